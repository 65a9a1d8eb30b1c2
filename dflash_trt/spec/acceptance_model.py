"""The geometric acceptance model: each draft is accepted with probability alpha given its predecessors were.

Shared by the build's performance model (perf_model.py: tau for K values not measured) and the runtime's
adaptive draft length (engine/adaptive_draft.py), which must not import the planner to use two formulas.
"""

from __future__ import annotations


def tau_from_acceptance(alpha: float, k: int) -> float:
    """Expected tokens per step with K drafts when each draft is accepted with probability alpha given
    its predecessors were: 1 + alpha + ... + alpha^K."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    return float(k + 1) if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def alpha_from_tau(tau: float, k: int) -> float:
    """The per-draft acceptance alpha with tau_from_acceptance(alpha, K) == tau (bisection)."""
    if not 1.0 <= tau <= k + 1:
        raise ValueError(f"tau={tau} at K={k} must be in [1, {k + 1}]")
    lo, hi = 0.0, 1.0
    for _ in range(100):  # tau_from_acceptance increases in alpha
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tau_from_acceptance(mid, k) < tau else (lo, mid)
    return (lo + hi) / 2
