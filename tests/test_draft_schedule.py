"""The draft-length schedule chooser against brute force over small random tables, and TensorRT-LLM's
threshold rule by its definition."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_trt.draft_schedule import (check_table, choose_draft_len_schedule, compress, expand,
                                     first_idle_batch)


def _rule(schedule: dict[int, int], b: int) -> int:
    # The definition, written out: the smallest key >= b, else no drafting.
    above = [key for key in schedule if key >= b]
    return schedule[min(above)] if above else 0


def test_expand_is_trtllms_documented_example():
    s = {4: 4, 8: 2, 32: 1}
    assert [expand(s, b) for b in (1, 4, 5, 8, 9, 32, 33, 1000)] == [4, 4, 2, 2, 1, 1, 0, 0]
    assert expand({}, 1) == 0


@st.composite
def tables(draw):
    ks = draw(st.lists(st.integers(1, 9), min_size=1, max_size=4, unique=True))
    tau = {k: draw(st.floats(1.0, k + 1.0)) for k in ks}
    max_b = draw(st.integers(1, 12))
    # Step times as an arbitrary positive table: the chooser must not assume any shape.
    times = {(b, k): draw(st.floats(0.5, 20.0)) for b in range(1, max_b + 1) for k in [0, *ks]}
    cap = draw(st.integers(1, 9))
    floor = draw(st.sampled_from([0, 1]))  # 1: TensorRT-LLM's DFlash, which must not draft K=0 once it drafts
    return tau, times, max_b, cap, floor


def _tps(b, k, tau, times):
    return b * (1.0 if k == 0 else tau[k]) / times[(b, k)]


@settings(max_examples=300, deadline=None)
@given(tables())
def test_expanded_schedule_reaches_the_brute_force_optimum_at_every_batch_size(table):
    tau, times, max_b, cap, floor = table
    schedule = choose_draft_len_schedule(tau, lambda b, k: times[(b, k)], range(1, max_b + 1), cap, floor)
    # Brute force, stage 1: the best K at batch 1 among K <= cap.
    allowed = [0] + [k for k in tau if k <= cap]
    # The smallest K within 1% of the best: the model cannot tell nearer ones apart.
    def smallest_near_best(b, pool):
        best = max(_tps(b, k, tau, times) for k in pool)
        return min(k for k in pool if _tps(b, k, tau, times) * 1.01 >= best)

    k1 = smallest_near_best(1, allowed)
    # Stage 2 (TensorRT-LLM: schedule[1] == max_draft_len >= every K): larger batches choose K <= k1, and at least
    # the floor once batch 1 drafts.
    for b in range(1, max_b + 1):
        got = _rule(schedule, b)
        pool = allowed if b == 1 else [k for k in allowed if k <= k1 and (k >= floor or k1 == 0)]
        assert got == smallest_near_best(b, pool)
    if schedule:
        assert 1 in schedule and schedule[1] == k1 == max(schedule.values())
        assert schedule[max(schedule)] != 0  # a trailing 0 is implied, never written
        if floor:
            assert first_idle_batch(schedule, max_b) is None and max(schedule) == max_b
    else:
        assert k1 == 0


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(1, 40), st.integers(0, 6), min_size=1))
def test_compress_round_trips_every_batch_size(per_batch_sparse):
    per_batch = {b: per_batch_sparse.get(b, 0) for b in range(1, 41)}
    schedule = compress(per_batch)
    assert all(_rule(schedule, b) == per_batch[b] for b in range(1, 41))
    assert compress({b: _rule(schedule, b) for b in range(1, 41)}) == schedule
    keys = sorted(schedule)
    assert all(schedule[a] != schedule[b] for a, b in zip(keys[1:], keys[2:]))  # runs merged (key 1 aside)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(1, 40), st.integers(0, 6), min_size=1), st.integers(1, 50))
def test_first_idle_batch_is_the_first_batch_size_the_rule_drafts_nothing_at(schedule, top):
    idle = [b for b in range(1, top + 1) if _rule(schedule, b) == 0]
    assert first_idle_batch(schedule, top) == (idle[0] if idle else None)


def test_speculation_stops_where_drafting_costs_more_than_it_gains():
    # tau(4) = 2.5. A K=4 step costs 1.5x a decode step at b <= 4 (weight-bound), then grows with the
    # 5x tokens it verifies: b * 2.5 / 1.5 beats b / 1 up to b = 4; at b = 8 the step costs 3x -> 2.5/3 < 1.
    def step(b, k):
        return 1.0 if k == 0 else (1.5 if b <= 4 else 3.0)

    schedule = choose_draft_len_schedule({4: 2.5}, step, [1, 2, 4, 8, 16], max_draft_len=4)
    assert schedule == {1: 4, 4: 4}  # 1..4 rows draft 4, above 4 nothing (implied)
    # TensorRT-LLM's DFlash (DRAFTING_STOPS): above the cut the best K of at least 1, up to the largest batch size
    def with_k1(b, k):  # K=1 costs 2x a decode step above 4 rows: it loses to plain decoding too (1.9 / 2 < 1)
        return step(b, k) if k != 1 or b <= 4 else 2.0

    taus = {1: 1.9, 4: 2.5}
    assert choose_draft_len_schedule(taus, with_k1, [1, 2, 4, 8, 16], 4) == {1: 4, 4: 4}
    assert choose_draft_len_schedule(taus, with_k1, [1, 2, 4, 8, 16], 4, min_draft_len=1) == {1: 4, 4: 4, 16: 1}
    assert choose_draft_len_schedule({4: 1.2}, step, [1, 2, 4], max_draft_len=4) == {}  # never pays


def test_a_k_above_max_draft_len_is_never_chosen():
    schedule = choose_draft_len_schedule({3: 2.0, 9: 6.0}, lambda b, k: 1.0 + 0.01 * k, [1, 2, 4], max_draft_len=5)
    assert schedule == {1: 3, 4: 3}


def test_bad_tables_are_refused():
    with pytest.raises(ValueError, match="K >= 1"):
        choose_draft_len_schedule({0: 1.0}, lambda b, k: 1.0, [1], 3)
    with pytest.raises(ValueError, match="batch_sizes"):
        choose_draft_len_schedule({1: 1.5}, lambda b, k: 1.0, [], 3)


@pytest.mark.parametrize("table, limit, words", [
    ({0: 2}, None, "entry 0: 2 needs batch size >= 1"),
    ({1: -1}, None, "entry 1: -1 needs batch size >= 1 and nodes >= 0"),
    ({1: 4}, ("the block", 3), "entry 1: 4 needs batch size >= 1 and nodes in 0..the block=3"),
])
def test_a_table_with_a_bad_entry_is_refused_naming_it(table, limit, words):
    check_table({1: 3, 8: 0}, "draft_tree", "nodes", ("the block", 3))  # zeros and the limit itself are fine
    with pytest.raises(ValueError, match=f"draft_tree {words}"):
        check_table(table, "draft_tree", "nodes", limit=limit)


def test_every_config_that_takes_such_a_table_refuses_a_bad_one():
    from dflash_trt.config import SpeculativeConfig
    from dflash_trt.engine.llm_engine import EngineConfig
    from dflash_trt.engine.scheduler import SchedulerConfig

    with pytest.raises(ValueError, match="draft_tree entry 0"):
        SpeculativeConfig(speculative_model="d", draft_tree={0: 3})
    with pytest.raises(ValueError, match="draft_tree_without_amx entry 2: -1"):
        SpeculativeConfig(speculative_model="d", draft_tree_without_amx={2: -1})
    with pytest.raises(ValueError, match="draft_len_schedule entry 2: -1"):
        SpeculativeConfig(speculative_model="d", draft_len_schedule={1: 3, 2: -1})
    with pytest.raises(ValueError, match="draft_len_schedule_without_amx entry 2: -1"):
        SpeculativeConfig(speculative_model="d", draft_len_schedule_without_amx={1: 3, 2: -1})
    with pytest.raises(ValueError, match="draft_len_schedule_without_amx entry 0: 2"):
        EngineConfig(draft_len_schedule_without_amx={0: 2})
    with pytest.raises(ValueError, match="draft_tree entry 1: -2"):
        EngineConfig(draft_tree={1: -2})
    with pytest.raises(ValueError, match="draft_len_schedule entry 1: 5 .* in 0..max_draft_len=3"):
        SchedulerConfig(max_num_seqs=2, max_model_len=64, max_draft_len=3, draft_len_schedule={1: 5})
