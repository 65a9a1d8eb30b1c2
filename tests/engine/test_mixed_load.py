"""Mixed load: requests of every kind (greedy, seeded samples under the "match" rule, penalized, with logprobs, stop
strings, requests that reach the context's end) arriving between steps, some aborted, in one speculative engine
with draft trees, chains, context lookups and a draft-length schedule. Each answer is the one plain decoding gives
the request alone (fp32: tokens, finish reason, text, logprobs), an aborted answer a prefix of it. Drafts are forced
towards the true continuation (tests/forced_drafts.py), so long accepted runs and paths off the top chain happen.
Found nothing when a helper fuzzed ~1,800 such cases (session 44); these seeds keep the combinations under test."""

from __future__ import annotations

import random

import pytest

from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine
from dflash_trt.sampling_params import SamplingParams
from tests.conftest import VOCAB
from tests.forced_drafts import force_tree_drafts


def _config(r: random.Random) -> dict:
    rows, k = r.randint(2, 5), r.randint(3, 15)
    return dict(max_batch_size=rows, max_model_len=r.choice([48, 96, 160]), max_draft_len=k,
                max_prefill_tokens=r.choice([7, 16, 64]), dtype="float32",
                draft_tree={1: r.randint(2, 12), rows: r.randint(2, 6)} if r.random() < 0.7 else {},
                draft_len_schedule={1: k, rows: r.randint(1, 3)} if r.random() < 0.5 else {},
                lookup_nodes=r.choice([0, 3, min(k, 7)]))


def _request(r: random.Random, max_model_len: int) -> dict:
    n = r.randint(1, max_model_len - 2)
    if r.random() < 0.5:  # repeats itself, so context lookups have something to offer
        motif = [r.randrange(3, VOCAB - 1) for _ in range(r.randint(1, 5))]
        prompt = (motif * n)[:n]
    else:
        prompt = [r.randrange(3, VOCAB) for _ in range(n)]
    params = dict(max_new_tokens=r.randint(1, 40), ignore_eos=r.random() < 0.5)
    kind = r.choice(["greedy", "greedy", "match", "penalized"])
    if kind == "match":
        params.update(temperature=r.choice([0.5, 1.0]), seed=r.randrange(2**31), top_k=r.choice([0, 5]))
    if kind == "penalized":
        params.update(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3)
    if r.random() < 0.4:
        params["logprobs"] = r.randint(0, 3)
    if r.random() < 0.2:
        params["stop"] = [chr(32 + r.randrange(VOCAB - 3))]  # a one-character stop string (the tiny tokenizer's)
    return dict(prompt=prompt, params=params, arrival=r.choice([0, 0, r.randint(1, 20)]),
                abort_at=r.randint(1, 30) if r.random() < 0.15 else None)


class _TruthOfRunning(dict):
    """truth_by_slot for the forced drafts: a cache row's truth is its current request's (rows are reused)."""

    def __init__(self, engine: LLMEngine, truth_of: dict[int, list[int]]) -> None:
        super().__init__()
        self.engine, self.truth_of = engine, truth_of

    def __getitem__(self, row: int) -> list[int]:
        seq = next(s for s in self.engine.scheduler.running if s.slot == row)
        return self.truth_of[seq.request_id]


@pytest.mark.parametrize("seed", range(8))
def test_each_answer_under_mixed_load_is_the_one_plain_decoding_gives_it_alone(tiny_dirs, seed):
    r = random.Random(seed)
    arch = r.choice(["qwen3", "llama"])
    cfg = _config(r)
    requests = [_request(r, cfg["max_model_len"]) for _ in range(r.randint(4, 10))]
    alone = LLMEngine.from_dirs(tiny_dirs[arch], None, EngineConfig(
        speculative=False, max_batch_size=1, max_model_len=cfg["max_model_len"],
        max_prefill_tokens=cfg["max_prefill_tokens"], dtype="float32"))
    want = [alone.generate([q["prompt"]], SamplingParams(**q["params"]))[0] for q in requests]

    engine = LLMEngine.from_dirs(tiny_dirs[arch], tiny_dirs[f"{arch}_drafter"], EngineConfig(**cfg))
    truth_of: dict[int, list[int]] = {}
    force_tree_drafts(engine, _TruthOfRunning(engine, truth_of), seed=seed)
    seqs, step, aborted = [None] * len(requests), 0, set()
    while None in seqs or engine.has_unfinished():
        for i, q in enumerate(requests):
            if seqs[i] is None and q["arrival"] <= step:
                seqs[i] = engine.add_request(q["prompt"], SamplingParams(**q["params"]))
                truth_of[seqs[i].request_id] = q["prompt"] + want[i].token_ids
            if seqs[i] is not None and q["abort_at"] == step and engine.abort(seqs[i].request_id):
                aborted.add(i)
        engine.step()
        step += 1
    drafted = 0
    for i, (q, s, w) in enumerate(zip(requests, seqs, want)):
        got = engine.make_output(s)
        drafted += sum(got.acceptance_lengths)
        if i in aborted and got.finish_reason == "abort":
            assert got.token_ids == w.token_ids[: len(got.token_ids)], i
            continue
        assert (got.token_ids, got.finish_reason, got.text) == (w.token_ids, w.finish_reason, w.text), i
        for a, b in zip(got.logprobs or [], w.logprobs or [], strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4, i
            assert [t for t, _ in a.top] == [t for t, _ in b.top], i
    assert drafted > 0  # speculative steps ran
