"""Counting the aten ops, and the kernels among them, that a piece of code dispatches.

benchmarks/decode_speed.py (--ops) and benchmarks/train_throughput.py (--producer-ops) count what
a piece of code dispatches, eagerly and on any device; on a GPU every op that is not a view or a
metadata read is one kernel launch, the host-side cost of launch-bound code (a decode step at
batch 1, online training's producer).
"""
from __future__ import annotations

import collections
import contextlib

from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that only make a view or read metadata: no kernel behind them
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "slice", "select", "t", "transpose", "unsqueeze", "squeeze",
    "expand", "as_strided", "alias", "lift_fresh", "detach", "permute", "split", "unbind",
    "split_with_sizes", "narrow", "_reshape_alias", "view_as_real", "unfold"})


class OpCount(TorchDispatchMode):
    """`with OpCount() as c:` counts every aten op dispatched inside: `ops` and `kernels` (ops
    not in VIEW_OPS) by the label on top when it ran (`with c.label(name):` pushes one; `rest`
    below them all), and `names` by op name."""

    def __init__(self, rest: str = "rest"):
        super().__init__()
        self.labels = [rest]
        self.ops: collections.Counter = collections.Counter()
        self.kernels: collections.Counter = collections.Counter()
        self.names: collections.Counter = collections.Counter()

    @contextlib.contextmanager
    def label(self, name: str):
        self.labels.append(name)
        try:
            yield
        finally:
            self.labels.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket).split(".")[-1]
        self.ops[self.labels[-1]] += 1
        self.kernels[self.labels[-1]] += name not in VIEW_OPS
        self.names[name] += 1
        return func(*args, **(kwargs or {}))
