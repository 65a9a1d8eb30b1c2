"""Prometheus metrics of the serving engine, in their own registry (one per server, no global state)."""

from __future__ import annotations

import weakref

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

from dflash_trt.engine.llm_engine import RequestOutput, StepResult
from dflash_trt.engine.scheduler import Scheduler

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


# The same figures under vLLM's names (vllm/v1/metrics/loggers.py), labelled with the served model as vLLM's are,
# so dashboards and tools built on vLLM's /metrics read this server too
VLLM_NAMES = {
    "dflash_running_requests": "vllm:num_requests_running",
    "dflash_queue_depth": "vllm:num_requests_waiting",
    "dflash_kv_cache_usage": "vllm:kv_cache_usage_perc",
    "dflash_prompt_tokens": "vllm:prompt_tokens",
    "dflash_cached_prompt_tokens": "vllm:prefix_cache_hits",
    "dflash_generation_tokens": "vllm:generation_tokens",
    "dflash_requests": "vllm:request_success",
    "dflash_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "dflash_time_per_output_token_seconds": "vllm:request_time_per_output_token_seconds",
    "dflash_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
}
_VLLM_LABELS = {"finish_reason": "finished_reason"}
# vLLM labels every metric with the model's name and its engine's index (vllm/v1/metrics/loggers.py); one engine here
_VLLM_LABEL_NAMES = ["model_name", "engine"]
VLLM_ENGINE = "0"


class ServerMetrics:
    def __init__(self, scheduler: Scheduler, max_draft_len: int, model_name: str = "") -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("dflash_requests", "Finished requests by finish reason", ["finish_reason"], registry=r)
        self.errors = Counter("dflash_request_errors", "Refused or failed requests by HTTP status", ["status"], registry=r)
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens of requests that got a token", registry=r)
        self.cached_tokens = Counter("dflash_cached_prompt_tokens", "Of those, the ones another request's cache row held "
                                     "(freed or running; not prefilled again)", registry=r)
        self.generation_tokens = Counter("dflash_generation_tokens", "Generated tokens, counted as steps make them",
                                         registry=r)
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
        # vLLM's speculative-decoding counters (vllm/v1/spec_decode/metrics.py), counted every step as vLLM's: a
        # draft is one request's speculative step (a tree's nodes count as its draft tokens, the depths of its
        # accepted path as the positions)
        # (the labelled children are looked up once: observe_step runs on the engine's thread, between its steps)
        spec = dict(labelnames=_VLLM_LABEL_NAMES, registry=r)
        labels = (model_name, VLLM_ENGINE)
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Speculative steps, one per request per step",
                              **spec).labels(*labels)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed",
                                    **spec).labels(*labels)
        self.accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                       **spec).labels(*labels)
        self._per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each "
                                "position", labelnames=[*_VLLM_LABEL_NAMES, "position"], registry=r)
        self._labels = labels
        # K's positions there at zero before the first step, as vLLM's; a context lookup may go deeper (accepted_at)
        self._at = [self._per_pos.labels(*labels, str(pos)) for pos in range(max_draft_len)]
        # a running request -> its output tokens counted so far; weak, so a request that leaves without a last step
        # (an engine error fails it) takes its entry with it
        self._counted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        r.register(_VLLMNamed([self.running, self.queue_depth, self.kv_cache_usage, self.prompt_tokens,
                               self.cached_tokens, self.generation_tokens, self.requests, self.ttft, self.tpot,
                               self.latency], model_name))

    def observe_step(self, result: StepResult) -> None:
        if result.batch_size:
            self.batch_size.observe(result.batch_size)
            self.verify_time.observe(result.verify_time)
            if result.num_draft:
                self.draft_time.observe(result.draft_time)
        for n in result.acceptance_lengths:
            self.acceptance_length.observe(n)
            for counter in self.accepted_at(n - 1):  # less the bonus token
                counter.inc()
        if drafts := len(result.acceptance_lengths):
            self.drafts.inc(drafts)
            self.draft_tokens.inc(drafts * result.draft_tokens)
            self.accepted_tokens.inc(sum(result.acceptance_lengths) - drafts)
        # tokens as steps make them, as vLLM counts them: a long answer's rate shows while it streams
        prompt = generated = cached = 0
        for seq in result.updated:
            counted = self._counted.pop(seq, None)
            if counted is None and seq.output_ids:  # its first token: its prompt is cached (not one aborted queued)
                prompt += len(seq.prompt_ids)
                cached += seq.num_reused
            generated += len(seq.output_ids) - (counted or 0)
            if not seq.is_finished:
                self._counted[seq] = len(seq.output_ids)
        if prompt:
            self.prompt_tokens.inc(prompt)
            self.cached_tokens.inc(cached)
        if generated:
            self.generation_tokens.inc(generated)

    def accepted_at(self, positions: int) -> list:
        """The per-position counters of the first `positions` positions."""
        while len(self._at) < positions:
            self._at.append(self._per_pos.labels(*self._labels, str(len(self._at))))
        return self._at[:positions]

    def observe_finished(self, output: RequestOutput) -> None:
        self.requests.labels(output.finish_reason).inc()
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


class _VLLMNamed:
    """A collector of `metrics` again, under their VLLM_NAMES, with vLLM's label names and its model_name and engine
    labels."""

    def __init__(self, metrics: list, model_name: str) -> None:
        self.metrics, self.model_name = metrics, model_name

    def collect(self):
        for metric in self.metrics:
            for family in metric.collect():
                name = VLLM_NAMES[family.name]
                renamed = Metric(name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    labels = {"model_name": self.model_name, "engine": VLLM_ENGINE,
                              **{_VLLM_LABELS.get(k, k): v for k, v in sample.labels.items()}}
                    renamed.add_sample(name + sample.name[len(family.name):], labels, sample.value, sample.timestamp,
                                       sample.exemplar)
                yield renamed


def _kv_cache_usage(scheduler: Scheduler) -> float:
    held = sum(seq.num_cached if seq.is_prefilled else seq.num_prefilled for seq in scheduler.running)
    return held / (scheduler.slots.num_slots * scheduler.config.max_model_len)
