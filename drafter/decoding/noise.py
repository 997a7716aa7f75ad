"""Sampling's noise as the PyTorch forms draw it, and the numbers the Triton kernels share with
them (the kernels read these, so that a kernel and its PyTorch form make the same draws from the
same uniforms):

    g = gumbel(u)            # Gumbel noise from uniforms in [0, 1): -log(-log(u)), u clamped
    key = philox_key(dev)    # a fresh [1] key for a kernel's own Philox draws

The kernels draw four uniforms per Philox offset, and their offsets (like the noise's indices)
are int32: a launch's rows times columns stay below OFFSETS.
"""
from __future__ import annotations

import torch
from torch import Tensor

U_MIN = 1e-20        # the smallest uniform the noise reads: -log(-log(0)) would be -inf
U_MAX = 1.0 - 1e-7   # the largest (0.99999988 in float32): the noise stays below 16
OFFSETS = 2 ** 31    # int32 Philox offsets and noise indices: a launch's elements stay below


def gumbel(u: Tensor) -> Tensor:
    """Gumbel noise from uniforms in [0, 1)."""
    return -torch.log(-torch.log(u.clamp(min=U_MIN, max=U_MAX)))


def philox_key(dev) -> Tensor:
    """A fresh Philox key [1] on the device, from torch's generator (captured graphs draw a new
    one every replay)."""
    return torch.randint(0, 2 ** 31 - 1, (1,), device=dev)
