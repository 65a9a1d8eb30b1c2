"""The Llama-family target against transformers on the same weights (fp32: exact up to float noise)."""

import json
import zlib

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_trt.layers.attention import AttentionMetadata
from dflash_trt.models.registry import load_target
from tests.conftest import make_target, needs_bf16_kernels

TOL = 1e-4  # fp32; observed max |diff| is 0 to 2e-7

ROPES = {
    "default": {},
    "llama3": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
    "linear": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
}


def _run(model, ids, start=0, rows=None):
    b, n = ids.shape
    rows = torch.arange(b) if rows is None else rows
    return AttentionMetadata.causal_step(rows, start + torch.arange(n).expand(b, n))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("rope", sorted(ROPES))
def test_logits_and_captured_layers_equal_transformers(tmp_path, arch, rope):
    d = make_target(tmp_path / "t", arch, seed=7, **ROPES[rope])
    hf = AutoModelForCausalLM.from_pretrained(d).eval()
    ours = load_target(d)
    ids = torch.randint(0, 96, (2, 150))  # past original_max_position_embeddings, where scaling matters
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        cache = ours.make_cache(2, 160)
        hidden, feats = ours(ids, _run(ours, ids), cache, capture_layer_ids=(2, 0, 3))
        logits = ours.compute_logits(hidden)
        # The tail again as decode and verify steps run it (1, 1 and 8 tokens: the CPU kernels' path), over
        # the K/V the long prefill left
        steps = [(140, 141), (141, 142), (142, 150)]
        tail = [ours(ids[:, a:b], _run(ours, ids[:, a:b], a), cache, capture_layer_ids=(3, 1)) for a, b in steps]
    assert (logits - ref.logits).abs().max() < TOL
    assert (torch.cat([ours.compute_logits(h) for h, _ in tail], 1) - ref.logits[:, 140:]).abs().max() < TOL
    # layer l's output is transformers' hidden_states[l + 1], the last layer's after the final norm (what z-lab's
    # drafters are trained on); features concatenate in the given order
    assert torch.allclose(feats[..., :64], ref.hidden_states[3], atol=TOL)
    assert torch.allclose(feats[..., 64:128], ref.hidden_states[1], atol=TOL)
    assert torch.allclose(feats[..., 128:], ref.hidden_states[4], atol=TOL)
    tail_feats = torch.cat([f for _, f in tail], 1)
    assert torch.allclose(tail_feats[..., :64], ref.hidden_states[4][:, 140:], atol=TOL)
    assert torch.allclose(tail_feats[..., 64:], ref.hidden_states[2][:, 140:], atol=TOL)


SLIDING = {
    "mistral": dict(sliding_window=8),  # every layer
    "qwen3": dict(use_sliding_window=True, sliding_window=8, max_window_layers=2),  # layers 2 and 3 of 4
}


@pytest.mark.parametrize("arch", sorted(SLIDING))
def test_sliding_layers_hide_the_keys_outside_their_window_as_transformers_does(tmp_path, arch):
    """Mistral's window on every layer, Qwen3's on the layers from max_window_layers on: logits equal transformers'
    past the window, for the prefill and for decode and verify steps over its cache."""
    d = make_target(tmp_path / "t", arch, seed=9, **SLIDING[arch])
    hf = AutoModelForCausalLM.from_pretrained(d).eval()
    ours = load_target(d)
    assert ours.config.layer_windows == ((8,) * 4 if arch == "mistral" else (None, None, 8, 8))
    ids = torch.randint(0, 96, (2, 40))
    with torch.no_grad():
        ref = hf(ids).logits
        cache = ours.make_cache(2, 48)
        logits = ours.compute_logits(ours(ids[:, :30], _run(ours, ids[:, :30]), cache)[0])
        tail = [ours.compute_logits(ours(ids[:, a:b], _run(ours, ids[:, a:b], a), cache)[0])
                for a, b in [(30, 31), (31, 32), (32, 40)]]
        windowless = make_target(tmp_path / "w", arch, seed=9)  # the same weights attending to every key
        far = AutoModelForCausalLM.from_pretrained(windowless).eval()(ids).logits
    assert (logits - ref[:, :30]).abs().max() < TOL
    assert (torch.cat(tail, 1) - ref[:, 30:]).abs().max() < TOL
    assert (far[:, 8:] - ref[:, 8:]).abs().max() > 1e-2  # the window changes these logits: the test can fail
    assert (far[:, :8] - ref[:, :8]).abs().max() < TOL


def test_a_mistral_config_without_sliding_window_slides_at_transformers_default_and_null_turns_it_off(tmp_path):
    import json

    d = make_target(tmp_path / "t", "mistral", sliding_window=None)
    assert load_target(d).config.layer_windows == ()
    cfg = json.loads((d / "config.json").read_text())
    del cfg["sliding_window"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert load_target(d).config.layer_windows == (4096,) * 4


def test_capture_alone_runs_only_the_layers_up_to_the_deepest_captured_one(tmp_path):
    d = make_target(tmp_path / "t", "llama", seed=8, layers=4)
    hf = AutoModelForCausalLM.from_pretrained(d).eval()
    ours = load_target(d)
    ran = []
    for i, layer in enumerate(ours.layers):
        layer.register_forward_hook(lambda *_, i=i: ran.append(i))
    ids = torch.randint(0, 96, (2, 20))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        feats = ours.capture(ids, _run(ours, ids), ours.make_cache(2, 32), (1, 0))
    assert ran == [0, 1]  # layers 2 and 3 change no captured feature
    assert torch.allclose(feats[..., :64], ref.hidden_states[2], atol=TOL)
    assert torch.allclose(feats[..., 64:], ref.hidden_states[1], atol=TOL)
    with torch.no_grad():  # the last layer's capture is after the final norm, as transformers' last hidden state
        feats = ours.capture(ids, _run(ours, ids), ours.make_cache(2, 32), (3, 1))
    assert torch.allclose(feats[..., :64], ref.hidden_states[4], atol=TOL)
    assert torch.allclose(feats[..., 64:], ref.hidden_states[2], atol=TOL)


def test_incremental_decode_equals_full_forward(tmp_path):
    d = make_target(tmp_path / "t", "qwen3")
    ours = load_target(d)
    ids = torch.randint(0, 96, (1, 40))
    with torch.no_grad():
        full = ours.compute_logits(ours(ids, _run(ours, ids), ours.make_cache(1, 64))[0])
        cache = ours.make_cache(1, 64)
        ours(ids[:, :25], _run(ours, ids[:, :25]), cache)
        parts = [ours.compute_logits(ours(ids[:, i : i + 5], _run(ours, ids[:, i : i + 5], i), cache)[0]) for i in (25, 30, 35)]
    assert (torch.cat(parts, 1) - full[:, 25:]).abs().max() < TOL


def test_rows_have_independent_lengths_and_rollback_is_free(tmp_path):
    """Row 1 writes a rejected suffix, then is rolled back by reusing its positions; row 0 is untouched."""
    d = make_target(tmp_path / "t", "llama")
    ours = load_target(d)
    a, b = torch.randint(0, 96, (1, 30)), torch.randint(0, 96, (1, 12))
    with torch.no_grad():
        cache = ours.make_cache(3, 64)
        ours(a, _run(ours, a, rows=torch.tensor([0])), cache)
        ours(b, _run(ours, b, rows=torch.tensor([2])), cache)
        junk = torch.randint(0, 96, (1, 6))
        ours(junk, _run(ours, junk, 12, rows=torch.tensor([2])), cache)  # a rejected block at 12..17
        nxt = torch.randint(0, 96, (2, 3))
        # Both rows continue in one batch from their own lengths (30 and 12); row 2 overwrites 12..14.
        meta = AttentionMetadata.causal_step(torch.tensor([0, 2]), torch.tensor([[30, 31, 32], [12, 13, 14]]))
        got = ours.compute_logits(ours(nxt, meta, cache)[0])
        full0, full2 = torch.cat([a, nxt[:1]], 1), torch.cat([b, nxt[1:]], 1)
        ref0 = ours.compute_logits(ours(full0, _run(ours, full0), ours.make_cache(1, 64))[0])[:, 30:]
        ref2 = ours.compute_logits(ours(full2, _run(ours, full2), ours.make_cache(1, 64))[0])[:, 12:]
    assert (got[0] - ref0[0]).abs().max() < TOL
    assert (got[1] - ref2[0]).abs().max() < TOL


def test_unsupported_architecture_is_named(tmp_path):
    d = make_target(tmp_path / "t", "llama")
    cfg = (d / "config.json").read_text().replace("LlamaForCausalLM", "FalconForCausalLM")
    (d / "config.json").write_text(cfg)
    with pytest.raises(ValueError, match="FalconForCausalLM"):
        load_target(d)


@pytest.mark.parametrize("change, named", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),  # the MLP is SiLU-gated: gelu ran as SiLU
    ({"tie_word_embeddings": "false"}, "'tie_word_embeddings' must be true or false"),  # bool("false") tied the head
    ({"tie_word_embeddings": 1}, "'tie_word_embeddings' must be true or false"),
    ({"attention_bias": "false"}, "'attention_bias' must be true or false"),
    ({"sliding_window": 0}, "'sliding_window' must be >= 1"),
    ({"num_key_value_heads": 0}, "'num_key_value_heads' must be >= 1"),  # read as missing: the heads' count
    ({"head_dim": 0}, "'head_dim' must be >= 1"),
    ({"sliding_window": -4}, "'sliding_window' must be >= 1"),
    ({"architectures": "MistralForCausalLM"}, "'architectures' must be a list"),  # was taken as architecture 'M'
    ({"rope_parameters": [1, 2]}, "'rope_parameters' must be an object"),
    ({"rope_parameters": "x"}, "'rope_parameters' must be an object"),
    ({"rope_parameters": None, "rope_theta": None}, "'rope_theta' must be a number"),
    ({"rope_parameters": None, "rope_theta": "1e6"}, "'rope_theta' must be a number"),
    ({"rope_parameters": {"rope_type": "linear", "factor": "8", "rope_theta": 1e4}}, "'rope_parameters.factor'"),
])
def test_a_config_value_of_the_wrong_kind_is_refused_naming_its_key(tmp_path, change, named):
    """transformers refuses these configs (or runs another model than they say): a target whose output would
    silently differ from transformers' is refused instead, naming the file and key."""
    d = make_target(tmp_path / "t", "mistral", sliding_window=8)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=named) as refused:
        load_target(d)
    assert str(d / "config.json") in str(refused.value)


def test_swish_is_silu_as_transformers_reads_it(tmp_path):
    d = make_target(tmp_path / "t", "llama", hidden_act="swish")
    ids = torch.randint(0, 96, (1, 12))
    ours = load_target(d)
    with torch.no_grad():
        got = ours.compute_logits(ours(ids, _run(ours, ids), ours.make_cache(1, 16))[0])
        want = AutoModelForCausalLM.from_pretrained(d).eval()(ids).logits
    assert (got - want).abs().max() < TOL


def test_qwen3s_sliding_flag_must_be_a_flag(tmp_path):
    d = make_target(tmp_path / "t", "qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=2)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": "false"}))
    with pytest.raises(ValueError, match="'use_sliding_window' must be true or false"):
        load_target(d)


@needs_bf16_kernels
def test_bf16_steps_compute_each_token_alike_whatever_their_shape(tmp_path):
    """Four one-token decode steps and one four-token verify step over the same cache give bit-identical bf16
    logits at every position, for 4 rows: what makes greedy speculation token-exact in bf16 too
    (tests/engine/test_lossless.py). torch's own path attends with a grouped bf16 matmul for one-query steps and
    SDPA for blocks, which round apart."""
    d = make_target(tmp_path / "t", "qwen3", hidden_size=256, intermediate_size=512, head_dim=64)
    ours = load_target(d, dtype=torch.bfloat16)
    ours.pack_for_inference()  # as the engine runs it: the linears through the kernel
    ids = torch.randint(0, 96, (4, 24))
    with torch.no_grad():
        cache = ours.make_cache(4, 32)
        ours(ids[:, :20], _run(ours, ids[:, :20]), cache)
        block = ours.compute_logits(ours(ids[:, 20:24], _run(ours, ids[:, 20:24], 20), cache)[0])
        steps = [ours.compute_logits(ours(ids[:, i : i + 1], _run(ours, ids[:, i : i + 1], i), cache)[0]) for i in range(20, 24)]
    assert torch.equal(torch.cat(steps, 1), block)


@pytest.mark.parametrize("arch, overrides", [
    ("qwen3", {}), ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}),  # layers 2-3 slide
], ids=["qwen3", "llama-bias", "qwen3-sliding"])
@needs_bf16_kernels
def test_one_call_through_every_layer_equals_the_layer_by_layer_kernels(tmp_path, arch, overrides):
    """Packed bf16 decode and verify steps run every layer in one C call (cpu_ops.llama_layers); the oracle is the
    layers' own forward through the same kernels, one op at a time: hidden states, captured features and the
    K/V the step wrote are bit-identical, each layer with its own window past it. (That path is checked against
    transformers above.)"""
    from dflash_trt.models.causal_lm import CausalLM

    d = make_target(tmp_path / "t", arch, hidden_size=256, intermediate_size=512, head_dim=64, **overrides)
    ours = load_target(d, dtype=torch.bfloat16)
    with torch.no_grad():  # random init leaves every norm weight at 1 and every bias at 0: make them count
        for name, p in ours.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))).to(p.dtype) * 0.5)
    ours.pack_for_inference()
    assert ours.kernel_table is not None
    ids = torch.randint(0, 96, (3, 24))
    with torch.no_grad():
        caches = [ours.make_cache(3, 32) for _ in range(2)]
        for cache in caches:
            ours(ids[:, :20], _run(ours, ids[:, :20]), cache)  # a 20-token prefill
        for step in (slice(20, 21), slice(21, 24)):
            meta = lambda: _run(ours, ids[:, step], step.start)  # noqa: E731 (fresh metadata per call)
            # a layer named twice too (z-lab's format allows it): the one call filled only its last slot (the last
            # layer's slots are all written after it)
            fused = ours(ids[:, step], meta(), caches[0], capture_layer_ids=(1, 3, 1))
            layered = CausalLM.forward(ours, ids[:, step], meta(), caches[1], capture_layer_ids=(1, 3, 1))
            assert torch.equal(fused[0], layered[0]) and torch.equal(fused[1], layered[1])
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


@needs_bf16_kernels
def test_bf16_sliding_layers_take_the_kernels_past_their_window(tmp_path):
    """The CPU kernels hide the keys outside a sliding layer's window: a sliding target takes them (the one call
    included) before and past its window, and its bf16 logits agree with transformers' fp32 ones up to bf16's
    rounding."""
    from dflash_trt.kernels import cpu_ops

    ops = cpu_ops.load()
    d = make_target(tmp_path / "t", "mistral", hidden_size=256, intermediate_size=512, head_dim=64, sliding_window=12)
    ours = load_target(d, dtype=torch.bfloat16)
    ours.pack_for_inference()
    assert ours.kernel_table is not None
    calls = []
    real = ops.llama_layers
    ids = torch.randint(0, 96, (1, 24))
    with torch.no_grad():
        cache = ours.make_cache(1, 32)
        ours(ids[:, :8], _run(ours, ids[:, :8]), cache)
        try:
            ops.llama_layers = lambda *a: calls.append(1) or real(*a)
            steps = [ours.compute_logits(ours(ids[:, i : i + 1], _run(ours, ids[:, i : i + 1], i), cache)[0])
                     for i in range(8, 24)]
        finally:
            ops.llama_layers = real
        want = AutoModelForCausalLM.from_pretrained(d).eval()(ids).logits[:, 8:]
    assert len(calls) == 16  # positions 8-23: from 12 on, keys fall outside the window of 12
    got = torch.cat(steps, 1).float()
    assert (got - want).abs().max() < 0.15 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


@needs_bf16_kernels
def test_prompt_chunks_take_the_one_call_and_equal_token_by_token_decoding(tmp_path):
    """Prompt chunks of up to one_call_max_tokens run every layer in one C call too (past 16 rows the linear
    kernel's AMX tiles take 16 at a time, the last padded): every token's hidden state, captured features and K/V
    are bit for bit what one-token decode steps give, so a prompt computes alike however it is chunked; and the
    logits agree with transformers' fp32 forward on the same weights up to bf16's rounding."""
    d = make_target(tmp_path / "t", "qwen3", hidden_size=256, intermediate_size=512, head_dim=64)
    ours = load_target(d, dtype=torch.bfloat16)
    ours.pack_for_inference()
    # two rows of n tokens: 45 with AMX tiles (3 tile passes, the last padded), else the dot products' 32 rows / 2
    n = min(45, ours.one_call_max_tokens // 2)
    assert n >= 16
    ids = torch.randint(0, 96, (2, n))
    with torch.no_grad():
        caches = [ours.make_cache(2, 64) for _ in range(2)]
        chunk, chunk_features = ours(ids, _run(ours, ids), caches[0], capture_layer_ids=(2, 0))
        steps = [ours(ids[:, i : i + 1], _run(ours, ids[:, i : i + 1], i), caches[1], capture_layer_ids=(2, 0))
                 for i in range(n)]
        hf = AutoModelForCausalLM.from_pretrained(d).eval()
        want = hf(ids).logits
        got = ours.compute_logits(chunk).float()
    assert torch.equal(chunk, torch.cat([h for h, _ in steps], 1))
    assert torch.equal(chunk_features, torch.cat([f for _, f in steps], 1))
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    err = (got - want).abs().max() / want.abs().max()
    assert err < 0.03, f"bf16 chunk logits {err:.4f} of the largest logit away from transformers' fp32"
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("build", ["avx2_ops", "avx512f_ops"])
def test_builds_without_avx512_bf16_run_every_layer_in_one_call_alike_for_any_step_shape(tmp_path, build, request,
                                                                                        monkeypatch):
    """With the kernels an AVX2 laptop or an AVX-512 CPU without BF16 builds (tests/conftest.py), Llama-family steps
    still run every layer
    in one C call: four one-token decode steps, a four-token verify block and one prompt chunk give bit-identical
    bf16 hidden states and K/V (what keeps greedy speculation token-exact in bf16 there), and the logits agree with
    transformers' fp32 forward up to bf16's rounding. Where oneDNN has no bf16 (an AVX2 CPU), every row count takes
    the kernel: prompt chunks of up to 256 tokens in the one call."""
    from dflash_trt.kernels import cpu_ops
    from dflash_trt.layers import linear

    built = request.getfixturevalue(build)
    monkeypatch.setattr(cpu_ops, "load", lambda: built)
    monkeypatch.setattr(linear, "onednn_packs", lambda w: w.dtype == torch.float32)  # no bf16 reorder, as on AVX2
    d = make_target(tmp_path / "t", "qwen3", hidden_size=256, intermediate_size=512, head_dim=64)
    ours = load_target(d, dtype=torch.bfloat16)
    ours.pack_for_inference()
    assert ours.kernel_table is not None and ours.one_call_max_tokens == 256
    assert ours.layers[0].self_attn.qkv_proj.packed is None  # torch's linear past the kernel, never oneDNN's reorder
    ids = torch.randint(0, 96, (2, 40))
    with torch.no_grad():
        caches = [ours.make_cache(2, 48) for _ in range(3)]
        whole = ours(ids, _run(ours, ids), caches[0])[0]
        ours(ids[:, :36], _run(ours, ids[:, :36]), caches[1])
        block = ours(ids[:, 36:], _run(ours, ids[:, 36:], 36), caches[1])[0]
        steps = [ours(ids[:, i : i + 1], _run(ours, ids[:, i : i + 1], i), caches[2])[0] for i in range(40)]
        want = AutoModelForCausalLM.from_pretrained(d).eval()(ids).logits
        got = ours.compute_logits(whole).float()
    assert torch.equal(whole, torch.cat(steps, 1)) and torch.equal(block, whole[:, 36:])
    assert all(torch.equal(c.k, caches[0].k) and torch.equal(c.v, caches[0].v) for c in caches[1:])
    assert (got - want).abs().max() / want.abs().max() < 0.03


@pytest.mark.parametrize("index, message", [
    ("{not json", "not a safetensors index"),
    ('{"metadata": {}}', "not a safetensors index"),
    ('{"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}', "model-00002-of-00002.safetensors"),
])
def test_a_sharded_checkpoints_bad_index_is_named(tmp_path, index, message):
    from dflash_trt.models.weights import CheckpointError

    t = make_target(tmp_path / "t")
    (t / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match=message) as e:
        load_target(t)
    assert "model.safetensors.index.json" in str(e.value)


@pytest.mark.parametrize("which", ["target", "drafter"])
def test_weights_are_allocated_in_the_asked_dtype_not_fp32_first(tiny_dirs, monkeypatch, which):
    """A bf16 8B target allocated in fp32 and then cast needs 32 GB at its peak: more than a 24 GB GPU holds its
    16 GB of bf16 weights in."""
    from dflash_trt.models.dflash import load_drafter

    allocated = []
    real = torch.nn.Module.to_empty

    def to_empty(self, *args, **kwargs):
        allocated.extend(p.dtype for p in self.parameters() if p.is_floating_point())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to_empty", to_empty)
    target = load_target(tiny_dirs["qwen3"], torch.bfloat16)
    if which == "drafter":
        allocated.clear()
        load_drafter(tiny_dirs["qwen3_drafter"], target.config, torch.bfloat16)
    assert allocated and set(allocated) == {torch.bfloat16}
