"""One optimizer step of the drafter, and what it needs: the drafter shaped from the target
(`build_drafter`: train and drafter/train/precompile.py build it alike), the attention path for a
device (`pick_attention`), the TTT module on the device wrapped for the ranks with its optimizer
(`setup_model`: AdamW or Muon, drafter/train/optim.py), and the step itself (`train_step`:
forward and backward over the micro-batches, gradients scaled to the step's loss positions,
clipped, the optimizer's step). The train step's loop
(drafter/steps/train.py) and benchmarks/train_throughput.py both call these, so the benchmark
times exactly what training runs.
"""
from __future__ import annotations

import contextlib
import gc
import time

import torch

from drafter import DrafterError
from drafter.core.config import ConfigError
from drafter.core.dist import Dist, all_sum
from drafter.train import optim
from drafter.train.batches import model_inputs
from drafter.train.dspark import DSpark, DSparkConfig
from drafter.train.dspark_objective import BlockTrain
from drafter.train.losses import Objective
from drafter.train.model import Drafter, DrafterConfig, draft_layer_for
from drafter.train.ttt import TTT

# Warm-up = the train time of a process's first 10 optimizer steps (compiles included): the aim
# is <= 30 s, and the benchmark reports the same span.
WARMUP_STEPS = 10
# Offline, threads that build micro-batches from the store ahead of the step (batches.Prefetch):
# one fell behind the step on a GPU; the real runs of BENCHMARKS.md#training ran with 4.
LOADER_THREADS = 4


def build_drafter(cfg, target_config, layer_ids, d2t, t2d, embeddings, head=None):
    """The drafter train.method names, shaped from the target (DrafterConfig.from_target, or
    DSparkConfig.from_target for dflash / dspark), seeded init, the target's embeddings
    (frozen, kept at the target's dtype) and the vocab maps; a block drafter's lm_head starts
    from `head`, the target's rows of the draft vocab, where the widths match."""
    tc = cfg.train
    if tc.method != "eagle3":
        return _build_block(cfg, target_config, layer_ids, d2t, t2d, embeddings, head)
    dcfg = DrafterConfig.from_target(
        target_config, draft_vocab_size=d2t.numel(), aux_layer_ids=list(layer_ids),
        draft_layer=draft_layer_for(tc.draft_layer, target_config), mla=tc.mla,
        intermediate_size=tc.intermediate_size, norm_before_residual=tc.norm_before_residual,
        fc_norm=tc.fc_norm, norm_output=tc.norm_output)
    if tuple(embeddings.shape) != (dcfg.vocab_size, dcfg.hidden_size):
        raise DrafterError(f"target embeddings are {tuple(embeddings.shape)}, expected "
                           f"({dcfg.vocab_size}, {dcfg.hidden_size}) from its config")
    torch.manual_seed(tc.seed)
    drafter = Drafter(dcfg)
    drafter.embed_tokens.to(embeddings.dtype)
    drafter.set_embeddings(embeddings)
    drafter.set_vocab(d2t, t2d)
    return drafter


def _build_block(cfg, target_config, layer_ids, d2t, t2d, embeddings, head) -> DSpark:
    bc = cfg.train.dspark
    vocab = embeddings.shape[0]
    mask = bc.mask_token_id if bc.mask_token_id is not None else vocab - 1
    if not 0 <= mask < vocab:
        raise ConfigError(f"train.dspark.mask_token_id: {mask} is outside the target vocab "
                          f"(0..{vocab - 1})")
    dcfg = DSparkConfig.from_target(
        target_config, cfg.train.method, d2t.numel(), list(layer_ids), bc.block_size, mask,
        bc.layers, markov_rank=bc.markov_rank, confidence_head=bc.confidence_head,
        intermediate_size=cfg.train.intermediate_size)
    if tuple(embeddings.shape) != (dcfg.vocab_size, dcfg.hidden_size):
        raise DrafterError(f"target embeddings are {tuple(embeddings.shape)}, expected "
                           f"({dcfg.vocab_size}, {dcfg.hidden_size}) from its config")
    torch.manual_seed(cfg.train.seed)
    model = DSpark(dcfg)
    model.embed_tokens.to(embeddings.dtype)
    model.set_embeddings(embeddings)
    model.set_vocab(d2t, t2d)
    if head is not None:
        model.set_head(head.weight)
    return model


def positions(tc) -> int:
    """The draft positions the metrics count: TTT steps (eagle3), or a block's drafts."""
    return tc.ttt_steps if tc.method == "eagle3" else tc.dspark.block_size


def sync_device(device) -> None:
    """Wait for the device's queued work (timing points; a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process: constant after warm-up unless something
    recompiles (a recompile storm: one graph per new loss-row count until recompile_limit)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def compile_stats() -> dict:
    """What torch.compile has cost this process so far (where a warm-up goes): the
    seconds dynamo spent compiling frames (their forward graphs, AOTAutograd and Inductor
    inside) and backward graphs (compiled at their first backward), the graphs built, and the
    hits and misses of Inductor's FX graph cache and AOTAutograd's cache (on disk under
    TORCHINDUCTOR_CACHE_DIR, default /tmp/torchinductor_$USER: a second run on one machine
    hits them), `frames`: each compile in order (compile_frames), and `saved`: the pieces loaded
    or saved whole, with their seconds (drafter/train/aot.py; those take no dynamo time)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    from drafter.train.aot import report

    seconds = sum(sum(compilation_time_metrics.get(k, ()))
                  for k in ("_compile.compile_inner", "backward._backward_impl"))
    ind, aot = counters["inductor"], counters["aot_autograd"]
    return {"seconds": round(seconds, 3), "graphs": compiled_graphs(),
            "fx_graph_cache": {"hits": int(ind["fxgraph_cache_hit"]),
                               "misses": int(ind["fxgraph_cache_miss"])},
            "aot_autograd_cache": {"hits": int(aot["autograd_cache_hit"]),
                                   "misses": int(aot["autograd_cache_miss"])},
            "frames": compile_frames(), "saved": report()}


def compile_frames() -> list[dict]:
    """Each compile dynamo has recorded in this process, in order (torch's own per-compile
    metrics): {"graph": the compiled function's name, "pass": forward or backward, "seconds":
    the whole compile, "inductor_s": of it, Inductor's (code generation, or loading from its
    cache)}. A forward's seconds include its tracing, AOTAutograd and Inductor; the first
    compile of a process also pays for loading Inductor itself. "pass": "first run" is the work
    torch timed while a compiled graph first ran, after its compile (Triton autotuning its
    kernels where the autotune cache is cold). torch records it as a runtime record of that
    graph with no function name; read as a forward, it showed as a 0-second frame named by its
    compile id ("0/0") and renamed the graph's backward (in every cold run). A torch
    without these metrics gives []."""
    try:
        from torch._dynamo.utils import get_compilation_metrics
        records = list(get_compilation_metrics())
    except (ImportError, AttributeError):
        return []
    names, out = {}, []
    for m in records:
        cid, fwd = str(getattr(m, "compile_id", "")), getattr(m, "is_forward", True) is not False
        if getattr(m, "is_runtime", None):
            us = getattr(m, "duration_us", None) or 0
            out.append({"graph": names.get(cid, cid), "pass": "first run",
                        "seconds": round(us / 1e6, 3), "inductor_s": 0.0})
            continue
        if fwd:
            names[cid] = getattr(m, "co_name", None) or cid
            s = getattr(m, "entire_frame_compile_time_s", None)
        else:
            us = getattr(m, "backward_cumulative_compile_time_us", None)
            s = us / 1e6 if us is not None else None
        out.append({"graph": names.get(cid, cid), "pass": "forward" if fwd else "backward",
                    "seconds": round(s or 0.0, 3),
                    "inductor_s": round(getattr(m, "inductor_compile_time_s", None) or 0.0, 3)})
    return out


@contextlib.contextmanager
def compiles_hold(lock):
    """Hold `lock` (online training: the capture's, taken around every target forward) while
    torch.compile compiles, so that no target forward runs on the prefetch thread meanwhile.
    Compilation traces with torch.fx tracers, which patch torch.nn.Module.__call__ for the whole
    process while they run (inductor lowers FlexAttention's mask and score subgraphs with one);
    a target layer called on another thread in that window goes through the patch and fails
    with "NameError: module is not installed as a submodule" (seen once, in a long-row run's
    warm-up). Dynamo's compile callbacks mark the span; without them (a torch
    that lacks the module) this does nothing."""
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:  # pragma: no cover - every supported torch has it
        yield
        return

    def start(*_):
        lock.acquire()

    def end(*_):
        lock.release()

    callback_handler.register_start_callback(start)
    callback_handler.register_end_callback(end)
    try:
        yield
    finally:
        callback_handler.remove_start_callback(start)
        callback_handler.remove_end_callback(end)


def device_setup(tc, device):
    """What train sets for the device before the model: TF32 matmuls on a GPU (a setting that
    Inductor's cache keys hold: drafter/train/precompile.py must set it as train does), and the
    Triton cache of drafter's own kernels (aot.share_triton_cache: the one precompile filled).
    Returns the autocast dtype: bfloat16 on a GPU under dtype auto, else None (float32)."""
    cuda = device.type == "cuda"
    if cuda:
        from drafter.train.aot import share_triton_cache
        torch.backends.cuda.matmul.allow_tf32 = True
        share_triton_cache(torch.cuda.current_device() if device.index is None else device.index)
    return torch.bfloat16 if (tc.dtype == "bfloat16" or (tc.dtype == "auto" and cuda)) else None


def pick_attention(tc, device) -> str:
    if tc.attention == "auto":  # block drafters: SDPA over the dense block mask, until their
        # FlexAttention path is checked against it on a GPU (docs/train.md, "The drafter kind")
        return "flex" if device.type == "cuda" and tc.method == "eagle3" else "sdpa"
    if tc.attention == "flex" and device.type != "cuda":
        raise ConfigError("train.attention=flex needs a CUDA GPU (FlexAttention has no "
                          "backward on the CPU): use sdpa or auto")
    return tc.attention


def setup_model(drafter: Drafter, tc, dist: Dist, attention: str, obj: Objective,
                saved: str = "load"):
    """The trainable modules on the device (the embeddings stay on the CPU), wrapped for the
    ranks (DDP, or FSDP2 with train.fsdp), and train.optimizer over them (drafter/train/optim.py).
    obj: the loss (drafter/train/losses.objective(cfg): no default, as the kinds' differ);
    train.noise on the aux states while
    training. -> (ttt, model, optimizer).
    saved: what the compiled pieces do with the saved whole graphs (drafter/train/aot.py): "load"
    (train), "save" (precompile); "off" under train.fsdp (sharded parameters are not what a
    single-GPU precompile traced: precompile then fills Inductor's cache for the pieces as
    before, as train will run them)."""
    dev, cuda = dist.device, dist.device.type == "cuda"
    if tc.fsdp:
        saved = "off"
    if isinstance(drafter, DSpark):
        ttt = BlockTrain(drafter, fused=attention == "flex", loss_chunk=tc.loss_chunk,
                         flex=attention == "flex", obj=obj, noise=tc.noise).to(dev)
    else:
        ttt = TTT(drafter, attention=attention, compile=tc.compile and cuda,
                  loss_chunk=tc.loss_chunk, saved=saved, obj=obj, noise=tc.noise).to(dev)
    if dist.world > 1 and tc.fsdp:
        # One unit: the one layer runs K times forward and backward, so its weights stay
        # gathered for the whole step (ZeRO-2); gradients and AdamW state are sharded.
        from torch.distributed.fsdp import fully_shard
        model = fully_shard(ttt, reshard_after_forward=False)
    elif dist.world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(ttt, device_ids=[dev.index] if cuda else None)
    else:
        model = ttt
    opt = optim.build(ttt.named_parameters(), tc,
                      fused=cuda and not (tc.fsdp and dist.world > 1))
    return ttt, model, opt


def trained_with(tc, obj: Objective) -> dict:
    """What the drafter was trained to minimise and how: checkpoints' state.json and train's
    manifest ("objective"); export names it in the READMEs and drafter.json."""
    return {**obj.to_dict(), "ttt_decay": tc.ttt_decay, "noise": tc.noise,
            "optimizer": tc.optimizer,
            **({"muon_lr": tc.muon_lr or tc.lr} if tc.optimizer == "muon" else {})}


def train_step(model, params, opt, micro, tc, dist: Dist, autocast, meter=None,
               phases: dict | None = None):
    """One optimizer step over `micro` (grad_accum device batches, made one at a time).
    Returns the gradient norm before clipping (a device tensor: no host sync). `phases`, a
    dict: the step is timed in parts, the device waited for after each (Phases): where a
    process's first step goes."""
    fsdp = tc.fsdp and dist.world > 1
    clock = Phases(phases, dist.device)
    n0 = torch.zeros((), dtype=torch.float64, device=dist.device)
    for a, d in enumerate(micro):
        clock.tick("batch")  # the host batch waited for, and copied to the device
        n0 += d["n_valid"][0]
        last = a == tc.grad_accum - 1  # ranks sync gradients on the last one only
        sync = contextlib.nullcontext()
        if fsdp:
            model.set_requires_gradient_sync(last)
        elif dist.world > 1 and not last:
            sync = model.no_sync()
        with sync:
            with autocast:
                out = model(**model_inputs(d))
            clock.tick("forward")
            out["loss"].backward()
            clock.tick("backward")
        if meter is not None:
            meter.add(out, d)
    # grads hold Σ over this rank's rows, averaged over ranks: make them Σ / N0
    scale = dist.world / all_sum(n0, dist).clamp(min=1)
    grads = [p.grad for p in params if p.grad is not None]
    torch._foreach_mul_(grads, float(scale) if fsdp else scale.to(grads[0].dtype))
    gnorm = torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    clock.tick("optimizer")  # the metrics, scaling, clipping, the update
    return gnorm


class GcClock:
    """Python's garbage collections while it is open (gc.callbacks): seconds and count per
    generation, in all and since the last `interval()`. A full collection scans every object
    alive, and after the first step of a compiled train those are hundreds of thousands (torch's
    compiled graphs and caches): a pause of a step's length. `freeze()` moves every object alive
    now into Python's permanent generation (gc.freeze), which later collections skip: what the
    step loop creates is still collected. Train freezes after its first step and unfreezes when
    it ends, so full collections after the warm-up scan only what the loop made (train's
    manifest: `gc`). A collection runs on whichever thread triggered it; it stops them all."""

    def __init__(self, freeze: bool = True):
        self.seconds, self.count, self.since = [0.0, 0.0, 0.0], [0, 0, 0], 0.0
        self.froze, self.frozen, self._t = freeze, 0, None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            dt, g = time.perf_counter() - self._t, info["generation"]
            self.seconds[g] += dt
            self.count[g] += 1
            self.since += dt
            self._t = None

    def interval(self) -> float:
        """Seconds collecting since the last call."""
        s, self.since = self.since, 0.0
        return s

    def freeze(self) -> None:
        if self.froze:
            gc.freeze()
            self.frozen = gc.get_freeze_count()

    def summary(self) -> dict:
        return {"seconds": round(sum(self.seconds), 3),
                "seconds_by_generation": [round(s, 3) for s in self.seconds],
                "collections": list(self.count), "freeze": self.froze,
                "frozen_objects": self.frozen}

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        if self.froze:
            gc.unfreeze()


class Phases:
    """Seconds of a step's parts into `into` ({part: seconds}, summed over micro-batches), the
    device waited for at each tick; with `into` None it does nothing (steps after the first
    run unsynced). compile_stats says which of it torch.compile took. Train's setup is timed
    with one too (setup_parts_s)."""

    def __init__(self, into: dict | None, device):
        self.into, self.device = into, device
        self.t = time.perf_counter() if into is not None else 0.0

    def tick(self, part: str) -> None:
        if self.into is None:
            return
        sync_device(self.device)
        now = time.perf_counter()
        self.into[part] = self.into.get(part, 0.0) + now - self.t
        self.t = now
