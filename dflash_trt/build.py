"""`dflash-trt build`: a build config -> a validated, planned engine directory (layout in DESIGN.md).

Everything that can fail cheaply (config schema, target-drafter pairing, parallel mapping, memory plan)
runs before any file is written. The engine is written into a temporary directory beside the output and
renamed into place last, so an interrupted build never leaves a directory that serve would load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from dflash_trt import dir_swap
from dflash_trt.config import BuildConfig, build_config_from_dict, load_build_config
from dflash_trt.engine_dir import (BUILD_REPLACED, BUILD_WRITING, FORMAT_VERSION, MANIFEST, MANIFEST_DIGEST,
                                   manifest_digest, read_manifest)
from dflash_trt.hardware import HardwareProfile, profile
from dflash_trt.model_source import ModelSource, resolve_model
from dflash_trt.models.config import DecoderConfig, decoder_config_from_dict, generation_eos_ids, moe_shape
from dflash_trt.models.dflash import DFlashConfig
from dflash_trt.models.tokenizer import load_tokenizer, require_tokenizer_files
from dflash_trt.models.weights import CheckpointError, open_safetensors, read_index, safetensors_files
from dflash_trt.perf_model import plan_performance
from dflash_trt.plan import MemoryPlan, cuda_graph_batch_sizes, plan_build
from dflash_trt.signals import signal_handlers
from dflash_trt.spec.draft_vocab import FILE as DRAFT_VOCAB_FILE, cut_draft_vocab, load_draft_vocab
from dflash_trt.trtllm.config_writer import llm_api_options
from dflash_trt.trtllm.llm_api_keys import (
    LLM_ARGS_SOURCE,
    TENSORRT_LLM_VERSION,
    keys_missing_from,
    release_notes,
)
from dflash_trt.validate import check_mapping, check_pairing

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
INDEX = "model.safetensors.index.json"
TARGET_CONFIG_FILES = ("config.json", "generation_config.json", INDEX)
DRAFTER_CONFIG_FILES = ("config.json", INDEX, DRAFT_VOCAB_FILE)
# Testing knob: stall (sleep) after this build step, so a test can kill the build midway.
STALL_ENV = "DFLASH_TRT_BUILD_STALL_AFTER"


class PlanError(ValueError):
    """The build does not fit the hardware profile; the message has the numbers and the knob."""


@dataclass
class PreparedBuild:
    config: BuildConfig
    base_dir: Path
    hardware: HardwareProfile
    target: ModelSource
    drafter: ModelSource | None
    target_config: DecoderConfig
    drafter_config: DFlashConfig | None
    max_draft_len: int
    plan: MemoryPlan
    trtllm_options: dict


def prepare_build(config_path: str | Path, overrides: dict | None = None, allow_bundled: bool = False,
                  fetch_configs: bool = False) -> PreparedBuild:
    """Validate and plan without writing anything; raises ValueError / FileNotFoundError / PlanError.

    allow_bundled: plan a model not on disk from bundled config values, and with fetch_configs from its config.json
    alone, fetched from the Hub (one request)."""
    cfg, base_dir = load_build_config(config_path, overrides)
    hw = profile(cfg.hardware)
    target = resolve_model(cfg.model, base_dir, "model", allow_bundled, fetch_configs)
    tcfg = decoder_config_from_dict(target.config, f"{cfg.model} config.json")
    if target.path is not None:
        # the engine carries it; TensorRT-LLM and this runtime read its eos ids at load (damaged: a device's failure)
        generation_eos_ids(target.path)
    if hw.kind == "cpu":
        from dflash_trt.models.registry import runtime_class

        runtime_class(tcfg, f"model={cfg.model!r} config.json")
    drafter, dcfg, k = None, None, 0
    auto = cfg.speculative_config is not None and cfg.speculative_config.draft_len_schedule == "auto"
    if cfg.drafter is not None:
        key = "speculative_config.speculative_model"
        drafter = resolve_model(cfg.drafter, base_dir, key, allow_bundled, fetch_configs)
        source = f"{key}={cfg.drafter!r} config.json"
        dcfg = DFlashConfig.from_dict(drafter.config, source)
        # With auto, the pairing check sees no schedule yet; the chooser is capped at the K it resolves.
        k = check_pairing(tcfg, dcfg, _with_schedule(cfg, None, cfg.speculative_config.max_draft_len) if auto else cfg,
                          source)
    check_mapping(tcfg, dcfg, cfg)
    # This runtime drafts among the drafter's draft vocabulary; TensorRT-LLM (GPU profiles) scores the whole head.
    # The file is checked either way: the build copies it.
    ids = load_draft_vocab(drafter.path, tcfg.vocab_size) if drafter is not None and drafter.path is not None else None
    vocab = _draft_vocab_size(cfg, ids) if hw.kind != "gpu" else None
    perf = plan_performance(tcfg, dcfg, cfg, hw, k, cuda_graph_batch_sizes(cfg), vocab)
    if auto:
        cfg, k = _resolve_auto_schedule(cfg, perf.schedule, hw, config_path)
    plan = plan_build(tcfg, dcfg, cfg, hw, k)
    plan.performance = perf.section
    plan.notes.extend(perf.notes)
    if not plan.fits:
        raise PlanError(f"{config_path}: " + "; ".join(problem.rstrip(".") for problem in plan.problems) + ".")
    try:
        options = llm_api_options(cfg, plan, has_experts=moe_shape(tcfg) is not None)
    except ValueError as e:  # trtllm_options' keys and values: the file they are written in
        raise ValueError(f"{config_path}: {e}") from e
    return PreparedBuild(cfg, base_dir, hw, target, drafter, tcfg, dcfg, k, plan, options)


def _draft_vocab_size(cfg: BuildConfig, ids) -> int | None:
    """Rows of the draft head the torch runtime will score with (speculative_config.draft_vocab_size, checked
    against the drafter's draft_vocab.json); None: the whole head."""
    size = cfg.speculative_config.draft_vocab_size if cfg.speculative_config is not None else None
    vocab = cut_draft_vocab(ids, size, "speculative_config.draft_vocab_size", repr(cfg.drafter))
    return vocab.numel() if vocab is not None else None


def _with_schedule(cfg: BuildConfig, schedule: dict[int, int] | None, k: int | None) -> BuildConfig:
    spec = cfg.speculative_config.model_copy(update={"draft_len_schedule": schedule, "max_draft_len": k})
    return cfg.model_copy(update={"speculative_config": spec})


def _resolve_auto_schedule(cfg: BuildConfig, schedule: dict[int, int] | None, hw: HardwareProfile,
                           config_path) -> tuple[BuildConfig, int]:
    """The build config with `draft_len_schedule: auto` replaced by the chosen schedule; max_draft_len becomes
    the K chosen for one row (TensorRT-LLM requires schedule[1] == max_draft_len >= every K)."""
    if not schedule:
        raise ValueError(
            f"{config_path}: speculative_config.draft_len_schedule: auto: the performance model of hardware "
            f"{hw.name} predicts no K that beats plain decoding even for one row with the given "
            "acceptance_by_draft_len; drop speculative_config or measure a better drafter"
        )
    k = schedule[1]
    resolved = _with_schedule(cfg, schedule, k)
    # The copy skipped validation; validate it as if the chosen schedule had been written in the YAML.
    return build_config_from_dict(resolved.model_dump(mode="json"), f"{config_path} (auto schedule)"), k


def sha256_file(path: Path, bar=None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            if bar is not None:
                bar.update(len(chunk))
    return h.hexdigest()


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not enabled, leave=False)


def _stall(step: str) -> None:
    if os.environ.get(STALL_ENV) == step:
        logger.warning("%s=%s: stalling so the build can be interrupted", STALL_ENV, step)
        time.sleep(3600)


def _check_output(out: Path, force: bool) -> None:
    """An existing `out` is replaced only with --force, and only if it is an engine: --force with -o naming a
    checkpoint or any other directory would otherwise delete it once the build is done."""
    if os.path.ismount(out):  # found only after every file was copied and checksummed: the rename into place fails
        raise FileExistsError(f"{out} is a mount point: a build renames the finished engine into place, which a mount "
                              f"point cannot take; pass -o {out / 'ENGINE_NAME'}")
    engine = next((d for d in Path(os.path.abspath(out)).parents if _is_an_engine(d)), None)
    if engine is not None:  # it would hold files its manifest does not list, which --force then refuses to delete
        raise FileExistsError(f"-o {out} is inside the engine {engine}, which would then hold files its manifest does "
                              f"not list (and fail its check where they are in target/, drafter/ or tokenizer/); "
                              f"choose an -o outside it")
    above = next((d for d in out.parents if d.exists()), None)
    if above is not None and not above.is_dir():
        raise FileExistsError(f"{above} is a file, not a directory: -o {out} cannot be made inside it")
    if above is not None:
        try:  # here, not after minutes of reading the checkpoint, and named as -o (not as the build's lock file)
            os.rmdir(tempfile.mkdtemp(dir=above, prefix=f".{out.name}.probe-"))
        except OSError as e:
            raise OSError(f"-o {out}: cannot write in {above} ({e.strerror or e}); choose another -o") from None
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if not force:
        raise FileExistsError(f"{out} exists; pass --force to replace it")
    why = _not_an_engine(out)
    if why:
        raise FileExistsError(
            f"{out} exists and is not an engine directory ({why}); --force replaces only an engine written "
            "by `dflash-trt build`: choose another -o, or move that directory away yourself"
        )


def _is_an_engine(path: Path) -> bool:
    try:
        read_manifest(path)
        return True
    except (OSError, ValueError):
        return False


def _not_an_engine(path: Path) -> str | None:
    """Why directory `path` is not an engine `dflash-trt build` wrote, as it stands (None if it is one): a
    manifest.json alone (a browser extension's, a web app's) does not make one, nor does an engine holding files its
    manifest does not list (--force would delete them with it). Its checksums are not read: a damaged engine is
    still one to replace."""
    try:
        listed = read_manifest(path)["files"]
    except FileNotFoundError:
        return f"no {MANIFEST}"
    except (OSError, ValueError) as e:
        return str(e).removesuffix("; rebuild the engine")
    extra = sorted(str(f.relative_to(path)) for f in path.rglob("*")
                   if not f.is_dir() and str(f.relative_to(path)) not in listed and f.name != MANIFEST
                   and not _mac_metadata(f.name))
    if extra:
        return f"it holds {len(extra)} file(s) its {MANIFEST} does not list, e.g. {extra[0]}"
    return None


def _mac_metadata(name: str) -> bool:
    """What a Mac's Finder or a copy from its disks leaves beside files (an engine copied from one still is one)."""
    return name == ".DS_Store" or name.startswith("._")


def _weight_files(src: Path) -> list[Path]:
    """The safetensors files a loader reads from checkpoint `src` (those its index names, else every *.safetensors),
    each header read: safetensors checks there that the file holds every byte the header lists, so a truncated or
    unreadable file fails here, naming it, on every hardware profile and before anything is copied."""
    index = src / INDEX
    if index.is_file():
        files = sorted(set(read_index(index).values()))
        names = sorted(f.name for f in files)
        twice = next((a for a, b in zip(names, names[1:]) if a == b), None)
        if twice is not None:  # the engine keeps its shards beside the index, where TensorRT-LLM reads them
            raise CheckpointError(f"{index}: two shards named {twice} in different folders; an engine holds its "
                                  "shards in one folder: rename one (and the index's entries for it)")
    else:
        files = safetensors_files(src)
    if not files:
        raise CheckpointError(f"{src}: no *.safetensors weights")
    for f in files:
        with open_safetensors(f):
            pass
    return files


def _copy(src: Path, dst: Path, bar) -> None:
    """shutil.copyfile, reporting every chunk: one checkpoint file can be tens of GB."""
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        while chunk := fi.read(1 << 24):
            fo.write(chunk)
            bar.update(len(chunk))


def _write_weights(src: Path, dst: Path, config_files: tuple[str, ...], files: list[Path], link: bool, bar) -> None:
    dst.mkdir()  # not parents: a temp directory removed under the build fails it
    for name in config_files:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    if any(f.parent != src for f in files):
        # shards in folders of their own go beside the index, which names them there: TensorRT-LLM's loader reads
        # the *.safetensors beside it, not the index's paths (its names are unique: _weight_files)
        index = json.loads((src / INDEX).read_text())
        index["weight_map"] = {name: Path(str(f)).name for name, f in index["weight_map"].items()}
        (dst / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    for f in files:
        if link:
            (dst / f.name).symlink_to(f.resolve())
        else:
            _copy(f, dst / f.name, bar)


def _tokenizer_files(src: Path) -> list[str]:
    require_tokenizer_files(src)
    return [n for n in TOKENIZER_FILES if (src / n).is_file()]


def _write_tokenizer(src: Path, dst: Path, vocab_size: int) -> list[str]:
    dst.mkdir()  # not parents: a temp directory removed under the build fails it
    copied = _tokenizer_files(src)
    for n in copied:
        shutil.copy2(src / n, dst / n)
    # Loaded from the copy, as generate and serve will load it: a damaged file, or one the copy left behind,
    # fails the build instead of the first request.
    load_tokenizer(dst, vocab_size, named=src)
    return copied


def _has_chat_template(tok_dir: Path) -> bool:
    if (tok_dir / "chat_template.jinja").is_file() or (tok_dir / "chat_template.json").is_file():
        return True
    cfg = tok_dir / "tokenizer_config.json"
    return cfg.is_file() and bool(json.loads(cfg.read_text()).get("chat_template"))


def _versions() -> dict:
    import importlib.metadata as md

    out = {"format_version": FORMAT_VERSION, "tensorrt_llm_target": TENSORRT_LLM_VERSION}
    for pkg in ("dflash-trt", "torch", "transformers", "safetensors"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def _summaries(p: PreparedBuild) -> dict:
    t = p.target_config
    target = {"architecture": t.architecture, "model_type": t.model_type, "num_hidden_layers": t.num_hidden_layers,
              "hidden_size": t.hidden_size, "vocab_size": t.vocab_size, "num_attention_heads": t.num_attention_heads,
              "num_key_value_heads": t.num_key_value_heads, "head_dim": t.head_dim, "rope_type": t.rope_type}
    drafter = None
    if p.drafter_config is not None:
        d = p.drafter_config
        drafter = {"num_hidden_layers": d.num_hidden_layers, "hidden_size": d.hidden_size, "block_size": d.block_size,
                   "target_layer_ids": d.target_layer_ids, "mask_token_id": d.mask_token_id,
                   "max_draft_len": p.max_draft_len}
    return {"target": target, "drafter": drafter}


def _check_tensors(p: PreparedBuild) -> None:
    """Every drafter tensor and every target tensor must load with the shapes config.json implies, floating point
    (or MXFP4's packed blocks and scales); the models are built on the meta device, so nothing is kept in memory. The
    drafter's, and a CPU target's, are read to check they are finite; a GPU target's (up to hundreds of GB) only from
    the files' headers, and only for the architectures this project's runtime knows (TensorRT-LLM serves more)."""
    import torch

    from dflash_trt.models.dflash import DFlashDrafter
    from dflash_trt.models.registry import TARGET_ARCHITECTURES, runtime_class
    from dflash_trt.models.weights import WeightSet

    if p.drafter is not None:
        with torch.device("meta"):
            shell = DFlashDrafter(p.drafter_config)
        shell.load_weights(WeightSet(p.drafter.path, check_finite=True))
    cpu = p.hardware.kind == "cpu"
    if cpu or p.target_config.architecture in TARGET_ARCHITECTURES:
        with torch.device("meta"):
            target = runtime_class(p.target_config, f"model={p.config.model!r} config.json")(p.target_config)
        weights = WeightSet(p.target.path, check_finite=cpu, headers_only=not cpu)
        target.load_weights(weights)
        weights.check_no_layers_beyond(p.target_config.num_hidden_layers)
        weights.warn_unused(type(target).__name__, getattr(target, "unread_prefixes", ()))


def build_engine(config_path: str | Path, out_dir: str | Path, overrides: dict | None = None, force: bool = False,
                 progress: bool = True) -> Path:
    """Validate, plan and write the engine for `config_path` at `out_dir`; returns `out_dir`."""
    out = Path(out_dir).resolve()
    # first: a killed --force build may have left the previous engine aside
    dir_swap.remove_stale(out.parent, BUILD_WRITING, BUILD_REPLACED, complete=lambda old: (old / MANIFEST).is_file(),
                          name=out.name, unlocked_replaced=True)
    _check_output(out, force)
    p = prepare_build(config_path, overrides)
    if p.target.path is None or (p.drafter is not None and p.drafter.path is None):
        missing = p.target if p.target.path is None else p.drafter
        raise FileNotFoundError(f"{missing.ref!r} is not on disk; fetch it with `hf download {missing.ref}`")
    weights = {"target": _weight_files(p.target.path),
               "drafter": _weight_files(p.drafter.path) if p.drafter is not None else []}
    _check_tensors(p)
    _tokenizer_files(p.target.path)  # before gigabytes of weights are copied
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = dir_swap.temp_beside(out, BUILD_WRITING)
    with _termination_unwinds(), dir_swap.held(tmp):
        tmp.mkdir()
        _write_files(p, out, tmp, weights, force, progress)
    return out


def _write_files(p: PreparedBuild, out: Path, tmp: Path, weights: dict[str, list[Path]], force: bool,
                 progress: bool) -> None:
    """Write the engine into `tmp`, then swap it in at `out`; on any exit short of that, remove `tmp`."""
    try:
        tokenizer_files = _write_tokenizer(p.target.path, tmp / "tokenizer", p.target_config.vocab_size)
        link = p.config.target_weights == "link"
        copied = weights["drafter"] + ([] if link else weights["target"])
        with _progress(sum(f.stat().st_size for f in copied), "copy weights", progress) as bar:
            _write_weights(p.target.path, tmp / "target", TARGET_CONFIG_FILES, weights["target"], link, bar)
            if p.drafter is not None:
                _write_weights(p.drafter.path, tmp / "drafter", DRAFTER_CONFIG_FILES, weights["drafter"], False, bar)
        (tmp / "plan.json").write_text(json.dumps(p.plan.to_dict(), indent=2) + "\n")
        (tmp / "trtllm").mkdir()
        newer = keys_missing_from(p.trtllm_options)
        (tmp / "trtllm" / "config.yaml").write_text(
            f"# LLM-API options for TensorRT-LLM {TENSORRT_LLM_VERSION} (keys checked against {LLM_ARGS_SOURCE}).\n"
            + "".join(f"# {note}\n" for note in release_notes(p.trtllm_options))
            + "# Serve: dflash-trt serve ENGINE --backend trtllm (from anywhere), or from the engine directory,\n"
            "# where speculative_model's relative path resolves: trtllm-serve target --tokenizer tokenizer --config "
            "trtllm/config.yaml\n"
            + yaml.safe_dump(p.trtllm_options, sort_keys=False)
        )
        _stall("files")
        files = sorted(f for f in tmp.rglob("*") if f.is_file())
        with _progress(sum(f.stat().st_size for f in files), "sha256", progress) as bar:
            checksums = {str(f.relative_to(tmp)): {"sha256": sha256_file(f, bar), "size": f.stat().st_size}
                         for f in files}
        manifest = {
            "format_version": FORMAT_VERSION,
            "name": p.config.name,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "versions": _versions(),
            "build_config": p.config.model_dump(mode="json"),
            "sources": {
                "target": {"ref": p.target.ref, "kind": p.target.kind, "path": str(p.target.path)},
                "drafter": None if p.drafter is None else
                {"ref": p.drafter.ref, "kind": p.drafter.kind, "path": str(p.drafter.path)},
            },
            **_summaries(p),
            "max_draft_len": p.max_draft_len,
            "tokenizer": {"files": tokenizer_files, "chat_template": _has_chat_template(tmp / "tokenizer")},
            "trtllm": {"version": TENSORRT_LLM_VERSION, "llm_args_source": LLM_ARGS_SOURCE,
                       "needs_a_later_release_for": newer},
            "files": checksums,
        }
        manifest[MANIFEST_DIGEST] = manifest_digest(manifest)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        # --force's check again: another process may have written `out` during this build
        dir_swap.swap_in(tmp, out, BUILD_REPLACED, check=lambda: _check_output(out, force))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def _termination_unwinds() -> Iterator[None]:
    """SIGTERM (a stopped job, `timeout`, a scheduler) and SIGHUP (the terminal or SSH session closed) unwind like
    Ctrl-C, so a half-written engine (hundreds of GB for a large target) is removed at once rather than by the next
    build to the same place; a build under nohup, which ignores SIGHUP, goes on. SIGKILL cannot be caught: that case
    stays the next build's (dir_swap.remove_stale)."""
    def unwind(signum: int, frame) -> None:
        raise SystemExit(128 + signum)

    with signal_handlers(unwind, signal.SIGTERM, signal.SIGHUP):
        yield
