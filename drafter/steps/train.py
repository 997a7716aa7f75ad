"""The train step: the EAGLE-3 drafter with training-time test (TTT), offline or online.

Reads   vocab/vocab.safetensors (d2t, t2d), the target's config and input embeddings, and
        offline: extract/{train,val}/ shards and extract/head.safetensors (store.Reader);
        online (train.online): tokenize/{train,val}.parquet and the target itself (capture).
Writes  train/step_NNNNNN/  model.safetensors + drafter_config.json (model.save_drafter),
                            optimizer.pt, rng.safetensors, state.json, COMPLETE (written last)
        train/metrics.jsonl one record per log interval ("train") and validation ("val")
        train/tb/           TensorBoard events (train.tensorboard)

    drafter train CONFIG [train.lr=3e-4 ...]
    torchrun --nproc-per-node 8 -m drafter.cli train CONFIG [train.fsdp=true]

Data. Samples are taken in id order (so offline shards and online capture agree), shuffled with
train.seed, and packed first-fit into rows of train.max_length tokens (a longer sample keeps its
first max_length tokens); attention never crosses samples and positions restart in each. Each
epoch shuffles the rows again and groups them into micro-batches of batch_tokens // max_length
rows. Optimizer step s, accumulation a, rank r takes micro-batch (s·grad_accum + a)·world + r,
so 2 ranks × 1 equals 1 rank × accumulation 2 (tests/test_train.py).

Loss. Σ over TTT steps i of ttt_decay^i · (soft cross-entropy summed over the positions of
step i in the loss), divided by the positions of step 0 in the loss over the whole optimizer step
(all micro-batches, all ranks). Gradients are scaled after backward, so accumulation and ranks
need no count in advance. Metrics per TTT step, over the positions whose predicted token is in
the loss mask: acc (drafter argmax = teacher argmax; a teacher argmax outside the draft vocab is a
miss), accept (Σ min(p, q)), and sim_tau = 1 + Σ_i Π_{j<=i} acc_j: the acceptance length of a
greedy chain of ttt_steps drafts when acc_j is the acceptance of draft j given the earlier ones
(which TTT step j measures: its inputs are the true tokens); sim_tau_p uses accept (sampling).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import queue
import shutil
import threading
import time
from pathlib import Path

import torch

from .. import DrafterError, store, target, tokens
from ..config import ConfigError
from ..dist import Dist, all_sum, barrier, close_dist, dist_env
from ..model import Drafter, DrafterConfig, param_count, save_drafter
from ..rundir import JsonlAppender, Run, atomic_dir, atomic_json, read_json, read_jsonl, \
    remove_dir, safe_save_file
from ..ttt import TTT

log = logging.getLogger("drafter")


# -------------------------------------------------------------------------------------- data
class Source:
    """The samples of one split in id order: `lengths[i]`, `load([i, ...])` -> per-sample dicts
    (docs/internals.md). Offline from store.Reader; online through the target (capture)."""

    def __init__(self, ids: list[str], lengths: list[int], load):
        order = sorted(range(len(ids)), key=ids.__getitem__)
        self.ids = [ids[j] for j in order]
        self.lengths = [lengths[j] for j in order]
        self._order, self._load = order, load

    def __len__(self) -> int:
        return len(self.ids)

    def load(self, idx: list[int]) -> list[dict]:
        return self._load([self._order[i] for i in idx])

    @classmethod
    def offline(cls, reader) -> "Source":
        return cls(reader.ids, reader.lengths, lambda idx: [reader[j] for j in idx])

    @classmethod
    def online(cls, path: Path, cap) -> "Source":
        import pyarrow.parquet as pq

        table = pq.read_table(str(path), columns=["id", "input_ids", "loss_mask", "num_tokens"])
        return cls(table.column("id").to_pylist(), table.column("num_tokens").to_pylist(),
                   lambda idx: cap(table.take(idx).select(["input_ids", "loss_mask"]).to_pylist()))

    @classmethod
    def memory(cls, samples: list[dict]) -> "Source":
        """Per-sample dicts already in memory (tests, benchmarks); ids are their positions."""
        return cls([f"{i:09d}" for i in range(len(samples))],
                   [len(s["input_ids"]) for s in samples], lambda idx: [samples[j] for j in idx])


def pack(lengths: list[int], T: int, seed: int, window: int = 16) -> list[list[int]]:
    """Sample indices -> rows of at most T tokens: seeded shuffle, then first-fit over the last
    `window` open rows (O(n·window); about 95% full when samples are much shorter than T)."""
    g = torch.Generator().manual_seed(seed)
    rows, open_rows = [], []                                          # open: [free tokens, items]
    for i in torch.randperm(len(lengths), generator=g).tolist():
        n = min(lengths[i], T)
        for r in open_rows:
            if r[0] >= n:
                r[0] -= n
                r[1].append(i)
                break
        else:
            if len(open_rows) == window:
                rows.append(open_rows.pop(0)[1])
            open_rows.append([T - n, [i]])
    return rows + [r[1] for r in open_rows]


def epoch_micro_batches(rows: list[list[int]], B: int, seed: int, epoch: int) -> list[list]:
    """The epoch's micro-batches: rows shuffled with (seed, epoch), B at a time."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch + 1)
    order = torch.randperm(len(rows), generator=g).tolist()
    return [[rows[j] for j in order[a:a + B]] for a in range(0, len(order), B)]


def collate(rows: list[list[dict]], B: int, T: int) -> dict:
    """Samples packed into B rows of T tokens (row b holds rows[b] in order; missing rows are
    padding): input_ids, loss_mask, in_vocab, seq_id (-1 = padding), position_ids [B, T];
    aux [B, T, L, Ht]; teacher_hidden [B, T, Ht] or teacher_topk_ids/_logp [B, T, k]."""
    first = rows[0][0]
    dev = first["aux"].device
    pin = dev.type == "cpu" and torch.cuda.is_available()

    def new(shape, dtype, fill=0):
        return torch.full(shape, fill, dtype=dtype, device=dev, pin_memory=pin)

    out = {"input_ids": new((B, T), torch.long), "loss_mask": new((B, T), torch.long),
           "in_vocab": new((B, T), torch.bool), "seq_id": new((B, T), torch.long, -1),
           "position_ids": new((B, T), torch.long),
           "aux": new((B, T, *first["aux"].shape[1:]), first["aux"].dtype)}
    teacher = [k for k in ("teacher_hidden", "teacher_topk_ids", "teacher_topk_logp") if k in first]
    for k in teacher:
        fill = -math.inf if k == "teacher_topk_logp" else 0
        out[k] = new((B, T, first[k].shape[-1]), first[k].dtype, fill)
    for b, row in enumerate(rows):
        o = 0
        for j, s in enumerate(row):
            n = min(len(s["input_ids"]), T - o)
            for k in ("input_ids", "loss_mask", "in_vocab", "aux", *teacher):
                out[k][b, o:o + n] = s[k][:n]
            out["seq_id"][b, o:o + n] = j
            out["position_ids"][b, o:o + n] = torch.arange(n)
            o += n
    return out


def align(seq_id: torch.Tensor, loss_mask: torch.Tensor, in_vocab: torch.Tensor, steps: int,
          decay: float) -> dict:
    """THE alignment (docs/internals.md), written once. Drafter position t at TTT step i embeds
    token t+1+i (src), learns the teacher at t+1+i (the target's distribution over token t+2+i),
    and counts in the loss when token t+2+i is in t's sample, loss_mask[t+2+i] == 1 (an
    assistant token: the first assistant token is trained, by position t = first-2) and
    in_vocab[t+1+i]. Inputs [B, T]. Returns
        src [K, B, T]   the position whose token step i embeds (clamped at the row end: masked)
        rows [N]        flat indices into [K, B, T] of the positions in the loss
        trows [N]       their teacher rows, flat indices into [B, T]
        weights [N]     decay**i;  row_step [N] their step i
        n_valid [K], n_lm [K]  positions in the loss, and with loss_mask alone (the denominator
                        of acc/accept: out-of-vocab teacher argmaxes count as misses)."""
    B, T = seq_id.shape
    dev = seq_id.device
    t = torch.arange(T, device=dev).expand(B, T)
    src, valid, lm = [], [], []
    for i in range(steps):
        s = (t + 1 + i).clamp(max=T - 1)                                  # [B, T]
        nxt = (t + 2 + i).clamp(max=T - 1)
        same = (t + 2 + i < T) & (seq_id.gather(1, nxt) == seq_id) & (seq_id >= 0)
        m = same & loss_mask.gather(1, nxt).bool()
        src.append(s)
        lm.append(m)
        valid.append(m & in_vocab.gather(1, s))
    src, valid, lm = torch.stack(src), torch.stack(valid), torch.stack(lm)  # [K, B, T]
    rows = valid.reshape(-1).nonzero().squeeze(-1)                         # [N]
    row_step = rows // (B * T)
    base = torch.arange(B, device=dev)[:, None] * T
    trows = (src + base).reshape(-1)[rows]
    weights = torch.tensor([decay ** i for i in range(steps)], device=dev)[row_step]
    return {"src": src, "rows": rows, "trows": trows, "weights": weights, "row_step": row_step,
            "n_valid": valid.sum((1, 2)), "n_lm": lm.sum((1, 2))}


def host_batch(src: Source, rows: list[list[int]], B: int, T: int, tc, emb_table) -> dict:
    """One micro-batch, before the device: collated, aligned, embedded (the frozen table lives
    on the CPU, so only [B, T, H] crosses to the GPU)."""
    it = iter(src.load([i for r in rows for i in r]))
    out = collate([[next(it) for _ in r] for r in rows], B, T)
    out.update(align(out["seq_id"], out["loss_mask"], out["in_vocab"], tc.ttt_steps,
                     tc.ttt_decay))
    out["emb"] = emb_table[out["input_ids"].cpu()]                       # [B, T, H]
    if torch.cuda.is_available():  # pinned: the copy to the GPU does not block this thread
        out["emb"] = out["emb"].pin_memory()
    out["tokens"] = int((out["seq_id"] >= 0).sum())
    return out


def device_batch(hb: dict, device, head, fused: bool) -> dict:
    """Model inputs on the device; the teacher as the loss wants it: dense log-probs from
    store.teacher_logprobs, or (fused loss) top-k as stored, never densified."""
    d = {k: v.to(device, non_blocking=True) for k, v in hb.items() if torch.is_tensor(v)}
    B, T = d["seq_id"].shape
    with torch.no_grad():
        if "teacher_hidden" in d:
            t = {"logp": store.teacher_logprobs({"teacher_hidden": d["teacher_hidden"]
                                                 .reshape(B * T, -1)}, head)}
        elif fused:
            t = {"ids": d["teacher_topk_ids"].reshape(B * T, -1),
                 "logp": d["teacher_topk_logp"].reshape(B * T, -1)}
        else:
            t = {"logp": store.teacher_logprobs(
                {"teacher_topk_ids": d["teacher_topk_ids"].reshape(B * T, -1),
                 "teacher_topk_logp": d["teacher_topk_logp"].reshape(B * T, -1)},
                head.weight.shape[0])}
    d["teacher"] = t
    d["tokens_t"] = hb["tokens"]
    return d


def model_inputs(d: dict) -> dict:
    return {k: d[k] for k in ("aux", "emb", "position_ids", "seq_id", "src", "rows", "trows",
                              "weights", "teacher")}


class Prefetch:
    """Builds host batches on a thread, `depth` ahead, in order; errors surface in next()."""

    def __init__(self, make, jobs, depth: int = 2):
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = False

        def loop():
            for job in jobs:
                if self.stop:
                    return
                try:
                    self.q.put((make(job), None))
                except BaseException as e:  # noqa: BLE001 - handed to the main thread
                    self.q.put((None, e))
                    return
        self.thread = threading.Thread(target=loop, name="train-prefetch", daemon=True)
        self.thread.start()

    def next(self):
        item, err = self.q.get()
        if err is not None:
            raise err
        return item

    def close(self):
        self.stop = True
        with contextlib.suppress(queue.Empty):
            while True:
                self.q.get_nowait()


# ------------------------------------------------------------------------------------- model
def target_embeddings(tcfg) -> torch.Tensor:
    """The target's input embeddings [V, Ht] read from its safetensors (no model load): the
    tensor of the module transformers calls the input embeddings, else a known name."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    spec = target.resolve(tcfg.model)
    folder = Path(spec)
    if not folder.is_dir():  # an HF id: the index, then only the shard that holds the table
        from huggingface_hub import snapshot_download
        folder = Path(snapshot_download(spec, revision=tcfg.revision, allow_patterns=["*.json"]))
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index)["weight_map"]
    elif (folder / "model.safetensors").exists():
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    else:
        weight_map = {}
    config = target.load_config(tcfg)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, trust_remote_code=tcfg.trust_remote_code)
    emb = meta.get_input_embeddings()
    names = [n + ".weight" for n, m in meta.named_modules() if m is emb]
    names += sorted((k for k in weight_map if k.endswith(
        ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "tok_embeddings.weight"))
        and "mtp" not in k and "vision" not in k), key=len)
    shape = tuple(emb.weight.shape)
    for name in names:
        if name in weight_map:
            file = folder / weight_map[name]
            if not file.exists():
                from huggingface_hub import hf_hub_download
                file = Path(hf_hub_download(spec, weight_map[name], revision=tcfg.revision))
            with safe_open(str(file), "pt") as f:
                w = f.get_tensor(name)
            if tuple(w.shape) == shape:
                return w
    log.info("train: embeddings not found by name in %s; loading the target to read them", spec)
    return target.load_model(tcfg, device="cpu").get_input_embeddings().weight.detach().clone()


def build_drafter(cfg, target_config, layer_ids, d2t, t2d, embeddings) -> Drafter:
    """The drafter shaped from the target (DrafterConfig.from_target), seeded init, the target's
    embeddings (frozen, kept at the target's dtype) and the vocab maps."""
    tc = cfg.train
    dcfg = DrafterConfig.from_target(
        target_config, draft_vocab_size=d2t.numel(), aux_layer_ids=list(layer_ids),
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


def lr_lambda(tc, total: int):
    warm = max(1, round(tc.warmup_ratio * total)) if tc.warmup_ratio > 0 else 0

    def f(step: int) -> float:  # linear warmup, then cosine down to min_lr_ratio
        if step < warm:
            return (step + 1) / warm
        x = min(1.0, (step - warm) / max(1, total - warm))
        return tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * x))
    return f


# ------------------------------------------------------------------------------- checkpoints
def full_state(ttt, opt, fsdp: bool) -> tuple[dict, dict]:
    """Model and optimizer state as full tensors on the CPU (gathered from FSDP shards)."""
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, \
            get_model_state_dict, get_optimizer_state_dict
        o = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(ttt, options=o), get_optimizer_state_dict(ttt, opt, options=o)
    return ttt.state_dict(), opt.state_dict()


def save_checkpoint(run: Run, d: Dist, step: int, drafter, ttt, opt, fsdp: bool,
                    state: dict) -> Path | None:
    """train/step_NNNNNN/, built under a temp name with COMPLETE written last, then renamed."""
    msd, osd = full_state(ttt, opt, fsdp)
    path = run.checkpoint(step)
    if d.main:
        with atomic_dir(path) as tmp:
            save_drafter(drafter, tmp, state_dict=msd)
            torch.save(osd, tmp / "optimizer.pt")
            rng = {"cpu": torch.get_rng_state()}
            if torch.cuda.is_available():
                rng["cuda"] = torch.cuda.get_rng_state(d.device)
            safe_save_file(rng, tmp / "rng.safetensors")
            atomic_json(tmp / "state.json", state)
            (tmp / "COMPLETE").write_text("ok\n")
    barrier(d)
    return path


def load_checkpoint(path: Path, d: Dist, ttt, opt, sched, fsdp: bool) -> dict:
    from safetensors.torch import load_file

    sd = load_file(str(path / "model.safetensors"))
    msd = {k: sd[k] for k in ttt.state_dict()}
    osd = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, \
            set_model_state_dict, set_optimizer_state_dict
        o = StateDictOptions(full_state_dict=True)
        set_model_state_dict(ttt, msd, options=o)
        set_optimizer_state_dict(ttt, opt, osd, options=o)
    else:
        ttt.load_state_dict(msd)
        opt.load_state_dict(osd)
    state = read_json(path / "state.json")
    sched.load_state_dict(state["scheduler"])
    rng = load_file(str(path / "rng.safetensors"))
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"], d.device)
    return state


def resume_from(run: Run, tc) -> Path | None:
    if tc.resume in ("off", False):
        return None
    if tc.resume in ("auto", True):
        done = run.checkpoints()
        return done[-1] if done else None
    p = Path(tc.resume)
    if not (p / "COMPLETE").exists():
        raise ConfigError(f"train.resume: {p} is not a complete checkpoint (no COMPLETE marker)")
    return p


def prune_checkpoints(run: Run, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints and the best by validation sim_tau."""
    done = run.checkpoints()
    scored = [(read_json(p / "state.json").get("val") or {}).get("sim_tau") for p in done]
    best = max((s, i) for i, s in enumerate(scored) if s is not None)[1] \
        if any(s is not None for s in scored) else None
    for i, p in enumerate(done[:-keep] if keep > 0 else done):
        if i != best:
            remove_dir(p)  # never a "complete" checkpoint with files missing after a kill


def best_checkpoint(run: Run) -> Path | None:
    scored = [(s, p) for p in run.checkpoints()
              if (s := (read_json(p / "state.json").get("val") or {}).get("sim_tau")) is not None]
    return max(scored)[1] if scored else None


# ----------------------------------------------------------------------------------- metrics
class Meter:
    """Per-TTT-step sums on the device (no host sync until `read`): ce, correct, accept,
    n_valid, n_lm [5, K], and real tokens."""

    def __init__(self, K: int, device):
        self.K, self.device = K, device
        self.reset()

    def reset(self):
        self.sums = torch.zeros(6, self.K, dtype=torch.float64, device=self.device)

    def add(self, out: dict, d: dict):
        idx = d["row_step"]
        for j, key in enumerate(("ce", "correct", "accept")):
            self.sums[j].index_add_(0, idx, out[key].detach().double())
        self.sums[3] += d["n_valid"]
        self.sums[4] += d["n_lm"]
        self.sums[5, 0] += d["tokens_t"]

    def read(self, dist: Dist, decay: float) -> dict:
        s = all_sum(self.sums.clone(), dist).tolist()
        self.reset()
        return summarize(s, decay)


def summarize(s: list[list[float]], decay: float) -> dict:
    ce, cor, acc_sum, nv, nl = s[:5]
    acc = [c / max(n, 1) for c, n in zip(cor, nl)]
    accept = [a / max(n, 1) for a, n in zip(acc_sum, nl)]

    def tau(a):
        out, run_prod = 1.0, 1.0
        for x in a:
            run_prod *= x
            out += run_prod
        return out
    return {"loss": sum(decay ** i * c for i, c in enumerate(ce)) / max(nv[0], 1),
            "ce": [c / max(n, 1) for c, n in zip(ce, nv)], "acc": acc, "accept": accept,
            "sim_tau": tau(acc), "sim_tau_p": tau(accept),
            "oov": 1 - nv[0] / nl[0] if nl[0] else 0.0, "positions": int(nv[0]),
            "tokens": int(s[5][0])}


def fmt_line(split: str, step: int, total: int, m: dict, extra: str = "") -> str:
    acc = " ".join(f"{a:.2f}" for a in m["acc"])
    return (f"train: {split} step {step}/{total} | loss {m['loss']:.4f} | acc {acc} | "
            f"tau {m['sim_tau']:.2f} (p {m['sim_tau_p']:.2f}) | oov {m['oov']:.1%}{extra}")


# -------------------------------------------------------------------------------------- loop
def _check(tc) -> None:
    for key, ok in (("ttt_steps", tc.ttt_steps >= 1), ("grad_accum", tc.grad_accum >= 1),
                    ("max_length", tc.max_length >= 4), ("log_every", tc.log_every >= 1),
                    ("save_every", tc.save_every >= 1), ("keep_checkpoints",
                                                         tc.keep_checkpoints >= 1),
                    ("ttt_decay", tc.ttt_decay > 0), ("epochs", tc.epochs >= 1)):
        if not ok:
            raise ConfigError(f"train.{key}: invalid value {getattr(tc, key)!r}")
    if tc.batch_tokens < tc.max_length:
        raise ConfigError(f"train.batch_tokens ({tc.batch_tokens}) must be at least "
                          f"train.max_length ({tc.max_length}): a micro-batch holds whole rows")


def fit(cfg, run: Run, dist: Dist, drafter: Drafter, train_src: Source,
        val_src: Source | None, head) -> dict:
    """The training loop: plain PyTorch, top to bottom. Returns the manifest extras."""
    tc = cfg.train
    _check(tc)
    dev, cuda = dist.device, dist.device.type == "cuda"
    amp = torch.bfloat16 if (tc.dtype == "bfloat16" or (tc.dtype == "auto" and cuda)) else None
    attention = pick_attention(tc, dev)
    fused = attention == "flex"
    K, T = tc.ttt_steps, tc.max_length
    B = tc.batch_tokens // T
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    head = head.to(dev)

    ttt, model, opt = setup_model(drafter, tc, dist, attention)
    params = [p for p in ttt.parameters() if p.requires_grad]
    fsdp = tc.fsdp and dist.world > 1

    # data plan
    rows = pack(train_src.lengths, T, tc.seed)
    n_micro = math.ceil(len(rows) / B)
    per_step = dist.world * tc.grad_accum
    steps_per_epoch = n_micro // per_step
    if steps_per_epoch == 0:
        raise DrafterError(f"train: {len(train_src)} samples make {n_micro} micro-batches of "
                           f"{B} rows × {T} tokens, fewer than world size × grad_accum = "
                           f"{per_step}: lower train.batch_tokens or train.max_length")
    total = tc.max_steps or tc.epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(tc, total))

    # resume
    step, metrics_path, metrics, tb = 0, run.train_metrics(), None, None
    ckpt = resume_from(run, tc)
    if ckpt is not None:
        step = load_checkpoint(ckpt, dist, ttt, opt, sched, fsdp)["step"]
        log.info("train: resumed from %s (step %d)", ckpt, step)
    if dist.main:  # the metrics of steps after the checkpoint are redone
        for pattern in (".tmp-step_*", ".old-step_*"):  # what a kill in a save or prune leaves
            for junk in run.step_dir("train").glob(pattern):
                shutil.rmtree(junk, ignore_errors=True)
        kept = [r for r in read_jsonl(metrics_path, repair=True) if r.get("step", 0) <= step]
        atomic_json_lines(metrics_path, kept)
        metrics = JsonlAppender(metrics_path)
        tb = tensorboard_writer(run, step) if tc.tensorboard else None
        log.info("train: drafter %s trainable params, H=%d, Vd=%d, K=%d, %s attention, "
                 "%d rows/micro-batch × %d tokens, %d micro-batches/epoch, %d steps "
                 "(%d/epoch), world %d%s", f"{param_count(drafter):,}", drafter.cfg.hidden_size,
                 drafter.cfg.draft_vocab_size, K, attention, B, T, n_micro, total,
                 steps_per_epoch, dist.world, " fsdp" if fsdp else "")

    def jobs(from_step):  # this rank's micro-batches from a step on (the data position)
        plan = (None, None)
        for s in range(from_step, total):
            epoch, k = divmod(s, steps_per_epoch)
            if plan[0] != epoch:
                plan = (epoch, epoch_micro_batches(rows, B, tc.seed, epoch))
            for a in range(tc.grad_accum):
                yield plan[1][(k * tc.grad_accum + a) * dist.world + dist.rank]

    make = lambda r: host_batch(train_src, r, B, T, tc, drafter.embed_tokens.weight)  # noqa
    feed = Prefetch(make, jobs(step)) if not tc.online else None
    it = jobs(step)
    meter, val, last_val, last_train = Meter(K, dev), None, None, None
    t_log = time.perf_counter()
    autocast = torch.autocast(dev.type, dtype=amp) if amp else contextlib.nullcontext()
    first, t_start, tokens_total = step, time.perf_counter(), 0
    try:
        while step < total:
            micro = (device_batch(feed.next() if feed else make(next(it)), dev, head, fused)
                     for _ in range(tc.grad_accum))
            gnorm = train_step(model, params, opt, micro, tc, dist, autocast, meter)
            sched.step()
            step += 1

            if step % tc.log_every == 0 or step == total:
                m = meter.read(dist, tc.ttt_decay)
                now = time.perf_counter()
                tok_s = m["tokens"] / max(now - t_log, 1e-9)
                tokens_total += m["tokens"]
                t_log = now
                m.update(step=step, epoch=step / steps_per_epoch, split="train",
                         lr=sched.get_last_lr()[0], grad_norm=float(gnorm),
                         tokens_per_s=round(tok_s, 1), time=time.time())
                if cuda:
                    m["mem_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
                if dist.main:
                    eta = (total - step) * (now - t_start) / max(step - first, 1)
                    log.info("%s", fmt_line("train", step, total, m,
                                            f" | lr {m['lr']:.2e} | gnorm {m['grad_norm']:.2f} "
                                            f"| {tok_s / 1e3:.1f}k tok/s | eta {eta / 60:.1f}m"))
                    metrics.write(m)
                    if tb:
                        tb_write(tb, "train", step, m)
                last_train = m
            save = step % tc.save_every == 0 or step == total
            if val_src is not None and ((tc.eval_every and step % tc.eval_every == 0) or save):
                val = evaluate(model, val_src, dist, drafter, head, tc, B, T, fused, autocast)
                val.update(step=step, split="val", time=time.time())
                last_val = val
                if dist.main:
                    log.info("%s", fmt_line("val", step, total, val))
                    metrics.write(val)
                    if tb:
                        tb_write(tb, "val", step, val)
            if save:
                state = {"step": step, "epoch": step // steps_per_epoch,
                         "epoch_step": step % steps_per_epoch, "micro_batch": step * per_step,
                         "val": val if val is not None and val["step"] == step else None,
                         "train": last_train, "scheduler": sched.state_dict(),
                         "world_size": dist.world, "grad_accum": tc.grad_accum,
                         "drafter_config": drafter.cfg.to_dict()}
                save_checkpoint(run, dist, step, drafter, ttt, opt, fsdp, state)
                if dist.main:
                    prune_checkpoints(run, tc.keep_checkpoints)
    finally:
        if feed:
            feed.close()
        if metrics:
            metrics.close()
        if tb:
            tb.close()
    elapsed = time.perf_counter() - t_start
    best = best_checkpoint(run)
    return {
        "counts": {"steps": step, "epochs": round(step / steps_per_epoch, 3),
                   "train_samples": len(train_src), "train_tokens": sum(train_src.lengths),
                   "val_samples": len(val_src) if val_src is not None else 0,
                   "tokens_seen": tokens_total,
                   "truncated_samples": sum(n > T for n in train_src.lengths),
                   "dropped_micro_batches_per_epoch": n_micro - steps_per_epoch * per_step},
        "final_step": step, "train": last_train if step > first else None, "val": last_val,
        "tokens_per_s": round(tokens_total / max(elapsed, 1e-9), 1) if step > first else None,
        "drafter_config": drafter.cfg.to_dict(), "attention": attention,
        "world_size": dist.world, "fsdp": fsdp,
        "last_checkpoint": str(run.checkpoints()[-1]) if run.checkpoints() else None,
        "best_checkpoint": str(best) if best else None,
    }


def pick_attention(tc, device) -> str:
    if tc.attention == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if tc.attention == "flex" and device.type != "cuda":
        raise ConfigError("train.attention=flex needs a CUDA GPU (FlexAttention has no "
                          "backward on the CPU): use sdpa or auto")
    return tc.attention


def setup_model(drafter: Drafter, tc, dist: Dist, attention: str):
    """The trainable modules on the device (the embeddings stay on the CPU), wrapped for the
    ranks (DDP, or FSDP2 with train.fsdp), and AdamW over them. -> (ttt, model, optimizer)."""
    dev, cuda = dist.device, dist.device.type == "cuda"
    ttt = TTT(drafter, attention=attention, compile=tc.compile and cuda).to(dev)
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
    params = [p for p in ttt.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay,
                            fused=cuda and not (tc.fsdp and dist.world > 1))
    return ttt, model, opt


def train_step(model, params, opt, micro, tc, dist: Dist, autocast, meter=None):
    """One optimizer step over `micro` (grad_accum device batches, made one at a time).
    Returns the gradient norm before clipping (a device tensor: no host sync)."""
    fsdp = tc.fsdp and dist.world > 1
    n0 = torch.zeros((), dtype=torch.float64, device=dist.device)
    for a, d in enumerate(micro):
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
            out["loss"].backward()
        if meter is not None:
            meter.add(out, d)
    # grads hold Σ over this rank's rows, averaged over ranks: make them Σ / N0
    scale = dist.world / all_sum(n0, dist).clamp(min=1)
    grads = [p.grad for p in params if p.grad is not None]
    torch._foreach_mul_(grads, float(scale) if fsdp else scale.to(grads[0].dtype))
    gnorm = torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return gnorm


@torch.no_grad()
def evaluate(model, src: Source, dist: Dist, drafter, head, tc, B, T, fused, autocast) -> dict:
    """Metrics over the validation split (capped by train.eval_batches), spread over ranks;
    every rank runs the same number of forwards (FSDP needs it), the spare ones empty."""
    rows = pack(src.lengths, T, tc.seed)
    mbs = [rows[a:a + B] for a in range(0, len(rows), B)][:tc.eval_batches or None]
    meter = Meter(tc.ttt_steps, dist.device)
    for j in range(math.ceil(len(mbs) / dist.world)):
        i = j * dist.world + dist.rank  # past the end: a repeat whose numbers are dropped
        hb = host_batch(src, mbs[min(i, len(mbs) - 1)], B, T, tc, drafter.embed_tokens.weight)
        d = device_batch(hb, dist.device, head, fused)
        with autocast:
            out = model(**model_inputs(d))
        if i < len(mbs):
            meter.add(out, d)
    return meter.read(dist, tc.ttt_decay)


def atomic_json_lines(path: Path, records: list[dict]) -> None:
    from ..rundir import atomic_write
    atomic_write(path, "".join(json.dumps(r) + "\n" for r in records))


def tensorboard_writer(run: Run, step: int):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise DrafterError("train.tensorboard: needs the tensorboard package: "
                           "pip install 'drafter[tensorboard]'") from None
    return SummaryWriter(str(run.tensorboard()), purge_step=step + 1 if step else None)


def tb_write(tb, split: str, step: int, m: dict) -> None:
    for key in ("loss", "sim_tau", "sim_tau_p", "oov", "lr", "grad_norm", "tokens_per_s"):
        if key in m:
            tb.add_scalar(f"{split}/{key}", m[key], step)
    for key in ("acc", "accept", "ce"):
        for i, x in enumerate(m[key]):
            tb.add_scalar(f"{split}/{key}_{i}", x, step)


# -------------------------------------------------------------------------------------- main
def main(cfg) -> dict:
    dist = dist_env()
    try:
        return _main(cfg, dist)
    finally:
        close_dist()


def _main(cfg, dist: Dist) -> dict:
    run, tc = Run.of(cfg), cfg.train
    _check(tc)
    d2t, t2d, _ = tokens.load_vocab(run.require(run.vocab(), "vocab"))
    target_config = target.load_config(cfg.target)
    if tc.online:
        from ..capture import load_capture
        cap = load_capture(cfg, device=str(dist.device))
        layer_ids, head = cap.layer_ids, cap.head
        train_src = Source.online(run.require(run.tokens("train"), "tokenize"), cap)
        val_path = run.tokens("val")
        val_src = Source.online(val_path, cap) if val_path.exists() and \
            tokens.num_rows(val_path) else None
    else:
        reader = store.Reader(run, "train")
        layer_ids, head = reader.info["layer_ids"], reader.head()
        train_src = Source.offline(reader)
        val_src = None
        if run.shard_index("val").exists():
            vr = store.Reader(run, "val")
            val_src = Source.offline(vr) if len(vr) else None
    embeddings = target_embeddings(cfg.target)  # from its files in both modes: the same table
    drafter = build_drafter(cfg, target_config, layer_ids, d2t, t2d, embeddings)
    out = fit(cfg, run, dist, drafter, train_src, val_src, head)
    out["target"] = target.resolve(cfg.target.model)
    return out
