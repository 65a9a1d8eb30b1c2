"""The drafter against z-lab's reference `dflash.DFlashDraftModel` (dflash==0.1.0), and its load-time checks."""

import json
import zlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_trt.kernels import cpu_ops
from dflash_trt.layers.attention import AttentionMetadata
from dflash_trt.models.dflash import DFlashConfig, DFlashDrafter, load_drafter, save_drafter
from dflash_trt.models.registry import load_target
from dflash_trt.models.weights import CheckpointError
from tests.conftest import make_drafter, make_target, needs_bf16_kernels

dflash_ref = pytest.importorskip("dflash.model", reason="z-lab's dflash==0.1.0 (install --no-deps) is the oracle")

TOL = 1e-4


def _draft_hidden_ours(drafter, ctx, block_embeds, ctx_len, rows=1):
    cache = drafter.make_cache(rows, 128)
    r = torch.arange(rows)
    q = block_embeds.shape[1]
    drafter.project_context(ctx, AttentionMetadata.causal_step(r, torch.arange(ctx_len).expand(rows, -1)), cache)
    pos = (ctx_len + torch.arange(q)).expand(rows, -1)
    meta = AttentionMetadata.block_step(r, pos, torch.full((rows,), ctx_len + q))
    return drafter.forward_block(block_embeds, meta, cache)


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"attention_bias": True, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5, "use_sliding_window": True},
    ],
    ids=["qwen3", "bias+yarn (gpt-oss shape)", "sliding+full"],
)
def test_draft_hidden_and_logits_equal_zlab(tmp_path, variant):
    t = make_target(tmp_path / "t")
    layers = 2
    d = make_drafter(tmp_path / "d", t, layers=layers, block_size=8, target_layer_ids=(0, 1, 3), **variant)
    ref = dflash_ref.DFlashDraftModel.from_pretrained(d).eval()
    target = load_target(t)
    ours = load_drafter(d, target.config)
    ctx_len, q = 11, 8
    ctx = torch.randn(1, ctx_len, 3 * 64)
    block = torch.tensor([[5] + [ours.config.mask_token_id] * (q - 1)])
    embeds = target.embed_tokens(block)
    with torch.no_grad():
        want = ref(position_ids=torch.arange(ctx_len + q)[None], noise_embedding=embeds, target_hidden=ctx)
        got = _draft_hidden_ours(ours, ctx, embeds, ctx_len)
        want_logits = ref.compute_logits(want[:, 1:], lambda h: torch.nn.functional.linear(h, target.lm_head_weight))
        got_logits = ours.compute_logits(got[:, 1:], target.lm_head_forward)
    assert (got - want).abs().max() < TOL
    assert (got_logits - want_logits).abs().max() < TOL


def _edit_config(d, *drop, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k in drop:
        cfg.pop(k, None)
    for k, v in changes.items():
        if k in ("mask_token_id", "target_layer_ids"):
            cfg["dflash_config"][k] = v
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "keys, changes",
    [
        # a window without use_sliding_window: Qwen3Config drops it, so z-lab's sliding layer is causal, unwindowed
        ((), {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3,
              "use_sliding_window": False}),
        # no layer_types: Qwen3Config makes layers from max_window_layers on sliding where the window counts
        (("layer_types",), {"sliding_window": 3, "use_sliding_window": True, "max_window_layers": 1}),
        (("layer_types",), {"sliding_window": 3, "use_sliding_window": False, "max_window_layers": 0}),
    ],
    ids=["window off", "layer types from max_window_layers", "no window, no layer types"],
)
def test_hand_written_window_keys_are_read_as_zlab_reads_them(tmp_path, keys, changes):
    t = make_target(tmp_path / "t")
    d = make_drafter(tmp_path / "d", t, layers=2, block_size=8, target_layer_ids=(0, 1, 3))
    _edit_config(d, *keys, **changes)
    ref = dflash_ref.DFlashDraftModel.from_pretrained(d).eval()  # reads config.json through Qwen3Config
    target = load_target(t)
    ours = load_drafter(d, target.config)
    ctx_len, q = 11, 8
    ctx = torch.randn(1, ctx_len, 3 * 64)
    embeds = target.embed_tokens(torch.tensor([[5] + [ours.config.mask_token_id] * (q - 1)]))
    with torch.no_grad():
        want = ref(position_ids=torch.arange(ctx_len + q)[None], noise_embedding=embeds, target_hidden=ctx)
        got = _draft_hidden_ours(ours, ctx, embeds, ctx_len)
    assert (got - want).abs().max() < TOL


def test_a_window_without_use_sliding_window_is_named_as_unused(caplog):
    base = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96,
            "block_size": 8, "mask_token_id": 3, "target_layer_ids": [1], "sliding_window": 5}
    with caplog.at_level("WARNING"):
        cfg = DFlashConfig.from_dict({**base, "layer_types": ["sliding_attention", "full_attention"]})
    assert cfg.sliding_window is None and "sliding_window=5 is not used" in caplog.text
    # Qwen3Config's max_window_layers, -1 included, places sliding layers only where the window counts
    cfg = DFlashConfig.from_dict({**base, "use_sliding_window": True, "max_window_layers": -1})
    assert cfg.layer_types == ["sliding_attention"] * 2 and cfg.sliding_window == 5
    cfg = DFlashConfig.from_dict({**base, "max_window_layers": None})
    assert cfg.layer_types == ["full_attention"] * 2 and cfg.sliding_window is None


def test_a_saved_drafter_loads_in_zlab_unchanged(tmp_path):
    t = make_target(tmp_path / "t")
    d = make_drafter(tmp_path / "d", t, layers=2, block_size=8)
    target = load_target(t)
    ours = load_drafter(d, target.config)
    out = save_drafter(ours, tmp_path / "resaved")
    assert set(load_file(str(out / "model.safetensors"))) == set(load_file(str(d / "model.safetensors")))
    # readable as its config is (safetensors writes 0600: a server run as another user could not read the weights)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == (out / "config.json").stat().st_mode & 0o777
    ref = dflash_ref.DFlashDraftModel.from_pretrained(out).eval()
    assert ref.block_size == 8 and ref.mask_token_id == ours.config.mask_token_id
    ctx = torch.randn(1, 6, 2 * 64)
    embeds = torch.randn(1, 8, 64)
    with torch.no_grad():
        want = ref(position_ids=torch.arange(14)[None], noise_embedding=embeds, target_hidden=ctx)
        got = _draft_hidden_ours(ours, ctx, embeds, 6)
    assert (got - want).abs().max() < TOL


def test_config_keys_come_from_dflash_config_before_the_top_level():
    cfg = DFlashConfig.from_dict({
        "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 96,
        "block_size": 16, "mask_token_id": 3, "num_target_layers": 36,
        "dflash_config": {"block_size": 10, "mask_token_id": 7},
    })
    assert (cfg.block_size, cfg.mask_token_id) == (10, 7)
    assert cfg.target_layer_ids == [18]  # z-lab's default for one draft layer: the middle target layer


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_size": 32, "head_dim": 8}, "hidden_size=32"),
        ({"vocab_size": 1000}, "vocab_size=1000"),
        ({"mask_token_id": 96}, "mask_token_id=96"),
        ({"target_layer_ids": [1, 4]}, "target_layer_ids"),
        ({"num_target_layers": 24}, "num_target_layers=24 but the target has 4 layers"),  # trained for another
        ({"model_type": "gpt_oss"}, "model_type='gpt_oss'"),
        # loaded, a DFlash 2 drafter's convolutions and selector were dropped as unused tensors and its drafts were
        # plain DFlash's; an unknown layer type ran as full attention
        ({"architectures": ["DFlash2DraftModel"]}, r"a DFlash 2 drafter \(DFlash2DraftModel"),
        ({"selector_rank": 64}, r"a DFlash 2 drafter \(selector_rank"),
        ({"layer_types": ["linear_attention"]}, r"layer_types \['linear_attention'\] are not supported"),
    ],
)
def test_bad_pairing_is_refused_naming_the_key(tmp_path, change, message):
    t = make_target(tmp_path / "t")
    d = make_drafter(tmp_path / "d", t)
    _edit_config(d, **change)
    with pytest.raises(CheckpointError, match=message):
        load_drafter(d, load_target(t).config)


def test_a_target_given_as_the_drafter_is_called_what_it_is(tmp_path):
    t = make_target(tmp_path / "t")
    with pytest.raises(CheckpointError, match="not a DFlash drafter .*is it a target model"):
        load_drafter(t, load_target(t).config)


def test_missing_tensor_is_named(tmp_path):
    t = make_target(tmp_path / "t")
    d = make_drafter(tmp_path / "d", t)
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["layers.0.self_attn.k_norm.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.k_norm\.weight"):
        load_drafter(d, load_target(t).config)


def test_misshapen_tensor_is_named_with_both_shapes(tmp_path):
    t = make_target(tmp_path / "t")
    d = make_drafter(tmp_path / "d", t)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["fc.weight"] = tensors["fc.weight"][:, :64].contiguous()
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'fc\.weight' has shape \(64, 64\), expected \(64, 128\)"):
        load_drafter(d, load_target(t).config)


@pytest.mark.parametrize("variant", [{}, {"attention_bias": True}], ids=["qwen3", "bias"])
def test_a_block_through_every_layer_in_one_call_equals_the_layer_by_layer_kernels(tmp_path, variant):
    """Packed bf16 drafters run a block through all their layers in one C call (q_proj and kv_proj as one
    projection); the oracle is the layers' own forward through the same kernels: bit-identical hidden states
    and block K/V. (The layer path is checked against z-lab above.)"""
    target, ours = _packed_bf16_drafter(tmp_path, variant)
    assert ours.kernel_table is not None
    ctx = torch.randn(2, 11, 3 * 64).bfloat16()
    block = torch.tensor([[5] + [ours.config.mask_token_id] * 7, [9] + [ours.config.mask_token_id] * 7])
    embeds = target.embed_tokens(block).detach()
    with torch.no_grad():
        fused = _draft_hidden_ours(ours, ctx, embeds, 11, rows=2)
        table, ours.kernel_table = ours.kernel_table, None
        layered = _draft_hidden_ours(ours, ctx, embeds, 11, rows=2)
        ours.kernel_table = table
    assert torch.equal(fused, layered)


@pytest.mark.parametrize("variant", [{}, {"attention_bias": True}], ids=["qwen3", "bias"])
def test_a_whole_draft_step_in_one_call_equals_project_context_then_forward_block(tmp_path, variant, monkeypatch):
    """draft() runs the context injection and the block in one C call where the kernels serve both; the oracle is
    the two calls it replaces (the same kernels, one by one): bit-identical hidden states and drafter caches, over two
    consecutive steps."""
    target, ours = _packed_bf16_drafter(tmp_path, variant)
    assert ours.context_table is not None
    one_call = []
    step = cpu_ops.CpuOps.dflash_step
    monkeypatch.setattr(cpu_ops.CpuOps, "dflash_step", lambda self, *a: one_call.append(1) or step(self, *a))
    results = {}
    for name in ("one call", "two calls"):
        if name == "two calls":
            ours.context_table = None
        results[name] = _two_draft_steps(target, ours)
    assert len(one_call) == 2  # the fused path ran at both steps
    (fused, fused_cache), (split, split_cache) = results["one call"], results["two calls"]
    for a, b in zip(fused, split):
        assert torch.equal(a, b)
    assert torch.equal(fused_cache.k, split_cache.k) and torch.equal(fused_cache.v, split_cache.v)


@pytest.mark.parametrize("variant", [{}, {"attention_bias": True}], ids=["qwen3", "bias"])
def test_int8_tables_draft_what_the_bf16_ones_do_within_quantization_error(tmp_path, variant, monkeypatch):
    """pack_for_inference(int8_weights=True) puts the C step's projections in int8 (one scale per output feature,
    cpu_ops.Int8Weight). Against the bf16 tables, over two steps: hidden states within a few percent, row by row (a
    projection wired to the wrong slot or transposed would be off by ~100%), and not equal (the int8 path ran)."""
    target, ours = _packed_bf16_drafter(tmp_path, variant)
    if not cpu_ops.load().has_int8_kernels():
        pytest.skip("needs the CPU kernels with AVX512-VNNI or AVX2")
    one_call = []
    step = cpu_ops.CpuOps.dflash_step
    monkeypatch.setattr(cpu_ops.CpuOps, "dflash_step", lambda self, *a: one_call.append(a[7].int8) or step(self, *a))
    results = {}
    for int8 in (False, True):
        ours.pack_for_inference(int8_weights=int8)
        results[int8] = _two_draft_steps(target, ours)[0]
    assert one_call == [False, False, True, True]
    for exact, approx in zip(results[False], results[True]):
        exact, approx = exact.float(), approx.float()
        error = (approx - exact).norm(dim=-1) / exact.norm(dim=-1)
        assert float(error.max()) < 0.05 and float(error.max()) > 0


@needs_bf16_kernels
def test_int8_tables_by_default_only_where_they_are_faster(tmp_path, monkeypatch):
    """int8_weights=None (EngineConfig's default) takes int8 tables with AVX512-VNNI's dot product only: AVX2's
    VPMADDWD ties with the bf16 kernel at a block's rows, so there the tables stay bf16 unless asked for."""
    _, ours = _packed_bf16_drafter(tmp_path, {})
    for dot, default in [("vpdpbusd", True), ("vpmaddwd", False), (None, False)]:
        monkeypatch.setattr(cpu_ops.CpuOps, "int8_dot", lambda self, dot=dot: dot)
        ours.pack_for_inference(int8_weights=None)
        assert ours.kernel_table.int8 == default, dot
        ours.pack_for_inference(int8_weights=True)
        assert ours.kernel_table.int8 == (dot is not None), dot


@pytest.mark.parametrize("intermediate, features", [(8224, 1), (64, 257)], ids=["down_proj", "fc"])
def test_int8_tables_take_projections_wider_than_8192_inputs(intermediate, features):
    """An 8B target's drafter reads 5 x 4,096 fc inputs and 14,336 down_proj ones: its int8 tables (the default
    where AVX512-VNNI runs) were refused at 8,192 inputs, and opening its engine failed."""
    ops = cpu_ops.load()
    if ops is None or not ops.has_int8_kernels() or not ops.has_linear(torch.zeros(32, 32, dtype=torch.bfloat16)):
        pytest.skip("needs the CPU kernels with int8 and bf16 linears")
    cfg = DFlashConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                       intermediate_size=intermediate, block_size=4, mask_token_id=0,
                       target_layer_ids=list(range(features)))
    drafter = DFlashDrafter(cfg).bfloat16().eval()
    drafter.pack_for_inference(int8_weights=True)
    assert drafter.kernel_table.int8 and drafter.context_table is not None


def test_a_drafter_past_the_int8_kernels_inputs_keeps_bf16_tables():
    """A fc over 2,049 features of 32 (65,568 inputs, past Int8Weight.MAX_INPUTS): opening it raised."""
    ops = cpu_ops.load()
    if ops is None or not ops.has_int8_kernels() or not ops.has_linear(torch.zeros(32, 32, dtype=torch.bfloat16)):
        pytest.skip("needs the CPU kernels with int8 and bf16 linears")
    cfg = DFlashConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                       intermediate_size=64, block_size=4, mask_token_id=0, target_layer_ids=list(range(2049)))
    drafter = DFlashDrafter(cfg).bfloat16().eval()
    drafter.pack_for_inference(int8_weights=True)
    assert drafter.kernel_table is not None and not drafter.kernel_table.int8


def _two_draft_steps(target, drafter):
    """draft() at two consecutive steps of two rows on a fresh cache, from seeded random features ->
    ([hidden of each step], cache)."""
    rows, mask = torch.arange(2), drafter.config.mask_token_id
    cache = drafter.make_cache(2, 64)
    g = torch.Generator().manual_seed(0)
    hidden = []
    for first, n, anchors in [(0, 11, [5, 9]), (11, 3, [7, 2])]:  # (first context position, context tokens, anchors)
        ctx = torch.randn(2, n, 3 * 64, generator=g).bfloat16()
        ctx_meta = AttentionMetadata.causal_step(rows, (first + torch.arange(n)).expand(2, -1))
        block = torch.tensor([[a] + [mask] * 3 for a in anchors])
        pos = (first + n + torch.arange(4)).expand(2, -1)
        meta = AttentionMetadata.block_step(rows, pos, torch.full((2,), first + n + 4))
        with torch.no_grad():
            hidden.append(drafter.draft(ctx, ctx_meta, target.embed_tokens(block), meta, cache))
    return hidden, cache


def _packed_bf16_drafter(tmp_path, variant):
    """A tiny target and a packed bf16 drafter whose norms and biases are perturbed (at 1 and 0 from random init they
    would hide a swapped or dropped tensor); skips where the CPU kernels lack AVX512-BF16."""
    ops = cpu_ops.load()
    if ops is None or not ops.has_linear(torch.zeros(1, 64, dtype=torch.bfloat16)):
        pytest.skip("needs the CPU kernels with AVX512-BF16")
    t = make_target(tmp_path / "t")
    d = make_drafter(tmp_path / "d", t, layers=2, block_size=8, target_layer_ids=(0, 1, 3), **variant)
    target = load_target(t, dtype=torch.bfloat16)
    ours = load_drafter(d, target.config).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))).to(p.dtype))
    ours.pack_for_inference()
    return target, ours


def test_a_weights_file_it_may_not_read_is_said_to_be_unreadable_not_missing(tmp_path, monkeypatch):
    """safetensors reports a file it has no permission to read as "No such file" (root in CI reads any file, so the
    refusal is what safetensors would raise)."""
    import dflash_trt.models.weights as weights

    t = make_target(tmp_path / "t")
    d = make_drafter(tmp_path / "d", t)
    config = load_target(t).config

    def refused(path, framework):
        raise FileNotFoundError(f"No such file or directory: {path}")

    monkeypatch.setattr(weights, "safe_open", refused)
    with pytest.raises(PermissionError, match="permission denied") as e:
        load_drafter(d, config)
    assert e.value.filename == str(d / "model.safetensors")
