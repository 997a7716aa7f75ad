"""What the sessions' derive scripts read from one train's raw files (its manifest and metrics,
side by side): load(manifest path) -> (manifest, the train records, the last elapsed_s, the
after-warm-up ratio: (tokens - 10 x tokens / steps) / (last elapsed_s - warmup_s) / steady,
the steps after the warm-up against the steady speed)."""
import json


def load(manifest: str):
    m = json.load(open(manifest))
    rs = [r for r in map(json.loads, open(manifest.replace("manifest.json", "metrics.jsonl")))
          if r.get("split") == "train"]
    tok, el, n = sum(r["tokens"] for r in rs), rs[-1]["elapsed_s"], m["final_step"]
    return m, rs, el, (tok - 10 * tok / n) / (el - m["warmup_s"]) / m["steady_tokens_per_s"]
