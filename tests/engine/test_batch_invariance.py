"""A prompt's K/V, and so its greedy answer, do not depend on the requests that arrive with it: on the real SmolLM2
in bf16, where chunks past 256 tokens run SDPA's attention and oneDNN's linears, whose sums depend on the shapes (a
prompt batched with another one's last chunk, or cut where that chunk left room, came out up to 0.6 off in its keys).
The oracle is the same engine serving the prompt alone."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine
from dflash_trt.sampling_params import SamplingParams
from tests.forward_widths import record_forward_widths


# 512: the budget's grid, as on a GPU; None: this CPU's default (256 tokens, a call of the layer kernel, with AMX
# tiles; 32 without), where a prompt's chunks share steps
@pytest.fixture(scope="module", params=[512, None], ids=["grid 512", "default grid"])
def engine(smollm2_dir, request):
    return LLMEngine.from_dirs(smollm2_dir, None, EngineConfig(max_batch_size=2, speculative=False, dtype="bfloat16",
                                                               max_model_len=2048, prefill_chunk=request.param))


def chunks(start: int, end: int, grid: int) -> int:
    """Forwards that prefill prompt positions [start, end) on the grid (start on it)."""
    return -(-end // grid) - start // grid


def served(engine: LLMEngine, prompts: list[list[int]], cold: bool = True, later: bool = False,
           widths: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """The last prompt's K/V once prefilled, and its greedy answer, with the others sent just before it (cold: into a
    cleared cache, where no K/V a row kept from an earlier request can stand in for its own; later: once the others
    are prefilled, and the widths of the forwards from then on recorded in `widths`)."""
    if cold:
        engine.runner.target_cache.k.zero_()
        engine.runner.target_cache.v.zero_()
        engine.scheduler.forget_resident()
    seqs = [engine.make_sequence(p, SamplingParams(max_new_tokens=8, ignore_eos=True)) for p in prompts]
    for s in seqs[:-1]:
        engine.scheduler.add(s)
    while later and not all(s.is_prefilled for s in seqs[:-1]):
        engine.step()
    if widths is not None:
        widths.clear()
    engine.scheduler.add(seqs[-1])
    mine, kv = seqs[-1], None
    while engine.has_unfinished():
        engine.step()
        if kv is None and mine.num_prefilled == len(mine.prompt_ids):
            cache, n = engine.runner.target_cache, len(mine.prompt_ids)
            kv = torch.stack([cache.k[:, mine.slot, :, :n], cache.v[:, mine.slot, :, :n]]).clone()
    return kv, mine.output_ids


def test_a_prompt_prefilled_beside_another_long_one_gets_the_same_kv_and_answer(engine):
    other = engine.encode(" ".join(f"Item {i}: the value is {i * 7 % 13}." for i in range(60)) + " Summary:")
    mine = engine.encode(" ".join(f"Entry {i} has weight {i * 5 % 11}." for i in range(70)) + " Total:")
    assert len(other) > 512 and len(mine) > 512  # two chunks each at the default max_prefill_tokens
    kv_alone, answer_alone = served(engine, [mine])
    kv_beside, answer_beside = served(engine, [other, mine])
    assert torch.equal(kv_beside, kv_alone) and answer_beside == answer_alone


@pytest.mark.parametrize("first", ["the same prompt", "its first chunk"])
def test_a_prompt_whose_chunk_is_copied_from_another_gets_the_same_kv_and_answer(engine, first, monkeypatch):
    """Sent with its own copy (a request's n choices) or with a prompt of its first 512 tokens, a prompt takes the
    chunk's K/V from the other's forward: bit for bit what it computes alone."""
    mine = engine.encode(" ".join(f"Entry {i} has weight {i * 5 % 11}." for i in range(70)) + " Total:")
    kv_alone, answer_alone = served(engine, [mine])
    widths = record_forward_widths(engine.target, monkeypatch)
    kv_copied, answer_copied = served(engine, [mine if first == "the same prompt" else mine[:512], mine])
    # prefill chunks (not plain decode steps): [0, 512) once for both prompts, then the rest of mine (or of both)
    assert sum(w > 1 for w in widths) == chunks(0, len(mine), engine.scheduler.config.grid)
    assert torch.equal(kv_copied, kv_alone) and answer_copied == answer_alone


def test_a_prompt_that_takes_over_a_freed_rows_chunks_gets_the_same_kv_and_answer(engine, monkeypatch):
    """The next turn of a chat starts with the last turn's prompt: its whole chunks are taken over from the row that
    prompt left, bit for bit what it computes alone."""
    turn = engine.encode(" ".join(f"Entry {i} has weight {i * 5 % 11}." for i in range(70)) + " Total:")
    _, answer = served(engine, [turn])
    following = turn + answer + engine.encode(" And the heaviest entry?")
    kv_alone, answer_alone = served(engine, [following])
    served(engine, [turn])
    widths = record_forward_widths(engine.target, monkeypatch)
    kv_taken, answer_taken = served(engine, [following], cold=False)
    grid = engine.scheduler.config.grid
    # prefill chunks (not plain decode steps): those past the turn's whole ones alone
    assert sum(w > 1 for w in widths) == chunks(len(turn) // grid * grid, len(following), grid)
    assert torch.equal(kv_taken, kv_alone) and answer_taken == answer_alone


def test_a_prompt_that_copies_a_running_requests_chunk_gets_the_same_kv_and_answer(engine, monkeypatch):
    """Two users' prompts start with one system prompt of more than 512 tokens: the one that arrives while the other
    runs copies the system prompt's whole chunks from that request's row, bit for bit what it computes alone."""
    system = engine.encode(" ".join(f"Rule {i}: answer item {i} in {i % 4 + 1} words." for i in range(50)))
    assert len(system) > 512
    mine, other = (system + engine.encode(question) for question in (" Which rule covers item 7?", " Summarize."))
    kv_alone, answer_alone = served(engine, [mine])
    widths = record_forward_widths(engine.target, monkeypatch)
    kv_copied, answer_copied = served(engine, [other, mine], later=True, widths=widths)
    grid = engine.scheduler.config.grid
    # prefill chunks (not plain decode steps): those past the system prompt's whole ones alone
    assert sum(w > 1 for w in widths) == chunks(len(system) // grid * grid, len(mine), grid)
    assert torch.equal(kv_copied, kv_alone) and answer_copied == answer_alone
