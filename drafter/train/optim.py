"""The drafter's optimizer, a choice (train.optimizer): AdamW over every trainable parameter, or
Muon (torch.optim.Muon) over the 2-D weight matrices with AdamW over the rest, as one
torch.optim.Optimizer (`MuonAdamW`), so that the LR schedule, gradient clipping, the checkpoint's
optimizer.pt and resume treat both alike.

    opt = build(ttt.named_parameters(), tc, fused=cuda)

Muon orthogonalises each matrix's update (Newton-Schulz); it takes 2-D weights only. lm_head
stays on AdamW, as the Muon recipe keeps the output layer (and speculators' trainer does): its
rows are a classifier over the draft vocab, not a hidden transform. `adjust_lr_fn`
"match_rms_adamw" scales each matrix's step to AdamW's update RMS, so train.muon_lr is on
AdamW's scale (Moonshot's "Muon is Scalable for LLM Training").
"""
from __future__ import annotations

from typing import Iterable

import torch

# kept on AdamW although 2-D: the output layer (module docstring)
ADAMW_ONLY = ("lm_head",)


def split(named: Iterable[tuple[str, torch.nn.Parameter]]):
    """Trainable parameters -> (Muon's: 2-D matrices, both sides > 1, not lm_head; AdamW's)."""
    muon, adamw = [], []
    for name, p in named:
        if not p.requires_grad:
            continue
        if p.ndim == 2 and min(p.shape) > 1 and not any(h in name for h in ADAMW_ONLY):
            muon.append(p)
        else:
            adamw.append(p)
    return muon, adamw


class MuonAdamW(torch.optim.Optimizer):
    """Muon's parameter groups, then AdamW's, in one Optimizer: `param_groups` and `state` are
    the two inner optimizers' own (the same dicts), so a scheduler's lr changes reach them, and
    `state_dict` / `load_state_dict` are the base class's over both (one optimizer.pt)."""

    def __init__(self, matrices: list, others: list, lr: float, muon_lr: float,
                 weight_decay: float, fused: bool = False):
        self.muon = torch.optim.Muon(matrices, lr=muon_lr, weight_decay=weight_decay,
                                     adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(others, lr=lr, weight_decay=weight_decay, fused=fused) \
            if others else None
        groups = self.muon.param_groups + (self.adamw.param_groups if self.adamw else [])
        super().__init__(groups, {})
        self._share()

    def _share(self) -> None:
        n = len(self.muon.param_groups)
        self.muon.param_groups = self.param_groups[:n]
        self.muon.state = self.state
        if self.adamw is not None:
            self.adamw.param_groups = self.param_groups[n:]
            self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.muon.step()
        if self.adamw is not None:
            self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # new group dicts and state: hand them on
        self._share()


def build(named: Iterable[tuple[str, torch.nn.Parameter]], tc, fused: bool = False):
    """train.optimizer over the trainable parameters: AdamW (fused on a GPU), or MuonAdamW."""
    named = list(named)
    if tc.optimizer == "adamw":
        params = [p for _, p in named if p.requires_grad]
        return torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay, fused=fused)
    muon, adamw = split(named)
    return MuonAdamW(muon, adamw, lr=tc.lr, muon_lr=tc.muon_lr or tc.lr,
                     weight_decay=tc.weight_decay, fused=fused)
