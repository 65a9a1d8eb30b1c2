"""Goodness-of-fit helpers for the sampling tests (a statistical oracle, fixed seeds)."""

from __future__ import annotations

import math
from collections import Counter


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper chi-square quantile by Wilson-Hilferty; z = 3.719 is the 1e-4 one-sided normal quantile."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def chi2_statistic(samples: list, expected: dict) -> tuple[float, int]:
    """Pearson's statistic of samples against probabilities `expected` (cells with n*p < 5 pooled)."""
    n = len(samples)
    counts = Counter(samples)
    outside = sum(v for k, v in counts.items() if k not in expected or expected[k] == 0)
    if outside:
        return math.inf, 1  # a zero-probability outcome occurred
    stat, df, pool_obs, pool_exp = 0.0, 0, 0, 0.0
    for k, p in expected.items():
        e = n * p
        if e < 5:
            pool_obs += counts.get(k, 0)
            pool_exp += e
            continue
        stat += (counts.get(k, 0) - e) ** 2 / e
        df += 1
    if pool_exp > 0:
        stat += (pool_obs - pool_exp) ** 2 / pool_exp
        df += 1
    return stat, max(df - 1, 1)


def assert_matches(samples: list, expected: dict) -> None:
    stat, df = chi2_statistic(samples, expected)
    assert stat < chi2_critical(df), f"chi2={stat:.1f} exceeds the 1e-4 critical value {chi2_critical(df):.1f} (df={df})"
