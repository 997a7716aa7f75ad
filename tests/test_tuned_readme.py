"""The tuned serving settings in the export READMEs (drafter/measure/tuned.py): a real export of a
tiny random drafter, evaluate's metrics built with drafter.measure.tuning.recommend from made-up
acceptance and step costs; the section per temperature and batch size with each dir's own path
in the flags, the
same README when written twice, export's manifest and lint untouched (export stays done, evaluate
stays up to date), and a re-export that keeps the section only for the weights evaluate measured."""
from __future__ import annotations

import json

from test_export import make_run

from drafter.core import config as C
from drafter.core.rundir import Run, atomic_json, sealed
from drafter.measure.tuning import flags, recommend
from drafter.export.check import run_checks
from drafter.export.engines import README_FILE
from drafter.measure.tuned import BEGIN, END, TITLE, add_tuned_settings, splice
from drafter.run import pipeline

ALPHA = [0.8, 0.6, 0.5]           # conditional acceptance of a greedy chain of K=3
ALPHA_T1 = [0.5, 0.3, 0.2]        # the same chain sampling at temperature 1
TIMINGS = {1: {"target_ms": 10.0, "verify_ms": 10.5, "draft_ms": 0.6},
           64: {"target_ms": 14.0, "verify_ms": 20.0, "draft_ms": 1.5}}
TREE = {"label": "tree depth=4 topk=4 tokens=16", "tau": 3.4, "depth": 4, "topk": 4, "tokens": 16,
        "timings": {1: {"target_ms": 10.0, "verify_ms": 11.0, "draft_ms": 0.9},
                    64: {"target_ms": 14.0, "verify_ms": 90.0, "draft_ms": 3.0}}, "ratio": 1.1}


def metrics_for(drafter: str, lossless: bool = True) -> dict:
    """evaluate/metrics.json as evaluate writes it, its serving setting from tuning.recommend."""
    by_batch = recommend(ALPHA, TIMINGS, 3, {"spec_ratio": 1.2, "plain_ratio": 1.05}, [TREE],
                         drafter)
    # at T=1: lower acceptance, a slower sampling step, the tree's sampled tau
    by_batch_t1 = recommend(ALPHA_T1, TIMINGS, 3, {"spec_ratio": 1.5, "plain_ratio": 1.1},
                            [{**TREE, "tau": 1.7, "ratio": 1.6}], drafter)
    greedy = {"temperature": 0.0,
              "calibration": {"batch": 64, "spec_ratio": 1.2, "plain_ratio": 1.05,
                              "static_batch_efficiency": 0.89},
              "by_batch": by_batch}
    sampled = {"temperature": 1.0,
               "calibration": {"batch": 64, "spec_ratio": 1.5, "plain_ratio": 1.1,
                               "static_batch_efficiency": 0.81},
               "by_batch": by_batch_t1,
               "measured": {"batch": 64, "temperature": 1.0, "run": "drafter: chain K=1, T=1",
                            "tau": 1.5, "speedup": 1.05, "decode_speedup": 1.12,
                            "expected_speedup": by_batch_t1["64"]["expected_speedup"],
                            "expected_as_evaluated": {"speedup": 1.04,
                                                      "decode_speedup": 1.13}}}

    def run(name, who, method, tau, speedup, **kw):
        return {"name": name, "drafter": who, "path": drafter, "method": method,
                "temperature": 0.0, **kw, "timing": {"by_batch": TIMINGS},
                "datasets": {"overall": {"tau": tau, "speedup": speedup, "decode_speedup":
                                         speedup + 0.1, "acceptance_conditional": ALPHA}}}

    return {
        "lossless": lossless, "mismatches": 0, "ties": 0, "drift": 0,
        "settings": {"target": "tiny", "device": "cpu", "dtype": "float32", "drafter": drafter,
                     "baseline": None, "batch_size": 64, "max_new_tokens": 32,
                     "temperatures": [0.0, 1.0],
                     "datasets": {"mtbench": {"path": "builtin", "records": 8, "prompts": 8}},
                     "recommended": {**greedy, "by_temperature": {"0.0": greedy,
                                                                  "1.0": sampled}}},
        "runs": [run("drafter: chain K=3, T=0", "drafter", "chain", 2.52, 1.31, k=3),
                 run("drafter: tree depth=4 topk=4 tokens=16, T=0", "drafter", "tree", 3.4, 1.6,
                     depth=4, topk=4, tokens=16),
                 run("baseline: chain K=3, T=0", "baseline", "chain", 1.9, 1.1, k=3)],
    }


def exported(tmp_path, tiny_target, *overrides):
    """A run whose export step ran through the pipeline (train's manifest stands in)."""
    cfg, run = make_run(tmp_path, tiny_target, *overrides)
    atomic_json(run.manifest("train"), {"step": "train", "counts": {}, "fingerprint": {}})
    pipeline.run_step(cfg, "export")
    return cfg, run


def readmes(run: Run) -> dict[str, str]:
    return {f: (run.export(f) / README_FILE).read_text() for f in ("native", "speculators")}


def test_the_recommendation_mixes_a_tree_and_a_chain():
    rec = recommend(ALPHA, TIMINGS, 3, {"spec_ratio": 1.2, "plain_ratio": 1.05}, [TREE])
    assert rec["1"]["best"] == TREE["label"] and rec["1"]["flags"]["vllm"] is None
    assert rec["64"]["best"] == "chain K=2" and rec["64"]["flags"]["vllm"]
    t1 = metrics_for("D")["settings"]["recommended"]["by_temperature"]["1.0"]["by_batch"]
    assert t1["1"]["best"] == "chain K=2" and t1["64"]["best"] == "chain K=1"


def test_readmes_carry_each_dirs_flags_and_export_stays_done(tiny_target, tmp_path):
    cfg, run = exported(tmp_path, tiny_target)
    native, spec = (run.export(f).resolve() for f in ("native", "speculators"))
    before = readmes(run)
    manifest = run.manifest("export").read_bytes()
    ev_fp = pipeline.fingerprint(cfg, run, "evaluate")
    metrics = metrics_for(str(run.export("native")))   # the dir evaluate loads (run-relative)
    atomic_json(run.eval_metrics(), metrics)
    # evaluate finished: the pipeline's manifest of it, on the export manifest as it is now
    atomic_json(run.manifest("evaluate"), sealed({"step": "evaluate", "fingerprint": ev_fp}))

    out = add_tuned_settings(run, metrics)
    assert out == [run.export("native") / README_FILE, run.export("speculators") / README_FILE]
    after = readmes(run)
    for fmt, text in after.items():
        assert text.count(BEGIN) == text.count(END) == text.count(TITLE) == 1
        assert text.index("## Serve it") < text.index(TITLE) < text.index("## Aux layer ids")
        assert splice(text, None) == before[fmt]          # nothing else of the README changed
        assert str(run.eval_report().resolve()) in text
        # per temperature, greedy first
        body = text.split(BEGIN)[1].split(END)[0]
        greedy, sampled = body.split("### Temperature 0 (greedy)")[1].split("### Temperature 1")
        sampled = sampled.split("### Measured")[0]
        # greedy, batch 1: the tree (SGLang only, always the native dir); vLLM its best chain
        assert "#### Batch 1: tree depth=4 topk=4 tokens=16, expected speedup" in greedy
        assert flags(str(native), tree={"depth": 4, "topk": 4, "tokens": 16})["sglang"] in greedy
        assert "vLLM cannot serve this tree" in greedy
        assert "#### Batch 64: chain K=2, expected speedup" in greedy
        assert flags(str(native), 2)["sglang"] in greedy
        # sampling at T=1: chains, their own flags
        assert "#### Batch 1: chain K=2, expected speedup" in sampled
        assert "#### Batch 64: chain K=1, expected speedup" in sampled
        assert flags(str(native), 1)["sglang"] in sampled and "cannot serve" not in sampled
        # T=1: slower than plain decoding at both batch sizes, said so; greedy is faster
        t1 = metrics["settings"]["recommended"]["by_temperature"]["1.0"]["by_batch"]
        assert t1["1"]["expected_speedup"] < 1 and t1["64"]["expected_speedup"] < 1
        assert sampled.count("No setting is expected to beat plain decoding here") == 2
        assert "No setting is expected" not in greedy
        assert "Temperature 1: step model calibrated on the decode steps at batch 64: " \
               "speculative x1.5" in body
        assert "speedup 1.05x (1.04x expected with evaluate's batches and prefills), 1.12x " \
               "without the prefills (1.13x expected)" in body
        assert "per decode step (prefills left out" in body
        # the measured runs of the drafter (not the baseline's)
        assert "| drafter: chain K=3, T=0 | 2.52 | 1.31x | 1.41x |" in text
        assert "baseline" not in text.split(TITLE)[1].split(END)[0]
    # vLLM's flags name the dir the README sits in
    assert f"vllm serve {tiny_target} " + flags(str(native), 2)["vllm"] in after["native"]
    assert flags(str(spec), 2)["vllm"] in after["speculators"]
    assert str(spec) not in after["native"] and "reads the native layout" in after["speculators"]
    assert flags(str(native), 2)["vllm"] not in after["speculators"]
    side = json.loads(run.eval_tuned().read_text())
    assert sorted(side["weights"]) == ["native", "speculators"]

    # idempotent: the same README, not rewritten
    mtime = (run.export("native") / README_FILE).stat().st_mtime_ns
    assert add_tuned_settings(run, json.loads(run.eval_metrics().read_text())) == out
    assert readmes(run) == after
    assert (run.export("native") / README_FILE).stat().st_mtime_ns == mtime

    # export's own record and checks accept the dirs: manifest untouched, still done and
    # skipped, not damaged; evaluate's input fingerprint unchanged; `drafter check` passes
    assert run.manifest("export").read_bytes() == manifest
    assert pipeline.damage(run, "export") is None
    assert pipeline.up_to_date(run, "export", pipeline.fingerprint(cfg, run, "export"))
    m = json.loads(manifest)
    assert pipeline.run_step(cfg, "export")["started"] == m["started"]     # skipped
    assert pipeline.up_to_date(run, "evaluate", pipeline.fingerprint(cfg, run, "evaluate"))
    for fmt in ("native", "speculators"):
        assert run_checks(run.export(fmt), str(tiny_target)).ok


def test_section_left_out_for_another_drafter_or_a_failed_check(tiny_target, tmp_path):
    cfg, run = exported(tmp_path, tiny_target)
    before = readmes(run)
    # evaluate measured a checkpoint, not this export: nothing written
    assert add_tuned_settings(run, metrics_for(str(run.checkpoint(20)))) == []
    assert readmes(run) == before and not run.eval_tuned().exists()
    add_tuned_settings(run, metrics_for(str(run.export("speculators"))))  # the other layout
    assert all(TITLE in t for t in readmes(run).values())
    # a later evaluate that is not lossless, or that measured another drafter: taken out again
    assert add_tuned_settings(run, metrics_for(str(run.export("native")), lossless=False)) == []
    assert readmes(run) == before and not run.eval_tuned().exists()
    add_tuned_settings(run, metrics_for(str(run.export("native"))))
    add_tuned_settings(run, metrics_for(str(tmp_path / "elsewhere")))
    assert readmes(run) == before


def test_reexport_keeps_the_section_only_for_the_measured_weights(tiny_target, tmp_path):
    cfg, run = exported(tmp_path, tiny_target)
    metrics = metrics_for(str(run.export("native")))
    atomic_json(run.eval_metrics(), metrics)
    add_tuned_settings(run, metrics)
    tuned = readmes(run)
    # `drafter export --force`: the same checkpoint, byte-identical weights: the section is back
    m = pipeline.run_step(cfg, "export", force=True)
    assert readmes(run) == tuned
    assert m["counts"]["native_bytes"] == sum(p.stat().st_size
                                              for p in run.export("native").iterdir())
    # metrics.json rewritten by a later evaluate that wrote no section: left out
    atomic_json(run.eval_metrics(), {**metrics, "ties": 1})
    pipeline.run_step(cfg, "export", force=True)
    assert all(TITLE not in t for t in readmes(run).values())
    # another checkpoint (export.checkpoint=best picks step 10): evaluate measured other weights
    atomic_json(run.eval_metrics(), metrics)
    pipeline.run_step(cfg, "export", force=True)
    assert readmes(run) == tuned
    cfg2 = C.load(None, [f"run_dir={run.root}", f"target.model={tiny_target}",
                         "export.checkpoint=best"])
    pipeline.run_step(cfg2, "export")
    assert json.loads((run.export("native") / "drafter.json").read_text())["step"] == 10
    assert all(TITLE not in t for t in readmes(run).values())


def test_splice_inserts_replaces_and_removes():
    base = "# t\n\n## Serve it\n\nx\n\n## Aux layer ids\n\ny\n"
    one = splice(base, "## S\n\na\n")
    assert one == f"# t\n\n## Serve it\n\nx\n\n{BEGIN}\n## S\n\na\n{END}\n\n## Aux layer ids\n\ny\n"
    assert splice(one, "## S\n\na\n") == one
    two = splice(one, "## S\n\nb\n")
    assert two.count(BEGIN) == 1 and "\nb\n" in two and "\na\n" not in two
    assert splice(two, None) == base and splice(base, None) == base
    tail = splice("# t\n", "## S\n")            # no anchor: at the end
    assert tail == f"# t\n\n{BEGIN}\n## S\n{END}\n" and splice(tail, None) == "# t\n"
