"""Bundled copies of public config.json values, for planning a build whose model is not on disk.

Each file holds one model's config.json plus a `_bundled` entry naming the HF id and where the values
come from. A model directory on disk always wins over these copies.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def bundled_configs() -> dict[str, Path]:
    """HF id -> bundled config file."""
    out = {}
    for path in sorted(HERE.glob("*.json")):
        out[json.loads(path.read_text())["_bundled"]["hf_id"]] = path
    return out


def bundled_config(hf_id: str) -> dict | None:
    """The bundled config.json dict for `hf_id` (without the `_bundled` entry), or None."""
    path = bundled_configs().get(hf_id)
    if path is None:
        return None
    cfg = json.loads(path.read_text())
    cfg.pop("_bundled")
    return cfg
