"""Triton Inference Server: export a model repository (python backend, decoupled for streaming) whose
inputs and outputs follow TensorRT-LLM's llmapi Triton model, and run the tritonserver binary that
`nvidia-pytriton==0.7.0` ships (env-probe §2.4) on it.

Repository layout:  REPO/NAME/config.pbtxt   REPO/NAME/1/model.py  (a copy of server/triton_model.py)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dflash_trt import dir_swap
from dflash_trt.runtime_device import use_threads
from dflash_trt.server.sockets import address, bound
from dflash_trt.signals import stop_signals

logger = logging.getLogger(__name__)

MODEL_TEMPLATE = Path(__file__).with_name("triton_model.py")

# (name, Triton type, dims) as in TensorRT-LLM's triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt.
INPUTS = [
    ("text_input", "TYPE_STRING", "[ -1 ]", False),
    ("streaming", "TYPE_BOOL", "[ 1 ]", True),
    ("sampling_param_temperature", "TYPE_FP32", "[ 1 ]", True),
    ("sampling_param_top_k", "TYPE_INT32", "[ 1 ]", True),
    ("sampling_param_top_p", "TYPE_FP32", "[ 1 ]", True),
    ("sampling_param_max_tokens", "TYPE_INT32", "[ 1 ]", True),
    ("sampling_param_stop", "TYPE_STRING", "[ -1 ]", True),
    ("sampling_param_seed", "TYPE_UINT64", "[ 1 ]", True),
    ("return_finish_reason", "TYPE_BOOL", "[ 1 ]", True),
    # taken so that clients written for TensorRT-LLM's model are not refused as sending unexpected inputs;
    # triton_model.py answers a value it cannot honour with an error naming the input
    ("sampling_param_best_of", "TYPE_INT32", "[ 1 ]", True),
    ("sampling_param_frequency_penalty", "TYPE_FP32", "[ 1 ]", True),
    ("sampling_param_presence_penalty", "TYPE_FP32", "[ 1 ]", True),
    ("sampling_param_exclude_input_from_output", "TYPE_BOOL", "[ 1 ]", True),
    ("sampling_param_return_perf_metrics", "TYPE_BOOL", "[ 1 ]", True),
    ("return_stop_reason", "TYPE_BOOL", "[ 1 ]", True),
    ("return_cumulative_logprob", "TYPE_BOOL", "[ 1 ]", True),
]
OUTPUTS = [
    ("text_output", "TYPE_STRING", "[ -1 ]"),
    ("finish_reason", "TYPE_STRING", "[ -1 ]"),
    ("acceptance_rate", "TYPE_FP32", "[ 1 ]"),
    ("total_accepted_draft_tokens", "TYPE_INT32", "[ 1 ]"),
    ("total_draft_tokens", "TYPE_INT32", "[ 1 ]"),
]


@dataclass
class ModelSettings:
    """What model.py loads; written as config.pbtxt `parameters` (strings) and read back from them."""

    engine_dir: str = ""  # an engine built by `dflash-trt build`; or target_dir (+ drafter_dir)
    target_dir: str = ""
    drafter_dir: str = ""
    speculative: bool = True
    backend: str = "torch"  # torch: this project's runtime; trtllm: tensorrt_llm.LLM with the engine's config
    max_batch_size: int = 8
    max_model_len: int = 0  # 0: the engine's default
    max_draft_len: int = 0  # 0: the engine's default
    dtype: str = ""  # "": the engine's default
    threads: int = 0  # CPU threads; 0: torch's default
    # True: many responses a request (streaming); False: one, for Triton's unary infer, which Triton's HTTP endpoint
    # refuses for a decoupled model (501)
    decoupled: bool = True

    def __post_init__(self) -> None:
        if not self.engine_dir and not self.target_dir:
            raise ValueError("a Triton model needs an engine directory or a target directory")
        if self.backend not in ("torch", "trtllm"):
            raise ValueError(f"backend must be torch or trtllm, got {self.backend!r}")
        if self.backend == "trtllm" and not self.engine_dir:
            raise ValueError("the trtllm backend serves an engine directory built by `dflash-trt build`")
        if self.speculative and not self.engine_dir and not self.drafter_dir:
            raise ValueError("speculative decoding needs a drafter directory (or speculative=False)")

    def to_parameters(self) -> dict[str, str]:
        return {f.name: str(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> "ModelSettings":
        values: dict = {}
        for f in dataclasses.fields(cls):
            if f.name not in params:
                continue
            raw = params[f.name]
            values[f.name] = raw == "True" if f.type in ("bool", bool) else int(raw) if f.type in ("int", int) else raw
        return cls(**values)

    def open_engine(self):
        """The torch runtime's LLMEngine for these settings, on the thread that will step it."""
        use_threads(self.threads)
        overrides = {"max_batch_size": self.max_batch_size, "max_model_len": self.max_model_len or None,
                     "max_draft_len": self.max_draft_len or None, "dtype": self.dtype or None}
        if self.engine_dir:
            from dflash_trt.engine_dir import open_engine

            if not self.speculative:
                overrides["speculative"] = False
            return open_engine(self.engine_dir, backend="torch", **overrides)
        from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine
        from dflash_trt.runtime_device import target_runtime

        # as generate and serve run checkpoints: the GPU where torch sees one, in bf16 there
        overrides["device"], overrides["dtype"] = target_runtime(None, overrides["dtype"])
        config = EngineConfig(speculative=self.speculative, **{k: v for k, v in overrides.items() if v is not None})
        return LLMEngine.from_dirs(self.target_dir, self.drafter_dir or None, config)


PATHS = ("engine_dir", "target_dir", "drafter_dir")


def relative_paths(settings: ModelSettings, model_dir: Path) -> dict[str, str]:
    """`KEY_relative` parameters: each directory relative to the model's, so that a repository moved or mounted
    (a container's /models) together with what it serves still finds it (located())."""
    model_dir = Path(model_dir).resolve()
    return {f"{key}_relative": os.path.relpath(Path(getattr(settings, key)).resolve(), model_dir)
            for key in PATHS if getattr(settings, key)}


def located(params: dict[str, str], model_dir: str | Path) -> dict[str, str]:
    """params with each directory where it is now: its absolute path while that holds it, else its path relative to
    the model directory (the repository moved with what it serves)."""
    out = dict(params)
    for key in PATHS:
        moved = Path(model_dir) / params.get(f"{key}_relative", "")
        if params.get(key) and not Path(params[key]).is_dir() and params.get(f"{key}_relative") and moved.is_dir():
            out[key] = str(moved.resolve())
    return out


def config_pbtxt(model_name: str, settings: ModelSettings, model_dir: Path | None = None) -> str:
    policy = (["# Decoupled: a request may get many responses (streaming), the last one flagged final.",
               "model_transaction_policy { decoupled: true }"] if settings.decoupled else
              ["# Not decoupled: one response a request (unary infer, /generate); no streaming.",
               "model_transaction_policy { decoupled: false }"])
    lines = [f'name: "{model_name}"', 'backend: "python"', "max_batch_size: 0", *policy,
             "instance_group [ { count: 1, kind: KIND_CPU } ]", "input ["]
    lines.append(",\n".join(
        f'  {{ name: "{n}", data_type: {t}, dims: {d}{", optional: true" if opt else ""} }}' for n, t, d, opt in INPUTS))
    lines += ["]", "output ["]
    lines.append(",\n".join(f'  {{ name: "{n}", data_type: {t}, dims: {d} }}' for n, t, d in OUTPUTS))
    lines.append("]")
    parameters = settings.to_parameters() | (relative_paths(settings, model_dir) if model_dir is not None else {})
    for key, value in parameters.items():
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")  # protobuf text escapes
        lines.append(f'parameters {{ key: "{key}", value: {{ string_value: "{escaped}" }} }}')
    return "\n".join(lines) + "\n"


_PARAMETER = re.compile(r'parameters \{ key: "(\w+)", value: \{ string_value: "((?:[^"\\]|\\.)*)" \} \}')


def pbtxt_parameters(text: str) -> dict[str, str]:
    """The string parameters config_pbtxt wrote, unescaped."""
    unescape = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
    return {key: re.sub(r"\\.", lambda m: unescape.get(m[0], m[0]), value) for key, value in _PARAMETER.findall(text)}


def check_sources(settings: ModelSettings) -> None:
    """What tritonserver would find only when it loads the model, checked from the config files alone: the engine
    or the target/drafter pair, and K within the drafter's block (ValueError naming the file or setting)."""
    from dflash_trt.models.config import decoder_config_from_dict, read_config_json
    from dflash_trt.models.dflash import DFlashConfig

    block = None
    if settings.engine_dir:
        from dflash_trt.engine_dir import EngineDir

        engine = EngineDir(settings.engine_dir)
        # else tritonserver fails to load it, its reason buried in the server's log (cheap: no file is read whole;
        # the checksums are verified as the model loads)
        engine.check_format()
        engine.check_digest()
        engine.check_sizes()
        engine.check_unlisted()
        if settings.backend == "trtllm":
            from dflash_trt.trtllm.launch import check_planned_for_trtllm

            check_planned_for_trtllm(engine)
        if settings.speculative and engine.manifest.get("drafter"):
            block = engine.manifest["drafter"]["block_size"]
    else:
        target = decoder_config_from_dict(read_config_json(settings.target_dir),
                                          str(Path(settings.target_dir) / "config.json"))
        if settings.speculative:
            source = str(Path(settings.drafter_dir) / "config.json")
            drafter = DFlashConfig.from_dict(read_config_json(settings.drafter_dir), source)
            drafter.check_pairing(target, source)
            block = drafter.block_size
    if settings.max_draft_len and block is not None and settings.max_draft_len > block - 1:
        raise ValueError(f"max_draft_len={settings.max_draft_len} exceeds the drafter's block_size - 1 = {block - 1}")


MODEL_NAME = re.compile(r"[A-Za-z0-9_.-]+")
WRITING, REPLACED = "export", "replaced"  # dir_swap's kinds: REPO/.NAME.export-*, REPO/.NAME.replaced-*


def export_repository(repo: str | Path, model_name: str, settings: ModelSettings, force: bool = False) -> Path:
    """Write REPO/model_name/{config.pbtxt, 1/model.py}; returns the model directory. A model directory that holds
    anything already is replaced only with `force` (else FileExistsError), as `dflash-trt build` asks before
    replacing an engine, and replaced whole: a version directory left from before (2/model.py) would be the one
    tritonserver loads, its latest."""
    if not MODEL_NAME.fullmatch(model_name) or model_name in (".", ".."):
        # one directory inside REPO, named as config.pbtxt names it: "" wrote the model into REPO itself, "../x" beside
        # it, and a quote broke config.pbtxt
        raise ValueError(f"model name {model_name!r}: use letters, digits, '_', '-' and '.' (one directory in {repo})")
    model_dir = Path(repo) / model_name
    remove_stale_exports(model_dir.parent)

    def check_target() -> None:  # before writing, and again where it is swapped in: another export may be done by then
        if model_dir.is_symlink() or (model_dir.exists() and not model_dir.is_dir()):
            raise FileExistsError(f"{model_dir} is not a model directory (a file or a link): move it away yourself")
        if model_dir.is_dir() and any(model_dir.iterdir()) and not force:
            raise FileExistsError(f"{model_dir} already holds a model; pass --force to overwrite it")

    check_target()
    for path in (settings.engine_dir, settings.target_dir, settings.drafter_dir):
        if path and not Path(path).is_dir():
            raise FileNotFoundError(f"{path}: no such directory")
    check_sources(settings)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    # written beside, then swapped in: a failed or interrupted export leaves the previous model as it was
    tmp = dir_swap.temp_beside(model_dir, WRITING)
    with dir_swap.held(tmp):
        try:
            (tmp / "1").mkdir(parents=True)  # the umask's modes, as a plain mkdir: tritonserver may run as another user
            (tmp / "config.pbtxt").write_text(config_pbtxt(model_name, settings, model_dir))
            shutil.copyfile(MODEL_TEMPLATE, tmp / "1" / "model.py")
            dir_swap.swap_in(tmp, model_dir, REPLACED, check=check_target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return model_dir


def remove_stale_exports(repo: Path) -> None:
    """Clear what killed exports left in the repository (dir_swap.remove_stale), where tritonserver would refuse to
    start ("directory name must equal model name")."""
    dir_swap.remove_stale(repo, WRITING, REPLACED, complete=lambda old: (old / "config.pbtxt").is_file())


# The file `triton serve` creates before it stops tritonserver: the model ends its requests in flight (model.py)
STOP_FILE_ENV = "DFLASH_TRT_TRITON_STOP_FILE"
# The file the model writes (the reason) when its engine loop failed: Triton has no way for a python model to become
# unready, so `triton serve` stops tritonserver and exits with an error, for a supervisor to restart it
FAILED_FILE_ENV = "DFLASH_TRT_TRITON_FAILED_FILE"


class TritonServer:
    """The pytriton-bundled tritonserver on a model repository, bound to one host (127.0.0.1 by default).

    The python backend's stub for this interpreter is linked in a private backend directory, and the
    loader is pointed at this interpreter's own libpython and at pytriton's bundled libraries
    (env-probe §2.4); PATH and PYTHONPATH carry this environment to the stub, so model.py imports dflash_trt.
    """

    def __init__(self, repo: str | Path, http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
                 host: str = "127.0.0.1") -> None:
        self.repo = Path(repo).resolve()
        self.ports = (http_port, grpc_port, metrics_port)
        self.host = host
        self.process: subprocess.Popen | None = None
        self._workdir: tempfile.TemporaryDirectory | None = None

    def command(self, backends: Path) -> list[str]:
        http, grpc, metrics = self.ports
        # The exit timeout, under wait_forwarding_signals' 15 s grace: the model's unload alone took 3 s with another
        # job on the cores, and the trtllm model finishes its requests within it.
        return [str(_pytriton_root() / "bin" / "tritonserver"), f"--model-repository={self.repo}",
                f"--backend-directory={backends}", f"--http-address={self.host}", f"--http-port={http}",
                f"--grpc-address={self.host}", f"--grpc-port={grpc}", f"--metrics-address={self.host}",
                f"--metrics-port={metrics}", "--allow-gpu-metrics=false", "--exit-timeout-secs=10",
                "--log-verbose=0"]

    def check_repository(self) -> None:
        """FileNotFoundError unless the repository holds a model, FileExistsError while an export writes into it,
        which tritonserver would otherwise find only after starting, ending in "failed to load all models"; what
        killed exports left is cleared first."""
        if (self.repo / "manifest.json").is_file():
            raise FileNotFoundError(f"{self.repo} is an engine directory, not a Triton model repository: export it "
                                    f"first (dflash-trt triton export {self.repo} -o REPO), then serve REPO")
        try:
            remove_stale_exports(self.repo)
        except OSError as e:  # a read-only repository, or another user's: what is left is named below
            logger.warning("%s: could not clear what an interrupted export left (%s)", self.repo, e)
        running = dir_swap.live_writers(self.repo, WRITING)
        if running:
            raise FileExistsError(f"{running[0]}: an export is being written there; start the server once it is done")
        # tritonserver reads every directory as a model, hidden ones too ("directory name must equal model name")
        left = sorted(p for p in self.repo.glob(f".*.{WRITING}-*") if p.is_dir())
        left += sorted(p for p in self.repo.glob(f".*.{REPLACED}-*") if p.is_dir())
        if left:
            raise FileExistsError(f"{left[0]}: left by an interrupted export, and tritonserver would not start "
                                  "with it in the repository: move it away (it holds an unfinished model, or the one "
                                  "its export replaced)")
        for config in sorted(self.repo.glob("*/config.pbtxt")):
            # absolute paths written at export: found gone here, not 15 s into tritonserver's load of the model
            params = located(pbtxt_parameters(config.read_text(errors="replace")), config.parent)
            gone = next(((k, params[k]) for k in PATHS if params.get(k) and not Path(params[k]).is_dir()), None)
            if gone:
                raise FileNotFoundError(f"{config}: its {gone[0]} {gone[1]} is gone (moved or deleted?), and not "
                                        "where it was beside the repository either: export the model again, with "
                                        "--force, from where it is now")
        if not any(self.repo.glob("*/config.pbtxt")):
            raise FileNotFoundError(f"{self.repo} is not a Triton model repository (no MODEL/config.pbtxt in it); "
                                    f"write one first: dflash-trt triton export ENGINE -o {self.repo}")

    def check_ports(self) -> None:
        """OSError naming the flag of a port another process holds, which tritonserver would find only once the model
        has loaded (and say in its log alone)."""
        flags = ("--http-port", "--grpc-port", "--metrics-port")
        for i, j in ((0, 1), (0, 2), (1, 2)):
            if self.ports[i] == self.ports[j]:  # tritonserver would print its whole usage text, then refuse
                raise OSError(f"{flags[i]} and {flags[j]} are both {self.ports[i]}: give each its own port")
        for flag, port in zip(flags, self.ports):
            try:
                bound(self.host, port).close()
            except OSError as e:
                raise OSError(f"{flag} {port}: {address(self.host, port)} is not free ({e.strerror or e}); pass "
                              f"another {flag}") from None

    def start(self) -> "TritonServer":
        self.check_repository()
        self.check_ports()
        root = _pytriton_root()
        self._workdir = tempfile.TemporaryDirectory(prefix="dflash-triton-")
        work = Path(self._workdir.name)
        backend = work / "backends" / "python"
        backend.mkdir(parents=True)
        for f in (root / "backends" / "python").iterdir():
            if f.is_file():
                (backend / f.name).symlink_to(f)
        stub = root / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}" / "triton_python_backend_stub"
        if not stub.is_file():
            raise RuntimeError(f"nvidia-pytriton has no python backend stub for Python {sys.version_info[:2]} ({stub})")
        (backend / stub.name).symlink_to(stub)
        env = dict(os.environ)
        libs = [sysconfig.get_config_var("LIBDIR") or "", str(root.parent.parent / "nvidia_pytriton.libs")]
        env["LD_LIBRARY_PATH"] = os.pathsep.join([p for p in libs if p] + [env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
        import dflash_trt

        paths = [str(Path(dflash_trt.__file__).resolve().parent.parent), sysconfig.get_paths()["purelib"]]
        env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        # The stub's embedded interpreter finds its prefix (this venv, with torch) through the python on PATH.
        env["PATH"] = os.pathsep.join([str(Path(sys.exec_prefix) / "bin"), env.get("PATH", "")])
        env["TMPDIR"] = str(work)  # the python backend's per-model scratch folders go away with the workdir
        env[STOP_FILE_ENV] = str(self._stop_file)
        env[FAILED_FILE_ENV] = str(self._failed_file)
        # Logs to our stdout. Own session (the terminal's Ctrl-C reaches us, and we stop the server), but it dies
        # with us.
        self.process = subprocess.Popen(self.command(work / "backends"), env=env, stderr=subprocess.STDOUT,
                                        start_new_session=True, preexec_fn=_die_with_parent)
        return self

    def is_ready(self) -> bool:
        """Whether /v2/health/ready answers 200: every model loaded, all three endpoints up."""
        import urllib.error
        import urllib.request

        host = f"[{self.host}]" if ":" in self.host else self.host
        url = f"http://{host}:{self.ports[0]}/v2/health/ready"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self) -> None:
        """Poll /v2/health/ready until it answers (loading a model may take minutes: no limit but the server's exit,
        a RuntimeError)."""
        while not self.is_ready():
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode}")
            time.sleep(0.5)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (Triton unloads the models and exits), then SIGKILL after `timeout`; either way, what is left of
        its process group then (the python backend's stub, which tritonserver leaves behind when it gives up on a
        request in flight) is killed."""
        code = None
        if self.process is not None and self.process.poll() is None:
            self._signal_stop()
            try:
                code = self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._kill_group()
                code = self.process.wait()
        elif self.process is not None:
            code = self.process.returncode
        self._kill_group()
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None
        return code

    @property
    def _stop_file(self) -> Path:
        return Path(self._workdir.name) / "stopping"

    @property
    def _failed_file(self) -> Path:
        return Path(self._workdir.name) / "failed"

    def _model_failure(self) -> str | None:
        """Why a model's engine loop failed, where one did (FAILED_FILE_ENV)."""
        if self._workdir is None:
            return None
        with contextlib.suppress(FileNotFoundError):
            return self._failed_file.read_text()
        return None

    def _signal_stop(self) -> None:
        """SIGTERM tritonserver, its model told first to end the requests in flight (STOP_FILE_ENV)."""
        if self._workdir is not None:
            self._stop_file.touch()
        self.process.send_signal(signal.SIGTERM)

    def _kill_group(self) -> None:
        """SIGKILL tritonserver's process group (its own session: it and the stubs it started)."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)

    def wait_forwarding_signals(self, on_ready=None, grace: float = 15.0) -> int:
        """Run until the server exits; SIGINT / SIGTERM / SIGHUP (unless ignored: nohup) stop it (0). Returns its exit
        code. `on_ready()` is called once the server is ready, if it gets there. A request still generating keeps
        tritonserver from exiting (its model is live until the request ends, minutes on a long answer): `grace` seconds
        after the stop, or at a second signal, the server's process group is killed. A model whose engine loop failed
        refuses every request while Triton still reports it ready: the server is stopped, and 1 returned."""
        assert self.process is not None, "start() first"
        stopping: list[float] = []  # when the first signal came
        failure = None

        def forward(signum, _frame):
            if self.process is None or self.process.poll() is not None:
                return
            if stopping:
                self._kill_group()
            else:
                stopping.append(time.monotonic())
                self._signal_stop()

        for signum in stop_signals():
            signal.signal(signum, forward)
        if on_ready is not None:
            try:
                self.wait_ready()
            except RuntimeError:
                pass  # it exited: its code is returned below
            else:
                on_ready()
        while True:
            try:
                code = self.process.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if not stopping and (failure := self._model_failure()) is not None:
                    logger.error("stopping tritonserver: %s (every request is refused while Triton reports the model "
                                 "ready)", failure)
                    stopping.append(time.monotonic())
                    self._signal_stop()
                if stopping and time.monotonic() - stopping[0] > grace:
                    logger.warning("tritonserver did not stop within %.0f s of the signal (a request still "
                                   "generating): killed", grace)
                    self._kill_group()
        self.stop()
        if failure is not None:
            return 1
        return 0 if stopping or code in (0, -signal.SIGTERM) else code


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the launching process dies, even by SIGKILL (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass  # not Linux: stop() and the signal handlers still stop it


def _pytriton_root() -> Path:
    try:
        import pytriton
    except ImportError as e:
        raise RuntimeError(
            "tritonserver comes with nvidia-pytriton: pip install 'nvidia-pytriton==0.7.0' 'tritonclient[http,grpc]~=2.50' "
            "(or `pip install dflash-trt[triton]`)"
        ) from e
    root = Path(pytriton.__file__).parent / "tritonserver"
    if not (root / "bin" / "tritonserver").is_file():
        raise RuntimeError(f"{root / 'bin' / 'tritonserver'} is missing: reinstall nvidia-pytriton==0.7.0")
    return root
