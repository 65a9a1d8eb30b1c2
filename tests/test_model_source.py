"""Where a build config's models come from: a plan needs only a model's config.json, which `--plan-only` takes from
the Hub (one request, nothing cached) when neither the disk nor the bundled copies hold the model."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from dflash_trt.build import build_engine, prepare_build
from dflash_trt.cli import main

REPO = "some-org/tiny-dflash"


@pytest.fixture
def hub(monkeypatch):
    """A local stand-in for the Hub: serves `files[path]` (bytes) and records every requested path. The user's
    environment asks nothing of HF_HUB_OFFLINE; huggingface_hub runs offline, as under the CLI's default."""
    from huggingface_hub import constants

    files: dict[str, bytes] = {}
    requested: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            requested.append(self.path)
            body = files.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    yield files, requested
    server.shutdown()


def _config(tmp_path: Path, target: Path, drafter: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"name": "tiny", "model": str(target), "hardware": "cpu", "dtype": "float32",
                                    "max_batch_size": 2, "max_seq_len": 256,
                                    "speculative_config": {"speculative_model": drafter, "max_draft_len": 7}}))
    return path


def test_plan_only_plans_with_the_drafters_config_json_from_the_hub_as_with_the_drafter_on_disk(
        tiny_dirs, tmp_path, hub):
    files, requested = hub
    drafter = tiny_dirs["qwen3_drafter"]
    files[f"/{REPO}/resolve/main/config.json"] = (drafter / "config.json").read_bytes()
    on_disk = prepare_build(_config(tmp_path, tiny_dirs["qwen3"], str(drafter)), allow_bundled=True, fetch_configs=True)
    fetched = prepare_build(_config(tmp_path, tiny_dirs["qwen3"], REPO), allow_bundled=True, fetch_configs=True)
    assert fetched.drafter.kind == "hub_config" and fetched.drafter.path is None
    assert fetched.plan.to_dict() == on_disk.plan.to_dict()
    assert requested == [f"/{REPO}/resolve/main/config.json"]  # one file, no weights


def test_a_build_does_not_fetch_configs_and_says_how_to_download_the_model(tiny_dirs, tmp_path, hub):
    files, requested = hub
    files[f"/{REPO}/resolve/main/config.json"] = (tiny_dirs["qwen3_drafter"] / "config.json").read_bytes()
    with pytest.raises(FileNotFoundError, match=f"is not on disk: fetch it with `hf download {REPO}`"):
        build_engine(_config(tmp_path, tiny_dirs["qwen3"], REPO), tmp_path / "e", progress=False)
    assert requested == [] and not (tmp_path / "e").exists()


def test_a_repo_the_hub_does_not_have_is_an_error_that_says_why_the_plan_could_not_fetch_it(tiny_dirs, tmp_path, hub):
    r = CliRunner().invoke(main, ["build", str(_config(tmp_path, tiny_dirs["qwen3"], REPO)), "--plan-only"])
    assert r.exit_code != 0
    assert f"hf download {REPO}" in r.output and "nor could its config.json alone be fetched" in r.output
    assert "404" in r.output


def test_a_hub_answer_that_is_not_a_config_names_the_url(tiny_dirs, tmp_path, hub):
    files, _ = hub
    url_path = f"/{REPO}/resolve/main/config.json"
    for body, problem in ((b"<html>login</html>", "not JSON"), (b"[1, 2]", "a JSON list, not an object")):
        files[url_path] = body
        with pytest.raises(ValueError, match=f"{url_path}: {problem}"):
            prepare_build(_config(tmp_path, tiny_dirs["qwen3"], REPO), allow_bundled=True, fetch_configs=True)


def test_build_plan_only_fetches_the_config_unless_the_user_set_hf_hub_offline(tiny_dirs, tmp_path, hub,
                                                                               monkeypatch):
    files, requested = hub
    files[f"/{REPO}/resolve/main/config.json"] = (tiny_dirs["qwen3_drafter"] / "config.json").read_bytes()
    config = str(_config(tmp_path, tiny_dirs["qwen3"], REPO))
    r = CliRunner().invoke(main, ["build", config, "--plan-only"])  # the CLI sets HF_HUB_OFFLINE=1 for libraries
    assert r.exit_code == 0, r.output
    assert requested == [f"/{REPO}/resolve/main/config.json"]
    for value in ("1", "true", "ON"):
        monkeypatch.setenv("HF_HUB_OFFLINE", value)
        r = CliRunner().invoke(main, ["build", config, "--plan-only"])
        assert r.exit_code == 1 and "fetching is off, as under HF_HUB_OFFLINE=1" in r.output, r.output
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")  # huggingface_hub reads it only where HF_HUB_OFFLINE is unset
    assert CliRunner().invoke(main, ["build", config, "--plan-only"]).exit_code == 0
    assert len(requested) == 2


def test_prepare_build_asks_nothing_of_the_hub_unless_told_to(tiny_dirs, tmp_path, hub):
    files, requested = hub
    files[f"/{REPO}/resolve/main/config.json"] = (tiny_dirs["qwen3_drafter"] / "config.json").read_bytes()
    with pytest.raises(FileNotFoundError, match="fetching is off, as under HF_HUB_OFFLINE=1"):
        prepare_build(_config(tmp_path, tiny_dirs["qwen3"], REPO), allow_bundled=True)
    assert requested == []


def test_a_path_written_without_dot_slash_is_not_asked_of_the_hub(tiny_dirs, tmp_path, hub):
    files, requested = hub
    files[f"/{REPO}/resolve/main/config.json"] = (tiny_dirs["qwen3_drafter"] / "config.json").read_bytes()
    (tmp_path / REPO.split("/")[0]).mkdir()  # beside the config: the user meant ./some-org/tiny-dflash
    with pytest.raises(FileNotFoundError, match=f"written ./{REPO} if that is what you meant"):
        prepare_build(_config(tmp_path, tiny_dirs["qwen3"], REPO), allow_bundled=True, fetch_configs=True)
    assert requested == []
