"""`drafter check DIR [--target MODEL_OR_CONFIG] [--trust-remote-code] [--strict] [--json]`: lint
any EAGLE-3 directory (ours or a published one, native or speculators layout) for the known
acceptance killers (ENGINES.md, "Why drafters accept less in an engine than offline"), or a block
drafter's (DSpark, DFlash) native dir against what vLLM's classes read. Each check is named and
ends pass, warn or fail with a one-line reason; the exit code is 1 when any check fails, and with
--strict (a CI gate, as yamllint's and mkdocs's --strict) when any warns too. The static checks
are in drafter/export/rules.py (block dirs: drafter/export/dspark_rules.py); this module runs
them, runs the acceptance smoke test (EAGLE-3 dirs) and reports.

    drafter check runs/x/export/native --target meta-llama/Llama-3.1-8B-Instruct
    drafter check some/published-eagle3 --target path/to/target/config.json --json

The target (an HF id, folder, .gguf, builtin:NAME, or a config.json) gives the layer count, hidden
size, vocab size, RoPE and context that several checks compare against. Without --target the
dir's own hints are used: drafter.json (written by `drafter export`), or a speculators verifier
that is a local folder.

The reasoning: docs/internals.md, "Module notes", check.py.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from drafter.export import engines as E
from drafter.export.dspark_rules import BLOCK_CHECKS
from drafter.export.enginedir import EngineDir, read_dir
from drafter.export.readme_check import c_sampled_drafts
from drafter.export.rules import CHECKS, FAIL, PASS, WARN, Check, Ctx, c_target
from drafter.export.support import SKIP, c_engine_support
from drafter.export.trained import c_greedy_answers


@dataclass
class Report:
    dir: str
    format: str | None
    target: dict | None
    target_source: str | None
    checks: list[Check]

    @property
    def counts(self) -> dict[str, int]:
        return {s: sum(c.status == s for c in self.checks) for s in (PASS, WARN, FAIL, SKIP)}

    @property
    def ok(self) -> bool:
        return self.counts[FAIL] == 0

    def status(self, name: str) -> str | None:
        return next((c.status for c in self.checks if c.name == name), None)

    def to_dict(self) -> dict:
        return {"dir": self.dir, "format": self.format, "target": self.target,
                "target_source": self.target_source, "ok": self.ok, "counts": self.counts,
                "checks": [asdict(c) for c in self.checks]}


# ---------------------------------------------------------------------- the acceptance smoke test
SMOKE_PROMPTS, SMOKE_TOKENS = 4, 48     # few: the target writes them before the report
SMOKE_WARN = 0.2    # step-0 accuracy under which engines accept few of the drafts: weak
# A drafter predicts nothing when a uniform guess over its draft vocab would hit as many of the
# same tokens with probability SMOKE_ALPHA or more (the binomial tail: at 4 x 48 tokens and
# 1,024 draft ids, 2 hits or fewer). A drafter trained even a few steps hits the frequent tokens
# first, far above that (tests/test_check.py trains one).
SMOKE_ALPHA = 1e-3


@torch.no_grad()
def acceptance(path, spec: str, k: int = 3, prompts: int = SMOKE_PROMPTS,
               new_tokens: int = SMOKE_TOKENS, trust_remote_code: bool = False) -> dict:
    """Teacher-forced acceptance of the drafter in `path` on text the target `spec` writes
    itself: greedy answers to the first `prompts` builtin quickstart prompts, captured the way
    extract does (drafter/features/capture.py, at the drafter's own layer ids and vocab), scored
    the way training scores validation (TTT metrics over the answer tokens). -> {"acc" per step,
    "tau" (expected acceptance length of a greedy chain of k drafts), "tokens", "prompts", and
    the step-0 accuracies two guesses that ignore the text would have: "chance" (uniform over
    the draft vocab) and "blind" (always the answers' most frequent draft-vocab token)}."""
    from types import SimpleNamespace

    from drafter.core import target as T
    from drafter.core.config import TargetConfig
    from drafter.core.dist import Dist
    from drafter.data.sources import load_prompts
    from drafter.export.enginedir import load_drafter_dir
    from drafter.features.capture import Capture
    from drafter.train.batches import Source, device_batch, host_batch, model_inputs
    from drafter.train.metrics import Meter
    from drafter.train.ttt import TTT

    tcfg = TargetConfig(model=spec, trust_remote_code=trust_remote_code)
    device = T.pick_device(tcfg)
    model = T.load_model(tcfg, device=device)
    tok = T.load_tokenizer(tcfg)
    drafter = load_drafter_dir(path, device=device, dtype=torch.float32,
                               target=E.target_info(spec, tcfg))
    stop = [i for i in {tok.eos_token_id, getattr(model.generation_config, "eos_token_id", None)}
            if isinstance(i, int)]
    samples = []
    for rec in load_prompts("builtin:quickstart-prompts", max_n=prompts):
        text = tok.apply_chat_template(rec["messages"], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, top_p=None,
                             top_k=None, temperature=None, eos_token_id=stop or None,
                             pad_token_id=tok.pad_token_id)[0].tolist()
        n = ids.shape[1]
        samples.append({"input_ids": out, "loss_mask": [0] * n + [1] * (len(out) - n)})
    answers = torch.tensor([t for s in samples for t, m in zip(s["input_ids"], s["loss_mask"])
                            if m], dtype=torch.long)
    in_vocab = answers[drafter.t2d.cpu()[answers]]
    blind = in_vocab.bincount().max().item() / len(answers) if len(in_vocab) else 0.0
    chance = len(in_vocab) / max(len(answers), 1) / drafter.cfg.draft_vocab_size
    cap = Capture(model, drafter.cfg.aux_layer_ids, drafter.d2t.cpu(), drafter.t2d.cpu(),
                  teacher="hidden", out_dtype=torch.float32)
    src = Source.memory(cap(samples))
    T_max = max(src.lengths)
    tc = SimpleNamespace(method="eagle3", ttt_steps=k, ttt_decay=1.0)
    hb = host_batch(src, [[i] for i in range(len(src))], len(src), T_max, tc,
                    drafter.embed_tokens.weight)
    d = device_batch(hb, torch.device(device), cap.head, fused=False)
    meter = Meter(k, torch.device(device))
    meter.add(TTT(drafter, attention="sdpa")(**model_inputs(d)), d)
    m = meter.read(Dist(device=torch.device(device)), 1.0)
    return {"acc": m["acc"], "tau": m["sim_tau"], "tokens": int(d["n_lm"][0]),
            "prompts": len(samples), "k": k, "chance": chance, "blind": blind}


def c_acceptance(path, spec: str, fmt: str | None, config: dict,
                 trust_remote_code: bool = False) -> list[Check]:
    sc = config.get("speculators_config") or {}
    k = ((sc.get("proposal_methods") or [{}])[0]).get("speculative_tokens") or 3
    a = acceptance(path, spec, k=int(k), trust_remote_code=trust_remote_code)
    if not a["tokens"]:
        return [Check("acceptance", WARN, "the target wrote no answer tokens to score")]
    return [smoke_verdict(a)]


def at_least(hits: int, n: int, p: float) -> float:
    """P(X >= hits) for X ~ Binomial(n, p)."""
    if hits <= 0 or p >= 1:
        return 1.0
    if p <= 0:
        return 0.0
    below = sum(math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
                         + k * math.log(p) + (n - k) * math.log1p(-p))
                for k in range(min(hits, n + 1)))
    return max(0.0, 1.0 - below)


def smoke_verdict(a: dict) -> Check:
    """The acceptance check from `acceptance`'s figures: pass at SMOKE_WARN or more; fail when
    chance explains the hits (a uniform guess over the draft vocab reaches them with probability
    SMOKE_ALPHA or more); weak (a warning) between."""
    n, acc0, p = a["tokens"], a["acc"][0], a["chance"]
    hits = round(acc0 * n)
    what = (f"step-0 accuracy {acc0:.2f} ({hits} of {n} tokens the target wrote for "
            f"{a['prompts']} prompts, teacher-forced), expected tau {a['tau']:.2f} (greedy chain "
            f"K={a['k']})")
    if acc0 >= SMOKE_WARN:
        return Check("acceptance", PASS, what)
    if at_least(hits, n, p) >= SMOKE_ALPHA:
        return Check("acceptance", FAIL, f"{what}: the drafter predicts nothing, as a random "
                     f"guess over its draft vocab would (random weights, wrong aux layer ids or "
                     f"norms, or trained for another target)")
    return Check("acceptance", WARN, f"{what}: weak but working: it predicts some of the "
                 f"target's tokens (always guessing the most frequent one would score "
                 f"{a['blind']:.2f}), yet engines will accept few drafts (undertrained, or "
                 f"trained on other text than this target writes)")


# ---------------------------------------------------------------------------------- run them
def _hinted_target(ed: EngineDir) -> tuple[E.TargetInfo | None, str | None]:
    t = (ed.meta or {}).get("target")
    if isinstance(t, dict):
        try:
            return E.TargetInfo(**t), "drafter.json"
        except TypeError:
            pass
    ver = ((ed.config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    if ver and (Path(ver) / "config.json").is_file():
        return E.target_info(str(Path(ver) / "config.json")), "speculators verifier"
    return None, None


def run_checks(path, target: E.TargetInfo | str | None = None,
               serving_context: int | None = None, smoke: bool = False,
               trust_remote_code: bool = False, engines: bool = True) -> Report:
    """Every check on one dir. `target`: a TargetInfo, a spec for drafter.core.target / a
    config.json path, or None (use the dir's hints). `smoke`: with a target spec that names a
    model, also the acceptance smoke test (loads the target). `trust_remote_code`: the target's
    own code may run (target.trust_remote_code). `engines`: also the engine rule (the installed
    vLLM / SGLang serve EAGLE-3 for the target: export/support.py). A dir that cannot be read
    gives one failed check."""
    from drafter.core.config import TargetConfig

    path = Path(path)
    try:
        ed = read_dir(path)
    except E.EngineDirError as e:
        return Report(str(path), None, None, None, [Check("format", FAIL, str(e))])
    source, spec = None, target if isinstance(target, str) else None
    if isinstance(target, str):
        tcfg = TargetConfig(model=target, trust_remote_code=trust_remote_code)
        target, source = E.target_info(target, tcfg), "--target"
    elif target is not None:
        source = "--target"
    else:
        target, source = _hinted_target(ed)
    x = Ctx(ed, target, serving_context)
    checks = c_target(x, source)
    for fn in BLOCK_CHECKS if ed.block else CHECKS:
        try:
            checks += fn(x)
        except Exception as e:  # noqa: BLE001 - one broken field must not hide the other checks
            checks.append(Check(fn.__name__[2:], FAIL, f"could not be checked: "
                                f"{type(e).__name__}: {e}"))
    checks += c_sampled_drafts(path)
    checks += c_greedy_answers(path, ed.meta)
    if engines:
        checks += c_engine_support(target)
    if smoke and spec is not None:
        if Path(spec).expanduser().suffix == ".json":
            checks.append(Check("acceptance", WARN, f"{spec} is a config.json: no weights to "
                                "run (give the model to measure acceptance)"))
        elif ed.block:
            checks.append(Check("acceptance", SKIP, "the acceptance smoke test runs EAGLE-3 "
                                "drafters only: a block drafter's is not run here"))
        else:
            try:
                checks += c_acceptance(path, spec, ed.fmt, ed.config, trust_remote_code)
            except Exception as e:  # noqa: BLE001 - a drafter that cannot run predicts nothing
                checks.append(Check("acceptance", FAIL, f"the drafter cannot run on the target: "
                                    f"{type(e).__name__}: {e}"))
    return Report(str(path), ed.fmt, target.to_dict() if target else None, source, checks)


def format_report(r: Report) -> str:
    head = f"drafter check {r.dir}"
    if r.format:
        head += f"  ({r.format} layout"
        head += f"; target {r.target['name_or_path']} from {r.target_source})" if r.target else ")"
    width = max(len(c.name) for c in r.checks)
    lines = [head] + [f"  {c.status.upper():<4}  {c.name:<{width}}  {c.reason}" for c in r.checks]
    n = r.counts
    lines.append(f"{n[FAIL]} fail, {n[WARN]} warn, {n[PASS]} pass, {n[SKIP]} skipped")
    return "\n".join(lines)


def main(args) -> int:
    """CLI entry: args.dir, args.target, args.json, args.no_smoke, args.trust_remote_code,
    args.strict. Returns 1 when any check fails, or (strict) warns."""
    report = run_checks(args.dir, args.target, smoke=not getattr(args, "no_smoke", False),
                        trust_remote_code=getattr(args, "trust_remote_code", False))
    strict = getattr(args, "strict", False)
    if args.json:
        print(json.dumps({**report.to_dict(), "strict": strict}, indent=2))
    else:
        print(format_report(report))
    return 0 if report.ok and not (strict and report.counts[WARN]) else 1
