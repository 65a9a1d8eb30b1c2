"""The Qwen3-MoE target against transformers' Qwen3MoeForCausalLM (fp32) on tiny random configs: 8 experts, top-2,
sparse and dense layers as mlp_only_layers and decoder_sparse_step say, the top-k weights renormalised or not; both
of its checkpoint layouts; DFlash on top stays lossless, token for token against transformers' greedy."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3MoeConfig
from transformers import Qwen3MoeForCausalLM as HFQwen3Moe

from dflash_trt import SamplingParams
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine
from dflash_trt.models.qwen3_moe import Qwen3MoeForCausalLM
from dflash_trt.models.registry import load_target
from dflash_trt.models.weights import CheckpointError
from tests.conftest import EOS, VOCAB, make_drafter, needs_bf16_kernels, save_tiny_model
from tests.forced_drafts import force_drafts, force_tree_drafts
from tests.models.helpers import meta, sample_prompts, spec_engine

TOL = 1e-4  # fp32
HIDDEN = 64
NEW = 24


def make_qwen3_moe(path: Path, seed: int = 0, layers: int = 4, **overrides) -> Path:
    """A random Qwen3-MoE saved by transformers, its router's logits far from ties."""
    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
              num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=128,
              eos_token_id=EOS, bos_token_id=1, tie_word_embeddings=False)
    kw.update(overrides)
    model = HFQwen3Moe(Qwen3MoeConfig(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return save_tiny_model(model, path, VOCAB)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return make_qwen3_moe(tmp_path_factory.mktemp("qwen3_moe") / "t")


@pytest.fixture(scope="module")
def hf_model(moe_dir):
    return HFQwen3Moe.from_pretrained(moe_dir).eval()


@pytest.mark.parametrize("config", [{}, {"norm_topk_prob": False, "mlp_only_layers": []},
                                    {"decoder_sparse_step": 2, "mlp_only_layers": [], "num_experts_per_tok": 3}],
                         ids=["renormalised, layer 1 dense", "raw top-k, all sparse", "every second sparse, top-3"])
def test_logits_and_captured_layers_equal_transformers(tmp_path, config):
    d = make_qwen3_moe(tmp_path / "t", **config)
    hf = HFQwen3Moe.from_pretrained(d).eval()
    ours = load_target(d)
    assert isinstance(ours, Qwen3MoeForCausalLM)
    # which layers are sparse, as transformers' own layers say
    assert list(ours.params.sparse) == [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock"
                                        for layer in hf.model.layers]
    ids = torch.randint(0, VOCAB, (2, 30))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        hidden, feats = ours(ids, meta(ids), ours.make_cache(2, 32), capture_layer_ids=(1, 3))
        logits = ours.compute_logits(hidden)
    assert (logits - ref.logits).abs().max() < TOL
    assert (feats[..., :HIDDEN] - ref.hidden_states[2]).abs().max() < TOL
    assert (feats[..., HIDDEN:] - ref.hidden_states[4]).abs().max() < TOL
    for layer, sparse in zip(ours.layers, ours.params.sparse):  # the experts in grouped GEMMs, as on a GPU
        if sparse:
            layer.mlp.experts.grouped = True
    with torch.no_grad():
        logits = ours.compute_logits(ours(ids, meta(ids), ours.make_cache(2, 32))[0])
    assert (logits - ref.logits).abs().max() < TOL


def test_packed_incremental_decode_equals_transformers(moe_dir, hf_model):
    ours = load_target(moe_dir)
    ours.pack_for_inference()  # prepacked experts, router and projections are exact too
    ids = torch.randint(0, VOCAB, (1, 33))
    with torch.no_grad():
        ref = hf_model(ids).logits
        cache = ours.make_cache(1, 40)
        ours(ids[:, :12], meta(ids[:, :12]), cache)
        parts = [ours.compute_logits(ours(ids[:, i:i + 7], meta(ids[:, i:i + 7], i), cache)[0]) for i in (12, 19, 26)]
    assert (torch.cat(parts, 1) - ref[:, 12:]).abs().max() < TOL


def test_stacked_experts_as_transformers_holds_them_load_alike(moe_dir, hf_model, tmp_path):
    """A checkpoint of each layer's experts stacked (gate_up_proj [E, 2I, H], down_proj [E, H, I], transformers'
    layout in memory) gives the same logits."""
    tensors = load_file(moe_dir / "model.safetensors")
    for i in (0, 2, 3):
        m = f"model.layers.{i}.mlp.experts."
        gate_up = [[tensors.pop(f"{m}{e}.{n}_proj.weight") for n in ("gate", "up")] for e in range(8)]
        tensors[m + "gate_up_proj"] = torch.stack([torch.cat(pair) for pair in gate_up])
        tensors[m + "down_proj"] = torch.stack([tensors.pop(f"{m}{e}.down_proj.weight") for e in range(8)])
    d = tmp_path / "stacked"
    d.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (d / f).write_bytes((moe_dir / f).read_bytes())
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    ids = torch.randint(0, VOCAB, (1, 20))
    ours = load_target(d)
    with torch.no_grad():
        logits = ours.compute_logits(ours(ids, meta(ids), ours.make_cache(1, 20))[0])
        assert (logits - hf_model(ids).logits).abs().max() < TOL


def test_a_missing_expert_is_named(moe_dir, tmp_path):
    tensors = load_file(moe_dir / "model.safetensors")
    d = tmp_path / "t"
    d.mkdir()
    (d / "config.json").write_bytes((moe_dir / "config.json").read_bytes())
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        load_target(d)
    del tensors["model.layers.0.mlp.experts.0.gate_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"experts\.0\.gate_proj\.weight'? \(each expert's\) or .*gate_up_proj"):
        load_target(d)


@pytest.mark.parametrize("change, says", [
    ({"decoder_sparse_step": 0}, "'decoder_sparse_step' must be"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 must be in 1..num_experts=8"),
    ({"mlp_only_layers": "1"}, "mlp_only_layers must be a list")])
def test_malformed_moe_keys_are_refused_naming_them(moe_dir, tmp_path, change, says):
    import json

    d = tmp_path / "t"
    d.mkdir()
    cfg = json.loads((moe_dir / "config.json").read_text()) | change
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").symlink_to(moe_dir / "model.safetensors")
    with pytest.raises(ValueError, match=says) as raised:
        load_target(d)
    assert str(d / "config.json") in str(raised.value)  # (the file it is in)


@pytest.fixture(scope="module")
def moe_drafter(moe_dir, tmp_path_factory) -> Path:
    return make_drafter(tmp_path_factory.mktemp("qwen3_moe_drafter") / "d", moe_dir, layers=1, block_size=8,
                        target_layer_ids=(0, 2, 3))


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculative_equals_transformers_greedy(moe_dir, moe_drafter, hf_model, batch):
    prompts = sample_prompts(batch)
    refs = [hf_model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                              eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    assert [o.token_ids for o in spec_engine(moe_dir, moe_drafter, 7, batch).generate(prompts, params)] == refs
    engine = spec_engine(moe_dir, moe_drafter, 7, batch)  # mostly-right drafts: long acceptances and rollbacks
    force_drafts(engine, {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))}, error_rate=0.15)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == refs and max(max(o.acceptance_lengths) for o in outs) >= 4


@needs_bf16_kernels
@pytest.mark.parametrize("temperature, tree", [(0.0, None), (1.0, None), (0.0, 24)],
                         ids=["greedy chain", "sampled chain", "greedy tree of 24"])
def test_bf16_speculative_equals_bf16_plain_decoding(moe_dir, moe_drafter, temperature, tree):
    """In bf16 the oracle is the same runtime decoding one token a step: verify blocks of forced, mostly-right
    drafts give the same tokens (greedy, and seeded samples under the "match" rule). A tree of 24 nodes verifies more
    queries a row than the kernels' attention takes by default (16): its layers, run one by one, attend whole steps
    through the kernels (they cut such a tree to 15 nodes before)."""
    prompts = sample_prompts(4)
    params = [SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=temperature, seed=i) for i in range(4)]
    plain = LLMEngine(load_target(moe_dir, torch.bfloat16), None, None, EngineConfig(
        max_batch_size=4, max_model_len=96, dtype="bfloat16", speculative=False)).generate(prompts, params)
    engine = spec_engine(moe_dir, moe_drafter, 7, 4, torch.bfloat16, **({"draft_tree": {4: tree}} if tree else {}))
    truth = {i: p + o.token_ids for i, (p, o) in enumerate(zip(prompts, plain))}
    if tree:
        assert engine._within_exact_rows(4, 7, tree) == (7, tree)
        force_tree_drafts(engine, truth)
    else:
        force_drafts(engine, truth, error_rate=0.15)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain] and all(o.tau > 1.5 for o in outs)
