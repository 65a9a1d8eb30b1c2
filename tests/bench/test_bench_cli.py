"""`dflash-trt bench sweep` and `bench plot` as a user runs them, against this project's server."""

import json

import click
import pytest
from click.testing import CliRunner

from dflash_trt.bench.cli import point_line
from dflash_trt.cli import main
from tests.server.conftest import MODEL, free_port, start_server, tiny_engine


@pytest.fixture(scope="module")
def running(tiny_dirs):
    server = start_server(tiny_engine(tiny_dirs, max_batch_size=4, max_draft_len=3))
    yield server
    server.stop()


def test_sweep_then_plot(running, tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": t, "category": "x"}) for t in ("ab", "cd", "ef")))
    out = tmp_path / "run.json"
    r = CliRunner().invoke(main, ["bench", "sweep", "--url", running.url, "--concurrency", "1,2",
                                  "--dataset", str(data), "--osl", "5", "--requests-per-concurrency", "2",
                                  "--api", "completions", "--label", "tiny K=3", "-o", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    assert res["model"] == MODEL  # from the endpoint's /v1/models
    assert [p["concurrency"] for p in res["points"]] == [1, 2]
    assert all(p["tokens_from"] == "usage" for p in res["points"])
    assert [p["num_requests"] for p in res["points"]] == [4, 4]
    assert all(p["output_tokens"] == 5 * 4 and p["num_failed"] == 0 for p in res["points"])
    assert all(p["acceptance"]["source"] == "response" for p in res["points"])
    assert out.with_suffix(".csv").read_text().count("\n") == 3  # header + 2 points
    # 9 requests over 3 prompts: the console says so (a prefix cache would have served the repeats in part)
    assert all(p["repeated_prompts"] for p in res["points"]) and "repeated prompts" in r.output
    assert "counted by chunks" not in r.output
    assert "tokens counted by chunks" in point_line({**res["points"][0], "tokens_from": "chunks"})
    assert "tokens counted by the tokenizer" in point_line({**res["points"][0], "tokens_from": "tokenizer"})
    png = tmp_path / "pareto.png"
    r = CliRunner().invoke(main, ["bench", "plot", str(out), str(out), "-o", str(png), "--title", "t"])
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_model_the_endpoint_does_not_list_is_refused_before_any_request(running, tmp_path):
    out = tmp_path / "run.json"
    r = CliRunner().invoke(main, ["bench", "sweep", "--url", running.url, "--model", "nope", "--concurrency", "1",
                                  "--osl", "4", "-o", str(out)])
    assert r.exit_code == 2 and "--model" in r.output and "'nope' is not served" in r.output, r.output
    assert "tiny-qwen3" in r.output and not out.exists()


def test_a_sweep_that_measures_nothing_says_why_and_leaves_an_earlier_result_as_it_was(running, tmp_path):
    out = tmp_path / "run.json"
    out.write_text('{"points": "an earlier run\'s"}')
    r = CliRunner().invoke(main, ["bench", "sweep", "--url", running.url, "--concurrency", "1", "--osl", "4",
                                  "--extra-body", '{"top_k": -5}', "-o", str(out)])  # every request a 400
    assert r.exit_code == 1 and "every warm-up request failed" in r.output and "HTTP 400" in r.output, r.output
    assert f"no point was measured; {out} was not written" in r.output.replace("\n", "")
    assert out.read_text() == '{"points": "an earlier run\'s"}' and not out.with_suffix(".csv").exists()


def test_sweep_errors_name_what_is_wrong(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    r = CliRunner().invoke(main, ["bench", "sweep", "--url", dead, "--model", "m", "-o", str(tmp_path / "x.json")])
    assert r.exit_code != 0 and "127.0.0.1" in r.output
    r = CliRunner().invoke(main, ["bench", "sweep", "--url", dead, "-o", str(tmp_path / "x.json")])
    # nothing answers: the error says so, and does not suggest --model, which would not help
    assert r.exit_code != 0 and "/v1/models" in r.output and "cannot reach the endpoint" in r.output
    assert "is a server running" in r.output and "--model" not in r.output
    bare = dead.removeprefix("http://")
    r = CliRunner().invoke(main, ["bench", "sweep", "--url", bare, "-o", str(tmp_path / "x.json")])
    assert r.exit_code == 2 and f"http://{bare}" in r.output and "--url" in r.output, r.output
    for route in ("/v1/chat/completions", "/v1/completions/", "/completions", "/v1/models"):
        r = CliRunner().invoke(main, ["bench", "sweep", "--url", dead + route, "-o", str(tmp_path / "x.json")])
        assert r.exit_code == 2 and "names the route" in r.output and f"pass the server's address, {dead}" in r.output
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    r = CliRunner().invoke(main, ["bench", "plot", str(bad), "-o", str(tmp_path / "p.png")])
    assert r.exit_code != 0 and "bad.json" in r.output


@pytest.mark.parametrize("args, option", [
    (["--concurrency", "0"], "--concurrency"), (["--concurrency", "1,1"], "--concurrency"), (["--isl", "0"], "--isl"),
    (["--osl", "0"], "--osl"), (["--requests-per-concurrency", "0"], "--requests-per-concurrency"),
    (["--warmup", "-1"], "--warmup"), (["--gpus", "0"], "--gpus"), (["--temperature", "-1"], "--temperature"),
    (["--extra-body", "{top_p: 1}"], "--extra-body"), (["--extra-body", "[1]"], "--extra-body"),
    # a mistyped tokenizer path is named as such, not answered with Hugging Face's "Repo id must be in the form"
    (["--tokenizer", "./no/such/dir"], "'./no/such/dir': no such directory"),
    (["--tokenizer", "no/such/dir"], "'no/such/dir': no such directory"),
    # prompts are gathered for every request before the first is sent: a huge count hung, memory growing
    (["--concurrency", "99999999999999999999"], "--concurrency"),
    (["--concurrency", "1000", "--requests-per-concurrency", "100000"], "--concurrency"),
])
def test_sweep_refuses_out_of_range_numbers_naming_the_option(tmp_path, args, option):
    dead = f"http://127.0.0.1:{free_port()}"
    r = CliRunner().invoke(main, ["bench", "sweep", "--url", dead, "--model", "m", *args, "-o", str(tmp_path / "x.json")])
    assert r.exit_code == 2 and option in r.output and "Traceback" not in r.output, r.output


def test_plot_refuses_an_image_format_it_cannot_write(tmp_path):
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"points": [{"concurrency": 1, "tok_s_per_user": 1.0, "tok_s_per_gpu": 2.0}]}))
    r = CliRunner().invoke(main, ["bench", "plot", str(run), "-o", str(tmp_path / "p.xyz")])
    assert r.exit_code == 2 and "--output" in r.output and "'xyz'" in r.output, r.output
    assert not (tmp_path / "p.xyz").exists()


def test_every_bench_option_says_what_it_does():
    from dflash_trt.bench.cli import bench

    for name, command in bench.commands.items():
        for param in command.params:
            if isinstance(param, click.Option):
                assert param.help, f"bench {name} {param.opts[0]}"


def test_sweep_against_an_endpoint_without_v1_models_suggests_model(tmp_path):
    import http.server
    import threading

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_error(404)

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        r = CliRunner().invoke(main, ["bench", "sweep", "--url", url, "-o", str(tmp_path / "x.json")])
    finally:
        httpd.shutdown()
    assert r.exit_code == 1 and "cannot list the served models" in r.output and "pass --model" in r.output, r.output


@pytest.mark.parametrize("engine, args, expected", [
    (True, [], None),  # an ENGINE runs its own dtype
    (True, ["--dtype", "float32"], "float32"),
    (False, [], "bfloat16"),  # the embedded SmolLM2 (or --target): bfloat16
])
def test_bench_speed_dtype_defaults_to_the_engines_own(monkeypatch, tmp_path, engine, args, expected):
    from dflash_trt.server import cli as server_cli

    seen = {}

    def load_engine(engine_dir, target, drafter, no_spec, **overrides):
        seen.update(overrides)
        raise ValueError("stop before loading")

    monkeypatch.setattr(server_cli, "load_engine", load_engine)
    r = CliRunner().invoke(main, ["bench", "speed", *([str(tmp_path)] if engine else []), *args])
    assert r.exit_code == 1 and "stop before loading" in r.output, r.output
    assert seen["dtype"] == expected
    help_text = " ".join(CliRunner().invoke(main, ["bench", "speed", "--help"]).output.split())
    assert "default: the ENGINE's dtype, else bfloat16" in help_text


@pytest.mark.parametrize("output, message", [
    ("run.csv", "the CSV is written beside it"),
    ("afile/run.json", "is not a folder"),
])
def test_sweep_refuses_an_output_it_cannot_keep_before_sending_a_request(tmp_path, output, message):
    (tmp_path / "afile").write_text("")
    dead = f"http://127.0.0.1:{free_port()}"  # the output is refused first: no connection is tried
    r = CliRunner().invoke(main, ["bench", "sweep", "--url", dead, "--model", "m", "-o", str(tmp_path / output)])
    assert r.exit_code == 2 and "--output" in r.output and message in r.output, r.output


def test_sweep_refuses_a_fifo_it_would_write_again_after_every_point(tmp_path):
    """A reader of a FIFO ends at the first result; the second would wait for another forever."""
    import os

    os.mkfifo(tmp_path / "f.json")
    dead = f"http://127.0.0.1:{free_port()}"
    r = CliRunner().invoke(main, ["bench", "sweep", "--url", dead, "--model", "m", "-o", str(tmp_path / "f.json")])
    assert r.exit_code == 2 and "is no regular file: a sweep writes its result again after every point" in r.output, \
        r.output


def test_plot_refuses_a_folder_that_is_a_file_by_name_before_reading_runs(tmp_path):
    (tmp_path / "afile").write_text("")
    missing_points = tmp_path / "run.json"
    missing_points.write_text("{}")  # would be refused itself: the output is checked first
    r = CliRunner().invoke(main, ["bench", "plot", str(missing_points), "-o", str(tmp_path / "afile" / "p.png")])
    assert r.exit_code == 2 and f"{tmp_path / 'afile'} is not a folder" in r.output and "Errno" not in r.output, \
        r.output


def test_merge_refuses_a_device_output_for_the_csv_beside_it(tmp_path):
    run = tmp_path / "r.json"
    run.write_text(json.dumps({"label": "ar", "points": [{"concurrency": 1, "tok_s_per_user": 1.0,
                                                          "tok_s_per_gpu": 2.0, "output_tok_s": 2.0}]}))
    r = CliRunner().invoke(main, ["bench", "merge", str(run), str(run), "-o", "/dev/null"])
    assert r.exit_code == 2 and "/dev/null is no regular file: the CSV is written beside it, as /dev/null.csv" \
        in r.output and "after every point" not in r.output, r.output


@pytest.mark.parametrize("url", ["http://127.0.0.1:8o00", "http://127.0.0.1:99999"])
def test_sweep_refuses_a_url_with_a_bad_port(tmp_path, url):
    r = CliRunner().invoke(main, ["bench", "sweep", "--url", url, "--model", "m", "-o", str(tmp_path / "x.json")])
    assert r.exit_code == 2 and "--url" in r.output and "Traceback" not in r.output, r.output


def test_plot_says_which_runs_it_leaves_out(tmp_path):
    good, empty = tmp_path / "good.json", tmp_path / "one_token.json"
    good.write_text(json.dumps({"label": "g", "points": [{"concurrency": 1, "tok_s_per_user": 1.0, "tok_s_per_gpu": 2.0}]}))
    empty.write_text(json.dumps({"label": "e", "points": [{"concurrency": 1, "tok_s_per_user": None,
                                                           "tok_s_per_gpu": 2.0}]}))
    r = CliRunner().invoke(main, ["bench", "plot", str(good), str(empty), "-o", str(tmp_path / "p.png")])
    assert r.exit_code == 0 and f"warning: {empty} (e) has no point with both axes" in r.output, r.output
    assert str(good) not in r.output.split("wrote")[0]


def test_plot_of_runs_without_points_says_why_and_writes_nothing(tmp_path):
    run = tmp_path / "stopped.json"
    run.write_text(json.dumps({"label": "ar", "model": "m", "points": [], "complete": False,
                               "stopped": {"warmup": 1, "error": "every warm-up request failed"}}))
    png = tmp_path / "p.png"
    r = CliRunner().invoke(main, ["bench", "plot", str(run), "-o", str(png)])
    assert r.exit_code == 1 and "has no points (the sweep stopped: every warm-up request failed)" in r.output, r.output
    assert "no run has a point to plot" in r.output and not png.exists()
    run.write_text(json.dumps({"label": "ar", "points": [], "complete": False, "stopped": "hand-written"}))
    r = CliRunner().invoke(main, ["bench", "plot", str(run), "-o", str(png)])
    assert r.exit_code == 1 and "has no points: left out" in r.output and "Traceback" not in r.output, r.output


@pytest.mark.parametrize("args, message", [
    (["--dataset", "nosuch"], "dataset 'nosuch' is neither a built-in"),
    (["--category", "nope"], "nope"),
])
def test_bench_speed_refuses_a_bad_dataset_before_the_model_loads(monkeypatch, args, message):
    # a mistake must not cost a model load (minutes for a large one)
    from dflash_trt.server import cli as server_cli

    monkeypatch.setattr(server_cli, "load_engine", lambda *a, **k: pytest.fail("the model was loaded"))
    r = CliRunner().invoke(main, ["bench", "speed", *args])
    assert r.exit_code != 0 and message in r.output, r.output


def test_plot_and_compare_say_which_runs_are_incomplete_sweeps(tmp_path):
    """A sweep cut short (Ctrl-C, a failed point) has only its first points: its frontier and ratios are not the
    whole sweep's, so both commands name the file, and the plot's legend marks the run."""
    points = [{"concurrency": c, "output_tok_s": 10.0 * c, "tok_s_per_user": 10.0 / c, "tok_s_per_gpu": 10.0 * c}
              for c in (1, 2, 4)]
    whole, cut = tmp_path / "whole.json", tmp_path / "cut.json"
    whole.write_text(json.dumps({"label": "ar", "points": points, "complete": True}))
    cut.write_text(json.dumps({"label": "dflash", "points": points[:2], "complete": False,
                               "stopped": {"concurrency": 4, "error": "interrupted"}}))
    svg = tmp_path / "p.svg"
    r = CliRunner().invoke(main, ["bench", "plot", str(whole), str(cut), "-o", str(svg)])
    assert r.exit_code == 0, r.output
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning")]
    assert len(warnings) == 1 and str(cut) in warnings[0] and "incomplete" in warnings[0], r.stderr
    assert "concurrency 4" in warnings[0] and "interrupted" in warnings[0]
    assert "dflash (incomplete)" in svg.read_text() and "ar (incomplete)" not in svg.read_text()  # the legend
    r = CliRunner().invoke(main, ["bench", "compare", str(cut), str(whole)])
    assert r.exit_code == 0 and "c=2" in r.stdout, r.output
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning")]
    assert len(warnings) == 1 and str(cut) in warnings[0] and "incomplete" in warnings[0], r.stderr
    r = CliRunner().invoke(main, ["bench", "compare", str(whole), str(whole)])
    assert r.exit_code == 0 and r.stderr == "", r.output


def test_compare_names_the_concurrencies_only_one_run_measured_and_the_file_it_cannot_read(tmp_path):
    def run(path, label, concurrencies):
        points = [{"concurrency": c, "output_tok_s": 10.0 * c, "tok_s_per_user": 10.0 / c, "tok_s_per_gpu": 10.0 * c}
                  for c in concurrencies]
        path.write_text(json.dumps({"label": label, "points": points, "complete": True}))
        return str(path)

    wide, narrow = run(tmp_path / "wide.json", "ar", (1, 2, 4, 8)), run(tmp_path / "narrow.json", "dflash", (1, 2))
    r = CliRunner().invoke(main, ["bench", "compare", narrow, wide])
    assert r.exit_code == 0 and "c=2" in r.stdout and "c=4" not in r.stdout, r.output
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning")]
    assert warnings == [f"warning: {wide} measured concurrency 4, 8, which {narrow} did not: left out"], r.stderr
    (tmp_path / "empty.json").write_text(json.dumps({"label": "x", "points": []}))
    r = CliRunner().invoke(main, ["bench", "compare", str(tmp_path / "empty.json"), wide])
    assert r.exit_code == 1 and f"{tmp_path / 'empty.json'}: has no points" in r.output, r.output
    r = CliRunner().invoke(main, ["bench", "compare", run(tmp_path / "far.json", "far", (16,)), wide])
    assert r.exit_code == 1 and f"{tmp_path / 'far.json'} and {wide} share no concurrency" in r.output, r.output


def test_a_sweep_sends_its_api_key_and_names_a_missing_one(tiny_dirs, tmp_path, monkeypatch):
    """serve --api-key (or vLLM's) answers 401 without it: the sweep takes it from --api-key or OPENAI_API_KEY, and
    never writes it into the result."""
    keyed = start_server(tiny_engine(tiny_dirs, max_batch_size=2), api_key="sesame")
    try:
        out = tmp_path / "run.json"
        args = ["bench", "sweep", "--url", keyed.url, "--concurrency", "1", "--osl", "3", "--warmup", "0",
                "-o", str(out)]
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 1 and "wants an API key (401): pass --api-key" in r.output, r.output
        r = CliRunner().invoke(main, [*args, "--api-key", "wrong"])
        assert r.exit_code == 1 and "another than this one" in r.output
        r = CliRunner().invoke(main, [*args, "--model", MODEL, "--api-key", "wrong"])  # checked against the listing
        assert r.exit_code == 1 and "another than this one" in r.output
        r = CliRunner().invoke(main, args, env={"OPENAI_API_KEY": "sesame"})
        assert r.exit_code == 0, r.output
        assert json.loads(out.read_text())["points"][0]["num_failed"] == 0 and "sesame" not in out.read_text()
    finally:
        keyed.stop()


def test_an_engine_directory_given_as_tokenizer_is_read_through_its_tokenizer(running, tiny_dirs, tmp_path):
    from tests.test_cli import _tiny_engine

    engine, _ = _tiny_engine(tiny_dirs, tmp_path)
    r = CliRunner().invoke(main, ["bench", "sweep", "--url", running.url, "--concurrency", "1", "--osl", "3",
                                  "--warmup", "0", "--tokenizer", str(engine), "-o", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "r.json").read_text())["points"][0]["num_failed"] == 0
