"""An engine directory written by `dflash-trt build`: reading its manifest, verifying it, opening it.

`verify()` checks the format version, the manifest's own checksum, the sha256 of every file the manifest lists,
and that no file was added where the runtimes read by glob; serve and generate call it (through `open_engine`)
before loading anything. A file it hashed is not hashed again while its inode, size, mtime and ctime stay those it
had (the record is in the cache directory): a 65 GB engine is not read twice at every start; `inspect --verify`
hashes every file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# dir_swap's kinds for a build: `.ENGINE.build-PID-HEX` being written, `.ENGINE.old-PID-HEX` the engine it replaces
BUILD_WRITING, BUILD_REPLACED = "build", "old"
# The manifest's own checksum: it holds the build config generate and serve run with, and cannot list itself.
MANIFEST_DIGEST = "manifest_sha256"
# Directories the runtimes read by globbing (*.safetensors, optional tokenizer files): a file added there after
# the build would be loaded although no checksum covers it.
LOADED_DIRS = ("target", "drafter", "tokenizer")


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's content (not its formatting), without its MANIFEST_DIGEST entry."""
    body = {k: v for k, v in json.loads(json.dumps(manifest)).items() if k != MANIFEST_DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _stat_key(f: Path) -> list[int]:
    s = f.stat()
    return [s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns]


class _VerifiedRecord:
    """The files of an engine directory a verification hashed, each as [sha256, *_stat_key], in the cache directory
    (the engine's own files are what the manifest checksums), with the engine's path: a record whose engine is gone
    is removed as another is written, so engines built and deleted (a test run's, a CI's) leave none behind."""

    def __init__(self, engine_path: Path) -> None:
        from dflash_trt.embedded import cache_dir

        self.engine = str(engine_path.absolute())
        key = hashlib.sha256(self.engine.encode()).hexdigest()[:16]
        self.path = cache_dir() / "verified" / f"{engine_path.name}-{key}.json"

    def read(self) -> dict:
        record = _read_record(self.path)
        files = record.get("files") if record.get("engine") == self.engine else None
        return files if isinstance(files, dict) else {}  # none yet, unreadable or older: every file is hashed

    def write(self, files: dict) -> None:
        from dflash_trt.dir_swap import replace_file

        record = {"engine": self.engine, "files": files}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            replace_file(self.path, lambda tmp: tmp.write_text(json.dumps(record)))
        except OSError as e:  # a read-only cache costs the next start its hashing, nothing else
            logger.info("could not record the verified files in %s: %s", self.path, e)
            return
        self._remove_orphans()

    def _remove_orphans(self) -> None:
        """Records of engines gone, and of releases before records named their engine (read() takes none of them).
        A record another process rewrites meanwhile costs that engine one hashing; an engine whose path cannot be
        looked at (a folder this user may not enter) keeps its record."""
        for other in self.path.parent.glob("*.json"):
            if other == self.path:
                continue
            try:
                engine = _read_record(other).get("engine")
                if not isinstance(engine, str) or not Path(engine).exists():
                    other.unlink(missing_ok=True)
            except OSError:
                continue


def _read_record(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _missing(f: Path) -> str:
    if f.exists():
        return f"{f}: listed in {MANIFEST} as a file, but not one; rebuild the engine"
    if f.is_symlink():  # target_weights: link
        return (f"{f}: a link to {f.readlink()}, which no longer exists (the engine was built with target_weights: "
                "link and the checkpoint moved); put the checkpoint back, or rebuild the engine")
    return f"{f}: listed in {MANIFEST} but missing; rebuild the engine"


@contextlib.contextmanager
def _read_from(path: Path):
    """Reading keys of the JSON file at `path`: one missing or of the wrong type (a file edited by hand, or written by
    another version, whose checksums still agree) is a ValueError naming the file, not a traceback."""
    try:
        yield
    except KeyError as e:
        raise ValueError(f"{path}: missing key {e.args[0]!r}; rebuild the engine") from None
    except (TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not as this dflash-trt writes it ({e}); rebuild the engine") from None


def format_error(manifest: Path, version) -> str | None:
    """Why this dflash-trt cannot read an engine of format `version` (None where it can): a newer one needs a newer
    dflash-trt, an older one a rebuild."""
    if version == FORMAT_VERSION:
        return None
    newer = isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION
    fix = "upgrade dflash-trt, or rebuild the engine with this one" if newer else "rebuild the engine"
    return f"{manifest}: format_version={version!r}, this dflash-trt reads {FORMAT_VERSION}; {fix}"


def _other_format(manifest: Path, content) -> str | None:
    """format_error() where the manifest says it is of another format: a key or file it lacks is then no damage (that
    format names them otherwise), and naming it would send the user looking for one."""
    if isinstance(content, dict) and "format_version" in content:
        return format_error(manifest, content["format_version"])
    return None


def read_manifest(path: Path) -> dict:
    """The manifest of the engine directory at `path`: FileNotFoundError without one, ValueError naming what makes
    it no dflash-trt manifest (not JSON, a key every version writes missing)."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise FileNotFoundError(
            f"{path}: not an engine directory (no {MANIFEST}); build one with `dflash-trt build CONFIG -o DIR`"
        )
    try:
        content = json.loads(manifest.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{manifest}: invalid JSON ({e}); rebuild the engine") from e
    if not isinstance(content, dict) or not isinstance(content.get("files"), dict):
        raise ValueError(_other_format(manifest, content)
                         or f"{manifest}: not a dflash-trt engine's manifest (no 'files' listing); rebuild the engine")
    missing = [k for k in ("format_version", "build_config", "target") if k not in content]
    if missing:
        raise ValueError(_other_format(manifest, content) or f"{manifest}: missing key {missing[0]!r}; rebuild the "
                         "engine")
    # a listing names the engine's own files: one outside it (../x, /x) would be checksummed and read from there
    outside = [rel for rel in content["files"] if Path(rel).is_absolute() or ".." in Path(rel).parts]
    if outside:
        raise ValueError(f"{manifest}: lists {outside[0]!r}, outside the engine directory; rebuild the engine")
    return content


class EngineDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).resolve()
        self.manifest: dict = read_manifest(self.path)
        gone = [rel for rel in self.manifest["files"] if not (self.path / rel).is_file()]
        if gone:  # cheap (no checksums): every command that opens an engine says so before reading any of it
            raise ValueError(_other_format(self.path / MANIFEST, self.manifest) or _missing(self.path / gone[0]))

    def check_format(self) -> None:
        """ValueError unless this dflash-trt reads the engine's format (cheap: verify() without the checksums)."""
        if error := format_error(self.path / MANIFEST, self.manifest["format_version"]):
            raise ValueError(error)

    def check_digest(self) -> None:
        """ValueError unless the manifest's content matches its own checksum (cheap: no file is read)."""
        recorded = self.manifest.get(MANIFEST_DIGEST)  # absent in engines built before it was written
        if recorded is not None and recorded != manifest_digest(self.manifest):
            raise ValueError(
                f"{self.path / MANIFEST}: its content does not match its {MANIFEST_DIGEST} (edited after the build); "
                "rebuild the engine"
            )

    def check_sizes(self) -> None:
        """ValueError naming the first file whose size is not the manifest's (cheap: a truncated copy or download,
        found without reading a byte; verify() reads them all)."""
        for rel, entry in self.manifest["files"].items():
            with _read_from(self.path / MANIFEST):
                size = entry["size"]
            if (found := (self.path / rel).stat().st_size) != size:
                raise ValueError(f"{self.path / rel}: {found} bytes, {MANIFEST} says {size} (cut short or modified); "
                                 "rebuild the engine")

    def check_unlisted(self) -> None:
        """ValueError naming the first file the runtime may read that the manifest does not list (cheap: a listing,
        no file read)."""
        listed = set(self.manifest["files"])
        for sub in LOADED_DIRS:
            for f in sorted((self.path / sub).rglob("*")):
                rel = f.relative_to(self.path)
                if f.is_file() and str(rel) not in listed and not any(p.startswith(".") for p in rel.parts):
                    raise ValueError(
                        f"{f}: not listed in {MANIFEST} (added after the build; the runtime may read it): "
                        "remove it or rebuild the engine"
                    )

    def verify(self, rehash: bool = False) -> None:
        """ValueError naming the file when the format version or any checksum does not match, or a file was added.

        rehash: hash every file, also those unchanged since a verification hashed them (their inode, size, mtime and
        ctime the same: a write changes the ctime, which no tool sets back)."""
        self.check_format()
        self.check_digest()
        self.check_unlisted()
        record = _VerifiedRecord(self.path)
        recorded = record.read()
        hashed = {} if rehash else dict(recorded)
        for rel, entry in self.manifest["files"].items():
            f = self.path / rel
            if not f.is_file():
                raise ValueError(_missing(f))
            with _read_from(self.path / MANIFEST):
                size, sha256 = entry["size"], entry["sha256"]
            stamp = [sha256, *_stat_key(f)]
            if hashed.get(rel) == stamp:
                continue
            if f.stat().st_size != size or _sha256(f) != sha256:
                raise ValueError(f"{f}: sha256 does not match {MANIFEST} (modified or corrupted); rebuild the engine")
            hashed[rel] = stamp
        if (now := {rel: hashed[rel] for rel in self.manifest["files"]}) != recorded:
            record.write(now)

    @property
    def target_dir(self) -> Path:
        return self.path / "target"

    @property
    def drafter_dir(self) -> Path | None:
        return self.path / "drafter" if self.manifest.get("drafter") else None

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / "tokenizer"

    @property
    def layout(self) -> str:
        """The plan's runtime layout ("torch" or "trtllm"), ValueError naming plan.json where it has none."""
        with _read_from(self.path / "plan.json"):
            return self.plan["layout"]

    @property
    def plan(self) -> dict:
        path = self.path / "plan.json"
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:  # without verify() an edited plan is not caught by its checksum
            raise ValueError(f"{path}: invalid JSON ({e}); rebuild the engine") from e

    @property
    def build_config(self) -> dict:
        return self.manifest["build_config"]

    def engine_config(self, **overrides):
        """The torch runtime's EngineConfig for this engine; keyword overrides (None = keep) win."""
        from dflash_trt.draft_schedule import with_k
        from dflash_trt.engine.llm_engine import EngineConfig

        with _read_from(self.path / "plan.json"):
            plan = self.plan
            values = {"dtype": plan["dtype"], "device": "cuda" if plan["hardware"]["kind"] == "gpu" else "cpu"}
            if overrides.get("draft_len_schedule") is None:
                self._note_auto_schedule_of_another_cpu(plan)
        with _read_from(self.path / MANIFEST):
            values.update(self._build_settings())
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        k = overrides.get("max_draft_len")
        for key in ("draft_len_schedule", "draft_len_schedule_without_amx"):
            if k is not None and overrides.get("draft_len_schedule") is None and values.get(key):
                values[key] = with_k(values[key], k)
        for key in ("draft_len_schedule", "draft_tree"):  # a table asked for holds on any CPU
            if overrides.get(key) is not None and overrides.get(f"{key}_without_amx") is None:
                overrides = {**overrides, f"{key}_without_amx": overrides[key]}
        for key, value in overrides.items():
            if key not in known:
                raise ValueError(f"unknown engine setting {key!r}; known: {sorted(known)}")
            if value is not None:
                values[key] = value
        return EngineConfig(**values)

    def _note_auto_schedule_of_another_cpu(self, plan: dict) -> None:
        """A warning where `draft_len_schedule: auto` chose K for another kind of CPU than this one (an engine built
        on an AMX server, served on an AVX2 laptop, drafts where plain steps would be faster there)."""
        from dflash_trt.hardware import CPU_FITS, cpu_fit

        perf = plan.get("performance") or {}
        built_for = (perf.get("hardware") or {}).get("perf_source")
        if plan["hardware"]["kind"] != "cpu" or perf.get("schedule_source") != "auto":
            return
        # by the kind of CPU whose fit it took: a fit this release does not know (refitted, reworded) says nothing
        kind = next((name for name, fit in CPU_FITS.items() if fit.source == built_for), None)
        if kind is not None and CPU_FITS[kind] != (here := cpu_fit()):
            logger.warning("%s: its draft_len_schedule (auto) was chosen for the CPU it was built on, by the figures "
                           "%s; this CPU's are those %s: rebuild the engine here for K chosen for this CPU, or pass "
                           "--draft-len-schedule", self.path, built_for, here.source)

    def _build_settings(self) -> dict:
        """The EngineConfig values the manifest's build config sets (ValueError for a table key that is no number)."""
        cfg = self.build_config
        spec = cfg.get("speculative_config") or {}
        values = {
            "max_batch_size": cfg["max_batch_size"],
            "max_model_len": cfg["max_seq_len"],
            "max_draft_len": self.manifest.get("max_draft_len") or None,
            "speculative": self.drafter_dir is not None,
        }
        try:
            if spec.get("draft_len_schedule"):
                values["draft_len_schedule"] = {int(b): int(k) for b, k in spec["draft_len_schedule"].items()}
            for key in ("draft_len_schedule_without_amx", "draft_tree", "draft_tree_without_amx"):
                if spec.get(key) is not None:  # an empty table without AMX is one (no tree there), not absent
                    values[key] = {int(b): int(n) for b, n in spec[key].items()}
            if spec.get("draft_vocab_size") is not None:
                values["draft_vocab_size"] = int(spec["draft_vocab_size"])
            if spec.get("lookup_nodes"):
                values["lookup_nodes"] = int(spec["lookup_nodes"])
        except ValueError as e:
            raise ValueError(f"{self.path / MANIFEST}: speculative_config holds what is no number ({e}); "
                             "rebuild the engine") from None
        if spec.get("adaptive_draft_len"):
            values["adaptive_draft_len"] = True
        return values


def open_engine(path: str | Path, backend: str = "torch", **overrides):
    """Verify the engine at `path` and load it on the torch runtime; returns an LLMEngine."""
    if backend not in ("torch", "auto"):  # auto: the torch runtime is what this function returns
        raise ValueError(
            f"open_engine(backend={backend!r}) loads the torch runtime only; TensorRT-LLM runs through "
            "dflash_trt.trtllm.launch"
        )
    from dflash_trt.engine.llm_engine import LLMEngine
    from dflash_trt.models.dflash import load_drafter
    from dflash_trt.models.registry import load_target
    from dflash_trt.models.tokenizer import load_tokenizer

    engine = EngineDir(path)
    engine.verify()
    config = engine.engine_config(**overrides)
    target = load_target(engine.target_dir, config.torch_dtype, config.device)
    drafter = None
    if config.speculative:
        if engine.drafter_dir is None:
            raise ValueError(f"{engine.path}: built without a drafter; pass speculative=False (--no-spec)")
        drafter = load_drafter(engine.drafter_dir, target.config, config.torch_dtype, config.device)
    tokenizer = load_tokenizer(engine.tokenizer_dir, target.config.vocab_size)
    return LLMEngine(target, tokenizer, drafter, config)
