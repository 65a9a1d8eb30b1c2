"""Run an engine directory on TensorRT-LLM: the LLM API for one-off generation, trtllm-serve for serving.

Both read the engine's trtllm/config.yaml and run from the engine directory, where its relative
paths (speculative_model: drafter) resolve.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from pathlib import Path

import yaml

from dflash_trt.trtllm.llm_api_keys import TENSORRT_LLM_VERSION

logger = logging.getLogger(__name__)
CONFIG_PATH = Path("trtllm") / "config.yaml"


def tensorrt_llm_available() -> bool:
    return importlib.util.find_spec("tensorrt_llm") is not None


def require_tensorrt_llm():
    """Import tensorrt_llm, or RuntimeError saying what to install."""
    try:
        import tensorrt_llm
    except ImportError as e:
        raise RuntimeError(
            f"tensorrt_llm is not importable ({e}): install TensorRT-LLM {TENSORRT_LLM_VERSION} (NVIDIA's wheel "
            "index or the NGC release container; it is not on PyPI), or use --backend torch"
        ) from e
    version = getattr(tensorrt_llm, "__version__", "unknown")
    if version != TENSORRT_LLM_VERSION:
        logger.warning("tensorrt_llm %s is installed; this engine's config targets %s", version, TENSORRT_LLM_VERSION)
    return tensorrt_llm


def load_options(engine_path: Path) -> dict:
    path = engine_path / CONFIG_PATH
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the engine has no TensorRT-LLM config; rebuild it with dflash-trt build")
    return yaml.safe_load(path.read_text())


def generate(engine, prompts: list[str], max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: int | None = None) -> list[dict]:
    """Generate with tensorrt_llm.LLM from a verified EngineDir; one dict (text, token_ids) per prompt."""
    trtllm = require_tensorrt_llm()
    options = load_options(engine.path)
    cwd = os.getcwd()
    os.chdir(engine.path)  # relative paths in the config resolve against the engine directory
    try:
        llm = trtllm.LLM(model=str(engine.target_dir), tokenizer=str(engine.tokenizer_dir), **options)
        params = trtllm.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                       top_k=top_k or None, seed=seed)
        outs = llm.generate(prompts, params)
    finally:
        os.chdir(cwd)
    return [{"text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids)} for o in outs]


def serve_command(engine, host: str = "127.0.0.1", port: int = 8000) -> list[str]:
    """The trtllm-serve command line for an engine (run it with cwd=engine.path)."""
    exe = shutil.which("trtllm-serve")
    if exe is None:
        raise RuntimeError(
            f"trtllm-serve is not on PATH: install TensorRT-LLM {TENSORRT_LLM_VERSION}, or use --backend torch"
        )
    return [exe, str(engine.target_dir), "--tokenizer", str(engine.tokenizer_dir), "--host", host, "--port", str(port),
            "--config", str(engine.path / CONFIG_PATH)]
