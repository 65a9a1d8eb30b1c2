"""Prometheus metrics of the serving engine, in their own registry (one per server, no global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dflash_trt.engine.llm_engine import RequestOutput, StepResult
from dflash_trt.engine.scheduler import Scheduler

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class ServerMetrics:
    def __init__(self, scheduler: Scheduler, max_draft_len: int) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("dflash_requests", "Finished requests by finish reason", ["finish_reason"], registry=r)
        self.errors = Counter("dflash_request_errors", "Refused or failed requests by HTTP status", ["status"], registry=r)
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("dflash_generation_tokens", "Generated tokens of finished requests", registry=r)
        self.queue_depth = Gauge("dflash_queue_depth", "Requests waiting for a cache row", registry=r)
        self.queue_depth.set_function(lambda: scheduler.num_waiting)
        self.running = Gauge("dflash_running_requests", "Requests holding a cache row", registry=r)
        self.running.set_function(lambda: scheduler.num_running)
        self.cache_rows = Gauge("dflash_cache_rows", "Cache rows: requests that can run at once", registry=r)
        self.cache_rows.set(scheduler.slots.num_slots)
        # The cache is static rows of max_model_len positions each, so a full row count with this low means short
        # requests: more rows (a larger --max-batch-size at a smaller --max-model-len) would serve more at once.
        self.kv_cache_usage = Gauge("dflash_kv_cache_usage", "Fraction of the KV cache's token positions holding "
                                    "running requests' tokens (1 = full)", registry=r)
        self.kv_cache_usage.set_function(lambda: _kv_cache_usage(scheduler))
        self.batch_size = Histogram("dflash_batch_size", "Decoding requests per engine step", buckets=_BATCH_BUCKETS, registry=r)
        steps = tuple(range(1, max(1, max_draft_len) + 2))
        self.acceptance_length = Histogram(
            "dflash_acceptance_length", "Tokens committed per request per speculative step (tau, counting the bonus)",
            buckets=steps, registry=r,
        )
        self.request_tau = Histogram("dflash_request_tau", "Mean acceptance length of each finished request",
                                     buckets=steps, registry=r)
        self.draft_time = Histogram("dflash_draft_seconds", "Drafter time per engine step", buckets=_TIME_BUCKETS, registry=r)
        self.verify_time = Histogram("dflash_verify_seconds", "Target verify (or decode) time per engine step",
                                     buckets=_TIME_BUCKETS, registry=r)
        # per finished request, as vLLM's time_to_first_token / request_time_per_output_token / e2e_request_latency
        self.ttft = Histogram("dflash_time_to_first_token_seconds", "From a request's arrival (queueing included) to "
                              "its first token", buckets=_REQUEST_BUCKETS, registry=r)
        self.tpot = Histogram("dflash_time_per_output_token_seconds", "A request's decode time over its tokens after "
                              "the first", buckets=_TIME_BUCKETS, registry=r)
        self.latency = Histogram("dflash_e2e_request_latency_seconds", "From a request's arrival to its last token",
                                 buckets=_REQUEST_BUCKETS, registry=r)

    def observe_step(self, result: StepResult) -> None:
        if result.batch_size:
            self.batch_size.observe(result.batch_size)
            self.verify_time.observe(result.verify_time)
            if result.num_draft:
                self.draft_time.observe(result.draft_time)
        for n in result.acceptance_lengths:
            self.acceptance_length.observe(n)

    def observe_finished(self, output: RequestOutput) -> None:
        self.requests.labels(output.finish_reason).inc()
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(output.num_tokens)
        if output.acceptance_lengths:
            self.request_tau.observe(output.tau)
        if output.time_to_first_token is not None:
            self.ttft.observe(output.time_to_first_token)
        if output.num_tokens > 1 and output.decode_time > 0:
            self.tpot.observe(output.decode_time / (output.num_tokens - 1))
        if output.latency is not None:
            self.latency.observe(output.latency)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _kv_cache_usage(scheduler: Scheduler) -> float:
    held = sum(seq.num_cached if seq.is_prefilled else seq.num_prefilled for seq in scheduler.running)
    return held / (scheduler.slots.num_slots * scheduler.config.max_model_len)
