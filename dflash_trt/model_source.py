"""Where a model named in a build config lives: the embedded default, a local directory, the Hugging
Face cache, or (for planning only) a bundled copy of its public config.json, else that file alone from the Hub."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.config import EMBEDDED_PREFIX
from dflash_trt.model_configs import bundled_config
from dflash_trt.models.config import read_config_json

EMBEDDED_MODELS = ("smollm2-135m-instruct",)
_HUB_TIMEOUT_S = 10


@dataclass(frozen=True)
class ModelSource:
    ref: str  # as written in the build config
    kind: str  # "embedded" | "local" | "hf_cache" | "bundled" | "hub_config"
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


def _hub_config(repo_id: str) -> tuple[dict | None, str]:
    """The repo's config.json alone, fetched from the Hub (a plan needs no weights), or None and why not.

    One request, no retries (offline, hf_hub_download retries for 23 s), and not into the HF cache, where a snapshot
    of one file would read as the model downloaded and a build would look there for weights. Not through
    huggingface_hub's session: it refuses every request under the HF_HUB_OFFLINE=1 that the CLI sets by default."""
    import httpx
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

    url = hf_hub_url(repo_id, "config.json")
    try:
        response = httpx.get(url, headers=build_hf_headers(), timeout=_HUB_TIMEOUT_S, follow_redirects=True)
        hf_raise_for_status(response)
    except (TypeError, AttributeError):  # a call this huggingface_hub does not take: a bug to see, not a reason
        raise
    except Exception as e:  # noqa: BLE001 - no route, timeout, 401/403 gated, 404: each means no config here
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'}"
    try:
        config = json.loads(response.text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{url}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{url}: a JSON {type(config).__name__}, not an object of config keys")
    return config, ""


def resolve_model(ref: str, base_dir: Path, key: str, allow_bundled: bool = False,
                  fetch_configs: bool = False) -> ModelSource:
    """Resolve `ref` (the value of build-config key `key`); `base_dir` anchors relative paths.

    allow_bundled: a plan's resolution, which takes config values alone (bundled ones, or with fetch_configs, the
    config.json fetched from the Hub) for a model that is not on disk."""
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
    hint = " (`--plan-only` plans with bundled config values, or with the config.json alone from the Hub)"
    if allow_bundled:
        hint = ""
        if not (base_dir / ref.split("/")[0]).is_dir():  # else a path written without ./: the hint below says so
            fetched, why = _hub_config(ref) if fetch_configs else (None, "fetching is off, as under HF_HUB_OFFLINE=1")
            if fetched is not None:
                return ModelSource(ref, "hub_config", None, fetched)
            hint = f" (nor could its config.json alone be fetched for the plan: {why})"
    raise FileNotFoundError(
        f"{key}={ref!r} is not on disk: fetch it with `hf download {ref}` (huggingface_hub) on a machine with "
        f"network access, or set {key} to a local directory (written ./{ref} if that is what you meant){hint}"
    )
