"""Where a model named in a build config lives: the embedded default, a local directory, the Hugging
Face cache, or (for planning only) a bundled copy of its public config.json."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash_trt.config import EMBEDDED_PREFIX
from dflash_trt.model_configs import bundled_config
from dflash_trt.models.config import read_config_json

EMBEDDED_MODELS = ("smollm2-135m-instruct",)


@dataclass(frozen=True)
class ModelSource:
    ref: str  # as written in the build config
    kind: str  # "embedded" | "local" | "hf_cache" | "bundled"
    path: Path | None  # the model directory; None when only bundled config values are known
    config: dict  # its config.json


def is_local_ref(ref: str) -> bool:
    return ref.startswith(("./", "../", "/", "~"))


def _hf_cache_dir(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        return None
    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None


def resolve_model(ref: str, base_dir: Path, key: str, allow_bundled: bool = False) -> ModelSource:
    """Resolve `ref` (the value of build-config key `key`); `base_dir` anchors relative paths."""
    if ref.startswith(EMBEDDED_PREFIX):
        name = ref.removeprefix(EMBEDDED_PREFIX)
        if name not in EMBEDDED_MODELS:
            raise ValueError(f"{key}={ref!r}: unknown embedded model; choose one of {list(EMBEDDED_MODELS)}")
        from dflash_trt.embedded import smollm2_dir

        path = smollm2_dir()
        return ModelSource(ref, "embedded", path, read_config_json(path))
    if is_local_ref(ref):
        path = (base_dir / Path(ref).expanduser()).resolve()
        if not path.exists():
            raise FileNotFoundError(f"{key}={ref!r}: {path} does not exist")
        try:
            config = read_config_json(path)  # names a training --out's drafter
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{key}={ref!r}: {e}") from None
        return ModelSource(ref, "local", path, config)
    if ref.count("/") != 1:
        raise ValueError(
            f"{key}={ref!r} is neither an HF id (org/name) nor a local path; write local paths as ./dir, ../dir or /abs"
        )
    cached = _hf_cache_dir(ref)
    if cached is not None and (cached / "config.json").is_file():
        return ModelSource(ref, "hf_cache", cached, read_config_json(cached))
    bundled = bundled_config(ref) if allow_bundled else None
    if bundled is not None:
        return ModelSource(ref, "bundled", None, bundled)
    hint = "" if allow_bundled else " (`--plan-only` can plan with bundled config values where they exist)"
    raise FileNotFoundError(
        f"{key}={ref!r} is not on disk: fetch it with `hf download {ref}` (huggingface_hub) on a machine with "
        f"network access, or set {key} to a local directory (written ./{ref} if that is what you meant){hint}"
    )
