"""The evaluation report: evaluate/metrics.json read back as report.md (acceptance length, speed,
the serving setting, per-position acceptance, the lossless counts) and its two plots.
    atomic_write(run.eval_report(), render_report(metrics))
    plots(run, metrics["runs"])                 # evaluate/acceptance.png, evaluate/tau.png
    report(run_dir)                   # `drafter report RUN_DIR`: prints it; 1 if not lossless
"""
from __future__ import annotations

import math

from drafter.core.rundir import MissingInput, Run, read_json


def _fmt(x, n=2):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{n}f}"
    return str(x)


def render_report(m: dict) -> str:
    s, runs = m["settings"], m["runs"]
    names = [n for n in runs[0]["datasets"] if n != "overall"] + ["overall"]
    L = ["# Evaluation report", ""]
    pg = s.get("prefill_graph_tokens")  # absent in metrics written before it was recorded
    L.append(f"- target: `{s['target']}` ({s['device']}, {s['dtype']}, CUDA graphs: "
             f"{'on' if s['cuda_graphs'] else 'off'}"
             + (f", prefills of up to {pg} tokens graphed" if s["cuda_graphs"] and pg else "")
             + ")")
    L.append(f"- drafter: `{s['drafter']}`" + (f"; baseline: `{s['baseline']}`"
                                               if s["baseline"] else ""))
    rows = runs[0]["datasets"]["overall"].get("rows_per_step")
    fewer = (f" (the steps ran at {_fmt(rows, 1)} rows on average: "
             + ", ".join(f"{n} {_fmt(runs[0]['datasets'][n].get('rows_per_step'), 1)}"
                         for n in names[:-1]) + "; a dataset with fewer prompts decodes in "
             "smaller batches)") if rows and rows < s["batch_size"] - 0.5 else ""
    L.append(f"- {s['max_new_tokens']} new tokens per prompt, batch {s['batch_size']}{fewer}, "
             f"temperatures {s['temperatures']}, seed {s['seed']}")
    L.append("- datasets: " + ", ".join(f"{n} ({d['prompts']} prompts from {d['records']} "
                                         f"records of `{d['path']}`)"
                                         for n, d in s["datasets"].items()))
    L.append("")
    tie = (f"; {m['ties']} numerical ties (a runner-up within {s['tie_tolerance']} of the top "
           f"logit)") if m["ties"] else ""
    drift = (f"; {m['drift']} bf16 drift (a mismatch in {s['dtype']} that float32 decodes "
             f"identically)") if m.get("drift") else ""
    if m["lossless"]:
        L.append(f"**Lossless: PASS.** At temperature 0 every speculative output is "
                 f"token-identical to plain greedy decoding of the target{tie}{drift}.")
    else:
        L.append(f"**Lossless: FAIL.** {m['mismatches']} speculative output(s) differ from plain "
                 f"greedy decoding of the target"
                 + (" in float32 too" if s.get("float32_recheck") else "")
                 + f"{tie}{drift}. See the divergences in metrics.json.")
    L += ["", "## Acceptance length τ", "",
          "Tokens per target forward after the prefill, the bonus token counted (plain decoding "
          "= 1.0).", "",
          "| run | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for r in runs:
        L.append(f"| {r['name']} | " + " | ".join(_fmt(r["datasets"][n].get("tau"))
                                                  for n in names) + " |")
    L += ["", "## Speed", "",
          "Wall-clock tokens/s on this machine, plain decoding of the same prompts in the same "
          "batches as the reference. c = one drafter forward / one verification forward (a "
          "block drafter: its forward and its Markov positions / the verification). "
          "step ms: the seconds over the decode steps, prefills included; decode ms: without "
          "them (the time of a step itself); decode speedup: the speedup without the prefills "
          "(the steps alone). An untimed warm-up decoding ran first.", "",
          "| run | dataset | prompts | τ | tokens/s | plain tokens/s | speedup | decode speedup | "
          "step ms | plain step ms | decode ms | plain decode ms |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        ok = r["datasets"]["overall"].get("speed_reliable", True)
        for n in names:
            d = r["datasets"][n]
            L.append(f"| {r['name']} | {n} | {d['prompts']} | {_fmt(d.get('tau'))} | "
                     f"{_fmt(d.get('tokens_per_s'), 1)} | {_fmt(d.get('plain_tokens_per_s'), 1)} | "
                     + (f"{_fmt(d.get('speedup'))}x | {_fmt(d.get('decode_speedup'))}x | " if ok
                        else "unreliable | unreliable | ") +
                     f"{_fmt(d.get('step_ms'))} | "
                     f"{_fmt(d.get('plain_step_ms'))} | {_fmt(d.get('decode_step_ms'))} | "
                     f"{_fmt(d.get('plain_decode_step_ms'))} |")
    L += ["", "| run | target forward ms (1 token) | verify forward ms | drafter forward ms | c |",
          "|---|---|---|---|---|"]
    for r in runs:
        t = r["timing"]
        markov = f" (+ {_fmt(t['markov_ms'], 3)} a Markov position)" if "markov_ms" in t else ""
        L.append(f"| {r['name']} | {_fmt(t['target_ms'])} | {_fmt(t['verify_ms'])} | "
                 f"{_fmt(t['draft_ms'])}{markov} | {_fmt(t['c'], 3)} |")
    plain0 = m["plain"].get("0.0", {}).get("overall", {})
    steps = [("plain, T=0", plain0)] + [(r["name"], r["datasets"]["overall"]) for r in runs]
    if any(d.get("x_parts") for _, d in steps):
        L += ["", "The decode step against what it must run, at the rows and attention spans "
              "its steps ran at (each shape's forwards timed on their own, weighted by its "
              "steps): a plain step's target forward; a speculative step's verification and "
              "depth x one drafter forward (a block drafter: one forward and depth Markov "
              "positions). x parts is the step's own logic and the host's gaps "
              "between replays; GPU ms is the GPU's time in the replays alone.", "",
              "| run | decode ms | GPU ms | parts ms | x parts | GPU x parts |",
              "|---|---|---|---|---|---|"]
        for name, d in steps:
            if d.get("parts_ms"):
                L.append(f"| {name} | {_fmt(d.get('decode_step_ms'))} | "
                         f"{_fmt(d.get('step_gpu_ms'))} | {_fmt(d['parts_ms'])} | "
                         f"{_fmt(d.get('x_parts'))}x | {_fmt(d.get('gpu_x_parts'))}x |")
    L += _speed_check(s.get("speed_check") or {}, runs)
    rec = s.get("recommended")
    if rec:
        L += _serving(rec)
    L += ["", "## Per-position acceptance", "",
          "Unconditional: share of steps whose draft position i was accepted. Conditional: the "
          "same among steps whose positions 1..i-1 were all accepted.", ""]
    for r in runs:
        D = len(r["datasets"]["overall"]["acceptance"])
        L += [f"**{r['name']}**", "", "| dataset | " + " | ".join(str(i) for i in range(1, D + 1))
              + " |", "|---|" + "---|" * D]
        for n in names:
            d = r["datasets"][n]
            L.append(f"| {n} | " + " | ".join(_fmt(x) for x in d["acceptance"]) + " |")
            L.append(f"| {n} (cond.) | " + " | ".join(_fmt(x) for x in d["acceptance_conditional"])
                     + " |")
        L.append("")
    L += _confidence(runs)
    L += ["## Counts", "", "| run | dataset | steps | drafted | accepted | accept rate | "
          "new tokens | lossless (identical / ties / drift / mismatches) |",
          "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        for n in names:
            d = r["datasets"][n]
            ll = d.get("lossless")
            ll = (f"{ll['identical']} / {ll['tie']} / {ll.get('drift', 0)} / {ll['mismatch']}"
                  if ll else "not checked (T>0)")
            L.append(f"| {r['name']} | {n} | {d['steps']} | {d['drafted']} | {d['accepted']} | "
                     f"{_fmt(d['accept_rate'], 3)} | {d['new_tokens']} | {ll} |")
    L += ["", "![per-position acceptance](acceptance.png)", "", "![tau per dataset](tau.png)", ""]
    return "\n".join(L)


def _confidence(runs: list[dict]) -> list[str]:
    """A block drafter's confidence head: predicted against measured acceptance per position,
    over all datasets (drafter.decoding.dspark.calibration)."""
    have = [(r["name"], r["datasets"]["overall"]["confidence"]) for r in runs
            if r["datasets"]["overall"].get("confidence")]
    if not have:
        return []
    L = ["## Confidence head", "",
         "The drafter's confidence in each draft against what verification accepted, all "
         "datasets. Conditional: the mean confidence at position i over the steps that tested "
         "it (its drafts before all accepted, not cut), and the share of those tests accepted. "
         "Unconditional: the mean running product of confidences over every step, and the "
         "share of steps that accepted position i.", ""]
    for name, c in have:
        D = len(c["predicted"])
        L += [f"**{name}**", "", "| | " + " | ".join(str(i) for i in range(1, D + 1)) + " |",
              "|---|" + "---|" * D]
        for label, key in (("predicted", "predicted"), ("measured", "measured"),
                           ("tested", "tested"),
                           ("predicted (uncond.)", "predicted_unconditional"),
                           ("measured (uncond.)", "measured_unconditional")):
            L.append(f"| {label} | " + " | ".join(_fmt(x) for x in c[key]) + " |")
        L.append("")
    return L


def _speed_check(checks: dict, runs: list[dict]) -> list[str]:
    """Per temperature: every setting's decode step timed in turns, the speedups it gives, and
    whether the temperature's speed figures hold up (drafter/measure/speedcheck.py)."""
    if not checks:
        return []
    L = ["", "## Speed check", "",
         "Every setting of a temperature decoded the same prompts again in turns "
         "(drafter/measure/speedcheck.py: the order rotated each repeat), so that a load on the "
         "machine falls on all of them alike. Interleaved speedup = τ × plain's median step / "
         "the setting's. The speedups above are unreliable when a setting's repeats spread too "
         "far, when a plain step runs further beyond its target forward than a speculative step "
         "beyond its parts, or when the passes and the turns disagree; the serving setting is "
         "then not recommended at that temperature.", "",
         "| temperature | setting | step ms per repeat | median | spread | interleaved speedup |",
         "|---|---|---|---|---|---|"]
    speedups = {r["name"]: r["datasets"]["overall"].get("interleaved_speedup") for r in runs}
    for t, c in checks.items():
        for name, x in c["interleaved"].items():
            L.append(f"| {_t(t)} | {name} | {', '.join(_fmt(v) for v in x['step_ms'])} | "
                     f"{_fmt(x['median'])} | {_fmt(x['spread'])} | "
                     f"{_fmt(speedups.get(name)) + 'x' if speedups.get(name) else '-'} |")
    for t, c in checks.items():
        if c["reliable"]:
            L += ["", f"Temperature {_t(t)}: the speed figures hold up."]
        else:
            L += ["", f"**Temperature {_t(t)}: speedups unreliable**, not printed and not used "
                  "for the serving setting:", ""] + [f"- {x}" for x in c["reasons"]]
    return L


def _serving(rec: dict) -> list[str]:
    """The serving setting per temperature and batch size (settings.recommended)."""
    by_t = rec.get("by_temperature") or {"0.0": rec}   # metrics written before: greedy only
    L = ["", "## Serving setting (expected speedup per temperature and batch size)", "",
         "For each temperature evaluated, from the chain run's conditional acceptance at that "
         "temperature and the step costs measured at each batch size (drafter/measure/tuning.py; "
         "the model calibrated on that temperature's decode step times against the costs at "
         "the batch its steps ran at); each tree run's own τ and step, and for a greedy tree, "
         "for each smaller depth the best number of nodes of its top-k, with the τ its steps "
         "give for that shape (*estimated*).", "",
         "**Expected speedup** is per decode step: τ × the plain step's time / the speculative "
         "step's, prefills left out, every row live at every step: what an engine with "
         "continuous batching gets, and what the best setting is chosen by. **As evaluated** "
         "(at the batch evaluate ran at) is the same prediction in the quantities evaluate "
         "measures: *decode speedup* = expected speedup × the share of τ evaluate's batches "
         "kept (they wait for their slowest row: continuous ones only once no prompt is left), "
         "and *speedup* with the prefills in, plain seconds / (the chain run's prefill seconds "
         "+ plain decode seconds / decode speedup). For the chain run the model is calibrated "
         "on, as evaluated equals what evaluate measured.", "",
         "| temperature | calibrated at batch | speculative step x | plain step x | "
         "share of τ kept |", "|---|---|---|---|---|"]
    for t, r in by_t.items():
        c = r["calibration"]
        L.append(f"| {_t(t)} | {c['batch']} | {c['spec_ratio']} | {c['plain_ratio']} | "
                 f"{_fmt(c['static_batch_efficiency'])} |")
    L += ["", "| temperature | batch | setting | expected τ | step ms | expected speedup | "
          "as evaluated: speedup / decode speedup |", "|---|---|---|---|---|---|---|"]
    for t, r in by_t.items():
        for b, x in r["by_batch"].items():
            for row in x["settings"]:
                best = " **(best)**" if row["setting"] == x["best"] else ""
                best += " *(estimated)*" if row.get("estimated") else ""
                ae = row.get("as_evaluated")
                L.append(f"| {_t(t)} | {b} | {row['setting']}{best} | "
                         f"{_fmt(row['expected_tau'])} | {_fmt(row['step_ms'])} | "
                         f"{_fmt(row['speedup'])}x | "
                         + (f"{_fmt(ae['speedup'])}x / {_fmt(ae['decode_speedup'])}x |"
                            if ae else "- |"))
    for t, r in by_t.items():
        for b, x in r["by_batch"].items():
            slower = x["expected_speedup"] < 1
            L += ["", f"Temperature {_t(t)}, batch {b}: "
                  + (f"no setting is expected to beat plain decoding (the best, {x['best']}, "
                     f"{_fmt(x['expected_speedup'])}x): serve without the drafter; its flags:"
                     if slower else f"serve with {x['best']}:"), ""]
            L += [f"- {eng}: `{f}`" for eng, f in x["flags"].items() if f]
    for t, r in by_t.items():
        got = r.get("measured")
        if not got:
            continue
        ae = got.get("expected_as_evaluated") or {}
        L += ["", f"Measured at batch {got['batch']}, temperature {_t(t)} (the run "
              f"`{got['run']}`): speedup **{_fmt(got['speedup'])}x** against "
              f"{_fmt(ae.get('speedup'))}x expected as evaluated; without the prefills "
              f"{_fmt(got['decode_speedup'])}x against {_fmt(ae.get('decode_speedup'))}x; "
              f"per step (an engine with continuous batching) {_fmt(got['expected_speedup'])}x "
              f"expected; τ {_fmt(got['tau'])}."]
    return L


def _t(t) -> str:
    return f"{float(t):g}"


def plots(run: Run, runs: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from drafter.core.rundir import atomic_open

    names = [n for n in runs[0]["datasets"] if n != "overall"] + ["overall"]
    cols = min(3, len(runs))
    rows = math.ceil(len(runs) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, r in zip(axes.flat, runs):
        for j, n in enumerate(names):
            d = r["datasets"][n]
            x = list(range(1, len(d["acceptance"]) + 1))
            ax.plot(x, [v if v is not None else math.nan for v in d["acceptance"]], "-o",
                    color=f"C{j}", label=f"{n}", ms=3)
            ax.plot(x, [v if v is not None else math.nan for v in d["acceptance_conditional"]],
                    "--", color=f"C{j}", alpha=0.6)
        ax.set_title(r["name"], fontsize=9)
        ax.set_xlabel("draft position (solid: unconditional, dashed: conditional)", fontsize=8)
        ax.set_ylim(0, 1.02)
        ax.set_xticks(x)                                    # draft positions are whole numbers
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(runs):]:
        ax.axis("off")
    fig.tight_layout()
    with atomic_open(run.eval_plot("acceptance"), "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(names) * max(1, len(runs)) / 2), 3.6))
    w = 0.8 / len(runs)
    for j, r in enumerate(runs):
        ax.bar([i + j * w for i in range(len(names))],
               [r["datasets"][n].get("tau") or 0 for n in names], w, label=r["name"])
    ax.set_xticks([i + w * (len(runs) - 1) / 2 for i in range(len(names))], names)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("τ (tokens per target forward)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_open(run.eval_plot("tau"), "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)


def report(run_dir) -> int:
    """`drafter report RUN_DIR`: print the evaluation report."""
    run = Run(run_dir)
    p = run.eval_report()
    if not p.exists():
        raise MissingInput(f"{p} not found: run `drafter evaluate CONFIG` first "
                           f"(or `drafter run CONFIG`)")
    print(p.read_text(), end="")
    m = run.eval_metrics()
    if m.exists() and not read_json(m).get("lossless", True):
        return 1
    return 0

