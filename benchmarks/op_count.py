"""The aten ops that make no kernel: counted dispatches minus these are kernel launches.

benchmarks/decode_speed.py (--ops) and benchmarks/train_throughput.py (--producer-ops) count what
a piece of code dispatches, eagerly and on any device (a TorchDispatchMode); on a GPU every op
that is not a view or a metadata read is one kernel launch, the host-side cost of launch-bound
code (a decode step at batch 1, online training's producer).
"""

# aten ops that only make a view or read metadata: no kernel behind them
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "slice", "select", "t", "transpose", "unsqueeze", "squeeze",
    "expand", "as_strided", "alias", "lift_fresh", "detach", "permute", "split", "unbind",
    "split_with_sizes", "narrow", "_reshape_alias", "view_as_real", "unfold"})
