"""SlotAllocator: hands out the KV-cache rows (one per running request) and takes them back (no torch).

The caches are static: each request owns one row of the target cache and the same row of the
drafter cache for its whole life. A freed row keeps its stale K/V; the next owner writes from
position 0 (or past the prompt chunks it takes over: the scheduler's reuse) and the position-derived masks hide
anything beyond what it has written.
"""

from __future__ import annotations

import heapq


class SlotAllocator:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        # A min-heap: lowest row first, so a lone request sits in row 0 and small batches stay contiguous (no copies).
        self._free = list(range(num_slots))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def free_rows(self) -> list[int]:
        return list(self._free)

    def allocate(self, slot: int | None = None) -> int:
        """The lowest free row, or `slot` (a free one)."""
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} cache rows are in use")
        if slot is None:
            slot = heapq.heappop(self._free)
        else:
            self._free.remove(slot)
            heapq.heapify(self._free)
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        assert slot in self._used, f"row {slot} freed twice or never allocated"
        self._used.remove(slot)
        heapq.heappush(self._free, slot)
