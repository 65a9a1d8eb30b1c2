"""A hand-written description of what TensorRT-LLM accepts, for checking what dflash-trt writes and runs.

Written from reading NVIDIA/TensorRT-LLM (not copied, and not derived from this project's own key lists in
dflash_trt/trtllm/llm_api_keys.py, so the tests that use it are not circular):

- tensorrt_llm/llmapi/llm_args.py @ 0004396720054fd8e205cbf616f21f0b57c6b412 (main after PR #16914, 1.3.0rc25 or later):
  `BaseLlmArgs` / `TorchLlmArgs` (model_config extra="forbid": an unknown top-level key is a validation error),
  `DecodingBaseConfig` + `DFlashDecodingConfig`, `KvCacheConfig`, `DecodeCudaGraphConfig` (`CudaGraphConfig`),
  `MoeConfig`, `AttentionDpConfig` (all `StrictBaseModel`: unknown keys rejected);
  validators mirrored: `validate_draft_len_schedule_and_sort` (batch size >= 1, K >= 0, the smallest key's K ==
  max_draft_len, no K above max_draft_len), max_concurrency XOR draft_len_schedule, `KvCacheConfig.validate_dtype`,
  `free_gpu_memory_fraction` in [0, 1], `validate_base_cuda_graph_config` (max_batch_size == max(batch_sizes)
  when both are given), `AttentionDpConfig` iteration counts >= 0 with balance on,
  `TorchLlmArgs.validate_speculative_config` ("DFlash max_draft_len must be > 0"), env_overrides coerced to str.
- tensorrt_llm/_torch/speculative/utils.py `get_draft_len_for_batch_size` (the one-model path DFlash uses):
  a batch of b rows runs the K of the smallest schedule key >= b; above the largest key, K = 0.
- tensorrt_llm/_torch/models/modeling_dflash.py @ 009d8fa4 and _torch/speculative/dflash.py @ 00679c66: the
  drafter's config.json is read for `dflash_config.mask_token_id`, `dflash_config.target_layer_ids`, top-level
  `block_size`, `architectures` / `model_type`; the worker refuses max_draft_len + 1 > block_size.
- tensorrt_llm/commands/serve.py @ 00209af149e7774406881a37283dce303571eb11 (`trtllm-serve serve`): its click options.

Field types are pydantic's lax mode, as TensorRT-LLM's are. Only the sections this project can write are modelled
field by field; the others are listed by name so an unknown key is still caught.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import (AliasChoices, BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, create_model,
                      field_validator, model_validator)

TRTLLM_COMMIT = "0004396720054fd8e205cbf616f21f0b57c6b412"


class _Forbid(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DFlashSpec(_Forbid):
    """DecodingBaseConfig's fields and DFlashDecodingConfig's own."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    # DecodingBaseConfig
    max_draft_len: Optional[NonNegativeInt] = None
    max_total_draft_tokens: Optional[int] = None
    speculative_model: Optional[Union[str, Path]] = Field(
        default=None, validation_alias=AliasChoices("speculative_model", "speculative_model_dir"))
    max_concurrency: Optional[PositiveInt] = None
    draft_len_schedule: Optional[dict[int, int]] = None
    load_format: Optional[str] = None
    acceptance_rate_window_size: Optional[NonNegativeInt] = None
    acceptance_rate_threshold: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    use_rejection_sampling: bool = False
    allow_advanced_sampling: bool = False  # deprecated no-op
    advanced_sampling_mode: Literal["full", "no_topk", "no_topp", "no_topk_no_topp"] = "full"
    enable_penalty: bool = False
    # DFlashDecodingConfig
    mask_token_id: Optional[int] = None
    target_layer_ids: Optional[list[int]] = None
    decoding_type: Literal["DFlash"] = "DFlash"
    attention_backend: Literal["VANILLA", "TRTLLM"] = "VANILLA"

    @model_validator(mode="after")
    def _schedule(self):
        s = self.draft_len_schedule
        if s is not None:
            for b, k in s.items():
                if b < 1:
                    raise ValueError(f"draft_len_schedule: batch size threshold must be >= 1, got {b}")
                if k < 0:
                    raise ValueError(f"draft_len_schedule: draft length must be >= 0, got {k}")
            if self.max_draft_len is not None:
                if s[min(s)] != self.max_draft_len:
                    raise ValueError(f"draft_len_schedule[{min(s)}] must equal max_draft_len={self.max_draft_len}")
                if max(s.values()) > self.max_draft_len:
                    raise ValueError("draft_len_schedule: all draft lengths must be <= max_draft_len")
        if self.max_concurrency is not None and s is not None:
            raise ValueError("max_concurrency and draft_len_schedule are mutually exclusive")
        if not self.max_draft_len:  # TorchLlmArgs.validate_speculative_config
            raise ValueError("DFlash max_draft_len must be > 0")
        return self


class KvCache(_Forbid):
    enable_block_reuse: bool = True
    max_tokens: Optional[int] = None
    max_attention_window: Optional[list[int]] = None
    free_gpu_memory_fraction: Optional[float] = Field(default=0.9, ge=0, le=1)
    host_cache_size: Optional[int] = None
    enable_partial_reuse: bool = True
    copy_on_partial_reuse: bool = True
    max_gpu_total_bytes: NonNegativeInt = 0
    dtype: str = "auto"
    tokens_per_block: int = 32
    use_kv_cache_manager_v2: Union[bool, Literal["auto"]] = "auto"
    # The remaining KvCacheConfig fields, by name only.
    sink_token_length: Any = None
    disk_cache_size: Any = None
    disk_cache_path: Any = None
    cross_kv_cache_fraction: Any = None
    secondary_offload_min_priority: Any = None
    event_buffer_max_size: Any = None
    attention_dp_events_gather_period_ms: Any = None
    kv_events_config: Any = None
    use_uvm: Any = None
    iteration_stats_interval: Any = None
    mamba_ssm_cache_dtype: Any = None
    mamba_ssm_stochastic_rounding: Any = None
    mamba_ssm_philox_rounds: Any = None
    mamba_state_cache_interval: Any = None
    mamba_state_config: Any = None
    enable_swa_scratch_reuse: Any = None
    kv_cache_event_hash_algo: Any = None
    max_util_for_resume: Any = None
    enable_kv_pool_rebalance: Any = None
    kv_pool_rebalance_min_sampled_kv_caches: Any = None
    kv_pool_rebalance_cooldown_secs: Any = None
    kv_pool_rebalance_target_ratio_update_interval: Any = None
    kv_pool_rebalance_ratio_threshold: Any = None
    kv_pool_rebalance_moving_average_decay: Any = None
    kv_pool_rebalance_check_interval: Any = None
    disk_prefetch_num_reqs: Any = None
    fp8_context_mla_kv_len_cap: Any = None
    pool_ratio: Any = None
    avg_seq_len: Any = None
    block_reuse_config: Any = None

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        # "auto", "fp8", "fp8_ds_mla", "nvfp4" or a torch dtype name (_str_to_torch_dtype_dict; the float ones here)
        if v.lower() not in {"auto", "fp8", "fp8_ds_mla", "nvfp4", "float16", "bfloat16", "float32"}:
            raise ValueError(f"kv_cache_config.dtype={v!r}")
        return v


class CudaGraph(_Forbid):
    batch_sizes: Optional[list[int]] = None
    max_batch_size: NonNegativeInt = 0
    enable_padding: bool = False
    mode: Literal["decode"] = "decode"

    @model_validator(mode="after")
    def _sizes(self):
        if self.batch_sizes and self.max_batch_size not in (0, max(self.batch_sizes)):
            raise ValueError("cuda_graph_config.max_batch_size must equal max(batch_sizes)")
        return self


class Moe(_Forbid):
    backend: Literal["AUTO", "CUTLASS", "CUTEDSL", "TRTLLM", "DEEPGEMM", "DENSEGEMM", "VANILLA", "TRITON", "MARLIN",
                     "MEGAMOE_DEEPGEMM", "MEGAMOE_CUTEDSL"] = "AUTO"
    max_num_tokens: Optional[int] = None
    load_balancer: Any = None
    disable_finalize_fusion: bool = False
    use_low_precision_moe_combine: bool = False


class AttentionDp(_Forbid):
    enable_balance: bool = False
    timeout_iters: int = 50
    batching_wait_iters: int = 10
    enable_kv_cache_aware_routing: bool = False
    kv_cache_routing_load_balance_weight: float = 1.0
    kv_cache_routing_match_rate_threshold: float = 0.1
    kv_cache_routing_fair_share_multiplier: float = 2.0
    kv_cache_routing_cold_start_warmup: bool = False
    kv_cache_routing_account_for_in_transfer: bool = False
    kv_cache_routing_conversation_affinity: bool = False
    kv_cache_routing_max_sessions: int = 65536
    kv_cache_routing_new_conv_placement: Literal["round_robin", "least_queued"] = "round_robin"

    @model_validator(mode="after")
    def _iters(self):
        if self.enable_balance and (self.batching_wait_iters < 0 or self.timeout_iters < 0):
            raise ValueError("attention_dp_config iteration counts must be >= 0 when enable_balance is true")
        return self


# TorchLlmArgs fields (BaseLlmArgs + TorchLlmArgs) that this project does not model field by field.
_OTHER_TOP_LEVEL = (
    "tokenizer", "tokenizer_mode", "custom_tokenizer", "post_processor_hook", "skip_tokenizer_init",
    "trust_remote_code", "revision", "tokenizer_revision", "model_kwargs", "context_parallel_size", "gpus_per_node",
    "moe_cluster_parallel_size", "enable_lm_head_tp_in_adp", "pp_partition", "cp_config", "enable_lora",
    "lora_config", "enable_chunked_prefill", "guided_decoding_backend", "batched_logits_processor",
    "iter_stats_max_iterations", "request_stats_max_iterations", "peft_cache_config", "scheduler_config",
    "cache_transceiver_config", "sparse_attention_config", "kv_cache_compression_config", "max_input_len",
    "max_beam_width", "gather_generation_logits", "postprocess_tokenizer_dir", "num_serve_frontends",
    "reasoning_parser", "decoding_config", "otlp_traces_endpoint", "backend", "return_perf_metrics",
    "perf_metrics_output_dir", "perf_metrics_max_requests", "prometheus_metrics_config", "enable_energy_metrics",
    "orchestrator_type", "telemetry_config",
    "generation_config", "garbage_collection_gen0_threshold", "encoder_cuda_graph_config",
    "enable_encoder_decoder_mixed_cuda_graph", "multimodal_config", "disable_overlap_scheduler", "nvfp4_gemm_config",
    "dwdp_config", "encoder_max_batch_size", "encoder_max_num_tokens", "attn_backend", "enable_mla_skip_correction",
    "mla_skip_correction_threshold", "sampler_force_async_worker", "enable_in_graph_sampling",
    "enable_speculative_beam_history_d2h", "enable_early_first_token_response", "enable_low_latency_host_dispatch",
    "enable_iter_perf_stats", "enable_iter_req_stats", "batch_wait_timeout_ms", "batch_wait_timeout_iters",
    "batch_wait_max_tokens_ratio", "torch_compile_config", "prefill_cuda_graph_backend", "prefill_capture_num_tokens",
    "enable_autotuner", "use_fine_grained_sync", "enable_layerwise_nvtx_marker", "load_format", "enable_min_latency",
    "force_dynamic_quantization", "allreduce_strategy", "checkpoint_loader", "checkpoint_format",
    "checkpoint_io_policy", "mx_config", "gms_config", "kv_connector_config", "mm_encoder_only", "disable_mm_encoder",
    "encode_only", "ray_worker_extension_cls", "ray_placement_config", "ray_worker_nsight_options", "sleep_config",
    "reorder_policy_config", "enable_resource_governor", "use_cute_dsl_blockscaling_mm",
    "use_cute_dsl_blockscaling_bmm", "use_cute_dsl_bf16_bmm", "use_cute_dsl_bf16_gemm", "max_stats_len",
    "layer_wise_benchmarks_config",
)


class _TorchLlmArgsModelled(_Forbid):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    model: Union[str, Path]
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    moe_tensor_parallel_size: Optional[int] = None
    moe_expert_parallel_size: Optional[int] = None
    enable_attention_dp: bool = False
    dtype: str = "auto"
    max_batch_size: Optional[int] = 2048
    max_seq_len: Optional[int] = None
    max_num_tokens: Optional[int] = 8192
    num_postprocess_workers: int = 0
    stream_interval: PositiveInt = 1
    print_iter_log: bool = False
    env_overrides: Optional[dict[str, str]] = None
    kv_cache_config: KvCache = Field(default_factory=KvCache)
    speculative_config: Optional[DFlashSpec] = None
    cuda_graph_config: Optional[CudaGraph] = Field(default_factory=CudaGraph)
    moe_config: Moe = Field(default_factory=Moe)
    attention_dp_config: Optional[AttentionDp] = None

    @field_validator("env_overrides", mode="before")
    @classmethod
    def _env(cls, v):
        return None if v is None else {str(k): str(x) for k, x in v.items()}


# Known to TorchLlmArgs; their own types are not modelled here.
TorchLlmArgs = create_model("TorchLlmArgs", __base__=_TorchLlmArgsModelled,
                            **{name: (Any, None) for name in _OTHER_TOP_LEVEL})


def validate_llm_args(options: dict, model: str = "target") -> BaseModel:
    """pydantic.ValidationError where TensorRT-LLM's TorchLlmArgs(model=..., **options) would reject options."""
    return TorchLlmArgs(model=model, **options)


def draft_len_for_batch_size(schedule: dict[int, int] | None, batch_size: int, max_draft_len: int) -> int:
    """K TensorRT-LLM's one-model path runs for a batch: the smallest key >= batch_size, 0 above every key."""
    if schedule is None:
        return max_draft_len
    for key in sorted(schedule):
        if key >= batch_size:
            return schedule[key]
    return 0


def check_drafter_config(cfg: dict, max_draft_len: int) -> None:
    """AssertionError where TensorRT-LLM's DFlash loader would not find what it reads in the drafter's config.json."""
    dflash = cfg.get("dflash_config")
    assert isinstance(dflash, dict), "config.json needs a dflash_config mapping"
    assert isinstance(dflash.get("mask_token_id"), int), "dflash_config.mask_token_id (else: vocab_size)"
    ids = dflash.get("target_layer_ids")
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids), "dflash_config.target_layer_ids"
    assert isinstance(cfg.get("block_size"), int), "top-level block_size"
    assert max_draft_len + 1 <= cfg["block_size"], f"max_draft_len={max_draft_len} needs block_size >= K + 1"
    assert cfg.get("model_type"), "model_type (the backbone when architectures is DFlashDraftModel)"


# trtllm-serve serve's options (tensorrt_llm/commands/serve.py @ 00209af1). Flags taking no value are marked.
TRTLLM_SERVE_OPTIONS = {
    "--tokenizer": True, "--custom_tokenizer": True, "--host": True, "--port": True, "--backend": True,
    "--custom_module_dirs": True, "--log_level": True, "--max_beam_width": True, "--max_batch_size": True,
    "--max_num_tokens": True, "--max_seq_len": True, "--tensor_parallel_size": True, "--tp_size": True,
    "--pipeline_parallel_size": True, "--pp_size": True, "--context_parallel_size": True, "--cp_size": True,
    "--moe_expert_parallel_size": True, "--ep_size": True, "--moe_cluster_parallel_size": True,
    "--cluster_size": True, "--gpus_per_node": True, "--free_gpu_memory_fraction": True,
    "--kv_cache_free_gpu_memory_fraction": True, "--num_postprocess_workers": True, "--trust_remote_code": False,
    "--revision": True, "--config": True, "--extra_llm_api_options": True, "--reasoning_parser": True,
    "--tool_parser": True, "--metadata_server_config_file": True, "--server_role": True,
    "--fail_fast_on_attention_window_too_large": False, "--otlp_traces_endpoint": True, "--disagg_cluster_uri": True,
    "--enable_chunked_prefill": False, "--media_io_kwargs": True, "--chat_template": True,
}


def parse_trtllm_serve(argv: list[str]) -> tuple[str, dict[str, str | bool]]:
    """(MODEL, {option: value}) for a `trtllm-serve [serve] MODEL --opt value ...` argv; ValueError on an option
    trtllm-serve does not have, a missing value or not exactly one MODEL."""
    args = list(argv[1:])
    if args and args[0] == "serve":
        args = args[1:]
    model, opts, i = [], {}, 0
    while i < len(args):
        a = args[i]
        if a.startswith("--"):
            name, _, inline = a.partition("=")
            if name not in TRTLLM_SERVE_OPTIONS:
                raise ValueError(f"trtllm-serve has no option {name}")
            if TRTLLM_SERVE_OPTIONS[name]:
                if not inline:
                    if i + 1 >= len(args):
                        raise ValueError(f"{name} needs a value")
                    i += 1
                    inline = args[i]
                opts[name] = inline
            else:
                opts[name] = True
        else:
            model.append(a)
        i += 1
    if len(model) != 1:
        raise ValueError(f"trtllm-serve takes one MODEL argument, got {model}")
    return model[0], opts
