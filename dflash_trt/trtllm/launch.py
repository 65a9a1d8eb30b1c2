"""Run an engine directory on TensorRT-LLM: the LLM API for one-off generation, trtllm-serve for serving.

Both read the engine's trtllm/config.yaml, whose paths are relative to the engine (speculative_model: drafter)
so an engine can be moved, and hand TensorRT-LLM those paths made absolute: it resolves a relative
speculative_model against the working directory of each process that reads it (TorchLlmArgs reads the drafter's
config.json, CachedModelLoader takes a path that is not a local directory for a Hugging Face Hub id, and the
executor workers are separate MPI processes), so "drafter" from any other directory would be fetched from the Hub.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
import shutil
from pathlib import Path

import yaml

from dflash_trt.dir_swap import replace_file
from dflash_trt.embedded import cache_dir
from dflash_trt.trtllm.llm_api_keys import TENSORRT_LLM_VERSION, keys_missing_from, release_needed

logger = logging.getLogger(__name__)
CONFIG_PATH = Path("trtllm") / "config.yaml"


def tensorrt_llm_available() -> bool:
    return importlib.util.find_spec("tensorrt_llm") is not None


def install_hint(options: dict | None = None) -> str:
    """What to do without TensorRT-LLM: install it (a release that takes the engine's `options`, where given) where
    there is a GPU for it, else run the torch backend."""
    import torch

    release = release_needed(options or {})
    which = (TENSORRT_LLM_VERSION if release == TENSORRT_LLM_VERSION
             else f"{release} or later (this engine's config needs it)")
    install = f"TensorRT-LLM {which} (NVIDIA's wheel index or the NGC release container; it is not on PyPI)"
    if not torch.cuda.is_available():  # an install would not help: TensorRT-LLM runs on NVIDIA GPUs only
        return f"TensorRT-LLM runs on NVIDIA GPUs and torch sees none here: use --backend torch (on a GPU, {install})"
    return f"install {install}, or use --backend torch"


def require_tensorrt_llm(options: dict | None = None):
    """Import tensorrt_llm, or RuntimeError saying what to install (for an engine's `options`, where given)."""
    try:
        import tensorrt_llm
    except ImportError as e:
        raise RuntimeError(f"tensorrt_llm is not importable ({e}): {install_hint(options)}") from e
    version = getattr(tensorrt_llm, "__version__", "unknown")
    if older_than_pin(version):  # a later release is what the keys past the pin need (check_release)
        logger.warning("tensorrt_llm %s is installed; this engine's config targets %s", version, TENSORRT_LLM_VERSION)
    return tensorrt_llm


def older_than_pin(version: str) -> bool:
    """Whether a tensorrt_llm version predates the pinned release (or cannot be read as a release's)."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version) < Version(TENSORRT_LLM_VERSION)
    except InvalidVersion:
        return True


def check_release(options: dict, version: str) -> None:
    """RuntimeError where the installed release predates a key the options hold (TensorRT-LLM would fail on it with a
    validation error that does not say which release to install)."""
    missing = keys_missing_from(options, version)
    if missing:
        raise RuntimeError(f"tensorrt_llm {version} refuses {'; '.join(missing)}: install a later release, or build "
                           "the engine without that key (e.g. speculative_config.attention_backend: VANILLA, with "
                           "flash-attn)")


def check_planned_for_trtllm(engine) -> None:
    """ValueError unless an EngineDir was planned for TensorRT-LLM (a GPU hardware profile): a CPU profile's plan
    (rows, memory, no CUDA graphs) is this project's runtime's, and its trtllm/config.yaml not one to run."""
    if engine.layout != "trtllm":
        raise ValueError(f"{engine.path} was planned for this project's runtime (plan.json layout {engine.layout!r}), "
                         "not TensorRT-LLM: run it with --backend torch, or build it from a config for a GPU")


def check_flash_attn(options: dict) -> None:
    """RuntimeError where the options' DFlash drafter runs TensorRT-LLM's VANILLA attention (the default) and flash-attn
    is not installed: TensorRT-LLM would fail as it builds the drafter (dflash_attention.py,
    get_dflash_flash_attention), after loading the target."""
    spec = options.get("speculative_config")
    if not isinstance(spec, dict) or str(spec.get("decoding_type", "")).lower() != "dflash":
        return
    if spec.get("attention_backend", "VANILLA") == "VANILLA" and importlib.util.find_spec("flash_attn") is None:
        raise RuntimeError("this engine's drafter attention is TensorRT-LLM's VANILLA backend, which needs flash-attn, "
                           "not installed here: pip install flash-attn (a build for this torch and CUDA), or on "
                           "B200/B300 build the engine with speculative_config.attention_backend: TRTLLM")


def load_options(engine_path: Path) -> dict:
    """The engine's LLM-API options with the paths in them absolute (the drafter directory of this engine)."""
    engine_path = Path(engine_path).resolve()
    path = engine_path / CONFIG_PATH
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the engine has no TensorRT-LLM config; rebuild it with dflash-trt build")
    options = yaml.safe_load(path.read_text())
    spec = options.get("speculative_config")
    if isinstance(spec, dict) and spec.get("speculative_model") is not None:
        model = Path(str(spec["speculative_model"]))
        if not model.is_absolute():
            local = engine_path / model
            if not local.is_dir():
                raise FileNotFoundError(
                    f"{path}: speculative_config.speculative_model={str(model)!r} is not a directory of the engine "
                    f"({local}); rebuild the engine"
                )
            spec["speculative_model"] = str(local)
    return options


def runtime_config(engine) -> Path:
    """A copy of the engine's trtllm/config.yaml with absolute paths (load_options), for `trtllm-serve --config`.

    Written outside the engine directory, whose files the manifest checksums, to one file per engine path in the cache
    directory: serve execs trtllm-serve, so nothing is left to delete a temporary file afterwards, and a file per
    launch would pile up. Replaced atomically, so a serve starting beside another never reads half a file."""
    engine_path = Path(engine.path).resolve()
    key = hashlib.sha256(str(engine_path).encode()).hexdigest()[:12]
    out = cache_dir() / "trtllm" / f"{engine_path.name}-{key}.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    text = (f"# {engine_path / CONFIG_PATH} with absolute paths, written by dflash-trt serve\n"
            + yaml.safe_dump(load_options(engine_path), sort_keys=False))
    replace_file(out, lambda tmp: tmp.write_text(text))
    return out


def new_llm(trtllm, engine, options: dict | None = None):
    """tensorrt_llm.LLM for a verified EngineDir, its options' paths absolute (no working directory to depend on:
    load_options, or the ones the caller loaded) and refused up front on a release that predates one of them."""
    options = load_options(engine.path) if options is None else options
    check_release(options, getattr(trtllm, "__version__", "unknown"))
    check_flash_attn(options)
    return trtllm.LLM(model=str(engine.target_dir), tokenizer=str(engine.tokenizer_dir), **options)


def open_llm(engine):
    """(tensorrt_llm, its LLM) for a verified EngineDir: its options read once, for the install advice (the release
    they need) and for the LLM."""
    check_planned_for_trtllm(engine)
    options = load_options(engine.path)
    trtllm = require_tensorrt_llm(options)
    return trtllm, new_llm(trtllm, engine, options)


def generate(engine, prompts: list[str], max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: int | None = None) -> list[dict]:
    """Generate with tensorrt_llm.LLM from a verified EngineDir; one dict (text, token_ids) per prompt."""
    trtllm, llm = open_llm(engine)
    params = trtllm.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                   top_k=top_k or None, seed=seed)
    outs = llm.generate(prompts, params)
    return [{"text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids)} for o in outs]


def serve_command(engine, host: str = "127.0.0.1", port: int = 8000, reasoning_parser: str | None = None,
                  tool_call_parser: str | None = None) -> list[str]:
    """The trtllm-serve command line for an engine; every path in it, and in the config it passes, is absolute.

    Options as `trtllm-serve serve` defines them (tensorrt_llm/commands/serve.py): MODEL, --tokenizer, --host,
    --port, and the YAML as --config (alias of --extra_llm_api_options), whose keys override the CLI defaults
    (tensor_parallel_size, max_batch_size, ... come from it); --reasoning_parser in its spelling (deepseek-r1), and
    --tool_parser by its name for the format (hermes is its qwen3); parsers by any name serve takes ("none": none)."""
    check_planned_for_trtllm(engine)
    exe = shutil.which("trtllm-serve")
    if exe is None:
        raise RuntimeError(f"trtllm-serve is not on PATH: {install_hint(load_options(engine.path))}")
    try:  # trtllm-serve's release and flash-attn, where it shares this Python's packages
        options = load_options(engine.path)
        check_release(options, importlib.metadata.version("tensorrt_llm"))
        check_flash_attn(options)
    except importlib.metadata.PackageNotFoundError:
        pass
    cmd = [exe, str(engine.target_dir), "--tokenizer", str(engine.tokenizer_dir), "--host", host, "--port", str(port),
           "--config", str(runtime_config(engine))]
    from dflash_trt.server.reasoning import reasoning_parser as reasoning_named
    from dflash_trt.server.tool_calls import tool_call_parser as tools_named

    if (reasoning := reasoning_named(reasoning_parser)) is not None:
        cmd += ["--reasoning_parser", reasoning.name.replace("_", "-")]
    if (tools := tools_named(tool_call_parser)) is not None and not tools.in_trtllm:
        raise ValueError(f"trtllm-serve has no tool parser for {tools.name}'s format: serve this engine with "
                         "--backend torch to read its calls")
    if tools is not None and tools.trtllm_name is not None:  # (gpt-oss's: unasked)
        cmd += ["--tool_parser", tools.trtllm_name]
    return cmd
