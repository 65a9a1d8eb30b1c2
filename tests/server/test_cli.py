"""`dflash-trt serve`'s engine options reach the engine's configuration (load_engine), unset ones as None (keep the
engine's or EngineConfig's default), and it takes its port before loading the model; `dflash-trt triton export`
refuses what tritonserver could not load, and an existing model without --force; `triton serve` refuses a directory
that is not a model repository."""

import fcntl
import os
import shutil
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from dflash_trt import dir_swap as dir_swap_module
from dflash_trt.server import cli
from tests.server.conftest import QWEN3_5_TEMPLATE, free_port


@pytest.mark.parametrize("args, expected", [
    ([], {"screen_head": None, "int8_drafter": None, "draft_tree": None}),
    (["--draft-tree", "1:5,2:3"], {"draft_tree": {1: 5, 2: 3}}),
    (["--draft-tree", "0"], {"draft_tree": {}}),
    ([], {"lookup_nodes": None}),
    (["--lookup-nodes", "5"], {"lookup_nodes": 5}),
    (["--full-head", "--bf16-drafter"], {"screen_head": False, "int8_drafter": False}),
    (["--head-screen", "--int8-drafter"], {"screen_head": True, "int8_drafter": True}),
    ([], {"prefix_reuse": None}),
    (["--no-prefix-reuse"], {"prefix_reuse": False}),
    ([], {"prefill_chunk": None}),
    (["--prefill-chunk", "64"], {"prefill_chunk": 64}),
])
def test_engine_switches_reach_load_engine(monkeypatch, args, expected):
    seen = {}

    def load_engine(engine, target, drafter, no_spec, **overrides):
        seen.update(overrides)
        raise ValueError("stop before serving")

    monkeypatch.setattr(cli, "load_engine", load_engine)
    result = CliRunner().invoke(cli.serve, ["--max-batch-size", "2", "--port", str(free_port()),
                                            *args])
    assert result.exit_code == 1 and "stop before serving" in result.output
    assert {k: seen[k] for k in expected} == expected
    assert seen["max_batch_size"] == 2


@pytest.mark.parametrize("flag, env, key", [([], {}, None), (["--api-key", "k1"], {}, "k1"),
                                            ([], {"DFLASH_TRT_API_KEY": "k2"}, "k2")])
def test_serve_takes_its_api_key_from_the_flag_or_the_environment(monkeypatch, tiny_dirs, flag, env, key):
    from dflash_trt.server import app

    seen = []

    def create_app(*args, **kwargs):
        seen.append(kwargs["api_key"])
        raise ValueError("stop before serving")

    monkeypatch.setattr(app, "create_app", create_app)
    result = CliRunner().invoke(cli.serve, ["--target", str(tiny_dirs["qwen3"]), "--no-spec", "--max-model-len", "64",
                                            "--port", str(free_port()), *flag], env=env)
    assert isinstance(result.exception, ValueError) and seen == [key]


@pytest.mark.parametrize("model, flag, parser", [("qwen3", [], None),
                                                 ("qwen3", ["--reasoning-parser", "qwen3"], "qwen3"),
                                                 ("gpt_oss", [], "gpt_oss"),
                                                 ("gpt_oss", ["--reasoning-parser", "none"], None),
                                                 ("gpt_oss", ["--reasoning-parser", "deepseek-r1"], "deepseek_r1"),
                                                 ("qwen3.5", [], "qwen3"),
                                                 ("qwen3.5", ["--reasoning-parser", "none"], None)])
def test_serve_splits_reasoning_as_asked_and_by_default_as_the_target_writes_it(monkeypatch, tmp_path, tiny_dirs,
                                                                               model, flag, parser):
    """gpt-oss's answers without their channels split read "analysis...assistantfinal...", and a chat template
    that writes <think> (Qwen3.5's, opening it in the prompt) thinks in a block: split unless told not."""
    seen, output = _app_options(monkeypatch, tmp_path, tiny_dirs, model, flag, "reasoning")
    assert [p and p.name for p in seen] == [parser]
    assert (f"(--reasoning-parser {parser}, this target's default" in output) == (model != "qwen3" and not flag)


def _app_options(monkeypatch, tmp_path, tiny_dirs, model: str, flag: list[str], option: str) -> tuple[list, str]:
    """What `serve --target MODEL FLAG...` passes create_app as `option`, and what it says, stopped before serving."""
    from dflash_trt.server import app
    from tests.models.test_gpt_oss import make_gpt_oss

    target = tiny_dirs["qwen3"] if model == "qwen3" else make_gpt_oss(tmp_path / "gpt-oss", layers=2)
    if model == "qwen3.5":  # the tiny Qwen3 with a template that writes calls and opens <think> as Qwen3.5's does
        target = Path(shutil.copytree(tiny_dirs["qwen3"], tmp_path / "qwen3.5-template"))
        (target / "chat_template.jinja").write_text(QWEN3_5_TEMPLATE + "{{- '<|im_start|>assistant\\n<think>\\n' }}")
    seen = []

    def create_app(*args, **kwargs):
        seen.append(kwargs[option])
        raise ValueError("stop before serving")

    monkeypatch.setattr(app, "create_app", create_app)
    result = CliRunner().invoke(cli.serve, ["--target", str(target), "--no-spec", "--max-model-len", "64",
                                            "--port", str(free_port()), *flag])
    assert isinstance(result.exception, ValueError), result.output
    return seen, result.output


@pytest.mark.parametrize("model, flag, parser", [("qwen3", [], None), ("qwen3", ["--tool-call-parser", "none"], None),
                                                 ("qwen3", ["--tool-call-parser", "qwen3"], "hermes"),
                                                 ("qwen3", ["--enable-auto-tool-choice", "--tool-call-parser",
                                                            "qwen3_coder"], "qwen3_coder"),
                                                 ("gpt_oss", [], "gpt_oss"),
                                                 ("gpt_oss", ["--tool-call-parser", "none"], None),
                                                 ("qwen3.5", [], "qwen3_coder"),
                                                 ("qwen3.5", ["--tool-call-parser", "none"], None)])
def test_serve_reads_tool_calls_with_a_tool_call_parser_and_by_default_as_the_target_writes_them(
        monkeypatch, tmp_path, tiny_dirs, model, flag, parser):
    """A gpt-oss target's in harmony; one whose chat template writes calls (a Qwen3.5's <function=...>) as it does."""
    seen, output = _app_options(monkeypatch, tmp_path, tiny_dirs, model, flag, "tool_parser")
    assert [p and p.name for p in seen] == [parser]
    assert (f"tools may be called (--tool-call-parser {parser}, this target's default" in output) == (
        model != "qwen3" and not flag)


def test_vllms_enable_auto_tool_choice_without_a_parser_is_refused_before_loading(tiny_dirs):
    result = CliRunner().invoke(cli.serve, ["--target", str(tiny_dirs["qwen3"]), "--no-spec",
                                            "--enable-auto-tool-choice"])
    assert result.exit_code == 2 and "needs --tool-call-parser" in result.output, result.output


@pytest.mark.parametrize("args, option", [(["--draft-tree", "five"], "--draft-tree"),
                                          (["--draft-tree", "0:4"], "--draft-tree"),
                                          (["--draft-len-schedule", "1:-3"], "--draft-len-schedule")])
def test_a_malformed_table_names_the_option_as_typed(args, option):
    result = CliRunner().invoke(cli.serve, args)
    assert result.exit_code == 2 and option in result.output and "without_amx" not in result.output, result.output


@pytest.mark.parametrize("args, message", [
    ([], "speculative decoding needs --drafter DIR (or pass --no-spec for plain decoding)"),
    (["--backend", "trtllm", "--no-spec"], "the trtllm backend serves an engine directory"),
])
def test_triton_export_of_a_target_that_cannot_be_served_fails_before_writing(tmp_path, tiny_dirs, args, message):
    repo = tmp_path / "repo"
    result = CliRunner().invoke(cli.triton, ["export", "-o", str(repo), "--target", str(tiny_dirs["qwen3"]), *args])
    assert result.exit_code != 0 and message in result.output
    assert not repo.exists()


@pytest.mark.parametrize("name", ["", "..", "../escaped", 'a"b', "a/b"])
def test_triton_export_refuses_a_model_name_that_is_not_one_directory_name(tmp_path, tiny_dirs, name):
    # "" wrote the model into the repository itself, "../x" beside it, a quote broke config.pbtxt
    repo = tmp_path / "repo"
    result = CliRunner().invoke(cli.triton, ["export", "-o", str(repo), "--target", str(tiny_dirs["qwen3"]),
                                             "--no-spec", "--model-name", name])
    assert result.exit_code == 1 and f"model name {name!r}: use letters" in result.output, result.output
    assert not repo.exists() and not (tmp_path / "escaped").exists()


def test_triton_export_refuses_a_context_of_one_token_as_serve_does(tmp_path, tiny_dirs):
    result = CliRunner().invoke(cli.triton, ["export", "-o", str(tmp_path / "repo"), "--target",
                                             str(tiny_dirs["qwen3"]), "--no-spec", "--max-model-len", "1"])
    assert result.exit_code == 2 and "--max-model-len" in result.output


def test_an_engine_with_another_target_or_drafter_is_a_usage_error(tmp_path, tiny_dirs):
    for flag in ("--target", "--drafter"):
        result = CliRunner().invoke(cli.serve, [str(tmp_path), flag, str(tiny_dirs["qwen3"]),
                                                "--port", str(free_port())])
        assert result.exit_code == 2 and "pass either ENGINE or --target/--drafter, not both" in result.output


def test_triton_export_checks_k_and_the_config_files_before_writing(tmp_path, tiny_dirs):
    repo = tmp_path / "repo"
    base = ["export", "-o", str(repo), "--target", str(tiny_dirs["qwen3"]), "--drafter", str(tiny_dirs["qwen3_drafter"])]
    result = CliRunner().invoke(cli.triton, [*base, "-k", "99"])
    assert result.exit_code == 1 and "max_draft_len=99 exceeds the drafter's block_size - 1 = 15" in result.output
    broken = tmp_path / "target"
    shutil.copytree(tiny_dirs["qwen3"], broken)
    (broken / "config.json").write_text("{")
    result = CliRunner().invoke(cli.triton, ["export", "-o", str(repo), "--target", str(broken), "--no-spec"])
    assert result.exit_code == 1 and str(broken / "config.json") in result.output
    assert not repo.exists()


def test_triton_export_of_an_engine_refuses_other_models_and_a_backend_it_was_not_planned_for(tmp_path, tiny_dirs,
                                                                                             monkeypatch):
    from dflash_trt.build import build_engine

    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({
        "name": "tiny", "model": str(tiny_dirs["qwen3"]), "hardware": "cpu", "dtype": "float32", "max_batch_size": 2,
        "max_seq_len": 256, "speculative_config": {"speculative_model": str(tiny_dirs["qwen3_drafter"])}}))
    engine = build_engine(config, tmp_path / "engine", progress=False)
    repo = tmp_path / "repo"
    result = CliRunner().invoke(cli.triton, ["export", str(engine), "-o", str(repo), "--target", str(tiny_dirs["qwen3"])])
    assert result.exit_code == 2 and "not both" in result.output
    result = CliRunner().invoke(cli.triton, ["export", str(engine), "-o", str(repo), "--backend", "trtllm"])
    assert result.exit_code == 1 and "run it with --backend torch" in result.output
    assert not repo.exists()
    with monkeypatch.context() as m:
        m.setattr(cli.shutil, "which", lambda name: f"/usr/bin/{name}")
        result = CliRunner().invoke(cli.triton, ["export", str(engine), "-o", str(repo)])
    assert result.exit_code == 0 and result.stdout.strip() == str(repo / "dflash")  # the model's folder, for scripts
    assert f"serve it with: dflash-trt triton serve {repo}" in result.stderr
    # a venv not activated: the command as it runs from there
    monkeypatch.setattr(cli.shutil, "which", lambda name: None)
    result = CliRunner().invoke(cli.triton, ["export", str(engine), "-o", str(repo), "--force"])
    assert f"serve it with: {Path(sys.executable).parent / 'dflash-trt'} triton serve {repo}" in result.stderr
    # a file added to the engine: generate and serve refuse it by name; exported, tritonserver failed to load it, the
    # reason deep in its log
    (engine / "tokenizer" / "extra.json").write_text("{}")
    result = CliRunner().invoke(cli.triton, ["export", str(engine), "-o", str(tmp_path / "repo2")])
    assert result.exit_code == 1 and f"{engine / 'tokenizer' / 'extra.json'}: not listed in manifest.json" in \
        " ".join(result.output.split()), result.output
    assert not (tmp_path / "repo2").exists()


def test_serve_on_a_taken_port_fails_before_loading_the_model(monkeypatch):
    loaded = []

    def load_engine(*args, **overrides):
        loaded.append(args)
        raise ValueError("stop before serving")

    monkeypatch.setattr(cli, "load_engine", load_engine)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(cli.serve, ["--no-spec", "--port", str(port)])
    assert result.exit_code == 1 and f"127.0.0.1:{port} is already in use" in result.output, result.output
    assert "pass another --port" in result.output and "serving" not in result.output
    assert not loaded


def test_serve_refuses_a_port_another_server_took_while_its_model_loaded(monkeypatch, tiny_dirs):
    """Both bound (SO_REUSEADDR, for a restart beside TIME_WAIT connections), neither listening: the bind did not
    tell, and the later server failed at uvicorn's listen with two tracebacks once its model had loaded."""
    from dflash_trt.server.sockets import bound

    port, others = free_port(), []
    load_engine = cli.load_engine

    def load_then_lose_the_port(*args, **overrides):
        others.append(bound("127.0.0.1", port))
        others[0].listen()
        return load_engine(*args, **overrides)

    monkeypatch.setattr(cli, "load_engine", load_then_lose_the_port)
    try:
        result = CliRunner().invoke(cli.serve, ["--target", str(tiny_dirs["qwen3"]), "--drafter",
                                                str(tiny_dirs["qwen3_drafter"]), "--max-model-len", "256",
                                                "--port", str(port)])
    finally:
        others[0].close()
    assert result.exit_code == 1, result.output
    assert f"127.0.0.1:{port} was taken while the model loaded" in result.output and "Traceback" not in result.output
    assert "serving" not in result.output


def test_serve_stopped_in_a_long_step_answers_its_requests_once_the_step_ends(monkeypatch, tiny_dirs):
    """A step cannot be cut short (one long prefill takes minutes on a CPU). Given up after 10 s (and 5 more of
    uvicorn's grace), the requests in it
    were never answered: uvicorn cancelled their handlers (streams cut, a 500 in plain text) and the interpreter
    aborted under the engine thread."""
    import asyncio
    import json
    import threading
    import time

    import httpx

    port, gate, events, steps = free_port(), threading.Event(), [], []
    load_engine = cli.load_engine

    def load_gated(*args, **overrides):
        llm, name = load_engine(*args, **overrides)
        step = llm.step

        def gated():  # the request's first step runs (its first token), the next holds
            steps.append(None)
            if len(steps) > 1:
                gate.wait(60)
            return step()
        llm.step = gated
        return llm, name

    async def stop_in_a_long_step(self):  # instead of serving until a signal
        def stream():
            body = {"model": "m", "prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
        client = threading.Thread(target=stream)
        client.start()
        while not events:
            await asyncio.sleep(0.01)
        threading.Timer(15.5, gate.set).start()  # past the 10 s the stop gave up after, and uvicorn's 5 s grace

    server_class = cli._uvicorn_server_class
    monkeypatch.setattr(cli, "load_engine", load_gated)
    monkeypatch.setattr(cli, "_uvicorn_server_class",
                        lambda: type("S", (server_class(),), {"main_loop": stop_in_a_long_step}))
    result = CliRunner().invoke(cli.serve, ["--target", str(tiny_dirs["qwen3"]), "--drafter",
                                            str(tiny_dirs["qwen3_drafter"]), "--max-model-len", "256",
                                            "--port", str(port), "--served-model-name", "m"])
    gate.set()
    assert result.exit_code == 0, result.output
    assert "waiting for the engine's step in flight to end" in result.output and "stopped" in result.output
    deadline = time.monotonic() + 10
    while (not events or events[-1] != "[DONE]") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "shutting_down", events[-3:]


def test_serve_whose_engine_loop_failed_answers_what_it_took_and_exits_1(monkeypatch, tiny_dirs):
    """A loop that failed on its own bug left the server up, answering /health and every request 503 for as long as
    it ran: nothing restarted it but a probe of /health. It stops now, as vLLM's server does when its engine dies."""
    import signal
    import threading

    import httpx

    port, answers, broken = free_port(), [], threading.Event()
    load_engine = cli.load_engine

    def load_breakable(*args, **overrides):
        llm, name = load_engine(*args, **overrides)
        has_unfinished = llm.has_unfinished
        llm.has_unfinished = lambda: 1 / 0 if broken.is_set() else has_unfinished()  # a bug outside any step
        return llm, name

    def client():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                answers.append(httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={
                    "model": "m", "prompt": "hi", "max_tokens": 4}, timeout=30).status_code)
                break
            except httpx.TransportError:  # not listening yet
                time.sleep(0.1)
        broken.set()

    monkeypatch.setattr(cli, "load_engine", load_breakable)
    threading.Thread(target=client, daemon=True).start()
    stop = threading.Timer(90, os.kill, (os.getpid(), signal.SIGTERM))  # (were it never to stop by itself)
    stop.start()
    try:
        result = CliRunner().invoke(cli.serve, ["--target", str(tiny_dirs["qwen3"]), "--drafter",
                                                str(tiny_dirs["qwen3_drafter"]), "--max-model-len", "256",
                                                "--port", str(port), "--served-model-name", "m"])
    finally:
        stop.cancel()
    assert answers == [200]
    assert result.exit_code == 1, result.output
    assert "stopping: the engine loop failed: ZeroDivisionError: division by zero" in result.output


def test_a_blank_api_key_is_a_usage_error_not_an_open_server(monkeypatch, tiny_dirs):
    async def stop_at_once(self):  # (were it served)
        pass

    server_class = cli._uvicorn_server_class
    monkeypatch.setattr(cli, "_uvicorn_server_class", lambda: type("S", (server_class(),), {"main_loop": stop_at_once}))
    monkeypatch.setenv("DFLASH_TRT_API_KEY", "  ")
    result = CliRunner().invoke(cli.serve, ["--target", str(tiny_dirs["qwen3"]), "--no-spec", "--max-model-len", "64",
                                            "--port", str(free_port())])
    assert result.exit_code == 2 and "is blank" in result.output, result.output


@pytest.mark.parametrize("host, key, warned", [("0.0.0.0", None, True), ("0.0.0.0", "sesame", False),
                                               ("127.0.0.1", None, False)])
def test_serve_warns_where_others_reach_it_without_a_key(monkeypatch, tiny_dirs, host, key, warned):
    async def stop_at_once(self):  # instead of serving until a signal
        pass

    server_class = cli._uvicorn_server_class
    monkeypatch.setattr(cli, "_uvicorn_server_class", lambda: type("S", (server_class(),), {"main_loop": stop_at_once}))
    monkeypatch.delenv("DFLASH_TRT_API_KEY", raising=False)
    result = CliRunner().invoke(cli.serve, ["--target", str(tiny_dirs["qwen3"]), "--no-spec", "--max-model-len", "64",
                                            "--host", host, "--port", str(free_port()),
                                            *(["--api-key", key] if key else [])])
    assert result.exit_code == 0, result.output
    assert ("without --api-key: whoever reaches it may use the model" in result.output) == warned, result.output


def test_serve_says_it_serves_only_once_it_listens(monkeypatch, tiny_dirs):
    """The "serving ... on URL" line is a promise that a client can connect: checked when it is written."""
    port, connected = free_port(), []
    echo = cli.click.echo

    def spy(message=None, *args, **kwargs):
        if str(message).startswith("serving"):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
                connected.append(True)
            except OSError:
                connected.append(False)
        return echo(message, *args, **kwargs)

    async def stop_at_once(self):  # instead of serving until a signal
        pass

    server_class = cli._uvicorn_server_class
    monkeypatch.setattr(cli, "_uvicorn_server_class", lambda: type("S", (server_class(),), {"main_loop": stop_at_once}))
    monkeypatch.setattr(cli.click, "echo", spy)
    result = CliRunner().invoke(cli.serve, ["--target", str(tiny_dirs["qwen3"]), "--drafter",
                                            str(tiny_dirs["qwen3_drafter"]), "--max-model-len", "256",
                                            "--port", str(port)])
    assert result.exit_code == 0, result.output
    assert f"on http://127.0.0.1:{port}/v1" in result.output and "stopped" in result.output
    assert connected == [True]


def test_triton_serve_refuses_a_directory_that_is_not_a_model_repository(monkeypatch, tmp_path):
    from dflash_trt.server import triton

    def no_tritonserver():  # the check must come before tritonserver is looked for, let alone started
        raise RuntimeError("tritonserver looked for")

    monkeypatch.setattr(triton, "_pytriton_root", no_tritonserver)
    engine = tmp_path / "engine"  # what `dflash-trt build` writes: models, no config.pbtxt
    (engine / "target").mkdir(parents=True)
    (engine / "target" / "config.json").write_text("{}")
    result = CliRunner().invoke(cli.triton, ["serve", str(engine)])
    assert result.exit_code == 1, result.output
    message = " ".join(result.output.split())
    assert f"{engine.resolve()} is not a Triton model repository" in message
    assert f"dflash-trt triton export ENGINE -o {engine.resolve()}" in message
    assert "tritonserver looked for" not in message


def test_triton_serve_refuses_a_model_whose_sources_moved_before_starting_tritonserver(monkeypatch, tmp_path,
                                                                                       tiny_dirs):
    # found 15 s into tritonserver's load, buried in its log, with a hint to build an engine
    from dflash_trt.server import triton

    def no_tritonserver():
        raise RuntimeError("tritonserver looked for")

    monkeypatch.setattr(triton, "_pytriton_root", no_tritonserver)
    target, repo = tmp_path / "tar\"get\nhere", tmp_path / "repo"  # a path protobuf's text format must escape
    shutil.copytree(tiny_dirs["qwen3"], target)
    exported = CliRunner().invoke(cli.triton, ["export", "-o", str(repo), "--target", str(target), "--no-spec"])
    assert exported.exit_code == 0, exported.output
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    parsed = text_format.Parse((repo / "dflash" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert parsed.parameters["target_dir"].string_value == str(target)  # as tritonserver reads it
    target.rename(tmp_path / "moved")
    result = CliRunner().invoke(cli.triton, ["serve", str(repo)])
    assert result.exit_code == 1 and "its target_dir" in result.output and "is gone" in result.output, result.output
    assert "tritonserver looked for" not in result.output


def test_triton_export_overwrites_a_model_only_with_force(tmp_path, tiny_dirs):
    repo = tmp_path / "repo"
    base = ["export", "-o", str(repo), "--target", str(tiny_dirs["qwen3"]), "--no-spec"]
    assert CliRunner().invoke(cli.triton, base).exit_code == 0
    config = repo / "dflash" / "config.pbtxt"
    first = config.read_text()
    result = CliRunner().invoke(cli.triton, [*base, "--max-model-len", "128"])
    assert result.exit_code == 1 and f"{repo / 'dflash'} already holds a model; pass --force" in result.output
    assert config.read_text() == first
    (repo / "dflash" / "2").mkdir()  # a version from before: tritonserver would load it, the latest
    (repo / "dflash" / "2" / "model.py").write_text("stale")
    result = CliRunner().invoke(cli.triton, [*base, "--max-model-len", "128", "--force"])
    assert result.exit_code == 0, result.output
    assert 'key: "max_model_len", value: { string_value: "128" }' in config.read_text()
    assert sorted(p.name for p in (repo / "dflash").iterdir()) == ["1", "config.pbtxt"]  # replaced whole
    assert sorted(p.name for p in repo.iterdir()) == ["dflash"]  # nothing left beside it
    # another model in the same repository overwrites nothing
    assert CliRunner().invoke(cli.triton, [*base, "--model-name", "other"]).exit_code == 0
    assert (repo / "other" / "config.pbtxt").is_file()


def test_a_repository_moved_with_what_it_serves_finds_it_there_and_one_moved_alone_still_finds_it(tmp_path,
                                                                                                   tiny_dirs):
    """Its directories are written absolute and relative to the model's: a repository and its model mounted into a
    container together (the absolute paths gone) resolve beside it; moved alone, they resolve where they were."""
    from dflash_trt.server.triton import TritonServer, located, pbtxt_parameters

    a = tmp_path / "a"
    shutil.copytree(tiny_dirs["qwen3"], a / "target")
    shutil.copytree(tiny_dirs["qwen3_drafter"], a / "drafter")
    export = ["export", "-o", str(a / "repo"), "--target", str(a / "target"), "--drafter", str(a / "drafter")]
    assert CliRunner().invoke(cli.triton, export).exit_code == 0
    b = tmp_path / "b"
    a.rename(b)
    model = b / "repo" / "dflash"
    TritonServer(b / "repo").check_repository()  # the absolute paths are gone; beside it they are not
    params = located(pbtxt_parameters((model / "config.pbtxt").read_text()), model)
    assert (params["target_dir"], params["drafter_dir"]) == (str(b / "target"), str(b / "drafter"))
    shutil.copytree(b / "repo", tmp_path / "alone")  # the repository alone, its model where it was exported
    b.rename(a)
    params = located(pbtxt_parameters((tmp_path / "alone" / "dflash" / "config.pbtxt").read_text()),
                     tmp_path / "alone" / "dflash")
    assert params["target_dir"] == str(a / "target")
    a.rename(b)
    shutil.rmtree(b / "drafter")  # gone from both places
    with pytest.raises(FileNotFoundError, match="its drafter_dir .* is gone"):
        TritonServer(b / "repo").check_repository()


def test_a_triton_export_that_fails_at_the_swap_keeps_the_previous_model(tmp_path, tiny_dirs, monkeypatch):
    repo = tmp_path / "repo"
    base = ["export", "-o", str(repo), "--target", str(tiny_dirs["qwen3"]), "--no-spec"]
    assert CliRunner().invoke(cli.triton, base).exit_code == 0
    first = (repo / "dflash" / "config.pbtxt").read_text()
    assert oct((repo / "dflash").stat().st_mode & 0o777) == oct(0o777 & ~_umask())  # readable as a mkdir leaves it
    real, calls = Path.rename, []

    def fail_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # the new model into place
            raise OSError("injected: rename failed")
        return real(src, dst)

    monkeypatch.setattr(Path, "rename", fail_second)
    result = CliRunner().invoke(cli.triton, [*base, "--max-model-len", "128", "--force"])
    monkeypatch.undo()
    assert result.exit_code == 1 and "cannot write the model repository" in result.output and "injected" in result.output
    assert (repo / "dflash" / "config.pbtxt").read_text() == first  # put back
    assert sorted(p.name for p in repo.iterdir()) == ["dflash"]  # nothing left beside it
    (repo / "other").write_text("a file named like a model")
    result = CliRunner().invoke(cli.triton, [*base, "--model-name", "other", "--force"])
    assert result.exit_code == 1 and "is not a model directory (a file or a link)" in result.output
    assert (repo / "other").read_text() == "a file named like a model"


def test_an_export_that_finds_a_model_written_meanwhile_does_not_overwrite_it(tmp_path, tiny_dirs, monkeypatch):
    # two exports without --force into an empty repository both passed the check up front: the second overwrote
    repo = tmp_path / "repo"
    base = ["export", "-o", str(repo), "--target", str(tiny_dirs["qwen3"]), "--no-spec"]
    real = dir_swap_module.swap_in

    def another_export_first(tmp, out, replaced, check=None):
        monkeypatch.setattr(dir_swap_module, "swap_in", real)
        assert CliRunner().invoke(cli.triton, [*base, "--max-model-len", "128"]).exit_code == 0
        real(tmp, out, replaced, check)

    monkeypatch.setattr(dir_swap_module, "swap_in", another_export_first)
    result = CliRunner().invoke(cli.triton, base)
    assert result.exit_code == 1 and "already holds a model; pass --force" in result.output, result.output
    assert 'string_value: "128"' in (repo / "dflash" / "config.pbtxt").read_text()  # the other export's, whole
    assert sorted(p.name for p in repo.iterdir()) == ["dflash"]


def test_a_repository_that_cannot_be_written_is_named_not_a_traceback(tmp_path, tiny_dirs):
    (tmp_path / "file").write_text("")
    result = CliRunner().invoke(cli.triton, ["export", "-o", str(tmp_path / "file" / "repo"), "--target",
                                             str(tiny_dirs["qwen3"]), "--no-spec"])
    assert result.exit_code == 1 and f"cannot write the model repository {tmp_path / 'file' / 'repo'}" in result.output


def _killed(path: Path) -> Path:
    """`path` as a writer killed with SIGKILL leaves it: a directory and its lock file, which no process holds."""
    path.mkdir(parents=True, exist_ok=True)
    path.with_name(path.name + ".lock").touch()
    return path


@contextmanager
def _running(path: Path):
    """`path` as a live writer holds it: its lock file flocked."""
    path.mkdir(parents=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield path


def test_a_triton_export_killed_mid_way_is_recovered_by_the_next(tmp_path, tiny_dirs):
    """SIGKILL between the export's two renames leaves the previous model set aside and the new one unswapped: the
    next export puts the previous model back (so, without --force, refuses to overwrite it) and clears the rest."""
    repo = tmp_path / "repo"
    base = ["export", "-o", str(repo), "--target", str(tiny_dirs["qwen3"]), "--no-spec"]
    assert CliRunner().invoke(cli.triton, base).exit_code == 0
    first = (repo / "dflash" / "config.pbtxt").read_text()
    (repo / "dflash").rename(repo / ".dflash.replaced-7-0123abcd")
    _killed(repo / ".dflash.replaced-7-0123abcd")
    (_killed(repo / ".dflash.export-7-4567cdef") / "1").mkdir()  # the new model, half written
    with _running(repo / ".other.export-8-89abcdef") as running:  # another export, still writing: not touched
        result = CliRunner().invoke(cli.triton, [*base, "--max-model-len", "128"])
        assert result.exit_code == 1 and "already holds a model; pass --force" in result.output, result.output
        assert (repo / "dflash" / "config.pbtxt").read_text() == first
        assert sorted(p.name for p in repo.iterdir()) == sorted(["dflash", running.name, running.name + ".lock"])
        # killed after the swap, before the previous model was deleted: the new model stays, the old one goes
        (_killed(repo / ".dflash.replaced-9-0123abcd") / "1").mkdir()
        assert CliRunner().invoke(cli.triton, [*base, "--force"]).exit_code == 0
        assert sorted(p.name for p in repo.iterdir()) == sorted(["dflash", running.name, running.name + ".lock"])


def test_triton_serve_clears_what_a_killed_export_left_and_waits_for_a_running_one(monkeypatch, tmp_path, tiny_dirs):
    """tritonserver refuses to start on a repository holding an export's working directory ("directory name must
    equal model name"): a killed export's is cleared, a running one's named before tritonserver is looked for."""
    from dflash_trt.server import triton

    repo = tmp_path / "repo"
    assert CliRunner().invoke(cli.triton, ["export", "-o", str(repo), "--target", str(tiny_dirs["qwen3"]),
                                           "--no-spec"]).exit_code == 0
    shutil.copytree(repo / "dflash", _killed(repo / ".dflash.export-7-0123abcd"), dirs_exist_ok=True)
    (repo / "dflash").rename(_killed(repo / ".dflash.replaced-7-0123abcd"))  # killed between the renames
    triton.TritonServer(repo).check_repository()
    assert sorted(p.name for p in repo.iterdir()) == ["dflash"] and (repo / "dflash" / "config.pbtxt").is_file()

    def no_tritonserver():
        raise RuntimeError("tritonserver looked for")

    monkeypatch.setattr(triton, "_pytriton_root", no_tritonserver)
    with _running(repo / ".dflash.export-8-89abcdef") as running:
        result = CliRunner().invoke(cli.triton, ["serve", str(repo)])
    assert result.exit_code == 1, result.output
    assert f"{running}: an export is being written there" in " ".join(result.output.split())
    assert "tritonserver looked for" not in result.output
    legacy = repo / ".dflash.export-9-0123abcd.old"  # an export before locks left no lock file: named, not deleted
    shutil.copytree(repo / "dflash", legacy)
    result = CliRunner().invoke(cli.triton, ["serve", str(repo)])
    assert result.exit_code == 1 and f"{legacy}: left by an interrupted export" in " ".join(result.output.split())
    assert legacy.is_dir()


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("command, args, flag", [
    ("serve", ["-k", "3"], "--max-draft-len"), ("serve", ["--draft-tree", "1:6"], "--draft-tree"),
    ("serve", ["--lookup-nodes", "4"], "--lookup-nodes"), ("serve", ["--adaptive-draft-len"], "--adaptive-draft-len"),
    ("triton export", ["-k", "3", "-o", "repo"], "--max-draft-len"),
])
def test_no_spec_with_a_drafting_flag_is_a_usage_error_not_an_ignored_flag(command, args, flag, tmp_path):
    from dflash_trt.cli import main

    r = CliRunner().invoke(main, [*command.split(), "--no-spec", "--port" if command == "serve" else "--model-name",
                                  str(free_port()) if command == "serve" else "m", *args])
    assert r.exit_code == 2 and flag in r.output and "--no-spec" in r.output, r.output
    assert not (tmp_path / "repo").exists()


@pytest.mark.parametrize("layout, expected", [
    ("tiles", "DFlash K=3, K by batch size {1: 3, 4: 2}, tree nodes by batch size {1: 4}, lookups of up to 2"),
    # the tables for CPUs without AMX tiles
    ("panels", "DFlash K=2, K by batch size {1: 2, 2: 1}, tree nodes by batch size {1: 3}, lookups of up to 2"),
])
def test_the_start_up_line_names_the_k_and_trees_this_cpu_drafts(tiny_dirs, monkeypatch, layout, expected):
    from dflash_trt.engine import llm_engine
    from tests.server.conftest import tiny_engine

    monkeypatch.setattr(llm_engine, "kernel_layout", lambda model: layout)
    llm = tiny_engine(tiny_dirs, max_batch_size=4, max_draft_len=3, draft_len_schedule={1: 3, 4: 2},
                      draft_len_schedule_without_amx={1: 2, 2: 1}, draft_tree={1: 4}, draft_tree_without_amx={1: 3},
                      lookup_nodes=2)
    assert cli.mode_text(llm) == expected
    assert cli.mode_text(tiny_engine(tiny_dirs, speculative=False)) == "autoregressive"


@pytest.mark.parametrize("args", [["--no-spec"], ["--max-draft-len", "3"], ["--max-model-len", "64"],
                                  ["--max-batch-size", "4"], ["--dtype", "float32"]])
def test_triton_export_on_trtllm_refuses_what_the_engines_config_would_overrule(tmp_path, args):
    """The model builds tensorrt_llm.LLM from the engine's trtllm/config.yaml: these were written and then unused."""
    result = CliRunner().invoke(cli.triton, ["export", str(tmp_path), "-o", str(tmp_path / "repo"), "--backend",
                                             "trtllm", *args])
    assert result.exit_code == 2 and "does not take " + args[0] in result.output, result.output
    assert not (tmp_path / "repo").exists()


@pytest.mark.parametrize("args", [["--no-spec"], ["--served-model-name", "x"], ["--max-batch-size", "4"],
                                  ["--full-head"], ["--allowed-origin", "*"], ["--dtype", "float32"]])
def test_serve_on_trtllm_refuses_what_trtllm_serve_would_not_be_told(tmp_path, args):
    """trtllm-serve runs the engine's trtllm/config.yaml: a --no-spec baseline would draft, a model name go unused."""
    result = CliRunner().invoke(cli.serve, [str(tmp_path), "--backend", "trtllm", *args])
    assert result.exit_code == 2 and "does not take " + args[0] in result.output, result.output


@pytest.mark.parametrize("args, env, named", [(["--api-key", "k"], {}, "--api-key"),
                                              ([], {"DFLASH_TRT_API_KEY": "k"}, "$DFLASH_TRT_API_KEY")])
def test_serve_on_trtllm_refuses_an_api_key_it_cannot_enforce_naming_where_it_came_from(tmp_path, args, env, named):
    result = CliRunner().invoke(cli.serve, [str(tmp_path), "--backend", "trtllm", *args], env=env)
    assert result.exit_code == 2, result.output
    assert f"{named} is set, and --backend trtllm passes no API key" in result.output, result.output
    assert "rebuild" not in result.output


def test_a_directory_is_served_under_the_name_it_was_given_a_links_own(tmp_path, monkeypatch, tiny_dirs):
    """`serve srv/current` (a link pointed at each new build) answered to the build's name, which changed with every
    release, and refused clients sending `current`."""
    import dflash_trt.engine_dir

    monkeypatch.setattr(dflash_trt.engine_dir, "open_engine", lambda path, **kw: "engine")
    (tmp_path / "smollm2-v1").mkdir()
    (tmp_path / "current").symlink_to(tmp_path / "smollm2-v1")
    assert cli.load_engine(str(tmp_path / "current"), None, None, False) == ("engine", "current")
    assert cli.load_engine(str(tmp_path / "current") + "/", None, None, False)[1] == "current"
    monkeypatch.chdir(tmp_path / "smollm2-v1")
    assert cli.load_engine(".", None, None, False)[1] == "smollm2-v1"
    (tmp_path / "target").symlink_to(tiny_dirs["qwen3"])
    assert cli.load_engine(None, str(tmp_path / "target"), None, True, max_model_len=64)[1] == "target"
