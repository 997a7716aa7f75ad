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
from drafter.train.memory import train_gpu_bytes

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


def test_kimi_gpu_memory_and_warnings(kimi):
    plan, run_dir = kimi
    total, _ = kimi_params()
    g = plan["gpu_memory"]["extract"]
    # extract.tp=true over 8 GPUs: weights / 8 + activations of 16384 tokens (4 Ht + 3 I with
    # I = max(dense 18432, 8 experts * 2048)) + 4 captured states + a logits chunk, +25%
    w = total * 2 // 8
    act = 16384 * (4 * H + 3 * max(I_DENSE, K * I_MOE)) * 2
    cap = 16384 * 4 * H * 2
    logits = (1 << 30) * 3 // 2
    assert (g["weights"], g["activations"], g["capture"], g["logits"]) == (w, act, cap, logits)
    assert g["total"] == int((w + act + cap + logits) * 1.25) and g["tp"] == 8
    mem = 139.8 * GiB
    assert plan["gpus"] == {"count": 8, "memory": mem, "memory_source":
                            "config (plan.gpu_memory_gib)"}
    warns = plan["warnings"]
    # 1.9 TiB of bf16 weights cannot fit 8 x 139.8 GiB: the warning says how many GPUs would
    need = math.ceil(total * 2 * 1.25 / (mem * 0.95))
    gpu_w = [x for x in warns if x.startswith("GPU memory: extract")]
    assert len(gpu_w) == 1 and f">= {need} GPUs" in gpu_w[0] and need == 18
    # the disk warning fires exactly when this machine's free space is short
    free = shutil.disk_usage(next(p for p in run_dir.parents if p.exists())).free
    disk_need = plan["disk"]["total"]
    assert any(x.startswith("disk:") for x in warns) == (disk_need > free * 0.95)
    assert plan["disk"]["run_dir_free"] == pytest.approx(free, rel=0.01)


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
            assert on["total"] == int((sum(off[k] for k in ("states", "frozen", "activations",
                                                            "teacher"))
                                       + on["online_features"]) * 1.25)


def test_kimi_times(kimi):
    plan, _ = kimi
    total, routed = kimi_params()
    active = total - routed + routed * K // E
    rows = {r["step"]: r for r in plan["time"]}
    # prefill: 0.3 * 989 TFLOP/s per GPU over 2 FLOPs per active non-embedding weight, 8 GPUs
    per_gpu = 0.3 * 989e12 / (2 * (active - V * H))
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
