"""The gated delta rule (Gated DeltaNet's linear attention), in fp32: per value head a [key, value] state S,

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),   o_t = S_t^T q_t

token by token (`delta_rule_steps`: every state on the way, each token taken in as a one-token step takes it) or by
chunks (`delta_rule_chunked`: a prompt's tokens whose states nobody keeps, in a few matrix products a chunk).

Within a chunk, with G the cumulative log decay from its start and S_0 the state before it, u solves a unit lower
triangular system, (I + A) U = beta (V - exp(G) K S_0) with A[t, j] = beta_t exp(G_t - G_j) k_t . k_j (j < t); then
O = exp(G) Q S_0 + (exp(G_t - G_j) q_t . k_j)_{j <= t} U and the chunk leaves exp(G_C) S_0 + (exp(G_C - G) K)^T U.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def delta_rule_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, decay: torch.Tensor,
                     state: torch.Tensor, keep_from: int,
                     parents: list[list[int]] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k [B, T, H, K], v [B, T, H, V], beta and decay (exp(g)) [B, T, H], state [B, H, K, V] -> (outputs
    [B, T, H, V], the states after tokens keep_from.. [B, T - keep_from, H, K, V], None where there are none).
    parents (a draft tree's): per row, each token's parent token (-1: it follows `state`), before it; each token
    then continues its parent's state, not the one before it. On a GPU one Triton kernel runs a chain
    (kernels/delta_rule_triton.py)."""
    if q.is_cuda and parents is None:
        from dflash_trt.kernels.delta_rule_triton import delta_rule_steps_triton

        return delta_rule_steps_triton(q, k, v, beta, decay, state, keep_from)
    outputs, kept, after = [], [], []
    initial = state
    for t in range(q.shape[1]):
        if parents is not None:
            state = torch.stack([initial[b] if row[t] < 0 else after[row[t]][b] for b, row in enumerate(parents)])
        state = state * decay[:, t, :, None, None]
        k_t = k[:, t, :, :, None]
        remembered = (state * k_t).sum(dim=-2)
        state = state + k_t * ((v[:, t] - remembered) * beta[:, t, :, None])[:, :, None, :]
        outputs.append((state * q[:, t, :, :, None]).sum(dim=-2))
        if parents is not None:
            after.append(state)
        if t >= keep_from:
            kept.append(state)
    return torch.stack(outputs, dim=1), torch.stack(kept, dim=1) if kept else None


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, log_decay: torch.Tensor,
                       state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """As delta_rule_steps with log decays g (not exp(g)) -> (outputs [B, T, H, V], the state after the last token)."""
    b, t, h, dk = k.shape
    pad = -t % chunk
    # padding tokens of k = 0, beta = 0 and g = 0 leave the state as it is
    q, k, v, beta, g = (F.pad(x.transpose(1, 2), (0, 0) * (x.dim() - 3) + (0, pad)) if x.dim() == 4
                        else F.pad(x.transpose(1, 2), (0, pad)) for x in (q, k, v, beta, log_decay))
    n = (t + pad) // chunk
    q, k, v = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, v))
    beta, g = beta.reshape(b, h, n, chunk), g.reshape(b, h, n, chunk).cumsum(-1)
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)  # key j after query t
    gaps = (g[..., :, None] - g[..., None, :]).masked_fill(later, float("-inf")).exp()  # exp(G_t - G_j), j <= t
    lower = (k @ k.transpose(-1, -2)) * gaps * beta[..., None]
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    system = eye + lower.masked_fill(~later.T, 0.0)  # unit lower triangular: A below the diagonal
    inverse = torch.linalg.solve_triangular(system, eye.expand_as(system), upper=False, unitriangular=True)
    u_own = inverse @ (v * beta[..., None])
    u_from_state = inverse @ (k * (beta * g.exp())[..., None])
    scores = (q @ k.transpose(-1, -2)) * gaps
    outputs = []
    for c in range(n):
        u = u_own[:, :, c] - u_from_state[:, :, c] @ state
        outputs.append((q[:, :, c] * g[:, :, c, :, None].exp()) @ state + scores[:, :, c] @ u)
        last = g[:, :, c, -1]
        state = state * last.exp()[..., None, None] + \
            (k[:, :, c] * (last[..., None] - g[:, :, c]).exp()[..., None]).transpose(-1, -2) @ u
    out = torch.stack(outputs, dim=2).reshape(b, h, n * chunk, -1)[:, :, :t]
    return out.transpose(1, 2), state
