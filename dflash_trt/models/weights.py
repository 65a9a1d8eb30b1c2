"""Safetensors checkpoints as a name -> tensor set with checked lookups.

Every lookup names the tensor and the directory it came from, so a missing or misshapen tensor is
reported before any generation starts.
"""

from __future__ import annotations

import json
import logging
import re
from functools import cached_property
from pathlib import Path

import torch
from safetensors import safe_open

from dflash_trt.models.fp8 import FP8_DTYPES, SCALE_SUFFIXES, dequantize, quantization_config, weight_block_size

logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint is missing a tensor, has a wrong shape, or cannot be read."""


def open_safetensors(path: Path):
    if Path(path).exists() and not Path(path).is_file():  # a FIFO's open waits for a writer: the build hung
        raise CheckpointError(f"{path}: not a regular file (a folder, a pipe or a device), not a safetensors file")
    try:
        return safe_open(str(path), framework="pt")
    except FileNotFoundError:
        if Path(path).is_file():  # safetensors says "No such file" of a file it may not read
            raise PermissionError(13, "permission denied (the file is there, but not readable)", str(path)) from None
        raise
    except Exception as e:  # safetensors raises its own SafetensorError for a bad header or a cut-short file
        raise CheckpointError(f"{path}: not a readable safetensors file ({e}); it may be truncated or corrupt") from e


def read_index(index: Path) -> dict[str, Path]:
    """A sharded checkpoint's tensor -> shard file, every shard checked present and inside the checkpoint (a build
    copies the shards where the index says, and an engine must hold every file it reads)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        file_of = {str(name): index.parent / str(f) for name, f in weight_map.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # bad JSON, or no weight_map object in it
        raise CheckpointError(f"{index}: not a safetensors index ({type(e).__name__}: {e}); it needs a "
                              '"weight_map" of tensor name -> file') from e
    if not file_of:  # read as a checkpoint without weights ("no *.safetensors weights" beside its shards)
        raise CheckpointError(f"{index}: its weight_map is empty; it needs an entry of tensor name -> file for every "
                              "tensor")
    outside = sorted({str(f) for f in weight_map.values() if Path(str(f)).is_absolute() or ".." in Path(str(f)).parts})
    if outside:
        raise CheckpointError(f"{index}: shard {outside[0]!r} is outside the checkpoint directory; shards are named "
                              "relative to it")
    missing = sorted({f for f in file_of.values() if not f.is_file()})
    if missing:
        raise CheckpointError(f"{missing[0]}: named in {index} but missing")
    return file_of


def safetensors_files(model_dir: Path) -> list[Path]:
    """A directory's *.safetensors, hidden files left out, as an engine's checksums leave them (the `._x.safetensors`
    a macOS copy leaves beside every file is not a checkpoint shard)."""
    return sorted(f for f in model_dir.glob("*.safetensors") if not f.name.startswith("."))


# safetensors' dtype names (its header's "dtype" strings)
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


UNREAD_SUFFIXES = ("rotary_emb.inv_freq", ".input_scale", ".k_scale", ".v_scale")


class WeightSet:
    """check_finite: a floating tensor holding NaN or Inf is refused (a build reads each tensor once, to check it;
    a corrupt weight otherwise runs, writing token 0 forever or drafting nothing). headers_only: tensors are read
    from the files' headers alone, as meta tensors of their shape and dtype (a build's check of a checkpoint too
    large to read in full: names, shapes and dtypes, not values)."""

    def __init__(self, model_dir: str | Path, check_finite: bool = False, headers_only: bool = False) -> None:
        self.model_dir = Path(model_dir)
        self.check_finite = check_finite
        self.headers_only = headers_only
        self._file_of: dict[str, Path] = {}
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            self._file_of = read_index(index)
        else:
            files = safetensors_files(self.model_dir)
            if not files:
                raise CheckpointError(f"{self.model_dir}: no *.safetensors files")
            for f in files:
                with open_safetensors(f) as h:
                    for name in h.keys():
                        if name in self._file_of:  # which copy a loader took would depend on the files' order
                            raise CheckpointError(f"{self.model_dir}: tensor {name!r} is in both "
                                                  f"{self._file_of[name].name} and {f.name}")
                        self._file_of[name] = f
        self._handles: dict[Path, object] = {}
        self._keys: dict[Path, set[str]] = {}
        self.used: set[str] = set()

    def names(self) -> list[str]:
        return sorted(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str, shape: tuple[int, ...] | None = None, floating: bool = True) -> torch.Tensor:
        """floating: the tensor must be floating point (False for packed ones, MXFP4's blocks and scales)."""
        if name not in self._file_of:
            raise CheckpointError(f"{self.model_dir}: missing tensor {name!r}")
        path = self._file_of[name]
        if path not in self._handles:
            self._handles[path] = open_safetensors(path)
            self._keys[path] = set(self._handles[path].keys())
        if name not in self._keys[path]:
            raise CheckpointError(f"{self.model_dir / 'model.safetensors.index.json'}: names {path.name} for tensor "
                                  f"{name!r}, which that file does not hold")
        try:
            t = self._header_tensor(path, name) if self.headers_only else self._handles[path].get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors' own error types: a file cut short after its header
            raise CheckpointError(f"{path}: cannot read tensor {name!r} ({e}); the file may be truncated") from e
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)} from config.json"
            )
        if floating and not t.is_floating_point():
            raise CheckpointError(f"{path}: tensor {name!r} is {t.dtype}; these weights are floating point (a "
                                  "checkpoint quantized in a format this runtime does not read?)")
        if floating and t.dtype in FP8_DTYPES:
            t = self._dequantized(path, name, t)
        if self.check_finite and t.is_floating_point() and not _all_finite(t):
            raise CheckpointError(f"{path}: tensor {name!r} holds NaN or Inf values")
        self.used.add(name)
        return t

    @cached_property
    def _quantization(self) -> dict | None:
        """config.json's quantization_config (read once, at the first FP8 tensor)."""
        from dflash_trt.models.config import read_config_json

        has_config = (self.model_dir / "config.json").is_file()
        return quantization_config(read_config_json(self.model_dir)) if has_config else None

    def _dequantized(self, path: Path, name: str, t: torch.Tensor) -> torch.Tensor:
        """An FP8 weight as the fp32 weight it stands for, by the scale beside it (models/fp8.py); without one, its
        values as stored, unless config.json declares a quantization (whose scale this runtime would not apply)."""
        quantization = self._quantization
        scale_name = next((name + suffix for suffix in SCALE_SUFFIXES if name + suffix in self._file_of), None)
        if scale_name is None:
            if quantization is None:
                return t
            raise CheckpointError(f"{path}: tensor {name!r} is {t.dtype} with no scale beside it "
                                  f"({' or '.join(name + s for s in SCALE_SUFFIXES)}), and config.json declares "
                                  f"quantization {quantization.get('quant_method')!r}: a format this runtime does not "
                                  "read")
        scale = self.get(scale_name)
        if self.headers_only:
            return torch.empty(t.shape, dtype=torch.float32, device="meta")
        try:
            return dequantize(t, scale, weight_block_size(quantization), name)
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from e

    def _header_tensor(self, path: Path, name: str) -> torch.Tensor:
        piece = self._handles[path].get_slice(name)
        dtype = _DTYPES.get(piece.get_dtype())
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name!r} is {piece.get_dtype()}, which this runtime does not read")
        return torch.empty(piece.get_shape(), dtype=dtype, device="meta")

    def unused(self) -> list[str]:
        return sorted(set(self._file_of) - self.used)

    def warn_unused(self, reader: str, unread: tuple[str, ...] = ()) -> None:
        """Log the tensors `reader` (a model class) left unread: a checkpoint of another variant whose extra
        weights would be dropped silently (HF's rotary inv_freq buffers are derived, not weights; an FP8 checkpoint's
        activation and K/V scales are for kernels that quantize those, which this runtime keeps in its dtype; tensors
        under the prefixes `unread` are parts the reader knows it does not run)."""
        skipped = [n for n in self.unused() if not n.endswith(UNREAD_SUFFIXES) and not n.startswith(unread)]
        if skipped:
            logger.warning("%s: %d tensors not used by %s, e.g. %s", self.model_dir, len(skipped), reader, skipped[:3])

    def check_no_layers_beyond(self, num_layers: int) -> None:
        """CheckpointError where unused tensors belong to layers past num_hidden_layers: a config.json that
        undercounts the checkpoint's layers would run the model without them, and write nonsense."""
        deeper = sorted({int(m.group(1)) for n in self.unused() if (m := re.search(r"(?:^|\.)layers\.(\d+)\.", n))
                         and int(m.group(1)) >= num_layers})
        if deeper:
            which = "layer index" if len(deeper) == 1 else "layer indices"
            raise CheckpointError(f"{self.model_dir}: the weights hold {which} {', '.join(map(str, deeper))}, but "
                                  f"config.json says num_hidden_layers={num_layers} (layers 0..{num_layers - 1}): "
                                  "fix num_hidden_layers, or use the config.json that came with these weights")


def _all_finite(t: torch.Tensor) -> bool:
    """torch.isfinite takes no float8: a one-byte float is screened by its bit patterns, found from the dtype itself
    (a float32 copy to check would be four times the tensor)."""
    if t.element_size() != 1:
        return bool(torch.isfinite(t).all())
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    bad = codes[~torch.isfinite(codes.view(t.dtype).to(torch.float32))]
    return not bool(torch.isin(t.view(torch.uint8), bad).any())
