"""The gpt-oss target against transformers' GptOssForCausalLM (eager attention, fp32) on tiny random
configs with both attention kinds, 8 experts, top-2, a window of 8 and contexts well past it; MXFP4
experts against transformers' own dequantization; DFlash on top stays lossless."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig, GptOssForCausalLM
from transformers.generation.logits_process import (LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from dflash_trt import SamplingParams
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine
from dflash_trt.kernels import cpu_ops
from dflash_trt.layers.attention import AttentionMetadata
from dflash_trt.layers.linear import PackedLinear
from dflash_trt.models.config import decoder_config_from_dict
from dflash_trt.models.dflash import load_drafter
from dflash_trt.models.gpt_oss import GptOssParams
from dflash_trt.models.mxfp4 import dequantize_mxfp4, expert_range, quantize_mxfp4
from dflash_trt.models.registry import load_target
from dflash_trt.models.weights import CheckpointError
from dflash_trt.spec.context_lookup import ContextLookup
from tests.conftest import (EOS, VOCAB, bf16_kernels_serve, make_drafter, needs_bf16_kernels,
                            save_tiny_model)
from tests.forced_drafts import force_drafts, force_lookup_drafts, force_tree_drafts

TOL = 1e-4  # fp32
WINDOW = 8
HIDDEN = 64
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False, "rope_theta": 10000.0}


def make_gpt_oss(path: Path, seed: int = 0, layers: int = 4, **overrides) -> Path:
    """A random gpt-oss saved by transformers. Weights are scaled so that every feature matters: biases and
    sinks non-zero, expert pre-activations past the SwiGLU clamp (7.0), router logits far from ties."""
    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
              sliding_window=WINDOW, max_position_embeddings=128, rope_parameters=YARN, eos_token_id=EOS,
              bos_token_id=1, tie_word_embeddings=False)
    kw.update(overrides)
    model = GptOssForCausalLM(GptOssConfig(**kw)).eval()
    assert model.config._attn_implementation == "eager"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0, 0.5)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0, 0.6)
            elif name.endswith("router.weight"):
                p.normal_(0, 0.5)
    return save_tiny_model(model, path, VOCAB)


def _meta(ids, start=0, rows=None):
    b, n = ids.shape
    rows = torch.arange(b) if rows is None else rows
    return AttentionMetadata.causal_step(rows, start + torch.arange(n).expand(b, n))


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory) -> Path:
    return make_gpt_oss(tmp_path_factory.mktemp("gpt_oss") / "t")


@pytest.fixture(scope="module")
def hf_model(gpt_oss_dir):
    return GptOssForCausalLM.from_pretrained(gpt_oss_dir).eval()


def test_logits_and_captured_layers_equal_transformers(gpt_oss_dir, hf_model):
    ours = load_target(gpt_oss_dir)
    assert ours.params.layer_types == ("sliding_attention", "full_attention") * 2
    ids = torch.randint(0, VOCAB, (2, 45))  # 5x the window, past original_max_position_embeddings (YaRN matters)
    with torch.no_grad():
        ref = hf_model(ids, output_hidden_states=True)
        hidden, feats = ours(ids, _meta(ids), ours.make_cache(2, 48), capture_layer_ids=(2, 0, 3))
        logits = ours.compute_logits(hidden)
    assert (logits - ref.logits).abs().max() < TOL
    # layer l's output is transformers' hidden_states[l + 1], the last layer's after the final norm; features
    # concatenate in the given order
    assert (feats[..., :HIDDEN] - ref.hidden_states[3]).abs().max() < TOL
    assert (feats[..., HIDDEN:2 * HIDDEN] - ref.hidden_states[1]).abs().max() < TOL
    assert (feats[..., 2 * HIDDEN:] - ref.hidden_states[4]).abs().max() < TOL


def test_incremental_decode_past_the_window_equals_transformers(gpt_oss_dir, hf_model):
    """Chunks after a prefill read only the window on sliding layers; logits still equal the full forward."""
    ours = load_target(gpt_oss_dir)
    ours.pack_for_inference()  # prepacked experts and projections are exact too
    ids = torch.randint(0, VOCAB, (1, 40))
    with torch.no_grad():
        ref = hf_model(ids).logits
        cache = ours.make_cache(1, 48)
        ours(ids[:, :19], _meta(ids[:, :19]), cache)
        parts = [ours.compute_logits(ours(ids[:, i : i + 7], _meta(ids[:, i : i + 7], i), cache)[0]) for i in (19, 26, 33)]
    assert (torch.cat(parts, 1) - ref[:, 19:]).abs().max() < TOL


def test_rollback_across_the_window_boundary_is_exact(gpt_oss_dir, hf_model):
    """Row 2 writes a rejected block that crosses a window boundary (positions 20..29 with window 8), then
    continues from 20 in a batch with row 0; both equal transformers on the true sequences."""
    ours = load_target(gpt_oss_dir)
    a, b = torch.randint(0, VOCAB, (1, 30)), torch.randint(0, VOCAB, (1, 20))
    with torch.no_grad():
        cache = ours.make_cache(3, 48)
        ours(a, _meta(a, rows=torch.tensor([0])), cache)
        ours(b, _meta(b, rows=torch.tensor([2])), cache)
        junk = torch.randint(0, VOCAB, (1, 10))
        ours(junk, _meta(junk, 20, rows=torch.tensor([2])), cache)
        nxt = torch.randint(0, VOCAB, (2, 4))
        meta = AttentionMetadata.causal_step(torch.tensor([0, 2]), torch.tensor([[30, 31, 32, 33], [20, 21, 22, 23]]))
        got = ours.compute_logits(ours(nxt, meta, cache)[0])
        ref0 = hf_model(torch.cat([a, nxt[:1]], 1)).logits[0, 30:]
        ref2 = hf_model(torch.cat([b, nxt[1:]], 1)).logits[0, 20:]
    assert (got[0] - ref0).abs().max() < TOL
    assert (got[1] - ref2).abs().max() < TOL


def test_params_default_like_transformers_when_config_json_omits_them():
    """A config.json without layer_types / rope / bias / eps keys gets transformers' GptOssConfig defaults."""
    raw = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 96, "hidden_size": 64,
           "intermediate_size": 32, "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2}
    hf = GptOssConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    p = GptOssParams.from_config(decoder_config_from_dict(raw))
    assert list(p.layer_types) == hf.layer_types
    assert p.sliding_window == hf.sliding_window and p.rms_norm_eps == hf.rms_norm_eps
    assert p.attention_bias is hf.attention_bias is True
    assert (p.swiglu_alpha, p.swiglu_limit) == (hf.swiglu_alpha, hf.swiglu_limit)
    assert {k: float(v) if isinstance(v, int) else v for k, v in p.rope.items()} == hf.rope_parameters
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        GptOssParams.from_config(decoder_config_from_dict({**raw, "num_experts_per_tok": 9}))


@pytest.mark.parametrize("change, named", [
    ({"sliding_window": "8"}, "'sliding_window' must be a whole number"),  # transformers refuses these; int() took them
    ({"sliding_window": 0}, "'sliding_window' must be >= 1"),  # was read as no window at all
    ({"num_experts_per_tok": "2"}, "'num_experts_per_tok' must be a whole number"),
    ({"num_local_experts": 8.5}, "'num_local_experts' must be a whole number"),
    ({"swiglu_limit": "7"}, "'swiglu_limit' must be a number"),
    ({"attention_bias": "false"}, "'attention_bias' must be true or false"),
])
def test_params_of_the_wrong_kind_are_refused_naming_the_key(change, named):
    raw = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 96, "hidden_size": 64,
           "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2}
    with pytest.raises(ValueError, match=named):
        GptOssParams.from_config(decoder_config_from_dict({**raw, **change}))


# ---- MXFP4 experts ------------------------------------------------------------------------------------


def test_mxfp4_dequantization_equals_transformers():
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=g)  # every nibble code
    scales = torch.randint(100, 150, (3, 10, 4), dtype=torch.uint8, generator=g)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 128, 10]: transposed for HF
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), ref.transpose(1, 2))
    # quantizing a dequantized tensor is exact (its values are on the grid), so the quantizer is consistent
    w = dequantize_mxfp4(blocks, scales, torch.float32)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(w), torch.float32), w)


def _to_mxfp4_checkpoint(src: Path, dst: Path) -> Path:
    """Rewrite a bf16/fp32 gpt-oss checkpoint with MXFP4 experts, in the layout the released checkpoints use."""
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(name).transpose(1, 2).contiguous()  # HF [E, in, out] -> [E, out, in]: blocks run along `in`
        tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(w)
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": None}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def mxfp4_dir(gpt_oss_dir, tmp_path_factory) -> Path:
    return _to_mxfp4_checkpoint(gpt_oss_dir, tmp_path_factory.mktemp("mxfp4") / "t")


def test_an_mxfp4_checkpoints_headers_alone_load_into_the_meta_model_and_name_what_is_missing(mxfp4_dir, tmp_path):
    """A GPU build's check of a checkpoint it does not read (dflash_trt/build.py _check_tensors)."""
    import shutil

    from dflash_trt.models.config import read_config_json
    from dflash_trt.models.registry import runtime_class
    from dflash_trt.models.weights import WeightSet

    cfg = decoder_config_from_dict(read_config_json(mxfp4_dir))
    with torch.device("meta"):
        model = runtime_class(cfg, "config.json")(cfg)
    model.load_weights(WeightSet(mxfp4_dir, headers_only=True))
    broken = tmp_path / "t"
    shutil.copytree(mxfp4_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    name = next(n for n in tensors if n.endswith("down_proj_blocks"))
    del tensors[name]
    save_file(tensors, broken / "model.safetensors")
    with torch.device("meta"):
        model = runtime_class(cfg, "config.json")(cfg)
    with pytest.raises(CheckpointError, match=f"or '{name}' \\(MXFP4\\)"):
        model.load_weights(WeightSet(broken, headers_only=True))


def test_mxfp4_checkpoint_gives_transformers_logits(mxfp4_dir):
    # On a CPU, transformers dequantizes MXFP4 experts on load: that is the oracle.
    hf = GptOssForCausalLM.from_pretrained(mxfp4_dir, dtype=torch.float32).eval()
    ours = load_target(mxfp4_dir)
    hf_gu = hf.model.layers[1].mlp.experts.gate_up_proj  # [E, H, 2I], gate/up interleaved
    assert torch.equal(ours.layers[1].mlp.experts.gate_up_proj[:, :32], hf_gu[..., 0::2].transpose(1, 2))
    ids = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours.compute_logits(ours(ids, _meta(ids), ours.make_cache(2, 24))[0])
    assert (got - ref).abs().max() < TOL


@pytest.mark.parametrize("ep_size", [2, 4])
def test_expert_parallel_ranks_load_their_experts_and_sum_to_the_full_layer(mxfp4_dir, ep_size):
    from dflash_trt.models.config import read_config_json
    from dflash_trt.models.gpt_oss import GptOssForCausalLM as Ours
    from dflash_trt.models.weights import WeightSet

    cfg = decoder_config_from_dict(read_config_json(mxfp4_dir))
    full = load_target(mxfp4_dir)
    x = torch.randn(3, 5, HIDDEN)
    partial = torch.zeros_like(x)
    with torch.no_grad():
        for rank in range(ep_size):
            model = Ours(cfg, ep_rank=rank, ep_size=ep_size)
            model.load_weights(WeightSet(mxfp4_dir))
            held = expert_range(8, rank, ep_size)
            assert model.experts == held and len(held) == 8 // ep_size
            mine = model.layers[2].mlp.experts.down_proj
            assert torch.equal(mine, full.layers[2].mlp.experts.down_proj[held.start : held.stop])
            partial += model.layers[2].mlp.forward_local(x)
        want = full.layers[2].mlp(x)
    assert (partial - want).abs().max() < 1e-5
    with pytest.raises(ValueError, match="not divisible by ep_size=3"):
        expert_range(8, 0, 3)


def test_missing_expert_tensor_is_named(gpt_oss_dir, tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    tensors = load_file(str(gpt_oss_dir / "model.safetensors"))
    del tensors["model.layers.3.mlp.experts.down_proj"]
    save_file(tensors, str(d / "model.safetensors"))
    (d / "config.json").write_text((gpt_oss_dir / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.mlp\.experts\.down_proj"):
        load_target(d)


# ---- DFlash on a gpt-oss target ----------------------------------------------------------------------

NEW = 30  # prompts of 5..30 tokens + 30 new: several windows of 8


@pytest.fixture(scope="module")
def gpt_oss_drafter(gpt_oss_dir, tmp_path_factory) -> Path:
    # The gpt-oss drafter shape (z-lab/gpt-oss-120b-DFlash config.json): attention_bias, YaRN, block 10.
    return make_drafter(tmp_path_factory.mktemp("gpt_oss_drafter") / "d", gpt_oss_dir, layers=2, block_size=10,
                        target_layer_ids=(0, 2, 3), attention_bias=True,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})


def _prompts(n, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (length,), generator=g).tolist() for length in (5, 17, 9, 30)[:n]]


_oracle: dict = {}  # transformers' continuations, computed once per test module (one hf_model)


def _hf_greedy(hf, prompt):
    if (key := tuple(prompt)) not in _oracle:
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                          eos_token_id=None)
        _oracle[key] = out[0, len(prompt):].tolist()
    return _oracle[key]


def _engine(target_dir, drafter_dir, k, rows, **cfg):
    target = load_target(target_dir)
    drafter = load_drafter(drafter_dir, target.config)
    assert drafter.config.attention_bias and drafter.config.rope["rope_type"] == "yarn"
    return LLMEngine(target, None, drafter, EngineConfig(max_batch_size=rows, max_draft_len=k, max_model_len=96, **cfg))


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculative_equals_target_greedy(gpt_oss_dir, gpt_oss_drafter, hf_model, batch):
    prompts = _prompts(batch)
    refs = [_hf_greedy(hf_model, p) for p in prompts]
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    outs = _engine(gpt_oss_dir, gpt_oss_drafter, 9, batch).generate(prompts, params)
    assert [o.token_ids for o in outs] == refs
    # Mostly-right drafts: multi-token acceptances and rollbacks that cross window boundaries.
    engine = _engine(gpt_oss_dir, gpt_oss_drafter, 9, batch)
    force_drafts(engine, {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))}, error_rate=0.15)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == refs
    assert max(max(o.acceptance_lengths) for o in outs) >= 4


def test_greedy_draft_trees_equal_target_greedy_across_window_boundaries(gpt_oss_dir, gpt_oss_drafter, hf_model):
    """Tree verification through the torch path's mask: sliding-window layers and attention sinks, nodes rotated at
    their depths; accepted paths off the chain move their K/V."""
    prompts = _prompts(2)
    refs = [_hf_greedy(hf_model, p) for p in prompts]
    engine = _engine(gpt_oss_dir, gpt_oss_drafter, 4, 2, draft_tree={2: 9})
    force_tree_drafts(engine, {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))})
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    assert max(max(o.acceptance_lengths) for o in outs) >= 4


class _PositionalInverseCdf(LogitsProcessor):
    """transformers' scores shaped by its own temperature / top-k / top-p warpers and sampled by inverse CDF, the
    token at output position p with the p-th float32 draw of PCG64(SeedSequence(2 * seed)) (layers/sampler.py
    PositionalUniforms' documented stream; tests/engine/test_lossless.py hf_sample, with truncation). It leaves
    only its sample for greedy generate to pick, so the oracle decodes with transformers' KV cache."""

    def __init__(self, prompt_len, seed, temperature, top_k, top_p):
        self.prompt_len = prompt_len
        self.u = np.random.Generator(np.random.PCG64(np.random.SeedSequence(2 * seed))).random(NEW, dtype=np.float32)
        self.warpers = [TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else [])
        self.warpers += [TopPLogitsWarper(top_p)] if top_p < 1.0 else []

    def __call__(self, input_ids, scores):
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        cdf = torch.softmax(scores.float(), -1)[0].cumsum(-1)
        u = float(self.u[input_ids.shape[1] - self.prompt_len])
        token = min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)), len(cdf) - 1)
        return torch.full_like(scores, float("-inf")).index_fill_(-1, torch.tensor([token]), 0.0)


def _hf_sample(hf, prompt, seed, temperature, top_k=0, top_p=1.0):
    """transformers' own seeded sample of NEW tokens (the oracle)."""
    key = (tuple(prompt), seed, temperature, top_k, top_p)
    if key not in _oracle:
        sampler = _PositionalInverseCdf(len(prompt), seed, temperature, top_k, top_p)
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                          eos_token_id=None, logits_processor=LogitsProcessorList([sampler]))
        _oracle[key] = out[0, len(prompt):].tolist()
    return _oracle[key]


@pytest.mark.parametrize("drafts, temperature, top_k, top_p", [
    ("chain", 1.0, 0, 1.0), ("tree with lookups", 1.0, 0, 1.0), ("tree with lookups", 0.8, 12, 0.9)])
def test_a_seeded_match_sample_is_transformers_own_sample(gpt_oss_dir, gpt_oss_drafter, hf_model, monkeypatch,
                                                          drafts, temperature, top_k, top_p):
    """Under the "match" rule a seeded request's tokens are the target's own samples with the seed's positional
    uniforms, whatever each step drafted: through chains that are mostly right and trees with context lookup
    branches, whose accepted and rejected blocks cross window boundaries. Drafts are forced to the oracle's tokens
    (with errors), so most are accepted: the engine's target sampled what transformers sampled."""
    prompts, seeds = _prompts(2), [7, 2**40 + 3]
    refs = [_hf_sample(hf_model, p, s, temperature, top_k, top_p) for p, s in zip(prompts, seeds)]
    truth = {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))}
    lookups = []
    if drafts == "chain":
        engine = _engine(gpt_oss_dir, gpt_oss_drafter, 4, 2)
        force_drafts(engine, truth, error_rate=0.2)
    else:
        engine = _engine(gpt_oss_dir, gpt_oss_drafter, 4, 2, draft_tree={2: 9}, lookup_nodes=4)
        force_tree_drafts(engine, truth)
        force_lookup_drafts(engine, truth)
        lookups = _recorded_lookups(monkeypatch)
    params = [SamplingParams(max_new_tokens=NEW, temperature=temperature, top_k=top_k, top_p=top_p, seed=s,
                             ignore_eos=True) for s in seeds]
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == refs
    assert min(o.tau for o in outs) > 1.5  # speculation ran: most forced drafts were the target's samples
    assert drafts == "chain" or max(a for _, a in lookups) >= 2


def _recorded_lookups(monkeypatch) -> list:
    """Every (verified, accepted) depth the engine reports to a request's context lookup."""
    seen, real = [], ContextLookup.observe

    def observe(self, verified, accepted):
        seen.append((verified, accepted))
        real(self, verified, accepted)

    monkeypatch.setattr(ContextLookup, "observe", observe)
    return seen


class _EveryOtherStep:
    """A stand-in for AdaptiveDraftLen that drafts on every other step and runs plain K=0 steps in between."""

    def __init__(self):
        self.steps: list[int] = []

    def choose(self, batch_size, k):
        self.steps.append(k if len(self.steps) % 2 == 0 else 0)
        return self.steps[-1]

    def observe(self, batch_size, k, step_s, tokens, catch_up=False):
        pass


def test_greedy_with_context_lookups_and_plain_steps_between_equals_target_greedy(gpt_oss_dir, gpt_oss_drafter,
                                                                                   hf_model, monkeypatch):
    """Trees with context lookup branches, and plain steps between them as adaptive_draft_len would choose by
    timing (their features queued for the next speculative step): transformers' greedy tokens."""
    prompts = _prompts(2)
    refs = [_hf_greedy(hf_model, p) for p in prompts]
    engine = _engine(gpt_oss_dir, gpt_oss_drafter, 4, 2, draft_tree={2: 9}, lookup_nodes=4, adaptive_draft_len=True)
    engine.adaptive = schedule = _EveryOtherStep()
    truth = {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))}
    force_tree_drafts(engine, truth)
    force_lookup_drafts(engine, truth)
    lookups = _recorded_lookups(monkeypatch)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    assert 0 in schedule.steps and min(o.tau for o in outs) > 1.5
    assert max(a for _, a in lookups) >= 2 and any(0 < a < v for v, a in lookups)


@needs_bf16_kernels
def test_bf16_steps_compute_each_token_alike_whatever_their_shape(tmp_path, monkeypatch):
    """One-token decode steps and one verify block over the same cache give bit-identical bf16 logits at every
    position, for 4 rows, on sliding and full layers past the window: the experts (whichever rows route to one) and
    attention with its sinks run through the CPU kernels, each row computed alike whatever shares the call (torch's
    attention takes other ops for one-token steps and for blocks). oneDNN's experts rounded a verify row apart from a
    one-token step's, and greedy speculative output parted from plain decoding's at near-ties (at gpt-oss-20b's width,
    tokens 10 and 25 of 64). gpt-oss's hidden size and attention heads (2,880; 16 of 64 over 4 KV heads here):
    narrower shapes happened to round alike."""
    d = make_gpt_oss(tmp_path / "t", layers=2, hidden_size=2880, intermediate_size=256, num_attention_heads=16,
                     num_key_value_heads=4, head_dim=64)
    ours = load_target(d, dtype=torch.bfloat16)
    ours.pack_for_inference()
    ids = torch.randint(3, 90, (4, 28), generator=torch.Generator().manual_seed(0))
    attended = []  # queries each kernel attention call took with the sinks
    real = cpu_ops.CpuOps.cached_attention
    monkeypatch.setattr(cpu_ops.CpuOps, "cached_attention", lambda self, q, *a, sinks=None, **kw: attended.append(
        (len(q), sinks is not None)) or real(self, q, *a, sinks=sinks, **kw))
    with torch.no_grad():
        cache = ours.make_cache(4, 32)
        ours(ids[:, :20], _meta(ids[:, :20]), cache)
        block = ours.compute_logits(ours(ids[:, 20:28], _meta(ids[:, 20:28], 20), cache)[0])
        steps = [ours.compute_logits(ours(ids[:, i : i + 1], _meta(ids[:, i : i + 1], i), cache)[0])
                 for i in range(20, 28)]
    assert torch.equal(torch.cat(steps, 1), block)
    assert attended[-2 * 9:] == [(32, True)] * 2 + [(4, True)] * 2 * 8  # the block, then the steps: 2 layers each


@needs_bf16_kernels
@pytest.mark.parametrize("k, batch, forced, temperature", [(3, 1, "", 0.0), (7, 4, "chain", 0.0),
                                                           (3, 2, "tree", 0.0), (3, 2, "tree", 1.0),
                                                           (9, 1, "tree of 24", 0.0)])
def test_bf16_speculative_equals_bf16_plain_decoding(gpt_oss_dir, gpt_oss_drafter, k, batch, forced, temperature):
    """End to end in bf16, greedy and seeded samples ("match" rule: the target samples each token with the seed's
    positional uniform, in verify steps as in one-token ones): the same runtime's plain decoding, one token a step, is
    the oracle. Forced drafts (from the plain output: chains 15% corrupted, or 5-node trees with context lookups) make
    most verify blocks accept several tokens and roll back. A tree of 24 nodes verifies more queries a row than the
    kernels' attention takes by default (16): it ran through SDPA and parted from plain decoding."""
    prompts = _prompts(batch)
    params = [SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=temperature, seed=i)
              for i in range(batch)]
    target = load_target(gpt_oss_dir, torch.bfloat16)
    plain_engine = LLMEngine(target, None, None, EngineConfig(max_batch_size=batch, max_model_len=96,
                                                               dtype="bfloat16", speculative=False))
    plain = plain_engine.generate(prompts, params)
    target = load_target(gpt_oss_dir, torch.bfloat16)
    drafter = load_drafter(gpt_oss_drafter, target.config, torch.bfloat16)
    tree = {"draft_tree": {batch: 5}, "lookup_nodes": 3} if forced == "tree" else {}
    if forced == "tree of 24":
        tree = {"draft_tree": {batch: 24}}
    engine = LLMEngine(target, None, drafter, EngineConfig(max_batch_size=batch, max_draft_len=k, max_model_len=96,
                                                           dtype="bfloat16", **tree))
    assert engine.exact_rows is not None
    truth = {i: p + o.token_ids for i, (p, o) in enumerate(zip(prompts, plain))}
    if forced.startswith("tree"):
        force_tree_drafts(engine, truth)
        if forced == "tree":
            force_lookup_drafts(engine, truth)
    elif forced:
        force_drafts(engine, truth, error_rate=0.15)
    outs = engine.generate(prompts, params)
    for o, ref in zip(outs, plain):
        assert o.token_ids == ref.token_ids
        if forced:
            assert o.tau > 1.5


@needs_bf16_kernels
def test_a_bf16_engine_keeps_its_steps_within_its_attention_projections_reach(gpt_oss_dir, gpt_oss_drafter):
    """The router takes the kernel without oneDNN's copy, reaching at least AMX tiles' 128 rows: a router of 32
    experts (gpt-oss-20b) cannot take the tiles (widths of 64), and left on oneDNN past 32 rows it cut every step to
    32 rows where the attention's projections reach 128. A step's rows are kept within the projections' reach."""
    target = load_target(gpt_oss_dir, torch.bfloat16)
    drafter = load_drafter(gpt_oss_drafter, target.config, torch.bfloat16)
    engine = LLMEngine(target, None, drafter, EngineConfig(max_batch_size=4, max_draft_len=3, max_model_len=96,
                                                           dtype="bfloat16"))
    reach = target.layers[0].self_attn.qkv_proj.kernel_max_rows
    for layer in target.layers:
        router = layer.mlp.router
        assert isinstance(router, PackedLinear) and router.packed is None and router.kernel_max_rows >= reach
    assert engine.exact_rows == reach


def test_a_bf16_cpu_engine_without_the_kernels_says_its_verify_steps_round_apart(gpt_oss_dir, gpt_oss_drafter,
                                                                                 caplog, monkeypatch):
    """Without the CPU kernels (no compiler, or DFLASH_TRT_CPU_KERNELS=0) the experts and attention take oneDNN's
    and torch's ops, whose verify rows round apart from a one-token step's: in bf16 a greedy answer can part from
    plain decoding's at a near-tie, which the engine says; with the kernels (where they serve bf16) it need not."""
    cases = [(torch.bfloat16, True, True), (torch.float32, True, False)]
    if bf16_kernels_serve():
        cases.append((torch.bfloat16, False, False))
    kernels = cpu_ops.load
    for dtype, no_kernels, warned in cases:
        caplog.clear()
        monkeypatch.setattr(cpu_ops, "load", (lambda: None) if no_kernels else kernels)
        target = load_target(gpt_oss_dir, dtype)
        drafter = load_drafter(gpt_oss_drafter, target.config, dtype)
        with caplog.at_level("WARNING", logger="dflash_trt"):
            LLMEngine(target, None, drafter, EngineConfig(max_batch_size=1, max_draft_len=3, max_model_len=96,
                                                          dtype=str(dtype).removeprefix("torch.")))
        assert ("can part from plain greedy output" in caplog.text) == warned, (dtype, no_kernels)


def test_a_gpt_oss_drafter_that_is_not_qwen3_style_fails_clearly(gpt_oss_dir, gpt_oss_drafter, tmp_path):
    bad = tmp_path / "d"
    bad.mkdir()
    cfg = json.loads((gpt_oss_drafter / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_oss"}))
    (bad / "model.safetensors").write_bytes((gpt_oss_drafter / "model.safetensors").read_bytes())
    target = load_target(gpt_oss_dir)
    with pytest.raises(CheckpointError, match="model_type='gpt_oss' is not supported"):
        load_drafter(bad, target.config)


def test_bundled_gpt_oss_120b_config_builds_the_published_shape():
    """The planner's bundled config.json (dflash_trt/model_configs) is the one description of gpt-oss-120b:
    built from it on the meta device, this runtime has transformers' parameter count (116.8B per OpenAI's
    model card) and the bundled DFlash drafter pairs with it."""
    from transformers import GptOssConfig

    from dflash_trt.model_configs import bundled_config
    from dflash_trt.models.dflash import DFlashConfig
    from dflash_trt.models.gpt_oss import GptOssForCausalLM as Ours

    raw = bundled_config("openai/gpt-oss-120b")
    cfg = decoder_config_from_dict(raw)
    with torch.device("meta"):
        ours = Ours(cfg)
        hf = GptOssForCausalLM(GptOssConfig(**{k: v for k, v in raw.items() if k != "quantization_config"}))
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in hf.parameters())
    assert abs(count / 1e9 - 116.8) < 0.1
    p = ours.params
    assert (p.num_local_experts, p.num_experts_per_tok, p.sliding_window) == (128, 4, 128)
    assert p.layer_types[:2] == ("sliding_attention", "full_attention") and p.rope["rope_type"] == "yarn"
    drafter = DFlashConfig.from_dict(bundled_config("z-lab/gpt-oss-120b-DFlash"))
    drafter.check_pairing(cfg)
    assert drafter.block_size == 10 and drafter.attention_bias


def _ep_rank(rank: int, ep_size: int, ckpt: str, port: int, ids: torch.Tensor, out: dict) -> None:
    import torch.distributed as dist

    from dflash_trt.models.config import read_config_json
    from dflash_trt.models.gpt_oss import GptOssForCausalLM as Ours
    from dflash_trt.models.weights import WeightSet

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ep_size)
    try:
        model = Ours(decoder_config_from_dict(read_config_json(ckpt)), ep_rank=rank, ep_size=ep_size)
        with torch.no_grad():
            model.load_weights(WeightSet(ckpt))
            hidden, _ = model(ids, _meta(ids), model.make_cache(ids.shape[0], ids.shape[1]))
            out[rank] = model.compute_logits(hidden)
    finally:
        dist.destroy_process_group()


def test_expert_parallel_group_all_reduces_to_the_full_model(mxfp4_dir):
    """Two ranks, each holding 4 of the 8 experts, all-reduce their MoE outputs (gloo) into the full logits."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ids = torch.randint(0, VOCAB, (2, 12))
    # fork: the ranks inherit the imported modules (spawn would re-import torch and transformers per rank)
    manager = mp.get_context("fork").Manager()
    out = manager.dict()
    mp.start_processes(_ep_rank, args=(2, str(mxfp4_dir), port, ids, out), nprocs=2, start_method="fork")
    full = load_target(mxfp4_dir)
    with torch.no_grad():
        want = full.compute_logits(full(ids, _meta(ids), full.make_cache(2, 12))[0])
    assert (out[0] - want).abs().max() < TOL and torch.equal(out[0], out[1])
