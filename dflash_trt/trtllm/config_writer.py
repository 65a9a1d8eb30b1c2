"""Build config + plan -> the LLM-API options of trtllm/config.yaml (for `trtllm-serve --config` and
`tensorrt_llm.LLM(**options)`), checked against the pinned TensorRT-LLM version's accepted keys.

Paths inside are relative to the engine directory (speculative_model: drafter), so an engine can be
moved; the launcher runs TensorRT-LLM from the engine directory.
"""

from __future__ import annotations

import typing

import pydantic

from dflash_trt.config import BuildConfig
from dflash_trt.plan import MemoryPlan
from dflash_trt.trtllm.llm_api_keys import bad_values, unknown_keys

DRAFTER_SUBDIR = "drafter"


def _modeled_keys(key: str) -> set[str]:
    """The keys of the BuildConfig section `key` (a pydantic model, or an optional one), set or not; empty if none."""
    field = BuildConfig.model_fields.get(key)
    for kind in (field.annotation, *typing.get_args(field.annotation)) if field else ():
        if isinstance(kind, type) and issubclass(kind, pydantic.BaseModel):
            return set(kind.model_fields)
    return set()


def llm_api_options(cfg: BuildConfig, plan: MemoryPlan, has_experts: bool) -> dict:
    """The options dict; ValueError naming the key when something the pinned version rejects would be written."""
    opts: dict = {
        "dtype": plan.dtype,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "pipeline_parallel_size": cfg.pipeline_parallel_size,
        "enable_attention_dp": cfg.enable_attention_dp,
        # Pinned so TRT-LLM sizes the DFlash context arena and KV cache exactly as planned (issue #16005).
        "max_batch_size": cfg.max_batch_size,
        "max_seq_len": cfg.max_seq_len,
        "max_num_tokens": cfg.max_num_tokens,
    }
    kv = {"dtype": cfg.kv_cache_config.dtype, "free_gpu_memory_fraction": cfg.kv_cache_config.free_gpu_memory_fraction,
          "tokens_per_block": cfg.kv_cache_config.tokens_per_block}
    reuse = cfg.kv_cache_config.enable_block_reuse
    if reuse is None and cfg.speculative_config is not None:
        # Off unless asked for: TensorRT-LLM's DFlash keeps the drafter's context per request from the chunks it
        # prefills (_torch/speculative/dflash.py@00679c66 _store_prefill_context), so a prompt whose prefix came
        # from reused blocks drafts from a context without it, at shifted positions; NVIDIA's gpt-oss perf configs
        # turn reuse off too (tests/scripts/perf-sanity/aggregated/gpt_oss_120b_fp4_blackwell.yaml@06508c5f)
        reuse = False
    if reuse is not None:
        kv["enable_block_reuse"] = reuse
    opts["kv_cache_config"] = kv
    if has_experts:
        opts["moe_expert_parallel_size"] = cfg.moe_ep
        opts["moe_tensor_parallel_size"] = cfg.moe_tp
    spec = cfg.speculative_config
    if spec is not None:
        sc: dict = {
            "decoding_type": spec.decoding_type,
            "max_draft_len": plan.max_draft_len,
            "speculative_model": DRAFTER_SUBDIR,
        }
        # Written only off its default: TensorRT-LLM releases before the key (1.3.0rc20 among them, read in
        # llm_args.py: DFlash came before attention_backend) forbid unknown keys, so writing VANILLA there fails.
        if spec.attention_backend != "VANILLA":
            sc["attention_backend"] = spec.attention_backend
        if plan.draft_len_schedule:  # the plan's: the YAML's, or the one `auto` chose
            sc["draft_len_schedule"] = {int(b): int(k) for b, k in sorted(plan.draft_len_schedule.items())}
        if spec.max_concurrency is not None:
            sc["max_concurrency"] = spec.max_concurrency
        if spec.use_rejection_sampling:
            sc["use_rejection_sampling"] = True
        opts["speculative_config"] = sc
    if cfg.cuda_graph_config is not None:
        opts["cuda_graph_config"] = {
            "enable_padding": cfg.cuda_graph_config.enable_padding,
            "batch_sizes": plan.cuda_graph_batch_sizes,
        }
    else:
        # Left out, TensorRT-LLM captures graphs by default (TorchLlmArgs' cuda_graph_config default_factory, up
        # to max_batch_size or 128) that the plan did not size; null turns them off, as the plan assumes.
        opts["cuda_graph_config"] = None
    if cfg.moe_config is not None:
        opts["moe_config"] = {"backend": cfg.moe_config.backend}
    if cfg.attention_dp_config is not None:
        opts["attention_dp_config"] = cfg.attention_dp_config.model_dump()
    launcher_owned = sorted(set(cfg.trtllm_options) & {"model", "tokenizer"})
    if launcher_owned:
        raise ValueError(f"trtllm_options.{launcher_owned[0]}: set by the launcher from the engine directory (the "
                         "target and its tokenizer are the build's --target); remove it")
    for key, value in cfg.trtllm_options.items():
        ours = opts.get(key)
        if isinstance(value, dict):  # a section: the keys the build config models are set there (and checked there)
            clash = sorted(set(value) & (_modeled_keys(key) | set(ours if isinstance(ours, dict) else ())))
            if clash:
                raise ValueError(f"trtllm_options.{key}.{clash[0]}: set by the build config itself; set the "
                                 f"build-config key '{key}.{clash[0]}' instead")
        if key not in opts:
            opts[key] = value
        elif isinstance(ours, dict) and isinstance(value, dict):  # a section's keys the build config leaves unset
            opts[key] = {**ours, **value}
        else:
            raise ValueError(f"trtllm_options.{key}: set by the build config itself; set the build-config key "
                             f"{key!r} instead")
    bad = unknown_keys(opts)
    if bad:
        raise ValueError(
            f"trtllm_options: {', '.join(bad)} not accepted by the pinned TensorRT-LLM version "
            "(dflash_trt/trtllm/llm_api_keys.py)"
        )
    wrong = bad_values(opts)
    if wrong:
        raise ValueError(f"TensorRT-LLM would reject {', '.join(wrong)}")
    return opts
