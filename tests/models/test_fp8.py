"""FP8 checkpoints read as the weights they stand for: a block-quantized one (Qwen's and DeepSeek's -FP8 format) gives
the logits transformers gives reading the same files; per-tensor and per-channel scales (ModelOpt's,
compressed-tensors') as a torch reference multiplies them; an FP8 weight without a scale the runtime reads, in a
checkpoint that declares its quantization, is refused naming it (one that declares none reads as stored:
tests/test_build.py)."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_trt.layers.attention import AttentionMetadata
from dflash_trt.models.config import decoder_config_from_dict
from dflash_trt.models.registry import load_target
from dflash_trt.models.weights import CheckpointError, WeightSet

BLOCK = 32
FP8_MAX = 448.0  # float8_e4m3fn's largest value


def _block_quantized(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w as float8 and the scale of each block x block tile (its largest magnitude over FP8's), as Qwen's FP8 releases
    store them: the scale grid ceil(rows / block) x ceil(cols / block), the last tiles partial."""
    rows, cols = w.shape
    grid = torch.zeros(math.ceil(rows / block), math.ceil(cols / block))
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            grid[i, j] = w[i * block:(i + 1) * block, j * block:(j + 1) * block].abs().max().clamp(min=1e-8) / FP8_MAX
    full = torch.kron(grid, torch.ones(block, block))[:rows, :cols]
    return (w / full).to(torch.float8_e4m3fn), grid


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Qwen3 saved as it is and with its layers' linears block-quantized (whole blocks: transformers takes
    the block from the shapes)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("fp8")
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                         tie_word_embeddings=False)
    Qwen3ForCausalLM(config).float().save_pretrained(root / "bf16")
    tensors = {}
    for name, w in load_file(root / "bf16" / "model.safetensors").items():
        if ".layers." in name and name.endswith("proj.weight"):  # the embeddings, norms and head stay unquantized
            tensors[name], tensors[name + "_scale_inv"] = _block_quantized(w, BLOCK)
        else:
            tensors[name] = w
    fp8 = Path(shutil.copytree(root / "bf16", root / "fp8"))
    save_file(tensors, fp8 / "model.safetensors")
    raw = json.loads((fp8 / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [BLOCK, BLOCK]}
    (fp8 / "config.json").write_text(json.dumps(raw))
    return root / "bf16", fp8


def _logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    model = load_target(model_dir)
    meta = AttentionMetadata.causal_step(torch.tensor([0]), torch.arange(ids.shape[1])[None])
    with torch.no_grad():
        return model.compute_logits(model(ids, meta, model.make_cache(1, ids.shape[1]))[0])


def test_a_block_quantized_checkpoint_gives_the_logits_transformers_reads_from_it(fp8_pair):
    from transformers import AutoModelForCausalLM

    unquantized, fp8 = fp8_pair
    ids = torch.randint(3, 90, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # transformers without a GPU dequantizes FP8 checkpoints as it loads them
        want = AutoModelForCausalLM.from_pretrained(fp8, dtype=torch.float32)(ids).logits
        before = AutoModelForCausalLM.from_pretrained(unquantized, dtype=torch.float32)(ids).logits
    assert (want - before).abs().max() > 1e-2  # the quantization shows: the scales must be applied as it applied them
    assert (_logits(fp8, ids) - want).abs().max() < 1e-5


def _write(path: Path, tensors: dict[str, torch.Tensor], quantization: dict | None = None) -> Path:
    path.mkdir()
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({"quantization_config": quantization} if quantization else {}))
    return path


def test_per_tensor_per_channel_and_block_scales_multiply_the_weight(tmp_path):
    g = torch.Generator().manual_seed(2)
    w = [(torch.randn(48, 40, generator=g) * 4).to(torch.float8_e4m3fn) for _ in range(3)]
    scalar, channels, grid = torch.tensor(0.02), torch.rand(48, 1, generator=g), torch.rand(3, 2, generator=g)
    d = _write(tmp_path / "ckpt", {"a.weight": w[0], "a.weight_scale": scalar, "b.weight": w[1],
                                   "b.weight_scale": channels, "c.weight": w[2], "c.weight_scale_inv": grid},
               {"quant_method": "fp8", "weight_block_size": [16, 32]})
    weights = WeightSet(d)
    assert torch.equal(weights.get("a.weight", (48, 40)), w[0].float() * 0.02)
    assert torch.equal(weights.get("b.weight"), w[1].float() * channels)
    assert torch.equal(weights.get("c.weight"), w[2].float() * torch.kron(grid, torch.ones(16, 32))[:48, :40])
    assert weights.unused() == []  # the scales are read with their weights
    headers = WeightSet(d, headers_only=True).get("c.weight")
    assert headers.shape == (48, 40) and headers.dtype == torch.float32


@pytest.mark.parametrize("quantization", [
    {"quant_method": "fp8"},  # no block named: transformers' 128 x 128
    {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {"block_structure": [128, 128]}}}},
], ids=["fp8 without a block size", "compressed-tensors' block structure"])
def test_a_grid_of_scales_covers_the_blocks_the_config_names_or_else_128_square(tmp_path, caplog, quantization):
    """300 rows in 3 blocks: of 128 (the last partial), not of 100, which the grid's shape alone would also fit."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(300, 200, generator=g) * 4).to(torch.float8_e4m3fn)
    grid = torch.rand(3, 2, generator=g)
    d = _write(tmp_path / "ckpt", {"l.weight": w, "l.weight_scale_inv": grid, "l.input_scale": torch.tensor(1.0)},
               quantization)
    weights = WeightSet(d)
    assert torch.equal(weights.get("l.weight"), w.float() * torch.kron(grid, torch.ones(128, 128))[:300, :200])
    with caplog.at_level("WARNING"):
        weights.warn_unused("test")
    assert "not used" not in caplog.text  # an activation scale: for kernels that quantize activations


@pytest.mark.parametrize("tensors, says", [
    ({"a.weight": torch.ones(4, 4).to(torch.float8_e4m3fn)},
     "'a.weight' is torch.float8_e4m3fn with no scale .* declares quantization 'fp8'"),
    ({"a.weight": torch.ones(4, 4).to(torch.float8_e4m3fn), "a.weight_scale_inv": torch.ones(3, 3)},
     r"a.weight: its scale has shape \(3, 3\); .* grid of 2 x 2 blocks \(2, 2\)"),
])
def test_an_fp8_weight_without_a_scale_it_reads_is_refused_naming_it(tmp_path, tensors, says):
    d = _write(tmp_path / "ckpt", tensors, {"quant_method": "fp8", "weight_block_size": [2, 2]})
    with pytest.raises(CheckpointError, match=says):
        WeightSet(d).get("a.weight")


def test_a_multimodal_checkpoints_quantization_is_read_from_its_top_level():
    """Qwen3.5's FP8 releases keep quantization_config beside text_config: the language model's config carries it
    (the planner reads its KV cache algorithm, the loader its block size)."""
    from dflash_trt.models.fp8 import quantization_config, weight_block_size

    quantization = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    text = {"model_type": "qwen3_5_text", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "vocab_size": 96,
            "max_position_embeddings": 128, "rms_norm_eps": 1e-6}
    raw = {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
           "quantization_config": quantization}
    assert decoder_config_from_dict(raw).extra["quantization_config"] == quantization
    assert weight_block_size(quantization_config(raw)) == (128, 128)
