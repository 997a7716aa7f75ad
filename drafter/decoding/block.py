"""Block verification for a sampled chain (Sun et al., "Block Verification Accelerates
Speculative Decoding", arXiv 2403.10444, their Algorithm 2): the K drafts are verified jointly
as one block instead of token by token. It is exact in distribution, as the standard rejection
sampling is, and accepts at least as many tokens in expectation for the same drafts (the paper's
optimality result); what vLLM 0.32 runs with `rejection_sample_method: block`.

    n_acc, last = verify_chain_block(tokens, logits, q, t_ids, temperature)
    dec.chain_verify = verify_chain_block     # Decoder._chain_step's sampled verification

Shapes as drafter.decoding.rejection's: tokens [B, K] draft ids, logits [B, K+1, V] the
verification's target logits (row i: the target's distribution after drafts 1..i), q the draft
distributions (DraftQ, rows [B, K, Vd]: row i the one draft i+1 was drawn from), t_ids [Vd] the
draft -> target id map (q is zero outside its image). P_i = softmax(logits[:, i] / T), Q_i = the
draft's row i at T, X_i the i-th draft (1-based):

    p_0 = 1,   p_i = min(1, p_{i-1} P_{i-1}(X_i) / Q_{i-1}(X_i))
    r_i(x) = max(0, p_i P_i(x) - Q_i(x))       (outside the draft vocab: p_i P_i(x))
    h_i = |r_i| / (|r_i| + 1 - p_i)  for i < K  (1 where both are 0),   h_K = p_K
    tau = the largest i with u_i <= h_i (0 if none), u_i uniform
    the last token ~ P_K if tau = K, else r_tau / |r_tau|

Every position is tested (a later one can pass after an earlier one failed: the block keeps the
longest passing prefix), where the standard walk stops at its first rejection. With K = 1 it is
the standard rejection sampling. vLLM computes the same quantities (vllm/v1/worker/gpu/
spec_decode/rejection_sampler_utils.py: `_compute_cumulative_log_p_kernel`, the residual mass,
`USE_BLOCK_VERIFICATION` in `_rejection_kernel`); its V1 model runner (vLLM's CPU build, or
VLLM_USE_V2_MODEL_RUNNER=0) has no block verification and drafts greedily when asked for it.

PyTorch only: it builds the [B, K+1, V] float32 softmax and the [B, K, Vd] residuals, where the
standard walk (rejection.walk) reads the logits in place. tests/test_sampling_exact.py holds its
tokens to the target's distribution with the chi-square test the standard verification passes,
and a planted bias fails it.
"""
from __future__ import annotations

import torch
from torch import Tensor

from drafter.decoding.noise import gumbel
from drafter.decoding.rejection import DraftQ


def block_terms(tokens: Tensor, logits: Tensor, q: DraftQ, t_ids: Tensor, temperature: float
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The block's quantities: p [B, K+1] (p_0 = 1), h [B, K] (h_1..h_K), the residuals on the
    draft vocab r [B, K, Vd] (rows 0..K-1) and the target's log-probs [B, K+1, V]."""
    B, K = tokens.shape
    logp = torch.log_softmax(logits.float() / temperature, -1)                      # [B, K+1, V]
    P = logp[:, :K].exp()
    Pd = P[:, :, t_ids]                                                              # [B, K, Vd]
    Q = (q.logq()[:, :K]).exp()                                                      # [B, K, Vd]
    out = (1.0 - Pd.sum(-1)).clamp(min=0.0)                  # each row's mass outside the vocab
    ratio = (logp[:, :K].gather(2, t_ids[tokens][..., None]).squeeze(-1)
             - q.logq()[:, :K].gather(2, tokens[..., None]).squeeze(-1))             # [B, K]
    p = torch.ones(B, K + 1, device=logits.device)
    for i in range(K):                                   # p_{i+1} = min(1, p_i P_i(X)/Q_i(X))
        p[:, i + 1] = (p[:, i].log() + ratio[:, i]).clamp(max=0.0).exp()
    r = (p[:, :K, None] * Pd - Q).clamp(min=0.0)                                     # [B, K, Vd]
    mass = r.sum(-1) + p[:, :K] * out                                                # |r_i|
    m, pi = mass[:, 1:], p[:, 1:K]
    den = m + 1.0 - pi
    h_mid = torch.where(den > 0, m / den.clamp(min=1e-30), torch.ones_like(m))       # [B, K-1]
    h = torch.cat([h_mid, p[:, K:]], 1)                                              # [B, K]
    return p, h, r, logp


def verify_chain_block(tokens: Tensor, logits: Tensor, q: DraftQ, t_ids: Tensor,
                       temperature: float, u: Tensor | None = None, noise: Tensor | None = None
                       ) -> tuple[Tensor, Tensor]:
    """Block verification of a sampled chain (module doc). u [B, K] the positions' uniforms and
    noise [B, V] the last token's (tests); by default torch.rand's. Returns the accepted count
    [B] and the step's last token [B] (a target id): rejection.walk's chain returns."""
    B, K = tokens.shape
    V = logits.shape[-1]
    dev = logits.device
    if u is None:
        u = torch.rand(B, K, device=dev)
    if noise is None:
        noise = torch.rand(B, V, device=dev)
    p, h, r, logp = block_terms(tokens, logits, q, t_ids, temperature)
    passed = u <= h                                                                  # [B, K]
    pos = torch.arange(1, K + 1, device=dev)
    n_acc = (passed * pos).amax(1)                                   # the last passing position
    rows = torch.arange(B, device=dev)
    # the last token: P_K after the whole block, else the residual r_tau (p_tau P outside)
    lp = logp[rows, n_acc]                                                           # [B, V]
    pt = p[rows, n_acc]                                                              # [B]
    w = (pt[:, None].log() + lp).exp()
    res = r[rows, n_acc.clamp(max=K - 1)]                                            # [B, Vd]
    w = torch.where((n_acc < K)[:, None], w.index_copy(1, t_ids, res), lp.exp())
    # a residual of zero mass is only reached through rounding (h is 0 there): take P
    w = torch.where((w.sum(-1) > 0)[:, None], w, lp.exp())
    last = (w.log() + gumbel(noise)).argmax(-1)
    return n_acc, last
