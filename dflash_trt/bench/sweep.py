"""`bench sweep`: a closed-loop load generator for any OpenAI-compatible streaming endpoint.

At each concurrency c, exactly c streaming requests are in flight until the point's requests are done
(bounded load: requests per point grow with c). Prompts are dealt from one seeded stream (PromptStream), so two
runs with the same seed and points send the same prompts, and none twice until the dataset runs out. Latencies
follow trtllm-serve's benchmark_serving definitions:
TTFT = first content chunk, TPOT = (E2E - TTFT) / (output tokens - 1), ITL = gaps between content chunks. With
speculative decoding one chunk may carry several tokens, so ITL is per chunk, not per token (as vLLM's and
TensorRT-LLM's benchmark_serving count it; TPOT is the per-token figure). Events that arrive within BURST_S of the
one before count as one chunk: trtllm-serve streams gpt-oss's harmony output one event per token, so a step's tokens
arrive as a burst that per-event gaps would read as an ITL near 0 (TensorRT-LLM's serve/harmony_adapter.py).
Tokens/s/user is 1 / median TPOT, the "interactivity" axis of InferenceMAX's throughput-vs-interactivity charts
(utils/process_result.py: intvty = 1000 / tpot_ms); TensorRT-LLM's "User throughput" (mean of output tokens / E2E,
TTFT included) is kept beside it as user_throughput_tok_s.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import json
import os
import platform
import random
import socket
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import httpx
import numpy as np
from tqdm import tqdm

from dflash_trt import dir_swap
from dflash_trt.bench.endpoint_metrics import acceptance_delta, drains, scrape, sum_drained

if TYPE_CHECKING:
    from dflash_trt.bench.datasets import BenchPrompt

# Content events closer than this are one step's tokens sent one event each: no server steps in under a millisecond.
BURST_S = 0.001


def server_root(url: str) -> str:
    """http://host:port for an endpoint given with or without its /v1."""
    return url.rstrip("/").removesuffix("/v1")


class SweepError(RuntimeError):
    """A point where no request succeeded (the endpoint's error is in the message)."""


# request fields the sweep sets from its own options: --extra-body may not change them behind the result's back
OWNED_FIELDS = frozenset({"model", "max_tokens", "max_completion_tokens", "temperature", "stream", "stream_options",
                          "messages", "prompt", "ignore_eos", "n", "seed"})
# how long to read past [DONE] for the end of the body, which returns the connection to the pool (a server that
# holds it open keeps the worker's slot this much longer)
DRAIN_AFTER_DONE_S = 0.1


@dataclass
class SweepConfig:
    url: str  # http://host:port or http://host:port/v1
    model: str
    concurrencies: list[int]
    requests_per_concurrency: int = 4  # a point sends max(min_requests, requests_per_concurrency * c)
    min_requests: int = 4
    warmup_requests: int | None = None  # None: the first concurrency; sent and discarded before the first point
    seed: int = 0
    gpus: int = 1
    api: Literal["chat", "completions"] = "chat"
    temperature: float = 0.0
    ignore_eos: bool = True  # vLLM, trtllm-serve and this project's server accept it
    osl: int | None = None  # output tokens per request; None: each prompt's max_tokens
    label: str = ""  # run name in plots, e.g. "DFlash K=3"
    # What the prompts are, recorded so that rounds and runs of other workloads are told apart (the sweep sends
    # the prompts it is given): the input tokens of long-context prompts (None: prompts as written) and the
    # tokenizer that cut them (None: about 4 characters per token).
    isl: int | None = None
    tokenizer: str | None = None
    # One system prompt every request starts with (the system message, or the text before a completions prompt),
    # and its tokens as asked for (--prefix-len): many users' requests share one, and a server may reuse its prefill.
    prefix: str = ""
    prefix_len: int | None = None
    # Turns a conversation holds: a stream sends its prompts in conversations, each request the next user message
    # after the earlier turns and their answers (a chat's history grows, and a server may reuse its prefill). 1: every
    # request stands alone.
    turns: int = 1
    # more request fields for every request (top_p, top_k, penalties, a server's own extensions); never the ones above
    extra_body: dict = field(default_factory=dict)
    timeout_s: float = 600.0  # per connect / read of the stream: seconds without a byte before a request fails
    # Servers may count a step in /metrics only after sending its tokens; waiting this long before each
    # scrape keeps the last step of one point from landing in the next.
    metrics_settle_s: float = 0.2
    # trtllm-serve keeps its last 1000 iterations between reads of /metrics (each read empties them): read this often
    # while a point runs, so that its acceptance covers the whole point rather than its tail
    metrics_every_s: float = 2.0

    def __post_init__(self) -> None:
        self.concurrencies = [int(c) for c in self.concurrencies]
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ValueError(f"concurrencies must be a non-empty list of integers >= 1, got {self.concurrencies}")
        if self.api not in ("chat", "completions"):
            raise ValueError(f"api must be 'chat' or 'completions', got {self.api!r}")
        if not self.metrics_every_s > 0:
            raise ValueError(f"metrics_every_s must be > 0, got {self.metrics_every_s}")
        for name in ("requests_per_concurrency", "min_requests", "gpus", "turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_requests is not None and self.warmup_requests < 0:
            raise ValueError(f"warmup_requests must be >= 0, got {self.warmup_requests}")
        owned = sorted(set(self.extra_body) & OWNED_FIELDS)
        if owned:
            raise ValueError(f"extra_body sets {', '.join(owned)}, which the sweep sets itself (--model, --osl, "
                             "--temperature, --ignore-eos, --seed, --api and the dataset)")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.metrics_settle_s < 0:
            raise ValueError(f"metrics_settle_s must be >= 0, got {self.metrics_settle_s}")
        for name in ("osl", "isl", "prefix_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")

    @property
    def root_url(self) -> str:
        return server_root(self.url)

    @property
    def endpoint(self) -> str:
        path = "chat/completions" if self.api == "chat" else "completions"
        return f"{self.root_url}/v1/{path}"

    @property
    def metrics_url(self) -> str:
        return f"{self.root_url}/metrics"

    def requests_at(self, concurrency: int) -> int:
        n = max(self.min_requests, self.requests_per_concurrency * concurrency)
        if self.turns > 1:  # whole conversations, at least one a stream (else fewer streams would run)
            n = max(-(-n // self.turns), concurrency) * self.turns
        return n

    @property
    def num_warmup(self) -> int:
        return self.concurrencies[0] if self.warmup_requests is None else self.warmup_requests


class PromptStream:
    """The run's prompts, dealt in order to the warm-up and then to each point: passes over the whole set, each
    pass in a fresh seeded shuffle. A prompt is sent again only once the set runs out, so a server's prefix cache
    (vLLM's is on by default) cannot answer a measured request from an earlier request's prefill; `repeats`
    counts the requests it dealt whose prompt had been dealt before. The deal depends only on (prompts, seed)."""

    def __init__(self, prompts: Sequence[BenchPrompt], seed: int) -> None:
        if not prompts:
            raise ValueError("no prompts to send")
        self._prompts = list(prompts)
        self._rng = random.Random(seed)
        self._pending: list[BenchPrompt] = []
        self._dealt: set[str] = set()

    def take(self, n: int) -> tuple[list[BenchPrompt], int]:
        """The next n prompts, and how many of them were dealt before."""
        while len(self._pending) < n:
            order = list(range(len(self._prompts)))
            self._rng.shuffle(order)
            self._pending.extend(self._prompts[i] for i in order)
        out, self._pending = self._pending[:n], self._pending[n:]
        repeats = 0
        for p in out:
            repeats += p.id in self._dealt
            self._dealt.add(p.id)
        return out, repeats


@dataclass
class RequestResult:
    prompt_id: str
    start: float  # perf_counter just before the request is sent
    ok: bool = False
    error: str | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each non-empty content chunk
    end: float | None = None  # arrival of the last data event (the finishing / usage chunk)
    finish: float | None = None  # when the request was over, failed or not: it held its slot until then
    completion_tokens: int | None = None  # usage, when the endpoint sends it
    text: list[str] = field(default_factory=list)  # the content chunks, for a tokenizer to count without usage
    answer: list[str] = field(default_factory=list)  # of those, the answer's (not reasoning): a chat's next turn
    counted_tokens: int | None = None  # that count
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # of those, the ones the server did not prefill again (usage, where it says)
    finish_reason: str | None = None  # the choice's, once the endpoint sends one
    acceptance: dict | None = None  # this project's per-choice extension
    avg_decoded_tokens_per_iter: float | None = None  # trtllm-serve's per-choice acceptance length

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2el(self) -> float:
        return self.end - self.start

    @property
    def output_tokens(self) -> int:
        if self.completion_tokens is not None:
            return self.completion_tokens
        return self.counted_tokens if self.counted_tokens is not None else len(self.chunk_times)

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        return (self.e2el - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        starts: list[float] = []
        for t in self.chunk_times:  # a burst is measured from its first event: a late reader's backlog is not one
            if not starts or t - starts[-1] > BURST_S:
                starts.append(t)
        return [b - a for a, b in zip(starts, starts[1:])]


def request_body(cfg: SweepConfig, prompt: BenchPrompt, index: int, history: Sequence[tuple[str, str]] = ()) -> dict:
    """history: the conversation's earlier turns, (user message, answer) each, which the request repeats first."""
    body: dict = {
        "model": cfg.model,
        "max_tokens": cfg.osl if cfg.osl is not None else prompt.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.api == "chat":
        system = [{"role": "system", "content": cfg.prefix}] if cfg.prefix else []
        earlier = [{"role": role, "content": text}
                   for turn in history for role, text in zip(("user", "assistant"), turn)]
        body["messages"] = [*system, *earlier, {"role": "user", "content": prompt.text}]
    else:
        text = "".join(f"{user}{answer}\n\n" for user, answer in history) + prompt.text
        body["prompt"] = f"{cfg.prefix}\n\n{text}" if cfg.prefix else text
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.temperature > 0:
        body["seed"] = (cfg.seed * 1_000_003 + index) % 2**31  # sampled runs stay reproducible
    return {**body, **cfg.extra_body}


async def send_request(client: httpx.AsyncClient, cfg: SweepConfig, prompt: BenchPrompt, index: int,
                       history: Sequence[tuple[str, str]] = ()) -> RequestResult:
    """One streaming request, timed chunk by chunk; failures come back as results with ok=False."""
    body = request_body(cfg, prompt, index, history)
    res = RequestResult(prompt.id, time.perf_counter())
    try:
        await _stream(client, cfg, body, res)
    finally:
        if res.finish is None:  # else [DONE]'s time: what is read after it is not the request's
            res.finish = time.perf_counter()
    return res


async def _stream(client: httpx.AsyncClient, cfg: SweepConfig, body: dict, res: RequestResult) -> None:
    try:
        async with client.stream("POST", cfg.endpoint, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {text[:500]}"
                return
            if resp.headers.get("content-type", "").startswith("application/json"):
                # a server that answers an error (or ignores "stream") with one JSON body: its message is the news
                text = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP 200 with a JSON body, not an event stream: {text[:500]}"
                return
            done = False
            lines = resp.aiter_lines()
            async for line in lines:
                if not line.startswith("data:"):
                    continue
                now = time.perf_counter()
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done, res.finish = True, now
                    break
                event = json.loads(payload)
                if isinstance(event, dict) and "error" in event:
                    err = event["error"]
                    res.error = "stream error: " + (err.get("message", str(err)) if isinstance(err, dict) else str(err))
                    return
                try:
                    _read_event(event, cfg.api, now, res, _max_tokens(body))
                except (AttributeError, TypeError, ValueError) as e:
                    # a malformed event fails its request, not the whole sweep and every point measured so far
                    res.error = f"malformed event {payload[:200]!r}: {e}"
                    return
            if done:
                # Read what follows [DONE] so the connection goes back to the pool, but not from a server that
                # holds it open: the answer is complete.
                with contextlib.suppress(asyncio.TimeoutError, httpx.HTTPError):
                    await asyncio.wait_for(_drain(lines), DRAIN_AFTER_DONE_S)
    except httpx.TimeoutException as e:
        res.error = f"{type(e).__name__}: no answer from the endpoint for {cfg.timeout_s:g} s (--timeout)"
        return
    except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return
    if not res.chunk_times:
        # An empty answer (EOS first, with --stop-at-eos), complete: finished and [DONE]. Usage may count the EOS
        # token (this project's serve and vLLM do: 1), or not (0).
        if done and (res.completion_tokens == 0 or res.finish_reason is not None):
            res.ok = True
            return
        res.error = "the stream ended without any content"
        return
    if not done:
        # OpenAI-compatible servers (vLLM, trtllm-serve, SGLang, this one) end a complete stream with [DONE]; one
        # that closes without it was cut short, and its latencies and token count describe a truncated answer.
        res.error = f"the stream ended before [DONE] (cut short after {len(res.chunk_times)} content chunks)"
        return
    res.ok = True


async def _drain(lines) -> None:
    async for _ in lines:
        pass


def _max_tokens(body: dict) -> int | None:
    limits = [v for v in (body.get("max_tokens"), body.get("max_completion_tokens")) if isinstance(v, int)]
    return max(limits) if limits else None


def _count(value, name: str, of: str = "") -> int:
    """`value` where it is a count (an int >= 0, not a bool), else ValueError naming the field `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} is {value!r}, not a count{of}")
    return value


def _token_count(usage: dict, key: str, default: int | None) -> int | None:
    value = usage.get(key, default)
    return None if value is None else _count(value, f"usage.{key}", " of tokens")


def _read_event(event: dict, api: str, now: float, res: RequestResult, max_tokens: int | None = None) -> None:
    """Raises ValueError (or TypeError, AttributeError) on an event no endpoint should send."""
    res.end = now
    usage = event.get("usage")
    if usage:
        res.completion_tokens = _token_count(usage, "completion_tokens", res.completion_tokens)
        res.prompt_tokens = _token_count(usage, "prompt_tokens", res.prompt_tokens)
        if max_tokens is not None and res.completion_tokens is not None and res.completion_tokens > max_tokens:
            # figures on it would be off by that factor (tok/s up, TPOT down)
            raise ValueError(f"usage.completion_tokens {res.completion_tokens} is more than the request's "
                             f"max_tokens {max_tokens}")
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            res.cached_tokens = details["cached_tokens"]
    for choice in event.get("choices") or []:
        if choice.get("index", 0) != 0:  # the sweep asks for one; another choice's chunks are not its tokens
            continue
        if api == "chat":
            delta = choice.get("delta") or {}
            # Reasoning models (gpt-oss through harmony) stream their analysis channel in a separate field:
            # those are generated tokens too, for TTFT and ITL alike, but not the answer a chat's next turn repeats
            # (chat templates drop earlier turns' reasoning, and clients do not send it back).
            answer = delta.get("content")
            content = answer or delta.get("reasoning_content") or delta.get("reasoning")
        else:
            content = answer = choice.get("text")
        if content:
            res.chunk_times.append(now)
            res.text.append(content)
            if answer:
                res.answer.append(answer)
        if choice.get("finish_reason"):
            res.finish_reason = choice["finish_reason"]
        if isinstance(choice.get("acceptance"), dict):
            res.acceptance = _acceptance(choice["acceptance"])
        if choice.get("avg_decoded_tokens_per_iter"):
            res.avg_decoded_tokens_per_iter = float(choice["avg_decoded_tokens_per_iter"])


def _acceptance(record: dict) -> dict:
    """This project's per-choice acceptance record, checked for what response_acceptance reads."""
    steps, tau = _count(record.get("num_steps"), "acceptance.num_steps", " of steps"), record.get("tau")
    if steps and (isinstance(tau, bool) or not isinstance(tau, (int, float))):
        raise ValueError(f"acceptance.tau is {tau!r}, not a number")
    counts = {key: record.get(key, 0) for key in ("total_draft_tokens", "total_accepted_draft_tokens")}
    histogram = record.get("acceptance_histogram") or []
    if not isinstance(histogram, list):
        raise ValueError(f"acceptance.acceptance_histogram is {histogram!r}, not a list of counts")
    counts.update({f"acceptance_histogram[{i}]": n for i, n in enumerate(histogram)})
    for key, n in counts.items():
        _count(n, f"acceptance.{key}")
    return record


async def run_requests(client: httpx.AsyncClient, cfg: SweepConfig, prompts: list[BenchPrompt], concurrency: int,
                       first_index: int = 0, stage: str = "") -> list[RequestResult]:
    """Closed loop: `concurrency` workers, each sending its next request as soon as its previous one ends; with
    cfg.turns > 1 a worker holds one conversation at a time, cfg.turns consecutive prompts (the last one may be
    shorter), each sent after the earlier ones and their answers; a failed turn ends its conversation, and the turns
    left fail unsent. A terminal shows the requests done (`stage` names them): a point of long answers runs for
    minutes."""
    results: list[RequestResult | None] = [None] * len(prompts)
    firsts = range(0, len(prompts), cfg.turns)
    todo = iter(firsts)  # each conversation's first request, shared by the workers; next() never yields to the loop
    # disable=None: no bar where stderr is no terminal (a log file, CI)
    with tqdm(total=len(prompts), desc=stage, unit="req", leave=False, disable=None) as bar:

        async def worker() -> None:
            for first in todo:
                history: list[tuple[str, str]] | None = []
                for i in range(first, min(first + cfg.turns, len(prompts))):
                    if history is None:
                        now = time.perf_counter()
                        results[i] = RequestResult(prompts[i].id, now, error="an earlier turn of its conversation "
                                                   "failed: not sent", finish=now)
                    else:
                        results[i] = res = await send_request(client, cfg, prompts[i], first_index + i, history)
                        history = [*history, (prompts[i].text, "".join(res.answer))] if res.ok else None
                    bar.update()

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(firsts)))))
    return results  # type: ignore[return-value]


def summary(values: Sequence[float]) -> dict[str, float | None]:
    if len(values) == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def response_acceptance(results: Sequence[RequestResult]) -> dict | None:
    """Token-weighted over requests: tau = sum(tau_i * steps_i) / sum(steps_i)."""
    stats = [r.acceptance for r in results if r.acceptance and r.acceptance.get("num_steps") is not None]
    if not stats:
        return _trtllm_acceptance(results)
    steps = sum(a["num_steps"] for a in stats)
    drafted = sum(a.get("total_draft_tokens", 0) for a in stats)
    accepted = sum(a.get("total_accepted_draft_tokens", 0) for a in stats)
    hist = [0] * max(len(a.get("acceptance_histogram") or []) for a in stats)
    for a in stats:
        for i, n in enumerate(a.get("acceptance_histogram") or []):
            hist[i] += n
    return {
        "source": "response",
        "tau": sum(a["tau"] * a["num_steps"] for a in stats if a["num_steps"]) / steps if steps else None,
        "num_steps": steps,
        "acceptance_rate": accepted / drafted if drafted else None,
        "total_draft_tokens": drafted,
        "total_accepted_draft_tokens": accepted,
        "acceptance_histogram": hist,
        "num_requests": len(stats),
    }


def _trtllm_acceptance(results: Sequence[RequestResult]) -> dict | None:
    """From trtllm-serve's avg_decoded_tokens_per_iter (tokens per iteration): request i took
    tokens_i / avg_i iterations, so tau = sum(tokens) / sum(iterations)."""
    rs = [r for r in results if r.avg_decoded_tokens_per_iter and r.output_tokens]
    if not rs:
        return None
    iterations = sum(r.output_tokens / r.avg_decoded_tokens_per_iter for r in rs)
    return {"source": "response", "field": "avg_decoded_tokens_per_iter",
            "tau": sum(r.output_tokens for r in rs) / iterations, "num_steps": iterations, "num_requests": len(rs)}


def point_stats(cfg: SweepConfig, concurrency: int, results: Sequence[RequestResult]) -> dict:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    timed = [r for r in ok if r.chunk_times]  # an empty answer has no first token to time
    if not ok:
        raise SweepError(f"{cfg.endpoint}: every request at concurrency {concurrency} failed "
                         f"({len(failed)} of {len(results)}); first error: {failed[0].error}")
    # the point lasts until its last request is over, failed ones included (vLLM's benchmark_duration): a request
    # that timed out at the end still held a slot that whole time
    start = min(r.start for r in results)
    duration = max(r.finish if r.finish is not None else r.end for r in results) - start
    out_tokens = sum(r.output_tokens for r in ok)
    tpots = [r.tpot for r in timed if r.tpot is not None]
    in_tokens = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    output_tok_s = out_tokens / duration
    tpot = summary(tpots)
    per_user = [r.output_tokens / r.e2el for r in timed if r.e2el > 0]  # TensorRT-LLM benchmark_serving's tput_user
    return {
        "concurrency": concurrency,
        # where the endpoint sent no usage: "tokenizer", the text tokenized (a count that may differ from the
        # server's by a token where the text tokenizes otherwise); "chunks", content chunks, an undercount where a
        # chunk packs several tokens (speculation, stream intervals)
        "tokens_from": ("usage" if all(r.completion_tokens is not None for r in ok) else
                        "tokenizer" if all(r.completion_tokens is not None or r.counted_tokens is not None
                                           for r in ok) else "chunks"),
        "num_requests": len(results),
        "num_failed": len(failed),
        "empty_answers": len(ok) - len(timed),
        # answers that ended before max_tokens although ignore_eos asked for them whole (null without it): the
        # endpoint stops on tokens other than EOS (trtllm-serve on gpt-oss's harmony stop tokens), so the point's
        # output lengths are not the --osl asked for
        "ended_early": sum(r.finish_reason not in (None, "length") for r in ok) if cfg.ignore_eos else None,
        "errors": list(dict.fromkeys(r.error for r in failed))[:3],
        "duration_s": duration,
        "output_tokens": out_tokens,
        "input_tokens": sum(in_tokens) if in_tokens else None,
        # prompt tokens the server reused rather than prefilled (usage's prompt_tokens_details.cached_tokens; None
        # where no answer reported it)
        "cached_input_tokens": sum(cached) if cached else None,
        "output_tok_s": output_tok_s,
        "request_throughput": len(ok) / duration,
        # 1 / median TPOT, not the mean of per-request 1 / TPOT: that mean is pulled up by the fastest requests
        # (Jensen), so it exceeds what the median user sees and what other tools plot on this axis
        "tok_s_per_user": 1.0 / tpot["p50"] if tpot["p50"] else None,
        "user_throughput_tok_s": float(np.mean(per_user)) if per_user else None,
        "tok_s_per_gpu": output_tok_s / cfg.gpus,
        "ttft_s": summary([r.ttft for r in timed]),
        "tpot_s": tpot,
        "itl_s": summary([g for r in timed for g in r.itls]),
        "e2el_s": summary([r.e2el for r in ok]),
        # each request's own figures, as vLLM's benchmark_serving --save-detailed keeps them: percentiles of any
        # kind, outliers and failures are read from them (the CSV leaves them out)
        "requests": [request_record(r, start) for r in results],
    }


def request_record(r: RequestResult, point_start: float) -> dict:
    timed = r.ok and bool(r.chunk_times)
    record = {"prompt_id": r.prompt_id, "ok": r.ok, "start_s": round(r.start - point_start, 6),
              "ttft_s": r.ttft if timed else None, "tpot_s": r.tpot if timed else None,
              "e2el_s": r.e2el if r.ok else None, "output_tokens": r.output_tokens if r.ok else None,
              "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens, "finish_reason": r.finish_reason}
    return {**record, "error": r.error} if not r.ok else record


# Settings that change which instructions run, recorded with a machine (another CPU emulated: benchmarks/README.md,
# session 20).
_INSTRUCTION_ENV = ("DFLASH_TRT_MARCH", "DFLASH_TRT_AMX", "DFLASH_TRT_PANELS", "DFLASH_TRT_CPU_KERNELS",
                    "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS")


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"hostname": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform()}
    env = {k: os.environ[k] for k in _INSTRUCTION_ENV if k in os.environ}
    return {**info, "environment": env} if env else info


async def run_sweep_async(cfg: SweepConfig, prompts: Sequence[BenchPrompt], dataset: str | None = None,
                          on_point: Callable[[dict], None] | None = None,
                          on_result: Callable[[dict], None] | None = None,
                          count_tokens: Callable[[str], int] | None = None,
                          headers: dict[str, str] | None = None) -> dict:
    """on_point(point) after each point; on_result(result so far) after each point and where a later point fails
    or the run is interrupted, so a caller can keep what was measured ('complete' false until the last point,
    'stopped' naming a failed one); never before a point was measured (a result written earlier stays as it was).
    count_tokens(text) counts the output tokens of answers that came without usage (after each point, untimed).
    headers: sent with every request (an API key), kept out of the result."""
    prompts = list(prompts)
    result = {
        "label": cfg.label,
        "url": cfg.url,
        "model": cfg.model,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": asdict(cfg),
        "machine": machine_info(),  # of the load generator, which is the server's only when run locally
        "dataset": {"name": dataset, "count": len(prompts),
                    "categories": dict(sorted(Counter(p.category for p in prompts).items()))},
        "points": [],
        "complete": False,
    }

    def keep(result: dict) -> None:
        if on_result is not None and result["points"]:
            on_result(result)

    running: dict = {}  # the stage in flight, for an interrupt to name
    try:
        return await _points(cfg, prompts, result, running, on_point, keep, count_tokens, headers or {})
    except (KeyboardInterrupt, asyncio.CancelledError):  # Ctrl-C: asyncio.run cancels the sweep's task
        result.setdefault("stopped", {**running, "error": "interrupted"})
        keep(result)
        raise


async def _points(cfg: SweepConfig, prompts: list[BenchPrompt], result: dict, running: dict,
                  on_point: Callable[[dict], None] | None, keep: Callable[[dict], None],
                  count_tokens: Callable[[str], int] | None, headers: dict[str, str]) -> dict:
    """The warm-up and every point of run_sweep_async, into `result`; `running` names the stage in flight."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max(cfg.concurrencies))
    timeout = httpx.Timeout(cfg.timeout_s)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        stream = PromptStream(prompts, cfg.seed)
        if cfg.num_warmup:
            running.update(warmup=cfg.num_warmup)
            warm = await run_requests(client, cfg, stream.take(cfg.num_warmup)[0], cfg.concurrencies[0],
                                      first_index=-cfg.num_warmup, stage="warm-up")
            if not any(r.ok for r in warm):
                error = f"{cfg.endpoint}: every warm-up request failed; first error: {warm[0].error}"
                result["stopped"] = {"warmup": cfg.num_warmup, "error": error}
                raise SweepError(error)
            running.clear()
            await asyncio.sleep(cfg.metrics_settle_s)
        metrics = await scrape(client, cfg.metrics_url)
        for c in cfg.concurrencies:
            running.clear()
            running.update(concurrency=c)
            before = metrics
            sent, repeats = stream.take(cfg.requests_at(c))
            async with _drained_while_running(client, cfg, before) as drained:
                results = await run_requests(client, cfg, sent, c, stage=f"c={c}")
            # asked after every point, also where a read failed before: one refused or timed-out read costs the
            # points on either side of it their figure, not every later point's
            await asyncio.sleep(cfg.metrics_settle_s)
            after = metrics = await scrape(client, cfg.metrics_url)
            if drained:  # the reads taken while it ran, and the last one where it answered (coverage tells a gap)
                after = sum_drained([*drained, *([after] if after is not None else [])])
            if count_tokens is not None:
                for r in results:
                    if r.ok and r.completion_tokens is None:
                        r.counted_tokens = count_tokens("".join(r.text))
            try:
                point = point_stats(cfg, c, results)
            except SweepError as e:
                result["stopped"] = {"concurrency": c, "error": str(e)}
                keep(result)
                raise
            point["repeated_prompts"] = repeats  # requests a prefix cache may have answered in part
            from_metrics = acceptance_delta(before, after)
            if from_metrics is not None:
                # tokens the figure's steps committed over the tokens the point decoded (its first tokens came from
                # prefill): under 1 where steps ran plain, or where trtllm-serve dropped iterations between reads
                decoded = sum(max(r.output_tokens - 1, 0) for r in results if r.ok)
                committed = from_metrics["tau"] * from_metrics["num_steps"]
                from_metrics["coverage"] = committed / decoded if decoded else None
            point["acceptance"] = response_acceptance([r for r in results if r.ok]) or from_metrics
            point["metrics_acceptance"] = from_metrics  # kept beside the response figure as a cross-check
            result["points"].append(point)
            result["complete"] = len(result["points"]) == len(cfg.concurrencies)
            running.clear()
            if on_point is not None:
                on_point(point)
            keep(result)
    return result


@contextlib.asynccontextmanager
async def _drained_while_running(client: httpx.AsyncClient, cfg: SweepConfig, before: dict[str, float] | None):
    """The scrapes of trtllm-serve's /metrics taken every cfg.metrics_every_s while the block runs (none for other
    endpoints): each read empties its bounded queue. The last read in flight is awaited, never cancelled: the server
    has emptied its queue into that answer."""
    drained: list[dict[str, float]] = []
    if not drains(before):
        yield drained
        return
    stop = asyncio.Event()

    async def reader() -> None:
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), cfg.metrics_every_s)
                return
            got = await scrape(client, cfg.metrics_url)
            if got is not None:
                drained.append(got)

    task = asyncio.create_task(reader())
    try:
        yield drained
    finally:
        stop.set()
        await task


def run_sweep(cfg: SweepConfig, prompts: Sequence[BenchPrompt], dataset: str | None = None,
              on_point: Callable[[dict], None] | None = None,
              on_result: Callable[[dict], None] | None = None,
              count_tokens: Callable[[str], int] | None = None, headers: dict[str, str] | None = None) -> dict:
    """Run every concurrency point; returns the result dict (see write_results)."""
    return asyncio.run(run_sweep_async(cfg, prompts, dataset, on_point, on_result, count_tokens, headers))


_SUMMARY = ("mean", "p50", "p90", "p99")
# Every key any source puts in an acceptance record (response_acceptance, _trtllm_acceptance, acceptance_delta).
_ACCEPTANCE = ("source", "field", "metrics", "tau", "num_steps", "acceptance_rate", "acceptance_per_position",
               "acceptance_histogram", "total_draft_tokens", "total_accepted_draft_tokens", "num_requests",
               "num_iterations", "coverage")
# The CSV's columns, all of them in every file whatever the endpoint reports (an empty cell for null), so CSVs of
# different runs concatenate; a merged run's rounds last.
CSV_COLUMNS: tuple[str, ...] = (
    "concurrency", "tokens_from", "num_requests", "num_failed", "empty_answers", "ended_early", "errors", "duration_s",
    "output_tokens", "input_tokens", "cached_input_tokens", "output_tok_s", "request_throughput", "tok_s_per_user",
    "user_throughput_tok_s",
    "tok_s_per_gpu",
    *(f"{m}_{s}" for m in ("ttft_s", "tpot_s", "itl_s", "e2el_s") for s in _SUMMARY),
    "repeated_prompts",
    *(f"{a}_{k}" for a in ("acceptance", "metrics_acceptance") for k in _ACCEPTANCE),
    "rounds_output_tok_s", "median_round",
)


def flatten(point: dict, prefix: str = "") -> dict:
    """One CSV row: nested dicts joined with '_' (ttft_s_p50), lists as JSON."""
    row: dict = {}
    for key, value in point.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            row.update(flatten(value, name + "_"))
        elif isinstance(value, list):
            row[name] = json.dumps(value)
        elif value is not None:
            row[name] = value
    return row


def csv_path_of(path: str | Path) -> Path:
    """Where write_results puts the CSV of a result written to `path`; ValueError where that is `path` itself."""
    path = Path(path)
    if path.suffix.lower() == ".csv":
        raise ValueError(f"{path}: name the JSON result (RESULT.json); the CSV is written beside it")
    # only .json gives way to .csv: ar.r1 and ar.r2 (or r.json and r.txt) would share one CSV, the last one's
    return path.with_suffix(".csv") if path.suffix.lower() == ".json" else path.with_name(path.name + ".csv")


def write_results(result: dict, path: str | Path) -> tuple[Path, Path]:
    """The result as JSON at `path` and one CSV row per point next to it (csv_path_of: RUN.csv for RUN.json; the
    columns of CSV_COLUMNS, empty where a value is null), each replaced whole: a sweep rewrites them as it starts
    and after every point."""
    path = Path(path)
    csv_path = csv_path_of(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [flatten({k: v for k, v in p.items() if k != "requests"}) for p in result["points"]]
    # a key no sweep writes (a hand-edited point) is kept, after the fixed columns, rather than dropped
    columns = list(dict.fromkeys([*CSV_COLUMNS, *(k for row in rows for k in row)]))
    dir_swap.replace_file(path, lambda tmp: tmp.write_text(json.dumps(result, indent=2) + "\n"), output=True)

    def write_csv(tmp: Path) -> None:
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns, restval="")
            writer.writeheader()
            writer.writerows(rows)

    dir_swap.replace_file(csv_path, write_csv, output=True)
    return path, csv_path
