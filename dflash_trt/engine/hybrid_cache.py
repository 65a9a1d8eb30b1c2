"""The cache of a hybrid target (Qwen3.5: linear-attention layers between full-attention ones): K/V for the attention
layers, as engine/kv_cache.py keeps them, and for each linear layer its recurrent state and convolution inputs.

A K/V cache rolls back for free (rejected positions are masked, then overwritten); a recurrent state does not: it
has taken in every token of the verify block, rejected ones too. So each forward keeps, per row and linear layer, the
state after each of its last `snapshots` real positions, and the next forward starts from the state after the
position before its first query, wherever the last one stopped accepting. A verify block of K + 1 queries needs
K + 1 snapshots; a prompt chunk its last one; a draft tree's verify one a node, each node's state continuing its
parent's, and HybridCache.move lines the accepted path's up by depth, as it does their K/V. The engine needs no
rollback call, as with K/V.

A row also keeps, as "marks", its state after the last position of MAX_MARKS of its prompt chunks: a later request
whose prompt starts with those chunks takes them over or copies them (scheduler.py's row reuse: a chat's next turn, a
shared system prompt), as far as the row still holds a mark (HybridCache.holds_prefix). The last two chunks' stay (a
chat's next turn takes over its last turn's prompt up to its last whole chunk); of the earlier ones, the two at the
largest power of two before them and its half (chunks of 512 in a 4,000-token prompt: 2,048 and 1,024), so a prefix
later prompts share (a system prompt, tools) keeps a mark at least half way into it where it is a quarter of the
prompt or more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_trt.engine.kv_cache import KVCache
from dflash_trt.layers.attention import AttentionMetadata


# The most states a row keeps a forward (a verify step's queries: z-lab's drafters' blocks are 16 at most, draft trees
# here 31 nodes and their root): a layer takes a prompt's tokens before its last this many by chunks, whatever an
# engine keeps.
MAX_SNAPSHOTS = 32
# The prompt chunks' ends a row keeps its state after (LinearStates._mark: the last two, and the roundest before them)
MAX_MARKS = 4
KEPT_LAST = 2


def _roundness(position: int) -> tuple[int, int]:
    """How round the end of a mark's chunk is (the power of two dividing position + 1, the prefix's length); the
    least goes first, and of two as round the later: the earlier ones kept are then the largest power of two below
    the last two and its half."""
    end = position + 1
    return (end & -end).bit_length(), -position


@dataclass(frozen=True)
class LinearStateShape:
    conv_channels: int  # the channels the causal convolution runs over (q, k and v of every head)
    conv_history: int  # inputs a convolution reads before the current one (its kernel size - 1)
    heads: int  # value heads: one [key_dim, value_dim] state each
    key_dim: int
    value_dim: int


@dataclass(frozen=True)
class RowStates:
    """One forward's rows as a linear layer reads and keeps their states."""

    rows: list[int]
    starts: list[int]  # each row's first query position
    lens: list[int]  # each row's real queries (the rest of the forward's Q are padding)
    prompt: bool = False  # a prompt chunk (its rows mark their state after its last token)


def row_states(meta: AttentionMetadata) -> RowStates:
    """The forward's rows, first positions and real query counts, from the host copies where the engine gave them."""
    queries = meta.positions.shape[1]
    host = meta.host
    if host is not None:
        lens = list(host.lens) if host.lens is not None else [queries] * len(host.slots)
        return RowStates(list(host.slots), list(host.starts), lens, host.lens is not None)
    rows = meta.rows.tolist()
    return RowStates(rows, meta.positions[:, 0].tolist(), [queries] * len(rows))


class LinearStates:
    """One linear-attention layer's states: for each row, those after positions first[row] .. first[row] + count - 1,
    in slots 0 .. count - 1."""

    def __init__(self, shape: LinearStateShape, rows: int, snapshots: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        if not 1 <= snapshots <= MAX_SNAPSHOTS:
            raise ValueError(f"a linear-attention layer keeps 1..{MAX_SNAPSHOTS} states a row, not {snapshots}")
        self.shape = shape
        self.snapshots = snapshots
        # the convolution's inputs in the model dtype, as the layer computes them; the recurrent state in fp32
        self.conv = torch.zeros(rows, snapshots, shape.conv_history, shape.conv_channels, dtype=dtype, device=device)
        self.state = torch.zeros(rows, snapshots, shape.heads, shape.key_dim, shape.value_dim, dtype=torch.float32,
                                 device=device)
        self.first = [0] * rows
        self.count = [0] * rows
        # per row: position -> (convolution history, state) after it, at its last prompt chunks' ends
        self.marks: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(rows)]

    def nbytes(self) -> int:
        """The snapshots' bytes and room for every row's marks."""
        per_state = self.conv[0, 0].numel() * self.conv.element_size() + self.state[0, 0].numel() * \
            self.state.element_size()
        return self.conv.numel() * self.conv.element_size() + self.state.numel() * self.state.element_size() + \
            MAX_MARKS * per_state * len(self.marks)

    def holds(self, row: int, position: int) -> bool:
        return 0 <= position - self.first[row] < self.count[row] or position in self.marks[row]

    def state_after(self, row: int, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The row's convolution history and state after `position`; RuntimeError where it holds none (a bug in the
        caller: a forward must start where one of the last one's real positions left off, or at a mark)."""
        slot = position - self.first[row]
        if 0 <= slot < self.count[row]:
            return self.conv[row, slot], self.state[row, slot]
        if position in self.marks[row]:
            return self.marks[row][position]
        held = (f"positions {self.first[row]}..{self.first[row] + self.count[row] - 1}" if self.count[row]
                else "no position")
        raise RuntimeError(f"row {row}: a linear-attention layer holds no state after position {position} (it holds "
                           f"{held}, and marks at {sorted(self.marks[row])}); a hybrid target's rows must start where "
                           "their last forward's real positions end, inside its last verify block, or at a mark")

    def _mark(self, row: int, position: int, conv: torch.Tensor, state: torch.Tensor) -> None:
        marks = self.marks[row]
        marks[position] = (conv, state)
        while len(marks) > MAX_MARKS:
            earlier = sorted(marks)[:-KEPT_LAST]
            del marks[min(earlier, key=_roundness)]

    def initial(self, rs: RowStates) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's convolution history [B, history, channels] and recurrent state [B, heads, key, value] before its
        first query (zeros at position 0)."""
        b = len(rs.rows)
        conv = self.conv.new_zeros(b, *self.conv.shape[2:])
        state = self.state.new_zeros(b, *self.state.shape[2:])
        for i, (row, start) in enumerate(zip(rs.rows, rs.starts)):
            # the forward rewrites positions from start on: marks there are of what the row held before
            self.marks[row] = {p: m for p, m in self.marks[row].items() if p < start}
            if start > 0:
                conv[i], state[i] = self.state_after(row, start - 1)
        return conv, state

    def keep_from(self, rs: RowStates) -> int:
        """The first query index any row keeps a state after (the forward need not hold states before it)."""
        return max(0, min(n - self.snapshots for n in rs.lens))

    def keep(self, rs: RowStates, history: torch.Tensor, states: torch.Tensor, offset: int,
             windows: torch.Tensor | None = None) -> None:
        """history [B, conv_history + Q, channels]: the convolution inputs before and of this forward; states
        [B, Q - offset, heads, key, value]: the recurrent state after each query from `offset` on. Each row keeps
        those after its last `snapshots` real queries. windows [B, Q, taps] (a draft tree's): the history indices
        each query's convolution read, oldest first (its own and its ancestors' inputs)."""
        h = self.shape.conv_history
        for i, (row, start, n) in enumerate(zip(rs.rows, rs.starts, rs.lens)):
            lo = max(0, n - self.snapshots)
            if windows is not None and lo:
                raise ValueError(f"a draft tree of {n} nodes and its root: a linear-attention layer keeps the states "
                                 f"of {self.snapshots} a row")
            count = n - lo
            self.state[row, :count] = states[i, lo - offset:n - offset]
            for j in range(count):
                if windows is None:  # the history after query t is the inputs of queries t - h + 1 .. t
                    self.conv[row, j] = history[i, lo + j + 1:lo + j + 1 + h]
                else:
                    self.conv[row, j] = history[i, windows[i, j, 1:]]
            self.first[row], self.count[row] = start + lo, count
            if rs.prompt:
                self._mark(row, start + n - 1, self.conv[row, count - 1].clone(), self.state[row, count - 1].clone())

    def line_up(self, row: int, start: int, nodes: list[int]) -> None:
        """After a draft tree's verify starting at `start`: the states after its accepted nodes (root first) become
        those after positions start, start + 1, ... (its nodes' states lie at slots 0.. in node order)."""
        idx = torch.tensor(nodes, device=self.state.device)
        self.state[row, :len(nodes)] = self.state[row, idx]
        self.conv[row, :len(nodes)] = self.conv[row, idx]
        self.first[row], self.count[row] = start, len(nodes)

    def copy_row(self, src: int, dst: torch.Tensor, start: int, end: int) -> None:
        """Row src's state after position end - 1 to rows dst, as their only snapshot and a mark, with src's marks in
        [start, end) (their own marks before start stay: positions the copy leaves as they are)."""
        conv, state = (x.clone() for x in self.state_after(src, end - 1))
        copied = {p: m for p, m in self.marks[src].items() if start <= p < end - 1}
        for row in dst.tolist():
            self.conv[row, 0], self.state[row, 0] = conv, state
            self.first[row], self.count[row] = end - 1, 1
            self.marks[row] = {p: m for p, m in self.marks[row].items() if p < start} | copied
            self._mark(row, end - 1, conv, state)


class HybridCache:
    def __init__(self, kv: KVCache, linear: list[LinearStates]) -> None:
        self.kv = kv
        self.linear = linear

    @property
    def max_len(self) -> int:
        return self.kv.max_len

    @property
    def num_rows(self) -> int:
        return self.kv.num_rows

    def nbytes(self) -> int:
        return self.kv.nbytes() + sum(s.nbytes() for s in self.linear)

    def copy_rows(self, src: int, dst: torch.Tensor, start: int, end: int) -> None:
        """Row src's K/V at positions [start, end) and its linear layers' states after end - 1 to rows dst (the
        state sums every position before it: it is the whole prefix's, wherever start is)."""
        self.kv.copy_rows(src, dst, start, end)
        for states in self.linear:
            states.copy_row(src, dst, start, end)

    def holds_prefix(self, row: int, end: int) -> bool:
        """Whether a request may take over (or copy) the row's first `end` prompt positions: their K/V are the
        scheduler's to know; the linear layers must hold the state after end - 1."""
        return all(states.holds(row, end - 1) for states in self.linear)

    def move(self, moves: list[tuple[int, int, list[int]]]) -> None:
        """As KVCache.move: for (row, start, nodes), a draft tree's accepted path, root first, to the positions of its
        depths; the linear layers' states after them likewise."""
        self.kv.move(moves)
        for row, start, nodes in moves:
            for states in self.linear:
                states.line_up(row, start, nodes)
