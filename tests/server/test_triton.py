"""The exported Triton model repository on the real tritonserver that nvidia-pytriton ships, driven by
tritonclient over gRPC streaming: the same greedy text as generate(), streaming and not, with
TensorRT-LLM's acceptance outputs; `dflash-trt triton serve` stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from click.testing import CliRunner

from dflash_trt.sampling_params import SamplingParams
from tests.server.conftest import free_port, tiny_engine

MODEL = "dflash"
UNARY = "dflash_unary"  # the same, exported --unary
PROMPT = "the quick brown fox"


def _tritonserver_runs() -> str | None:
    """None when the bundled tritonserver can start here, else the reason it cannot."""
    try:
        from dflash_trt.server.triton import _pytriton_root
        import tritonclient.grpc  # noqa: F401
    except (RuntimeError, ImportError) as e:
        return f"tritonserver or tritonclient missing: {e}"
    binary = _pytriton_root() / "bin" / "tritonserver"
    try:
        subprocess.run([str(binary), "--help"], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{binary} cannot run on this machine: {e}"
    return None


@pytest.fixture(scope="module")
def triton(tiny_dirs, tmp_path_factory):
    reason = _tritonserver_runs()
    if reason:
        pytest.skip(reason)
    from dflash_trt.cli import main

    repo = tmp_path_factory.mktemp("triton_repo")
    result = CliRunner().invoke(main, ["triton", "export", "-o", str(repo), "--target", str(tiny_dirs["qwen3"]),
                                       "--drafter", str(tiny_dirs["qwen3_drafter"]), "--max-model-len", "256"])
    assert result.exit_code == 0, result.output
    assert (repo / MODEL / "config.pbtxt").is_file() and (repo / MODEL / "1" / "model.py").is_file()
    result = CliRunner().invoke(main, ["triton", "export", "-o", str(repo), "--target", str(tiny_dirs["qwen3"]),
                                       "--drafter", str(tiny_dirs["qwen3_drafter"]), "--max-model-len", "256",
                                       "--unary", "--model-name", UNARY])
    assert result.exit_code == 0, result.output
    http, grpc, metrics = free_port(), free_port(), free_port()
    log = repo / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dflash_trt", "triton", "serve", str(repo), "--http-port", str(http),
                                 "--grpc-port", str(grpc), "--metrics-port", str(metrics)],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    import urllib.request

    deadline = time.monotonic() + 180
    while True:
        try:
            ready = []
            for name in (MODEL, UNARY):
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/{name}/ready", timeout=2) as r:
                    ready.append(r.status == 200)
            if all(ready):
                break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.terminate()
            proc.wait(60)
            pytest.fail(f"tritonserver did not load the model:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    yield {"proc": proc, "grpc": f"127.0.0.1:{grpc}", "http": http, "metrics": metrics, "log": log}
    if proc.poll() is None:
        proc.terminate()
        proc.wait(60)


def _start_stream(url: str, inputs: list[tuple[str, np.ndarray, str]]):
    """A gRPC stream with one request of (name, value, Triton dtype) inputs sent -> (client, queue of its responses)."""
    import tritonclient.grpc as grpcclient

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    tensors = []
    for name, value, dtype in inputs:
        tensor = grpcclient.InferInput(name, list(value.shape), dtype)
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    client.async_stream_infer(MODEL, tensors)
    return client, responses


def _infer(url: str, prompt: str, max_tokens: int, streaming: bool, temperature: float = 0.0,
           more: tuple = ()) -> list[dict]:
    """One request over a gRPC stream (`more`: other (name, value, dtype) inputs); every response's outputs, up to
    the one with a finish_reason."""
    client, responses = _start_stream(url, [
        ("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
        ("streaming", np.array([streaming]), "BOOL"),
        ("sampling_param_max_tokens", np.array([max_tokens], dtype=np.int32), "INT32"),
        ("sampling_param_temperature", np.array([temperature], dtype=np.float32), "FP32"), *more])
    got = []
    try:
        while True:
            result, error = responses.get(timeout=60)
            if error is not None:
                raise RuntimeError(error.message())
            out = {name: result.as_numpy(name) for name in
                   ("text_output", "finish_reason", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")}
            got.append(out)
            if out["finish_reason"][0]:
                return got
    finally:
        client.stop_stream()
        client.close()


def test_triton_non_streaming_and_streaming_equal_generate(triton, tiny_dirs):
    oracle = tiny_engine(tiny_dirs, max_batch_size=8)
    want = oracle.generate([oracle.encode(PROMPT)], SamplingParams(max_new_tokens=24))[0]

    (single,) = _infer(triton["grpc"], PROMPT, 24, streaming=False)
    assert single["text_output"][0].decode() == want.text
    assert single["finish_reason"][0].decode() == want.finish_reason
    assert int(single["total_draft_tokens"][0]) == want.total_draft_tokens
    assert int(single["total_accepted_draft_tokens"][0]) == want.total_accepted_draft_tokens
    assert float(single["acceptance_rate"][0]) == pytest.approx(want.total_accepted_draft_tokens / want.total_draft_tokens)

    parts = _infer(triton["grpc"], PROMPT, 24, streaming=True)
    assert "".join(p["text_output"][0].decode() for p in parts) == want.text
    assert len(parts) > 1  # really streamed, one response per step
    assert parts[-1]["finish_reason"][0].decode() == want.finish_reason


def test_a_unary_export_answers_triton_infer_and_generate_and_refuses_streaming(triton, tiny_dirs):
    """tritonclient's infer(), which Triton's HTTP endpoint refuses for a decoupled model (501), and /generate."""
    import json
    import urllib.request

    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    oracle = tiny_engine(tiny_dirs, max_batch_size=8)
    want = oracle.generate([oracle.encode(PROMPT)], SamplingParams(max_new_tokens=24))[0]
    client = httpclient.InferenceServerClient(f"127.0.0.1:{triton['http']}")

    def inputs(streaming: bool):
        tensors = []
        for name, value, dtype in (("text_input", np.array([PROMPT.encode()], dtype=np.object_), "BYTES"),
                                   ("streaming", np.array([streaming]), "BOOL"),
                                   ("sampling_param_max_tokens", np.array([24], dtype=np.int32), "INT32")):
            tensor = httpclient.InferInput(name, list(value.shape), dtype)
            tensor.set_data_from_numpy(value)
            tensors.append(tensor)
        return tensors

    result = client.infer(UNARY, inputs(False))
    assert result.as_numpy("text_output")[0].decode() == want.text
    assert int(result.as_numpy("total_draft_tokens")[0]) == want.total_draft_tokens
    with pytest.raises(InferenceServerException, match="streaming needs the decoupled model") as refused:
        client.infer(UNARY, inputs(True))
    assert refused.value.status() == "400"  # the client's doing (INVALID_ARG), not a server error
    body = json.dumps({"text_input": PROMPT, "sampling_param_max_tokens": 24}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{triton['http']}/v2/models/{UNARY}/generate", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert json.loads(r.read())["text_output"] == want.text
    client.close()


def test_triton_sampling_inputs_give_the_targets_own_seeded_sample(triton, tiny_dirs):
    """A seeded answer under top_k, top_p or a penalty is the plain-decoding target's sample with the same values,
    another one than without them: each input really reaches the sampler."""
    plain = tiny_engine(tiny_dirs, max_batch_size=8, speculative=False)
    ids = plain.encode(PROMPT)
    base = {"max_new_tokens": 16, "temperature": 1.3, "seed": 7}
    seed = ("sampling_param_seed", np.array([7], dtype=np.uint64), "UINT64")
    unbiased = plain.generate([ids], SamplingParams(**base))[0].text
    for name, value, dtype in (("top_k", 8, np.int32), ("top_p", 0.6, np.float32),
                               ("presence_penalty", 1.0, np.float32), ("frequency_penalty", 1.0, np.float32)):
        want = plain.generate([ids], SamplingParams(**base, **{name: value}))[0].text
        assert want != unbiased, name
        kind = "INT32" if dtype is np.int32 else "FP32"
        (got,) = _infer(triton["grpc"], PROMPT, 16, streaming=False, temperature=1.3,
                        more=(seed, (f"sampling_param_{name}", np.array([value], dtype=dtype), kind)))
        assert got["text_output"][0].decode() == want, name


def _counters(triton) -> dict[str, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{triton['metrics']}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.name.removesuffix("_total"): s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("dflash_") and s.labels.get("model") == MODEL}


def test_triton_metrics_count_what_the_model_generated(triton, tiny_dirs):
    oracle = tiny_engine(tiny_dirs, max_batch_size=8)
    want = oracle.generate([oracle.encode(PROMPT)], SamplingParams(max_new_tokens=24))[0]
    before = _counters(triton)
    (single,) = _infer(triton["grpc"], PROMPT, 24, streaming=False)
    # counted after the answer went out (a failing metric costs no answer), one counter after another: the client
    # may read them first, or between two (waiting for the first alone read a draft count of 0 once)
    growing = ["dflash_requests", "dflash_generation_tokens", "dflash_spec_decode_num_drafts",
               "dflash_spec_decode_num_draft_tokens"]
    if int(single["total_accepted_draft_tokens"][0]):
        growing.append("dflash_spec_decode_num_accepted_tokens")
    deadline = time.monotonic() + 10
    while True:
        after = _counters(triton)
        if all(after.get(n, 0) != before.get(n, 0) for n in growing):
            break
        assert time.monotonic() < deadline, "the request was never counted"
        time.sleep(0.05)

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert grew("dflash_requests") == 1 and grew("dflash_generation_tokens") == want.num_tokens
    assert grew("dflash_spec_decode_num_drafts") == len(want.acceptance_lengths)
    assert grew("dflash_spec_decode_num_draft_tokens") == int(single["total_draft_tokens"][0]) > 0
    assert grew("dflash_spec_decode_num_accepted_tokens") == int(single["total_accepted_draft_tokens"][0])


def test_triton_bad_request_gets_an_error_and_the_server_keeps_serving(triton):
    with pytest.raises(RuntimeError, match="maximum context length 256"):
        _infer(triton["grpc"], PROMPT, 100_000, streaming=False)
    (ok,) = _infer(triton["grpc"], PROMPT, 4, streaming=False)
    assert ok["finish_reason"][0]


def _post(http_port: int, path: str, body: dict) -> tuple[int, str]:
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{http_port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_triton_http_generate_extension(triton, tiny_dirs):
    """Triton's generate extension maps JSON keys onto the model's input names (text_input,
    sampling_param_max_tokens, streaming, as in TensorRT-LLM's llmapi model): /generate takes exactly one
    response, /generate_stream an SSE event per response; a bad request is answered with its error."""
    import json

    oracle = tiny_engine(tiny_dirs, max_batch_size=8)
    want = oracle.generate([oracle.encode(PROMPT)], SamplingParams(max_new_tokens=12))[0]
    status, body = _post(triton["http"], f"/v2/models/{MODEL}/generate",
                         {"text_input": PROMPT, "sampling_param_max_tokens": 12})
    assert status == 200, body
    out = json.loads(body)
    assert out["text_output"] == want.text and out["finish_reason"] == want.finish_reason
    assert out["total_draft_tokens"] == want.total_draft_tokens

    status, body = _post(triton["http"], f"/v2/models/{MODEL}/generate_stream",
                         {"text_input": PROMPT, "sampling_param_max_tokens": 12, "streaming": True})
    assert status == 200, body
    events = [json.loads(line[len("data:"):]) for line in body.splitlines() if line.startswith("data:")]
    assert len(events) > 1 and "".join(e["text_output"] for e in events) == want.text
    assert events[-1]["finish_reason"] == want.finish_reason

    status, body = _post(triton["http"], f"/v2/models/{MODEL}/generate",
                         {"text_input": PROMPT, "sampling_param_max_tokens": 100_000})
    assert status == 400 and "maximum context length 256" in body

    # the body a client of TensorRT-LLM's llmapi model sends: inputs this model takes as they are
    status, body = _post(triton["http"], f"/v2/models/{MODEL}/generate",
                         {"text_input": PROMPT, "sampling_param_max_tokens": 12, "return_finish_reason": True,
                          "sampling_param_exclude_input_from_output": True, "sampling_param_best_of": 1,
                          "sampling_param_return_perf_metrics": True, "sampling_param_frequency_penalty": 0.0})
    assert status == 200, body
    assert json.loads(body)["text_output"] == want.text
    status, body = _post(triton["http"], f"/v2/models/{MODEL}/generate",
                         {"text_input": PROMPT, "sampling_param_max_tokens": 12, "sampling_param_presence_penalty": 1.5})
    assert status == 200, body  # the runtime's penalties (tests/engine/test_logits_processors.py)
    status, body = _post(triton["http"], f"/v2/models/{MODEL}/generate",
                         {"text_input": PROMPT, "sampling_param_max_tokens": 12, "sampling_param_presence_penalty": 2.5})
    assert status == 400 and "sampling_param_presence_penalty=2.5" in body
    # TensorRT-LLM ensemble names are not this model's inputs: Triton passes them as parameters, which are refused
    status, body = _post(triton["http"], f"/v2/models/{MODEL}/generate",
                         {"text_input": PROMPT, "max_tokens": 12, "stop_words": "city"})
    assert status == 400 and "unknown parameters ['max_tokens', 'stop_words']" in body, body
    status, body = _post(triton["http"], f"/v2/models/{MODEL}/generate", {"text_input": "\udcff"})
    assert status == 400, body


def test_triton_serve_says_where_it_listens_once_ready(triton):
    """Its "tritonserver on ..." line follows tritonserver's own "Started HTTPService", which comes once the models
    have loaded, not its start."""
    log = triton["log"]
    deadline = time.monotonic() + 30  # the CLI polls for readiness; the fixture may have seen it first
    while "tritonserver on 127.0.0.1" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    text = log.read_text()
    assert "Started HTTPService" in text and "tritonserver on 127.0.0.1" in text, text[-3000:]
    assert text.index("Started HTTPService") < text.index("tritonserver on 127.0.0.1"), text[-3000:]


def _cancel_a_stream(url: str) -> None:
    """A streaming request cancelled by its client after its first response (tritonclient's gRPC cancellation)."""
    client, responses = _start_stream(url, [
        ("text_input", np.array([PROMPT.encode()], dtype=np.object_), "BYTES"),
        ("streaming", np.array([True]), "BOOL"),
        ("sampling_param_max_tokens", np.array([200], dtype=np.int32), "INT32")])
    result, error = responses.get(timeout=60)
    assert error is None and result.as_numpy("finish_reason")[0] == b""  # still generating
    client.stop_stream(cancel_requests=True)
    client.close()


def test_triton_serve_stops_cleanly_on_sigterm_after_a_cancelled_stream(triton):
    """A cancelled request must still get its final flag (python_backend README, "Decoupled mode": "Sending the
    TRITONSERVER_RESPONSE_COMPLETE_FINAL flag at the end of response is still needed even the request is
    cancelled"); without it the model never unloads and tritonserver gives up after --exit-timeout-secs
    ("Found 1 live models", "Exit timeout expired", exit code 1)."""
    _cancel_a_stream(triton["grpc"])
    (ok,) = _infer(triton["grpc"], PROMPT, 4, streaming=False)  # the model keeps serving
    assert ok["finish_reason"][0]
    # a request in flight at the stop ends with an error, as `dflash-trt serve` ends it, at once; its client gone,
    # the server exits within tritonserver's own exit timeout (an open gRPC stream keeps its model live until then)
    client, responses = _start_stream(triton["grpc"], [
        ("text_input", np.array([PROMPT.encode()], dtype=np.object_), "BYTES"),
        ("streaming", np.array([True]), "BOOL"),
        ("sampling_param_max_tokens", np.array([230], dtype=np.int32), "INT32")])
    first = responses.get(timeout=60)[1]
    assert first is None, first.message()  # generating
    proc, log = triton["proc"], triton["log"]
    stopped = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    error = None
    while error is None:
        _, error = responses.get(timeout=10)
    assert "server shutting down" in error.message() and time.monotonic() - stopped < 10, error.message()
    client.stop_stream()
    client.close()
    assert proc.wait(60) == 0, log.read_text()[-2000:]
    assert time.monotonic() - stopped < 14, log.read_text()[-3000:]  # not killed at the 15 s grace
    assert "Exit timeout expired" not in log.read_text()


def test_a_port_in_use_is_named_before_tritonserver_starts(tmp_path):
    import socket

    from dflash_trt.cli import main

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text('name: "m"\n')
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # the other two ports free too, not Triton's defaults, which a server on this machine may hold
        r = CliRunner().invoke(main, ["triton", "serve", str(tmp_path), "--http-port", str(free_port()),
                                      "--grpc-port", str(free_port()), "--metrics-port", str(port)])
    assert r.exit_code == 1 and f"--metrics-port {port}: 127.0.0.1:{port} is not free" in r.output, r.output


def test_one_port_given_to_two_flags_is_named_before_tritonserver_starts(tmp_path):
    from dflash_trt.cli import main

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text('name: "m"\n')
    r = CliRunner().invoke(main, ["triton", "serve", str(tmp_path), "--http-port", "8154", "--grpc-port", "8154"])
    assert r.exit_code == 1 and "--http-port and --grpc-port are both 8154" in r.output, r.output


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_server_that_does_not_stop_is_killed_with_its_stubs_after_the_grace(tmp_path, stop):
    """A request still generating kept tritonserver from exiting on SIGTERM for minutes, and when it gave up, its
    python backend stub (same process group) was left running. Here a stand-in that ignores SIGTERM and holds a
    child in its group: the stop kills the whole group after the grace, and reads as a clean stop (0). SIGHUP (the
    terminal closed) stops it as SIGTERM does: it killed the launcher outright; under nohup it stays ignored."""
    import threading

    from dflash_trt.server.triton import TritonServer

    server = TritonServer(tmp_path)
    server.process = subprocess.Popen(["bash", "-c", "trap '' TERM; sleep 600 & wait; wait"], start_new_session=True)
    time.sleep(0.5)  # the trap is set
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    nohup = stop != signal.SIGHUP  # the SIGTERM case runs as under nohup
    signal.signal(signal.SIGHUP, signal.SIG_IGN if nohup else signal.SIG_DFL)
    threading.Timer(0.5, os.kill, (os.getpid(), stop)).start()
    try:
        assert server.wait_forwarding_signals(grace=1.0) == 0
        assert (signal.getsignal(signal.SIGHUP) == signal.SIG_IGN) == nohup
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    deadline = time.monotonic() + 30  # nothing left in its group: the child went with it, once init reaps it
    with pytest.raises(ProcessLookupError):
        while time.monotonic() < deadline:
            os.killpg(server.process.pid, 0)
            time.sleep(0.1)


def test_a_model_whose_engine_loop_failed_stops_the_server_with_an_error(tmp_path, caplog):
    """Triton reports a python model ready whatever it answers: one whose engine loop failed refused every request
    while health checks passed. The model marks the failure (tests/server/test_triton_model.py), and `triton serve`
    stops the server and exits 1, for a supervisor to restart it. A stand-in for tritonserver here."""
    import tempfile
    import threading

    from dflash_trt.server.triton import TritonServer

    server = TritonServer(tmp_path)
    server._workdir = tempfile.TemporaryDirectory(prefix="dflash-triton-test-")
    stopped, trapping = tmp_path / "stopped", tmp_path / "trapping"
    server.process = subprocess.Popen(["bash", "-c", f"trap 'touch {stopped}; exit 0' TERM; touch {trapping}; "
                                      "sleep 600 & wait"], start_new_session=True)
    deadline = time.monotonic() + 30
    while not trapping.exists():  # (a fixed sleep was too short for bash to set its trap on a busy machine)
        assert time.monotonic() < deadline and server.process.poll() is None
        time.sleep(0.02)

    def fail():  # as the model writes it: whole or not there (write_text's empty file was read as a failure)
        writing = tmp_path / "failed.writing"
        writing.write_text("the engine loop failed: ZeroDivisionError")
        os.replace(writing, server._failed_file)

    threading.Timer(0.5, fail).start()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        assert server.wait_forwarding_signals(grace=10.0) == 1
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    assert stopped.exists()  # stopped by SIGTERM, as a signal stops it (its model told first), not killed
    assert "stopping tritonserver: the engine loop failed: ZeroDivisionError" in caplog.text


def test_a_model_without_an_engine_runs_where_and_as_generate_would(tiny_dirs, monkeypatch):
    """generate's rule (runtime_device.target_runtime: bf16 on a GPU where torch sees one, else fp32 on the CPU);
    here its answer stands in for a GPU's dtype, as this machine has none."""
    import dflash_trt.runtime_device as runtime_device
    from dflash_trt.server.triton import ModelSettings

    monkeypatch.setattr(runtime_device, "target_runtime", lambda device, dtype: ("cpu", dtype or "bfloat16"))
    settings = dict(target_dir=str(tiny_dirs["qwen3"]), speculative=False, max_batch_size=1)
    assert ModelSettings(**settings).open_engine().config.dtype == "bfloat16"
    assert ModelSettings(**settings, dtype="float32").open_engine().config.dtype == "float32"
