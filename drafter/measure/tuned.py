"""The tuned serving settings in the export READMEs: per temperature evaluated and batch size,
the chain K or tree that `drafter evaluate` measured to serve this drafter best, its expected
speedup, and the exact vLLM and SGLang flags, so that a user finds the drafter and how to serve
it in one folder.

    add_tuned_settings(run, metrics)      # evaluate, at its end: every export README
    carry_over(run, fmt, built, final)    # export, on a re-run: the section again, if it applies

The section sits between two HTML comments (BEGIN, END) in each export dir's README.md, before
"## Aux layer ids"; writing it again replaces it (idempotent), and a README whose drafter evaluate
did not measure loses it. Only README.md changes: export's manifest, whose hash is evaluate's
input fingerprint, seals no file of the dirs (its `*_bytes` counts are as exported), `drafter
check` does not read the README, and the weights and configs are never rewritten. Rewriting the
manifest would make evaluate stale the moment it finished.

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
from drafter.measure.tuning import flags

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
    s, rec = metrics["settings"], metrics["settings"]["recommended"]
    meta = _meta(meta_dir or out_dir)
    d = str(Path(out_dir).resolve())
    native = str(Path(out_dir).resolve().parent / NATIVE)
    is_native = Path(out_dir).name == NATIVE
    tgt = (meta.get("target") or {}).get("name_or_path") or s.get("target") or "TARGET"
    tmpl = f" --chat-template {meta['chat_template']}" if meta.get("chat_template") else ""
    nbr = bool((meta.get("drafter_config") or {}).get("norm_before_residual"))
    by_t = rec.get("by_temperature") or {"0.0": rec}   # metrics written before: greedy only
    report = run.eval_report().resolve()
    L = [TITLE, "",
         f"Measured by `drafter evaluate` with drafter's own decoder on {s.get('device', '?')} "
         f"({s.get('dtype', '?')}): for each temperature evaluated and each batch size, the "
         "setting with the highest expected speedup (drafter/measure/tuning.py: the chain's "
         "per-position acceptance at that temperature, each measured tree's τ, and the step "
         "costs timed on that machine) and the flags that select it, in place of the default K "
         "under \"Serve it\". Serve with the flags of the temperature your requests use (the "
         "acceptance of sampled requests differs from greedy ones'). The expected speedup is "
         "per decode step (prefills left out, every row live: what an engine with continuous "
         "batching gets). Step costs differ on another GPU or engine: run `drafter evaluate` "
         f"there to tune for it. All tables: the \"Serving setting\" section of {report}.", ""]
    for t, rt in by_t.items():
        L += [f"### Temperature {float(t):g}" + (" (greedy)" if float(t) == 0 else ""), ""]
        L += _batches(rt, tgt, tmpl, d, native, is_native, nbr)
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
        L.append(f"| {x.get('name')} | {_f(o.get('tau'))} | {_f(o.get('speedup'))}x | "
                 f"{_f(o.get('decode_speedup'))}x |")
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


def _batches(rec: dict, tgt: str, tmpl: str, d: str, native: str, is_native: bool,
             nbr: bool) -> list[str]:
    """The section's part for one temperature: per batch size the best setting and its flags."""
    L = []
    for b, r in sorted(rec["by_batch"].items(), key=lambda kv: int(kv[0])):
        best = next((x for x in r["settings"] if x["setting"] == r["best"]), None)
        if best is None:
            continue
        est = " (estimated from a larger tree's counts)" if best.get("estimated") else ""
        L += [f"#### Batch {b}: {best['setting']}{est}, expected speedup "
              f"{_f(best['speedup'])}x (expected τ {_f(best['expected_tau'])})", ""]
        if best["speedup"] < 1:
            L += [f"No setting is expected to beat plain decoding here: serve without the drafter "
                  f"at this temperature and batch size. The best one, should you serve it:", ""]
        f = flags(d, best.get("k"), best.get("tree"))
        if f["vllm"]:
            L += ["vLLM:", "", "```bash", f"vllm serve {tgt}{tmpl} {f['vllm']}", "```", ""]
        else:
            chains = [x for x in r["settings"] if x.get("k")]
            alt = max(chains, key=lambda x: x["speedup"]) if chains else None
            L += ["vLLM cannot serve this tree (vLLM's EAGLE-3 drafts chains only)"
                  + (f"; its best chain here is {alt['setting']}, expected speedup "
                     f"{_f(alt['speedup'])}x (expected τ {_f(alt['expected_tau'])}):"
                     if alt else "."), ""]
            if alt:
                L += ["```bash", f"vllm serve {tgt}{tmpl} {flags(d, alt['k'])['vllm']}",
                      "```", ""]
        g = flags(native, best.get("k"), best.get("tree"))["sglang"]
        L += ["SGLang" + ("" if is_native else f" (it reads the native layout, {native})")
              + (" (norm_before_residual is true: SGLang implements only false and will accept "
                 "less; serve with vLLM)" if nbr else "") + ":", "", "```bash",
              f"python -m sglang.launch_server --model {tgt}{tmpl} {g}", "```", ""]
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
    s = metrics.get("settings")
    rec = s.get("recommended") if isinstance(s, dict) else None
    return bool(metrics.get("lossless")) and isinstance(rec, dict) \
        and bool(rec.get("by_batch"))


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
