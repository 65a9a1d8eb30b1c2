"""The memory planner against figures computed by hand (the arithmetic is in the comments)."""

import pytest

from dflash_trt.config import build_config_from_dict
from dflash_trt.hardware import has_amx_tiles, profile
from dflash_trt.model_configs import bundled_config
from dflash_trt.models.config import decoder_config_from_dict, moe_shape
from dflash_trt.models.dflash import DFlashConfig
from dflash_trt.plan import cuda_graph_batch_sizes, plan_build

GPT_OSS = decoder_config_from_dict(bundled_config("openai/gpt-oss-120b"))
GPT_OSS_DRAFTER = DFlashConfig.from_dict(bundled_config("z-lab/gpt-oss-120b-DFlash"))


def _cfg(**kw):
    raw = {"name": "t", "model": "openai/gpt-oss-120b", "hardware": "b300", "dtype": "bfloat16",
           "kv_cache_config": {"dtype": "fp8"}, "speculative_config": {"speculative_model": "z-lab/gpt-oss-120b-DFlash"}}
    raw.update(kw)
    return build_config_from_dict(raw)


def test_gpt_oss_120b_at_tp8_ep8_matches_hand_arithmetic():
    cfg = _cfg(tensor_parallel_size=8, moe_expert_parallel_size=8, max_batch_size=16, max_seq_len=8192,
               cuda_graph_config={"enable_padding": True, "max_batch_size": 16})
    plan = plan_build(GPT_OSS, GPT_OSS_DRAFTER, cfg, profile("b300"), max_draft_len=9)
    c = plan.components
    # Target weights per rank, TP8 (8 q heads and 1 kv head of 64 per rank), EP8 (16 of 128 experts):
    #   attention  q 2880x512 + k,v 2x2880x64 + o 512x2880      = 3,317,760
    #   biases     q 512 + k,v 2x64 + o 2880 (replicated)        =     3,520
    #   sinks 64/8 = 8; norms 2x2880 = 5,760; router 2880x128+128 = 368,768
    #   -> 3,695,816 bf16 values = 7,391,632 B per layer
    #   experts, as TensorRT-LLM's TRTLLM-gen MoE pads them (intermediate 2880 -> 2944 by 128, gate_up's input hidden
    #   2880 -> 3072 by 512, down's output hidden 2880 -> 2944): gate_up 5888 x 3072 + down 2944 x 2944
    #   = 26,755,072 values x 17/32 B (MXFP4 and its scales) = 14,213,632 B, + fp32 biases (5888 + 2944) x 4
    #   = 35,328 B -> 14,248,960 B an expert, x 16 = 227,983,360 B
    #   per layer 235,374,992 B x 36 layers = 8,473,499,712 B
    #   embedding + lm_head 2 x 201,088 x 2880 / 8 = 144,783,360 values; final norm 2880 -> 289,572,480 B
    assert c["target_weights"] == 8_473_499_712 + 289_572_480 == 8_763_072_192
    # Target KV, fp8, 1 kv head x 64 per rank: 2 x 64 x 1 B = 128 B per token per layer. TensorRT-LLM (before
    #   PR #18767) puts the sliding layers in the full-context pool too: all 36 layers hold 8192 tokens.
    #   16 rows x 128 x 36 x 8192 = 603,979,776
    assert c["target_kv_cache"] == 603_979_776
    # Drafter arena: 2 x 8 layers x 1 kv head x 64 x 2 B = 2,048 B per token;
    #   (16 + 1 dummy) slots x (8192 + 9 + 1) tokens x 2,048 = 285,560,832
    assert c["drafter_context_cache"] == 17 * 8202 * 2048 == 285_560_832
    # Drafter weights per rank: per layer q/o 2x2880x512 + k/v 2x2880x64 + MLP 3x2880x7680/8 + norms 2x2880
    #   + q/k norms 2x64 + biases 512+128+2880 = 3,317,760 + 8,294,400 + 5,760 + 128 + 3,520 = 11,621,568;
    #   x 8 layers + fc 5x2880x2880 + 2 norms 2x2880 = 92,972,544 + 41,472,000 + 5,760 = 134,450,304 values x 2 B
    assert c["drafter_weights"] == 268_900_608
    assert plan.cuda_graph_batch_sizes == [1, 2, 4, 8, 16] and c["cuda_graph_pools"] == 5 * 200 * 10**6
    assert plan.fits


def test_the_drafters_own_kv_cache_takes_its_share_of_the_budget_unless_attention_is_data_parallel():
    """TensorRT-LLM gives one-model DFlash a draft KV cache manager without attention DP, and splits the KV budget
    between the two by bytes per token (_util.py: _compute_draft_budget_shares)."""
    def free_and_plan(**extra):
        cfg = _cfg(tensor_parallel_size=8, moe_expert_parallel_size=8, max_batch_size=16, max_seq_len=8192, **extra)
        plan = plan_build(GPT_OSS, GPT_OSS_DRAFTER, cfg, profile("b300"), max_draft_len=9)
        c = plan.components
        before = sum(v for k, v in c.items() if k not in ("target_kv_cache", "drafter_context_cache"))
        return profile("b300").memory_bytes - before, plan

    free, plan = free_and_plan()
    # the target's 128 B x 36 layers = 4,608 B a token (TP8, fp8) against the drafter's 2 x 8 layers x 64 x 2 B
    # = 2,048 B: the target keeps 4,608 / 6,656 = 69% of the budget
    assert abs(plan.kv_cache_budget_bytes - int(free * 0.9) * 4608 / 6656) <= 1
    assert any("with 31% of the KV budget" in n for n in plan.notes)
    free, plan = free_and_plan(enable_attention_dp=True, max_num_tokens=20000)
    assert plan.kv_cache_budget_bytes == int(free * 0.9) and not any("KV budget" in n for n in plan.notes)


def test_an_nvfp4_kv_cache_holds_nine_sixteenths_of_a_byte_a_value():
    """TensorRT-LLM's NVFP4 KV cache: 4-bit values and an FP8 scale per 16 in a pool beside them."""
    cfg = _cfg(tensor_parallel_size=8, moe_expert_parallel_size=8, max_batch_size=16, max_seq_len=8192,
               kv_cache_config={"dtype": "nvfp4"})
    plan = plan_build(GPT_OSS, GPT_OSS_DRAFTER, cfg, profile("b300"), max_draft_len=9)
    # 1 kv head x 64 per rank: 2 x 64 x (0.5 + 1/16) B = 72 B per token per layer (fp8's 128 above);
    #   16 rows x 72 x 36 layers x 8192 = 339,738,624
    assert plan.kv_cache_dtype == "nvfp4" and plan.components["target_kv_cache"] == 339_738_624
    assert plan.fits and any("ModelOpt" in n for n in plan.notes)  # gpt-oss declares no NVFP4 KV scales
    declared = decoder_config_from_dict({**bundled_config("openai/gpt-oss-120b"), "quantization_config": {
        "quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_quant_algo": "NVFP4"}})
    assert not any("ModelOpt" in n for n in plan_build(declared, GPT_OSS_DRAFTER, cfg, profile("b300"), 9).notes)
    odd = decoder_config_from_dict({**bundled_config("openai/gpt-oss-120b"), "head_dim": 80})
    plan = plan_build(odd, GPT_OSS_DRAFTER, cfg, profile("b300"), max_draft_len=9)
    assert not plan.fits and any("power-of-two head_dim" in p and "80" in p for p in plan.problems)


def test_an_auto_kv_cache_is_the_quantized_one_the_checkpoint_declares():
    cfg = _cfg(tensor_parallel_size=8, moe_expert_parallel_size=8, max_batch_size=16, max_seq_len=8192,
               kv_cache_config={"dtype": "auto"})
    assert plan_build(GPT_OSS, GPT_OSS_DRAFTER, cfg, profile("b300"), 9).kv_cache_dtype == "bfloat16"
    for algo, dtype, per_token in (("FP8", "fp8", 128), ("NVFP4", "nvfp4", 72)):
        declared = decoder_config_from_dict({**bundled_config("openai/gpt-oss-120b"), "quantization_config": {
            "quant_method": "modelopt", "kv_cache_quant_algo": algo}})
        plan = plan_build(declared, GPT_OSS_DRAFTER, cfg, profile("b300"), max_draft_len=9)
        assert plan.kv_cache_dtype == dtype and plan.details["target_kv_bytes_per_token_per_layer"] == per_token
    plan = plan_build(declared, GPT_OSS_DRAFTER, _cfg(**{**cfg.model_dump(), "hardware": "h200"}), profile("h200"), 9)
    assert not plan.fits and any("NVFP4 KV cache" in p and "fp8" in p for p in plan.problems)  # no FP4 on Hopper


def test_drafter_arena_at_64_x_131072_is_the_trtllm_16005_trap():
    # TP1, gpt-oss drafter: 2 (K,V) x 8 layers x 8 kv heads x 64 x 2 B = 16,384 B per token.
    # TRT-LLM's dense arena: (64 + 1) slots x (131,072 + 9 + 1) tokens x 16,384 B
    #   = 65 x 131,082 x 16,384 = 139,597,086,720 B = 130.0 GiB per rank, before any weight or KV.
    cfg = _cfg(max_batch_size=64, max_seq_len=131072, moe_expert_parallel_size=1)
    plan = plan_build(GPT_OSS, GPT_OSS_DRAFTER, cfg, profile("h200"), max_draft_len=9)
    assert plan.components["drafter_context_cache"] == 65 * 131_082 * 16_384 == 139_597_086_720
    assert not plan.fits
    msg = plan.problems[0]
    assert "does not fit h200" in msg and "drafter_context_cache 139.60 GB" in msg
    # allocated after the KV cache (its first forward), so not "before the KV cache" as this test once read
    assert ("The drafter's context arena (139.60 GB) is allocated after the KV cache took free_gpu_memory_fraction=0.9 "
            "of free memory") in msg and "change max_seq_len or max_batch_size" in msg and "Before the KV" not in msg
    # The same arena at TP8 on a B300 is an eighth (one kv head per rank): 17.45 GB, and fits.
    cfg8 = _cfg(max_batch_size=64, max_seq_len=131072, tensor_parallel_size=8, moe_expert_parallel_size=8)
    plan8 = plan_build(GPT_OSS, GPT_OSS_DRAFTER, cfg8, profile("b300"), max_draft_len=9)
    assert plan8.components["drafter_context_cache"] == 139_597_086_720 // 8 and plan8.fits


def test_the_suggested_batch_size_is_the_largest_that_fits():
    # A single H200 cannot hold gpt-oss-120b's ~65 GB of weights plus 32 rows of 65,536 tokens.
    cfg = _cfg(max_batch_size=32, max_seq_len=65536, moe_expert_parallel_size=1)
    plan = plan_build(GPT_OSS, GPT_OSS_DRAFTER, cfg, profile("h200"), max_draft_len=9)
    assert not plan.fits
    n = int(plan.problems[0].split("max_batch_size <= ")[1].split()[0])
    fits = lambda b: plan_build(GPT_OSS, GPT_OSS_DRAFTER, _cfg(max_batch_size=b, max_seq_len=65536,  # noqa: E731
                                moe_expert_parallel_size=1), profile("h200"), 9).fits
    assert 1 <= n < 32 and fits(n) and not fits(n + 1)


def test_seq_len_beyond_the_target_context_is_refused():
    cfg = _cfg(max_batch_size=1, max_seq_len=200_000, tensor_parallel_size=8, moe_expert_parallel_size=8)
    plan = plan_build(GPT_OSS, GPT_OSS_DRAFTER, cfg, profile("b300"), max_draft_len=9)
    assert not plan.fits and "max_position_embeddings=131072" in plan.problems[0]


def test_a_max_num_tokens_below_one_requests_verify_is_a_problem_not_a_note():
    """It built, noting that TensorRT-LLM schedules at most 0 decoding requests a step."""
    cfg = _cfg(max_batch_size=4, max_seq_len=1024, max_num_tokens=9, tensor_parallel_size=8,
               moe_expert_parallel_size=8)
    plan = plan_build(GPT_OSS, GPT_OSS_DRAFTER, cfg, profile("b300"), max_draft_len=9)
    assert not plan.fits and "max_num_tokens=9 is below the 10 tokens one request verifies" in plan.problems[0]
    cfg = _cfg(max_batch_size=4, max_seq_len=1024, max_num_tokens=10, tensor_parallel_size=8,
               moe_expert_parallel_size=8)
    plan = plan_build(GPT_OSS, GPT_OSS_DRAFTER, cfg, profile("b300"), max_draft_len=9)
    assert not any("below the" in p for p in plan.problems)


def test_a_batch_whose_verified_tokens_pass_max_num_tokens_is_noted_and_its_logits_capped():
    # TensorRT-LLM caps a step at max_num_tokens: 4,000 rows of K=9 verify 40,000 tokens, so 2,000 rows decode a step
    def plan(batch):
        cfg = _cfg(max_batch_size=batch, max_seq_len=1024, max_num_tokens=20_000, tensor_parallel_size=8,
                   moe_expert_parallel_size=8)
        return plan_build(GPT_OSS, GPT_OSS_DRAFTER, cfg, profile("b300"), max_draft_len=9)

    big, edge = plan(4000), plan(2000)
    assert any("verifies 40000 tokens a step, past max_num_tokens=20000" in n and "at most 2000 decoding" in n
               for n in big.notes)
    assert not any("max_num_tokens" in n for n in edge.notes)  # 20,000 exactly
    # the fp32 logits (target and drafter: 2 x 201,088 x 4 B a token) of 20,000 verified tokens at most
    logits = 20_000 * GPT_OSS.vocab_size * 4 * 2
    assert big.components["activations_estimate"] - edge.components["activations_estimate"] < logits // 100


@pytest.mark.parametrize(
    "graph, schedule, expected",
    [
        ({"enable_padding": True, "max_batch_size": 16}, None, [1, 2, 4, 8, 16]),
        # 1, 2, 4 + 16 multiples of 8 up to 128 + 192 .. 512 in steps of 64 (6 more) = 25 sizes
        ({"enable_padding": True, "max_batch_size": 512}, None,
         [1, 2, 4] + list(range(8, 129, 8)) + [192, 256, 320, 384, 448, 512]),
        ({"enable_padding": False, "max_batch_size": 40}, None, list(range(1, 33)) + [40]),
        # schedule keys within the graphs join their sizes (512: a GPU build drafts at every batch size up to it)
        ({"batch_sizes": [4, 1, 64]}, {1: 5, 20: 5, 64: 2, 512: 1}, [1, 4, 20, 64]),
    ],
)
def test_cuda_graph_batch_sizes(graph, schedule, expected):
    spec = {"speculative_model": "z/d", "max_draft_len": 5, "draft_len_schedule": schedule} if schedule else {"speculative_model": "z/d"}
    cfg = _cfg(max_batch_size=512, max_seq_len=2048, cuda_graph_config=graph, speculative_config=spec,
               moe_expert_parallel_size=1)
    assert cuda_graph_batch_sizes(cfg) == expected


def test_the_cpu_runtime_plans_mxfp4_experts_dequantized():
    # The torch runtime dequantizes experts on load: an expert's 3 x 2880 x 2880 values and 8,640 biases at 2 B
    # (bf16) = 49,783,680 B, where TensorRT-LLM holds 14,248,960 B (padded MXFP4, fp32 biases; see the TP8 test):
    # 35,534,720 B more an expert, x 128 experts x 36 layers = 163,743,989,760 B more than the packed plan.
    gpu = _cfg(max_batch_size=1, max_seq_len=1024, moe_expert_parallel_size=1)
    cpu = build_config_from_dict({"name": "t", "model": "openai/gpt-oss-120b", "hardware": "cpu", "dtype": "bfloat16",
                                  "max_batch_size": 1, "max_seq_len": 1024})
    packed = plan_build(GPT_OSS, None, gpu, profile("h200"), 0).components["target_weights"]
    unpacked = plan_build(GPT_OSS, None, cpu, profile("cpu"), 0).components["target_weights"]
    assert unpacked - packed == (49_783_680 - 14_248_960) * 128 * 36 == 163_743_989_760


def test_gpt_oss_throughput_plan_chooses_a_schedule_whose_k_falls_with_the_batch():
    from pathlib import Path

    from dflash_trt.build import prepare_build
    from dflash_trt.draft_schedule import expand

    path = Path(__file__).resolve().parent.parent / "build_configs" / "gpt-oss-120b-8xb300-throughput.yaml"
    p = prepare_build(path, allow_bundled=True)
    schedule = p.plan.draft_len_schedule
    assert schedule and schedule[1] == p.max_draft_len == p.plan.max_draft_len <= 7  # the YAML's cap
    ks = [expand(schedule, b) for b in range(1, 513)]
    assert all(a >= b for a, b in zip(ks, ks[1:])) and ks[-1] < ks[0]  # never rises, and falls
    # Every threshold is a CUDA-graph batch size (the plan chose among the sizes batches are padded to).
    assert set(schedule) <= set(p.plan.cuda_graph_batch_sizes)
    perf = p.plan.performance
    assert perf["schedule_source"] == "auto" and perf["acceptance_by_draft_len"][7] < 4.4  # extrapolated below K=9
    chosen = {pt["batch_size"]: pt["draft_len"] for pt in perf["points"] if pt["chosen"]}
    assert all(chosen[b] == expand(schedule, b) for b in chosen)
    # At each batch size the chosen K is the smallest within 1% of the best predicted tok/s/GPU among K <= schedule[1].
    for b in chosen:
        pts = [pt for pt in perf["points"] if pt["batch_size"] == b]
        best = max(pt["tok_s_gpu"] for pt in pts)
        assert chosen[b] == min(pt["draft_len"] for pt in pts if pt["tok_s_gpu"] * 1.01 >= best)


def test_suggestions_stay_within_the_targets_positions():
    # 32 rows of 200,000 tokens on one H200: past gpt-oss's 131,072 positions and past the memory; the length
    # suggested must be one the target can run, not the memory's alone, and the batch one that fits at such a length.
    cfg = _cfg(max_batch_size=32, max_seq_len=200_000, moe_expert_parallel_size=1)
    plan = plan_build(GPT_OSS, GPT_OSS_DRAFTER, cfg, profile("h200"), max_draft_len=9)
    suggested = [p for p in plan.problems if "max_seq_len <= " in p]
    assert suggested, plan.problems
    n = int(suggested[0].split("max_seq_len <= ")[1].split()[0])
    assert n <= GPT_OSS.max_position_embeddings
    batch = int(suggested[0].split("max_batch_size <= ")[1].split()[0])
    assert f"max_batch_size <= {batch} fits at max_seq_len=131072" in suggested[0]
    fits = lambda b: plan_build(GPT_OSS, GPT_OSS_DRAFTER, _cfg(max_batch_size=b, max_seq_len=131072,  # noqa: E731
                                moe_expert_parallel_size=1), profile("h200"), 9).fits
    assert fits(batch) and not fits(batch + 1)


def test_a_cpu_plan_whose_activations_overflow_names_the_settings_that_size_them():
    # The torch runtime's activations are max_batch_size x max_seq_len tokens: max_num_tokens changes nothing there.
    # Qwen3-8B, bf16, 256 rows x 8,192 tokens: activations of 2,097,152 tokens x (4 x 4,096 + (32 + 16) x 128 +
    # 3 x 12,288) x 2 B ~ 249 GB, past the 16 GB of weights and every other item
    qwen = decoder_config_from_dict(bundled_config("Qwen/Qwen3-8B"))
    raw = dict(model="Qwen/Qwen3-8B", hardware="cpu", kv_cache_config={"dtype": "bfloat16"}, speculative_config=None,
               max_batch_size=256, max_seq_len=8192)
    plan = plan_build(qwen, None, _cfg(**raw), profile("cpu"), max_draft_len=0)
    msg = plan.problems[0]
    assert "most of it activations_estimate: change max_seq_len or max_batch_size" in msg, msg
    assert "max_num_tokens" not in msg
    assert "cuda_graph_pools" not in msg  # a CPU has none: not listed as a component of 0.00 GB
    assert plan_build(qwen, None, _cfg(**raw, max_num_tokens=64), profile("cpu"), 0).components == plan.components


def test_the_plan_table_counts_throughput_per_gpu_on_a_gpu_and_per_device_on_a_cpu(tmp_path):
    import yaml

    from dflash_trt.build import prepare_build
    from dflash_trt.build_cli import format_plan

    from tests.conftest import make_target

    tables = {}
    # Qwen3-8B's bundled config, planned with no download, on the GPU; a tiny checkpoint on the CPU (Qwen3-8B's packed
    # copies do not fit a 24 GB machine)
    models = {"cpu": str(make_target(tmp_path / "tiny")), "h200": "Qwen/Qwen3-8B"}
    for hardware in ("cpu", "h200"):
        path = tmp_path / f"{hardware}.yaml"
        path.write_text(yaml.safe_dump({"name": "q", "model": models[hardware], "hardware": hardware,
                                        "dtype": "bfloat16", "max_batch_size": 4, "max_seq_len": 256}))
        tables[hardware] = format_plan(prepare_build(path, allow_bundled=True).plan.to_dict())
    assert "tok/s/device" in tables["cpu"] and "GPU" not in tables["cpu"] and "CUDA-graph" not in tables["cpu"]
    assert "cuda_graph_pools" not in tables["cpu"]
    assert "tok/s/GPU" in tables["h200"] and "CUDA-graph batch sizes" in tables["h200"]
    assert "cuda_graph_pools" in tables["h200"]


def test_a_cpu_plan_counts_the_runtimes_packed_copies_of_the_projections():
    """The CPU runtime holds every projection and the head twice (three times with AMX tiles) and int8 copies of the
    head and the drafter's tables (layers/linear.py): Qwen3-8B's 16.4 GB of weights "fit" a 25 GB machine and took
    about 38 at load."""
    qwen = decoder_config_from_dict(bundled_config("Qwen/Qwen3-8B"))
    raw = dict(model="Qwen/Qwen3-8B", hardware="cpu", kv_cache_config={"dtype": "bfloat16"}, speculative_config=None,
               max_batch_size=1, max_seq_len=256)
    comps = plan_build(qwen, None, _cfg(**raw), profile("cpu"), max_draft_len=0).components
    h, v, layers = qwen.hidden_size, qwen.vocab_size, qwen.num_hidden_layers
    per_layer = 2 * h * (32 * 128) + 2 * h * (8 * 128) + 3 * h * qwen.intermediate_size  # q, o, k, v; the MLP
    projections = (layers * per_layer + v * h) * 2  # bf16, with the head (untied)
    copies = 2 if has_amx_tiles() else 1
    assert comps["packed_weight_copies"] == pytest.approx(projections * copies + v * h, rel=1e-3)


def test_a_cpu_plan_keeps_room_for_a_draft_tree_larger_than_the_drafters_block():
    # The runtime keeps max(block, tree nodes + 1) + 1 positions past a row's last (engine/model_runner.py): here
    # 20 nodes past block 16. Qwen3-8B, 2 rows of 1,024: 36 layers x 8 KV heads x 128 x 2 (K, V) x 2 B = 147,456 B a
    # token, x 2 rows x (1,024 + 21 + 1) = 308,477,952 B (the block alone planned 2 x 1,041 tokens).
    qwen = decoder_config_from_dict(bundled_config("Qwen/Qwen3-8B"))
    drafter = DFlashConfig.from_dict(bundled_config("z-lab/Qwen3-8B-DFlash-b16"))
    raw = dict(model="Qwen/Qwen3-8B", hardware="cpu", kv_cache_config={"dtype": "bfloat16"}, max_batch_size=2,
               max_seq_len=1024, speculative_config={"speculative_model": "z-lab/Qwen3-8B-DFlash-b16",
                                                     "max_draft_len": 15, "draft_tree": {1: 20}})
    plan = plan_build(qwen, drafter, _cfg(**raw), profile("cpu"), max_draft_len=15)
    assert plan.components["target_kv_cache"] == 147_456 * 2 * (1024 + 21 + 1) == 308_477_952


def test_the_drafter_arena_must_fit_in_what_the_kv_caches_carve_leaves():
    # TensorRT-LLM allocates DFlash's context arena at the drafter's first forward, after the KV cache took
    # free_gpu_memory_fraction (0.9 by default) of the free memory. TP8/EP8 with attention DP (every rank holds all 8
    # kv heads), 512 rows x 9,472 tokens: 513 slots x (9,472 + 7 + 1) tokens x 2 x 8 layers x 8 x 64 x 2 B = 79.7 GB,
    # past the ~26 GB the carve leaves, though the KV cache itself fits.
    cfg = _cfg(max_batch_size=512, max_seq_len=9472, tensor_parallel_size=8, moe_expert_parallel_size=8,
               enable_attention_dp=True, max_num_tokens=20000)
    plan = plan_build(GPT_OSS, GPT_OSS_DRAFTER, cfg, profile("b300"), max_draft_len=7)
    c = plan.components
    arena = c["drafter_context_cache"]
    assert arena == 513 * (9472 + 7 + 1) * 2 * 8 * 8 * 64 * 2  # attention DP: all 8 kv heads on every rank
    free = profile("b300").memory_bytes - sum(v for k, v in c.items() if k not in ("target_kv_cache",
                                                                                     "drafter_context_cache"))
    assert plan.kv_cache_budget_bytes == int(free * 0.9)
    assert arena > free - plan.kv_cache_budget_bytes and c["target_kv_cache"] <= plan.kv_cache_budget_bytes
    assert not plan.fits and "allocated after the KV cache took free_gpu_memory_fraction=0.9" in plan.problems[0]
    n = int(plan.problems[0].split("max_batch_size <= ")[1].split()[0])
    fits = lambda b: plan_build(GPT_OSS, GPT_OSS_DRAFTER, _cfg(**{**cfg.model_dump(), "max_batch_size": b}),  # noqa
                                profile("b300"), 7).fits
    assert 1 <= n < 512 and fits(n) and not fits(n + 1)
    # an arena past the whole device is still named as allocated after the KV cache, not as what comes before it
    huge = plan_build(GPT_OSS, GPT_OSS_DRAFTER, _cfg(**{**cfg.model_dump(), "max_seq_len": 131072}), profile("b300"), 7)
    assert not huge.fits and "Before the KV cache" not in huge.problems[0], huge.problems[0]
    assert "drafter's context arena" in huge.problems[0]
    # without attention DP the carve holds the drafter's own KV cache too: it is still what the arena may not overflow
    tp8 = _cfg(max_batch_size=512, max_seq_len=32768, tensor_parallel_size=8, moe_expert_parallel_size=8,
               max_num_tokens=20000)
    plan8 = plan_build(GPT_OSS, GPT_OSS_DRAFTER, tp8, profile("b300"), max_draft_len=7)
    assert not plan8.fits and "context arena" in plan8.problems[0] and "The KV cache" not in plan8.problems[0]
    assert "kv_cache_config.free_gpu_memory_fraction (lower)" in plan8.problems[0]
    # with 31% left to it, the same arena fits (79.7 of 262.1 GB free), and so does the KV cache (178.8 GB: all 36
    # layers at 9,472 tokens, the sliding ones too)
    roomy = _cfg(**{**cfg.model_dump(), "kv_cache_config": {"dtype": "fp8", "free_gpu_memory_fraction": 0.69}})
    assert plan_build(GPT_OSS, GPT_OSS_DRAFTER, roomy, profile("b300"), 7).fits


def test_qwen3_moe_weights_are_its_checkpoints_bytes():
    """Qwen3-Coder-30B-A3B, bf16 on one H200: the plan's target weights are the checkpoint's own total_size
    (model.safetensors.index.json: 61,064,245,248 B), every layer's 128 experts of 768 counted, not the dense
    intermediate_size (5,472) its config.json also lists. With two layers dense (mlp_only_layers) those hold Qwen3's
    MLP of 5,472 instead: 2 x (3 x 2,048 x 5,472 - (128 x 3 x 2,048 x 768 + 2,048 x 128)) x 2 B fewer."""
    raw = bundled_config("Qwen/Qwen3-Coder-30B-A3B-Instruct")
    cfg = dict(model="Qwen/Qwen3-Coder-30B-A3B-Instruct", hardware="h200", kv_cache_config={"dtype": "bfloat16"},
               speculative_config=None, max_batch_size=1, max_seq_len=4096)
    plan = plan_build(decoder_config_from_dict(raw), None, _cfg(**cfg), profile("h200"), max_draft_len=0)
    assert plan.components["target_weights"] == 61_064_245_248
    mixed = decoder_config_from_dict({**raw, "mlp_only_layers": [0, 47]})
    fewer = 2 * (3 * 2048 * 768 * 128 + 2048 * 128 - 3 * 2048 * 5472) * 2
    assert plan_build(mixed, None, _cfg(**cfg), profile("h200"), 0).components["target_weights"] == (
        61_064_245_248 - fewer)
    # experts on no layer: a dense model, as the runtime runs it (no expert parallelism to check, none to plan)
    assert moe_shape(decoder_config_from_dict({**raw, "mlp_only_layers": list(range(48))})) is None


def _qwen3_5_text(config=None) -> dict:
    """Qwen3.5's language model config as transformers writes it (its defaults: every fourth layer full attention),
    in a Qwen3_5ForConditionalGeneration config.json beside a vision tower's."""
    from transformers import Qwen3_5TextConfig

    text = (config or Qwen3_5TextConfig)().to_dict()
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
            "vision_config": {"depth": 27}, "tie_word_embeddings": False}


@pytest.mark.parametrize("moe", [False, True], ids=["Qwen3.5", "Qwen3.5-MoE"])
def test_a_hybrid_targets_weights_are_the_parameters_transformers_builds(moe):
    """Qwen3.5 and Qwen3.5-MoE (bf16 on one H200): the plan's target weights are the language model's parameters as
    transformers counts them, its gated attention's doubled q_proj, its linear layers' own projections and the MoE's
    routed and shared experts included."""
    import torch
    from transformers import (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig,
                              Qwen3_5TextConfig)

    config, model = (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM) if moe else (Qwen3_5TextConfig, Qwen3_5ForCausalLM)
    raw = _qwen3_5_text(config)
    if moe:
        raw.update(architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe")
    with torch.device("meta"):
        params = sum(p.numel() for p in model(config(**raw["text_config"])).parameters())
    cfg = dict(model="Qwen/Qwen3.5-27B", hardware="h200", kv_cache_config={"dtype": "bfloat16"},
               speculative_config=None, max_batch_size=1, max_seq_len=4096)
    plan = plan_build(decoder_config_from_dict(raw), None, _cfg(**cfg), profile("h200"), max_draft_len=0)
    assert plan.components["target_weights"] == pytest.approx(2 * params, rel=1e-4)


@pytest.mark.parametrize("hardware, quantization", [
    ("h200", {"quant_method": "fp8", "weight_block_size": [128, 128]}),
    ("h200", {"quant_method": "modelopt", "quant_algo": "FP8"}),
    ("cpu", {"quant_method": "fp8", "weight_block_size": [128, 128]})])
def test_an_fp8_targets_linears_take_a_byte_a_value_where_tensorrt_llm_keeps_them(hardware, quantization):
    """Qwen3-8B's FP8 release: TensorRT-LLM keeps its decoder layers' linears in FP8, a byte a value, and the
    embeddings, head and norms in bf16 (transformers' count of each); this project's torch runtime dequantizes them
    as it loads them: bf16 throughout."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    raw = {**bundled_config("Qwen/Qwen3-8B"), "quantization_config": quantization}
    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config(**raw))
    linear = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    others = sum(p.numel() for p in model.parameters()) - linear
    cfg = dict(model="Qwen/Qwen3-8B", hardware=hardware, kv_cache_config={"dtype": "bfloat16"},
               speculative_config=None, max_batch_size=1, max_seq_len=4096)
    plan = plan_build(decoder_config_from_dict(raw), None, _cfg(**cfg), profile(hardware), max_draft_len=0)
    want = linear + 2 * others if hardware != "cpu" else 2 * (linear + others)
    assert plan.components["target_weights"] == pytest.approx(want, rel=1e-4)


def test_a_hybrid_targets_cpu_caches_are_what_its_runtime_allocates(tmp_path):
    """K/V for the attention layers only, and for each linear layer a state per row after each position of a
    verify block: the plan's two components sum to the bytes of the cache the runtime makes (2 rows of 64 positions,
    a drafter block of 8)."""
    from dflash_trt.models.registry import load_target
    from tests.conftest import make_drafter
    from tests.models.test_qwen3_5 import make_qwen3_5

    t = make_qwen3_5(tmp_path / "t")
    d = DFlashConfig.from_dict(__import__("json").loads(
        (make_drafter(tmp_path / "d", t, block_size=8, target_layer_ids=(0, 3)) / "config.json").read_text()))
    target = decoder_config_from_dict(__import__("json").loads((t / "config.json").read_text()))
    raw = dict(model=str(t), hardware="cpu", dtype="float32", kv_cache_config={"dtype": "float32"}, max_batch_size=2,
               max_seq_len=64, speculative_config={"speculative_model": str(tmp_path / "d"), "max_draft_len": 7})
    comps = plan_build(target, d, _cfg(**raw), profile("cpu"), max_draft_len=7).components
    cache = load_target(t).make_cache(2, 64 + 8 + 1, queries=8)
    assert comps["target_kv_cache"] + comps["target_recurrent_states"] == cache.nbytes()
    assert comps["target_kv_cache"] == cache.kv.nbytes()
