"""What the sessions' derive scripts read from one train's raw files (its manifest and metrics,
side by side): load(manifest path) -> (manifest, the train records, the last elapsed_s, the
after-warm-up ratio: (tokens - 10 x tokens / steps) / (last elapsed_s - warmup_s) / steady,
the steps after the warm-up against the steady speed); row(name, manifest path) prints one
train's line (setup in parts when its tree logs them, the first step's batch, forward and
backward, avg/steady) and returns avg/steady; summary(label, ratios) prints their range."""
import json


def load(manifest: str):
    m = json.load(open(manifest))
    rs = [r for r in map(json.loads, open(manifest.replace("manifest.json", "metrics.jsonl")))
          if r.get("split") == "train"]
    tok, el, n = sum(r["tokens"] for r in rs), rs[-1]["elapsed_s"], m["final_step"]
    return m, rs, el, (tok - 10 * tok / n) / (el - m["warmup_s"]) / m["steady_tokens_per_s"]


def row(name: str, f: str) -> float:
    m, rs, el, after = load(f)
    parts = m.get("setup_parts_s")
    big = "-" if parts is None else " ".join(f"{k} {v:.2f}" for k, v in parts.items()
                                             if v >= 0.1)
    fs = m["warmup_first_step_s"]
    print(f"{name:4} setup {m['setup_s']:5.2f} ({big}) warmup {m['warmup_s']:5.2f} step1 "
          f"{m['warmup_steps_s'][0]:.2f} (batch {fs['batch']:.2f} forward {fs['forward']:.2f} "
          f"backward {fs['backward']:.2f}) wait {m['warmup_data_wait_s']:.2f} avg "
          f"{m['avg_tokens_per_s']:9.0f} steady {m['steady_tokens_per_s']:9.0f} ratio "
          f"{m['avg_over_steady']:.3f} after-warmup {after:.3f} wall {m['setup_s'] + el:5.1f} "
          f"intervals {' '.join(str(round(r['tokens_per_s'] / 1e3)) for r in rs)}k")
    return m["avg_over_steady"]


def summary(label: str, r: list[float]) -> None:
    r = sorted(r)
    print(f"{label}: {len(r)} runs, avg/steady {r[0]:.3f}-{r[-1]:.3f}, "
          f"{sum(x >= 0.85 for x in r)} at or above 0.85")
