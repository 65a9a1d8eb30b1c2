"""Scheduler: continuous batching over the fused draft-verify step (no torch).

Requests wait in a bounded FIFO queue and join the running set between steps, each taking one cache
row. A step carries prefill chunks (new or partly prefilled prompts, within a token budget, so a long
prompt never stalls the running requests for more than max_prefill_tokens) and one decode step for every
request whose prompt is fully cached. A request leaves when it finishes, fails or is aborted, and
its row is free for the next step. Methods are thread-safe: requests and aborts may arrive from any
thread while one engine thread calls `schedule` and `finish`.

A prompt's chunks lie on a grid of its own positions (prefill_chunk each, the last one shorter), whatever else
runs, and a chunk waits for a step with room for all of it. Cut where a neighbour's chunk left room, a chunk
would be computed another way (past 256 tokens or 128 rows the CPU's attention and linears are SDPA's and
oneDNN's, whose bf16 sums depend on the shapes), and a prompt's K/V, and so its greedy answer, would depend on the
requests that arrived with it (the engine also prefills each chunk in a forward of its own). Requests whose prompts
hold the same tokens up to a chunk's end, at the same span, run it once in a step (PrefillChunk.source). And a freed
row keeps its last prompt's whole chunks: a request whose prompt starts with them (the next turn of a chat, the same
long prompt again) takes that row and skips them, since computed again on the same grid they would come out the same
bit for bit (`_Resident`). A running request's row gives a copy of its prompt's whole chunks the same way (a system
prompt that many users' requests start with, or the same prompt while the first one still runs).

Worked example (max_num_seqs=2, max_prefill_tokens=8, prefill_chunk=4): A (prompt 5) and B (prompt 20) arrive.
Step 1: prefill A[0:4] and A[4:5] (B's first chunk, 4 tokens, does not fit the 3 left). Step 2: decode A; prefill
B[0:4] and B[4:8]. Step 3: decode A; prefill B[8:12], B[12:16]. Step 4: decode A; prefill B[16:20] (B samples its
first token). Step 5: decode A and B together.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from dflash_trt.draft_schedule import check_table, expand
from dflash_trt.engine.sequence import Sequence
from dflash_trt.engine.slot_allocator import SlotAllocator


class QueueFullError(Exception):
    """The waiting queue is at max_queue_len: retry later (HTTP 503)."""


@dataclass
class SchedulerConfig:
    max_num_seqs: int  # cache rows: requests running at once
    max_model_len: int  # prompt + generated tokens per request
    max_draft_len: int = 0  # K for every batch when there is no schedule (0: autoregressive)
    # batch-size threshold -> K, TensorRT-LLM's rule (draft_schedule.expand): the smallest key >= the batch
    # size wins, and batches above the largest key run without drafts. Empty: always max_draft_len.
    draft_len_schedule: dict[int, int] = field(default_factory=dict)
    max_queue_len: int = 256  # waiting requests beyond the running ones; more are refused
    max_prefill_tokens: int = 512  # prompt tokens per step, over all prefill chunks
    # The grid a prompt's chunks lie on, in tokens (0: max_prefill_tokens). A step carries as many of a prompt's chunks
    # as the budget holds, each in a forward of its own; rows give later prompts whole chunks, so a finer grid reuses
    # shorter prefixes (a chat's turns under 512 tokens), at the cost of more forwards a prompt.
    prefill_chunk: int = 0
    # K follows the most requests running in any of the last this many steps, not the instantaneous batch: under
    # a closed-loop load a finished request's replacement arrives some steps later, and the one-row steps in
    # between would draft with the one-row K (measured: the CPU default 11% below AR at concurrency 2). 1: the
    # requests running in this step, decoding or prefilling (TensorRT-LLM applies the schedule to each step's batch).
    load_window: int = 8
    # Rows give the whole prompt chunks they hold (a freed row its last request's, a running one its request's) to
    # the requests whose prompts start with them. False: every request prefills its own prompt, bar a chunk another
    # request computes in the same step (vLLM's --no-enable-prefix-caching).
    reuse_rows: bool = True
    # Where given, whether a row still holds what a request taking over (or copying) its first `end` prompt positions
    # needs beside their K/V (a hybrid target's recurrent state after end - 1: engine/hybrid_cache.py's marks); the
    # chunks up to an end it does not hold are not given.
    holds_prefix: Callable[[int, int], bool] | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_queue_len < 0:
            raise ValueError(f"max_queue_len must be >= 0, got {self.max_queue_len}")
        if self.load_window < 1:
            raise ValueError(f"load_window must be >= 1, got {self.load_window}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if not 0 <= self.prefill_chunk <= self.max_prefill_tokens:  # a chunk past the budget would never be run
            raise ValueError(f"prefill_chunk must be in 0..max_prefill_tokens ({self.max_prefill_tokens}), got "
                             f"{self.prefill_chunk}")
        check_table(self.draft_len_schedule, "draft_len_schedule", "K", ("max_draft_len", self.max_draft_len))

    @property
    def grid(self) -> int:
        """Tokens a prompt chunk holds (its last one fewer)."""
        return self.prefill_chunk or self.max_prefill_tokens

    def draft_len_for(self, batch_size: int) -> int:
        """K for a batch: TensorRT-LLM's rule over the schedule (0 above its largest key); max_draft_len without one."""
        if not self.draft_len_schedule:
            return self.max_draft_len
        return expand(self.draft_len_schedule, batch_size)


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int  # first prompt position of the chunk
    end: int  # one past the last; end == len(prompt) samples the first token
    # Another request of this step whose prompt holds the same tokens up to `end` and whose chunk is the same span: it
    # computes the chunk and this one copies its K/V (a chunk's K/V are a function of the tokens up to its end, on
    # the grid). Such a chunk costs no budget: a request's n choices, or a batch of one prompt, prefill once.
    source: Sequence | None = None
    # (row, end): a request's first chunk past the prompt tokens a running request's row holds (that request took them
    # over in this step, or computed them); before the step's forwards, that row's K/V and drafter context at [0, end)
    # are copied to this one's
    takes: tuple[int, int] | None = None
    copied: bool = False  # the copy `takes` asks for has landed (a step that fails before it undoes the request's)

    def undo_takeover(self) -> None:
        """Where the copy `takes` asks for never landed (the step failed first), the request holds none of the prompt
        Scheduler._admit gave it with the copy."""
        if self.takes is not None and not self.copied:
            self.seq.num_prefilled = self.seq.num_reused = self.seq.drafter_context = 0
            self.seq.pending_features = []

    def __len__(self) -> int:
        return self.end - self.start


@dataclass
class _Resident:
    """What a row holds of a request's prompt (a running request's, or a freed row's last): the target's K/V of
    prompt_ids[:kv_len], chunk by chunk on the grid (later positions hold its answer), the drafter's context at
    positions [0, drafter_len), and the target features of the positions after it that the drafter has not taken in
    (`Sequence.pending_features`: under a load that drafts nothing, a whole prompt's; a freed row keeps those of its
    prompt positions only, views of its prefill's outputs)."""

    row: int
    prompt_ids: list[int]
    kv_len: int
    drafter_len: int
    features: list
    freed: int = -1  # when: a count of the rows freed before it (-1: running)

    @classmethod
    def of(cls, seq: Sequence, freed: int = -1) -> _Resident:
        return cls(seq.slot, seq.prompt_ids, seq.num_prefilled, seq.drafter_context, seq.pending_features, freed)

    def drafter_reach(self, limit: int) -> int:
        """Positions [0, n) whose drafter context a request taking them over can have, held or pending, counted as
        far as `limit` (a plain stretch adds a pending entry a step)."""
        reach = self.drafter_len
        for f in self.features:
            if reach >= limit:
                break
            reach += f.shape[0]
        return reach

    def features_up_to(self, end: int) -> list:
        """The pending features of positions [drafter_len, end)."""
        out, left = [], end - self.drafter_len
        for f in self.features:
            if left <= 0:
                break
            out.append(f[:left])
            left -= f.shape[0]
        return out


@dataclass
class ScheduledBatch:
    prefills: list[PrefillChunk]
    decodes: list[Sequence]  # prompts fully cached: one draft-verify (or plain decode) step each
    num_draft: int  # K for the decodes; 0 means one autoregressive token
    # requests that left since the last step unanswered (rows already freed): aborted ones, and those a failed step
    # finished
    aborted: list[Sequence]


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.slots = SlotAllocator(config.max_num_seqs)
        self.waiting: deque[Sequence] = deque()
        self._running: dict[int, Sequence] = {}  # request_id -> request owning a row (prefilling or decoding), oldest first
        self._abort_ids: set[int] = set()
        self._aborted: list[Sequence] = []  # left, not yet answered: aborted, or finished by a failed step
        self._abort_later: deque[int] = deque()  # abort_later's, taken in by the next _take_aborted()
        self._lock = threading.Lock()
        self._recent_load: deque[int] = deque(maxlen=config.load_window)  # requests running, one entry per step
        self._resident: dict[int, _Resident] = {}  # free rows holding at least one whole prompt chunk
        self._frees = 0

    # --- any thread -------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def running(self) -> list[Sequence]:
        return list(self._running.values())

    @property
    def capacity(self) -> int:
        """The most requests it holds at once: a row each, plus the queue."""
        return self.slots.num_slots + self.config.max_queue_len

    def has_work(self) -> bool:
        with self._lock:
            return bool(self.waiting or self._running or self._aborted)

    def _has_room(self, n: int = 1) -> bool:
        # A request is admitted when a row will be free for it, or the queue has room.
        return len(self.waiting) + n <= self.slots.num_free + self.config.max_queue_len

    def add(self, *seqs: Sequence) -> None:
        """Queue requests, all or none, in one go: a request's n answers reach the same step and share its chunks."""
        with self._lock:
            if not self._has_room(len(seqs)):
                more = f"; {len(seqs)} more do not fit" if len(seqs) > 1 else ""
                # the waiting requests include those admitted for the rows that are free (not yet scheduled)
                raise QueueFullError(f"{len(self.waiting)} requests are waiting, for {self.slots.num_free} free "
                                     f"rows and {self.config.max_queue_len} queue places (max_queue_len){more}; "
                                     "retry later")
            self.waiting.extend(seqs)

    def try_add(self, *seqs: Sequence) -> bool:
        """add() where there is room; False, adding nothing, where there is none (one check under the lock: a check
        before add() let two threads both see the last place free)."""
        try:
            self.add(*seqs)
        except QueueFullError:
            return False
        return True

    def abort(self, request_id: int, reason: str = "abort") -> bool:
        """Cancel a request; its row is freed at the next step boundary. False if it is unknown, done or already
        aborted."""
        with self._lock:
            return self._abort(request_id, reason)

    def abort_later(self, request_id: int) -> None:
        """abort() at the next schedule() (or take_aborted()), taking no lock: a stream's generator that the garbage
        collector closes runs its clean-up wherever a collection starts, inside this scheduler's locked code too, on
        the same thread (abort() waited there on its own lock for ever)."""
        self._abort_later.append(request_id)

    def _abort(self, request_id: int, reason: str = "abort") -> bool:
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.finish_reason = reason
                self._aborted.append(seq)
                return True
        seq = self._running.get(request_id)
        if seq is not None and not seq.is_finished and request_id not in self._abort_ids:
            self._abort_ids.add(request_id)
            return True
        return False

    # --- the engine thread ------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        with self._lock:
            aborted = self._take_aborted()
            try:
                prefills, decodes = self._admit()
                self._recent_load.append(len(self._running))
                return ScheduledBatch(prefills, decodes, self._draft_len(decodes), aborted)
            except BaseException:  # (a bug of its own) the requests taken above are still answered, by the next
                # step or at the stop: they left the running ones, and nothing else would
                self._aborted[:0] = aborted
                raise

    def _admit(self) -> tuple[list[PrefillChunk], list[Sequence]]:
        """This step's prompt chunks and decoding requests: the running requests' first, then waiting ones admitted
        in order while rows and the prefill budget last."""
        budget = self.config.max_prefill_tokens
        prefills: list[PrefillChunk] = []
        decodes: list[Sequence] = []
        computed: dict[tuple[int, int], list[Sequence]] = {}  # (start, end) -> requests computing such a chunk

        def admit(chunk: PrefillChunk) -> bool:
            nonlocal budget
            cost = 0 if chunk.source is not None else len(chunk)
            if cost > budget:
                return False
            prefills.append(chunk)
            budget -= cost
            if chunk.source is None:
                computed.setdefault((chunk.start, chunk.end), []).append(chunk.seq)
            return True

        def admit_rest(seq: Sequence, chunk: PrefillChunk | None = None) -> None:
            """The prompt's chunks after `chunk` (this step's first of it; None: from num_prefilled), in order,
            as many as the budget holds. They must take effect in order too (a copy lands when its source's
            forward runs, and with it the request's features, its progress and, on its last chunk, its first
            token): the chunks it copies all come from the request it copies the first one from, whose chunks
            run in order, and once it computes a chunk itself it copies none after it."""
            start = seq.num_prefilled if chunk is None else chunk.end
            sources = None if chunk is None else (chunk.source,) if chunk.source is not None else ()
            while start < len(seq.prompt_ids) and admit(chunk := self._chunk(seq, computed, start, sources)):
                start = chunk.end
                sources = (chunk.source,) if chunk.source is not None else ()

        for seq in self._running.values():  # oldest first
            if seq.is_prefilled:
                decodes.append(seq)
            else:
                admit_rest(seq)
        # in order: a long prompt at the head is not passed by shorter ones, which would starve it
        copying: set[int] = set()
        while self.waiting and self.slots.num_free:
            slot, reused, held = self._row_for(self.waiting[0], copying)
            if not admit(chunk := self._chunk(self.waiting[0], computed, reused)):
                break
            # the row first, then out of the queue and at once among the running requests: where anything raised
            # in between (a bug of its own), the request was in neither, held its row for ever and its caller waited;
            # this way it is still queued, or a failed step's fail_running() answers it and frees its row
            slot = self.slots.allocate(slot)
            seq = self.waiting.popleft()
            seq.slot = slot
            self._running[seq.request_id] = seq
            self._resident.pop(seq.slot, None)
            seq.num_prefilled = seq.num_reused = reused
            if held is not None:
                if held.row != seq.slot:
                    chunk.takes = (held.row, reused)
                    copying.add(seq.request_id)
                seq.drafter_context = min(held.drafter_len, reused)
                seq.pending_features = held.features_up_to(reused)
            admit_rest(seq, chunk)
        return prefills, decodes

    def finish(self, seq: Sequence) -> bool:
        """Release a finished (or failed) request's row; False where it held none (released already)."""
        with self._lock:
            return self._release(seq)

    def forget_resident(self) -> None:
        """Free rows forget the prompt chunks they hold: the next requests prefill from the start (cold measurements,
        or a cache written behind the scheduler's back)."""
        with self._lock:
            self._resident.clear()

    def fail_running(self, reason: str = "error") -> list[Sequence]:
        """Finish every running request with `reason` (after an engine error; "abort" where its abort was pending:
        its caller asked for that, and is gone); returns them."""
        with self._lock:
            failed = list(self._running.values())
            for seq in failed:
                seq.finish_reason = "abort" if seq.request_id in self._abort_ids else reason
                self._release(seq, keep=False)  # a failed step may have left its rows half written
            return failed

    def answer_next(self, seqs: list[Sequence]) -> None:
        """Requests a failed step released but never answered (aborted, or finished before it failed): the next
        schedule() hands them out with its aborted ones."""
        with self._lock:
            self._aborted[:0] = seqs

    def take_aborted(self) -> list[Sequence]:
        """Requests that left unanswered (aborted, or finished by a failed step) that no step has answered yet (at
        shutdown, when no step will)."""
        with self._lock:
            return self._take_aborted()

    def _take_aborted(self) -> list[Sequence]:
        while self._abort_later:  # (a collection in this loop appends, and the loop takes that in too)
            self._abort(self._abort_later.popleft())
        aborted, self._aborted = self._aborted, []
        for seq in [self._running[i] for i in self._abort_ids if i in self._running]:
            seq.finish_reason = "abort"
            self._release(seq)
            aborted.append(seq)
        self._abort_ids.clear()
        return aborted

    def _release(self, seq: Sequence, keep: bool = True) -> bool:
        held = self._running.pop(seq.request_id, None) is not None
        if held:
            self.slots.free(seq.slot)
            if keep and self.config.reuse_rows and seq.num_prefilled >= self.config.grid:
                resident = _Resident.of(seq, self._frees)
                # its prompt positions' only: the answer's plain steps add an entry each, a view of a whole batch
                resident.features = resident.features_up_to(resident.kv_len)
                self._resident[seq.slot] = resident
                self._frees += 1
        self._abort_ids.discard(seq.request_id)
        return held

    def _row_for(self, seq: Sequence, copying: set[int]) -> tuple[int | None, int, _Resident | None]:
        """The free row to give a request (None: the lowest), how many of its prompt tokens it takes over, and what
        holds them: a freed row's last prompt (the row given), or a running request's, whose row they are copied from
        (a system prompt many users share, a request's n answers, a prompt sent again while the first one runs).
        copying: the requests whose copies land in this step."""
        reused, held = 0, None
        grid = self.config.grid
        # one that asks for its prompt's logprobs needs every prompt position's hidden state; one whose prompt is no
        # longer than a chunk computes its only chunk (a cheap answer for a server of many rows and short prompts)
        if self.config.reuse_rows and seq.params.prompt_logprobs is None and len(seq.prompt_ids) > grid:
            # A running row's prompt positions are not written again (its answer goes after them, and this step's
            # forwards come after the copy); those of this step's chunks are not written yet, so they do not count.
            # On a tie a freed row wins: it is taken over, not copied.
            # A request admitted in this step that takes its prompt over by a copy holds none of it until the copy
            # lands, and never more than the row it copies from (a candidate too): a hybrid cache's holds_prefix
            # would read the row's last occupant's states.
            candidates = [*sorted(self._resident.values(), key=lambda r: r.row),
                          *(_Resident.of(s) for s in self._running.values()
                            if s.num_prefilled >= grid and s.request_id not in copying)]
            for candidate in candidates:
                if (n := self._reusable(candidate, seq.prompt_ids)) > reused:
                    reused, held = n, candidate
        if held is not None and held.freed >= 0:
            return held.row, reused, held
        return self._spare_row(), reused, held

    def _spare_row(self) -> int | None:
        """A row for a request that takes nothing over in it: one that holds nothing (None: the lowest, when none
        does), or else the one freed longest ago; the lowest would wipe out the prompt a chat's next turn is about
        to take over."""
        if not self._resident:
            return None
        if len(self._resident) < self.slots.num_free:
            return min(r for r in self.slots.free_rows() if r not in self._resident)
        return min(self._resident, key=lambda r: self._resident[r].freed)

    def _reusable(self, resident: _Resident, prompt_ids: list[int]) -> int:
        """The prompt's tokens, in whole chunks of the grid, whose K/V (and drafter context) the row holds: chunks
        where both prompts have all of them and hold the same tokens up to their end. The prompt's last chunk is
        always computed: it samples the first token."""
        size = self.config.grid
        reused = 0
        for end in range(size, min(resident.kv_len, len(prompt_ids) - 1) + 1, size):
            if resident.prompt_ids[end - size: end] != prompt_ids[end - size: end]:
                break
            reused = end
        if self.config.max_draft_len and reused > resident.drafter_len:  # the drafter needs context for them
            reused = min(reused, resident.drafter_reach(reused) // size * size)
        holds = self.config.holds_prefix
        while reused and holds is not None and not holds(resident.row, reused):
            reused -= size
        return reused

    def _chunk(self, seq: Sequence, computed: dict[tuple[int, int], list[Sequence]], start: int,
               sources: tuple[Sequence, ...] | None = None) -> PrefillChunk:
        """The prompt's chunk on its grid from `start` (on the grid: num_prefilled only ever moves by whole chunks),
        with the request that computes the same chunk in this step, if one does (among `sources`, where given): the
        same span after the same tokens."""
        end = min(len(seq.prompt_ids), start + self.config.grid)
        ids = seq.prompt_ids
        candidates = [s for s in computed.get((start, end), ()) if sources is None or any(s is x for x in sources)]
        source = next((s for s in candidates  # the chunk's own tokens first: most differ there
                       if s.prompt_ids[start:end] == ids[start:end] and s.prompt_ids[:start] == ids[:start]), None)
        return PrefillChunk(seq, start, end, source)

    def _draft_len(self, decodes: list[Sequence]) -> int:
        """K for this step: the schedule's K for the load (the most requests running over the last load_window
        steps), capped by draft_room."""
        if not decodes:
            return 0
        k = self.config.draft_len_for(max(self._recent_load))  # this step's entry counts the decodes among others
        return min(k, self.draft_room(decodes))

    def draft_room(self, decodes: list[Sequence]) -> int:
        """The most drafts a step of these rows can take: what any row still needs, and the context room of the
        fullest row (the verify block must fit)."""
        need = max(s.remaining for s in decodes)
        room = min(self.config.max_model_len - 1 - s.num_cached for s in decodes)
        return max(0, min(need, room))
