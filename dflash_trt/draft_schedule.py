"""The draft-length schedule: which K each batch size runs, by TensorRT-LLM's rule, and how to choose it.

TensorRT-LLM's `draft_len_schedule` maps batch-size thresholds to K: a batch of b rows runs the K of the
smallest key >= b, and a batch above the largest key runs without drafts (K = 0). {4: 4, 8: 2, 32: 1}
means 1..4 rows -> K=4, 5..8 -> 2, 9..32 -> 1, 33+ -> 0 (tensorrt_llm/_torch/speculative/utils.py
get_draft_len_for_batch_size, bisect_left; example from llm_args.py). Its config validator also requires a
key 1 equal to max_draft_len (later versions: the smallest key) and no K above it (llm_args.py
validate_draft_len_schedule_and_sort); a key 1 holding max_draft_len passes either.
`expand` is that rule, the one place this project implements it; the torch runtime's scheduler uses it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping

from dflash_trt.sampling_params import is_int


def check_table(table: Mapping[int, int], name: str, value: str, limit: tuple[str, int] | None = None) -> None:
    """ValueError naming `name` where a table under this rule (batch-size threshold -> K, or draft tree nodes) has a
    batch size below 1 or a value below 0 (or above the named limit, e.g. ("max_draft_len", 3))."""
    if not (isinstance(table, Mapping) and all(is_int(b) and is_int(v) for b, v in table.items())):
        raise ValueError(f"{name} must map batch sizes to {value} (integers), got {table!r:.60}")
    for b, v in table.items():
        if b < 1 or v < 0 or (limit is not None and v > limit[1]):
            bound = ">= 0" if limit is None else f"in 0..{limit[0]}={limit[1]}"
            raise ValueError(f"{name} entry {b}: {v} needs batch size >= 1 and {value} {bound}")


def with_k(schedule: Mapping[int, int], k: int) -> dict[int, int]:
    """The schedule for a K given by hand (-k): K at one row (TensorRT-LLM's rule: key 1 is max_draft_len), no batch
    size drafting more than K, and the batch sizes the schedule turned speculation down at kept so."""
    return {b: k if b == 1 else min(n, k) for b, n in schedule.items()}


def expand(schedule: Mapping[int, int], batch_size: int) -> int:
    """K for a batch of `batch_size` rows: the value of the smallest key >= batch_size; 0 above every key."""
    keys = sorted(schedule)
    i = bisect_left(keys, batch_size)
    return schedule[keys[i]] if i < len(keys) else 0


def throughput(batch_size: int, k: int, tau_by_k: Mapping[int, float], step_time: Callable[[int, int], float]) -> float:
    """Committed tokens per second of a batch: b x tau(K) / step time (tau(0) = 1, a plain decode step)."""
    tau = 1.0 if k == 0 else tau_by_k[k]
    return batch_size * tau / step_time(batch_size, k)


# A larger K must model more than this much faster to be chosen: the model's step costs are estimates far coarser
# than 1%, and a larger K costs what they leave out (verify rows, the drafter's cache, a wasted block on a miss).
MIN_GAIN = 0.01


def _best_k(batch_size: int, candidates: list[int], tau_by_k, step_time) -> int:
    """The smallest candidate within MIN_GAIN of the best throughput."""
    tps = {k: throughput(batch_size, k, tau_by_k, step_time) for k in candidates}
    best = max(tps.values())
    return min(k for k in candidates if tps[k] * (1 + MIN_GAIN) >= best)


def choose_per_batch_size(
    tau_by_k: Mapping[int, float], step_time: Callable[[int, int], float], batch_sizes: Iterable[int],
    max_draft_len: int, min_draft_len: int = 0,
) -> dict[int, int]:
    """{batch size: K} maximising b x tau(K) / step_time(b, K) over K in {0} and tau_by_k's keys (the smallest K
    within MIN_GAIN of the maximum).

    K at the smallest batch size is chosen among K <= max_draft_len; every larger batch size among
    K <= that choice, because TensorRT-LLM requires schedule[1] == max_draft_len >= every K. (A larger
    K at a larger batch would need tau to grow faster than the step cost; the cap then costs throughput.)
    min_draft_len: the least K a larger batch size may run once the smallest drafts (1 for TensorRT-LLM's DFlash:
    DRAFTING_STOPS).
    """
    sizes = sorted(set(batch_sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch_sizes must be >= 1 and non-empty, got {sizes}")
    bad = [k for k, tau in tau_by_k.items() if k < 1 or tau <= 0]
    if bad:
        raise ValueError(f"tau_by_k needs K >= 1 and tau > 0; bad entries for K={bad}")
    ks = [0] + sorted(k for k in tau_by_k if k <= max_draft_len)
    first = _best_k(sizes[0], ks, tau_by_k, step_time)
    capped = [k for k in ks if (min_draft_len <= k or first == 0) and k <= first]
    return {b: (first if b == sizes[0] else _best_k(b, capped, tau_by_k, step_time)) for b in sizes}


def compress(per_batch: Mapping[int, int]) -> dict[int, int]:
    """{batch size: K} over consecutive batch sizes -> TensorRT-LLM thresholds.

    A run of batch sizes with the same K becomes one key (its largest batch size); a trailing run of
    K = 0 is dropped (above the largest key TensorRT-LLM drafts nothing), a K = 0 run below a drafting
    run stays explicit. Key 1 is always written when batch 1 drafts (TensorRT-LLM requires it).
    Batch sizes between two listed ones take the K of the next listed one, as `expand` reads it.
    """
    sizes = sorted(per_batch)
    out: dict[int, int] = {}
    for i, b in enumerate(sizes):
        last_of_run = i + 1 == len(sizes) or per_batch[sizes[i + 1]] != per_batch[b]
        if last_of_run:
            out[b] = per_batch[b]
    while out and out[max(out)] == 0:
        del out[max(out)]
    if out and sizes[0] == 1 and 1 not in out:
        out[1] = per_batch[1]
    return dict(sorted(out.items()))


def choose_draft_len_schedule(
    tau_by_k: Mapping[int, float], step_time: Callable[[int, int], float], batch_sizes: Iterable[int],
    max_draft_len: int, min_draft_len: int = 0,
) -> dict[int, int]:
    """The throughput-maximising draft_len_schedule (TensorRT-LLM thresholds) for these batch sizes.

    The K chosen at the smallest batch size becomes the schedule's max_draft_len (schedule[1]); {} means
    speculation never pays at batch 1 under this model, and the engine should run without a drafter.
    `step_time(b, K)` is the time of one engine step of b rows at draft length K (K = 0: plain decode).
    """
    return compress(choose_per_batch_size(tau_by_k, step_time, batch_sizes, max_draft_len, min_draft_len))


# TensorRT-LLM's DFlash worker skips a K=0 step whole, storing neither the prompts it prefills nor the tokens it
# accepts into the drafter's per-request context (_torch/speculative/dflash.py@00679c66 _forward_impl: skip_drafting
# before _store_prefill_context); once the batch shrinks and drafting resumes, the drafter attends to rows never
# written and acceptance collapses for the rest of those requests (NVIDIA/TensorRT-LLM PR #16888, open, which floors
# the runtime K at 1). A GPU build drafts at least K=1 at every batch size instead.
DRAFTING_STOPS = ("TensorRT-LLM's DFlash stores no drafter context while it drafts K=0 (its dflash.py skip_drafting; "
                  "NVIDIA/TensorRT-LLM PR #16888), and acceptance collapses once drafting resumes")


def first_idle_batch(schedule: Mapping[int, int], max_batch_size: int) -> int | None:
    """The smallest batch size up to max_batch_size that `schedule` drafts nothing at (above its largest key, or a
    K=0 entry); None where every batch size drafts."""
    for b in sorted({1, *(key + 1 for key in schedule), *schedule}):
        if b <= max_batch_size and expand(schedule, b) == 0:
            return b
    return None


def check_drafting_continues(schedule: Mapping[int, int] | str | None, max_concurrency: int | None,
                             max_draft_len: int | None, max_batch_size: int) -> None:
    """ValueError naming the key where TensorRT-LLM would draft K=0 at a batch size up to max_batch_size
    (DRAFTING_STOPS): a schedule's 0 or its last key below it, or max_concurrency below it. `auto` is checked once
    chosen."""
    if max_concurrency is not None and max_concurrency < max_batch_size:
        k = max_draft_len or "K"
        raise ValueError(f"speculative_config.max_concurrency={max_concurrency} drafts nothing above {max_concurrency} "
                         f"requests: {DRAFTING_STOPS}; write draft_len_schedule: {{1: {k}, {max_concurrency}: {k}, "
                         f"{max_batch_size}: 1}} instead")
    if isinstance(schedule, Mapping) and (b := first_idle_batch(schedule, max_batch_size)) is not None:
        raise ValueError(f"speculative_config.draft_len_schedule={dict(sorted(schedule.items()))} drafts nothing at a "
                         f"batch of {b} (max_batch_size={max_batch_size}): {DRAFTING_STOPS}; draft K=1 there instead"
                         + (f" (end it with {max_batch_size}: 1)" if b > max(schedule) else ""))
