"""Acceptance statistics from an endpoint's Prometheus /metrics, as the delta between two scrapes.

Understands this project's server (`dflash_acceptance_length` histogram: one observation per request per
speculative step, the value being the tokens committed) and vLLM's spec-decode counters. Endpoints that
report neither give None, never a made-up number.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

DFLASH_SUM = "dflash_acceptance_length_sum"
DFLASH_COUNT = "dflash_acceptance_length_count"
VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
_WANTED = {DFLASH_SUM, DFLASH_COUNT, VLLM_DRAFTS, VLLM_ACCEPTED, VLLM_DRAFT_TOKENS}


def parse_metrics(text: str) -> dict[str, float]:
    """The acceptance-related samples of a Prometheus text exposition, summed over label sets
    (vLLM labels its counters by model and engine)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _WANTED:
                values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    return values


async def scrape(client: httpx.AsyncClient, metrics_url: str, timeout_s: float = 10.0) -> dict[str, float] | None:
    """The parsed samples, or None when the endpoint has no readable /metrics."""
    try:
        resp = await client.get(metrics_url, timeout=timeout_s)
        if resp.status_code != 200:
            return None
        return parse_metrics(resp.text)
    except (httpx.HTTPError, ValueError):  # unreachable, or not Prometheus text
        return None


def acceptance_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict | None:
    """Acceptance over the interval between two scrapes, or None when the endpoint reports none
    (no /metrics, no spec-decode metrics, or no speculative step in the interval)."""
    if before is None or after is None:
        return None

    def delta(name: str) -> float | None:
        if name not in after:
            return None
        return after[name] - before.get(name, 0.0)

    steps, committed = delta(DFLASH_COUNT), delta(DFLASH_SUM)
    if steps and committed is not None:
        return {"source": "metrics", "metrics": "dflash", "tau": committed / steps, "num_steps": int(steps),
                "acceptance_rate": None}
    drafts, accepted, draft_tokens = delta(VLLM_DRAFTS), delta(VLLM_ACCEPTED), delta(VLLM_DRAFT_TOKENS)
    if drafts and accepted is not None:
        # vLLM counts one draft per request per step, so each draft commits its accepted tokens + the bonus.
        return {"source": "metrics", "metrics": "vllm", "tau": 1.0 + accepted / drafts, "num_steps": int(drafts),
                "acceptance_rate": accepted / draft_tokens if draft_tokens else None}
    return None
