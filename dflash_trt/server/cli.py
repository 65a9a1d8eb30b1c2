"""`dflash-trt serve` (OpenAI-compatible HTTP) and `dflash-trt triton export | serve`."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

import click

from dflash_trt.build_cli import EnginePath
from dflash_trt.runtime_device import DEVICE_HELP, DTYPE_HELP, THREADS_HELP, use_threads
from dflash_trt.server.sockets import address, bound
from dflash_trt.signals import stop_signals

# EngineConfig's defaults, which serve's unset options keep (stated here for --help without importing torch;
# tests/test_cli.py checks they agree)
DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_MAX_QUEUE_LEN = 256
DEFAULT_MAX_PREFILL_TOKENS = 512
TRITON_DEFAULT_MAX_BATCH_SIZE = 8
# At a stop, how long answered requests may take to drain to their clients before the connections of those that
# stopped reading are cut: under uvicorn's own grace (timeout_graceful_shutdown, 5 s), which cancels with tracebacks.
STALLED_READER_GRACE_S = 4.0


def parse_schedule(text: str | None, option: str = "--draft-len-schedule") -> dict[int, int]:
    """"1:15,4:7,16:3" -> {1: 15, 4: 7, 16: 3} (batch size -> K, or draft tree nodes)."""
    if not text:
        return {}
    from dflash_trt.draft_schedule import check_table

    try:
        pairs = [item.split(":") for item in text.split(",") if item.strip()]
        table = {int(b): int(k) for b, k in pairs}
    except ValueError as e:
        raise click.BadParameter(f"expected BATCH:N[,BATCH:N...], e.g. 1:15,8:7,32:3; got {text!r}",
                                 param_hint=option) from e
    try:  # here, named as typed: the engine checks a copy of it (the table for CPUs without AMX) first
        check_table(table, "entry", "N")
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint=option) from e
    return table


def load_engine(engine_dir, target, drafter, no_spec, **overrides):
    """An LLMEngine from an engine directory, or from --target/--drafter (default: the embedded SmolLM2)."""
    from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine

    if engine_dir is not None:
        from dflash_trt.engine_dir import open_engine

        if target or drafter:  # an engine carries its own models: one of them would be silently ignored
            raise click.UsageError("pass either ENGINE or --target/--drafter, not both")
        if no_spec:
            overrides["speculative"] = False
        return open_engine(engine_dir, backend="torch", **overrides), _served_name(engine_dir)
    from dflash_trt.cli import _default_dirs
    from dflash_trt.runtime_device import target_runtime

    target_dir, drafter_dir = _default_dirs(target, drafter, no_spec)
    overrides["device"], overrides["dtype"] = target_runtime(overrides.get("device"), overrides.get("dtype"))
    values = {k: v for k, v in overrides.items() if v is not None}
    config = EngineConfig(speculative=not no_spec, **values)
    return LLMEngine.from_dirs(target_dir, drafter_dir, config), _served_name(target_dir)


def _served_name(path: str | Path) -> str:
    """The model id a directory is served as: its name as given, a symbolic link's own (`current`, pointed at each
    new build, is served as `current`, not as the build it points at today); "." names the working directory."""
    return Path(os.path.abspath(path)).name


def _engine_options(f):
    options = [
        click.option("--target", type=click.Path(exists=True, file_okay=False),
                     help="HF-format target directory instead of ENGINE (default: the embedded SmolLM2-135M-Instruct)."),
        click.option("--drafter", type=click.Path(exists=True, file_okay=False),
                     help="z-lab-format DFlash drafter directory (default without --target: the embedded SmolLM2's "
                     "shipped drafter, drafters/smollm2-135m-dflash)."),
        click.option("--no-spec", is_flag=True, help="Plain autoregressive decoding (no drafter)."),
        click.option("--max-batch-size", type=click.IntRange(min=1), default=None, help="Requests decoded together (cache rows); default 8 or the engine's."),
        click.option("--max-model-len", type=click.IntRange(min=2), default=None,
                     help=f"Prompt + generated tokens per request (default: the engine's max_seq_len, else "
                     f"{DEFAULT_MAX_MODEL_LEN})."),
        click.option("--max-draft-len", "-k", type=click.IntRange(min=1), default=None,
                     help="K draft tokens per step (with ENGINE: at one row, the engine's draft-length schedule capped at K at "
                     "larger batches, unless --draft-len-schedule is given)."),
        click.option("--draft-len-schedule", default=None, help="K by batch size, TensorRT-LLM's rule: the smallest key >= the batch wins, batches above the "
                     "largest key run without drafts; e.g. 1:15,4:7,16:3 (1 row K=15, 2-4 rows 7, 5-16 rows 3, 17+ none). Default: "
                     "the engine's speculative_config.draft_len_schedule (its draft_len_schedule_without_amx on a CPU without AMX "
                     "tiles), else K at every batch size. Applies on any CPU."),
        click.option("--draft-tree", default=None,
                     help="Draft tree nodes by batch size, the schedule's rule: steps verify that many drafts, "
                     "the best paths through each slot's top tokens, instead of a chain of K; e.g. 1:5,2:4 (0: chains; "
                     "default: the engine's speculative_config.draft_tree, or its draft_tree_without_amx on a CPU "
                     "without AMX tiles, else chains). Applies on any CPU."),
        click.option("--lookup-nodes", type=click.IntRange(min=0), default=None,
                     help="Steps also weigh up to N tokens copied from the request's own context where its last "
                     "tokens occurred before (prompt lookup): in a tree's nodes, or as a chain's drafts, where "
                     "likelier than the drafter's; 0: none (default: the engine's speculative_config.lookup_nodes, "
                     "else none)."),
        click.option("--adaptive-draft-len/--fixed-draft-len", default=None,
                     help="Measure plain and speculative steps while serving and run K=0 where plain decoding is faster "
                     "(default: the engine's speculative_config.adaptive_draft_len, else fixed)."),
        click.option("--draft-vocab-size", type=click.IntRange(min=0), default=None,
                     help="Draft among the drafter's N most frequent tokens (its draft_vocab.json); 0: the whole "
                     "vocabulary (default: the engine's speculative_config.draft_vocab_size, else every token the "
                     "file lists, else the whole vocabulary)."),
        click.option("--max-queue-len", type=click.IntRange(min=0), default=None,
                     help=f"Requests waiting for a row beyond which the server answers 503 (default: "
                     f"{DEFAULT_MAX_QUEUE_LEN})."),
        click.option("--max-prefill-tokens", type=click.IntRange(min=1), default=None,
                     help=f"Prompt tokens per step, over all prefill chunks (--prefill-chunk) (default: "
                          f"{DEFAULT_MAX_PREFILL_TOKENS})."),
        click.option("--prefill-chunk", type=click.IntRange(min=1), default=None,
                     help="Tokens a prompt chunk holds, each prefilled in a forward of its own, several a step within "
                     "--max-prefill-tokens; prompt reuse takes whole chunks (default: what the target's CPU layer "
                     "kernel runs in one call, 256 tokens with AMX tiles, else 32 at most; where no layer kernel runs, "
                     "--max-prefill-tokens)."),
        click.option("--prefix-reuse/--no-prefix-reuse", default=None,
                     help="A request whose prompt starts with the whole chunks another request's row holds (a freed "
                     "row's last prompt, a running request's) takes them over instead of prefilling them, bit for bit "
                     "the same (default); or every request prefills its own (vLLM's --no-enable-prefix-caching)."),
        click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None, help=DTYPE_HELP),
        click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help=DEVICE_HELP),
        click.option("--head-screen/--full-head", default=None,
                     help="Greedy tokens through the output head's int8 screen on the CPU (the full head's tokens, "
                     "about half its bytes read; default) or through the full head."),
        click.option("--int8-drafter/--bf16-drafter", default=None,
                     help="The drafter's CPU step with int8 projections (default where the CPU has AVX512-VNNI; AVX2 "
                     "runs them on request; drafts may differ slightly, outputs never) or bf16 ones."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _overrides(max_batch_size, max_model_len, max_draft_len, draft_len_schedule, draft_tree, lookup_nodes,
               adaptive_draft_len, draft_vocab_size, max_queue_len, max_prefill_tokens, prefill_chunk, prefix_reuse,
               dtype, device, head_screen, int8_drafter):
    schedule = parse_schedule(draft_len_schedule)
    tree = None
    if draft_tree is not None:
        tree = {} if draft_tree.strip() == "0" else parse_schedule(draft_tree, "--draft-tree")
    return dict(max_batch_size=max_batch_size, max_model_len=max_model_len, max_draft_len=max_draft_len,
                draft_len_schedule=schedule or None, draft_tree=tree, lookup_nodes=lookup_nodes,
                adaptive_draft_len=adaptive_draft_len,
                draft_vocab_size=draft_vocab_size, max_queue_len=max_queue_len, max_prefill_tokens=max_prefill_tokens,
                prefill_chunk=prefill_chunk, prefix_reuse=prefix_reuse, dtype=dtype, device=device,
                screen_head=head_screen, int8_drafter=int8_drafter)


@click.command()
@click.argument("engine", required=False, type=EnginePath())
@_engine_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Bind address (127.0.0.1: this machine only).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535), help="TCP port.")
@click.option("--backend", type=click.Choice(["torch", "trtllm"]), default="torch", show_default=True,
              help="torch: this project's runtime; trtllm: exec trtllm-serve with the engine's trtllm/config.yaml.")
@click.option("--served-model-name", default=None, help="The model id clients send (default: the engine or target directory name).")
@click.option("--trust-request-chat-template", is_flag=True,
              help="Let requests bring their own chat_template (a template is a program the server runs; off by "
              "default, as vLLM's).")
@click.option("--threads", type=click.IntRange(min=1), default=None, help=THREADS_HELP)
@click.option("--api-key", envvar="DFLASH_TRT_API_KEY", default=None,
              help="The /v1 routes, /tokenize and /detokenize answer 401 to a request without `Authorization: Bearer "
              "KEY` (vLLM's --api-key); default: $DFLASH_TRT_API_KEY, else open to whoever reaches --host.")
@click.option("--max-request-mb", default=32, show_default=True, type=click.IntRange(min=1),
              help="The largest request body in MiB; a larger one is refused (413) before it is read.")
@click.option("--allowed-origin", "allowed_origins", multiple=True,
              help="A web origin whose pages may call the API from a browser (CORS), e.g. http://localhost:3000; '*' "
              "for any; repeatable (default: none).")
@click.option("--allowed-host", "allowed_hosts", multiple=True,
              help="On a loopback --host, a Host name answered beside localhost (a reverse proxy's or tunnel's that "
              "passes its own on); '*' for any; repeatable. Others get 403 (DNS rebinding). Any name is answered on "
              "other addresses.")
@click.option("--reasoning-parser", type=click.Choice(["deepseek_r1", "deepseek-r1", "qwen3", "gpt_oss", "gpt-oss",
                                                        "none"]), default=None,
              help="A thinking model's chat answers: their reasoning in the message's `reasoning` (and "
              "`reasoning_content`), the rest in `content`, as vLLM's and trtllm-serve's option. deepseek_r1: from "
              "the answer's start to </think> (DeepSeek-R1, Qwen3 thinking-only models); qwen3: a <think> block the "
              "answer opens with (Qwen3; none with enable_thinking off) or the prompt does (Qwen3.5, Qwen3.6); "
              "gpt_oss: harmony's analysis channel. Default (the torch backend's): gpt_oss for a gpt-oss target, qwen3 "
              "where the target's chat template writes <think>, else none.")
@click.option("--tool-call-parser", type=click.Choice(["hermes", "qwen3", "qwen3_coder", "qwen3_xml", "llama3_json",
                                                       "gpt_oss", "openai", "none"]), default=None,
              help="Chat requests' tools may be called (tool_choice auto, OpenAI's default with tools): the calls "
              "the model writes come back in the message's `tool_calls`, finish_reason tool_calls, as vLLM's option "
              "(trtllm-serve's --tool_parser). hermes (TensorRT-LLM's qwen3): <tool_call>{JSON}</tool_call>, Qwen2.5 "
              "and Qwen3; qwen3_coder: <tool_call><function=...> (Qwen3-Coder); llama3_json: an answer that opens "
              "with {\"name\": ..., \"parameters\": ...} (Llama 3.1-3.3; the torch backend only); gpt_oss (vLLM's "
              "openai): harmony's commentary channel to=functions.NAME (the torch backend's default for a gpt-oss "
              "target). Default: the form the target's chat template shows (<function=...>: qwen3_coder; other "
              "<tool_call>: hermes; gpt-oss: gpt_oss), else none (tools only with tool_choice none: rendered by the "
              "template, the answer is text).")
@click.option("--enable-auto-tool-choice", is_flag=True,
              help="vLLM's companion of --tool-call-parser, taken so its command lines run; the parser alone enables "
              "tool calling here.")
def serve(engine, target, drafter, no_spec, max_batch_size, max_model_len, max_draft_len, draft_len_schedule,
          draft_tree, lookup_nodes, adaptive_draft_len, draft_vocab_size, max_queue_len, max_prefill_tokens,
          prefill_chunk, prefix_reuse, dtype, device, head_screen, int8_drafter, host, port, backend, served_model_name,
          trust_request_chat_template, threads, api_key, max_request_mb, allowed_origins, allowed_hosts,
          reasoning_parser, tool_call_parser, enable_auto_tool_choice) -> None:
    """Serve ENGINE (or --target/--drafter) with an OpenAI-compatible API: /v1/completions,
    /v1/chat/completions, /v1/responses, /v1/models, /health, /metrics. Stops cleanly on Ctrl-C / SIGTERM / SIGHUP
    (not under nohup)."""
    if enable_auto_tool_choice and tool_call_parser in (None, "none"):
        raise click.UsageError("--enable-auto-tool-choice needs --tool-call-parser (hermes, qwen3_coder, llama3_json, "
                               "gpt_oss): the format the model writes its calls in")
    if backend == "trtllm":
        if api_key is not None:  # refused, not dropped: trtllm-serve would answer anyone who reaches --host
            source = click.get_current_context().get_parameter_source("api_key")
            given = "$DFLASH_TRT_API_KEY" if source is click.core.ParameterSource.ENVIRONMENT else "--api-key"
            raise click.UsageError(f"{given} is set, and --backend trtllm passes no API key to trtllm-serve, which "
                                   "would answer whoever reaches --host: unset it to serve the engine open, or serve "
                                   "it with --backend torch")
        # trtllm-serve takes these
        _refuse_unseen_by_trtllm({"backend", "host", "port", "reasoning_parser", "tool_call_parser",
                                  "enable_auto_tool_choice"})
        _exec_trtllm_serve(engine, host, port, reasoning_parser, tool_call_parser)
        return
    if api_key is not None and not api_key.strip():  # (else read as no key: the server open to all)
        raise click.UsageError("--api-key (or $DFLASH_TRT_API_KEY) is blank: give the key, or unset it")
    if no_spec:
        from dflash_trt.cli import refuse_drafting_flags

        refuse_drafting_flags({"--max-draft-len": max_draft_len, "--draft-len-schedule": draft_len_schedule,
                               "--draft-tree": draft_tree, "--lookup-nodes": lookup_nodes,
                               "--adaptive-draft-len": adaptive_draft_len, "--draft-vocab-size": draft_vocab_size,
                               "--int8-drafter": int8_drafter})
    import uvicorn

    from dflash_trt.engine.engine_loop import EngineLoop
    from dflash_trt.engine.llm_engine import capped_note
    from dflash_trt.server.access import is_loopback
    from dflash_trt.server.app import create_app
    from dflash_trt.server.reasoning import default_parser
    from dflash_trt.server.reasoning import reasoning_parser as reasoning_parser_named
    from dflash_trt.server.tool_calls import default_tool_parser
    from dflash_trt.server.tool_calls import tool_call_parser as tool_call_parser_named

    _Server = _uvicorn_server_class()
    from dflash_trt.server.metrics import ServerMetrics

    names = []
    overrides = _overrides(max_batch_size, max_model_len, max_draft_len, draft_len_schedule, draft_tree, lookup_nodes,
                           adaptive_draft_len, draft_vocab_size, max_queue_len, max_prefill_tokens, prefill_chunk,
                           prefix_reuse, dtype, device, head_screen, int8_drafter)

    def build():  # on the engine's thread
        use_threads(threads)
        llm, name = load_engine(engine, target, drafter, no_spec, **overrides)
        names.append(name)
        return llm

    sock = _bind(host, port)  # a taken port fails here, not after the model has loaded
    try:
        try:
            loop = EngineLoop.spawn(build)  # built and stepped on one thread (see EngineLoop.spawn)
        except (ValueError, OSError, RuntimeError) as e:
            raise click.ClickException(str(e)) from e
        llm, name = loop.engine, served_model_name or names[0]
        if note := capped_note(max_model_len, llm.max_position_embeddings):
            click.echo(note, err=True)
        reasoning = default_parser(llm.target, llm.tokenizer.chat_template) if reasoning_parser is None else (
            reasoning_parser_named(reasoning_parser))
        if reasoning is not None and reasoning_parser is None:
            click.echo(f"chat answers' reasoning in `reasoning` (--reasoning-parser {reasoning.name}, this target's "
                       "default; none to turn it off)", err=True)
        if tool_call_parser is None:
            tools = default_tool_parser(llm.target, llm.tokenizer.chat_template)
            if tools is not None:
                click.echo(f"chat requests' tools may be called (--tool-call-parser {tools.name}, this target's "
                           "default, the form its chat template shows; none to turn it off)", err=True)
        else:
            tools = tool_call_parser_named(tool_call_parser)
        metrics = ServerMetrics(llm.scheduler, llm.max_draft_len, name)
        loop.on_step, loop.on_finish = metrics.observe_step, metrics.observe_finished  # before any request exists
        app = create_app(loop, name, metrics, allowed_origins, trust_request_chat_template, api_key=api_key,
                         max_request_bytes=max_request_mb * 2**20,
                         allowed_hosts=tuple(allowed_hosts) if is_loopback(host) else None,
                         reasoning=reasoning, tool_parser=tools)
        if not api_key and not is_loopback(host):
            click.echo(f"warning: serving on {host} without --api-key: whoever reaches it may use the model"
                       + (" and run their own chat templates" if trust_request_chat_template else ""), err=True)
        mode = mode_text(llm) + (f", reasoning parser {reasoning.name}" if reasoning is not None else "") + (
            f", tool-call parser {tools.name}" if tools is not None else "")

        def started() -> None:
            click.echo(f"serving '{name}' ({mode}, {llm.config.dtype}, {llm.config.max_batch_size} rows, max_model_len "
                       f"{llm.max_model_len}) on http://{address(host, port)}/v1", err=True)

        # lifespan off: the app has no start-up or shutdown events, and a second Ctrl-C logged the cancelled
        # lifespan task's traceback
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5,
                                lifespan="off")
        try:
            _listen(sock, host, port, config.backlog)
            # returns on SIGINT / SIGTERM / SIGHUP after closing connections
            _Server(config, on_started=started, engine_loop=loop).run(sockets=[sock])
        finally:
            loop.stop()
    finally:
        sock.close()  # uvicorn closes it on shutdown, but not when the engine failed to load
    _say("stopped")
    if loop.failure is not None:
        raise SystemExit(1)


def _say(message: str) -> None:
    """A line on stderr while stopping: the terminal that closed (SIGHUP) fails every write with EIO, which must not
    fail the stop itself."""
    try:
        click.echo(message, err=True)
    except OSError:
        pass


def _bind(host: str, port: int):
    """The server's socket, bound but not yet listening, so that clients are refused (not left waiting) while the
    model loads; uvicorn listens on it once the app is up."""
    import errno

    try:
        return bound(host, port)
    except OSError as e:
        where = address(host, port)
        if e.errno == errno.EADDRINUSE:
            raise click.ClickException(f"{where} is already in use (another server?); pass another --port") from e
        raise click.ClickException(f"cannot listen on {where}: {e.strerror or e}; check --host and --port") from e


def _listen(sock, host: str, port: int, backlog: int) -> None:
    """Listen before uvicorn does: a bound socket that is not listening takes no port from another (both set
    SO_REUSEADDR, which a restart needs beside its old connections' TIME_WAIT), so a server started while this one
    loaded may have taken the port first."""
    try:
        sock.listen(backlog)
    except OSError as e:
        raise click.ClickException(f"{address(host, port)} was taken while the model loaded (another server?); pass "
                                   "another --port") from e


def _uvicorn_server_class():
    import asyncio
    import contextlib
    import signal
    import time

    import uvicorn

    class Server(uvicorn.Server):
        def __init__(self, config, on_started=None, engine_loop=None):
            super().__init__(config)
            self.on_started, self.engine_loop = on_started, engine_loop

        async def on_tick(self, counter: int) -> bool:
            # An engine loop that failed on its own bug refuses every request: the server stops (exit status 1), for
            # a supervisor to restart it, as vLLM's does when its engine dies.
            if self.engine_loop is not None and self.engine_loop.failure is not None:
                _say(f"stopping: {self.engine_loop.stopped_because}")
                return True
            return await super().on_tick(counter)

        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started and self.on_started is not None:  # listening: a client connecting now is served
                self.on_started()

        async def shutdown(self, sockets=None):
            # Before uvicorn's graceful wait, not after it: stopping the engine answers every request "server shutting
            # down" while the event loop still runs to deliver it, so streams end with that error and [DONE]. After
            # it, the engine generated on through the wait, the streams were cut mid-answer, and the answers went to
            # a closed loop.
            for server in self.servers:  # first: no new connection while the engine stops
                server.close()
            if self.engine_loop is not None:
                await self._stop_engine()
            if not self.force_exit:  # (with it, from Python 3.12.1 on, uvicorn's wait_closed waits out its grace)
                await self._drop_stalled_readers()
                await super().shutdown(sockets=sockets)
            if self.force_exit and (self.server_state.tasks or self.engine_loop and self.engine_loop.is_alive):
                # Quitting without waiting: asyncio.run would cancel the handlers still running, each logged with a
                # traceback, and the interpreter cannot exit under the engine's step in flight (it aborted).
                _say("stopped without waiting for the requests in flight")
                with contextlib.suppress(OSError):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(130)

        async def _drop_stalled_readers(self):
            # Every request is answered by now; what is left waits on clients that stopped reading (their sends wait
            # on full socket buffers). Left to uvicorn's grace, their handlers were cancelled with an ERROR line and a
            # CancelledError traceback each; a connection cut here drops its sends instead, and its handler ends.
            deadline = time.monotonic() + STALLED_READER_GRACE_S
            while self.server_state.tasks and time.monotonic() < deadline and not self.force_exit:
                await asyncio.sleep(0.05)
            if self.server_state.tasks:
                for connection in list(self.server_state.connections):
                    connection.transport.abort()
                await asyncio.sleep(0.1)  # connection_lost ends each cut handler's wait

        async def _stop_engine(self):
            # A step in flight cannot be cut short (one long prefill can take minutes on a CPU): waited for, however
            # long, so that every request is answered; a second Ctrl-C (uvicorn's force_exit) quits without it.
            # Given up after a fixed wait, the requests were never answered and uvicorn cancelled their handlers.
            self.engine_loop.stop(timeout=0)
            told_at = time.monotonic() + 2.0
            while self.engine_loop.is_alive and not self.force_exit:
                if told_at is not None and time.monotonic() > told_at:
                    _say("waiting for the engine's step in flight to end (Ctrl-C again to quit without it)")
                    told_at = None
                await asyncio.sleep(0.02)

        @contextlib.contextmanager
        def capture_signals(self):
            # Shut down gracefully on SIGINT / SIGTERM / SIGHUP (the terminal closed, as build and train take it; not
            # under nohup, which ignores it) and exit 0; uvicorn's own handler re-raises the signal after shutdown,
            # which kills the process before the engine loop is stopped.
            previous = {s: signal.signal(s, self.handle_exit) for s in stop_signals()}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    return Server


def _exec_trtllm_serve(engine, host: str, port: int, reasoning_parser: str | None = None,
                       tool_call_parser: str | None = None) -> None:
    if engine is None:
        raise click.UsageError("--backend trtllm needs an ENGINE directory built by `dflash-trt build`")
    from dflash_trt.engine_dir import EngineDir
    from dflash_trt.trtllm.launch import serve_command

    try:
        built = EngineDir(engine)
        built.verify()
        cmd = serve_command(built, host, port, reasoning_parser, tool_call_parser)
    except (ValueError, OSError, RuntimeError) as e:
        raise click.ClickException(str(e)) from e
    # trtllm-serve has no option for the served name: it is the path it loads, which clients must send as "model"
    click.echo(f"trtllm-serve serves the model as {cmd[1]!r} (clients send it as \"model\"; /v1/models lists it)",
               err=True)
    os.execv(cmd[0], cmd)  # trtllm-serve takes over this process, and its signals


def _refuse_unseen_by_trtllm(taken: set[str]) -> None:
    """A usage error naming the options given beside `taken`: TensorRT-LLM runs the engine's trtllm/config.yaml as
    built, so they would go unseen (a --no-spec baseline would draft)."""
    from dflash_trt.cli import options_given

    dropped = options_given(click.get_current_context(), taken)
    if dropped:
        raise click.UsageError(f"--backend trtllm runs the engine's trtllm/config.yaml as built; it does not take "
                               f"{', '.join(dropped)} (rebuild the engine with those settings, or use --backend torch)")


@click.group()
def triton() -> None:
    """Triton Inference Server: export a model repository, serve it with tritonserver."""


@triton.command("export")
@click.argument("engine", required=False, type=EnginePath())
@click.option("-o", "--output", "repo", required=True, type=click.Path(file_okay=False), help="Model repository to write.")
@click.option("--target", type=click.Path(exists=True, file_okay=False),
              help="HF-format target directory instead of ENGINE (default: the embedded SmolLM2-135M-Instruct).")
@click.option("--drafter", type=click.Path(exists=True, file_okay=False),
              help="z-lab-format DFlash drafter directory (default without --target: the embedded SmolLM2's shipped "
              "drafter, drafters/smollm2-135m-dflash).")
@click.option("--no-spec", is_flag=True, help="Plain autoregressive decoding (no drafter).")
@click.option("--model-name", default="dflash", show_default=True, help="The Triton model name.")
@click.option("--backend", type=click.Choice(["torch", "trtllm"]), default="torch", show_default=True,
              help="The runtime the model drives: this project's, or tensorrt_llm.LLM (needs TensorRT-LLM there).")
@click.option("--max-batch-size", type=click.IntRange(min=1), default=None,
              help=f"Rows decoded together (default: the engine's max_batch_size, else {TRITON_DEFAULT_MAX_BATCH_SIZE}).")
@click.option("--max-model-len", type=click.IntRange(min=2), default=None,
              help=f"Context length (default: the engine's max_seq_len, else {DEFAULT_MAX_MODEL_LEN}).")
@click.option("--max-draft-len", "-k", type=click.IntRange(min=1), default=None,
              help="K draft tokens per step (default: the engine's, else the drafter's block_size - 1).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None, help=DTYPE_HELP)
@click.option("--threads", type=click.IntRange(min=1), default=None, help=THREADS_HELP)
@click.option("--unary", is_flag=True, help="One response a request, for Triton's unary infer (tritonclient's "
              "infer(), which Triton refuses for a decoupled model); no streaming (default: decoupled, streaming).")
@click.option("--force", is_flag=True, help="Overwrite the model if the repository already holds one of that name.")
def triton_export(engine, repo, target, drafter, no_spec, model_name, backend, max_batch_size, max_model_len,
                  max_draft_len, dtype, threads, unary, force) -> None:
    """Write a Triton model repository (python backend, decoupled for streaming unless --unary) for ENGINE."""
    from dflash_trt.server.triton import ModelSettings, export_repository

    if engine is not None and (target or drafter):
        raise click.UsageError("pass either ENGINE or --target/--drafter, not both")
    if backend == "trtllm" and engine is not None:
        # the model builds tensorrt_llm.LLM from the engine's trtllm/config.yaml alone (without an engine,
        # export_repository says that it needs one)
        _refuse_unseen_by_trtllm({"repo", "model_name", "backend", "unary", "force"})
    if no_spec:
        from dflash_trt.cli import refuse_drafting_flags

        refuse_drafting_flags({"--max-draft-len": max_draft_len})
    if max_batch_size is None:  # an engine was planned for its own rows (its memory plan, its schedule)
        max_batch_size = TRITON_DEFAULT_MAX_BATCH_SIZE
        if engine is not None:
            from dflash_trt.engine_dir import EngineDir

            try:
                max_batch_size = int(EngineDir(engine).build_config["max_batch_size"])
            except (ValueError, FileNotFoundError) as e:
                raise click.ClickException(str(e)) from e
    if engine is None:  # generate's resolution: the embedded defaults, and a usage error naming the flags
        from dflash_trt.cli import _default_dirs

        t, d = _default_dirs(target, drafter, no_spec)
        target, drafter = str(t), (str(d) if d else None)
    try:
        settings = ModelSettings(
            engine_dir=str(Path(engine).resolve()) if engine else "",
            target_dir=str(Path(target).resolve()) if target else "",
            drafter_dir=str(Path(drafter).resolve()) if drafter and not no_spec else "", speculative=not no_spec,
            backend=backend, max_batch_size=max_batch_size, max_model_len=max_model_len or 0,
            max_draft_len=max_draft_len or 0, dtype=dtype or "", threads=threads or 0, decoupled=not unary,
        )
        path = export_repository(repo, model_name, settings, force=force)
        if max_model_len:  # capped where the model loads, with only a log line there
            from dflash_trt.engine.llm_engine import capped_note
            from dflash_trt.models.config import decoder_config_from_dict, read_config_json

            target_dir = Path(engine) / "target" if engine else Path(target)
            positions = decoder_config_from_dict(read_config_json(target_dir)).max_position_embeddings
            if note := capped_note(max_model_len, positions):
                click.echo(note, err=True)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        raise click.ClickException(str(e)) from e
    except OSError as e:  # a repository in a read-only directory, or under a file
        raise click.ClickException(f"cannot write the model repository {repo}: {e}") from e
    click.echo(str(path))
    # as the user can run it: a venv's command is not on PATH until the venv is activated
    command = "dflash-trt" if shutil.which("dflash-trt") else shlex.quote(str(Path(sys.executable).parent /
                                                                               "dflash-trt"))
    click.echo(f"serve it with: {command} triton serve {shlex.quote(str(repo))}", err=True)


@triton.command("serve")
@click.argument("repo", type=click.Path(exists=True, file_okay=False))
@click.option("--http-port", default=8000, show_default=True, type=click.IntRange(1, 65535), help="HTTP/REST port.")
@click.option("--grpc-port", default=8001, show_default=True, type=click.IntRange(1, 65535),
              help="gRPC port (streams; HTTP streams too, through generate_stream).")
@click.option("--metrics-port", default=8002, show_default=True, type=click.IntRange(1, 65535),
              help="Prometheus metrics port.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Bind address for all three endpoints.")
def triton_serve(repo, http_port, grpc_port, metrics_port, host) -> None:
    """Run tritonserver (the one nvidia-pytriton ships) on REPO until Ctrl-C / SIGTERM / SIGHUP (not under nohup)."""
    from dflash_trt.server.triton import TritonServer

    try:
        server = TritonServer(repo, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port, host=host)
        server.start()
    except (RuntimeError, OSError) as e:
        raise click.ClickException(str(e)) from e
    readied = []

    def ready() -> None:
        readied.append(True)
        click.echo(f"tritonserver on {host}: http {http_port}, grpc {grpc_port}, metrics {metrics_port}", err=True)

    code = server.wait_forwarding_signals(on_ready=ready)
    if code and not readied:
        raise click.ClickException(f"tritonserver exited with code {code} before it was ready (its log above says "
                                   "why)")
    raise SystemExit(code)


def mode_text(llm) -> str:
    """How the engine decodes, for the start-up line: the K a one-row step drafts on this CPU, and the schedules by
    batch size where there are (the tables without AMX where the CPU has no tiles): K, the draft tree's nodes, and the
    context lookups' length."""
    if llm.drafter is None:
        return "autoregressive"
    schedule = llm.scheduler.config.draft_len_schedule
    by_batch = f", K by batch size {dict(sorted(schedule.items()))}" if schedule else ""
    tree = f", tree nodes by batch size {dict(sorted(llm.draft_tree.items()))}" if llm.draft_tree else ""
    lookups = f", lookups of up to {llm.runner.lookup_nodes}" if llm.runner.lookup_nodes else ""
    return f"DFlash K={llm.scheduler.config.draft_len_for(1)}{by_batch}{tree}{lookups}"
