"""A roofline model of one engine step, per rank, and the throughput-versus-interactivity curve it implies.

One step of b rows at draft length K: the target scores t = K + 1 tokens per row (t = 1 without drafts),
then, when K > 0, the DFlash drafter runs once over a block of K + 1 positions (the anchor and K masks)
per row, attending to its context cache, and scores K positions with the target's LM head. Each forward
costs its fixed overheads plus max(bytes / bandwidth, FLOPs / FLOP/s) plus its collectives:

- bytes: the weights of one rank (plan.target_weight_parts), of which a MoE layer reads only the experts
  the batch routes to, E_rank x (1 - (1 - topk/E)^tokens) in expectation for `tokens` routed tokens;
  the KV cache of every row over the context (sliding layers their window); the drafter's weights, the
  LM head again and its context cache.
- FLOPs: 2 x the parameters each token multiplies by (top-k experts for MoE) x tokens, plus attention
  4 x query heads x head_dim x context per token per layer.
- collectives: with tensor-parallel attention, 2 all-reduces per layer of b x t x hidden activations
  (ring: latency + 2 (p-1)/p x message / link bandwidth); under attention data parallelism with expert
  parallelism, an all-gather and a reduce-scatter of every rank's tokens per MoE layer.

Ignored, knowingly: activations' own traffic, the KV writes of the new tokens, the logits gather, the
embedding gather, prefill chunks sharing a step. The hardware figures are in hardware.py.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from dflash_trt.config import BuildConfig
from dflash_trt.hardware import HardwareProfile, has_amx_tiles
from dflash_trt.models.config import DecoderConfig, Qwen3_5Params, moe_shape
from dflash_trt.models.dflash import DFlashConfig
from dflash_trt.plan import (DTYPE_BYTES, KV_DTYPE_BYTES, drafter_weight_bytes, kv_dtype, layer_kinds, model_dtype,
                             target_weight_parts)
from dflash_trt.spec.acceptance_model import tau_from_acceptance
from dflash_trt.validate import attention_tp


@dataclass(frozen=True)
class ForwardCost:
    """One forward on one rank: what it moves, computes and communicates, and its fixed cost."""

    bytes: float
    flops: float
    comm_s: float
    overhead_s: float

    def time(self, hw: HardwareProfile) -> float:
        return self.overhead_s + max(self.bytes / hw.mem_bandwidth_bytes_s, self.flops / hw.dense_flops) + self.comm_s


def expected_experts(num_experts: int, top_k: int, tokens: float) -> float:
    """Experts (of num_experts) that at least one of `tokens` routed tokens picks, in expectation,
    when each token picks top_k distinct experts uniformly."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def ring_allreduce_s(message_bytes: float, ranks: int, link_bytes_s: float, latency_s: float) -> float:
    """A ring all-reduce: each rank sends and receives 2 (p-1)/p of the message."""
    if ranks <= 1:
        return 0.0
    if link_bytes_s <= 0:
        raise ValueError(f"{ranks} ranks exchange activations, but the hardware profile has no interconnect_bytes_s")
    return latency_s + 2 * (ranks - 1) / ranks * message_bytes / link_bytes_s


def fill_tau_table(measured: dict[int, float], max_draft_len: int) -> tuple[dict[int, float], float]:
    """tau for every K in 1..max_draft_len: measured values as given, the others from the geometric
    acceptance model with one alpha fitted to the measured points (least squares), kept between the measured
    values of the nearest shorter and longer drafts; returns (table, alpha)."""
    if not measured:
        raise ValueError("acceptance_by_draft_len is empty: give at least one measured {K: tau}")
    grid = [i / 10000 for i in range(10001)]
    alpha = min(grid, key=lambda a: sum((tau_from_acceptance(a, k) - t) ** 2 for k, t in measured.items()))

    def modelled(k: int) -> float:
        # A longer draft never accepts fewer tokens: a fitted value stays between its measured neighbours'.
        below = max((t for j, t in measured.items() if j < k), default=1.0)
        above = min((t for j, t in measured.items() if j > k), default=float("inf"))
        return max(below, min(tau_from_acceptance(alpha, k), above))

    table = {k: measured.get(k, modelled(k)) for k in range(1, max_draft_len + 1)}
    return table, alpha


@dataclass(frozen=True)
class PerfModel:
    target: DecoderConfig
    drafter: DFlashConfig | None
    cfg: BuildConfig
    hw: HardwareProfile
    context_len: int  # tokens each row attends to (prompt + generated so far)
    draft_vocab_size: int | None = None  # rows of the head the drafter scores with (spec/draft_vocab.py); None: all

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[model_dtype(self.cfg, self.target.extra)]

    @property
    def dp(self) -> int:
        """Attention data-parallel ranks: each holds its own rows (1 without attention DP)."""
        return self.cfg.world_size if self.cfg.enable_attention_dp else 1

    @property
    def gpus(self) -> int:
        return self.cfg.world_size

    def _collectives_s(self, layers: int, tokens_per_rank: float, moe: bool) -> float:
        """Communication of `layers` layers for `tokens_per_rank` tokens on each rank."""
        hw, act_b, h = self.hw, self.dtype_bytes, self.target.hidden_size
        tp = attention_tp(self.cfg)
        if tp > 1:  # tensor-parallel attention: after attention and after the MLP / MoE
            return 2 * layers * ring_allreduce_s(tokens_per_rank * h * act_b, tp, hw.interconnect_bytes_s,
                                                 hw.interconnect_latency_s)
        p = self.cfg.world_size
        if not moe or p <= 1:
            return 0.0
        # Attention DP + expert parallelism: gather every rank's tokens for the experts, scatter the sums back.
        if hw.interconnect_bytes_s <= 0:
            raise ValueError(f"{p} ranks exchange tokens, but the hardware profile has no interconnect_bytes_s")
        total = tokens_per_rank * p * h * act_b
        return 2 * layers * (hw.interconnect_latency_s + (p - 1) / p * total / hw.interconnect_bytes_s)

    def target_cost(self, batch: int, tokens_per_row: int, context: int | None = None) -> ForwardCost:
        t, cfg, dtype_b = self.target, self.cfg, self.dtype_bytes
        ctx = self.context_len if context is None else context
        parts = target_weight_parts(t, cfg, dtype_b, keep_quantized=self.hw.kind == "gpu")
        tokens = batch * tokens_per_row  # on this rank
        tp = attention_tp(cfg)
        moe = moe_shape(t)
        weight_bytes = parts.layer_dense_bytes * t.num_hidden_layers + parts.head_bytes + parts.final_norm_bytes
        flops = 2 * parts.layer_dense_values * t.num_hidden_layers * tokens
        if moe:
            e, top_k = moe.num_experts, moe.experts_per_token
            routed = tokens * self.dp  # every attention-DP rank's tokens reach the experts
            active = expected_experts(e, top_k, routed) / cfg.moe_ep  # this rank holds 1/ep of them
            weight_bytes += t.num_hidden_layers * active * parts.expert_bytes  # (expert_bytes: a layer's average)
            values = 3 * t.hidden_size * moe.intermediate_size / cfg.moe_tp
            flops += 2 * values * routed * top_k / cfg.moe_ep * moe.sparse_layers
        flops += 2 * (parts.head_bytes / dtype_b) * tokens
        # Attention: K/V of the context, sliding layers only their window.
        kinds = layer_kinds(t)
        attended = kinds.full * ctx + kinds.sliding * min(ctx, kinds.window or 0)  # context tokens over all layers
        kv_heads = max(1, t.num_key_value_heads // tp)
        kv_b = KV_DTYPE_BYTES[kv_dtype(cfg, model_dtype(cfg, t.extra), t.extra)]
        kv_bytes = batch * attended * 2 * kv_heads * t.head_dim * kv_b
        if kinds.linear:  # a hybrid's linear layers read each row's state and write it back
            kv_bytes += 2 * batch * kinds.linear * Qwen3_5Params.from_config(t).state_bytes(dtype_b) / tp
        flops += 4 * (t.num_attention_heads // tp) * t.head_dim * attended * tokens
        overhead = self.hw.step_overhead_s + self.hw.layer_overhead_s * t.num_hidden_layers
        comm = self._collectives_s(t.num_hidden_layers, tokens, moe=moe is not None)
        return ForwardCost(weight_bytes + kv_bytes, flops, comm, overhead)

    def drafter_cost(self, batch: int, k: int, context: int | None = None) -> ForwardCost:
        """One DFlash forward: a block of K + 1 positions per row over its context cache, K scored positions."""
        d, t, cfg, dtype_b = self.drafter, self.target, self.cfg, self.dtype_bytes
        if d is None or k == 0:
            return ForwardCost(0.0, 0.0, 0.0, 0.0)
        ctx = self.context_len if context is None else context
        tp = attention_tp(cfg)
        block = batch * (k + 1)
        own = drafter_weight_bytes(d, t, cfg, dtype_b)
        head = target_weight_parts(t, cfg, dtype_b).head_bytes  # shared with the target, read again
        if self.draft_vocab_size:  # only the draft vocabulary's rows (0 or None: the whole head, as in EngineConfig)
            head *= min(self.draft_vocab_size, t.vocab_size) / t.vocab_size
        attended = ctx + k + 1
        d_kv = max(1, d.num_key_value_heads // tp)
        kv_bytes = batch * attended * 2 * d.num_hidden_layers * d_kv * d.head_dim * dtype_b
        # fc projects the target features of the block's tokens; the layers run on the block itself.
        flops = 2 * (own / dtype_b) * block + 2 * (head / dtype_b) * batch * k
        flops += 4 * (d.num_attention_heads // tp) * d.head_dim * attended * block * d.num_hidden_layers
        overhead = self.hw.layer_overhead_s * d.num_hidden_layers + self.hw.draft_overhead_s
        comm = self._collectives_s(d.num_hidden_layers, block, moe=False)
        return ForwardCost(own + head + kv_bytes, flops, comm, overhead)

    def step_time(self, batch: int, k: int, context: int | None = None) -> float:
        """Seconds for one step of `batch` rows on each rank at draft length k (0: plain decoding)."""
        return self.target_cost(batch, k + 1, context).time(self.hw) + self.drafter_cost(batch, k, context).time(self.hw)

    def breakdown(self, batch: int, k: int, context: int | None = None) -> dict:
        """Bytes, FLOPs, communication, overhead and time of the step's two forwards."""
        tc, dc = self.target_cost(batch, k + 1, context), self.drafter_cost(batch, k, context)
        return {"target": asdict(tc) | {"time_s": tc.time(self.hw)},
                "drafter": asdict(dc) | {"time_s": dc.time(self.hw)}}


@dataclass(frozen=True)
class ParetoPoint:
    concurrency: int  # requests in flight over all GPUs
    batch_size: int  # rows per rank (concurrency / attention-DP ranks, rounded up)
    draft_len: int
    tau: float
    step_time_s: float
    tok_s_user: float
    tok_s_gpu: float


def predict_pareto(model: PerfModel, tau_by_k: dict[int, float], concurrencies, gpus: int | None = None) -> list[ParetoPoint]:
    """Predicted (tok/s/user, tok/s/GPU) for every concurrency and every K in {0} and tau_by_k:
    tok/s/user = tau(K) / step time, tok/s/GPU = concurrency x tau(K) / step time / GPUs (tau(0) = 1)."""
    gpus = gpus or model.gpus
    points = []
    for c in concurrencies:
        b = math.ceil(c / model.dp)
        for k in [0, *sorted(tau_by_k)]:
            tau = 1.0 if k == 0 else tau_by_k[k]
            step = model.step_time(b, k)
            points.append(ParetoPoint(c, b, k, tau, step, tau / step, c * tau / step / gpus))
    return points


def schedule_batch_sizes(cfg: BuildConfig, graph_sizes: list[int]) -> list[int]:
    """Batch sizes (per rank) the schedule is chosen at and the plan predicts: the CUDA-graph sizes a GPU
    build pads every batch to, else every size up to max_batch_size (powers of two beyond 64)."""
    if graph_sizes:  # batches above the largest graph run eagerly: the largest batch is evaluated too
        return sorted(set(graph_sizes) | {1, cfg.max_batch_size})
    top = cfg.max_batch_size
    sizes = set(range(1, min(top, 64) + 1)) | {2**i for i in range(7, 20) if 2**i < top} | {top}
    return sorted(sizes)


@dataclass
class PerformancePlan:
    schedule: dict[int, int] | None  # the chosen schedule (auto) or the config's; {} = speculation never pays
    section: dict  # plan.json "performance"
    notes: list[str] = field(default_factory=list)  # for the build's notes


def plan_performance(
    target: DecoderConfig, drafter: DFlashConfig | None, cfg: BuildConfig, hw: HardwareProfile, max_draft_len: int,
    graph_sizes: list[int], draft_vocab_size: int | None = None,
) -> PerformancePlan:
    """Predicted step time and throughput per batch size and K for this build; with draft_len_schedule:
    auto, the schedule that maximises throughput at every batch size (draft_schedule.py)."""
    from dflash_trt.draft_schedule import choose_draft_len_schedule, expand

    model = PerfModel(target, drafter, cfg, hw, context_len=max(1, cfg.max_seq_len // 2), draft_vocab_size=draft_vocab_size)
    spec = cfg.speculative_config
    measured = dict(spec.acceptance_by_draft_len or {}) if spec is not None and drafter is not None else {}
    taus, alpha = fill_tau_table(measured, max_draft_len) if measured else ({}, None)
    sizes = schedule_batch_sizes(cfg, graph_sizes)
    steps = {(b, k): model.step_time(b, k) for b in sizes for k in range(0, max_draft_len + 1)}
    source, schedule = None, None
    if spec is not None and drafter is not None:
        if spec.draft_len_schedule == "auto":
            source = "auto"
            # a GPU build is served by TensorRT-LLM, whose DFlash must not draft K=0 (DRAFTING_STOPS)
            schedule = choose_draft_len_schedule(taus, lambda b, k: steps[(b, k)], sizes, max_draft_len,
                                                 min_draft_len=1 if hw.kind == "gpu" else 0)
        elif spec.draft_len_schedule:
            source, schedule = "config", dict(spec.draft_len_schedule)
    runs = schedule  # the table this machine's torch runtime takes (engine/llm_engine.py)
    without_amx = None if spec is None else spec.draft_len_schedule_without_amx
    if without_amx is not None and hw.kind == "cpu" and not has_amx_tiles():
        source, runs = "config (without AMX)", dict(without_amx)
    points = []
    for b in sizes:
        chosen = 0 if drafter is None or spec is None else max_draft_len if runs is None else expand(runs, b)
        for k in range(0, max_draft_len + 1):
            tau = 1.0 if k == 0 else taus.get(k)
            step = steps[(b, k)]
            c = b * model.dp
            points.append({
                "batch_size": b, "concurrency": c, "draft_len": k, "tau": tau, "step_time_s": step,
                "tok_s_user": None if tau is None else tau / step,
                "tok_s_gpu": None if tau is None else c * tau / step / model.gpus, "chosen": k == chosen,
            })
    section = {
        "model": "roofline, dflash_trt/perf_model.py (per rank; GPU figures are peak-based, so optimistic, and GPU "
                 "speedups read about 2x the published gpt-oss-120b ones: benchmarks/perf_model_vs_published.py)",
        "hardware": {key: getattr(hw, key) for key in ("mem_bandwidth_bytes_s", "dense_flops", "interconnect_bytes_s",
                                                       "interconnect_latency_s", "step_overhead_s", "layer_overhead_s",
                                                       "draft_overhead_s", "perf_source")},
        "context_len": model.context_len,
        "draft_vocab_size": draft_vocab_size,
        "gpus": model.gpus,
        "attention_dp_ranks": model.dp,
        "schedule_source": source,
        "acceptance_by_draft_len": taus or None,
        "measured_draft_lens": sorted(measured) or None,
        "acceptance_alpha": alpha,
        "points": points,
    }
    notes = _falling_tau_notes(measured) + _floor_notes(source, hw, schedule, sizes, taus, steps)
    return PerformancePlan(schedule, section, notes)


def _falling_tau_notes(measured: dict[int, float]) -> list[str]:
    """A measured tau below a shorter draft's: a longer draft accepts at least the shorter one's tokens, so one
    measurement is off. fill_tau_table keeps both as given (the table then falls there) and models the K it does not
    list past the shorter one at that one's tau or more."""
    notes = []
    for b in sorted(measured):
        a = max((k for k in measured if k < b), key=lambda k: (measured[k], -k), default=None)
        if a is not None and measured[b] < measured[a]:
            notes.append(f"speculative_config.acceptance_by_draft_len falls from K={a} (tau {measured[a]}) to K={b} "
                         f"(tau {measured[b]}): a longer draft accepts at least as many tokens, so one of them is off "
                         f"(too few prompts, another drafter or sampling); K={b} is planned at {measured[b]} as given, "
                         f"the K the table leaves out past {a} at {measured[a]} or more")
    return notes


def _floor_notes(source: str | None, hw: HardwareProfile, schedule: dict[int, int] | None, sizes: list[int],
                 taus: dict[int, float], steps: dict[tuple[int, int], float]) -> list[str]:
    """Where an auto GPU schedule drafts at a batch size whose every K >= 1 is predicted below plain decoding (a GPU
    build never drafts K=0 there: draft_schedule.DRAFTING_STOPS): the plan said "0 where drafting stops paying" and
    drafted at a loss without a word."""
    if source != "auto" or hw.kind != "gpu" or not schedule:
        return []
    from dflash_trt.draft_schedule import DRAFTING_STOPS, expand

    losses = {}  # batch size -> (its K, the share of plain decoding's throughput it loses)
    for b in sizes:
        k = expand(schedule, b)
        if k >= 1 and taus.get(k) and (ratio := taus[k] / steps[(b, k)] * steps[(b, 0)]) < 1:
            losses[b] = (k, 1 - ratio)
    if not losses:
        return []
    where = ", ".join(f"{b} (K={k}, {loss:.0%})" for b, (k, loss) in losses.items())
    return [f"draft_len_schedule auto: predicted below plain decoding's throughput at batch size"
            f"{'s' * (len(losses) > 1)} {where}, which a GPU build drafts at all the same: {DRAFTING_STOPS}"]
