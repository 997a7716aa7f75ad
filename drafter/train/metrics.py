"""Training metrics: per-TTT-step sums over the ranks (`Meter`), their summary (loss, ce, acc,
accept, sim_tau, oov, and acceptance and sim_tau at each served temperature: defined in
docs/train.md), the log line for people, train/metrics.jsonl rewritten on resume, and
TensorBoard scalars.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from drafter import DrafterError
from drafter.core.dist import Dist, all_sum
from drafter.core.rundir import Run
from drafter.train.losses import DEFAULT, Objective


class Meter:
    """Per-TTT-step sums on the device (no host sync until `read`): ce, correct, accept,
    n_valid, n_lm, real tokens (in [5, 0]), the objective's per-row value, the loss (in [7, 0])
    and accept at each of obj.temperatures [8 + m, K]."""

    def __init__(self, K: int, device, obj: Objective = DEFAULT):
        self.K, self.device, self.obj = K, device, obj
        self.reset()

    def reset(self):
        self.sums = torch.zeros(8 + len(self.obj.temperatures), self.K, dtype=torch.float64,
                                device=self.device)

    def add(self, out: dict, d: dict):
        idx = d["row_step"]
        for j, key in enumerate(("ce", "correct", "accept")):
            self.sums[j].index_add_(0, idx, out[key].detach().double())
        self.sums[3] += d["n_valid"]
        self.sums[4] += d["n_lm"]
        self.sums[5, 0] += d["tokens_t"]
        self.sums[6].index_add_(0, idx, out.get("value", out["ce"]).detach().double())
        self.sums[7, 0] += out["loss"].detach().double()
        if self.obj.temperatures:
            self.sums[8:].index_add_(1, idx, out["accept_t"].detach().double().T)

    def read(self, dist: Dist, decay: float) -> dict:
        s = all_sum(self.sums.clone(), dist).tolist()
        self.reset()
        return summarize(s, None if self.obj.position == "dpace" else decay,
                         self.obj.temperatures)


def tau(a: list[float]) -> float:
    """1 + Σ_i Π_{j<=i} a_j: the acceptance length of a chain whose draft j is accepted with
    probability a_j given the earlier ones."""
    out, run_prod = 1.0, 1.0
    for x in a:
        run_prod *= x
        out += run_prod
    return out


def summarize(s: list[list[float]], decay: float | None,
              temperatures: tuple[float, ...] = ()) -> dict:
    """The sums of a Meter -> the metrics record. decay: the loss is Σ_i decay^i·value_i over
    the step-0 positions (the rows' weights as align makes them); None (dpace weights): the
    loss's own sum."""
    ce, cor, acc_sum, nv, nl = s[:5]
    acc = [c / max(n, 1) for c, n in zip(cor, nl)]
    accept = [a / max(n, 1) for a, n in zip(acc_sum, nl)]
    value = s[6] if len(s) > 6 else ce
    loss = (sum(decay ** i * c for i, c in enumerate(value)) if decay is not None
            else s[7][0]) / max(nv[0], 1)
    accept_t = {f"{t:g}": [a / max(n, 1) for a, n in zip(row, nl)]
                for t, row in zip(temperatures, s[8:])}
    sim_tau_t = {"0": tau(acc), **{t: tau(a) for t, a in accept_t.items()}, "1": tau(accept)}
    return {"loss": loss,
            "ce": [c / max(n, 1) for c, n in zip(ce, nv)], "acc": acc, "accept": accept,
            "sim_tau": tau(acc), "sim_tau_p": tau(accept), "accept_t": accept_t,
            "sim_tau_t": dict(sorted(sim_tau_t.items(), key=lambda kv: float(kv[0]))),
            "oov": 1 - nv[0] / nl[0] if nl[0] else 0.0, "positions": int(nv[0]),
            "tokens": int(s[5][0])}


def throughput(tokens: int, seconds: float, rates: list[float],
               warmup_s: float | None) -> dict:
    """A run's tokens/s against its steady state (aim: >= 0.85 for runs of >= 200 steps).
    tokens over `seconds` of train steps (warm-up and compiles included) -> avg_tokens_per_s;
    `rates`, the tokens/s of each log interval (or step) in order -> steady_tokens_per_s, the
    median of their last half; avg_over_steady, their ratio; warmup_s as measured."""
    out = {"warmup_s": round(warmup_s, 2) if warmup_s is not None else None,
           "avg_tokens_per_s": None, "steady_tokens_per_s": None, "avg_over_steady": None}
    if rates and seconds > 0:
        steady = statistics.median(rates[len(rates) // 2:])
        out.update(avg_tokens_per_s=round(tokens / seconds, 1),
                   steady_tokens_per_s=round(steady, 1),
                   avg_over_steady=round(tokens / seconds / steady, 3) if steady else None)
    return out


def fmt_line(split: str, step: int, total: int, m: dict, extra: str = "") -> str:
    acc = " ".join(f"{a:.2f}" for a in m["acc"])
    served = "".join(f" | T={t} accept {' '.join(f'{a:.2f}' for a in acc_t)} tau "
                     f"{m['sim_tau_t'][t]:.2f}" for t, acc_t in m.get("accept_t", {}).items())
    return (f"train: {split} step {step}/{total} | loss {m['loss']:.4f} | acc {acc} | "
            f"tau {m['sim_tau']:.2f} (p {m['sim_tau_p']:.2f}){served} | oov {m['oov']:.1%}"
            f"{extra}")


def atomic_json_lines(path: Path, records: list[dict]) -> None:
    from drafter.core.rundir import atomic_write
    atomic_write(path, "".join(json.dumps(r) + "\n" for r in records))


def tensorboard_writer(run: Run, step: int):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise DrafterError("train.tensorboard: needs the tensorboard package: "
                           "pip install 'drafter[tensorboard]'") from None
    return SummaryWriter(str(run.tensorboard()), purge_step=step + 1 if step else None)


def tb_write(tb, split: str, step: int, m: dict) -> None:
    for key in ("loss", "sim_tau", "sim_tau_p", "oov", "lr", "grad_norm", "tokens_per_s"):
        if key in m:
            tb.add_scalar(f"{split}/{key}", m[key], step)
    for key in ("acc", "accept", "ce"):
        for i, x in enumerate(m[key]):
            tb.add_scalar(f"{split}/{key}_{i}", x, step)
    for t, x in m.get("sim_tau_t", {}).items():
        tb.add_scalar(f"{split}/sim_tau_T{t}", x, step)
    for t, xs in m.get("accept_t", {}).items():
        for i, x in enumerate(xs):
            tb.add_scalar(f"{split}/accept_T{t}_{i}", x, step)
