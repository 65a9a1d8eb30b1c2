"""`dflash-trt serve`'s engine options reach the engine's configuration (load_engine), unset ones as None (keep the
engine's or EngineConfig's default); `dflash-trt triton export` refuses what tritonserver could not load."""

import shutil

import pytest
import yaml
from click.testing import CliRunner

from dflash_trt.server import cli


@pytest.mark.parametrize("args, expected", [
    ([], {"screen_head": None, "int8_drafter": None, "draft_tree": None}),
    (["--draft-tree", "1:5,2:3"], {"draft_tree": {1: 5, 2: 3}}),
    (["--draft-tree", "0"], {"draft_tree": {}}),
    ([], {"lookup_nodes": None}),
    (["--lookup-nodes", "5"], {"lookup_nodes": 5}),
    (["--full-head", "--bf16-drafter"], {"screen_head": False, "int8_drafter": False}),
    (["--head-screen", "--int8-drafter"], {"screen_head": True, "int8_drafter": True}),
])
def test_engine_switches_reach_load_engine(monkeypatch, args, expected):
    seen = {}

    def load_engine(engine, target, drafter, no_spec, **overrides):
        seen.update(overrides)
        raise ValueError("stop before serving")

    monkeypatch.setattr(cli, "load_engine", load_engine)
    result = CliRunner().invoke(cli.serve, ["--no-spec", "--max-batch-size", "2", *args])
    assert result.exit_code == 1 and "stop before serving" in result.output
    assert {k: seen[k] for k in expected} == expected
    assert seen["max_batch_size"] == 2


def test_a_malformed_draft_tree_names_the_option():
    result = CliRunner().invoke(cli.serve, ["--draft-tree", "five"])
    assert result.exit_code == 2 and "--draft-tree" in result.output


@pytest.mark.parametrize("args, message", [
    ([], "speculative decoding needs --drafter DIR (or pass --no-spec for plain decoding)"),
    (["--backend", "trtllm", "--no-spec"], "the trtllm backend serves an engine directory"),
])
def test_triton_export_of_a_target_that_cannot_be_served_fails_before_writing(tmp_path, tiny_dirs, args, message):
    repo = tmp_path / "repo"
    result = CliRunner().invoke(cli.triton, ["export", "-o", str(repo), "--target", str(tiny_dirs["qwen3"]), *args])
    assert result.exit_code != 0 and message in result.output
    assert not repo.exists()


def test_an_engine_with_another_target_or_drafter_is_a_usage_error(tmp_path, tiny_dirs):
    for flag in ("--target", "--drafter"):
        result = CliRunner().invoke(cli.serve, [str(tmp_path), flag, str(tiny_dirs["qwen3"])])
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


def test_triton_export_of_an_engine_refuses_other_models_and_a_backend_it_was_not_planned_for(tmp_path, tiny_dirs):
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
    assert result.exit_code == 1 and "export it with --backend torch" in result.output
    assert not repo.exists()
    assert CliRunner().invoke(cli.triton, ["export", str(engine), "-o", str(repo)]).exit_code == 0
