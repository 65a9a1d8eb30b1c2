"""bench sweep against a stub OpenAI-compatible endpoint with known timings, counts and acceptance, and once
end to end against this project's server on the tiny model."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from fastapi import FastAPI, Request  # module level: the handlers' annotations are resolved by name
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from dflash_trt.bench.endpoint_metrics import acceptance_delta, parse_metrics
from dflash_trt.bench.sweep import (
    BURST_S,
    PromptStream,
    RequestResult,
    SweepConfig,
    SweepError,
    csv_path_of,
    run_sweep,
    run_sweep_async,
    write_results,
)
from tests.server.conftest import free_port


@dataclass(frozen=True)
class Prompt:  # the fields of datasets.BenchPrompt the sweep reads
    id: str
    category: str
    text: str
    max_tokens: int


def prompts(*texts: str, max_tokens: int = 6) -> list[Prompt]:
    return [Prompt(f"t/{i}", "chat", t, max_tokens) for i, t in enumerate(texts)]


# --- the stub endpoint ----------------------------------------------------------------------------

FIRST_DELAY = 0.05  # before the first token
GAP = 0.02  # between chunks
K = 3  # draft tokens per step
SLOW = 0.4  # before the first token of a "slowfail:" prompt
STEPS, ACCEPTED = 3, 5  # the stub's vLLM-style counters, per finished request: 3 drafts of K tokens, 5 accepted


@dataclass
class StubState:
    tokens_per_chunk: int = 1
    events_per_chunk: int = 1  # >1: each chunk's tokens sent one event each, as trtllm-serve streams harmony output
    usage: bool = True
    metrics: bool = True
    metrics_failures: int = 0  # the next reads of /metrics that fail (a server busy past the read's timeout)
    metrics_fail_after: int | None = None  # reads fail once this many requests have finished
    acceptance: dict = field(default_factory=dict)  # prompt text -> (tau, num_steps)
    decoded_per_iter: dict = field(default_factory=dict)  # prompt text -> trtllm-serve's avg_decoded_tokens_per_iter
    gaps: dict = field(default_factory=dict)  # prompt text -> seconds between its chunks (default GAP)
    metrics_format: str = "vllm"  # or "trtllm": trtllm-serve's JSON iteration statistics
    inflight: int = 0
    arrivals: list = field(default_factory=list)  # (request body, in flight including this one)
    finished: int = 0
    iteration_stats: list = field(default_factory=list)  # trtllm-serve's queue, drained by each GET /metrics
    stats_cap: int | None = None  # the queue keeps its last this many iterations (iter_stats_max_iterations)
    fail_after: int | None = None  # requests after this many arrivals fail (a server that goes down mid-sweep)
    cached_tokens: int | None = None  # usage's prompt_tokens_details.cached_tokens, where set
    usage_patch: dict = field(default_factory=dict)  # prompt text -> entries that replace its usage's
    acceptance_record: dict = field(default_factory=dict)  # prompt text -> its acceptance record as sent

    def metrics_text(self) -> str:
        # Two engines, as vLLM labels its counters, so the parser must sum label sets.
        lines = []
        for name, per_request in (("num_drafts", STEPS), ("num_accepted_tokens", ACCEPTED), ("num_draft_tokens", STEPS * K)):
            lines += [f"# HELP vllm:spec_decode_{name} stub", f"# TYPE vllm:spec_decode_{name} counter"]
            for engine in (0, 1):
                n = (self.finished + 1 - engine) // 2  # requests credited to this engine
                lines.append(f'vllm:spec_decode_{name}_total{{engine="{engine}",model_name="stub"}} {float(n * per_request)}')
        return "\n".join(lines) + "\n"


def stub_app(state: StubState, n_chunks: int = 6):
    app = FastAPI()

    def event(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    async def generate(request: Request):
        body = await request.json()
        chat = "messages" in body
        text = body["messages"][-1]["content"] if chat else body["prompt"]
        state.inflight += 1
        state.arrivals.append((body, state.inflight))
        if text.startswith("fail:") or (state.fail_after is not None and len(state.arrivals) > state.fail_after):
            state.inflight -= 1
            return JSONResponse({"error": {"message": f"stub failure for {text}"}}, status_code=500)
        if text.startswith("json200:"):  # an error as one JSON body, status 200 (no stream)
            state.inflight -= 1
            return JSONResponse({"error": {"message": "stub refuses this prompt"}})

        def chunk(content: str | None, finish: str | None = None, field: str = "content", **extra) -> dict:
            choice = {"index": 0, "finish_reason": finish, **extra}
            if chat:
                choice["delta"] = {field: content}
            else:
                choice["text"] = content or ""
            return {"choices": [choice]}

        async def events():
            try:
                if chat:
                    yield event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
                await asyncio.sleep(SLOW if text.startswith("slowfail:") else FIRST_DELAY)
                if text.startswith(("empty:", "eos1:")):  # EOS first: no content, a finish, usage, [DONE]
                    eos = int(text.startswith("eos1:"))  # usage counting the EOS token (vLLM, this serve) or not
                    yield event({**chunk(None, "stop"), "usage": {"prompt_tokens": len(text), "completion_tokens": eos}})
                    yield "data: [DONE]\n\n"
                    return
                chunks = min(n_chunks, body["max_tokens"])  # --osl 1 answers one token, as a server would
                for i in range(chunks):
                    if i:
                        await asyncio.sleep(state.gaps.get(text, GAP))
                    # "think:": a reasoning model's first two chunks, its analysis channel
                    field = "reasoning_content" if text.startswith("think:") and i < 2 else "content"
                    for _ in range(state.events_per_chunk):
                        yield event(chunk("rb"[: state.tokens_per_chunk] if field != "content" else
                                          "ab"[: state.tokens_per_chunk], field=field))
                    if text.startswith("twochoices:"):  # another choice's chunk, which is not this answer's
                        yield event({"choices": [{**chunk("zz"), "index": 1}]})
                    if text.startswith("stall:"):  # a server that stops sending mid-answer
                        await asyncio.sleep(30)
                    if text.startswith(("midfail:", "slowfail:")):
                        yield event({"error": {"message": "stub died mid-stream"}})
                        yield "data: [DONE]\n\n"
                        return
                    if text.startswith("cut:") and i == 1:  # a clean close of the body, no finish, no [DONE]
                        return
                    if text.startswith("drop:"):  # the server's generator raises: the connection is torn down
                        raise RuntimeError("stub engine died")
                    if text.startswith("malformed:"):
                        yield "data: null\n\n"
                extra = {}
                if text in state.acceptance:
                    tau, steps = state.acceptance[text]
                    extra["acceptance"] = {"tau": tau, "num_steps": steps, "acceptance_histogram": [1, steps - 1],
                                           "total_draft_tokens": steps * K, "total_accepted_draft_tokens": steps}
                if text in state.acceptance_record:
                    extra["acceptance"] = state.acceptance_record[text]
                if text in state.decoded_per_iter:
                    extra["avg_decoded_tokens_per_iter"] = state.decoded_per_iter[text]
                state.finished += 1
                # trtllm-serve: one iteration-stats entry per engine iteration, here STEPS iterations of this one
                # request, K drafts each, ACCEPTED accepted in all (ACCEPTED // STEPS per step, rest on the first).
                # Shape as trtllm-serve's /metrics returns it (docs/source/commands/trtllm-serve, "Metrics
                # Endpoint"; specDecodingStats fields as in cpp/include/tensorrt_llm/executor/types.h
                # SpecDecodingStats, serialized camelCase).
                for step in range(STEPS):
                    got = ACCEPTED // STEPS + (ACCEPTED % STEPS if step == 0 else 0)
                    state.iteration_stats.append({
                        "iter": len(state.iteration_stats), "iterLatencyMS": 16.5, "gpuMemUsage": 56401920000,
                        "inflightBatchingStats": {"numContextRequests": 0, "numGenRequests": 1},
                        "specDecodingStats": {"numDraftTokens": K, "numAcceptedTokens": got,
                                              "numRequestsWithDraftTokens": 1, "acceptanceLength": 1.0 + got,
                                              "iterLatencyMS": 2.0, "draftOverhead": 0.1}})
                if state.stats_cap is not None:
                    del state.iteration_stats[:-state.stats_cap]
                usage = {"prompt_tokens": len(text),
                         "completion_tokens": chunks * state.tokens_per_chunk * state.events_per_chunk,
                         **state.usage_patch.get(text, {})}
                if state.cached_tokens is not None:
                    usage["prompt_tokens_details"] = {"cached_tokens": state.cached_tokens}
                final = chunk(None, "length", **extra)
                if state.usage:
                    final["usage"] = usage
                yield event(final)
                if state.usage:
                    yield event({"choices": [], "usage": usage})
                yield "data: [DONE]\n\n"
                if text.startswith("holdopen:"):  # complete, but the body is not closed
                    await asyncio.sleep(30)
            finally:
                state.inflight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    app.post("/v1/chat/completions")(generate)
    app.post("/v1/completions")(generate)

    @app.get("/metrics")
    async def metrics():
        if not state.metrics:
            return PlainTextResponse("not found", status_code=404)
        if state.metrics_failures:
            state.metrics_failures -= 1
            return PlainTextResponse("busy", status_code=503)
        if state.metrics_fail_after is not None and state.finished >= state.metrics_fail_after:
            return PlainTextResponse("busy", status_code=503)
        if state.metrics_format == "trtllm":  # a JSON list, and the queue is emptied by the read
            stats, state.iteration_stats = state.iteration_stats, []
            return JSONResponse(stats)
        return PlainTextResponse(state.metrics_text())

    return app


@dataclass
class Stub:
    url: str
    state: StubState

    def reset(self, **kw) -> StubState:
        """Fresh behaviour and counters; the server keeps the same state object."""
        self.state.__dict__.update(StubState(**kw).__dict__)
        return self.state


@pytest.fixture(scope="module")
def stub():
    import uvicorn

    state = StubState()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(stub_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "stub did not start"
        time.sleep(0.02)
    yield Stub(f"http://127.0.0.1:{port}", state)
    server.should_exit = True
    thread.join(10)


def config(url: str, concurrencies, **kw) -> SweepConfig:
    kw.setdefault("warmup_requests", 0)
    kw.setdefault("requests_per_concurrency", 1)
    return SweepConfig(url=url, model="stub", concurrencies=list(concurrencies), **kw)


# --- config and prompt order ----------------------------------------------------------------------

def test_config_urls_and_request_counts():
    a = SweepConfig(url="http://h:8000", model="m", concurrencies=[1, 4])
    b = SweepConfig(url="http://h:8000/v1/", model="m", concurrencies=[1, 4], api="completions")
    assert a.endpoint == "http://h:8000/v1/chat/completions"
    assert b.endpoint == "http://h:8000/v1/completions"
    assert a.metrics_url == b.metrics_url == "http://h:8000/metrics"
    assert a.num_warmup == 1  # the first concurrency
    assert [a.requests_at(c) for c in (1, 2, 8)] == [4, 8, 32]  # max(4, 4 * c)
    with pytest.raises(ValueError, match="concurrencies"):
        SweepConfig(url="http://h", model="m", concurrencies=[0])
    with pytest.raises(ValueError, match="api"):
        SweepConfig(url="http://h", model="m", concurrencies=[1], api="responses")
    with pytest.raises(ValueError, match="url"):
        SweepConfig(url="h:8000", model="m", concurrencies=[1])


def test_prompt_stream_deals_seeded_passes_without_repeats_inside_a_pass():
    ps = prompts(*"abcdef")
    stream = PromptStream(ps, seed=0)
    dealt = []
    for n in (1, 2, 3, 4, 5):  # a warm-up request, then points of growing size
        batch, repeats = stream.take(n)
        assert len(batch) == n
        before = [p.text for p in dealt]
        assert repeats == sum(p.text in before for p in batch)
        dealt += batch
    assert sorted(p.text for p in dealt[:6]) == list("abcdef")  # every pass is a permutation of the set
    assert sorted(p.text for p in dealt[6:12]) == list("abcdef")
    assert len({p.text for p in dealt[:6]}) == 6  # nothing sent twice before the set runs out
    other = PromptStream(ps, seed=0)
    assert [p for n in (1, 2, 3, 4, 5) for p in other.take(n)[0]] == dealt  # the deal depends on (prompts, seed)
    assert PromptStream(ps, seed=1).take(15)[0] != dealt
    with pytest.raises(ValueError, match="no prompts"):
        PromptStream([], seed=0)


# --- timings and counts against the stub ----------------------------------------------------------

def test_latencies_match_the_stub_delays(stub):
    stub.reset()
    cfg = config(stub.url, [1], requests_per_concurrency=4, gpus=2)
    (pt,) = run_sweep(cfg, prompts("hello", "world"))["points"]
    n, chunks = 4, 6
    assert pt["num_requests"] == n and pt["num_failed"] == 0
    assert pt["output_tokens"] == n * chunks
    assert pt["input_tokens"] == 2 * len("hello") + 2 * len("world")
    slack = 0.03
    e2e = FIRST_DELAY + (chunks - 1) * GAP
    assert FIRST_DELAY <= pt["ttft_s"]["mean"] <= FIRST_DELAY + slack
    assert FIRST_DELAY <= pt["ttft_s"]["p99"] <= FIRST_DELAY + 2 * slack
    assert GAP <= pt["itl_s"]["p50"] <= GAP + slack / 2
    assert GAP * 0.95 <= pt["tpot_s"]["mean"] <= GAP + slack / 2
    assert e2e <= pt["e2el_s"]["p50"] <= e2e + slack * 2
    # one stream at a time: the point lasts at least n end-to-end latencies
    assert pt["duration_s"] >= n * e2e
    assert pt["output_tok_s"] == pytest.approx(n * chunks / pt["duration_s"])
    assert pt["request_throughput"] == pytest.approx(n / pt["duration_s"])
    assert pt["tok_s_per_gpu"] == pytest.approx(pt["output_tok_s"] / 2)
    assert 1 / (GAP + slack / 2) <= pt["tok_s_per_user"] <= 1 / (GAP * 0.95)
    # and each request's own figures, as vLLM's --save-detailed keeps them
    assert sorted(r["prompt_id"] for r in pt["requests"]) == ["t/0", "t/0", "t/1", "t/1"]
    for r in pt["requests"]:
        assert r["ok"] and r["output_tokens"] == chunks and r["finish_reason"] == "length" and "error" not in r
        assert FIRST_DELAY <= r["ttft_s"] <= FIRST_DELAY + 2 * slack and e2e <= r["e2el_s"] <= e2e + 2 * slack
        assert GAP * 0.95 <= r["tpot_s"] <= GAP + slack
    starts = [r["start_s"] for r in pt["requests"]]
    assert starts[0] == 0 and all(b - a >= e2e for a, b in zip(starts, starts[1:]))  # one stream: one after another


def test_a_steps_tokens_sent_one_event_each_are_one_chunk_for_itl(stub):
    """trtllm-serve streams gpt-oss (harmony) one event per token: a 4-token step is a burst of 4 events, and ITL
    between them would read near 0 at the median where other servers read the step time."""
    stub.reset(events_per_chunk=4)
    (pt,) = run_sweep(config(stub.url, [1], osl=24, min_requests=2), prompts("x"))["points"]
    assert pt["output_tokens"] == 2 * 24
    assert GAP <= pt["itl_s"]["p50"] <= GAP + 0.015
    span = 5 * GAP
    assert span / 23 <= pt["tpot_s"]["mean"] <= (span + 0.03) / 23  # TPOT stays per token


def test_a_burst_is_measured_from_its_first_event_so_a_backlog_is_not_one_chunk():
    """Events each under BURST_S after the one before, read back to back by a client that fell behind, are several
    steps' chunks: only those within BURST_S of a burst's first event join it."""
    step = 0.6 * BURST_S
    r = RequestResult("p", 0.0, chunk_times=[i * step for i in range(6)])
    assert r.itls == pytest.approx([2 * step, 2 * step])
    assert RequestResult("p", 0.0, chunk_times=[0.0, 0.1 * BURST_S, 0.02, 0.02 + 0.1 * BURST_S]).itls == \
        pytest.approx([0.02])


def test_tokens_come_from_usage_else_from_chunks(stub):
    # Two tokens per chunk (as a speculative step sends): usage says 12 tokens over 6 chunks.
    stub.reset(tokens_per_chunk=2)
    (pt,) = run_sweep(config(stub.url, [1], osl=12, min_requests=2), prompts("x"))["points"]
    assert pt["output_tokens"] == 2 * 12
    span = 5 * GAP  # from the first chunk to the last
    assert span / 11 <= pt["tpot_s"]["mean"] <= (span + 0.03) / 11
    assert GAP <= pt["itl_s"]["p50"] <= GAP + 0.015  # ITL stays per chunk
    # Without usage the sweep counts content chunks, or with a tokenizer the text: here one token a character.
    stub.reset(tokens_per_chunk=2, usage=False)
    (pt,) = run_sweep(config(stub.url, [1], min_requests=2), prompts("x"))["points"]
    assert pt["output_tokens"] == 2 * 6 and pt["tokens_from"] == "chunks"
    assert pt["input_tokens"] is None
    assert span / 5 <= pt["tpot_s"]["mean"] <= (span + 0.03) / 5
    stub.reset(tokens_per_chunk=2, usage=False)
    (pt,) = run_sweep(config(stub.url, [1], min_requests=2), prompts("x"), count_tokens=len)["points"]
    assert pt["output_tokens"] == 2 * 12 and pt["tokens_from"] == "tokenizer"
    assert span / 11 <= pt["tpot_s"]["mean"] <= (span + 0.03) / 11


def test_closed_loop_holds_exactly_c_in_flight(stub):
    state = stub.reset()
    cfg = config(stub.url, [1, 3], requests_per_concurrency=2, min_requests=4, warmup_requests=2, osl=5)
    points = run_sweep(cfg, prompts("p", "q", "r"))["points"]
    assert [p["concurrency"] for p in points] == [1, 3]
    assert [p["num_requests"] for p in points] == [4, 6]  # max(4, 2 * c)
    arrivals = state.arrivals
    assert len(arrivals) == 2 + 4 + 6  # warm-up first, then the points in order
    assert max(n for _, n in arrivals[2:6]) == 1
    assert max(n for _, n in arrivals[6:]) == 3
    body = arrivals[-1][0]
    assert body["max_tokens"] == 5 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["model"] == "stub" and body["temperature"] == 0.0
    assert body["messages"][0]["role"] == "user"


def test_prompt_order_is_reproducible(stub):
    ps = prompts(*"abcde")

    def sent(seed: int) -> list[str]:
        state = stub.reset()
        run_sweep(config(stub.url, [1], min_requests=6, seed=seed), ps)
        return [b["messages"][0]["content"] for b, _ in state.arrivals]

    first = sent(0)
    assert sent(0) == first
    assert sent(1) != first
    assert sorted(first[:5]) == list("abcde")  # a full pass before any repeat
    assert first == [p.text for p in PromptStream(ps, seed=0).take(6)[0]]


def test_points_and_warm_up_share_one_stream_and_report_repeats(stub):
    # 1 warm-up + 2 + 4 requests over 5 prompts: the first two points repeat nothing (a prefix cache could not
    # answer them from earlier prefills), the last one repeats what the set could not supply fresh.
    state = stub.reset()
    cfg = config(stub.url, [1, 2], requests_per_concurrency=2, min_requests=1, warmup_requests=1)
    points = run_sweep(cfg, prompts(*"abcde"))["points"]
    texts = [b["messages"][0]["content"] for b, _ in state.arrivals]
    assert len(texts) == 1 + 2 + 4
    assert len(set(texts[:5])) == 5
    assert [p["repeated_prompts"] for p in points] == [0, 2]


def test_completions_api(stub):
    state = stub.reset()
    (pt,) = run_sweep(config(stub.url, [2], api="completions"), prompts("raw prompt"))["points"]
    assert pt["num_failed"] == 0 and pt["output_tokens"] == 4 * 6
    assert all(b["prompt"] == "raw prompt" and "messages" not in b for b, _ in state.arrivals)


def test_extra_body_fields_reach_every_request_and_are_recorded(stub):
    state = stub.reset()
    extra = {"top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}
    result = run_sweep(config(stub.url, [2], extra_body=extra), prompts("hi"))
    assert state.arrivals and all(b["top_p"] == 0.9 and b["top_k"] == 20 and b["repetition_penalty"] == 1.1
                                  and b["stream"] is True for b, _ in state.arrivals)
    assert result["config"]["extra_body"] == extra


@pytest.mark.parametrize("field", ["max_tokens", "stream", "model", "messages", "seed"])
def test_extra_body_may_not_change_what_the_sweep_sets(field):
    with pytest.raises(ValueError, match=f"extra_body sets {field}, which the sweep sets itself"):
        SweepConfig(url="http://x", model="m", concurrencies=[1], extra_body={field: 1})


def test_failures_are_counted(stub):
    stub.reset()
    cfg = config(stub.url, [2], min_requests=8)
    (pt,) = run_sweep(cfg, prompts("ok1", "ok2", "fail:x", "midfail:y"))["points"]
    assert pt["num_requests"] == 8 and pt["num_failed"] == 4  # two passes over 2 failing prompts
    assert pt["output_tokens"] == 4 * 6  # only the successful requests
    joined = " ".join(pt["errors"])
    assert "HTTP 500" in joined and "stub failure for fail:x" in joined and "stub died mid-stream" in joined


def test_tok_s_per_user_is_one_over_the_median_tpot(stub):
    """Interactivity as InferenceMAX plots it against tokens/s/GPU: 1000 / median TPOT (ms). Three users decoding
    at very different speeds: the mean of their 1 / TPOT (44 tok/s) is no user's experience; the median is 25."""
    gaps = {"fast": 0.01, "mid": 0.04, "slow": 0.16}
    stub.reset(gaps=gaps)
    (pt,) = run_sweep(config(stub.url, [1], min_requests=3), prompts(*gaps))["points"]
    # slack: a loaded 2-core machine's scheduling (10 ms was exceeded with other jobs running); 20 ms still tells
    # 1 / the median TPOT (25 tok/s) from the mean of 1 / TPOT (44) and from 1 / the mean TPOT (14)
    chunks, slack = 6, 0.020
    # one token per chunk and the usage chunk right after the last: TPOT_i = gap_i (plus scheduling slack)
    assert 1 / (0.04 + slack) <= pt["tok_s_per_user"] <= 1 / 0.04
    assert pt["tok_s_per_user"] == pytest.approx(1 / pt["tpot_s"]["p50"])
    # TensorRT-LLM benchmark_serving's tput_user beside it: mean of tokens / E2E, E2E_i = FIRST_DELAY + 5 gap_i
    e2e = [FIRST_DELAY + (chunks - 1) * g for g in gaps.values()]
    lo = sum(chunks / (t + 2 * slack) for t in e2e) / 3
    assert lo <= pt["user_throughput_tok_s"] <= sum(chunks / t for t in e2e) / 3


def test_tail_latencies_are_the_percentiles_of_the_requests(stub):
    """Three users at 10, 40 and 160 ms a token: p90 and p99 interpolate between the two slowest as numpy's default
    (linear) does (a p90 and p99 that reported the median passed every test where all requests took alike)."""
    gaps = {"fast": 0.01, "mid": 0.04, "slow": 0.16}
    stub.reset(gaps=gaps)
    (pt,) = run_sweep(config(stub.url, [1], min_requests=3), prompts(*gaps))["points"]
    slack, chunks = 0.020, 6  # as above: a loaded machine's scheduling

    def tail(lo: float, hi: float, q: float) -> float:  # the q-th percentile of [low, lo, hi], q >= 50
        return lo + (hi - lo) * (q - 50) / 50

    for q in (50, 90, 99):
        assert tail(0.04, 0.16, q) <= pt["tpot_s"][f"p{q}"] <= tail(0.04, 0.16, q) + slack, q
        e2e = tail(FIRST_DELAY + (chunks - 1) * 0.04, FIRST_DELAY + (chunks - 1) * 0.16, q)
        assert e2e <= pt["e2el_s"][f"p{q}"] <= e2e + 2 * slack, q
    # inter-token gaps: five of each user's, so p90 and p99 are the slow user's (a late chunk shortens the next gap)
    assert 0.16 - slack <= pt["itl_s"]["p90"] <= pt["itl_s"]["p99"] <= 0.16 + 2 * slack
    assert pt["itl_s"]["p50"] < 0.04 + slack


def test_duration_lasts_until_a_failed_request_ends(stub):
    """vLLM's benchmark_duration runs to the end of the last request, failed or not: a request that held its slot
    for SLOW seconds and then died still took that time from the point's throughput."""
    stub.reset()
    (pt,) = run_sweep(config(stub.url, [2], min_requests=2), prompts("ok", "slowfail:x"))["points"]
    assert pt["num_failed"] == 1 and pt["output_tokens"] == 6
    assert pt["duration_s"] >= SLOW
    failed = next(r for r in pt["requests"] if not r["ok"])  # which prompt failed, and why, kept with it
    assert failed["prompt_id"] == "t/1" and "stub died" in failed["error"] and failed["ttft_s"] is None
    assert pt["output_tok_s"] <= 6 / SLOW and pt["request_throughput"] <= 1 / SLOW


def test_cut_dropped_and_malformed_streams_fail_their_request_only(stub):
    """A stream that closes before [DONE] (no finish, no usage) is a truncated answer, not a short success; a torn
    connection and an event that is not a JSON object fail their request without ending the sweep."""
    stub.reset()
    (pt,) = run_sweep(config(stub.url, [1], min_requests=4),
                      prompts("ok", "cut:a", "drop:b", "malformed:c"))["points"]
    assert pt["num_requests"] == 4 and pt["num_failed"] == 3
    assert pt["output_tokens"] == 6 and pt["tokens_from"] == "usage"  # the one complete answer's
    joined = " ".join(pt["errors"])
    assert "before [DONE]" in joined and "RemoteProtocolError" in joined and "malformed event" in joined


def test_an_error_sent_as_one_json_body_with_status_200_fails_its_request_with_the_servers_message(stub):
    stub.reset()
    (pt,) = run_sweep(config(stub.url, [1], min_requests=2), prompts("ok", "json200:x"))["points"]
    assert pt["num_failed"] == 1 and "stub refuses this prompt" in pt["errors"][0], pt["errors"]


def test_an_answer_complete_at_done_succeeds_though_the_server_holds_the_body_open(stub):
    stub.reset()
    start = time.monotonic()
    (pt,) = run_sweep(config(stub.url, [1], min_requests=2, timeout_s=10), prompts("ok", "holdopen:a"))["points"]
    assert pt["num_failed"] == 0 and pt["output_tokens"] == 12
    assert time.monotonic() - start < 5  # read past [DONE] briefly, not until the read timeout
    assert pt["duration_s"] < 2 * (FIRST_DELAY + 6 * GAP) + 0.5  # the request was over at [DONE]


def test_a_stalled_stream_fails_after_the_timeout_saying_which(stub):
    stub.reset()
    (pt,) = run_sweep(config(stub.url, [1], min_requests=2, timeout_s=0.5), prompts("ok", "stall:a"))["points"]
    assert pt["num_failed"] == 1 and "ReadTimeout: no answer from the endpoint for 0.5 s (--timeout)" in pt["errors"]


def test_only_the_first_choice_is_timed_and_counted(stub):
    stub.reset(usage=False)
    (pt,) = run_sweep(config(stub.url, [1], min_requests=1), prompts("twochoices:a"))["points"]
    assert pt["output_tokens"] == 6 and pt["tokens_from"] == "chunks"
    assert pt["itl_s"]["p50"] == pytest.approx(GAP, abs=0.015)


def test_an_empty_answer_is_a_success_with_no_latency_to_time(stub):
    """With --stop-at-eos a server may end at EOS before any content: a complete answer of 0 tokens, as vLLM's
    benchmark counts it, that gives no first-token time."""
    stub.reset()
    (pt,) = run_sweep(config(stub.url, [1], min_requests=2, ignore_eos=False), prompts("ok", "empty:a"))["points"]
    assert pt["num_failed"] == 0 and pt["empty_answers"] == 1 and pt["output_tokens"] == 6
    assert pt["ttft_s"]["p50"] == pytest.approx(FIRST_DELAY, abs=0.05)  # the one timed answer's
    # usage that counts the EOS token the answer ended on
    (pt,) = run_sweep(config(stub.url, [1], min_requests=2, ignore_eos=False), prompts("ok", "eos1:a"))["points"]
    assert pt["num_failed"] == 0 and pt["empty_answers"] == 1 and pt["output_tokens"] == 7


def test_answers_that_stop_before_max_tokens_under_ignore_eos_are_counted_and_shown(stub):
    """trtllm-serve stops gpt-oss's answers on harmony's stop tokens whatever ignore_eos says: the point's output
    lengths are then not the --osl asked for."""
    from dflash_trt.bench.cli import point_line

    stub.reset()
    (pt,) = run_sweep(config(stub.url, [1], min_requests=3), prompts("eos1:a", "empty:b"))["points"]
    assert pt["ended_early"] == 3  # the stub's EOS answers end with finish_reason "stop"
    assert "3 answers ended before max_tokens despite ignore_eos" in point_line(pt)
    (pt,) = run_sweep(config(stub.url, [1], min_requests=2), prompts("ok"))["points"]
    assert pt["ended_early"] == 0 and "ended before" not in point_line(pt)
    (pt,) = run_sweep(config(stub.url, [1], min_requests=2, ignore_eos=False), prompts("eos1:a"))["points"]
    assert pt["ended_early"] is None  # stopping at EOS was asked for


def test_a_sweep_whose_warm_up_fails_says_why_and_hands_over_nothing(stub):
    """Nothing measured, nothing to keep: a result written before by another run stays as it was."""
    stub.reset()
    kept = []
    with pytest.raises(SweepError, match="every warm-up request failed.*stub failure for fail:"):
        run_sweep(config(stub.url, [1], warmup_requests=1), prompts("fail:a"), on_result=kept.append)
    assert kept == []


def test_a_point_where_everything_fails_raises(stub):
    stub.reset()
    with pytest.raises(SweepError, match=r"concurrency 2 failed.*stub failure for fail:"):
        run_sweep(config(stub.url, [2]), prompts("fail:a", "fail:b"))


def test_the_points_before_a_failed_one_are_handed_over_as_measured(stub):
    stub.reset(fail_after=4)  # c=1's 4 requests, then the server errs
    kept = []
    with pytest.raises(SweepError, match="concurrency 2 failed"):
        run_sweep(config(stub.url, [1, 2, 4]), prompts("a", "b", "c"), on_result=lambda r: kept.append(json.dumps(r)))
    first, last = (json.loads(kept[i]) for i in (0, -1))
    assert [p["concurrency"] for p in first["points"]] == [1] and first["complete"] is False  # none before
    assert [p["concurrency"] for p in last["points"]] == [1] and last["stopped"]["concurrency"] == 2
    stub.reset()
    done = run_sweep(config(stub.url, [1, 2]), prompts("a", "b"))
    assert done["complete"] is True and "stopped" not in done


def test_an_interrupted_sweep_hands_over_the_points_before_it_and_names_the_one_in_flight(stub):
    # Ctrl-C: asyncio.run cancels the sweep's task; what was measured is kept with `stopped` naming the point
    stub.reset()
    kept = []

    async def interrupted():
        task = asyncio.ensure_future(run_sweep_async(config(stub.url, [1, 2]), prompts("a", "slowfail:b", "c", "d"),
                                                     on_result=lambda r: kept.append(json.loads(json.dumps(r)))))
        while len(kept) < 1:  # c=1's point
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # c=2 in flight (its slow request waits 0.4 s)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(interrupted())
    last = kept[-1]
    assert [p["concurrency"] for p in last["points"]] == [1] and last["complete"] is False
    assert last["stopped"] == {"concurrency": 2, "error": "interrupted"}


def test_results_named_otherwise_than_json_keep_csvs_of_their_own(tmp_path):
    assert csv_path_of(tmp_path / "ar.json") == tmp_path / "ar.csv"
    assert csv_path_of(tmp_path / "ar.r1") == tmp_path / "ar.r1.csv"
    assert csv_path_of(tmp_path / "ar.r2") == tmp_path / "ar.r2.csv"
    assert csv_path_of(tmp_path / "r.txt") != csv_path_of(tmp_path / "r.json")


def test_acceptance_fields_of_the_wrong_type_fail_their_request_only(stub):
    stub.reset(decoded_per_iter={"bad": "many"})
    (pt,) = run_sweep(config(stub.url, [1], min_requests=2), prompts("ok", "bad"))["points"]
    assert pt["num_failed"] == 1 and "malformed event" in pt["errors"][0]


@pytest.mark.parametrize("patch, error", [
    ({"usage_patch": {"bad": {"completion_tokens": "6"}}}, "usage.completion_tokens is '6', not a count"),
    ({"usage_patch": {"bad": {"prompt_tokens": "3"}}}, "usage.prompt_tokens is '3', not a count"),
    ({"usage_patch": {"bad": {"completion_tokens": -1}}}, "usage.completion_tokens is -1, not a count"),
    # the stub streams 6 chunks of an answer of at most 6 tokens: 60 would make tok/s ten times what was served
    ({"usage_patch": {"bad": {"completion_tokens": 60}}}, "usage.completion_tokens 60 is more than the request's "
                                                          "max_tokens 6"),
    ({"acceptance_record": {"bad": {"num_steps": 3}}}, "acceptance.tau is None, not a number"),
    ({"acceptance_record": {"bad": {"tau": 2.0, "num_steps": "3"}}}, "acceptance.num_steps is '3', not a count"),
    ({"acceptance_record": {"bad": {"tau": 2.0, "num_steps": 3, "acceptance_histogram": [1, "2"]}}},
     r"acceptance.acceptance_histogram\[1\] is '2', not a count"),
])
def test_counts_an_endpoint_gets_wrong_fail_their_request_not_the_sweep_or_its_figures(stub, patch, error):
    stub.reset(**patch)
    (pt,) = run_sweep(config(stub.url, [1], osl=6, min_requests=2), prompts("ok", "bad"))["points"]
    assert pt["num_failed"] == 1 and "malformed event" in pt["errors"][0]
    assert re.search(error, pt["errors"][0]), pt["errors"][0]
    assert pt["output_tokens"] == 6  # the good request's alone


# --- acceptance -----------------------------------------------------------------------------------

def test_acceptance_from_response_fields(stub):
    stub.reset(acceptance={"a": (2.0, 3), "b": (3.0, 1)})
    (pt,) = run_sweep(config(stub.url, [1], min_requests=4), prompts("a", "b"))["points"]
    acc = pt["acceptance"]
    assert acc["source"] == "response"
    # token-weighted: each prompt twice; (2*3 + 3*1) * 2 tokens over (3 + 1) * 2 steps
    assert acc["tau"] == pytest.approx(18 / 8)
    assert acc["num_steps"] == 8
    assert acc["acceptance_rate"] == pytest.approx((3 + 1) * 2 / ((3 + 1) * 2 * K))
    assert acc["acceptance_histogram"] == [1 * 4, (3 - 1) * 2 + (1 - 1) * 2]  # the stub sends [1, steps - 1]
    # the stub's /metrics is still read alongside: 4 requests of 3 drafts, 5 accepted, 9 draft tokens each
    m = pt["metrics_acceptance"]
    assert m["metrics"] == "vllm"
    assert m["tau"] == pytest.approx(1 + 20 / 12)


def test_requests_without_a_speculative_step_weigh_nothing_in_tau(stub):
    # the server answers tau: null for a request that ran no speculative step (a one-token answer)
    stub.reset(acceptance={"a": (2.0, 3), "c": (None, 0)})
    (pt,) = run_sweep(config(stub.url, [1], min_requests=4), prompts("a", "c"))["points"]
    assert pt["acceptance"]["tau"] == pytest.approx(2.0) and pt["acceptance"]["num_steps"] == 6


def test_acceptance_from_trtllm_decoded_tokens_per_iteration(stub):
    stub.reset(metrics=False, decoded_per_iter={"a": 2.0, "b": 3.0})
    (pt,) = run_sweep(config(stub.url, [1], min_requests=2), prompts("a", "b"))["points"]
    acc = pt["acceptance"]
    # 6 tokens each: 6 / 2 = 3 and 6 / 3 = 2 iterations -> 12 tokens over 5 iterations
    assert acc["field"] == "avg_decoded_tokens_per_iter"
    assert acc["tau"] == pytest.approx(12 / 5) and acc["num_steps"] == pytest.approx(5)


def test_acceptance_from_vllm_metrics(stub):
    stub.reset()
    (pt,) = run_sweep(config(stub.url, [2], min_requests=6), prompts("a"))["points"]
    acc = pt["acceptance"]
    assert acc["source"] == "metrics" and acc["metrics"] == "vllm"
    assert acc["tau"] == pytest.approx(1 + (6 * ACCEPTED) / (6 * STEPS))
    assert acc["acceptance_rate"] == pytest.approx(ACCEPTED / (STEPS * K))
    assert acc["num_steps"] == 6 * STEPS


def test_a_failed_read_of_metrics_costs_the_points_beside_it_not_the_rest(stub):
    stub.reset(metrics_failures=1)  # the read before the first point fails; those after it answer
    points = run_sweep(config(stub.url, [1, 2, 3], min_requests=2), prompts("a"))["points"]
    assert [pt["metrics_acceptance"] is None for pt in points] == [True, False, False]
    for pt in points[1:]:
        assert pt["metrics_acceptance"]["metrics"] == "vllm"
        assert pt["metrics_acceptance"]["tau"] == pytest.approx(1 + ACCEPTED / STEPS)


def test_no_acceptance_without_fields_or_metrics(stub):
    stub.reset(metrics=False)
    (pt,) = run_sweep(config(stub.url, [1], min_requests=1), prompts("a"))["points"]
    assert pt["acceptance"] is None and pt["metrics_acceptance"] is None


def test_acceptance_from_trtllm_serve_iteration_stats(stub):
    """trtllm-serve's /metrics: a JSON list of iteration statistics that each read drains. Over a point:
    tau = (accepted + requests with drafts) / requests with drafts, as TensorRT-LLM computes its acceptance length
    from the same stats (tests/integration/defs/accuracy/accuracy_core.py, compute_acceptance_length)."""
    stub.reset(metrics_format="trtllm")
    points = run_sweep(config(stub.url, [1, 2], min_requests=4, warmup_requests=2), prompts("a"))["points"]
    for pt in points:
        acc = pt["acceptance"]
        assert acc["source"] == "metrics" and acc["metrics"] == "trtllm"
        n = pt["num_requests"]  # only this point's requests: warm-up and the previous point were drained
        assert acc["num_steps"] == n * STEPS and acc["num_iterations"] == n * STEPS
        assert acc["tau"] == pytest.approx((n * ACCEPTED + n * STEPS) / (n * STEPS))
        assert acc["acceptance_rate"] == pytest.approx(ACCEPTED / (STEPS * K))
    # without enable_iter_perf_stats trtllm-serve answers []: a readable /metrics (asked again) with no figure
    empty = parse_metrics("[]")
    assert empty is not None and acceptance_delta(empty, empty) is None


def test_trtllm_serve_metrics_are_read_while_a_point_runs_so_none_are_dropped(stub):
    """trtllm-serve keeps its last 1000 iterations between reads of /metrics: a point longer than that, read once
    at its end, gave the acceptance of its tail. Read every metrics_every_s and summed, it covers the point."""
    stub.reset(metrics_format="trtllm", stats_cap=STEPS)  # here it keeps one request's iterations
    cfg = config(stub.url, [1], min_requests=4, metrics_every_s=0.05)
    (pt,) = run_sweep(cfg, prompts("a"))["points"]
    acc, n = pt["acceptance"], pt["num_requests"]
    assert acc["num_steps"] == n * STEPS and acc["tau"] == pytest.approx((ACCEPTED + STEPS) / STEPS)
    # the steps' committed tokens over the point's decoded ones (each answer's first token comes from prefill)
    assert acc["coverage"] == pytest.approx(n * (ACCEPTED + STEPS) / (n * (pt["output_tokens"] // n - 1)))
    stub.reset(metrics_format="trtllm", stats_cap=STEPS)
    (pt,) = run_sweep(config(stub.url, [1], min_requests=4, metrics_every_s=60), prompts("a"))["points"]
    assert pt["acceptance"]["num_steps"] == STEPS  # read at the end alone: the last request's iterations
    assert pt["acceptance"]["coverage"] == pytest.approx(acc["coverage"] / n)
    from dflash_trt.bench.cli import point_line

    assert f"tau from /metrics over steps that made {acc['coverage'] / n:.0%} of the tokens" in point_line(pt)


def test_a_failed_last_read_keeps_the_reads_taken_while_the_point_ran(stub):
    stub.reset(metrics_format="trtllm", metrics_fail_after=4)  # reads fail once the point's 4 requests are done
    (pt,) = run_sweep(config(stub.url, [1], min_requests=4, metrics_every_s=0.05), prompts("a"))["points"]
    acc = pt["acceptance"]
    assert acc["metrics"] == "trtllm" and STEPS <= acc["num_steps"] < 4 * STEPS  # the last request's went unread
    assert acc["coverage"] < (ACCEPTED + STEPS) / 5  # the stub's whole point: its 6-token answers decode 5 each
    with pytest.raises(ValueError, match="metrics_every_s must be > 0"):
        config(stub.url, [1], metrics_every_s=0)


def test_trtllm_iteration_stats_as_json_strings():
    """LLM.get_stats documents its items as JSON strings ('{"cpuMemUsage": ..., "iter": 0, ...}'); a /metrics
    list of those parses the same as a list of objects."""
    entry = {"iter": 0, "specDecodingStats": {"numDraftTokens": 6, "numAcceptedTokens": 4,
                                              "numRequestsWithDraftTokens": 2}}
    as_objects = parse_metrics(json.dumps([entry, {"iter": 1}]))
    assert parse_metrics(json.dumps([json.dumps(entry), json.dumps({"iter": 1})])) == as_objects
    acc = acceptance_delta({}, as_objects)
    assert acc["tau"] == pytest.approx((4 + 2) / 2) and acc["acceptance_rate"] == pytest.approx(4 / 6)
    assert acc["num_iterations"] == 2


def test_vllm_per_position_acceptance():
    """vLLM's counters as its SpecDecodingProm registers them (vllm/v1/spec_decode/metrics.py): the same names,
    labels and per-position counter, exposed by prometheus_client as vLLM's /metrics does."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    drafts = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", labels, registry=reg)
    tokens = Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", labels, registry=reg)
    accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", labels, registry=reg)
    per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                      labels + ["position"], registry=reg)

    def observe(engine: str, n_drafts: int, accepted_at: list[int]) -> None:  # K = 3 draft tokens per draft
        drafts.labels("m", engine).inc(n_drafts)
        tokens.labels("m", engine).inc(3 * n_drafts)
        accepted.labels("m", engine).inc(sum(accepted_at))
        for pos, n in enumerate(accepted_at):
            per_pos.labels("m", engine, str(pos)).inc(n)

    observe("0", 10, [5, 5, 5])
    before = parse_metrics(generate_latest(reg).decode())
    observe("0", 10, [8, 4, 2])
    observe("1", 10, [6, 2, 0])
    acc = acceptance_delta(before, parse_metrics(generate_latest(reg).decode()))
    assert acc["metrics"] == "vllm" and acc["num_steps"] == 20
    assert acc["tau"] == pytest.approx(1 + 22 / 20)
    assert acc["acceptance_rate"] == pytest.approx(22 / 60)
    assert acc["acceptance_per_position"] == pytest.approx([14 / 20, 6 / 20, 2 / 20])


def test_dflash_histogram_delta():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    reg = CollectorRegistry()
    h = Histogram("dflash_acceptance_length", "tau", buckets=(1, 2, 3, 4), registry=reg)
    for n in (1, 3, 4):
        h.observe(n)
    before = parse_metrics(generate_latest(reg).decode())
    for n in (2, 2, 4, 1):
        h.observe(n)
    after = parse_metrics(generate_latest(reg).decode())
    acc = acceptance_delta(before, after)
    assert acc["metrics"] == "dflash" and acc["num_steps"] == 4
    assert acc["tau"] == pytest.approx((2 + 2 + 4 + 1) / 4)
    assert acceptance_delta(after, after) is None  # no speculative step in between
    assert acceptance_delta(None, after) is None
    assert acceptance_delta({}, parse_metrics("# TYPE other counter\nother_total 3\n")) is None


# --- results files --------------------------------------------------------------------------------

def test_write_results_json_and_csv(stub, tmp_path):
    stub.reset(acceptance={"a": (2.0, 3)})
    result = run_sweep(config(stub.url, [1, 2], label="stub run"), prompts("a", "b"), dataset="tiny")
    assert result["label"] == "stub run" and result["model"] == "stub"
    assert result["dataset"] == {"name": "tiny", "count": 2, "categories": {"chat": 2}}
    assert result["config"]["concurrencies"] == [1, 2] and result["machine"]["cores"] >= 1
    json_path, csv_path = write_results(result, tmp_path / "out" / "run.json")
    assert csv_path == tmp_path / "out" / "run.csv"
    assert json.loads(json_path.read_text())["points"] == result["points"]
    with csv_path.open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["concurrency"]) for r in rows] == [1, 2]
    for row, pt in zip(rows, result["points"]):
        assert float(row["ttft_s_p50"]) == pytest.approx(pt["ttft_s"]["p50"])
        assert float(row["tpot_s_p99"]) == pytest.approx(pt["tpot_s"]["p99"])
        assert float(row["tok_s_per_user"]) == pytest.approx(pt["tok_s_per_user"])
        assert row["acceptance_source"] == "response"
        assert float(row["acceptance_tau"]) == pytest.approx(2.0)
        assert row["metrics_acceptance_metrics"] == "vllm"


def csv_table(path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def csv_cells(point: dict) -> dict[str, str]:
    """The cells a JSON point's values make: nested keys joined with '_', lists as JSON (nulls have none); its
    requests' own figures stay in the JSON."""
    def cells(value, name: str):
        if isinstance(value, dict):
            for key, item in value.items():
                yield from cells(item, f"{name}_{key}")
        elif value is not None:
            yield name, json.dumps(value) if isinstance(value, list) else str(value)

    return {k: v for key, item in point.items() if key != "requests" for k, v in cells(item, key)}


def test_csv_has_the_same_columns_whatever_the_endpoint_reports(stub, tmp_path):
    """CSVs of different runs concatenate: every run writes the same columns in the same order, an empty cell
    where its JSON has null (no acceptance reported, no TPOT for one-token answers, not a merged run)."""
    from dflash_trt.bench.rounds import merge_rounds

    runs = {}
    stub.reset(metrics=False)
    runs["no acceptance"] = run_sweep(config(stub.url, [1]), prompts("a"))
    stub.reset(metrics=False)
    runs["one token"] = run_sweep(config(stub.url, [1], osl=1), prompts("a"))
    stub.reset(acceptance={"a": (2.0, 3)})
    runs["response and vllm"] = run_sweep(config(stub.url, [1, 2]), prompts("a"))
    stub.reset(metrics_format="trtllm", decoded_per_iter={"a": 2.0})
    runs["trtllm"] = run_sweep(config(stub.url, [1]), prompts("a"))
    stub.reset(cached_tokens=3)
    runs["cached prompt tokens"] = run_sweep(config(stub.url, [1]), prompts("a"))
    stub.reset(acceptance={"a": (2.0, 3)})
    runs["merged"] = merge_rounds([runs["response and vllm"], run_sweep(config(stub.url, [1, 2]), prompts("a"))])
    tables = {name: csv_table(write_results(r, tmp_path / f"{i}.json")[1]) for i, (name, r) in enumerate(runs.items())}
    headers = {name: header for name, (header, _) in tables.items()}
    first = headers["no acceptance"]
    assert all(h == first for h in headers.values()), {n: len(h) for n, h in headers.items()}
    assert len(set(first)) == len(first)
    for name, (_, rows) in tables.items():
        for row, point in zip(rows, runs[name]["points"], strict=True):
            expected = csv_cells(point)
            assert {c: row.get(c) for c in expected} == expected, name
            # columns the point has no value for stay empty, never a made-up 0
            assert all(row[c] == "" for c in first if c not in expected), name
    assert tables["one token"][1][0]["tok_s_per_user"] == "" and tables["one token"][1][0]["tpot_s_p50"] == ""


# --- the command line against the stub ------------------------------------------------------------

def cli_sweep(stub, out, *args: str):
    from click.testing import CliRunner

    from dflash_trt.cli import main

    return CliRunner().invoke(main, ["bench", "sweep", "--url", stub.url, "--model", "stub", "--concurrency", "1",
                                     "--warmup", "0", "--requests-per-concurrency", "1", *args, "-o", str(out)])


def test_a_sweep_records_the_input_length_and_tokenizer_of_its_prompts(stub, tiny_dirs, tmp_path):
    """--isl replaces a built-in dataset's prompts by long-context ones: the result says so (its config holds the
    input length and the tokenizer that cut them, its dataset is not named as the short prompts were)."""
    tokenizer = str(tiny_dirs["qwen3"])
    state = stub.reset()
    r = cli_sweep(stub, tmp_path / "long.json", "--dataset", "cpu-small", "--isl", "64", "--tokenizer", tokenizer,
                  "--osl", "3")
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "long.json").read_text())
    assert res["config"]["isl"] == 64 and res["config"]["tokenizer"] == tokenizer
    sent = [b["messages"][0]["content"] for b, _ in state.arrivals]
    assert all(len(t) > 64 and "following" in t for t in sent)  # a task over a long context, not cpu-small's
    assert res["dataset"]["name"] != "cpu-small" and "64" in res["dataset"]["name"]
    stub.reset()  # the tokenizer as an absolute path, however it was written: the same workload either way
    r = cli_sweep(stub, tmp_path / "rel.json", "--dataset", "cpu-small", "--isl", "64", "--tokenizer",
                  os.path.relpath(tokenizer), "--osl", "3")
    assert json.loads((tmp_path / "rel.json").read_text())["config"]["tokenizer"] == str(Path(tokenizer).resolve())
    stub.reset()  # prompts used as written: no tokenizer cut them, none is recorded
    r = cli_sweep(stub, tmp_path / "short.json", "--dataset", "cpu-small", "--osl", "3", "--tokenizer", tokenizer)
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "short.json").read_text())
    assert res["config"]["isl"] is None and res["config"]["tokenizer"] is None
    assert res["dataset"]["name"] == "cpu-small"
    stub.reset()  # a GPU preset's own input length is recorded too, under the preset's name
    r = cli_sweep(stub, tmp_path / "preset.json", "--dataset", "gpu-1k1k", "--osl", "3")
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "preset.json").read_text())
    assert res["config"]["isl"] == 1024 and res["dataset"]["name"] == "gpu-1k1k"


def test_a_shared_prefix_starts_every_request_and_the_tokens_a_server_cached_are_summed(stub, tiny_dirs, tmp_path):
    """--prefix-len: one system prompt of real text, cut with the tokenizer, before every request's own (the system
    message, or the text before a completions prompt); the result records its length, and each point the prompt
    tokens the endpoint reported cached."""
    from transformers import AutoTokenizer

    from dflash_trt.bench.datasets import shared_prefix

    tokenizer = str(tiny_dirs["qwen3"])
    prefix = shared_prefix(40, AutoTokenizer.from_pretrained(tokenizer))
    state = stub.reset(cached_tokens=16)
    r = cli_sweep(stub, tmp_path / "chat.json", "--dataset", "cpu-small", "--osl", "3", "--prefix-len", "40",
                  "--tokenizer", tokenizer, "--requests-per-concurrency", "5")
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "chat.json").read_text())
    (point,) = res["points"]
    systems = [b["messages"][0] for b, _ in state.arrivals]
    assert systems == [{"role": "system", "content": prefix}] * 5
    assert len({b["messages"][1]["content"] for b, _ in state.arrivals}) == 5  # each its own question after it
    assert res["config"]["prefix_len"] == 40 and res["config"]["tokenizer"] == tokenizer
    assert point["cached_input_tokens"] == 5 * 16 and [q["cached_tokens"] for q in point["requests"]] == [16] * 5
    share = 5 * 16 / point["input_tokens"]
    assert f"{share:.0%} of prompt tokens cached" in r.stderr, r.stderr
    state = stub.reset()  # completions: the prefix, then the prompt; an endpoint that reports no cache: None
    r = cli_sweep(stub, tmp_path / "raw.json", "--dataset", "cpu-small", "--osl", "3", "--prefix-len", "40",
                  "--tokenizer", tokenizer, "--api", "completions")
    assert r.exit_code == 0, r.output
    assert all(b["prompt"].startswith(prefix + "\n\n") and len(b["prompt"]) > len(prefix) + 2
               for b, _ in state.arrivals)
    (point,) = json.loads((tmp_path / "raw.json").read_text())["points"]
    assert point["cached_input_tokens"] is None and "cached" not in r.stderr


def conversation(stub, cfg: SweepConfig, sent: list[Prompt], concurrency: int) -> list:
    """run_requests over `sent` in order (no shuffle, no warm-up): the results, in the prompts' order."""
    import httpx

    from dflash_trt.bench.sweep import run_requests

    async def run():
        async with httpx.AsyncClient(timeout=30) as client:
            return await run_requests(client, cfg, sent, concurrency)

    return asyncio.run(run())


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_turns_of_a_conversation_each_follow_the_earlier_ones_and_their_answers(stub, api):
    """--turns 3: seven prompts are conversations [0, 1, 2], [3, 4, 5] and [6], two at a time; a turn repeats the
    earlier user messages and the answers the endpoint streamed (the stub's: six chunks of "a"), then its own."""
    state = stub.reset()
    sent = prompts(*(f"q{i}" for i in range(7)))
    results = conversation(stub, config(stub.url, [2], api=api, turns=3), sent, 2)
    assert all(r.ok for r in results) and max(n for _, n in state.arrivals) == 2
    answer = "a" * 6

    def sent_before(body: dict) -> tuple[str, list]:
        """A request's own message, and what it sends before it."""
        if api == "chat":
            return body["messages"][-1]["content"], body["messages"][:-1]
        *before, last = body["prompt"].split("\n\n")
        return last, before

    def history(*earlier: str) -> list:
        """What a turn after these user messages and their answers sends before its own."""
        if api == "completions":
            return [f"{q}{answer}" for q in earlier]
        return [m for q in earlier for m in ({"role": "user", "content": q}, {"role": "assistant", "content": answer})]

    seen = dict(sent_before(b) for b, _ in state.arrivals)  # in the order they arrived
    assert seen == {"q0": history(), "q1": history("q0"), "q2": history("q0", "q1"), "q3": history(),
                    "q4": history("q3"), "q5": history("q3", "q4"), "q6": history()}
    order = list(seen)
    assert order.index("q0") < order.index("q1") < order.index("q2") and order.index("q3") < order.index("q4")


def test_a_turn_repeats_the_answer_of_a_reasoning_model_without_its_reasoning(stub):
    """Reasoning streams count as generated tokens, but a chat's next turn sends back the answer alone, as chat
    clients do (and as gpt-oss's template would drop it anyway)."""
    state = stub.reset()
    results = conversation(stub, config(stub.url, [1], turns=2), prompts("think:q0", "q1"), 1)
    assert all(r.ok for r in results) and len(results[0].chunk_times) == 6
    assert state.arrivals[1][0]["messages"][1] == {"role": "assistant", "content": "aaaa"}


def test_a_point_of_conversations_sends_whole_ones_at_least_one_a_stream():
    cfg = config("http://127.0.0.1:1", [1, 4], requests_per_concurrency=4, turns=8)
    assert (cfg.requests_at(1), cfg.requests_at(4)) == (8, 32)  # 4 and 16 requests: one and two conversations
    cfg = config("http://127.0.0.1:1", [2], requests_per_concurrency=5, turns=3)
    assert cfg.requests_at(2) == 12  # 10 requests: four conversations of three
    assert config("http://127.0.0.1:1", [2], requests_per_concurrency=5).requests_at(2) == 10


def test_a_failed_turn_ends_its_conversation_and_the_turns_left_fail_unsent(stub):
    state = stub.reset()
    sent = prompts("q0", "fail:q1", "q2", "q3", "q4")
    results = conversation(stub, config(stub.url, [1], turns=3), sent, 1)
    assert [r.ok for r in results] == [True, False, False, True, True]
    assert "not sent" in results[2].error and "stub failure" in results[1].error
    assert [b["messages"][-1]["content"] for b, _ in state.arrivals] == ["q0", "fail:q1", "q3", "q4"]
    assert len(state.arrivals[3][0]["messages"]) == 3  # q4 after q3 and its answer: a conversation of its own


def test_a_sweep_records_its_turns_and_refuses_none(stub, tmp_path):
    stub.reset()
    r = cli_sweep(stub, tmp_path / "turns.json", "--dataset", "cpu-small", "--osl", "2", "--turns", "2",
                  "--requests-per-concurrency", "4")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "turns.json").read_text())["config"]["turns"] == 2
    assert cli_sweep(stub, tmp_path / "none.json", "--turns", "0").exit_code == 2
    with pytest.raises(ValueError, match="turns must be >= 1"):
        config(stub.url, [1], turns=0)


def test_without_usage_a_given_tokenizer_counts_the_answers_text(stub, tiny_dirs, tmp_path):
    # the stub sends "ab" a chunk, 6 chunks; the tiny tokenizer has a token per character
    for args, tokens, source, said in (([], 6, "chunks", "--tokenizer counts its text"),
                                       (["--tokenizer", str(tiny_dirs["qwen3"])], 12, "tokenizer",
                                        "tokens counted by the tokenizer")):
        stub.reset(tokens_per_chunk=2, usage=False)
        r = cli_sweep(stub, tmp_path / "run.json", "--dataset", "cpu-small", "--osl", "6", *args)
        assert r.exit_code == 0, r.output
        (pt,) = json.loads((tmp_path / "run.json").read_text())["points"]
        assert pt["output_tokens"] == 4 * tokens and pt["tokens_from"] == source
        assert said in r.output


def test_rounds_of_other_input_lengths_are_not_merged_and_compare_warns(stub, tmp_path):
    from click.testing import CliRunner

    from dflash_trt.cli import main

    for name, isl, seed in (("a.r1", "64", "0"), ("a.r2", "64", "1"), ("b", "128", "0")):
        stub.reset()
        r = cli_sweep(stub, tmp_path / f"{name}.json", "--dataset", "cpu-small", "--isl", isl, "--osl", "3",
                      "--seed", seed)
        assert r.exit_code == 0, r.output
    runner = CliRunner()
    ok = runner.invoke(main, ["bench", "merge", str(tmp_path / "a.r1.json"), str(tmp_path / "a.r2.json"),
                              "-o", str(tmp_path / "a.json")])
    assert ok.exit_code == 0, ok.output
    bad = runner.invoke(main, ["bench", "merge", str(tmp_path / "a.r1.json"), str(tmp_path / "b.json"),
                               "-o", str(tmp_path / "x.json")])
    assert bad.exit_code == 1 and "config.isl 64" in bad.output and "128" in bad.output, bad.output
    assert not (tmp_path / "x.json").exists()
    res = runner.invoke(main, ["bench", "compare", str(tmp_path / "b.json"), str(tmp_path / "a.json"), "--json"])
    assert res.exit_code == 0, res.output
    assert "warning" in res.stderr and "isl" in res.stderr and str(tmp_path / "b.json") in res.stderr, res.stderr
    assert json.loads(res.stdout)[0]["concurrency"] == 1  # the rows still come, as JSON on stdout alone


@pytest.mark.parametrize("texts, args", [
    (["a", "b"], ["--osl", "1"]),  # one-token answers: no TPOT, so no tok/s/user
    (["empty:a", "empty:b"], ["--stop-at-eos"]),  # answers that end at EOS at once: no first token to time
])
def test_the_console_line_shows_a_dash_where_a_figure_is_undefined(stub, tmp_path, texts, args):
    data = tmp_path / "p.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": t}) for t in texts))
    stub.reset()
    r = cli_sweep(stub, tmp_path / "run.json", "--dataset", str(data), *args)
    assert r.exit_code == 0, r.output
    (point,) = json.loads((tmp_path / "run.json").read_text())["points"]
    assert point["tok_s_per_user"] is None and point["tpot_s"]["p50"] is None
    (line,) = [line for line in r.stderr.splitlines() if line.startswith("c=1 ")]
    assert re.search(r"\s- tok/s/user\s", line) and re.search(r"TPOT p50\s+- ms", line), line
    assert "0.0 tok/s/user" not in line and " 0.0 ms" not in line
    if point["ttft_s"]["p50"] is None:
        assert re.search(r"TTFT p50\s+- ms", line), line


# --- end to end against this project's server -----------------------------------------------------

class _TruthByRow:
    """force_drafts' truth table for a live server: the greedy continuation of whichever request holds a
    cache row, looked up when the drafter runs (rows are assigned by the scheduler)."""

    def __init__(self, engine, truth: dict[tuple, list[int]]) -> None:
        self.engine, self.truth = engine, truth

    def __getitem__(self, row: int) -> list[int]:
        (seq,) = [s for s in self.engine.scheduler.running if s.slot == row]
        return self.truth[tuple(seq.prompt_ids)]


def test_against_the_real_server(tiny_dirs):
    from dflash_trt import SamplingParams
    from tests.forced_drafts import force_drafts
    from tests.server.conftest import MODEL, start_server, tiny_engine

    new, k = 8, 3
    ps = prompts("Hello there", "def f(x):", "1 + 2 =", max_tokens=new)
    engine = tiny_engine(tiny_dirs, max_batch_size=4, max_draft_len=k)
    # A random drafter accepts nothing (tau 1 everywhere); drafting the true greedy continuation with some
    # corruption gives requests different step counts, so the token weighting of tau is exercised.
    ids = [engine.encode_chat([{"role": "user", "content": p.text}]) for p in ps]
    outs = engine.generate(ids, SamplingParams(max_new_tokens=new, ignore_eos=True))
    force_drafts(engine, _TruthByRow(engine, {tuple(i): i + o.token_ids for i, o in zip(ids, outs)}), error_rate=0.3)
    server = start_server(engine)
    try:
        cfg = SweepConfig(url=server.base_url, model=MODEL, concurrencies=[1, 2], requests_per_concurrency=1,
                          min_requests=3, warmup_requests=1)
        result = run_sweep(cfg, ps)
    finally:
        server.stop()
    assert [p["num_requests"] for p in result["points"]] == [3, 3]
    for pt in result["points"]:
        assert pt["num_failed"] == 0
        assert pt["output_tokens"] == 3 * new  # ignore_eos: every request runs to max_tokens
        acc, m = pt["acceptance"], pt["metrics_acceptance"]
        assert acc["source"] == "response" and m["metrics"] == "dflash"
        assert acc["num_steps"] == m["num_steps"] > 0
        assert acc["tau"] == pytest.approx(m["tau"], rel=1e-9)
        # every token after the prefill's first came from a verify step
        assert acc["tau"] == pytest.approx(3 * (new - 1) / acc["num_steps"])
        assert 1.0 < acc["tau"] <= k + 1


def test_reasoning_deltas_count_as_generated_chunks():
    from dflash_trt.bench.sweep import RequestResult, _read_event

    res = RequestResult("p", start=0.0)
    _read_event({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, "chat", 0.1, res)
    _read_event({"choices": [{"delta": {"reasoning_content": "Let me think"}}]}, "chat", 0.2, res)  # vLLM/TRT-LLM
    _read_event({"choices": [{"delta": {"reasoning": " more"}}]}, "chat", 0.3, res)
    _read_event({"choices": [{"delta": {"content": "Answer"}}]}, "chat", 0.4, res)
    assert res.chunk_times == [0.2, 0.3, 0.4] and res.ttft == pytest.approx(0.2)


def test_the_machine_record_names_the_settings_that_change_its_instructions(monkeypatch):
    """A run under DFLASH_TRT_MARCH / ONEDNN_MAX_CPU_ISA (another CPU emulated) says so in its record; a plain run
    records no environment."""
    from dflash_trt.bench.sweep import _INSTRUCTION_ENV, machine_info

    for key in _INSTRUCTION_ENV:
        monkeypatch.delenv(key, raising=False)
    assert "environment" not in machine_info()
    monkeypatch.setenv("DFLASH_TRT_MARCH", "x86-64-v3")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("UNRELATED", "1")
    assert machine_info()["environment"] == {"DFLASH_TRT_MARCH": "x86-64-v3", "ONEDNN_MAX_CPU_ISA": "AVX2"}
