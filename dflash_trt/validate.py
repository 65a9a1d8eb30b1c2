"""Checks that run before any heavy work: does the drafter fit the target, does the parallel mapping
divide the model, and which K the engine will run. Errors name the build-config key or checkpoint key."""

from __future__ import annotations

import logging

from dflash_trt.config import BuildConfig
from dflash_trt.layers.rotary import SUPPORTED_ROPE_TYPES
from dflash_trt.models.config import DecoderConfig, Qwen3_5Params, is_hybrid, moe_shape
from dflash_trt.models.dflash import DFlashConfig
from dflash_trt.models.weights import CheckpointError
from dflash_trt.spec.draft_tree import check_tree_nodes

logger = logging.getLogger(__name__)


def check_pairing(target: DecoderConfig, drafter: DFlashConfig, cfg: BuildConfig, drafter_source: str) -> int:
    """Raise ValueError when `drafter` cannot serve `target` under `cfg`; return the resolved K."""
    try:
        drafter.check_pairing(target, drafter_source)
    except CheckpointError as e:
        raise ValueError(f"bad target-drafter pairing: {e}") from None
    rope = drafter.rope.get("rope_type", "default")
    if rope not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{drafter_source}: rope_type={rope!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    # the type and the base frequency: scaling details differ between genuine pairs (z-lab's gpt-oss drafter leaves
    # YaRN's truncate unset where the target sets it false)
    differ = [k for k in ("rope_theta", "rope_type") if drafter.rope.get(k) != target.rope.get(k)]
    if differ:
        # z-lab's drafters rotate with their own RoPE whatever the target's, and some ship so (Qwen3.6's YaRN drafter)
        ours = ", ".join(f"{k}={drafter.rope.get(k)!r}" for k in differ)
        theirs = ", ".join(f"{k}={target.rope.get(k)!r}" for k in differ)
        logger.warning("%s: %s where the target uses %s: the drafter rotates its context with its own RoPE, as "
                       "z-lab's does; a drafter trained for another target would accept little", drafter_source, ours,
                       theirs)
    spec = cfg.speculative_config
    assert spec is not None, "check_pairing is only called for speculative builds"
    limit = drafter.block_size - 1
    k = spec.max_draft_len if spec.max_draft_len is not None else limit
    if k > limit:
        raise ValueError(
            f"speculative_config.max_draft_len={k}: draft_block_size={drafter.block_size} (checkpoint) allows "
            f"max_draft_len <= {limit}; lower max_draft_len"
        )
    schedule = spec.draft_len_schedule
    if schedule is not None and (schedule[min(schedule)] != k or max(schedule.values()) > k):
        raise ValueError(f"speculative_config.draft_len_schedule={schedule} must start at max_draft_len={k} and never "
                         "exceed it")
    # this runtime's table alone (TensorRT-LLM never reads it): one row may draft less than K there
    schedule = spec.draft_len_schedule_without_amx
    if schedule is not None and max(schedule.values()) > k:
        raise ValueError(f"speculative_config.draft_len_schedule_without_amx={schedule} must never exceed "
                         f"max_draft_len={k}")
    for key in ("draft_tree", "draft_tree_without_amx"):
        tree = getattr(spec, key) or {}
        check_tree_nodes(max(tree.values(), default=0), f"speculative_config.{key}={tree}")
    if spec.lookup_nodes > limit:
        raise ValueError(
            f"speculative_config.lookup_nodes={spec.lookup_nodes}: a context lookup branch is at most "
            f"{limit} tokens deep (draft_block_size={drafter.block_size}, checkpoint)"
        )
    past = sorted(key for key in spec.acceptance_by_draft_len or {} if key > limit)
    if past:  # no run of this drafter drafts that many, so the figure is another drafter's, or a typo
        raise ValueError(
            f"speculative_config.acceptance_by_draft_len has K={past}, past what this drafter drafts "
            f"(K <= {limit}: draft_block_size={drafter.block_size}, checkpoint)"
        )
    return k


def attention_tp(cfg: BuildConfig) -> int:
    """Ranks that split one attention layer's heads (1 under attention data parallelism)."""
    return 1 if cfg.enable_attention_dp else cfg.tensor_parallel_size


def check_mapping(target: DecoderConfig, drafter: DFlashConfig | None, cfg: BuildConfig) -> None:
    """Raise ValueError when the parallel mapping cannot split the models."""
    tp = attention_tp(cfg)
    models = [("target", target.num_attention_heads, target.num_key_value_heads)]
    if drafter is not None:
        models.append(("drafter", drafter.num_attention_heads, drafter.num_key_value_heads))
    for name, heads, kv in models:
        if heads % tp:
            raise ValueError(
                f"tensor_parallel_size={tp}: the {name}'s num_attention_heads={heads} is not divisible by it; "
                f"choose a tensor_parallel_size that divides {heads} (or enable_attention_dp)"
            )
        if kv % tp and tp % kv:
            raise ValueError(
                f"tensor_parallel_size={tp}: the {name}'s num_key_value_heads={kv} neither divides nor is divisible by it"
            )
    if is_hybrid(target):  # the linear layers' heads split across the same ranks
        hybrid = Qwen3_5Params.from_config(target)
        for key, heads in (("linear_num_key_heads", hybrid.key_heads), ("linear_num_value_heads", hybrid.value_heads)):
            if heads % tp:
                raise ValueError(f"tensor_parallel_size={tp}: the target's {key}={heads} is not divisible by it; "
                                 f"choose a tensor_parallel_size that divides {heads} (or enable_attention_dp)")
    moe = moe_shape(target)
    if moe:
        if moe.num_experts % cfg.moe_ep:
            raise ValueError(
                f"moe_expert_parallel_size={cfg.moe_ep}: the target's {moe.num_experts} experts are not divisible by it"
            )
        if moe.intermediate_size % cfg.moe_tp:
            raise ValueError(
                f"moe_tensor_parallel_size={cfg.moe_tp}: the expert intermediate_size={moe.intermediate_size} is "
                "not divisible by it"
            )
    elif cfg.moe_expert_parallel_size not in (None, 1) or cfg.moe_config is not None:
        raise ValueError(
            f"moe_expert_parallel_size / moe_config are set but the target ({target.architecture}) has no experts"
        )
