"""Build configs: every shipped YAML validates, and each bad key or impossible mapping fails naming the key."""

from pathlib import Path

import pytest

from dflash_trt.config import build_config_from_dict, load_build_config
from dflash_trt.model_configs import bundled_config
from dflash_trt.models.config import decoder_config_from_dict
from dflash_trt.models.dflash import DFlashConfig
from dflash_trt.validate import check_mapping

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "build_configs").glob("*.yaml"))
BASE = {"name": "t", "model": "Qwen/Qwen3-8B", "hardware": "h200", "max_batch_size": 8, "max_seq_len": 4096}


def test_all_five_shipped_build_configs_validate():
    names = {p.stem for p in CONFIGS}
    assert names == {"smollm2-135m-cpu", "qwen3-8b-1xh200", "llama3.1-8b-1xh200", "gpt-oss-120b-8xb300-latency",
                     "gpt-oss-120b-8xb300-throughput"}
    for path in CONFIGS:
        cfg, base = load_build_config(path)
        assert cfg.name == path.stem and base == path.parent


def _err(overrides: dict, **top) -> str:
    raw = {**BASE, **top}
    with pytest.raises(ValueError) as e:
        build_config_from_dict(raw, "t.yaml", overrides)
    return str(e.value)


@pytest.mark.parametrize(
    "top, key, words",
    [
        ({"modle": "x"}, "modle", "unknown key"),
        ({"kv_cache_config": {"dtype": "fp4"}}, "kv_cache_config.dtype", "'auto'"),
        ({"kv_cache_config": {"free_gpu_memory_fraction": 1.5}}, "kv_cache_config.free_gpu_memory_fraction", "1"),
        ({"hardware": "a100"}, "hardware", "b300"),
        ({"max_batch_size": 0}, "max_batch_size", "greater than or equal to 1"),
        # TensorRT-LLM's sizes are int32: written as given, they failed only at its load
        ({"max_num_tokens": 10**30}, "max_num_tokens", "less than or equal to 2147483647"),
        ({"kv_cache_config": {"tokens_per_block": 2**31}}, "kv_cache_config.tokens_per_block", "2147483647"),
        ({"speculative_config": {"max_draft_len": 4}}, "speculative_config.speculative_model", "required key is missing"),
        # YAML mistakes pydantic's lax mode would read as numbers and flags
        ({"max_batch_size": True}, "max_batch_size", "expected an integer, got True"),
        ({"max_seq_len": "4096"}, "max_seq_len", "expected an integer, got '4096'"),
        ({"tensor_parallel_size": 2.0}, "tensor_parallel_size", "expected an integer, got 2.0"),
        ({"enable_attention_dp": "yes"}, "enable_attention_dp", "expected true or false, got 'yes'"),
        ({"speculative_config": {"speculative_model": "z/d", "adaptive_draft_len": 1}},
         "speculative_config.adaptive_draft_len", "expected true or false, got 1"),
    ],
)
def test_schema_errors_name_the_offending_key(top, key, words):
    msg = _err({}, **top)
    assert f"t.yaml: key '{key}'" in msg and words in msg, msg


@pytest.mark.parametrize(
    "top, words",
    [
        ({"tensor_parallel_size": 8, "moe_expert_parallel_size": 4, "moe_tensor_parallel_size": 4},
         "moe_expert_parallel_size=4 x moe_tensor_parallel_size=4 = 16 must equal tensor_parallel_size=8"),
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
        ({"tensor_parallel_size": 16}, "needs 16 devices; hardware h200 has 8"),
        ({"tensor_parallel_size": 8, "moe_expert_parallel_size": 3}, "moe_expert_parallel_size=3 must divide"),
        ({"speculative_config": {"speculative_model": "z/d", "attention_backend": "TRTLLM"}},
         "attention_backend=TRTLLM needs SM100/SM103"),
        # trtllm-gen's kernels take pages of 16, 32 or 64 tokens (FlashInferTrtllmGenFmha.SUPPORTED_TOKENS_PER_BLOCK)
        ({"hardware": "b300", "kv_cache_config": {"tokens_per_block": 128},
          "speculative_config": {"speculative_model": "z/d", "attention_backend": "TRTLLM"}},
         "kv_cache_config.tokens_per_block=128: speculative_config.attention_backend=TRTLLM takes pages of 16, 32, 64"),
        ({"hardware": "cpu", "kv_cache_config": {"dtype": "fp8"}}, "kv_cache_config.dtype=fp8 needs a GPU"),
        ({"hardware": "cpu", "kv_cache_config": {"dtype": "nvfp4"}}, "kv_cache_config.dtype=nvfp4 needs a GPU"),
        ({"kv_cache_config": {"dtype": "nvfp4"}}, "nvfp4 needs FP4 tensor cores (Blackwell: b300); hardware h200"),
        # trtllm-gen's MoE kernels: Hopper takes TRITON (TensorRT-LLM's gpt-oss deployment guide)
        ({"moe_config": {"backend": "TRTLLM"}}, "moe_config.backend=TRTLLM runs TensorRT-LLM's trtllm-gen MoE kernels, "
         "SM100/SM103 (B200/B300) only; hardware h200 takes TRITON"),
        ({"hardware": "cpu", "cuda_graph_config": {"max_batch_size": 4}}, "cuda_graph_config needs a GPU"),
        ({"speculative_config": {"speculative_model": "z/d", "max_draft_len": 7, "draft_len_schedule": {1: 5, 4: 5}}},
         "draft_len_schedule[1]=5 must equal max_draft_len=7"),
        # TensorRT-LLM's validator requires key 1 (llm_args.py validate_draft_len_schedule_and_sort).
        ({"speculative_config": {"speculative_model": "z/d", "draft_len_schedule": {4: 5}}},
         "draft_len_schedule={4: 5} needs a key 1"),
        ({"speculative_config": {"speculative_model": "z/d", "draft_len_schedule": "auto"}},
         "draft_len_schedule: auto needs speculative_config.acceptance_by_draft_len"),
        ({"speculative_config": {"speculative_model": "z/d", "acceptance_by_draft_len": {3: 4.5}}},
         "acceptance_by_draft_len entry 3: 4.5 needs K >= 1 and 1 <= tau <= K + 1"),
        ({"speculative_config": {"speculative_model": "z/d", "draft_len_schedule": "auto", "max_concurrency": 8,
                                 "acceptance_by_draft_len": {3: 2.0}}}, "mutually exclusive"),
        ({"cuda_graph_config": {"max_batch_size": 64}}, "cuda_graph_config.max_batch_size=64 exceeds max_batch_size=8"),
    ],
)
def test_impossible_mappings_fail_with_their_message(top, words):
    assert words in _err({}, **top)


def test_a_check_across_keys_is_said_without_a_key_of_its_own():
    # it read "t.yaml: key '(top level)': moe_expert_parallel_size=3 ..."
    assert _err({}, tensor_parallel_size=8, moe_expert_parallel_size=3) == (
        "t.yaml: moe_expert_parallel_size=3 must divide tensor_parallel_size=8")


def test_overrides_use_dotted_keys():
    cfg = build_config_from_dict({**BASE, "speculative_config": {"speculative_model": "z/d"}}, "t.yaml",
                                 {"speculative_config.max_draft_len": 5, "max_seq_len": 1024, "max_batch_size": None})
    assert cfg.speculative_config.max_draft_len == 5 and cfg.max_seq_len == 1024 and cfg.max_batch_size == 8


def test_a_k_override_caps_the_files_draft_len_schedule():
    spec = {"speculative_model": "z/d", "max_draft_len": 7, "draft_len_schedule": {1: 7, 4: 2, 8: 5}}
    cfg = build_config_from_dict({**BASE, "speculative_config": spec}, "t.yaml", {"speculative_config.max_draft_len": 3})
    assert cfg.speculative_config.max_draft_len == 3
    assert cfg.speculative_config.draft_len_schedule == {1: 3, 4: 2, 8: 3}
    cfg = build_config_from_dict({**BASE, "speculative_config": spec}, "t.yaml", {"speculative_config.max_draft_len": 9})
    assert cfg.speculative_config.draft_len_schedule == {1: 9, 4: 2, 8: 5}
    spec = {**spec, "draft_len_schedule_without_amx": {1: 7, 2: 5}}  # the table for CPUs without AMX alike
    cfg = build_config_from_dict({**BASE, "speculative_config": spec}, "t.yaml",
                                 {"speculative_config.max_draft_len": 3})
    assert cfg.speculative_config.draft_len_schedule_without_amx == {1: 3, 2: 3}


def test_a_k_override_without_a_drafter_says_so():
    with pytest.raises(ValueError, match="no drafter"):
        build_config_from_dict(dict(BASE), "t.yaml", {"speculative_config.max_draft_len": 3})
    cfg = build_config_from_dict(dict(BASE), "t.yaml", {"speculative_config.speculative_model": "z/d",
                                                       "speculative_config.max_draft_len": 3})  # --drafter gives one
    assert cfg.speculative_config.max_draft_len == 3


def test_a_k_override_leaves_a_malformed_schedule_to_the_schema_error():
    spec = {"speculative_model": "z/d", "max_draft_len": 7, "draft_len_schedule": {1: 7, 4: None}}
    with pytest.raises(ValueError, match="t.yaml: key 'speculative_config.draft_len_schedule"):
        build_config_from_dict({**BASE, "speculative_config": spec}, "t.yaml", {"speculative_config.max_draft_len": 3})


def _models(target_id, drafter_id=None):
    t = decoder_config_from_dict(bundled_config(target_id))
    d = DFlashConfig.from_dict(bundled_config(drafter_id)) if drafter_id else None
    return t, d


@pytest.mark.parametrize(
    "target, drafter, top, words",
    [
        # Qwen3-8B has 32 query heads: 32 % 3 != 0.
        ("Qwen/Qwen3-8B", None, {"tensor_parallel_size": 3}, "num_attention_heads=32 is not divisible"),
        # With attention DP the heads are not split, so the experts are what fails: 128 % 6 != 0.
        ("openai/gpt-oss-120b", None, {"hardware": "b300", "tensor_parallel_size": 6, "enable_attention_dp": True,
                                      "moe_expert_parallel_size": 6}, "the target.s 128 experts are not divisible"),
        ("Qwen/Qwen3-8B", None, {"moe_config": {"backend": "CUTLASS"}}, "has no experts"),
        # The gpt-oss drafter has 64 query heads; TP 3 cannot split the target's 64 either.
        ("openai/gpt-oss-120b", "z-lab/gpt-oss-120b-DFlash", {"hardware": "b300", "tensor_parallel_size": 3,
                                                              "moe_expert_parallel_size": 1},
         "the target's num_attention_heads=64"),
    ],
)
def test_mapping_that_does_not_divide_the_model_fails(target, drafter, top, words):
    t, d = _models(target, drafter)
    cfg = build_config_from_dict({**BASE, "model": target, **top})
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace("[", r"\[")):
        check_mapping(t, d, cfg)


def test_bundled_gpt_oss_facts_match_the_issue():
    t = decoder_config_from_dict(bundled_config("openai/gpt-oss-120b"))
    assert (t.num_hidden_layers, t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim) == (36, 2880, 64, 8, 64)
    assert t.vocab_size == 201088 and t.intermediate_size == 2880
    assert (t.extra["num_local_experts"], t.extra["num_experts_per_tok"], t.extra["sliding_window"]) == (128, 4, 128)
    assert t.extra["layer_types"][:2] == ["sliding_attention", "full_attention"] and len(t.extra["layer_types"]) == 36
    assert t.extra["quantization_config"]["quant_method"] == "mxfp4"


def test_a_misspelt_key_is_named_first_with_the_key_it_was_meant_to_be():
    raw = {k: v for k, v in BASE.items() if k != "max_batch_size"}
    raw.update(max_batch_sise=8, speculative_config={"speculative_model": "z/d", "max_draft_lenn": 3})
    with pytest.raises(ValueError) as e:
        build_config_from_dict(raw, "t.yaml")
    lines = str(e.value).splitlines()
    # the required key the misspelling was meant to be is not also reported missing
    assert set(lines) == {"t.yaml: key 'max_batch_sise': unknown key; did you mean 'max_batch_size'?",
                          "t.yaml: key 'speculative_config.max_draft_lenn': unknown key; did you mean "
                          "'max_draft_len'?"}, lines
    raw = {k: v for k, v in BASE.items() if k not in ("max_batch_size", "model")}
    with pytest.raises(ValueError) as e:  # a required key with no misspelling near it still is
        build_config_from_dict({**raw, "max_batch_sise": 8}, "t.yaml")
    assert str(e.value).splitlines()[1:] == ["t.yaml: key 'model': required key is missing"]
    assert "did you mean" not in _err({}, modle_zzz="x")  # nothing close: no guess


def test_a_key_given_twice_in_the_yaml_is_an_error_naming_it_and_both_lines(tmp_path):
    # Plain YAML keeps the later value: the first max_draft_len would be dropped without a word.
    path = tmp_path / "twice.yaml"
    path.write_text("name: t\nmodel: Qwen/Qwen3-8B\nhardware: h200\nmax_batch_size: 8\nmax_seq_len: 4096\n"
                    "speculative_config:\n  speculative_model: z/d\n  max_draft_len: 3\n  max_draft_len: 5\n")
    words = r"(?s)twice.yaml: invalid YAML .*'max_draft_len' a second time \(first on line 8\).*twice.yaml.*line 9"
    with pytest.raises(ValueError, match=words):
        load_build_config(path)
    # A merge key's values give way to the mapping's own keys, as YAML says: no key is given twice there.
    path.write_text("name: t\nmodel: Qwen/Qwen3-8B\nhardware: h200\nmax_seq_len: 4096\n"
                    "<<: {max_batch_size: 8, max_num_tokens: 512}\nmax_batch_size: 4\n")
    cfg, _ = load_build_config(path)
    assert (cfg.max_batch_size, cfg.max_num_tokens) == (4, 512)


def test_a_build_config_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.yaml: invalid YAML \('utf-8' codec"):
        load_build_config(path)


@pytest.mark.parametrize("schedule, key, words", [
    ({1: 7, "a": 3}, "speculative_config.draft_len_schedule.a", "valid integer, unable to parse string as an integer "
     "(in a key)"),
    ({1: 7.5}, "speculative_config.draft_len_schedule.1", "valid integer, got a number with a fractional part"),
    ("fast", "speculative_config.draft_len_schedule", "valid dictionary; or: Input should be 'auto'"),
])
def test_a_bad_draft_len_schedule_names_its_yaml_key_not_the_schemas_union_members(schedule, key, words):
    msg = _err({}, speculative_config={"speculative_model": "z/d", "draft_len_schedule": schedule})
    assert msg.splitlines() == [f"t.yaml: key '{key}': Input should be a {words}"], msg


@pytest.mark.parametrize("name, batch, graphs", [
    ("gpt-oss-120b-8xb300-latency.yaml", 384, 384),  # graphs up to the file's 16 follow the batch up
    ("gpt-oss-120b-8xb300-throughput.yaml", 128, 128),  # and down (512 graphs over 128 rows were refused)
])
def test_cuda_graphs_tied_to_the_files_batch_size_follow_an_overridden_one(name, batch, graphs):
    cfg, _ = load_build_config(Path(__file__).resolve().parents[1] / "build_configs" / name, {"max_batch_size": batch})
    assert cfg.max_batch_size == batch and cfg.cuda_graph_config.max_batch_size == graphs


def test_cuda_graphs_chosen_apart_from_the_batch_size_stay_as_written():
    raw = {"name": "x", "model": "embedded:smollm2-135m-instruct", "hardware": "h200", "max_batch_size": 64,
           "max_seq_len": 2048,
           "cuda_graph_config": {"max_batch_size": 8}}
    assert build_config_from_dict(raw, overrides={"max_batch_size": 128}).cuda_graph_config.max_batch_size == 8
    listed = {**raw, "cuda_graph_config": {"batch_sizes": [1, 2, 4]}}
    assert build_config_from_dict(listed, overrides={"max_batch_size": 128}).cuda_graph_config.batch_sizes == [1, 2, 4]


@pytest.mark.parametrize("edit", [{"sliding_window": 0}, {"sliding_window": False}, {"sliding_window": None},
                                  # YaRN without its factor: derived from the two context lengths, as transformers does
                                  {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6,
                                                       "original_max_position_embeddings": 32768}}])
def test_config_values_that_mean_no_window_or_a_derived_factor_still_read(edit):
    """The checks of the planner's raw keys and of each rope type's needs leave these alone: configs that built."""
    from dflash_trt.layers.rotary import rope_inv_freq

    t = decoder_config_from_dict({**bundled_config("Qwen/Qwen3-8B"), **edit})
    inv_freq, _ = rope_inv_freq(t.head_dim, t.rope, t.max_position_embeddings)
    assert inv_freq.shape == (t.head_dim // 2,) and bool(inv_freq.isfinite().all())


def test_a_hybrid_targets_linear_heads_must_split_across_the_ranks():
    """Qwen3.5 with 16 attention heads and linear heads of 6 key / 12 value: TP 4 splits the attention heads but not
    the linear layers' key heads."""
    t = decoder_config_from_dict({"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
                                  "vocab_size": 1000, "hidden_size": 1024, "intermediate_size": 2048,
                                  "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4,
                                  "head_dim": 64, "linear_num_key_heads": 6, "linear_num_value_heads": 12})
    cfg = build_config_from_dict({**BASE, "model": "Qwen/Qwen3.5-4B", "hardware": "h200", "tensor_parallel_size": 4})
    with pytest.raises(ValueError, match="the target's linear_num_key_heads=6 is not divisible by it"):
        check_mapping(t, None, cfg)
    check_mapping(t, None, build_config_from_dict({**BASE, "model": "Qwen/Qwen3.5-4B", "hardware": "h200",
                                                   "tensor_parallel_size": 2}))
