"""The learner beside serving: rounds that train a candidate from the serving drafter on the
kept requests, judge it against that drafter on held-out ones, and propose it when it is better.

    drafter learn CONFIG --learner       # started (and restarted) by `drafter learn`

A round starts when learn.round_samples new kept requests of the training share have come in.
Round N (RUN_DIR/learn/rounds/rNNNN/, a run dir of its own):

1. round.json: the drafter it starts from (`base`, the one served then), the newest kept
   request it trains on, and the held-out requests it is judged on (the newest
   learn.eval_prompts), copied into holdout.json; train.parquet: every kept request of the
   training share, as a token file (prompt unmasked, the target's answer in the loss).
2. Training: drafter/steps/train.py's own loop (`fit`: losses, optimizer, schedule, metrics and
   checkpoints under rNNNN/train/), from the base drafter's weights, with train.* as configured
   (train.max_steps and train.epochs bound a round), the target's hidden states captured in
   this process as online training does (drafter/features/capture.py): vLLM cannot hand them
   out while it drafts (docs/learn.md). A killed round resumes from its last checkpoint.
3. The candidate, RUN_DIR/learn/versions/vNNNN/, judged against the base on the held-out
   requests (drafter/learn/judge.py) into judged.json; when better, proposal.json for the server
   to swap in. Then the round's copies of traffic (train.parquet, holdout.json) and its
   checkpoints go.

The target is loaded twice: once for the capture, once for the evaluator's decoder, which
switches the model's attention to its own static-cache form.
"""
from __future__ import annotations

import copy
import logging
import shutil
import time

from drafter.core.rundir import Run, atomic_json, read_json
from drafter.learn import judge, traffic, versions

log = logging.getLogger("drafter")

IDLE_SECONDS = 2.0
PROPOSAL_WAIT_S = 300.0
# intra-op threads on a CPU, where vLLM's own threads hold the cores: torch's threads wait for
# each other at every op, and one of them descheduled stalls the rest, so the judge's many small
# ops ran tens of times slower with two threads than with one (docs/learn.md, "On a CPU")
CPU_THREADS = 1


class Models:
    """The target twice (capture, decoding), its tokenizer's stop ids and the target's info."""

    def __init__(self, cfg, run: Run):
        from drafter.core.target import load_model, load_tokenizer, pick_device, pick_dtype
        from drafter.decoding.decode import Decoder, stop_ids_of
        from drafter.export.engines import target_info

        t = cfg.target
        self.run = run
        self.device = pick_device(t)
        if str(self.device) == "cpu":
            import torch

            torch.set_num_threads(CPU_THREADS)
        self.dtype = pick_dtype(t, self.device)
        self.capture_model = load_model(t, self.device, self.dtype)
        decode_model = load_model(t, self.device, self.dtype)
        self.decoder = Decoder(decode_model, max_batch=cfg.evaluate.batch_size)
        self.stop = stop_ids_of(load_tokenizer(t), decode_model)
        self.target = target_info(t.model, t)

    def capture(self, cfg, drafter):
        from drafter.features.capture import Capture

        e = cfg.extract
        return Capture(self.capture_model, drafter.cfg.aux_layer_ids, drafter.d2t.cpu(),
                       drafter.t2d.cpu(), teacher=e.teacher, topk=e.topk,
                       batch_tokens=e.batch_tokens)

    def load(self, version: str, device=None, dtype=None):
        """A version as drafter.train.model.Drafter (the target's table as its embed_tokens)."""
        from drafter.export.enginedir import load_drafter_dir

        return load_drafter_dir(versions.path_of(self.run, version), device=device or self.device,
                                dtype=dtype or self.dtype, target=self.target)


def _state(run: Run) -> dict:
    p = run.learn("learner.json")
    return read_json(p) if p.exists() else {"round": 0, "upto": ""}


def next_round(run: Run, lc) -> dict | None:
    """The round to run now: an unfinished one (resumed), else a new one when enough new
    kept requests came in (its round.json and data written here), else None."""
    st = _state(run)
    n = st["round"] + 1
    rdir = run.learn_round(n)
    if (rdir / "round.json").exists():
        return read_json(rdir / "round.json")
    recs = traffic.kept(run, lc)
    train = [r for r in recs if r["split"] == "train" and r["output_ids"]]
    hold = [r for r in recs if r["split"] == "holdout" and r["output_ids"]]
    new = [r for r in train if r["id"] > st["upto"]]
    if len(new) < lc.round_samples or len(hold) < 2:
        return None
    cur = versions.serving(run)
    if cur is None:
        return None
    hold = hold[-lc.eval_prompts:]
    rdir.mkdir(parents=True, exist_ok=True)
    traffic.write_tokens(train, rdir / "train.parquet")
    atomic_json(rdir / "holdout.json", hold)
    rec = {"round": n, "base": cur["version"], "upto": train[-1]["id"], "samples": len(train),
           "new": len(new), "holdout": len(hold), "time": time.time()}
    atomic_json(rdir / "round.json", rec)   # last: the round exists once its data does
    return rec


def round_config(cfg, rdir):
    """train's config for a round: the configured train section, the round's folder as the
    run dir, resumed from its own checkpoints."""
    rc = copy.deepcopy(cfg)
    rc.run_dir = str(rdir)
    rc.train.resume = "auto"
    rc.train.online = True
    return rc


def run_round(cfg, run: Run, models: Models, rec: dict) -> dict:
    """Train, export, judge and (when better) propose round rec["round"] (module doc)."""
    import torch

    from drafter.core.dist import read_env
    from drafter.steps.train import fit
    from drafter.train.batches import Source
    from drafter.train.checkpoint import resume_from
    from drafter.train.trainer import compiles_hold

    n, base = rec["round"], rec["base"]
    rdir = run.learn_round(n)
    vpath = run.learn_version(n)
    if not (vpath / versions.META).exists():
        rc = round_config(cfg, rdir)
        rrun = Run(rdir)
        # on the CPU in float32, as train builds its drafter: fit moves the trained modules to
        # the device and reads the frozen table where it is
        drafter = models.load(base, device="cpu", dtype=torch.float32).train()
        cap = models.capture(cfg, drafter)
        log.info("learn: round %d: training from %s on %d kept requests", n, base,
                 rec["samples"])
        t0 = time.perf_counter()
        with compiles_hold(cap.lock):   # as train's online mode: no capture while compiling
            out = fit(rc, rrun, read_env(str(models.device)), drafter,
                      Source.online(rdir / "train.parquet", cap), None, cap.head)
        ck = resume_from(rrun, rc.train)
        versions.write_version(run, n, drafter, models.target, _export_dtype(cfg), {
            "round": n, "base": base, "samples": rec["samples"], "steps": out["final_step"],
            "checkpoint": ck.name if ck else None,
            "train_seconds": round(time.perf_counter() - t0, 1)})
    hold = read_json(rdir / "holdout.json")
    k, max_new = cfg.export.speculative_tokens, cfg.evaluate.max_new_tokens
    t0 = time.perf_counter()
    hb = judge.acceptance(models.decoder, models.load(base), hold, k, max_new, models.stop,
                          cfg.evaluate.seed)
    hc = judge.acceptance(models.decoder, models.load(versions.name(n)), hold, k, max_new,
                          models.stop, cfg.evaluate.seed)
    verdict = judge.compare(hb, hc)
    res = {"round": n, "base": base, "candidate": versions.name(n), **verdict,
           "temperatures": sorted({float(r["temperature"]) for r in hold}),
           "judge_seconds": round(time.perf_counter() - t0, 1), "time": time.time()}
    atomic_json(rdir / "judged.json", res)
    log.info("learn: round %d: %s tau %s against %s's %s on %d held-out requests (gain %s, "
             "lower bound %s): %s", n, versions.name(n), verdict["tau_cand"], base,
             verdict["tau_base"], verdict["prompts"], verdict["gain"], verdict["lower"],
             "proposed" if verdict["better"] else "kept aside")
    if verdict["better"]:
        versions.propose(run, {"version": versions.name(n), "based_on": base, "round": n,
                               "figures": verdict})
    return res


def finish_round(run: Run, rec: dict) -> None:
    """The round judged: its copies of traffic and its checkpoints go; the state moves on."""
    rdir = run.learn_round(rec["round"])
    for name in ("train.parquet", "holdout.json"):
        (rdir / name).unlink(missing_ok=True)
    shutil.rmtree(rdir / "train", ignore_errors=True)
    atomic_json(run.learn("learner.json"), {"round": rec["round"], "upto": rec["upto"]})


def _export_dtype(cfg):
    from drafter.export.engines import DTYPES

    return DTYPES[cfg.export.dtype]


def main(cfg, once: bool = False) -> int:
    """Rounds until stopped (SIGTERM from `drafter learn`); `once`: at most one round."""
    run = Run.of(cfg)
    models = Models(cfg, run)
    log.info("learn: learner ready (target on %s, %s)", models.device, models.dtype)
    while True:
        rec = next_round(run, cfg.learn)
        if rec is None:
            if once:
                return 0
            time.sleep(IDLE_SECONDS)
            continue
        if not (run.learn_round(rec["round"]) / "judged.json").exists():
            run_round(cfg, run, models, rec)
        finish_round(run, rec)
        versions.prune(run)
        if once:
            return 0
        # the next round starts from the drafter served once the server took the proposal
        t0 = time.time()
        while versions.proposal(run) is not None and time.time() - t0 < PROPOSAL_WAIT_S:
            time.sleep(0.5)
