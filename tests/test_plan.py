"""drafter plan: every printed number checked against arithmetic done here from the shapes, on
the weightless Kimi-K2.5-sized target (configs/plan-kimi-k2.5.yaml) and the embedded SmolLM2
GGUF; nothing may be loaded or written."""
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from drafter.core import config as C
from drafter.core.rundir import Run, atomic_json
from drafter.run import plan as P
from drafter.run.counts import PlanError
from drafter.train.memory import embed_dtype_bytes, train_gpu_bytes

REPO = Path(__file__).resolve().parents[1]
KIMI_YAML = REPO / "configs" / "plan-kimi-k2.5.yaml"
GiB = 2**30

# Kimi-K2.5 shapes (configs/kimi-k2.5/config.json), written out by hand.
V, H, L, I_DENSE, E, K, I_MOE = 163840, 7168, 61, 18432, 384, 8, 2048
NH, Q_LORA, KV_LORA, NOPE, ROPE, V_HEAD = 64, 1536, 512, 128, 64, 128


def kimi_params() -> tuple[int, int]:
    """(total, routed-expert) parameters of the DeepSeek-V3 layout: MLA attention, 1 dense layer,
    60 MoE layers of 384 routed + 1 shared expert, untied embeddings."""
    attn = (H * Q_LORA + Q_LORA + Q_LORA * NH * (NOPE + ROPE) + H * (KV_LORA + ROPE) + KV_LORA
            + KV_LORA * NH * (NOPE + V_HEAD) + NH * V_HEAD * H)
    routed_layer = E * 3 * H * I_MOE
    moe = routed_layer + 3 * H * I_MOE + E * H           # routed + shared expert + router
    total = 2 * V * H + H + L * (attn + 2 * H) + 3 * H * I_DENSE + (L - 1) * moe
    return total, (L - 1) * routed_layer


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """`drafter plan configs/plan-kimi-k2.5.yaml --json` as a user runs it, from the repo root,
    with an empty cache and a fresh run dir; the text output comes from a second render."""
    tmp = tmp_path_factory.mktemp("plan")
    run_dir = tmp / "run"
    env = {**os.environ, "DRAFTER_CACHE": str(tmp / "cache")}
    out = subprocess.run([sys.executable, "-m", "drafter.cli", "plan", str(KIMI_YAML.relative_to(
        REPO)), f"run_dir={run_dir}", "--json"], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # nothing was loaded (there is nothing to load) and nothing written
    assert not run_dir.exists() and not (tmp / "cache").exists()
    return json.loads(out.stdout), run_dir


def test_kimi_target_and_data(kimi):
    plan, _ = kimi
    t = plan["target"]
    total, routed = kimi_params()
    assert (t["num_layers"], t["hidden_size"], t["vocab_size"], t["experts"],
            t["experts_per_token"], t["mla"]) == (L, H, V, E, K, True)
    assert t["params"] == total == 1_026_408_209_408   # "1.026T" in the config's comment
    assert t["routed_expert_params"] == routed
    assert t["active_params"] == total - routed + routed * K // E   # ~32.9 B, as published
    assert 32e9 < t["active_params"] < 34e9
    assert t["dtype"] == "bfloat16" and t["weights_bytes"] == total * 2
    assert t["weights_source"] == "no quantization_config: every weight at 16 bits"
    d = plan["data"]
    assert d["samples"] == 10_000 and d["val"]["samples"] == round(10_000 * 0.05)
    assert d["tokens"] == 10_000 * 2100 == 21_000_000
    assert d["train"]["tokens"] == 9_500 * 2100


def test_kimi_storage_bytes(kimi):
    plan, _ = kimi
    s = plan["storage"]
    tokens = 21_000_000
    ids = 4 + 1 + 1                        # input_ids int32, loss_mask, in_vocab
    expect = {("bf16", "hidden"): ids + 3 * H * 2 + H * 2,
              ("bf16", "topk"): ids + 3 * H * 2 + 64 * (2 + 2),      # int16 ids (Vd 32000) + fp16
              ("fp8", "hidden"): ids + 3 * H + 3 * 4 + H * 2,        # + fp32 scale per layer
              ("fp8", "topk"): ids + 3 * H + 3 * 4 + 64 * (2 + 2)}
    got = {(o["aux_dtype"], o["teacher"]): o for o in s["options"]}
    assert set(got) == set(expect)
    for key, bpt in expect.items():
        assert got[key]["bytes_per_token"] == bpt and got[key]["bytes"] == bpt * tokens
    assert [k for k, o in got.items() if o["chosen"]] == [("bf16", "hidden")]
    assert s["reference"] == {"bytes_per_token": 8 * H + 16, "bytes": (8 * H + 16) * tokens}
    assert plan["disk"]["extract"] == expect[("bf16", "hidden")] * tokens


def test_kimi_gpu_memory_refusal_and_warnings(kimi):
    plan, run_dir = kimi
    total, routed = kimi_params()
    g = plan["gpu_memory"]["extract"]
    # extract.tp=true over 8 GPUs: transformers' tp plan shards all but the routed experts, which
    # every rank holds whole; + activations of 16384 tokens (4 Ht + 3 I with I = max(dense
    # 18432, 8 experts * 2048)) + 4 captured states + a logits chunk, +25%
    w = (total - routed) * 2 // 8 + routed * 2
    act = 16384 * (4 * H + 3 * max(I_DENSE, K * I_MOE)) * 2
    cap = 16384 * 4 * H * 2
    logits = (1 << 30) * 3 // 2
    assert (g["weights"], g["activations"], g["capture"], g["logits"]) == (w, act, cap, logits)
    assert g["total"] == int((w + act + cap + logits) * 1.25) and g["tp"] == 8
    assert plan["target"]["routed_expert_bytes"] == routed * 2
    mem = 139.8 * GiB
    assert plan["gpus"] == {"count": 8, "memory": mem, "memory_source":
                            "config (plan.gpu_memory_gib)"}
    # a MoE under extract.tp is refused, in one line pointing at the vLLM path
    assert len(plan["refused"]) == 1
    why = plan["refused"][0]
    assert why.startswith("extract.tp:") and "384 routed experts" in why
    assert "extract.engine: vllm (docs/extract.md)" in why and "\n" not in why
    warns = plan["warnings"]
    # the refusal speaks for extract; evaluate (tp too) still warns, and says how many GPUs
    # the weights would need
    assert not [x for x in warns if x.startswith("GPU memory: extract")]
    need = math.ceil(total * 2 * 1.25 / (mem * 0.95))
    ev = [x for x in warns if x.startswith("GPU memory: evaluate")]
    assert len(ev) == 1 and f">= {need} GPUs" in ev[0] and need == 18
    assert "shards no routed experts" in ev[0] and "extract.tp=true" not in ev[0]   # a MoE
    # the disk warning fires exactly when this machine's free space is short
    free = shutil.disk_usage(next(p for p in run_dir.parents if p.exists())).free
    disk_need = plan["disk"]["total"]
    assert any(x.startswith("disk:") for x in warns) == (disk_need > free * 0.95)
    assert plan["disk"]["run_dir_free"] == pytest.approx(free, rel=0.01)
    text = P.render(plan)
    assert "refused" in text and why in text and "no warnings" not in text


def test_online_train_memory_counts_the_features_in_flight():
    """Online, train holds the captured features of 3 x train.online_group + 1 micro-batches
    (queued, being captured, in use): bf16 aux states and the teacher as capture returns it."""
    d = {"trainable": 10_000, "total": 30_000, "hidden_size": 64, "intermediate_size": 128,
         "draft_vocab_size": 512}
    base = ["train.batch_tokens=4096", "train.max_length=1024"]
    off = train_gpu_bytes(C.load(None, base), d, 1, ht=96)
    assert off["online_features"] == 0
    for teacher, per_token in (("hidden", 3 * 96 * 2 + 96 * 2), ("topk", 3 * 96 * 2 + 64 * 12)):
        for group in (1, 4):
            cfg = C.load(None, base + ["train.online=true", f"train.online_group={group}",
                                       f"extract.teacher={teacher}"])
            on = train_gpu_bytes(cfg, d, 1, ht=96)
            assert on["online_features"] == (3 * group + 1) * 4096 * per_token
            assert on["total"] == int((sum(off[k] for k in ("states", "activations",
                                                            "teacher"))
                                       + on["online_features"]) * 1.25)


def test_train_memory_keeps_the_frozen_embedding_on_the_host():
    """The frozen embedding table [V, H] stays on the CPU (setup_model moves only the trainable
    modules; host_batches looks the rows up there): it is no GPU byte but host memory at the
    dtype train holds it, while the batch's [tokens, H] embeddings that cross to the GPU are in
    the activations. By hand, for a bf16 and an fp32 table, on one GPU and 2 under FSDP."""
    V, Hd, Ht, I, Vd, trainable, tokens, K = 1000, 64, 96, 128, 512, 10_000, 4096, 7
    for emb_bytes in (2, 4):
        d = {"trainable": trainable, "total": trainable + V * Hd, "hidden_size": Hd,
             "intermediate_size": I, "draft_vocab_size": Vd, "embed_bytes": emb_bytes}
        for gpus, fsdp in ((1, "false"), (2, "true")):
            cfg = C.load(None, [f"train.batch_tokens={tokens}", "train.max_length=1024",
                                f"train.ttt_steps={K}", f"train.fsdp={fsdp}"])
            m = train_gpu_bytes(cfg, d, gpus, ht=Ht)
            states = trainable * 16 // gpus
            act = tokens * (K * (10 * Hd + 3 * I) + 3 * Ht) * 2 + tokens * Hd * emb_bytes
            teacher = tokens * Vd * 4
            assert m["host_embedding"] == V * Hd * emb_bytes
            assert (m["states"], m["activations"], m["teacher"]) == (states, act, teacher)
            assert m["total"] == int((states + act + teacher) * 1.25)   # no table in it
            assert "frozen" not in m
    # a shape without embed_bytes (benchmarks/train_throughput.py's): a bf16 table
    del d["embed_bytes"]
    assert train_gpu_bytes(cfg, d, 1, ht=Ht)["host_embedding"] == V * Hd * 2
    # drafter_shape's embed_bytes: the dtype config.json stores the checkpoint at
    from transformers import LlamaConfig
    assert [embed_dtype_bytes(LlamaConfig(dtype=t)) for t in ("float32", "bfloat16", None)] \
        == [4, 2, 2]


def test_kimi_train_memory(kimi):
    """The Kimi-K2.5 plan's train line: the GPU figure without the drafter's embedding table,
    which is printed as host memory at the checkpoint's bf16 (V x H x 2 bytes)."""
    plan, _ = kimi
    tr = plan["gpu_memory"]["train"]
    ds = plan["drafter"]
    assert ds["total"] - ds["trainable"] == V * H and ds["embed_bytes"] == 2
    assert tr["host_embedding"] == V * H * 2
    assert tr["total"] == int((tr["states"] + tr["activations"] + tr["teacher"]
                               + tr["online_features"]) * 1.25) + tr["target"]
    assert f"{tr['host_embedding'] / GiB:.1f} GiB host memory: the frozen embedding" \
        in P.render(plan)


def test_kimi_times(kimi):
    plan, _ = kimi
    total, routed = kimi_params()
    active = total - routed + routed * K // E
    rows = {r["step"]: r for r in plan["time"]}
    # prefill: 0.3 * 989 TFLOP/s per GPU over 2 FLOPs per active non-embedding weight, then
    # the token's stored bytes at plan.store_gbps = 0.5 GB/s, one after the other; 8 GPUs
    bpt = next(o["bytes_per_token"] for o in plan["storage"]["options"] if o["chosen"])
    per_gpu = 1 / (2 * (active - V * H) / (0.3 * 989e12) + bpt / 0.5e9)
    ex = rows["extract"]
    assert ex["source"] == "estimated" and ex["tokens"] == 21_000_000
    assert ex["tokens_per_s"] == pytest.approx(8 * per_gpu)
    assert ex["seconds"] == pytest.approx(21_000_000 / (8 * per_gpu))
    assert ex["load_seconds"] == pytest.approx(total * 2 / 2e9)   # plan.load_gbps = 2
    tr = rows["train"]
    assert tr["tokens"] == 2 * 9_500 * 2100                       # train.epochs = 2
    gen = rows["generate"]
    assert gen["tokens"] == 10_000 * 1700                         # answer_tokens_per_sample
    assert gen["seconds"] == pytest.approx(gen["tokens"] / gen["tokens_per_s"])


def test_extract_estimate_pays_for_what_it_stores(tmp_path, monkeypatch):
    """The smaller store is the faster extract, and a disk without cost gives back the
    forward's FLOP rate."""
    monkeypatch.chdir(REPO)
    rate = []
    for over in (["extract.aux_dtype=bf16", "extract.teacher=hidden"],
                 ["extract.aux_dtype=fp8", "extract.teacher=topk"],
                 ["extract.aux_dtype=fp8", "extract.teacher=topk", "plan.store_gbps=1e12"]):
        cfg = C.load(str(KIMI_YAML), [f"run_dir={tmp_path / 'run'}", *over])
        rows = {r["step"]: r for r in P.make_plan(cfg)["time"]}
        rate.append(rows["extract"]["tokens_per_s"])
    big, small, free = rate
    assert big < small < free
    total, routed = kimi_params()
    flop_rate = 8 * 0.3 * 989e12 / (2 * (total - routed + routed * K // E - V * H))
    assert free == pytest.approx(flop_rate, rel=1e-3)
    assert big == pytest.approx(1 / (1 / flop_rate + 57_350 / (8 * 0.5e9)), rel=1e-6)


def test_kimi_text_output(kimi):
    plan, _ = kimi
    text = P.render(plan)
    for needle in ["1,026,408,209,408 parameters", "21,000,000 tokens", "57,350 B/token",
                   "21,778 B/token", "reference 8*Ht+16", "57,360 B/token", "extract",
                   "MoE 384 experts (8 per token), MLA", "warnings"]:
        assert needle in text, needle


def test_measured_tokens_and_throughputs_win(tmp_path, monkeypatch):
    """With tokenize output and earlier manifests in the run dir, plan measures instead of
    estimating; measured tokens/s are scaled from the run's world size to plan.gpus."""
    from drafter.data.tokens import TokenWriter

    monkeypatch.chdir(REPO)
    cfg = C.load(KIMI_YAML, [f"run_dir={tmp_path}", "plan.train_tokens_per_s=1234"])
    run = Run.of(cfg)
    lengths = {"train": [5, 7, 9], "val": [4]}
    for split, ls in lengths.items():
        run.tokens(split).parent.mkdir(parents=True, exist_ok=True)
        w = TokenWriter(run.tokens(split))
        for i, n in enumerate(ls):
            w.write(f"{split}:{i}", list(range(n)), [0] * (n - 2) + [1, 1])
        w.close()
    atomic_json(run.manifest("extract"), {"tokens_per_s": 3000.0, "world_size": 2})
    atomic_json(run.manifest("generate"), {"throughput": {"completion_tokens_per_s": 512.0}})
    plan = P.make_plan(cfg)
    d = plan["data"]
    assert d["source"].startswith("measured")
    assert (d["train"]["samples"], d["train"]["tokens"], d["train"]["masked_tokens"]) == (3, 21, 6)
    assert (d["val"]["samples"], d["val"]["tokens"], d["tokens"]) == (1, 4, 25)
    rows = {r["step"]: r for r in plan["time"]}
    assert rows["extract"]["source"] == "measured"
    assert rows["extract"]["tokens_per_s"] == pytest.approx(3000.0 / 2 * 8)
    assert rows["generate"]["source"] == "measured" and rows["generate"]["tokens_per_s"] == 512.0
    assert rows["train"]["source"] == "config" and rows["train"]["tokens_per_s"] == 1234 * 8
    assert rows["train"]["tokens"] == 21 * 2
    opt = next(o for o in plan["storage"]["options"] if o["chosen"])
    assert opt["bytes"] == 25 * (6 + 8 * H)
    # train.max_steps wins over epochs: steps x batch tokens x accumulation x GPUs
    cfg = C.load(KIMI_YAML, [f"run_dir={tmp_path}", "train.max_steps=10", "train.grad_accum=2"])
    rows = {r["step"]: r for r in P.make_plan(cfg)["time"]}
    assert rows["train"]["tokens"] == 10 * 16384 * 2 * 8


def test_gguf_target_reads_metadata_only(tmp_path, monkeypatch):
    """The builtin SmolLM2 is a GGUF file: plan reads its header and never materialises it."""
    monkeypatch.setenv("DRAFTER_CACHE", str(tmp_path / "cache"))
    cfg = C.load(REPO / "configs" / "quickstart.yaml", [f"run_dir={tmp_path / 'run'}"])
    plan = P.make_plan(cfg)
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()
    t = plan["target"]
    assert "GGUF metadata" in t["source"] and t["gguf_bytes"] > 0
    # SmolLM2-135M: 30 layers, hidden 576, 9 heads / 3 kv heads of 64, MLP 1536, tied embeddings
    h, kv, i = 576, 3 * 64, 1536
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    assert t["params"] == 49152 * h + 30 * layer + h == 134_515_008
    assert t["experts"] == 0 and t["active_params"] == t["params"]
    # no GPU here and none planned: the target would run on CPU in float32
    if not plan["gpus"]["memory"]:
        assert t["dtype"] == "float32" and t["weights_bytes"] == t["params"] * 4
    # samples read from the builtin prompts (80 records, val_fraction 0.1)
    n = sum(1 for line in open(REPO / "drafter" / "data" / "quickstart_prompts.jsonl")
            if line.strip())
    assert plan["data"]["samples"] == n and plan["data"]["val"]["samples"] == round(n * 0.1)
    assert "cache" in plan["disk"]["cache_path"] and plan["disk"]["cache_need"] == t["params"] * 2


def test_no_data_and_remote_sources_is_a_clear_error(tmp_path):
    cfg = C.load(None, [f"run_dir={tmp_path}", "target.model=" + str(REPO / "configs/kimi-k2.5"),
                        "prepare.sources=[{path: some-org/some-dataset}]"])
    with pytest.raises(PlanError, match="plan.samples"):
        P.make_plan(cfg)


def test_extra_temperatures_multiply_the_conversations(tmp_path):
    """generate.extra_temperatures answers every conversation once more per entry: the plan
    counts the copies (from plan.samples here; from prepare's output or the sources alike)."""
    from drafter.run.counts import data_counts

    def counts(*over):
        cfg = C.load(KIMI_YAML, [f"run_dir={tmp_path / 'run'}", *over])
        return data_counts(cfg, Run.of(cfg))

    one, two = counts(), counts("generate.extra_temperatures=[0.8]")
    assert two["samples"] == 2 * one["samples"] == 20_000
    assert two["val"]["samples"] == 2 * one["val"]["samples"]
    assert two["tokens"] == 2 * one["tokens"]
    assert two["generated_tokens"] == 2 * one["generated_tokens"]
    assert "x 2 (generate.extra_temperatures)" in two["source"]
    off = counts("generate.extra_temperatures=[0.8]", "generate.enabled=false")
    assert off["samples"] == one["samples"]


# ------------------------------------------------- quantised targets, and what extract refuses
def kimi_folder(tmp_path: Path, quantization: dict | None) -> Path:
    """configs/kimi-k2.5's config.json (no weights), with Kimi-K2.5's own quantization_config."""
    d = json.loads((REPO / "configs/kimi-k2.5/config.json").read_text())
    if quantization is not None:
        d["quantization_config"] = quantization
    folder = tmp_path / "kimi"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(d))
    return folder


def test_int4_kimi_is_sized_as_stored_and_refused_for_the_transformers_path(tmp_path):
    """INT4 routed experts in groups of 32 with a bf16 scale each (4.5 bits a weight), the rest
    bf16: ~553 GiB, as Kimi-K2.5's safetensors files hold. One GPU of 139.8 GiB cannot hold
    that: plan refuses extract in one line pointing at the vLLM path."""
    from tests.remote_code import QUANTIZATION

    folder = kimi_folder(tmp_path, QUANTIZATION)
    cfg = C.load(KIMI_YAML, [f"run_dir={tmp_path / 'run'}", f"target.model={folder}",
                             "extract.tp=false"])
    plan = P.make_plan(cfg)
    total, routed = kimi_params()
    t = plan["target"]
    assert t["params"] == total and t["quantised_params"] == routed
    want = (total - routed) * 2 + routed * 9 // 16
    assert t["weights_bytes"] == want and t["routed_expert_bytes"] == routed * 9 // 16
    assert 553 * GiB < want < 554 * GiB
    assert t["weights_source"].startswith("quantization_config compressed-tensors "
                                          "pack-quantized: 4-bit int group 32 = 4.50 bits/weight")
    assert plan["gpu_memory"]["extract"]["weights"] == want            # no tp: all of it
    assert len(plan["refused"]) == 1
    why = plan["refused"][0]
    assert why.startswith(f"extract: the target's weights need {want / GiB:,.1f} GiB per GPU")
    assert "139.8 GiB" in why and why.endswith("use extract.engine: vllm (docs/extract.md)")
    text = P.render(plan)
    assert f"weights {want / GiB:.1f} GiB: quantization_config compressed-tensors" in text
    assert why in text
    # the decode estimate reads the bytes as stored: an INT4 target decodes faster than bf16
    rows = {r["step"]: r["tokens_per_s"] for r in plan["time"]}
    bf16 = {r["step"]: r["tokens_per_s"] for r in P.make_plan(C.load(KIMI_YAML, [
        f"run_dir={tmp_path / 'run'}", "extract.tp=false"]))["time"]}
    assert rows["generate"] > 2 * bf16["generate"]
    # under extract.tp the refusal is the MoE's, whatever the bytes
    cfg = C.load(KIMI_YAML, [f"run_dir={tmp_path / 'run'}", f"target.model={folder}"])
    [why] = P.make_plan(cfg)["refused"]
    assert why.startswith("extract.tp: the target is a MoE (384 routed experts)")
    assert f"{routed * 9 / 16 / GiB:,.1f} GiB per GPU, not 1/8" in why


def _config_only(tmp_path: Path, arch: str) -> Path:
    """A target folder with config.json and no weights: loading any would fail."""
    import transformers

    from tests.tiny import ARCHS, COMMON

    cls, extra = ARCHS.get(arch) or ("MixtralConfig", {"num_local_experts": 4,
                                                       "num_experts_per_tok": 2})
    folder = tmp_path / arch
    getattr(transformers, cls)(**{**COMMON, **extra}).save_pretrained(folder)
    assert not list(folder.glob("*.safetensors"))
    return folder


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe", "mixtral"])
def test_moe_under_extract_tp_is_refused_before_any_weight_loads(tmp_path, arch):
    """n_routed_experts, num_experts, num_local_experts: each a MoE whose experts transformers'
    tp plan would copy to every rank. plan, the run's preflight and extract itself refuse it,
    the same way, from config.json alone (the folder has no weights to load)."""
    from drafter.features.capture import UnfitTarget
    from drafter.run.preflight import preflight
    from drafter.steps import extract

    folder = _config_only(tmp_path, arch)
    cfg = C.load(None, [f"run_dir={tmp_path / 'run'}", f"target.model={folder}",
                        "extract.tp=true", "plan.samples=100", "plan.gpus=2",
                        "plan.gpu_memory_gib=80"])
    [why] = P.make_plan(cfg)["refused"]
    assert why.startswith("extract.tp: the target is a MoE (4 routed experts)")
    assert "extract.engine: vllm (docs/extract.md)" in why and "not 1/2" in why
    run = Run.of(cfg)
    with pytest.raises(UnfitTarget) as e:
        preflight(cfg, run, "extract", upfront=True)
    assert str(e.value).startswith("extract.tp: the target is a MoE (4 routed experts)")
    with pytest.raises(UnfitTarget, match=r"extract\.engine: vllm \(docs/extract\.md\)"):
        extract.main(cfg)
    assert not run.root.exists()
    # without extract.tp a CPU run goes on to its inputs (here: none yet)
    from drafter.core.rundir import MissingInput

    with pytest.raises(MissingInput, match="vocab"):
        extract.main(C.load(None, [f"run_dir={tmp_path / 'run'}", f"target.model={folder}"]))


def test_dense_weights_above_a_gpu_are_refused_with_both_ways_out(tmp_path):
    folder = _config_only(tmp_path, "llama")
    over = [f"run_dir={tmp_path / 'run'}", f"target.model={folder}", "plan.samples=100",
            "plan.gpus=1", "plan.gpu_memory_gib=0.01"]           # 10.2 MiB
    plan = P.make_plan(C.load(None, over))
    # tests/tiny.py's Llama: 2 x 49152 x 64 embeddings + 6 layers of 36,864 Linear weights and
    # 128 norm weights + the final norm = 6,513,472 parameters, 12.4 MiB at bf16
    assert plan["target"]["params"] == 6_513_472
    [why] = plan["refused"]
    assert why.startswith("extract: the target's weights need 12.4 MiB per GPU (no "
                          "quantization_config: every weight at 16 bits), more than one GPU's "
                          "10.2 MiB")
    assert why.endswith("use extract.engine: vllm (docs/extract.md), or extract.tp=true over "
                        "enough GPUs")
    assert plan["target"]["weights_bytes"] == plan["target"]["params"] * 2
    assert P.make_plan(C.load(None, over + ["plan.gpu_memory_gib=1"]))["refused"] == []


def test_kimi_node_config_fits_8_gpus_of_96gb_inside_vllm():
    """configs/kimi-k2.5-node.yaml: the INT4 target in vLLM (TP 8 + EP) for generate, extract and
    evaluate, offline train on fp8 + top-k shards: nothing refused, every step within 89.4 GiB."""
    import json as _json
    import subprocess as _sp

    p = _sp.run([sys.executable, "-m", "drafter.cli", "plan", "configs/kimi-k2.5-node.yaml",
                 "--json"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    plan = _json.loads(p.stdout)
    assert plan["refused"] == []
    assert plan["target"]["weights_source"].startswith("quantization_config compressed-tensors")
    for step, m in plan["gpu_memory"].items():
        assert m["total"] <= 89.4 * 2**30, (step, m)
    runs = plan["runs_in"]
    assert runs["extract"] == "vLLM over 8 GPU(s)" and runs["evaluate"] == "vLLM over 8 GPU(s)"
    assert "from the stored shards" in runs["train"]
    chosen = [o for o in plan["storage"]["options"] if o["chosen"]]
    assert chosen[0]["aux_dtype"] == "fp8" and chosen[0]["teacher"] == "topk"


def test_kimi_dspark_config_plans_its_block_drafter_on_the_node():
    """configs/kimi-k2.5-dspark.yaml: the node run with a DSpark drafter: nothing refused, five
    target layers stored (their bytes counted), the drafter's shape and train's memory within
    a 96 GB GPU under FSDP, and no warning but the disk's (a property of this machine)."""
    import json as _json
    import subprocess as _sp

    p = _sp.run([sys.executable, "-m", "drafter.cli", "plan", "configs/kimi-k2.5-dspark.yaml",
                 "--json"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    plan = _json.loads(p.stdout)
    assert plan["refused"] == []
    assert plan["storage"]["n_aux"] == 5
    chosen = [o for o in plan["storage"]["options"] if o["chosen"]][0]
    # EAGLE-3's 21,778 B a token (three fp8 layers + top-64) plus two fp8 layers and their scales
    assert chosen["bytes_per_token"] == 21_778 + 2 * (7168 + 4)
    assert "dspark: 5 layers, blocks of 8, 5 target layers" in plan["runs_in"]["train"]
    assert plan["gpu_memory"]["train"]["total"] <= 89.4 * 2**30
    assert [w for w in plan["warnings"] if not w.startswith("disk")] == []
