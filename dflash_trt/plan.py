"""The memory plan of one build, per rank, against a hardware profile; a build that does not fit fails
here, with the numbers and the setting to change, before anything is converted.

Two layouts are modelled. On a GPU profile the engine serves through TensorRT-LLM, so the plan follows
its allocations: weights sharded by the parallel mapping (MXFP4 experts at 4.25 bits), the target KV
cache (every layer max_seq_len tokens: the targeted release pools sliding layers with full-context blocks too),
DFlash's dense drafter context arena [max_batch + 1 slots, drafter layers, max_ctx + K + 1, kv heads,
head_dim] x 2 (K and V) that TRT-LLM allocates at the drafter's first forward (issue #16005), after the KV
cache took free_gpu_memory_fraction of free memory, so in what that leaves; activations and CUDA-graph pools.
On the CPU profile it follows this project's torch runtime: per-row caches of max_seq_len + block + 1
tokens for every layer of both models. Activation sizes are estimates and are labelled so.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from dflash_trt.config import BuildConfig
from dflash_trt.engine.hybrid_cache import MAX_MARKS
from dflash_trt.hardware import GB, HardwareProfile, has_amx_tiles
from dflash_trt.models.config import DecoderConfig, Qwen3_5Params, is_hybrid, moe_shape
from dflash_trt.models.dflash import DFlashConfig
from dflash_trt.validate import attention_tp

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
# TensorRT-LLM's NVFP4 KV cache: a 4-bit value and, in a pool beside it, an FP8 scale per 16 values (its KV cache
# managers: kQuantBlockSizeNVFP4 = 16 and kScaleDtypeNVFP4 = FP8 in kvCacheManager.cpp; ceil(n / 2) + ceil(n / 16)
# bytes in kv_cache_manager_v2.py)
KV_DTYPE_BYTES = {**DTYPE_BYTES, "nvfp4": 9 / 16}
# a checkpoint's quantization_config.kv_cache_quant_algo (ModelOpt's), which TensorRT-LLM takes where the build's
# kv_cache_config.dtype is auto
_CHECKPOINT_KV_ALGOS = {"FP8": "fp8", "NVFP4": "nvfp4"}
MXFP4_BYTES_PER_VALUE = 17 / 32  # 4-bit values plus one 8-bit (E8M0) scale per 32-value block
# TensorRT-LLM's TRTLLM-gen MXFP4 MoE pads an expert's shapes and keeps its biases in fp32
# (_torch/modules/fused_moe/quantization.py@002366a4, MXFP4WeightTRTLLMGenFusedMoEMethod: weight_alignment 128,
# input_hidden_alignment 512, bias_dtype float32)
MXFP4_WEIGHT_ALIGNMENT, MXFP4_INPUT_HIDDEN_ALIGNMENT, MXFP4_BIAS_BYTES = 128, 512, 4
# TRT-LLM's cuda_graph_config field description: "each CUDA graph can use up to 200 MB of extra memory"
# (tensorrt_llm/llmapi/llm_args.py @0004396720054fd8e205cbf616f21f0b57c6b412). The plan takes the bound.
CUDA_GRAPH_BYTES = 200 * 10**6


def model_dtype(cfg: BuildConfig, target_raw: dict) -> str:
    """The engine's dtype: the build's; auto, the checkpoint's, but bfloat16 on the CPU (cpu_dtype_note)."""
    if cfg.dtype != "auto":
        return cfg.dtype
    raw = checkpoint_dtype(target_raw)
    return "bfloat16" if cfg.hardware == "cpu" else raw


def checkpoint_dtype(target_raw: dict) -> str:
    raw = target_raw.get("dtype") or target_raw.get("torch_dtype") or "bfloat16"
    return raw if raw in DTYPE_BYTES else "bfloat16"


def cpu_dtype_note(cfg: BuildConfig, target_raw: dict) -> str | None:
    """Why a CPU engine of a float16 or float32 checkpoint runs bfloat16 under `dtype: auto`: the CPU kernels take
    bfloat16, and float32 at twice the bytes a step reads; float16 runs through torch's ops. Measured on a small Mistral
    (own-model audit, 2026-12-06): float16 5.5x and float32 8x slower than bfloat16, and the build said nothing (vLLM's
    CPU backend casts float16 to bfloat16 too)."""
    raw = checkpoint_dtype(target_raw)
    if cfg.dtype != "auto" or cfg.hardware != "cpu" or raw not in ("float16", "float32"):
        return None
    why = "torch's ops, several times slower" if raw == "float16" else "twice the bytes a step reads, and slower"
    return (f"the target is stored in {raw}: this CPU engine runs bfloat16, its kernels' fast path ({raw}: {why}); "
            f"dtype: {raw} keeps {raw}")


def kv_dtype(cfg: BuildConfig, dtype: str, target_raw: dict) -> str:
    """The KV cache's dtype: the build's, else (auto) the quantized cache the checkpoint declares, else `dtype`."""
    if cfg.kv_cache_config.dtype != "auto":
        return cfg.kv_cache_config.dtype
    algo = (target_raw.get("quantization_config") or {}).get("kv_cache_quant_algo")
    return _CHECKPOINT_KV_ALGOS.get(str(algo).upper(), dtype) if cfg.hardware != "cpu" else dtype


def cuda_graph_batch_sizes(cfg: BuildConfig) -> list[int]:
    """The decode batch sizes TRT-LLM captures, by the rule its CudaGraphConfig documents; [] without graphs."""
    g = cfg.cuda_graph_config
    if g is None:
        return []
    if g.batch_sizes:
        sizes = sorted(set(g.batch_sizes))
    else:
        top = g.max_batch_size or 128
        if g.enable_padding:  # 1, 2, 4, then multiples of 8 to 128, then steps of 64
            sizes = [1, 2, 4] + list(range(8, 129, 8))
            while sizes[-1] + 64 <= top:
                sizes.append(sizes[-1] + 64)
        else:  # every size below 32, then 32, 64, 128 and powers of two
            sizes = list(range(1, 33)) + [64, 128]
            p = 256
            while p < top:
                sizes.append(p)
                p *= 2
        sizes = [s for s in sizes if s <= top]
        if sizes[-1] != top:
            sizes.append(top)
    schedule = cfg.speculative_config.draft_len_schedule if cfg.speculative_config else None
    if isinstance(schedule, dict):  # every threshold of the draft-length schedule gets its own graph ("auto":
        # the build resolves it first)
        sizes = sorted(set(sizes) | {b for b in schedule if b <= sizes[-1]})
    return sizes


@dataclass(frozen=True)
class LayerKinds:
    full: int  # full-attention layers
    sliding: int  # sliding-window layers
    window: int | None
    linear: int = 0  # linear-attention layers (a hybrid target's): a recurrent state a row, no K/V


def layer_kinds(t: DecoderConfig) -> LayerKinds:
    """The target's layers by what their attention keeps."""
    if is_hybrid(t):
        linear = Qwen3_5Params.from_config(t).linear_layers
        return LayerKinds(t.num_hidden_layers - linear, 0, None, linear)
    window = t.extra.get("sliding_window")
    types = t.extra.get("layer_types")
    if not window or not types:
        return LayerKinds(t.num_hidden_layers, 0, None)
    sliding = sum(1 for x in types[: t.num_hidden_layers] if x == "sliding_attention")
    return LayerKinds(t.num_hidden_layers - sliding, sliding, int(window))


def _kv_heads_per_rank(kv_heads: int, tp: int) -> int:
    # TP splits KV heads; with fewer heads than ranks each rank holds a replica of one head.
    return max(1, kv_heads // tp)


@dataclass(frozen=True)
class WeightParts:
    """Target weight bytes on one rank, by what a forward reads: the per-layer weights every token uses,
    the per-layer experts (only those a batch routes to are read), and the vocabulary matrices."""

    num_layers: int
    layer_dense_bytes: float  # attention, norms, router (+ the MLP of a dense model), one layer
    layer_dense_values: float  # their values (as many multiply-adds a token; FP8 ones a byte each)
    experts_per_rank: int  # 0 for a dense model
    expert_bytes: float  # one expert's share on this rank, with its biases, one layer
    embedding_bytes: float  # the input embedding (a gather: only the batch's rows are read)
    lm_head_bytes: float  # 0 when tied to the embedding (then the embedding is the head)
    final_norm_bytes: float

    @property
    def total(self) -> int:
        layer = self.layer_dense_bytes + self.experts_per_rank * self.expert_bytes
        return int(self.num_layers * layer + self.embedding_bytes + self.lm_head_bytes + self.final_norm_bytes)

    @property
    def head_bytes(self) -> float:
        """The output projection every scored position multiplies by."""
        return self.lm_head_bytes or self.embedding_bytes


def target_weight_parts(t: DecoderConfig, cfg: BuildConfig, dtype_b: int, keep_quantized: bool = True) -> WeightParts:
    """Target weights on one rank, by part; `keep_quantized=False` when the runtime dequantizes a quantized
    checkpoint's weights on load (this project's torch runtime does: MXFP4 experts, FP8 linears; TensorRT-LLM keeps
    them as stored). FP8 linears (quant_method fp8, or ModelOpt's FP8) kept take a byte a value (their scales, a
    block's or a channel's, a few thousandths of that); the embeddings, norms and router stay in the model's dtype."""
    quant = t.extra.get("quantization_config") or {}
    fp8 = keep_quantized and (quant.get("quant_method") == "fp8" or (quant.get("quant_method") == "modelopt"
                                                                    and quant.get("quant_algo") == "FP8"))
    linear_b = 1 if fp8 else dtype_b
    tp = attention_tp(cfg)
    h, hd = t.hidden_size, t.head_dim
    q_out = t.num_attention_heads * hd // tp
    kv_out = _kv_heads_per_rank(t.num_key_value_heads, tp) * hd
    dense = 2 * h * q_out + 2 * h * kv_out  # q, o; k, v
    small = 2 * h  # values outside the linears' weights (FP8 keeps them in the model's dtype): the layer's norms
    if t.attention_bias:
        small += q_out + 2 * kv_out + h  # o_proj's bias is replicated
    if t.qk_norm:
        small += 2 * hd
    if is_hybrid(t):
        # Qwen3.5: the attention layers' q_proj doubles as their output gate (and they norm q and k); the linear
        # layers hold their own mixer instead: per layer on average
        hybrid = Qwen3_5Params.from_config(t)
        share = hybrid.linear_layers / t.num_hidden_layers
        attention = 3 * h * q_out + 2 * h * kv_out
        dense += (hybrid.mixer_values(h) // tp) * share + attention * (1 - share) - 2 * h * q_out - 2 * h * kv_out
        small += 2 * hd * (1 - share)
        if hybrid.experts is not None:  # Qwen3.5-MoE's shared expert and its gate, beside the routed ones
            dense += 3 * h * hybrid.shared_expert_intermediate // tp
            small += h
    if t.model_type == "gpt_oss":
        small += t.num_attention_heads // tp  # attention sinks, one per head
    moe = moe_shape(t)
    per_rank, one_expert = 0, 0.0
    if moe:
        e, i = moe.num_experts, moe.intermediate_size
        per_rank = e // cfg.moe_ep
        if quant.get("quant_method") == "mxfp4" and keep_quantized:
            one_expert = mxfp4_expert_bytes(h, i // cfg.moe_tp)
        else:
            one_expert = 3 * h * i / cfg.moe_tp * linear_b  # gate_up [h, 2i] and down [i, h], this rank's share
            one_expert += (2 * i // cfg.moe_tp + h) * dtype_b if moe.biases else 0  # its biases
        # per layer on average where only some layers route (Qwen3-MoE's mlp_only_layers): the sparse ones' router
        # (replicated) and experts, the others' dense MLP
        share = moe.sparse_layers / t.num_hidden_layers
        small += (h * e + (e if moe.biases else 0)) * share
        dense += 3 * h * t.intermediate_size // tp * (1 - share)
        one_expert *= share
    else:
        dense += 3 * h * t.intermediate_size // tp
    vocab = t.vocab_size * h // tp * dtype_b
    return WeightParts(
        num_layers=t.num_hidden_layers, layer_dense_bytes=dense * linear_b + small * dtype_b,
        layer_dense_values=dense + small, experts_per_rank=per_rank,
        expert_bytes=one_expert, embedding_bytes=vocab, lm_head_bytes=0 if t.tie_word_embeddings else vocab,
        final_norm_bytes=h * dtype_b,
    )


def mxfp4_expert_bytes(h: int, i: int) -> int:
    """One MXFP4 expert of hidden size h and (this rank's) intermediate size i as TensorRT-LLM holds it: gate_up
    [2i, h] and down [h, i], padded (MXFP4_*_ALIGNMENT), their scales, and fp32 biases."""
    pad = lambda n, to: -(-n // to) * to  # noqa: E731
    i_p, h_out = pad(i, MXFP4_WEIGHT_ALIGNMENT), pad(h, MXFP4_WEIGHT_ALIGNMENT)
    h_in = pad(h, MXFP4_INPUT_HIDDEN_ALIGNMENT)
    values = 2 * i_p * h_in + h_out * i_p
    return int(values * MXFP4_BYTES_PER_VALUE) + (2 * i_p + h_out) * MXFP4_BIAS_BYTES


def drafter_weight_bytes(d: DFlashConfig, target: DecoderConfig, cfg: BuildConfig, dtype_b: int) -> int:
    """Bytes of drafter weights on one rank (it shares the target's embedding and LM head)."""
    tp = attention_tp(cfg)
    h, hd = d.hidden_size, d.head_dim
    q_out = d.num_attention_heads * hd // tp
    kv_out = _kv_heads_per_rank(d.num_key_value_heads, tp) * hd
    layer = 2 * h * q_out + 2 * h * kv_out + 3 * h * d.intermediate_size // tp + 2 * h + 2 * hd
    if d.attention_bias:
        layer += q_out + 2 * kv_out + h
    fc = len(d.target_layer_ids) * target.hidden_size * h  # fc and the norms are replicated on every rank
    return int((d.num_hidden_layers * layer + fc + 2 * h) * dtype_b)


@dataclass
class MemoryPlan:
    hardware: dict
    layout: str  # "trtllm" (GPU profiles) or "torch" (the CPU runtime)
    dtype: str
    kv_cache_dtype: str
    world_size: int
    attention_tp: int
    moe_expert_parallel_size: int
    moe_tensor_parallel_size: int
    max_batch_size_per_rank: int
    max_seq_len: int
    max_draft_len: int  # K (0 for an engine without a drafter)
    draft_len_schedule: dict | None
    cuda_graph_batch_sizes: list[int]
    components: dict[str, int]  # bytes per rank
    details: dict  # the per-token figures behind the components
    memory_bytes: int
    kv_cache_budget_bytes: int
    fits: bool
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Predicted step time and throughput by batch size and K (perf_model.plan_performance); None if not made.
    performance: dict | None = None
    draft_len_schedule_without_amx: dict | None = None  # the torch runtime's on CPUs without AMX tiles

    @property
    def total_bytes(self) -> int:
        return sum(self.components.values())

    def to_dict(self) -> dict:
        d = asdict(self)
        d["total_bytes"] = self.total_bytes
        return d


def _components(t, d, cfg, hw, k, batch, seq, dtype, kvd) -> tuple[dict[str, int], dict]:
    dtype_b, kv_b = DTYPE_BYTES[dtype], KV_DTYPE_BYTES[kvd]
    tp = attention_tp(cfg)
    trtllm = hw.kind == "gpu"
    kv_heads = _kv_heads_per_rank(t.num_key_value_heads, tp)
    per_token_layer = math.ceil(2 * kv_heads * t.head_dim * kv_b)  # K and V of one token in one layer
    kinds = layer_kinds(t)
    full, sliding, window = kinds.full, kinds.sliding, kinds.window
    details: dict = {"target_kv_bytes_per_token_per_layer": per_token_layer}
    # a step's verify queries a row as this runtime sizes for them (engine/model_runner.py): a drafter block, or a
    # larger draft tree's nodes and its root (TensorRT-LLM drafts no trees)
    spec = cfg.speculative_config
    trees = [*(spec.draft_tree or {}).values(), *(spec.draft_tree_without_amx or {}).values()] \
        if spec and not trtllm else []
    queries = max(d.block_size, max(trees, default=0) + 1) if d is not None else 1
    if trtllm:
        # TensorRT-LLM through the targeted release puts every layer of a model with mixed layer_types in one pool of
        # full-context blocks (NVIDIA/TensorRT-LLM PR #18767, merged 2026-09-06, derives per-layer windows; before it
        # only a hand-set kv_cache_config.max_attention_window did): a sliding layer holds max_seq_len tokens too
        sliding_tokens = seq if window else 0
        target_kv = batch * per_token_layer * (full * seq + sliding * sliding_tokens)
        details.update(full_attention_layers=full, sliding_layers=sliding, sliding_tokens_per_seq=sliding_tokens)
    else:
        # room past a row's last position for a step's verify queries, as the runtime keeps it
        target_kv = batch * per_token_layer * (full + sliding) * (seq + queries + 1)
    parts = target_weight_parts(t, cfg, dtype_b, keep_quantized=trtllm)
    comps = {
        "target_weights": parts.total,
        "target_kv_cache": int(target_kv),
    }
    if kinds.linear:
        # A hybrid target's linear layers: each row's state after each of a step's verify queries and after its last
        # prompt chunks, as this runtime keeps them (engine/hybrid_cache.py); TensorRT-LLM's own cache manager holds
        # them its way
        snapshots = queries + MAX_MARKS
        per_row = kinds.linear * snapshots * Qwen3_5Params.from_config(t).state_bytes(dtype_b)
        comps["target_recurrent_states"] = batch * per_row // tp
        details.update(linear_attention_layers=kinds.linear, state_snapshots_per_row=snapshots)
    if d is not None:
        comps["drafter_weights"] = drafter_weight_bytes(d, t, cfg, dtype_b)
        d_heads = _kv_heads_per_rank(d.num_key_value_heads, tp)
        d_token = 2 * d.num_hidden_layers * d_heads * d.head_dim * dtype_b  # all drafter layers, K and V
        if trtllm:
            slots, tokens = batch + 1, min(seq, d.max_position_embeddings) + k + 1  # +1 slot: CUDA-graph dummy
        else:
            slots, tokens = batch, seq + d.block_size + 1
        comps["drafter_context_cache"] = slots * tokens * d_token
        details.update(drafter_ctx_bytes_per_token=d_token, drafter_ctx_slots=slots, drafter_ctx_tokens_per_slot=tokens)
        if trtllm and not cfg.enable_attention_dp:
            # one-model DFlash without attention DP gets a KV cache manager of its own, which takes a share of the KV
            # budget by bytes per token (_torch/pyexecutor/_util.py: _should_create_separate_draft_kv_cache,
            # _compute_draft_budget_shares), in the drafter's dtype
            details.update(target_kv_bytes_per_token=per_token_layer * (full + sliding),
                           draft_kv_bytes_per_token=d_token)
    if not trtllm:
        # The CPU runtime packs every projection and the head (layers/linear.py): oneDNN's copy beside the bf16
        # kernel's (one more in AMX's tile order), plus int8 copies of the head (its greedy screen) and of the drafter's
        # tables. Left out, an 8B-wide engine planned 6.75 GB ran at 7 GB resident, and Qwen3-8B "fit" in 25 GB.
        head = t.vocab_size * t.hidden_size
        drafter = comps.get("drafter_weights", 0)
        projections = parts.num_layers * parts.layer_dense_bytes + head * dtype_b + drafter
        comps["packed_weight_copies"] = int(projections * (2 if has_amx_tiles() else 1) + head + drafter / 2)
    # Activations (estimate): per token in flight, the residual streams, q/k/v, MLP intermediates
    # (top-k experts for MoE), plus fp32 logits for every verified and drafted position.
    moe = moe_shape(t)
    i_rank = moe.intermediate_size // cfg.moe_tp if moe else t.intermediate_size // tp
    fanout = moe.experts_per_token if moe else 1
    per_tok = (4 * t.hidden_size + (t.num_attention_heads // tp + 2 * kv_heads) * t.head_dim + 3 * i_rank * fanout)
    tokens = min(cfg.max_num_tokens, batch * seq) if trtllm else batch * seq
    # TensorRT-LLM's steps hold at most max_num_tokens tokens, verified drafts included
    verified = min(batch * (k + 1), cfg.max_num_tokens) if trtllm else batch * (k + 1)
    logits = verified * t.vocab_size * 4 * (2 if d is not None else 1)
    comps["activations_estimate"] = int(tokens * per_tok * dtype_b + logits)
    details["activation_tokens"] = tokens
    comps["cuda_graph_pools"] = len(cuda_graph_batch_sizes(cfg)) * CUDA_GRAPH_BYTES if trtllm else 0
    comps["runtime_reserve"] = hw.reserve_bytes
    return comps, details


_AFTER_THE_REST = ("target_kv_cache", "drafter_context_cache")  # TensorRT-LLM's allocations, in this order


def _free_for_kv(comps: dict[str, int], hw: HardwareProfile) -> int:
    """What a GPU holds when TensorRT-LLM carves its KV cache: everything but the allocations made at or after it."""
    return hw.memory_bytes - sum(v for key, v in comps.items() if key not in _AFTER_THE_REST)


def _fits(comps: dict[str, int], details: dict, hw: HardwareProfile, cfg: BuildConfig) -> tuple[bool, int]:
    """Whether it fits, and what the target's KV cache may use."""
    if hw.kind != "gpu":
        free = hw.memory_bytes - sum(v for key, v in comps.items() if key != "target_kv_cache")
        return free > 0 and comps["target_kv_cache"] <= free, free
    # TRT-LLM gives the KV cache free_gpu_memory_fraction of what is left after everything else, except DFlash's
    # context arena: the drafter allocates it lazily, at its first forward, after the KV pool is carved, so it must
    # fit in the rest (dflash.py `_check_ctx_arena_fits`; a newer path binds it to the draft KV pool, falling back
    # to this private arena when that pool's dtype is not the drafter's: an fp8 cache with a bf16 drafter).
    arena = comps.get("drafter_context_cache", 0)
    free = _free_for_kv(comps, hw)
    budget = int(free * cfg.kv_cache_config.free_gpu_memory_fraction)
    target_budget = budget * target_kv_share(details)
    return free > 0 and comps["target_kv_cache"] <= target_budget and arena <= free - budget, int(target_budget)


def target_kv_share(details: dict) -> float:
    """The target's share of TensorRT-LLM's KV budget: all of it, unless the drafter's KV cache manager takes its
    share by bytes per token."""
    draft = details.get("draft_kv_bytes_per_token", 0)
    return 1.0 if not draft else details["target_kv_bytes_per_token"] / (details["target_kv_bytes_per_token"] + draft)


def _largest_fitting(lo: int, hi: int, ok) -> int:
    """The largest v in [lo, hi] with ok(v), assuming ok is monotone; lo - 1 when none."""
    best = lo - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if ok(mid):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def plan_build(
    target: DecoderConfig, drafter: DFlashConfig | None, cfg: BuildConfig, hw: HardwareProfile, max_draft_len: int
) -> MemoryPlan:
    dtype = model_dtype(cfg, target.extra)
    kvd = kv_dtype(cfg, dtype, target.extra)
    batch, seq, k = cfg.max_batch_size, cfg.max_seq_len, max_draft_len
    comps, details = _components(target, drafter, cfg, hw, k, batch, seq, dtype, kvd)
    fits, budget = _fits(comps, details, hw, cfg)
    schedule = cfg.speculative_config.draft_len_schedule if cfg.speculative_config else None
    without_amx = cfg.speculative_config.draft_len_schedule_without_amx if cfg.speculative_config else None
    plan = MemoryPlan(
        hardware=hw.to_dict(), layout="trtllm" if hw.kind == "gpu" else "torch", dtype=dtype, kv_cache_dtype=kvd,
        world_size=cfg.world_size, attention_tp=attention_tp(cfg), moe_expert_parallel_size=cfg.moe_ep,
        moe_tensor_parallel_size=cfg.moe_tp, max_batch_size_per_rank=batch, max_seq_len=seq, max_draft_len=k,
        draft_len_schedule=dict(sorted(schedule.items())) if isinstance(schedule, dict) else None,
        cuda_graph_batch_sizes=cuda_graph_batch_sizes(cfg), components=comps, details=details,
        memory_bytes=hw.memory_bytes, kv_cache_budget_bytes=budget, fits=fits,
        draft_len_schedule_without_amx=dict(sorted(without_amx.items())) if without_amx is not None else None,
    )
    if note := cpu_dtype_note(cfg, target.extra):
        plan.notes.append(note)
    if seq > target.max_position_embeddings:
        plan.problems.append(
            f"max_seq_len={seq} exceeds the target's max_position_embeddings={target.max_position_embeddings}; "
            "lower max_seq_len"
        )
        plan.fits = False
    if drafter is not None and seq > drafter.max_position_embeddings:
        plan.notes.append(
            f"max_seq_len={seq} exceeds the drafter's max_position_embeddings={drafter.max_position_embeddings}: "
            "TensorRT-LLM drafts nothing for requests past it"
        )
    if (share := target_kv_share(details)) < 1:
        plan.notes.append(f"TensorRT-LLM gives the drafter a KV cache manager of its own (one-model DFlash without "
                          f"attention data parallelism), with {1 - share:.0%} of the KV budget by bytes per token: "
                          f"the target's KV cache may use {budget / GB:.2f} GB")
    if kvd == "nvfp4":
        _check_nvfp4_kv(plan, target, hw)
    if cfg.enable_attention_dp and isinstance(schedule, dict) and len(set(schedule.values())) > 1:
        plan.notes.append(
            f"draft_len_schedule={dict(sorted(schedule.items()))} under attention data parallelism: TensorRT-LLM "
            "picks K from each rank's own batch (no cross-rank agreement, a known issue in NVIDIA/TensorRT-LLM PR "
            "#16888), so ranks near a schedule key may draft different K and pad to CUDA graphs of other sizes; "
            "check on the device, or draft one K"
        )
    if hw.kind == "gpu" and cfg.max_num_tokens < k + 1:
        plan.problems.append(
            f"max_num_tokens={cfg.max_num_tokens} is below the {k + 1} tokens one request verifies a step "
            f"(max_draft_len={k}): TensorRT-LLM could schedule no decoding request; raise max_num_tokens"
        )
        plan.fits = False
    elif hw.kind == "gpu" and batch * (k + 1) > cfg.max_num_tokens:
        plan.notes.append(
            f"max_batch_size={batch} with max_draft_len={k} verifies {batch * (k + 1)} tokens a step, past "
            f"max_num_tokens={cfg.max_num_tokens}: TensorRT-LLM schedules at most {cfg.max_num_tokens // (k + 1)} "
            "decoding requests a step; raise max_num_tokens or lower max_batch_size"
        )
    if not fits:
        plan.problems.append(_explain(plan, target, drafter, cfg, hw, dtype, kvd))
    return plan


def _check_nvfp4_kv(plan: MemoryPlan, target: DecoderConfig, hw: HardwareProfile) -> None:
    if not hw.supports_nvfp4:  # auto on a checkpoint that declares an NVFP4 KV cache (an explicit nvfp4 is refused)
        plan.problems.append(f"the checkpoint declares an NVFP4 KV cache (quantization_config.kv_cache_quant_algo), "
                             f"which needs FP4 tensor cores (Blackwell: b300); hardware {hw.name}: set "
                             "kv_cache_config.dtype to fp8")
        plan.fits = False
    if target.head_dim & (target.head_dim - 1):
        # TensorRT-LLM's K/V preprocessing: "Head size needs to be power of 2 for nvfp4 kv cache"
        plan.problems.append(f"kv_cache_config.dtype=nvfp4 needs a power-of-two head_dim (TensorRT-LLM's FP4 K/V "
                             f"kernels); the target's is {target.head_dim}: use fp8")
        plan.fits = False
    algo = (target.extra.get("quantization_config") or {}).get("kv_cache_quant_algo")
    if str(algo).upper() != "NVFP4":
        plan.notes.append("kv_cache_config.dtype=nvfp4 on a checkpoint that declares no NVFP4 KV cache "
                          "(quantization_config.kv_cache_quant_algo): TensorRT-LLM documents the NVFP4 KV cache for "
                          "checkpoints ModelOpt quantized offline, whose KV scales it reads; check the answers' "
                          "accuracy, or use fp8")


def _explain(plan, target, drafter, cfg, hw, dtype, kvd) -> str:
    comps = plan.components
    gb = lambda b: f"{b / GB:.2f} GB"  # noqa: E731
    parts = ", ".join(f"{key} {gb(v)}" for key, v in sorted(comps.items(), key=lambda kv: -kv[1]) if v)
    head = (
        f"the build does not fit {hw.name} ({gb(hw.memory_bytes)} per device): each rank needs {gb(plan.total_bytes)} "
        f"({parts}); the KV cache may use {gb(max(plan.kv_cache_budget_bytes, 0))}"
    )

    def fits_with(batch: int, seq: int) -> bool:
        c, d = _components(target, drafter, cfg, hw, plan.max_draft_len, batch, seq, dtype, kvd)
        return _fits(c, d, hw, cfg)[0]

    hints = []
    # never past the target's positions, which max_seq_len may not exceed anyway (a problem of its own)
    longest = min(cfg.max_seq_len, target.max_position_embeddings)
    best_batch = _largest_fitting(1, cfg.max_batch_size, lambda b: fits_with(b, longest))
    if best_batch >= 1:
        hints.append(f"max_batch_size <= {best_batch} fits at max_seq_len={longest}")
    best_seq = _largest_fitting(2, longest, lambda s: fits_with(cfg.max_batch_size, s))
    if best_seq >= 2:
        hints.append(f"max_seq_len <= {best_seq} fits at max_batch_size={cfg.max_batch_size}")
    after = _AFTER_THE_REST if plan.layout == "trtllm" else ("target_kv_cache",)  # the arena: TensorRT-LLM's, after
    fixed = [key for key in comps if key != "runtime_reserve" and key not in after]
    arena = comps.get("drafter_context_cache", 0)
    fraction = cfg.kv_cache_config.free_gpu_memory_fraction
    free = _free_for_kv(comps, hw)
    left = free - int(free * fraction)  # what the KV cache's carve (the drafter's KV share in it too) leaves the arena
    knob_first = ""
    if sum(comps[key] for key in fixed) + comps["runtime_reserve"] >= hw.memory_bytes:
        # allocated before the KV cache, these alone overflow the device
        biggest = max(fixed, key=comps.get)
        culprit = f"Before the KV cache, the rest alone overflows the device, most of it {biggest}"
    elif plan.layout == "trtllm" and arena > left:
        biggest = "drafter_context_cache"
        # a lower fraction leaves the arena more only where the KV cache still fits in what it then gets
        if comps["target_kv_cache"] <= plan.kv_cache_budget_bytes:
            knob_first = "kv_cache_config.free_gpu_memory_fraction (lower), "
        culprit = (f"The drafter's context arena ({gb(arena)}) is allocated after the KV cache took "
                   f"free_gpu_memory_fraction={fraction} of free memory, and overflows the {gb(left)} that leaves")
    else:
        culprit = "The KV cache (target_kv_cache) overflows what the rest leaves"
        biggest = "target_kv_cache"
    # the torch runtime's activations grow with max_batch_size x max_seq_len; only TensorRT-LLM's with max_num_tokens
    activations = "max_num_tokens or max_batch_size" if plan.layout == "trtllm" else "max_seq_len or max_batch_size"
    knob = {
        "target_weights": "tensor_parallel_size / moe_expert_parallel_size (more ranks) or a smaller dtype",
        "drafter_context_cache": "max_seq_len or max_batch_size (the drafter arena is dense: "
                                 "slots x max_seq_len, TRT-LLM issue #16005), or tensor_parallel_size",
        "target_kv_cache": ("" if kvd in ("fp8", "nvfp4") else "kv_cache_config.dtype (fp8), ")
                           + "max_seq_len or max_batch_size",
        "activations_estimate": activations,
        "cuda_graph_pools": "cuda_graph_config.max_batch_size",
        "drafter_weights": "tensor_parallel_size",
    }.get(biggest, "max_batch_size")
    if not hints:
        hints.append("no batch size or sequence length fits; more ranks or a bigger device are needed")
    return f"{head}. {culprit}: change {knob_first}{knob}. " + "; ".join(hints) + "."
