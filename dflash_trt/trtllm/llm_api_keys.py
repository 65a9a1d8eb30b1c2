"""The TensorRT-LLM version the written config targets, and the LLM-API keys that version accepts.

The key lists are taken by reading NVIDIA/TensorRT-LLM `tensorrt_llm/llmapi/llm_args.py` at commit
0004396720054fd8e205cbf616f21f0b57c6b412 (classes BaseLlmArgs, TorchLlmArgs, DecodingBaseConfig,
DFlashDecodingConfig, KvCacheConfig, DecodeCudaGraphConfig, MoeConfig, AttentionDpConfig). They list the
keys this project may write (a subset of what that file defines: the ones a serving config needs), and
TorchLlmArgs rejects unknown keys (extra="forbid"), so a key outside these lists would fail at launch.
That commit is main after PR #16914 (merged 2026-08-17, first released in 1.3.0rc25 by the release notes; the
repository itself was too large to fetch here and check the tag). The release pin stays 1.3.0rc20, the release
candidate PR #15666 validated DFlash against (DFlash landed in the 1.3.0 line, PR #12794); keys the read source has
and the pin lacks are listed with the first release that has them, and the GPU check confirms the pin against an
installed tensorrt_llm.
"""

from __future__ import annotations

TENSORRT_LLM_VERSION = "1.3.0rc20"

# Keys the source read has and the pinned release does not, with the first release that has them (read in its
# release notes: NVIDIA's wheel index is out of reach here and PyPI holds only stub sdists), and where they came from.
NEWER_THAN_PIN: dict[str, tuple[str, str]] = {
    "speculative_config.attention_backend": ("1.3.0rc25", "NVIDIA/TensorRT-LLM PR #16914, merged 2026-08-17 "
                                                          "(TRTLLM-gen attention for DFlash drafters)"),
}


def _newer_keys(options: dict) -> list[tuple[str, str, str]]:
    """(dotted key, first release, origin) for each key of the LLM-API options that the pinned release lacks."""
    found = []
    for dotted, (first, origin) in NEWER_THAN_PIN.items():
        section, _, key = dotted.rpartition(".")
        if key in (options.get(section) or {} if section else options):
            found.append((dotted, first, origin))
    return found


def keys_missing_from(options: dict, version: str = TENSORRT_LLM_VERSION) -> list[str]:
    """'key (needs FIRST or later: where it came from)' for each key of the LLM-API options that release `version`
    (the pinned one by default) lacks; none for a version string that is not a release's (a source build, say)."""
    from packaging.version import InvalidVersion, Version

    try:
        installed = Version(version)
    except InvalidVersion:
        return []
    return [f"{dotted} (needs {first} or later: {origin})"
            for dotted, first, origin in _newer_keys(options) if installed < Version(first)]


def release_needed(options: dict) -> str:
    """The first release that takes every key of the options: the pin, or later where a key needs it."""
    from packaging.version import Version

    return max([TENSORRT_LLM_VERSION, *(first for _, first, _ in _newer_keys(options))], key=Version)


def release_notes(options: dict) -> list[str]:
    """One sentence per key of the options that the pinned release refuses (the written config's header and
    `build --plan-only` say them alike)."""
    return [f"Needs TensorRT-LLM {first} or later: {TENSORRT_LLM_VERSION} refuses {dotted} ({origin})"
            for dotted, first, origin in _newer_keys(options)]


LLM_ARGS_SOURCE = "NVIDIA/TensorRT-LLM tensorrt_llm/llmapi/llm_args.py@0004396720054fd8e205cbf616f21f0b57c6b412"

TOP_LEVEL_KEYS = frozenset({
    # BaseLlmArgs
    "model", "tokenizer", "tokenizer_mode", "skip_tokenizer_init", "trust_remote_code", "tensor_parallel_size",
    "dtype", "revision", "pipeline_parallel_size", "context_parallel_size", "gpus_per_node",
    "moe_tensor_parallel_size", "moe_expert_parallel_size", "enable_attention_dp", "enable_lm_head_tp_in_adp",
    "kv_cache_config", "enable_chunked_prefill", "scheduler_config", "speculative_config", "max_batch_size",
    "max_input_len", "max_seq_len", "max_beam_width", "max_num_tokens", "num_postprocess_workers",
    "reasoning_parser", "return_perf_metrics", "env_overrides", "guided_decoding_backend",
    # TorchLlmArgs
    "cuda_graph_config", "attention_dp_config", "disable_overlap_scheduler", "moe_config", "attn_backend",
    "enable_iter_perf_stats", "print_iter_log", "stream_interval", "enable_autotuner", "torch_compile_config",
    "garbage_collection_gen0_threshold", "allreduce_strategy", "batch_wait_timeout_ms", "enable_min_latency",
    "enable_layerwise_nvtx_marker",
})

NESTED_KEYS: dict[str, frozenset[str]] = {
    # DecodingBaseConfig + DFlashDecodingConfig
    "speculative_config": frozenset({
        "decoding_type", "max_draft_len", "max_total_draft_tokens", "speculative_model", "max_concurrency",
        "draft_len_schedule", "load_format", "acceptance_rate_window_size", "acceptance_rate_threshold",
        "use_rejection_sampling", "advanced_sampling_mode", "enable_penalty", "mask_token_id", "target_layer_ids",
        "attention_backend",
    }),
    "kv_cache_config": frozenset({
        "enable_block_reuse", "max_tokens", "max_attention_window", "free_gpu_memory_fraction", "host_cache_size",
        "enable_partial_reuse", "copy_on_partial_reuse", "max_gpu_total_bytes", "dtype", "tokens_per_block",
        "use_kv_cache_manager_v2",
    }),
    "cuda_graph_config": frozenset({"batch_sizes", "max_batch_size", "enable_padding", "mode"}),
    "moe_config": frozenset({"backend", "max_num_tokens", "load_balancer", "disable_finalize_fusion",
                             "use_low_precision_moe_combine"}),
    "attention_dp_config": frozenset({"enable_balance", "timeout_iters", "batching_wait_iters",
                                      "enable_kv_cache_aware_routing"}),
}

# Enumerated values the same file accepts for keys this project writes.
ALLOWED_VALUES: dict[str, frozenset] = {
    "speculative_config.decoding_type": frozenset({"DFlash"}),
    "speculative_config.attention_backend": frozenset({"VANILLA", "TRTLLM"}),
    "kv_cache_config.dtype": frozenset({"auto", "fp8", "nvfp4", "bfloat16", "float16", "float32"}),
    "moe_config.backend": frozenset({"AUTO", "CUTLASS", "CUTEDSL", "TRTLLM", "DEEPGEMM", "DENSEGEMM", "VANILLA",
                                     "TRITON", "MARLIN", "MEGAMOE_DEEPGEMM", "MEGAMOE_CUTEDSL"}),
    "dtype": frozenset({"auto", "float16", "bfloat16", "float32"}),
    "guided_decoding_backend": frozenset({"xgrammar", "llguidance"}),
}


def unknown_keys(options: dict) -> list[str]:
    """Dotted names of keys in `options` that the pinned version does not accept."""
    bad = [k for k in options if k not in TOP_LEVEL_KEYS]
    for section, allowed in NESTED_KEYS.items():
        value = options.get(section)
        if isinstance(value, dict):
            bad += [f"{section}.{k}" for k in value if k not in allowed]
    return bad


def bad_values(options: dict) -> list[str]:
    out = []
    for dotted, allowed in ALLOWED_VALUES.items():
        node = options
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None and node not in allowed:
            out.append(f"{dotted}={node!r} (accepted: {sorted(allowed)})")
    return out
