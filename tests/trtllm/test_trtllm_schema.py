"""What dflash-trt hands TensorRT-LLM, checked against a description of TensorRT-LLM's own schema and CLI
(tests/trtllm/trtllm_schema.py, read from NVIDIA/TensorRT-LLM, independent of dflash_trt/trtllm/llm_api_keys.py)."""

import json
import re
import shlex
from pathlib import Path

import pydantic
import pytest
import yaml

from dflash_trt.build import build_engine, prepare_build
from dflash_trt.engine_dir import EngineDir
from dflash_trt.trtllm import launch
from dflash_trt.trtllm.llm_api_keys import ALLOWED_VALUES, NESTED_KEYS, TOP_LEVEL_KEYS
from tests.trtllm.trtllm_schema import (TRTLLM_SERVE_OPTIONS, TorchLlmArgs, check_drafter_config,
                                        draft_len_for_batch_size, parse_trtllm_serve, validate_llm_args)

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "build_configs"
PLANNABLE_HERE = ["gpt-oss-120b-8xb300-latency", "gpt-oss-120b-8xb300-throughput", "qwen3-8b-1xh200"]


@pytest.mark.parametrize("name", PLANNABLE_HERE)
def test_written_config_validates_as_torch_llm_args(name):
    p = prepare_build(CONFIGS / f"{name}.yaml", allow_bundled=True)
    args = validate_llm_args(p.trtllm_options)
    spec = args.speculative_config
    assert spec is not None and spec.decoding_type == "DFlash" and spec.max_draft_len == p.max_draft_len
    # The DFlash worker refuses a block of K + 1 slots wider than the checkpoint was trained for.
    assert p.max_draft_len + 1 <= p.drafter_config.block_size
    # Its draft model reads the mask token and the captured layers from the drafter's config.json.
    check_drafter_config(p.drafter_config.to_hf_dict(), p.max_draft_len)


@pytest.mark.parametrize("name", PLANNABLE_HERE)
def test_written_schedule_runs_the_draft_lengths_the_plan_predicts(name):
    """TensorRT-LLM picks K per batch size from draft_len_schedule (the smallest key >= batch size, 0 above all
    keys); plan.json's performance section must describe the K it will actually run."""
    p = prepare_build(CONFIGS / f"{name}.yaml", allow_bundled=True)
    schedule = p.trtllm_options["speculative_config"].get("draft_len_schedule")
    chosen = [pt for pt in p.plan.performance["points"] if pt["chosen"]]
    assert chosen
    for pt in chosen:
        assert draft_len_for_batch_size(schedule, pt["batch_size"], p.max_draft_len) == pt["draft_len"], pt


def test_the_project_key_lists_claim_nothing_trtllm_would_reject():
    fields = TorchLlmArgs.model_fields
    assert set(TOP_LEVEL_KEYS) <= set(fields)
    for section, keys in NESTED_KEYS.items():
        model = fields[section].annotation
        model = next(a for a in getattr(model, "__args__", (model,)) if a is not type(None))
        assert set(keys) <= set(model.model_fields), section
    for dotted, values in ALLOWED_VALUES.items():
        section, _, key = dotted.rpartition(".")
        for v in values:
            options = {key: v} if not section else {section: {key: v}}
            if section == "speculative_config":
                options[section].update(decoding_type="DFlash", max_draft_len=3)
            validate_llm_args(options)


@pytest.mark.parametrize("spec, message", [
    ({"max_draft_len": 3, "draft_len_schedule": {4: 2, 16: 1}}, "must equal max_draft_len"),
    ({"max_draft_len": 3, "draft_len_schedule": {1: 3}, "max_concurrency": 8}, "mutually exclusive"),
    ({"max_draft_len": 3, "attention_backend": "FLASHINFER"}, "attention_backend"),
    ({"max_draft_len": 3, "block_size": 4}, "block_size"),
    ({"max_draft_len": 0}, "must be > 0"),
])
def test_the_schema_rejects_what_trtllm_rejects(spec, message):
    with pytest.raises(pydantic.ValidationError, match=message):
        validate_llm_args({"speculative_config": {"decoding_type": "DFlash", **spec}})


@pytest.fixture(scope="module")
def tiny_trtllm_engine(tiny_dirs, tmp_path_factory):
    from tests.test_build import write_config

    root = tmp_path_factory.mktemp("trtllm_engine")
    # planned for TensorRT-LLM (a GPU profile); its weights are the tiny CPU ones
    config = write_config(root, tiny_dirs["qwen3"], tiny_dirs["qwen3_drafter"], hardware="h200", dtype="bfloat16")
    return build_engine(config, root / "e", progress=False)


def test_engine_config_reaches_trtllm_with_the_drafter_as_an_absolute_path(tiny_trtllm_engine, tmp_path,
                                                                           monkeypatch):
    on_disk = yaml.safe_load((tiny_trtllm_engine / "trtllm" / "config.yaml").read_text())
    assert on_disk["speculative_config"]["speculative_model"] == "drafter"  # the engine stays movable
    monkeypatch.chdir(tmp_path)  # TensorRT-LLM would take a relative "drafter" from here for a Hub id
    options = launch.load_options(tiny_trtllm_engine)
    drafter = Path(options["speculative_config"]["speculative_model"])
    assert drafter.is_absolute() and drafter == tiny_trtllm_engine.resolve() / "drafter" and drafter.is_dir()
    args = validate_llm_args(options)
    check_drafter_config(json.loads((drafter / "config.json").read_text()), args.speculative_config.max_draft_len)


def test_serve_command_is_a_trtllm_serve_command_line(tiny_trtllm_engine, tmp_path, monkeypatch):
    monkeypatch.setattr(launch.shutil, "which", lambda name: f"/opt/bin/{name}")
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path))
    engine = EngineDir(tiny_trtllm_engine)
    cmd = launch.serve_command(engine, "127.0.0.1", 8123)
    model, opts = parse_trtllm_serve(cmd)
    assert Path(model) == engine.target_dir and Path(opts["--tokenizer"]) == engine.tokenizer_dir
    assert (opts["--host"], opts["--port"]) == ("127.0.0.1", "8123")
    config = Path(opts["--config"])
    assert config.is_absolute() and config.parent == tmp_path / "trtllm"  # not inside the checksummed engine
    options = yaml.safe_load(config.read_text())
    assert Path(options["speculative_config"]["speculative_model"]) == engine.path / "drafter"
    validate_llm_args(options)
    engine.verify()
    # serve execs trtllm-serve, so nothing deletes the file afterwards: launches reuse one file per engine
    assert launch.serve_command(engine, "127.0.0.1", 8124)[-1] == str(config)
    assert sorted(p.name for p in config.parent.iterdir()) == [config.name]


def test_serve_names_the_model_id_trtllm_serve_will_answer_to(tiny_trtllm_engine, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from dflash_trt.server import cli

    monkeypatch.setattr(launch.shutil, "which", lambda name: f"/opt/bin/{name}")
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path))
    ran = []
    monkeypatch.setattr(cli.os, "execv", lambda exe, argv: ran.append(argv))
    result = CliRunner().invoke(cli.serve, [str(tiny_trtllm_engine), "--backend", "trtllm"])
    assert result.exit_code == 0 and ran and ran[0][0] == "/opt/bin/trtllm-serve", result.output
    assert f"serves the model as {str(EngineDir(tiny_trtllm_engine).target_dir)!r}" in result.output


@pytest.mark.parametrize("given, passed", [("deepseek_r1", "deepseek-r1"), ("deepseek-r1", "deepseek-r1"),
                                           ("qwen3", "qwen3")])
def test_serve_passes_the_reasoning_parser_to_trtllm_serve_in_its_spelling(tiny_trtllm_engine, tmp_path, monkeypatch,
                                                                          given, passed):
    """TensorRT-LLM's ReasoningParserFactory knows "deepseek-r1" and "qwen3" (vLLM's "deepseek_r1" is taken too)."""
    assert _served_options(tiny_trtllm_engine, tmp_path, monkeypatch, "--reasoning-parser", given)[
        "--reasoning_parser"] == passed
    assert "--reasoning_parser" not in _served_options(tiny_trtllm_engine, tmp_path, monkeypatch)


@pytest.mark.parametrize("given, passed", [("hermes", "qwen3"), ("qwen3", "qwen3"), ("qwen3_coder", "qwen3_coder"),
                                           ("qwen3_xml", "qwen3_coder"), ("gpt_oss", None), ("none", None)])
def test_serve_passes_the_tool_call_parser_to_trtllm_serve_by_its_name_for_the_format(tiny_trtllm_engine, tmp_path,
                                                                                      monkeypatch, given, passed):
    """TensorRT-LLM's ToolParserFactory knows the hermes format as "qwen3", Qwen3-Coder's as "qwen3_coder"; its
    server reads a gpt-oss target's harmony calls itself (harmony_adapter.py)."""
    options = _served_options(tiny_trtllm_engine, tmp_path, monkeypatch, "--tool-call-parser", given)
    assert options.get("--tool_parser") == passed


def test_a_tool_call_format_trtllm_serve_cannot_read_is_refused_before_it_runs(tiny_trtllm_engine, tmp_path,
                                                                                monkeypatch):
    from click.testing import CliRunner

    from dflash_trt.server import cli

    monkeypatch.setattr(launch.shutil, "which", lambda name: f"/opt/bin/{name}")
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path))
    monkeypatch.setattr(cli.os, "execv", lambda exe, argv: pytest.fail("trtllm-serve ran"))
    result = CliRunner().invoke(cli.serve, [str(tiny_trtllm_engine), "--backend", "trtllm", "--tool-call-parser",
                                            "llama3_json"])
    assert result.exit_code == 1 and "trtllm-serve has no tool parser for llama3_json's format" in result.output


def _served_options(engine, tmp_path, monkeypatch, *args: str) -> dict:
    """The options of the trtllm-serve command `serve ENGINE --backend trtllm ARGS...` runs (its exec caught)."""
    from click.testing import CliRunner

    from dflash_trt.server import cli

    monkeypatch.setattr(launch.shutil, "which", lambda name: f"/opt/bin/{name}")
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path))
    ran = []
    monkeypatch.setattr(cli.os, "execv", lambda exe, argv: ran.append(argv))
    result = CliRunner().invoke(cli.serve, [str(engine), "--backend", "trtllm", *args])
    assert result.exit_code == 0, result.output
    return parse_trtllm_serve(ran[0])[1]


def _trtllm_serve_lines(script: str) -> list[list[str]]:
    joined = re.sub(r"\\\n\s*", " ", script)
    out = []
    for line in joined.splitlines():
        if "exec trtllm-serve" in line:
            words = shlex.split(line.split("exec ", 1)[1].split(")", 1)[0])
            out.append(words)
    return out


def test_benchmark_script_calls_trtllm_serve_with_options_it_has():
    script = (ROOT / "benchmarks" / "dgx_b300_gpt_oss_120b.sh").read_text()
    lines = _trtllm_serve_lines(script)
    assert lines, "the AR and EAGLE-3 arms run trtllm-serve directly"
    for argv in lines:
        model, opts = parse_trtllm_serve(argv)
        assert model.endswith("/target") and "--config" in opts
    assert set(TRTLLM_SERVE_OPTIONS) >= {"--config", "--extra_llm_api_options", "--tokenizer"}
