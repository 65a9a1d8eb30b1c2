"""The roofline step-time model against hand arithmetic on tiny configs, its monotonicity, the acceptance
model, and the Pareto prediction by its definition."""

import dataclasses
import itertools
import math

import pytest

from dflash_trt.config import build_config_from_dict
from dflash_trt.hardware import HardwareProfile, profile
from dflash_trt.model_configs import bundled_config
from dflash_trt.models.config import decoder_config_from_dict
from dflash_trt.models.dflash import DFlashConfig
from dflash_trt.perf_model import PerfModel, expected_experts, fill_tau_table, predict_pareto

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "tie_word_embeddings": False}
TINY_DRAFTER = DFlashConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, intermediate_size=128, block_size=4, mask_token_id=5,
                            target_layer_ids=[0, 1], vocab_size=1000)
# Round numbers so every term below is checkable by hand: 1 GB/s, 1 TFLOP/s, 1 GB/s links, 1 us latency.
HW = HardwareProfile("t", "gpu", 10**12, 8, 0, mem_bandwidth_bytes_s=1e9, dense_flops=1e12, interconnect_bytes_s=1e9,
                     interconnect_latency_s=1e-6, step_overhead_s=1e-3, layer_overhead_s=1e-4, draft_overhead_s=2e-5)


def _cfg(**kw):
    raw = {"name": "t", "model": "x/y", "hardware": "h200", "dtype": "bfloat16", "tensor_parallel_size": 2,
           "max_batch_size": 8, "max_seq_len": 200, "speculative_config": {"speculative_model": "x/d"}}
    raw.update(kw)
    return build_config_from_dict(raw)


def _tiny(hw=HW, target=None, **kw) -> PerfModel:
    return PerfModel(decoder_config_from_dict(target or TINY), TINY_DRAFTER, _cfg(**kw), hw, context_len=100)


def test_target_forward_matches_hand_arithmetic():
    # TP2, bf16. Per rank: q 4x16/2 = 32 outputs, k/v 1 head x 16; per layer q,o 2x64x32 + k,v 2x64x16 = 6,144
    #   + norms 2x64 = 128 + MLP 3x64x128/2 = 12,288 -> 18,560 values = 37,120 B; 2 layers = 74,240 B.
    #   lm_head 1000x64/2 = 32,000 values = 64,000 B (the embedding is a gather: not counted); final norm 128 B.
    # KV: 2 (K,V) x 1 head x 16 x 2 B = 64 B per token per layer; 3 rows x 100 context x 2 layers = 38,400 B.
    c = _tiny().target_cost(batch=3, tokens_per_row=2)
    assert c.bytes == 74_240 + 64_000 + 128 + 38_400 == 176_768
    # FLOPs for 6 tokens: 2 x 18,560 x 2 layers x 6 = 445,440; head 2 x 32,000 x 6 = 384,000;
    #   attention 4 x 2 heads x 16 x (2 layers x 100) x 6 = 153,600.
    assert c.flops == 445_440 + 384_000 + 153_600 == 983_040
    # Two ring all-reduces per layer over 2 ranks of 6 x 64 x 2 B = 768 B: 1 us + 2 x 1/2 x 768 B / 1 GB/s.
    assert c.comm_s == pytest.approx(4 * (1e-6 + 768 / 1e9))
    assert c.overhead_s == pytest.approx(1e-3 + 2 * 1e-4)
    # Memory-bound here (176,768 B / 1 GB/s = 176.8 us against 0.98 us of compute).
    assert c.time(HW) == pytest.approx(1.2e-3 + 176_768 / 1e9 + 4 * 1.768e-6)


def test_drafter_forward_matches_hand_arithmetic():
    # Per rank: layer q,o 2x64x32 + k,v 2x64x16 + MLP 3x64x128/2 + norms 2x64 + q/k norms 2x16 = 18,592;
    #   fc 2 target layers x 64 x 64 = 8,192; 2 norms of 64 = 128 -> 26,912 values = 53,824 B.
    # K=3, 2 rows: block 8 positions; the shared LM head again 64,000 B; context cache
    #   2 rows x (100 + 3 + 1) tokens x 2 (K,V) x 1 layer x 1 head x 16 x 2 B = 13,312 B.
    c = _tiny().drafter_cost(batch=2, k=3)
    assert c.bytes == 53_824 + 64_000 + 13_312
    # FLOPs: 2 x 26,912 x 8 + head 2 x 32,000 x (2 rows x 3 scored) + attention 4 x 2 x 16 x 104 x 8 x 1 layer.
    assert c.flops == 430_592 + 384_000 + 106_496
    assert c.comm_s == pytest.approx(2 * (1e-6 + 8 * 64 * 2 / 1e9))  # 2 all-reduces of 1,024 B, one layer
    assert c.overhead_s == pytest.approx(1e-4 + 2e-5)  # one drafter layer + the speculative step's own cost
    m = _tiny()
    assert m.step_time(2, 3) == pytest.approx(m.target_cost(2, 4).time(HW) + c.time(HW))
    assert m.drafter_cost(2, 0).bytes == 0 and m.step_time(2, 0) == m.target_cost(2, 1).time(HW)


def test_a_draft_vocabulary_prices_only_its_rows_of_the_head():
    # 250 of the 1,000 head rows: 250 x 64 / 2 ranks = 8,000 values = 16,000 B instead of 64,000 B;
    #   head FLOPs 2 x 8,000 x 6 scored positions = 96,000 instead of 384,000. The target's own head is untouched.
    full = _tiny()
    small = dataclasses.replace(full, draft_vocab_size=250)
    assert small.drafter_cost(2, 3).bytes == 53_824 + 16_000 + 13_312
    assert small.drafter_cost(2, 3).flops == 430_592 + 96_000 + 106_496
    assert small.target_cost(2, 4) == full.target_cost(2, 4)


def test_compute_bound_when_flops_are_scarce():
    slow = HardwareProfile("s", "gpu", 10**12, 8, 0, mem_bandwidth_bytes_s=1e12, dense_flops=1e6,
                           interconnect_bytes_s=1e9)
    c = _tiny(hw=slow).target_cost(batch=3, tokens_per_row=2)
    assert c.time(slow) == pytest.approx(983_040 / 1e6 + c.comm_s)  # no overheads in this profile


def test_expected_experts_equals_enumeration():
    # Every way 2 tokens can each pick 2 distinct experts of 4: the mean size of the union.
    pairs = list(itertools.combinations(range(4), 2))
    mean = sum(len(set(a) | set(b)) for a in pairs for b in pairs) / len(pairs) ** 2
    assert expected_experts(4, 2, 2) == pytest.approx(mean) == pytest.approx(3.0)
    assert expected_experts(4, 2, 1) == pytest.approx(2.0)


def test_moe_reads_only_the_experts_the_batch_routes_to():
    moe = {**TINY, "num_local_experts": 4, "num_experts_per_tok": 2}
    m = _tiny(target=moe, moe_expert_parallel_size=2)
    dense = _tiny(target={**TINY, "intermediate_size": 0}, moe_expert_parallel_size=2)  # attention only
    # Per rank: 2 of 4 experts (EP2), one expert 3 x 64 x 128 values x 2 B = 49,152 B (a family without biases,
    # Mixtral's; gpt-oss's are counted below); the router 64 x 4 = 256 values = 512 B per layer, read every step.
    one_expert = 49_152
    for tokens in (1, 3):
        active = 4 * (1 - (1 - 2 / 4) ** tokens) / 2
        extra = m.target_cost(tokens, 1).bytes - dense.target_cost(tokens, 1).bytes
        assert extra == pytest.approx(2 * (active * one_expert + 512)), tokens
    # Expert FLOPs: each token's 2 experts, 2 x 3 x 64 x 128 each, shared by the 2 expert ranks.
    f = m.target_cost(3, 1).flops - dense.target_cost(3, 1).flops
    assert f == pytest.approx(2 * (2 * 3 * 64 * 128 * 3 * 2 / 2 + 2 * 256 * 3))
    # gpt-oss's experts and router have biases: (2 x 128 + 64) x 2 B = 640 B an expert, 4 values (8 B) the router's
    oss = {**moe, "model_type": "gpt_oss"}
    gap = _tiny(target=oss, moe_expert_parallel_size=2).target_cost(1, 1).bytes - m.target_cost(1, 1).bytes
    sinks = 2 * (4 // 2) * 2  # (and its attention sinks: a value per head of the rank's 2 (TP2), per layer)
    assert gap == pytest.approx(2 * (4 * (1 - (1 - 2 / 4)) / 2 * 640 + 8) + sinks)


def test_attention_dp_gathers_every_ranks_tokens_for_the_experts():
    moe = {**TINY, "num_local_experts": 4, "num_experts_per_tok": 2}
    m = _tiny(target=moe, enable_attention_dp=True, moe_expert_parallel_size=2)
    assert m.dp == 2
    # 5 rows x 1 token on each of 2 ranks: gather and scatter 10 tokens x 64 x 2 B = 1,280 B per layer,
    # each moving (p-1)/p of it: 2 layers x 2 x (1 us + 640 B / 1 GB/s).
    assert m.target_cost(5, 1).comm_s == pytest.approx(4 * (1e-6 + 640 / 1e9))
    assert m.drafter_cost(5, 3).comm_s == 0  # the drafter is replicated under attention DP


def test_step_time_grows_with_batch_draft_length_and_context():
    t = decoder_config_from_dict(bundled_config("openai/gpt-oss-120b"))
    d = DFlashConfig.from_dict(bundled_config("z-lab/gpt-oss-120b-DFlash"))
    for kw in ({"enable_attention_dp": False}, {"enable_attention_dp": True}):
        cfg = build_config_from_dict({"name": "t", "model": "openai/gpt-oss-120b", "hardware": "b300",
                                      "tensor_parallel_size": 8, "moe_expert_parallel_size": 8, "max_batch_size": 512,
                                      "max_seq_len": 8192, "kv_cache_config": {"dtype": "fp8"},
                                      "speculative_config": {"speculative_model": "z-lab/gpt-oss-120b-DFlash"}, **kw})
        m = PerfModel(t, d, cfg, profile("b300"), context_len=2048)
        grid = {(b, k, ctx): m.step_time(b, k, ctx) for b in (1, 2, 8, 64, 512) for k in (0, 1, 3, 9)
                for ctx in (128, 2048, 8192)}
        for (b, k, ctx), s in grid.items():
            for (b2, k2, ctx2), s2 in grid.items():
                if b <= b2 and k <= k2 and ctx <= ctx2 and (b, k, ctx) != (b2, k2, ctx2):
                    assert s < s2, ((b, k, ctx), (b2, k2, ctx2))


def test_tau_table_from_one_measured_point():
    # One published point (K=9, tau 4.4) -> alpha with 1 + a + ... + a^9 = 4.4, and every other K from it.
    table, alpha = fill_tau_table({9: 4.4}, 9)
    assert table[9] == 4.4 and sum(alpha**i for i in range(10)) == pytest.approx(4.4, abs=1e-3)
    assert table[3] == pytest.approx(1 + alpha + alpha**2 + alpha**3)
    assert all(table[k] < table[k + 1] for k in range(1, 9))


def test_a_modelled_tau_stays_between_its_measured_neighbours():
    # The one-alpha fit through tau(3) = 2.5 and tau(15) = 6.0 puts tau(2) at ~2.53, above the measured tau(3); a
    # longer draft never accepts fewer tokens, so the table rises with K through the measured points.
    table, alpha = fill_tau_table({3: 2.5, 15: 6.0}, 15)
    assert 1 + alpha + alpha**2 > 2.5  # the fit alone breaks the order
    assert table[3] == 2.5 and table[15] == 6.0 and table[2] == 2.5
    assert all(table[k] <= table[k + 1] for k in range(1, 15))
    assert all(2.5 <= table[k] <= 6.0 for k in range(4, 15))


def test_predict_pareto_by_its_definition():
    m = _tiny(enable_attention_dp=True)  # 2 attention-DP ranks: concurrency 5 puts 3 rows on a rank
    points = predict_pareto(m, {3: 2.5}, [1, 5])
    assert [(p.concurrency, p.batch_size, p.draft_len) for p in points] == [(1, 1, 0), (1, 1, 3), (5, 3, 0), (5, 3, 3)]
    p = points[3]
    assert p.step_time_s == m.step_time(3, 3) and p.tau == 2.5
    assert p.tok_s_user == pytest.approx(2.5 / p.step_time_s)
    assert p.tok_s_gpu == pytest.approx(5 * 2.5 / p.step_time_s / 2)
    assert math.isclose(points[2].tok_s_user, 1 / m.step_time(3, 0))


def _plan(tau: dict[int, float], k: int = 3):
    from dflash_trt.perf_model import plan_performance

    cfg = _cfg(tensor_parallel_size=1, max_batch_size=64, speculative_config={
        "speculative_model": "x/d", "max_draft_len": k, "draft_len_schedule": "auto", "acceptance_by_draft_len": tau})
    return plan_performance(decoder_config_from_dict(TINY), TINY_DRAFTER, cfg, HW, k, [])


def test_a_gpu_schedules_k1_floor_is_noted_where_plain_decoding_is_predicted_faster():
    """A GPU build drafts K >= 1 at every batch size (TensorRT-LLM's DFlash must not draft K=0); where the model
    predicts that K below plain decoding the build says so (it claimed "0 where drafting stops paying")."""
    perf = _plan({1: 1.3}, k=1)
    m = PerfModel(decoder_config_from_dict(TINY), TINY_DRAFTER, _cfg(tensor_parallel_size=1, max_batch_size=64), HW,
                  context_len=100)
    losing = [b for b in range(1, 65) if 1.3 / m.step_time(b, 1) < 1 / m.step_time(b, 0)]
    assert losing and losing != list(range(1, 65)) and set(perf.schedule.values()) == {1}
    (note,) = [n for n in perf.notes if "below plain decoding" in n]
    assert f"at batch sizes {losing[0]} (K=1, " in note and f", {losing[-1]} (K=1, " in note
    assert note.count("(K=1, ") == len(losing)
    assert not [n for n in _plan({1: 1.9}, k=1).notes if "below plain decoding" in n]  # K=1 pays at every size there


def test_the_floor_note_names_the_k_each_batch_size_runs():
    """Where every K >= 1 loses, the chooser may keep K=2 or more: the note names that K and its own loss."""
    from dflash_trt.draft_schedule import expand
    from dflash_trt.perf_model import _floor_notes

    taus, sizes = {1: 1.3, 2: 2.1, 3: 2.5}, [1, 64]
    steps = {(1, k): 1.0 + 0.01 * k for k in range(4)} | {(64, k): 1.0 * (k + 1) for k in range(4)}  # compute-bound
    schedule = {1: 3, 64: 2}
    assert expand(schedule, 64) == 2
    (note,) = _floor_notes("auto", HW, schedule, sizes, taus, steps)
    assert "at batch size 64 (K=2, 30%)" in note  # 1 - 2.1 / 3


def test_a_measured_tau_that_falls_with_k_is_noted():
    notes = _plan({2: 2.5, 3: 2.1}).notes
    assert any("acceptance_by_draft_len falls from K=2 (tau 2.5) to K=3 (tau 2.1)" in n for n in notes)
    assert not [n for n in _plan({2: 2.1, 3: 2.5}).notes if "falls" in n]
    # below a shorter draft that is not its neighbour too
    (note,) = [n for n in _plan({1: 2.0, 2: 1.8, 3: 1.9}).notes if "falls" in n and "K=3" in n]
    assert "falls from K=1 (tau 2.0) to K=3 (tau 1.9)" in note
