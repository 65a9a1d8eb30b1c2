"""Safetensors checkpoints as a name -> tensor set with checked lookups.

Every lookup names the tensor and the directory it came from, so a missing or misshapen tensor is
reported before any generation starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


class CheckpointError(ValueError):
    """A checkpoint is missing a tensor, has a wrong shape, or cannot be read."""


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except FileNotFoundError:
        raise
    except Exception as e:  # safetensors raises its own SafetensorError for a bad header or a cut-short file
        raise CheckpointError(f"{path}: not a readable safetensors file ({e}); it may be truncated or corrupt") from e


class WeightSet:
    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self._file_of: dict[str, Path] = {}
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: self.model_dir / f for name, f in weight_map.items()}
        else:
            files = sorted(self.model_dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.model_dir}: no *.safetensors files")
            for f in files:
                with _open(f) as h:
                    for name in h.keys():
                        self._file_of[name] = f
        self._handles: dict[Path, object] = {}
        self.used: set[str] = set()

    def names(self) -> list[str]:
        return sorted(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if name not in self._file_of:
            raise CheckpointError(f"{self.model_dir}: missing tensor {name!r}")
        path = self._file_of[name]
        if path not in self._handles:
            self._handles[path] = _open(path)
        try:
            t = self._handles[path].get_tensor(name)
        except Exception as e:  # safetensors' own error types: a file cut short after its header
            raise CheckpointError(f"{path}: cannot read tensor {name!r} ({e}); the file may be truncated") from e
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)} from config.json"
            )
        self.used.add(name)
        return t

    def unused(self) -> list[str]:
        return sorted(set(self._file_of) - self.used)
