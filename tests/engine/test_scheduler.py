"""Continuous batching: the scheduler's bookkeeping (hand-computed expectations; tensors only stand in for a
request's target features) and the engine on top of it (chunked prefill and requests joining mid-flight stay
lossless)."""

import pytest
import torch

from dflash_trt.engine.scheduler import QueueFullError, Scheduler, SchedulerConfig
from dflash_trt.engine.sequence import Sequence
from dflash_trt.engine.slot_allocator import SlotAllocator
from dflash_trt.sampling_params import SamplingParams


def _seq(prompt_len: int, new: int = 4) -> Sequence:
    return Sequence(list(range(3, 3 + prompt_len)), SamplingParams(max_new_tokens=new, ignore_eos=True))


def _run(sched: Scheduler, batch, token: int = 50, max_model_len: int = 2048) -> None:
    """What the engine does with a batch, without a model: advance prefills, commit one token per row."""
    for c in batch.prefills:
        c.seq.num_prefilled = c.end
        if c.end == len(c.seq.prompt_ids):  # the last chunk samples the first token
            c.seq.append([token], max_model_len)
    for s in batch.decodes:
        s.append([token] * (batch.num_draft + 1), max_model_len)
    for s in [c.seq for c in batch.prefills] + batch.decodes:
        if s.is_finished:
            sched.finish(s)


def _interleaved(prefill_chunk: int) -> list:
    """A (prompt 5) and B (prompt 20, other tokens: none of its chunks is a copy of A's) under an 8-token budget:
    each of 4 steps' prefill chunks (A's?, start, end) and decodes (A's?), then the fifth step's decodes."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_model_len=64, max_prefill_tokens=8,
                                      prefill_chunk=prefill_chunk))
    a, b = _seq(5, new=10), Sequence(list(range(100, 120)), SamplingParams(max_new_tokens=10, ignore_eos=True))
    sched.add(a)
    sched.add(b)
    spans = []
    for _ in range(4):
        batch = sched.schedule()
        spans.append(([(c.seq is a, c.start, c.end) for c in batch.prefills], [s is a for s in batch.decodes]))
        _run(sched, batch)
    return spans + [[s is a for s in sched.schedule().decodes]]


def test_worked_example_of_the_docstring_chunks_and_interleaves():
    assert _interleaved(prefill_chunk=4) == [
        ([(True, 0, 4), (True, 4, 5)], []),  # B's first chunk (4) does not fit the 3 tokens left: it waits, queued
        ([(False, 0, 4), (False, 4, 8)], [True]),
        ([(False, 8, 12), (False, 12, 16)], [True]),
        ([(False, 16, 20)], [True]),  # B's last chunk samples its first token
        [True, False],  # A and B decode together
    ]


def test_without_a_prefill_chunk_the_grid_is_the_budget_one_chunk_a_step():
    assert _interleaved(prefill_chunk=0) == [
        ([(True, 0, 5)], []),  # B's first chunk (8) does not fit the 3 tokens left: it waits, in the queue
        ([(False, 0, 8)], [True]),
        ([(False, 8, 16)], [True]),
        ([(False, 16, 20)], [True]),
        [True, False],
    ]


def test_a_prompts_chunks_lie_on_its_own_grid_whatever_arrives_with_it():
    # Cut where a neighbour left room, a chunk would be computed another way (SDPA's and oneDNN's bf16 sums depend on
    # the shapes) and the prompt's K/V would depend on the requests around it.
    def chunks_of(target_len, others, arrive_at):
        sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_model_len=64, max_prefill_tokens=8))
        target, spans = _seq(target_len, new=2), []
        for step in range(12):
            if step == arrive_at:
                sched.add(target)
            if step == 0:
                for n in others:  # other tokens than the target's: it takes none of their chunks
                    sched.add(Sequence(list(range(200, 200 + n)), SamplingParams(max_new_tokens=6)))
            batch = sched.schedule()
            spans += [(c.start, c.end) for c in batch.prefills if c.seq is target]
            _run(sched, batch)
        return spans

    alone = chunks_of(21, [], 0)
    assert alone == [(0, 8), (8, 16), (16, 21)]
    for others, arrive_at in [([5], 0), ([13], 0), ([3, 19], 0), ([19], 1), ([6, 6], 1)]:
        assert chunks_of(21, others, arrive_at) == alone, (others, arrive_at)


def test_a_long_prompt_at_the_head_of_the_queue_is_not_passed_by_shorter_ones():
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_model_len=64, max_prefill_tokens=8))
    first, long, short = _seq(5), _seq(16), _seq(2)
    for s in (first, long, short):
        sched.add(s)
    batch = sched.schedule()
    assert [c.seq for c in batch.prefills] == [first] and sched.num_waiting == 2  # 3 left: the long one's 8 wait
    _run(sched, batch)
    assert [c.seq for c in sched.schedule().prefills] == [long]


def test_a_chunk_another_request_computes_in_the_same_step_is_copied_and_costs_no_budget():
    """Requests whose prompts hold the same tokens up to a chunk's end, at the same span, run it once: the others
    take a copy (a request's n choices, a batch of one prompt, a prompt and a longer one's first chunk)."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=5, max_model_len=64, max_prefill_tokens=8))
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    a, twin, longer, other = _seq(8), _seq(8), _seq(20), Sequence(list(range(40, 48)), params)
    for s in (a, twin, longer, other):
        sched.add(s)

    def step():
        batch = sched.schedule()
        _run(sched, batch)
        return [(c.seq, c.start, c.end, c.source) for c in batch.prefills]

    # a's 8 tokens take the budget; twin and longer's first chunk copy them; other's 8 tokens of its own wait
    assert step() == [(a, 0, 8, None), (twin, 0, 8, a), (longer, 0, 8, a)]
    late = _seq(8)  # a's tokens, a step later: a computes nothing now, so late computes its own
    sched.add(late)
    assert step() == [(longer, 8, 16, None)]
    assert step() == [(longer, 16, 20, None)]  # other's 8 do not fit the 4 left
    assert step() == [(other, 0, 8, None)]
    assert step() == [(late, 0, 8, None)]


def test_on_a_grid_finer_than_the_budget_copies_share_each_chunk_and_rows_give_whole_chunks():
    """4-token chunks, 8 tokens a step: a prompt's chunks share steps, a twin copies each of them, and the next turn
    takes over the freed row's whole 4-token chunks (its 10-token prompt: 8)."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_model_len=64, max_prefill_tokens=8, prefill_chunk=4))
    a, twin = _seq(10, new=2), _seq(10, new=2)
    sched.add(a, twin)

    def step():
        batch = sched.schedule()
        _run(sched, batch)
        return [(c.seq, c.start, c.end, c.source) for c in batch.prefills]

    assert step() == [(a, 0, 4, None), (a, 4, 8, None), (twin, 0, 4, a), (twin, 4, 8, a)]
    assert step() == [(a, 8, 10, None), (twin, 8, 10, a)]
    _finish(sched, a, twin)
    turn = _seq(23, new=1)  # a's prompt, its answer's positions, and more
    sched.add(turn)
    assert step() == [(turn, 8, 12, None), (turn, 12, 16, None)] and turn.num_reused == 8
    assert step() == [(turn, 16, 20, None), (turn, 20, 23, None)]


def test_a_request_copies_its_chunks_in_order_and_none_after_one_it_computes():
    """A copy lands when its source's forward runs, and with it the request's progress and, on its last chunk, its
    first token: b, a chunk behind its twin a, computes [0, 4) itself and so may not copy a's [4, 8), which a computes
    earlier in the step (b would sample before its own first chunk ran)."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_model_len=64, max_prefill_tokens=12, prefill_chunk=4,
                                      reuse_rows=False))
    other, a, b = Sequence(list(range(100, 108)), SamplingParams(max_new_tokens=4)), _seq(8), _seq(8)
    sched.add(other, a)

    def step():
        batch = sched.schedule()
        _run(sched, batch)
        return [(c.seq, c.start, c.end, c.source) for c in batch.prefills]

    assert step() == [(other, 0, 4, None), (other, 4, 8, None), (a, 0, 4, None)]
    sched.add(b)
    assert step() == [(a, 4, 8, None), (b, 0, 4, None), (b, 4, 8, None)]


def test_a_prefill_chunk_past_the_budget_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"prefill_chunk must be in 0\.\.max_prefill_tokens \(8\), got 16"):
        SchedulerConfig(max_num_seqs=1, max_model_len=64, max_prefill_tokens=8, prefill_chunk=16)


def _finish(sched: Scheduler, *seqs: Sequence) -> None:
    while not all(s.is_finished for s in seqs):
        _run(sched, sched.schedule())


def test_a_freed_row_gives_its_prompts_whole_chunks_to_a_request_that_starts_with_them():
    """The next turn of a chat, or a long prompt again: a freed row holds its last prompt's K/V, and a request whose
    prompt starts with that prompt's whole chunks (8 tokens each here) takes the row and starts past them."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_model_len=128, max_prefill_tokens=8))
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    other, a = Sequence(list(range(50, 70)), SamplingParams(max_new_tokens=50)), _seq(20, new=1)
    sched.add(other, a)  # a: chunks [0, 8), [8, 16), [16, 20)
    _finish(sched, a)
    sched.abort(other.request_id)
    sched.schedule()
    assert (other.slot, a.slot) == (0, 1)

    def first_chunk(seq):
        sched.add(seq)
        batch = sched.schedule()
        _run(sched, batch)
        _finish(sched, seq)
        (chunk,) = [c for c in batch.prefills if c.seq is seq]
        return seq.slot, chunk.start, chunk.end, seq.num_reused

    # a's two whole chunks; its last one, 4 tokens, was another span than the longer prompt's [16, 24)
    assert first_chunk(_seq(30, new=1)) == (1, 16, 24, 16)
    # the prompt's own last chunk is always computed (it samples the first token): of 16 tokens, 8 are reused
    assert first_chunk(_seq(16, new=1)) == (1, 8, 16, 8)
    # a request that asks for its prompt's logprobs needs every position: from the start, in the row freed longest
    # ago (other's)
    logprobs = Sequence(list(range(3, 33)), SamplingParams(max_new_tokens=1, prompt_logprobs=1, ignore_eos=True))
    assert first_chunk(logprobs) == (0, 0, 8, 0)
    # other tokens: nothing to take over, and now row 1 was freed longest ago
    assert first_chunk(Sequence(list(range(90, 120)), params)) == (1, 0, 8, 0)


@pytest.mark.parametrize("held, reused", [({8, 16, 24}, 24), ({8, 24}, 24), ({8}, 8), ({16}, 16), (set(), 0)])
def test_a_row_gives_its_prompts_chunks_only_as_far_as_it_holds_what_comes_with_them(held, reused):
    """holds_prefix (a hybrid target's recurrent state after a chunk's end): a freed row holding a 30-token prompt's
    K/V gives a request starting with it its chunks up to the last end whose state it still holds (of 8, 16, 24)."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_model_len=128, max_prefill_tokens=8,
                                      holds_prefix=lambda row, end: row == 1 and end in held))
    other, a = Sequence(list(range(50, 70)), SamplingParams(max_new_tokens=50)), _seq(30, new=1)
    sched.add(other, a)
    _finish(sched, a)
    sched.abort(other.request_id)
    sched.schedule()
    seq = _seq(32, new=1)
    sched.add(seq)
    _run(sched, sched.schedule())
    assert seq.num_reused == reused and (seq.slot == 1 or not reused)


def test_a_request_that_takes_nothing_over_leaves_the_rows_that_hold_prompts_alone():
    """Between a chat's two turns another request comes: it takes a row that holds nothing (the lowest free row would
    have been the one the chat's next turn takes over)."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_model_len=128, max_prefill_tokens=8))
    turn, unrelated = _seq(20, new=1), Sequence(list(range(90, 110)), SamplingParams(max_new_tokens=1))
    for seq in (turn, unrelated):
        sched.add(seq)
        _finish(sched, seq)
    following = _seq(30, new=1)
    sched.add(following)
    _finish(sched, following)
    assert (turn.slot, unrelated.slot, following.slot, following.num_reused) == (0, 1, 0, 16)


def test_a_requests_answers_all_take_over_the_row_their_prompt_left():
    """n answers to a chat's next turn: the first takes the row over, the others a copy of its prompt tokens (and so
    they share their next chunk too)."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_model_len=128, max_prefill_tokens=8))
    turn = _seq(20, new=1)
    sched.add(turn)
    _finish(sched, turn)
    answers = [_seq(24, new=1) for _ in range(3)]
    sched.add(*answers)
    batch = sched.schedule()
    first, *others = answers
    assert [(c.seq, c.start, c.end, c.source, c.takes) for c in batch.prefills] == [
        (first, 16, 24, None, None), *((s, 16, 24, first, (first.slot, 16)) for s in others)]
    assert first.slot == turn.slot and [s.num_reused for s in answers] == [16] * 3


def test_a_running_requests_row_gives_a_copy_of_the_prompt_chunks_it_has_computed():
    """Many users' requests start with one long system prompt: a request whose prompt starts with a running
    request's whole chunks copies them from that row before the step's forwards, and starts past them. Only the
    chunks that request has prefilled count, and no more than its drafter holds."""
    system = list(range(3, 23))  # 20 tokens: whole chunks [0, 8) and [8, 16)

    def request(*tail: int) -> Sequence:
        return Sequence(system + list(tail), SamplingParams(max_new_tokens=20, ignore_eos=True))

    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_model_len=128, max_prefill_tokens=8))
    first, second, third = request(70, 71), request(80), request(*range(90, 100))
    sched.add(first)
    _run(sched, sched.schedule())  # first: [0, 8)
    sched.add(second)
    batch = sched.schedule()
    # second copies first's [0, 8), and its [8, 16) from first's forward of this step
    assert [(c.seq, c.start, c.end, c.source, c.takes) for c in batch.prefills] == [
        (first, 8, 16, None, None), (second, 8, 16, first, (first.slot, 8))]
    while not second.is_prefilled:
        _run(sched, sched.schedule())
    sched.add(third)  # 30 tokens: both whole chunks are the system prompt's; [16, 24) holds its own tokens
    assert [(c.seq, c.start, c.end, c.takes) for c in sched.schedule().prefills] == [(third, 16, 24, (first.slot, 16))]
    assert (second.num_reused, third.num_reused) == (8, 16) and len({first.slot, second.slot, third.slot}) == 3

    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_model_len=128, max_draft_len=3, max_prefill_tokens=8))
    first, second, third = request(70), request(80), request(90)
    sched.add(first)
    while not first.is_prefilled:
        _run(sched, sched.schedule())
    sched.add(second)  # first has not drafted yet: its drafter holds none of its context
    _run(sched, batch := sched.schedule())
    assert [(c.seq, c.start, c.takes) for c in batch.prefills] == [(second, 0, None)]
    first.drafter_context = 12  # as a drafter pass up to position 12 leaves it (model_runner._context_written)
    sched.add(third)  # and second computes its [8, 16) in this step: third takes a copy of that too
    assert [(c.seq, c.start, c.source, c.takes) for c in sched.schedule().prefills] == [
        (second, 8, None, None), (third, 8, second, (first.slot, 8))]


def test_a_row_gives_no_more_than_its_drafter_context_nor_anything_after_a_failed_step():
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_model_len=128, max_draft_len=3, max_prefill_tokens=8))

    def serve(drafted_to=None):
        """A 30-token prompt; once prefilled, its drafter context reaches `drafted_to` (as a drafter pass up to that
        position leaves it: model_runner._context_written) -> the tokens it took over."""
        seq = _seq(30, new=2)
        sched.add(seq)
        while not seq.is_prefilled:
            _run(sched, sched.schedule())
        if drafted_to is not None:
            seq.drafter_context = drafted_to
        _finish(sched, seq)
        return seq.num_reused

    assert serve() == 0
    assert serve(drafted_to=12) == 0  # the first never drafted: the drafter holds none of its context
    assert serve(drafted_to=30) == 8  # the second's drafter context reached 12
    assert serve() == 24
    seq = _seq(30, new=2)
    sched.add(seq)
    _run(sched, sched.schedule())
    sched.fail_running()  # its step failed: the row may be half written
    assert serve() == 0


def test_without_row_reuse_every_request_prefills_its_own_prompt_bar_a_chunk_computed_in_its_step():
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_model_len=128, max_prefill_tokens=8, reuse_rows=False))
    first, twin = _seq(20, new=30), _seq(20, new=1)
    sched.add(first, twin)
    assert [(c.seq, c.start, c.source) for c in sched.schedule().prefills] == [(first, 0, None), (twin, 0, first)]
    _finish(sched, twin)  # its row holds [0, 16) of the prompt first still runs with
    again = _seq(20, new=1)
    sched.add(again)
    assert [(c.seq, c.start, c.takes) for c in sched.schedule().prefills] == [(again, 0, None)]
    assert again.num_reused == 0 and not sched._resident


def test_a_row_whose_drafter_lags_gives_the_pending_features_of_the_positions_taken_over():
    """Mid-prefill, or under a load that drafts nothing (the schedule's K=0 above some batch size), a row's drafter
    context lags its K/V: the target features of the positions after it wait for the drafter's next pass. A request
    that takes the row's chunks over (its row freed, or copied while it runs) gets the drafter context where the
    row's ends, and the pending features of the positions it takes."""
    def prefilled(sched: Scheduler) -> Sequence:
        seq = _seq(30, new=3)
        sched.add(seq)
        while not seq.is_prefilled:
            _run(sched, sched.schedule())
        # each feature holds its position; the drafter took in [0, 4) before the prefill's last chunks, and two plain
        # steps followed
        seq.drafter_context = 4
        seq.pending_features = [torch.arange(4, 20)[:, None], torch.arange(20, 30)[:, None],
                                torch.tensor([[30]]), torch.tensor([[31]])]
        return seq

    for running in (True, False):
        sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_model_len=128, max_draft_len=3, max_prefill_tokens=8))
        holder = prefilled(sched)
        if not running:
            _finish(sched, holder)
            # the freed row keeps the features of its prompt positions only
            assert torch.cat(sched._resident[holder.slot].features)[:, 0].tolist() == list(range(4, 30))
        seq = _seq(30, new=2)
        sched.add(seq)
        (chunk,) = sched.schedule().prefills
        assert (chunk.start, seq.num_reused, seq.drafter_context) == (24, 24, 4)
        assert chunk.takes == ((holder.slot, 24) if running else None) and (seq.slot == holder.slot) != running
        assert torch.cat(seq.pending_features)[:, 0].tolist() == list(range(4, 24))


def test_queue_is_bounded_beyond_the_free_rows():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_model_len=64, max_queue_len=3))
    for _ in range(5):  # 2 free rows + 3 queue places
        sched.add(_seq(4))
    # the message counts the requests admitted for free rows apart (it read "5 requests are waiting
    # (max_queue_len=3)")
    with pytest.raises(QueueFullError, match=r"5 requests are waiting, for 2 free rows and 3 queue places "
                                             r"\(max_queue_len\); retry later"):
        sched.add(_seq(4))
    _run(sched, sched.schedule())  # 2 start running: the queue now holds 3 of 3 places
    late = _seq(4)
    assert sched.num_waiting == 3 and not sched.try_add(late) and late not in sched.waiting


def test_requests_leave_and_their_rows_are_reused_lowest_first():
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_model_len=64))
    seqs = [_seq(4, new=n) for n in (1, 3, 3)]
    for s in seqs:
        sched.add(s)
    _run(sched, sched.schedule())  # the first finishes with its prefill token (max_new_tokens=1)
    assert [s.slot for s in seqs] == [0, 1, 2] and seqs[0].is_finished
    late = _seq(4)
    sched.add(late)
    batch = sched.schedule()
    assert [c.seq for c in batch.prefills] == [late] and late.slot == 0
    assert batch.decodes == seqs[1:]


def test_abort_frees_waiting_at_once_and_running_at_the_next_step():
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_model_len=64))
    running, waiting = _seq(4, new=50), _seq(4)
    sched.add(running)
    sched.add(waiting)
    _run(sched, sched.schedule())
    assert sched.abort(waiting.request_id) and sched.num_waiting == 0 and waiting.finish_reason == "abort"
    assert sched.abort(running.request_id)
    assert not sched.abort(running.request_id)  # once: a second abort of a waiting one was False, a running one's True
    assert sched.slots.num_used == 1  # still in the step that may be running now
    batch = sched.schedule()
    assert batch.aborted == [waiting, running] and not batch.decodes and not batch.prefills
    assert running.finish_reason == "abort" and sched.slots.num_used == 0 and not sched.has_work()
    assert not sched.abort(running.request_id)  # already gone


def test_an_abort_for_later_takes_no_lock_and_lands_at_the_next_schedule():
    """What a stream's clean-up calls, maybe from the garbage collector inside the scheduler's own locked code."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_model_len=64))
    running, waiting = _seq(4, new=50), _seq(4)
    sched.add(running, waiting)
    _run(sched, sched.schedule())
    with sched._lock:  # held, as schedule() holds it
        sched.abort_later(running.request_id)
        sched.abort_later(waiting.request_id)
        sched.abort_later(12345)  # unknown: nothing
    assert sched.num_waiting == 1 and sched.num_running == 1  # not yet
    batch = sched.schedule()
    assert batch.aborted == [waiting, running] and not batch.decodes and not batch.prefills
    assert running.finish_reason == waiting.finish_reason == "abort" and not sched.has_work()


def test_requests_a_failing_schedule_took_out_are_handed_out_by_the_next(monkeypatch):
    """Aborted (or finished by a failed step) requests leave with the next schedule(): one that raised after taking
    them lost them, and their callers waited for ever."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_model_len=64))
    running = _seq(4, new=50)
    sched.add(running)
    _run(sched, sched.schedule())
    assert sched.abort(running.request_id)
    monkeypatch.setattr(sched, "_draft_len", lambda decodes: 1 / 0)  # a bug of its own
    with pytest.raises(ZeroDivisionError):
        sched.schedule()
    monkeypatch.undo()
    assert sched.has_work() and sched.schedule().aborted == [running] and not sched.has_work()


def test_a_request_admitted_by_a_failing_schedule_is_failed_with_the_running_ones():
    """A schedule() that raises (a bug of its own) after giving a waiting request a row: the failed step's
    fail_running() answers it and frees the row (it had left the queue without joining the running requests: its
    row was held for ever and its caller waited)."""
    class BrokenResident(dict):
        def pop(self, *args):
            raise ZeroDivisionError

    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_model_len=64))
    seq = _seq(4)
    sched.add(seq)
    sched._resident = BrokenResident()
    with pytest.raises(ZeroDivisionError):
        sched.schedule()
    assert sched.fail_running() == [seq] and seq.finish_reason == "error"
    assert sched.slots.num_free == 2 and not sched.has_work()


def test_a_request_whose_row_failed_to_be_given_stays_queued(monkeypatch):
    """Taken off the queue before its row was allocated, a request whose allocation raised was in neither queue."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_model_len=64))
    seq = _seq(4)
    sched.add(seq)
    monkeypatch.setattr(sched.slots, "allocate", lambda slot: [].remove(slot))  # a row named that is not free
    with pytest.raises(ValueError):
        sched.schedule()
    monkeypatch.undo()
    assert list(sched.waiting) == [seq] and sched.fail_running() == []
    assert [c.seq for c in sched.schedule().prefills] == [seq] and sched.slots.num_free == 1


def test_draft_len_for_is_trtllm_rule_smallest_key_at_or_above_the_batch():
    # TensorRT-LLM's own example (get_draft_len_for_batch_size): {4: 4, 8: 2, 32: 1} runs 1-4 rows at K=4,
    # 5-8 at 2, 9-32 at 1 and 33+ without drafts.
    cfg = SchedulerConfig(max_num_seqs=64, max_model_len=100, max_draft_len=4, draft_len_schedule={4: 4, 8: 2, 32: 1})
    got = {b: cfg.draft_len_for(b) for b in range(1, 65)}
    assert got == {b: 4 if b <= 4 else 2 if b <= 8 else 1 if b <= 32 else 0 for b in range(1, 65)}
    # An explicit 0 below a drafting threshold: 1 row drafts 3, 2-3 rows draft nothing, 4 rows draft 2.
    gap = SchedulerConfig(max_num_seqs=8, max_model_len=100, max_draft_len=3, draft_len_schedule={1: 3, 3: 0, 4: 2})
    assert [gap.draft_len_for(b) for b in range(1, 7)] == [3, 0, 0, 2, 0, 0]
    # No schedule: every batch size runs max_draft_len.
    plain = SchedulerConfig(max_num_seqs=8, max_model_len=100, max_draft_len=5)
    assert {plain.draft_len_for(b) for b in range(1, 9)} == {5}


def test_draft_len_follows_the_schedule_by_batch_size_within_need_and_room():
    cfg = SchedulerConfig(max_num_seqs=16, max_model_len=100, max_draft_len=7, draft_len_schedule={1: 7, 2: 7, 4: 3})
    sched = Scheduler(cfg)
    seqs = [_seq(10, new=30) for _ in range(2)]
    for s in seqs:
        sched.add(s)
    _run(sched, sched.schedule())  # one token each
    assert sched.schedule().num_draft == 7
    seqs[0].output_ids += [5] * 26  # 27 of 30: 3 to go; the other row still needs 29
    assert sched.schedule().num_draft == 7  # need = the most any row still needs
    seqs[1].output_ids += [5] * 26
    assert sched.schedule().num_draft == 3
    # 3 and 4 rows take key 4's K=3; a fifth row is above the largest key: no drafts.
    sched = Scheduler(cfg)
    rows = [_seq(10, new=60) for _ in range(5)]
    for s in rows[:3]:
        sched.add(s)
    _run(sched, sched.schedule())
    for s, n in zip(rows[3:], (4, 5)):
        batch = sched.schedule()
        assert len(batch.decodes) == n - 1 and batch.num_draft == 3
        sched.add(s)
        _run(sched, sched.schedule())
    batch = sched.schedule()
    assert len(batch.decodes) == 5 and batch.num_draft == 0
    # room: the verify block [anchor, d_1..d_K] at positions num_cached..num_cached+K must fit max_model_len
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_model_len=40, max_draft_len=7))
    s = _seq(10, new=100)
    sched.add(s)
    _run(sched, sched.schedule(), max_model_len=40)
    s.output_ids += [5] * 25  # 26 generated: num_cached = 35, positions 35..39 leave K = 4
    assert sched.schedule().num_draft == 4


def test_bad_schedule_is_refused_naming_the_limit():
    with pytest.raises(ValueError, match="max_draft_len=3"):
        SchedulerConfig(max_num_seqs=4, max_model_len=64, max_draft_len=3, draft_len_schedule={2: 5})


def test_slot_allocator_never_hands_out_a_row_twice():
    slots = SlotAllocator(3)
    got = [slots.allocate() for _ in range(3)]
    assert got == [0, 1, 2] and slots.num_free == 0
    with pytest.raises(RuntimeError, match="all 3 cache rows"):
        slots.allocate()
    slots.free(1)
    assert slots.allocate() == 1


# --- the engine over the scheduler ----------------------------------------------------------------


def _engine(tiny_dirs, **cfg):
    from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine
    from dflash_trt.models.dflash import load_drafter
    from dflash_trt.models.registry import load_target

    target = load_target(tiny_dirs["qwen3"])
    drafter = load_drafter(tiny_dirs["qwen3_drafter"], target.config)
    return LLMEngine(target, None, drafter, EngineConfig(**cfg))


def test_chunked_prefill_and_joining_requests_equal_target_greedy(tiny_dirs):
    import torch

    from tests.engine.test_lossless import hf_greedy

    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (23, 4, 11, 30, 7)]
    # 2 rows for 5 requests: they join as rows free up; 6-token budget: every long prompt is chunked,
    # and the schedule varies K with the batch size (step by step: load_window 1).
    engine = _engine(tiny_dirs, max_batch_size=2, max_draft_len=7, max_prefill_tokens=6, draft_len_schedule={1: 7, 2: 3},
                     load_window=1)
    new = [20, 33, 9, 25, 14]
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in new])
    for p, o, n in zip(prompts, outs, new):
        assert o.token_ids == hf_greedy(tiny_dirs["qwen3"], p, new=n)
    assert {3, 7} <= {k for o in outs for k in o.draft_lens}
    assert engine.scheduler.slots.num_used == 0


def test_a_seeded_sample_does_not_depend_on_chunking_or_company(tiny_dirs):
    p = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    prompt = list(range(10, 40))
    alone = _engine(tiny_dirs, max_batch_size=1).generate([prompt], p)[0].token_ids
    others = [SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True) for n in (5, 9)]
    crowd = _engine(tiny_dirs, max_batch_size=2, max_prefill_tokens=8).generate(
        [list(range(5, 20)), prompt, list(range(3, 9))], [others[0], p, others[1]])[1].token_ids
    assert alone == crowd


def test_k_follows_the_load_of_the_last_steps_not_a_momentary_one_row_batch():
    # Schedule {1: 3}: one row drafts K=3, two rows decode plainly. Two requests run together; when the
    # shorter finishes, the longer decodes alone, but K stays 0 for load_window steps (a closed-loop client's
    # next request is on its way), then rises to the one-row K.
    cfg = SchedulerConfig(max_num_seqs=2, max_model_len=512, max_draft_len=3, draft_len_schedule={1: 3}, load_window=4)
    sched = Scheduler(cfg)
    short, long = _seq(4, new=3), _seq(4, new=200)
    sched.add(short)
    sched.add(long)
    ks = []
    while sched.has_work():
        batch = sched.schedule()
        if batch.decodes:
            ks.append((len(batch.decodes), batch.num_draft))
        _run(sched, batch)
        if len(ks) > 12:
            break
    assert ks[:2] == [(2, 0), (2, 0)]  # both decode; the short one's third token finishes it
    alone = ks[2:]
    # steps since two ran: 1, 2, 3 lie inside a 4-step window (the prefill step counts too), then K=3
    assert alone[:3] == [(1, 0)] * 3 and set(alone[3:]) == {(1, 3)}
    # a single stream from the start drafts at once
    solo = Scheduler(cfg)
    solo.add(_seq(4, new=20))
    solo_ks = []
    for _ in range(3):
        batch = solo.schedule()
        solo_ks.append(batch.num_draft)
        _run(solo, batch)
    assert solo_ks == [0, 3, 3]  # the prefill step, then K=3 straight away
    with pytest.raises(ValueError, match="load_window must be >= 1"):
        SchedulerConfig(max_num_seqs=1, max_model_len=8, load_window=0)


def test_the_default_prefill_grid_is_a_kernel_call_on_amx_tiles_and_32_tokens_off_them_within_the_budget(tiny_dirs):
    from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine
    from dflash_trt.kernels import cpu_ops
    from dflash_trt.models.registry import load_target

    from dflash_trt.layers.linear import kernel_layout

    def grid(dtype, **cfg):
        target = load_target(tiny_dirs["qwen3"], getattr(torch, dtype))
        engine = LLMEngine(target, None, None, EngineConfig(dtype=dtype, speculative=False, **cfg))
        layouts.append(kernel_layout(target))
        return engine.scheduler.config.grid, target.one_call_max_tokens

    layouts = []

    assert grid("float32") == (512, 0)  # no layer kernel in fp32: the budget's grid
    assert grid("float32", prefill_chunk=48) == (48, 0)
    if cpu_ops.load() is None:
        pytest.skip("no C compiler: the bf16 layer kernel is not built here")
    chunk, one_call = grid("bfloat16")
    # 32 rows of dot products a call, 256 tokens on AMX tiles or AVX2 panels; off tiles a grid of 32 (a chat's next
    # turn takes over its history in finer chunks: on AVX2 panels the grid was 256)
    assert one_call in (32, 256) and chunk == (256 if layouts[-1] == "tiles" else 32)
    assert grid("bfloat16", max_prefill_tokens=16) == (16, one_call)
    with pytest.raises(ValueError, match=r"prefill_chunk must be in 1\.\.max_prefill_tokens \(512\), got 600"):
        EngineConfig(prefill_chunk=600)


def test_generate_refuses_a_params_list_that_does_not_match_the_prompts(tiny_dirs):
    from tests.engine.test_lossless import hf_greedy

    engine = _engine(tiny_dirs, max_batch_size=2, max_draft_len=3)
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (4, 6)]
    with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
        engine.generate(prompts, params[:1])  # would answer the first prompt only
    assert not engine.has_unfinished()
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [hf_greedy(tiny_dirs["qwen3"], p, new=n) for p, n in zip(prompts, (4, 6))]
