"""The tuned serving settings in the export READMEs: per temperature evaluated and batch size,
the chain K or tree that `drafter evaluate` measured to serve this drafter best and its expected
speedup, and per temperature one vLLM command that serves it (K by batch range, the drafts
sampled as evaluate sampled them: drafter/measure/serving.py) and SGLang's lines, so that a user
finds the drafter and how to serve it in one folder. A temperature whose speed figures did not
hold up (drafter/measure/speedcheck.py) gets no setting and no speedup, only the reason and the
command that serves what was measured.

    add_tuned_settings(run, metrics)      # evaluate, at its end: every export README
    carry_over(run, fmt, built, final)    # export, on a re-run: the section again, if it applies

The section sits between two HTML comments (BEGIN, END) in each export dir's README.md, before
"## Aux layer ids"; writing it again replaces it (idempotent), and a README whose drafter evaluate
did not measure loses it. Only README.md changes: export's manifest, whose hash is evaluate's
input fingerprint, seals no file of the dirs (its `*_bytes` counts are as exported), `drafter
check` only reads the README's serving commands (a warning rule), and the weights and configs
are never rewritten. Rewriting the manifest would make evaluate stale the moment it finished.

What the section was written from is recorded in evaluate/tuned.json (the digest of the metrics
and, per engine dir, the sha256 of model.safetensors). A re-run of export (`drafter export
--force`) puts the section back into a dir only when metrics.json is still the one recorded and
the new weights are byte-identical to the measured ones (the same checkpoint, dtype and options:
exports are byte-reproducible); a different checkpoint gets the plain README until evaluate runs.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from drafter.core.rundir import Run, atomic_json, atomic_write, read_json
from drafter.export.engines import FORMATS, META_FILE, NATIVE, README_FILE, WEIGHTS_FILE
from drafter.measure.serving import (
    fallback_config,
    schedule,
    sglang_flags,
    sglang_notes,
    vllm_config,
    vllm_flag,
)

log = logging.getLogger("drafter")

BEGIN = "<!-- drafter:tuned-settings begin (written by `drafter evaluate`; replaced each run) -->"
END = "<!-- drafter:tuned-settings end -->"
TITLE = "## Tuned serving settings (measured by evaluate)"
ANCHOR = "## Aux layer ids"  # the section goes before this heading (after "Serve it")
# drafter.json keys that name the drafter a dir holds: the export dirs of one export share them
IDENTITY = ("checkpoint", "step", "drafter_config")


# ------------------------------------------------------------------------------------ the entries
def add_tuned_settings(run: Run, metrics: dict) -> list[Path]:
    """Write the tuned serving settings of `metrics` (evaluate/metrics.json as evaluate writes
    it) into the README.md of every engine dir under the run's export/. Called by the evaluate
    step at its end, once metrics.json and report.md are written.

    The section is written when evaluate measured one of these dirs (`settings.drafter`, the dir
    it loaded), the run was lossless and `settings.recommended` holds the per-batch setting; it
    goes into every export dir that holds the same drafter (drafter.json: same checkpoint, step
    and config), with the flags rebuilt for that dir's own path. Otherwise the section is taken
    out of the READMEs (it would describe a measurement that metrics.json no longer holds).
    Returns the READMEs that carry the section now. Idempotent: a README already up to date is
    not rewritten; one that cannot be written is logged and skipped (evaluate's result stands)."""
    dirs = [run.export(f) for f in FORMATS if (run.export(f) / README_FILE).is_file()]
    measured = _measured_dir(metrics, dirs)
    chosen = []
    if measured is not None:
        ident = _identity(measured)
        chosen = [d for d in dirs if _identity(d) == ident]
    out = []
    for d in dirs:
        text = section(metrics, d, run) if d in chosen else None
        try:
            if _rewrite(d / README_FILE, text):
                log.info("export: %s %s evaluate's tuned serving settings", d / README_FILE,
                         "carries" if text else "no longer carries")
        except OSError as e:  # evaluate's measurement stands; only the README is behind
            log.warning("export: %s not updated with the tuned serving settings: %s",
                        d / README_FILE, e)
            continue
        if text:
            out.append(d / README_FILE)
    if chosen:
        atomic_json(run.eval_tuned(), {
            "metrics": metrics_digest(metrics), "drafter": str(measured),
            "weights": {d.name: weights_digest(d) for d in chosen}})
    else:
        run.eval_tuned().unlink(missing_ok=True)
    return out


def carry_over(run: Run, fmt: str, built: Path, final: Path) -> bool:
    """Export's re-run: put the tuned section into the README of the dir being built (`built`,
    renamed to `final` afterwards) when evaluate's metrics.json is the one its last section was
    written from (evaluate/tuned.json) and the weights are byte-identical to the ones it
    measured. True when the section was written."""
    try:
        side = read_json(run.eval_tuned())
        metrics = read_json(run.eval_metrics())
    except (OSError, ValueError):
        return False  # no evaluate since, or one that wrote no section
    if not isinstance(side, dict) or not isinstance(metrics, dict) \
            or side.get("metrics") != metrics_digest(metrics) \
            or (side.get("weights") or {}).get(fmt) != weights_digest(built) \
            or not _recommended(metrics):
        return False
    _rewrite(built / README_FILE, section(metrics, final, run, meta_dir=built))
    return True


# ------------------------------------------------------------------------------------ the section
def section(metrics: dict, out_dir: Path, run: Run, meta_dir: Path | None = None) -> str:
    """The README section for the engine dir `out_dir` (its flags name that dir's resolved path;
    SGLang's the native dir, the layout it reads). `meta_dir`: where drafter.json is read (the
    temp dir export builds in), default `out_dir`."""
    s = metrics["settings"]
    rec = s.get("recommended") or {}
    meta = _meta(meta_dir or out_dir)
    d = str(Path(out_dir).resolve())
    native = str(Path(out_dir).resolve().parent / NATIVE)
    is_native = Path(out_dir).name == NATIVE
    tgt = (meta.get("target") or {}).get("name_or_path") or s.get("target") or "TARGET"
    tmpl = f" --chat-template {meta['chat_template']}" if meta.get("chat_template") else ""
    dc = meta.get("drafter_config") or {}
    nbr = bool(dc.get("norm_before_residual"))
    # a block drafter's dir (DSpark, DFlash: drafter/export/dsparkdir.py): its method and block
    block = (meta["method"], int(dc["block_size"])) \
        if meta.get("method") in ("dflash", "dspark") and dc.get("block_size") else None
    by_t = rec.get("by_temperature") or ({"0.0": rec} if rec.get("by_batch") else {})
    checks = s.get("speed_check") or {}
    report = run.eval_report().resolve()
    L = [TITLE, "",
         f"Measured by `drafter evaluate` with drafter's own decoder on {s.get('device', '?')} "
         f"({s.get('dtype', '?')}): for each temperature evaluated and each batch size, the "
         "setting with the highest expected speedup (drafter/measure/tuning.py: the chain's "
         "per-position acceptance at that temperature, each measured tree's τ, and the step "
         "costs timed on that machine), and one serving command per temperature that reproduces "
         "it, in place of the default K under \"Serve it\". Serve with the command of the "
         "temperature your requests use: a sampled request accepts other drafts than a greedy "
         "one, and above temperature 0 the drafts must be sampled as evaluate sampled them "
         "(vLLM's `draft_sample_method: probabilistic`; its default drafts the argmax). The "
         "expected speedup is per decode step (prefills left out, every row live: what an "
         "engine with continuous batching gets). Step costs differ on another GPU or engine: "
         f"run `drafter evaluate` there to tune for it. All tables: {report}.", ""]
    for t in sorted(set(by_t) | set(checks), key=float):
        L += [f"### Temperature {float(t):g}" + (" (greedy)" if float(t) == 0 else ""), ""]
        if t in by_t:
            L += _temperature(by_t[t], float(t), tgt, tmpl, d, native, is_native, nbr, block)
        else:
            L += _unreliable(checks[t], float(t), s, tgt, tmpl, d, native, nbr, block)
    L += ["### Measured", "",
          f"Batch {s.get('batch_size', '?')}, {s.get('max_new_tokens', '?')} new tokens per "
          "prompt, " + ", ".join(f"{n}: {x.get('prompts')} prompts"
                                 for n, x in (s.get("datasets") or {}).items())
          + f"; drafter `{s.get('drafter')}`; lossless: "
          + ("PASS" if metrics.get("lossless") else "FAIL") + ".", "",
          "| run | τ | speedup | decode speedup |", "|---|---|---|---|"]
    for x in metrics.get("runs") or []:
        if x.get("drafter") != "drafter":
            continue
        o = (x.get("datasets") or {}).get("overall") or {}
        L.append(f"| {x.get('name')} | {_f(o.get('tau'))} | "
                 + (f"{_f(o.get('speedup'))}x | {_f(o.get('decode_speedup'))}x |"
                    if o.get("speed_reliable", True) else "unreliable | unreliable |"))
    for t, rt in by_t.items():
        cal = rt.get("calibration") or {}
        if not cal:
            continue
        eff = cal.get("static_batch_efficiency")
        L += ["", f"Temperature {float(t):g}: step model calibrated on the decode steps at "
              f"batch {cal.get('batch')}: speculative x{cal.get('spec_ratio')}, plain "
              f"x{cal.get('plain_ratio')}"
              + (f"; evaluate's own batches kept {_f(eff)} of the steps' τ (they wait for "
                 "their slowest row; the expected speedups are per step, as an engine with "
                 "continuous batching gets)." if eff is not None else ".")]
        got = rt.get("measured")
        if got:
            ae = got.get("expected_as_evaluated") or {}
            L[-1] += (f" Its best setting there, decoded (`{got.get('run')}`): speedup "
                      f"{_f(got.get('speedup'))}x ({_f(ae.get('speedup'))}x expected with "
                      f"evaluate's batches and prefills), {_f(got.get('decode_speedup'))}x "
                      f"without the prefills ({_f(ae.get('decode_speedup'))}x expected).")
    return "\n".join(L) + "\n"


def _temperature(rec: dict, T: float, tgt: str, tmpl: str, d: str, native: str,
                 is_native: bool, nbr: bool, block: tuple[str, int] | None = None) -> list[str]:
    """One temperature's part: the best setting per batch size, then one vLLM command (K by
    batch range; a block drafter's whole block) and SGLang's lines (measure.serving)."""
    by = sorted(rec["by_batch"].items(), key=lambda kv: int(kv[0]))
    sch = schedule(rec["by_batch"])
    k_at = {b: next(k for a, e, k in sch if a <= int(b) <= e) for b, _ in by}
    if block:  # vLLM drafts the whole trained block wherever it speculates
        k_at = {b: block[1] if k else 0 for b, k in k_at.items()}
    L = ["| batch | best setting | expected speedup | expected τ | vLLM's K there |",
         "|---|---|---|---|---|"]
    for b, r in by:
        best = next((x for x in r["settings"] if x["setting"] == r["best"]), None)
        if best is None:
            continue
        est = " (estimated from a larger tree's counts)" if best.get("estimated") else ""
        L.append(f"| {b} | {best['setting']}{est} | {_f(best['speedup'])}x | "
                 f"{_f(best['expected_tau'])} | "
                 + (f"{k_at[b]}" if k_at[b] else "0: plain decoding is faster") + " |")
    L.append("")
    cfg = vllm_config(d, rec["by_batch"], T, block)
    if block and cfg is not None:
        L += [f"vLLM drafts this {block[0]} drafter's whole block, K = {block[1]}, at every "
              "batch size (a shorter block attends over other queries than in training); a "
              "best setting of fewer drafts above is drafter's decoder verifying the first "
              "drafts of that block, which vLLM has no flag for. Where plain decoding is "
              "faster, serve those batch sizes without the drafter.", ""]
    if cfg is None:
        L += ["No setting is expected to beat plain decoding at any batch size measured at "
              "this temperature: serve without the drafter.", ""]
        fb = fallback_config(d, rec["by_batch"], T, block)
        if fb is not None:
            L += [f"Should you serve it anyway, vLLM with its best chain here, "
                  f"{fb[1]['setting']} (expected speedup {_f(fb[1]['speedup'])}x)"
                  + (", the drafts sampled as evaluate sampled them" if T > 0 else "") + ":",
                  "", "```bash", f"vllm serve {tgt}{tmpl} {vllm_flag(fb[0])}", "```", ""]
    else:
        what = ["vLLM, one config for every batch size"]
        if "num_speculative_tokens_per_batch_size" in cfg:
            what.append("K by batch range (`num_speculative_tokens_per_batch_size`: "
                        "[first, last, K]; 0 where plain decoding is faster; past the last "
                        "range its K holds)")
        if T > 0:
            what.append("drafts sampled as evaluate sampled them (`draft_sample_method: "
                        "probabilistic`; vLLM's default, greedy, accepts what the report's "
                        "`greedy` row shows)")
        if cfg.get("rejection_sample_method") == "block":
            what.append("block verification (`rejection_sample_method: block`: vLLM's V2 model "
                        "runner only, the default on CUDA with Triton; the V1 runner, as in "
                        "vLLM's CPU build, ignores it and drafts greedily)")
        L += ["; ".join(what) + ":", "", "```bash", f"vllm serve {tgt}{tmpl} {vllm_flag(cfg)}",
              "```", ""]
    if block:
        return L + ["SGLang does not serve this export as trained (docs/export.md, \"Block "
                    "drafters\"): no SGLang lines.", ""]
    L += ["SGLang" + ("" if is_native else f" (it reads the native layout, {native})")
          + (" (norm_before_residual is true: SGLang implements only false and will accept "
             "less; serve with vLLM)" if nbr else "") + ", per batch size:", ""]
    for b, r in by:
        best = next((x for x in r["settings"] if x["setting"] == r["best"]), None)
        if best is None:
            continue
        if r["expected_speedup"] < 1:
            L += [f"- batch {b}: no setting beats plain decoding: serve without the drafter", ""]
            continue
        row = best
        if T > 0 and not best.get("k"):        # SGLang samples the drafts of chains only
            row = max((x for x in r["settings"] if x.get("k") and not x.get("block")),
                      key=lambda x: x["speedup"], default=best)
        elif best.get("block"):                # no block verification in SGLang
            row = max((x for x in r["settings"] if x.get("k") and not x.get("block")),
                      key=lambda x: x["speedup"], default=best)
        g = sglang_flags(native, row.get("k"), row.get("tree"), T)
        L += [f"- batch {b} ({row['setting']}):", "", "  ```bash",
              f"  python -m sglang.launch_server --model {tgt}{tmpl} {g}", "  ```", ""]
    L += [f"- {x}" for x in sglang_notes(T, rec["by_batch"])] + [""]
    return L


def _unreliable(check: dict, T: float, s: dict, tgt: str, tmpl: str, d: str, native: str,
                nbr: bool, block: tuple[str, int] | None = None) -> list[str]:
    """A temperature whose speed figures did not hold up: no setting recommended and no speedup,
    only the command that serves what evaluate measured (its acceptance stands)."""
    k = (s.get("primary") or {}).get("k")          # the chain evaluate ran first
    L = ["Not tuned: evaluate's step times at this temperature were unreliable "
         "(drafter/measure/speedcheck.py), so no setting is recommended and no speedup is "
         "given:", ""] + [f"- {x}" for x in check.get("reasons") or []] + [""]
    if k and block:
        cfg = {"method": block[0], "model": d, "num_speculative_tokens": block[1]}
        if T > 0:
            cfg["draft_sample_method"] = "probabilistic"
        L += ["The command that serves the drafter's block until `drafter evaluate` runs again "
              "on a quiet machine:", "", "```bash", f"vllm serve {tgt}{tmpl} {vllm_flag(cfg)}",
              "```", ""]
    elif k:
        cfg = {"method": "eagle3", "model": d, "num_speculative_tokens": k}
        if T > 0:
            cfg["draft_sample_method"] = "probabilistic"
        L += [f"The command that serves what evaluate measured (chain K={k}, its acceptance in "
              "the report) until `drafter evaluate` runs again on a quiet machine:", "",
              "```bash", f"vllm serve {tgt}{tmpl} {vllm_flag(cfg)}", "```", "",
              "```bash", f"python -m sglang.launch_server --model {tgt}{tmpl} "
              f"{sglang_flags(native, k, temperature=T)}", "```", ""]
    return L


def splice(text: str, body: str | None) -> str:
    """`text` with the marked section replaced by `body` (None: taken out). A section is put
    before ANCHOR, else at the end."""
    block = f"{BEGIN}\n{body.rstrip()}\n{END}\n\n" if body else ""
    i = text.find(BEGIN)
    if i >= 0:
        j = text.find(END, i)
        j = len(text) if j < 0 else j + len(END)
        while j < len(text) and text[j] == "\n":
            j += 1
        if j == len(text) and not block:
            return text[:i].rstrip("\n") + "\n"
        return text[:i] + block + text[j:]
    if not block:
        return text
    a = text.find("\n" + ANCHOR)
    if a >= 0:
        return text[:a + 1] + block + text[a + 1:]
    return text.rstrip("\n") + "\n\n" + block.rstrip("\n") + "\n"


# ------------------------------------------------------------------------------------ helpers
def metrics_digest(metrics: dict) -> str:
    """sha256 of the metrics as JSON (as written to metrics.json and read back)."""
    norm = json.loads(json.dumps(metrics, default=str))
    return "sha256:" + hashlib.sha256(json.dumps(norm, sort_keys=True).encode()).hexdigest()


def weights_digest(d: Path) -> str | None:
    p = Path(d) / WEIGHTS_FILE
    if not p.is_file():
        return None
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _recommended(metrics: dict) -> bool:
    """Whether the section has something to say: a lossless run with a tuned temperature, or
    one whose speed check says why it has none."""
    s = metrics.get("settings")
    if not isinstance(s, dict) or not metrics.get("lossless"):
        return False
    rec = s.get("recommended")
    return (isinstance(rec, dict) and bool(rec.get("by_batch") or rec.get("by_temperature"))) \
        or bool(s.get("speed_check"))


def _measured_dir(metrics: dict, dirs: list[Path]) -> Path | None:
    """The export dir evaluate loaded (settings.drafter), when the section applies."""
    if not _recommended(metrics) or not metrics["settings"].get("drafter"):
        return None
    p = Path(str(metrics["settings"]["drafter"])).expanduser()
    for d in dirs:
        try:
            if p.exists() and p.samefile(d):
                return d
        except OSError:
            continue
    return None


def _meta(d: Path) -> dict:
    try:
        m = read_json(Path(d) / META_FILE)
    except (OSError, ValueError):
        return {}
    return m if isinstance(m, dict) else {}


def _identity(d: Path) -> dict:
    m = _meta(d)
    return {k: m.get(k) for k in IDENTITY}


def _rewrite(readme: Path, body: str | None) -> bool:
    """Splice `body` into the README atomically; False when it already reads so."""
    text = readme.read_text()
    new = splice(text, body)
    if new == text:
        return False
    atomic_write(readme, new)
    return True


def _f(x, n=2) -> str:
    return "-" if x is None else f"{x:.{n}f}" if isinstance(x, float) else str(x)
