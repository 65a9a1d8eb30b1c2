"""Acceptance statistics from an endpoint's /metrics, over the interval between two scrapes.

Understands:
- this project's server: the `dflash_acceptance_length` histogram (one observation per request per speculative
  step, the value being the tokens committed), cumulative, so the interval is the difference of two scrapes;
- vLLM: the counters `vllm:spec_decode_num_drafts_total` (one per request per step),
  `vllm:spec_decode_num_draft_tokens_total`, `vllm:spec_decode_num_accepted_tokens_total` and
  `vllm:spec_decode_num_accepted_tokens_per_pos_total{position=...}` (vllm/v1/spec_decode/metrics.py), cumulative,
  summed over their label sets (model, engine);
- trtllm-serve: its /metrics is not Prometheus but a JSON list of iteration statistics, each iteration's
  `specDecodingStats` holding numDraftTokens, numAcceptedTokens and numRequestsWithDraftTokens
  (tensorrt_llm/serve/openai_server.py get_iteration_stats; docs/source/commands/trtllm-serve). It is a queue that
  each GET drains, so a scrape already covers just the interval since the previous one. The server records these
  only with `enable_iter_perf_stats: true` in its config and keeps a bounded number of iterations between reads
  (the sweep reads it every few seconds while a point runs).

SGLang exposes only gauges (`sglang:spec_accept_length`, `sglang:spec_accept_rate`: the average over its last
logging window, python/sglang/srt/metrics/collector.py), which cannot be turned into an interval's figure, so it
is not read. Endpoints that report none of these give None, never a made-up number.
"""

from __future__ import annotations

import json

import httpx
from prometheus_client.parser import text_string_to_metric_families

DFLASH_SUM = "dflash_acceptance_length_sum"
DFLASH_COUNT = "dflash_acceptance_length_count"
VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
VLLM_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"  # labelled by position
_WANTED = {DFLASH_SUM, DFLASH_COUNT, VLLM_DRAFTS, VLLM_ACCEPTED, VLLM_DRAFT_TOKENS}

# Keys of a parsed trtllm-serve scrape (sums over the iterations it returned; not cumulative).
TRTLLM_ITERATIONS = "trtllm:iterations"
TRTLLM_DRAFT_TOKENS = "trtllm:numDraftTokens"
TRTLLM_ACCEPTED = "trtllm:numAcceptedTokens"
TRTLLM_REQUESTS_WITH_DRAFTS = "trtllm:numRequestsWithDraftTokens"


def parse_metrics(text: str) -> dict[str, float]:
    """The acceptance-related values of a /metrics body: Prometheus text (samples summed over label sets, the
    per-position counter kept per position as '<name>:<position>'), or trtllm-serve's JSON iteration list."""
    if text.lstrip().startswith("["):
        return parse_trtllm_iteration_stats(json.loads(text))
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _WANTED:
                name = sample.name
            elif sample.name == VLLM_ACCEPTED_PER_POS and "position" in sample.labels:
                name = f"{VLLM_ACCEPTED_PER_POS}:{sample.labels['position']}"
            else:
                continue
            values[name] = values.get(name, 0.0) + float(sample.value)
    return values


def parse_trtllm_iteration_stats(stats: list) -> dict[str, float]:
    """Sums over trtllm-serve's iteration statistics (each a dict, or a JSON string as older versions give)."""
    if not isinstance(stats, list):
        raise ValueError("trtllm-serve /metrics is a JSON list of iteration statistics")
    out = {TRTLLM_ITERATIONS: 0.0, TRTLLM_DRAFT_TOKENS: 0.0, TRTLLM_ACCEPTED: 0.0, TRTLLM_REQUESTS_WITH_DRAFTS: 0.0}
    for stat in stats:
        if isinstance(stat, str):
            stat = json.loads(stat)
        if not isinstance(stat, dict):
            continue
        out[TRTLLM_ITERATIONS] += 1
        spec = stat.get("specDecodingStats")
        spec = spec if isinstance(spec, dict) else {}
        out[TRTLLM_DRAFT_TOKENS] += float(spec.get("numDraftTokens") or 0)
        out[TRTLLM_ACCEPTED] += float(spec.get("numAcceptedTokens") or 0)
        out[TRTLLM_REQUESTS_WITH_DRAFTS] += float(spec.get("numRequestsWithDraftTokens") or 0)
    return out


def drains(values: dict[str, float] | None) -> bool:
    """Whether a scrape came from trtllm-serve, whose /metrics queue each read empties and which keeps a bounded
    number of iterations between reads (1000 by default, iter_stats_max_iterations): a point longer than that is read
    as it runs and the reads summed (sum_drained)."""
    return values is not None and TRTLLM_ITERATIONS in values


def sum_drained(scrapes: list[dict[str, float]]) -> dict[str, float]:
    """trtllm-serve scrapes of consecutive intervals as one (each holds sums over its own iterations)."""
    return {key: sum(s.get(key, 0.0) for s in scrapes) for key in dict.fromkeys(k for s in scrapes for k in s)}


async def scrape(client: httpx.AsyncClient, metrics_url: str, timeout_s: float = 10.0) -> dict[str, float] | None:
    """The parsed values, or None when the endpoint has no readable /metrics."""
    try:
        resp = await client.get(metrics_url, timeout=timeout_s)
        if resp.status_code != 200:
            return None
        return parse_metrics(resp.text)
    except (httpx.HTTPError, ValueError):  # unreachable, or neither Prometheus text nor trtllm-serve's JSON
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
        per_pos = []
        while f"{VLLM_ACCEPTED_PER_POS}:{len(per_pos)}" in after:
            per_pos.append(delta(f"{VLLM_ACCEPTED_PER_POS}:{len(per_pos)}") / drafts)
        return {"source": "metrics", "metrics": "vllm", "tau": 1.0 + accepted / drafts, "num_steps": int(drafts),
                "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
                "acceptance_per_position": per_pos or None}
    requests = after.get(TRTLLM_REQUESTS_WITH_DRAFTS)
    if requests:  # already the interval's: trtllm-serve drained its queue at the previous scrape
        accepted, drafted = after[TRTLLM_ACCEPTED], after[TRTLLM_DRAFT_TOKENS]
        # each request with drafts in an iteration commits its accepted draft tokens + one token of its own
        return {"source": "metrics", "metrics": "trtllm", "tau": (accepted + requests) / requests,
                "num_steps": int(requests), "acceptance_rate": accepted / drafted if drafted else None,
                "num_iterations": int(after[TRTLLM_ITERATIONS])}
    return None
