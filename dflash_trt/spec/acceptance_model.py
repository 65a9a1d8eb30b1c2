"""The geometric acceptance model: each draft is accepted with probability alpha given its predecessors were.

The build's performance model (perf_model.py) fits alpha to the measured taus and fills in tau for the K values
not measured.
"""

from __future__ import annotations


def tau_from_acceptance(alpha: float, k: int) -> float:
    """Expected tokens per step with K drafts when each draft is accepted with probability alpha given
    its predecessors were: 1 + alpha + ... + alpha^K."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    return float(k + 1) if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
