"""The compiled FlexAttention training path against the exact one, gradient by gradient, with
each compiled piece run eagerly in turn: which piece a wrong gradient comes from. On a GPU only
(CPU flex has no backward). tests/test_model.py::test_gpu_flex_compiled_equals_sdpa is the
pass/fail check; this names the parameter and the piece.

    python3 benchmarks/flex_grad_check.py            # the package's TTT
    git apply benchmarks/variants/compiled-merge.patch && python3 benchmarks/flex_grad_check.py

Eighth session, H200, the stacked merge applied (benchmarks/variants/stacked-merge.patch, on
61875fe): compiled 5.9e-01 (midlayer.hidden_norm.weight), the merge eager 3.4e-07 (this
script's first form, a scratch copy with the same paths). Ninth session, this form, the
per-step merge compiled (61875fe): every row at most 3.3e-07 (BENCHMARKS.md). The merge has run
eagerly since (issue 18: a faster cold warm-up); compiled-merge.patch puts its graphs back."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import drafter.train.ttt as tt  # noqa: E402
import tests.test_model as tm  # noqa: E402


def grads(b, path: str, compile: bool, eager: tuple = ()) -> tuple[float, list]:
    d = tm.make_drafter(head_dim=16).cuda()
    t = tt.TTT(d, attention=path, compile=compile)
    plain = tt.TTT(d, attention=path, compile=False)
    for name in eager:  # this compiled piece run eagerly
        setattr(t, name, getattr(plain, name))
    out = tm.run_ttt(t, d, b)
    out["loss"].backward()
    return out["loss"].item(), [(n, p.grad.clone()) for n, p in t.named_parameters()
                                if p.grad is not None]


def main() -> int:
    if not torch.cuda.is_available():
        print("flex_grad_check: needs a CUDA GPU")
        return 0
    head = torch.randn(tm.VD, tm.HT, generator=torch.Generator().manual_seed(5)) * 0.3
    b = tm.batch_of(tm.packed_rows(), 128, K=4, head=head)  # one flex block; as the test
    b = {k: v.cuda() if torch.is_tensor(v) else {kk: vv.cuda() for kk, vv in v.items()}
         for k, v in b.items()}
    ref_loss, ref = grads(b, "sdpa", False)
    worst_all = 0.0
    for label, path, comp, eager in [
            ("flex, eager", "flex", False, ()),
            ("flex, compiled", "flex", True, ()),
            ("compiled, loss chunk eager", "flex", True, ("stats_fn",)),
            ("compiled, layer pieces eager", "flex", True, ("pre_fn", "post_fn"))]:
        loss, gs = grads(b, path, comp, eager)
        worst = max(((a - c).abs().max().item() / max(a.abs().max().item(), 1e-12), n)
                    for (n, a), (_, c) in zip(ref, gs))
        worst_all = max(worst_all, worst[0])
        print(f"{label:30s} loss {loss:.6f} (exact {ref_loss:.6f}); worst gradient "
              f"relative difference {worst[0]:.1e} at {worst[1]}")
    return 0 if worst_all < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
