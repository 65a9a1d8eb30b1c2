"""`dflash-trt build` end to end on tiny random models: the engine generates exactly what the source
checkpoints generate, bad pairings fail with their message, killed builds leave nothing, and a
checksum mismatch is refused."""

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from dflash_trt.build import STALL_ENV, build_engine, prepare_build
from dflash_trt.cli import main
from dflash_trt.engine_dir import EngineDir, open_engine
from dflash_trt.sampling_params import SamplingParams
from dflash_trt.spec.draft_vocab import save_draft_vocab
from dflash_trt.trtllm.llm_api_keys import NESTED_KEYS, TOP_LEVEL_KEYS
from tests.conftest import make_drafter, save_char_tokenizer

REPO = Path(__file__).resolve().parent.parent


def write_config(dir: Path, target: Path, drafter: Path | None, **extra) -> Path:
    raw = {"name": "tiny", "model": str(target), "hardware": "cpu", "dtype": "float32",
           "max_batch_size": 2, "max_seq_len": 256, **extra}
    if drafter is not None:
        raw["speculative_config"] = {"speculative_model": str(drafter), "max_draft_len": 7}
    path = dir / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def tiny_engine(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    cfg = write_config(root, tiny_dirs["qwen3"], tiny_dirs["qwen3_drafter"])
    return build_engine(cfg, root / "engines" / "tiny", progress=False)


def _gen(*args, tokens: int = 24):
    r = CliRunner().invoke(main, ["generate", *args, "-p", "hello", "--max-new-tokens", str(tokens), "--ignore-eos",
                                  "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_engine_generates_the_same_text_as_the_source_checkpoints(tiny_engine, tiny_dirs):
    from_engine = _gen(str(tiny_engine))
    from_sources = _gen("--target", str(tiny_dirs["qwen3"]), "--drafter", str(tiny_dirs["qwen3_drafter"]), "-k", "7",
                        "--max-model-len", "256")
    assert from_engine["token_ids"] == from_sources["token_ids"] and from_engine["text"] == from_sources["text"]
    assert from_engine["max_draft_len"] == 7 and from_engine["tau"] >= 1.0


def test_engine_directory_layout_and_manifest(tiny_engine, tiny_dirs):
    e = EngineDir(tiny_engine)
    e.verify()
    m = e.manifest
    files = set(m["files"])
    assert {"target/config.json", "target/model.safetensors", "drafter/config.json", "drafter/model.safetensors",
            "tokenizer/tokenizer.json", "plan.json", "trtllm/config.yaml"} <= files
    assert m["target"]["num_hidden_layers"] == 4 and m["drafter"]["block_size"] == 16 and m["max_draft_len"] == 7
    assert m["tokenizer"]["chat_template"] and m["build_config"]["max_seq_len"] == 256
    # The drafter is the z-lab checkpoint, byte for byte.
    assert (tiny_engine / "drafter/model.safetensors").read_bytes() == (tiny_dirs["qwen3_drafter"] / "model.safetensors").read_bytes()
    assert e.plan["layout"] == "torch" and e.plan["fits"]
    cfg = e.engine_config()
    assert (cfg.max_batch_size, cfg.max_model_len, cfg.max_draft_len, cfg.dtype) == (2, 256, 7, "float32")
    options = yaml.safe_load((tiny_engine / "trtllm/config.yaml").read_text())
    # attention_backend VANILLA is TensorRT-LLM's default, left out for releases that predate the key
    assert options["speculative_config"] == {"decoding_type": "DFlash", "max_draft_len": 7,
                                             "speculative_model": "drafter"}
    assert options["max_seq_len"] == 256 and options["max_batch_size"] == 2
    assert options["cuda_graph_config"] is None  # graphs off, as planned, not TensorRT-LLM's default capture
    for key, value in options.items():
        assert key in TOP_LEVEL_KEYS, key
        if key in NESTED_KEYS and value is not None:
            assert set(value) <= NESTED_KEYS[key], key


def test_a_built_engines_schedule_prints_as_the_plan_does(tiny_dirs, tmp_path):
    cfg = _spec_config(tmp_path, tiny_dirs, draft_len_schedule={1: 3, 2: 1})
    planned = CliRunner().invoke(main, ["build", str(cfg), "--plan-only"]).output
    built = CliRunner().invoke(main, ["build", str(cfg), "-o", str(tmp_path / "e")]).output
    assert "{1: 3, 2: 1}" in planned and "{1: 3, 2: 1}" in built and "'1'" not in built


def test_inspect_prints_manifest_and_plan_tables(tiny_engine):
    r = CliRunner().invoke(main, ["inspect", str(tiny_engine), "--verify"])
    assert r.exit_code == 0, r.output
    for words in ("Engine", "Qwen3ForCausalLM, 4 layers", "block 16", "Memory per rank", "target_kv_cache",
                  "drafter_context_cache", "sha256 verified", "fits: yes"):
        assert words in r.output


def test_a_file_verified_before_is_hashed_again_only_once_it_changed(tiny_engine, tmp_path, monkeypatch):
    """A 65 GB engine is not read whole at every start; a write changes the ctime, which no tool sets back."""
    from dflash_trt import engine_dir

    engine = tmp_path / "e"
    shutil.copytree(tiny_engine, engine)
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))
    hashed, sha256 = [], engine_dir._sha256
    monkeypatch.setattr(engine_dir, "_sha256", lambda f: hashed.append(f.relative_to(engine)) or sha256(f))
    EngineDir(engine).verify()
    assert len(hashed) == len(EngineDir(engine).manifest["files"])
    hashed.clear()
    EngineDir(engine).verify()
    assert hashed == []
    weights = engine / "drafter" / "model.safetensors"
    before, data = weights.stat(), bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, and the mtime set back as `cp -p` or `touch -r` would
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(ValueError, match=r"drafter/model.safetensors: sha256 does not match manifest.json"):
        EngineDir(engine).verify()
    assert hashed == [Path("drafter/model.safetensors")]
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    hashed.clear()
    r = CliRunner().invoke(main, ["inspect", str(engine), "--verify"])  # every file, recorded or not
    assert r.exit_code == 0 and len(hashed) == len(EngineDir(engine).manifest["files"]), r.output


def test_records_of_engines_deleted_since_are_removed_as_another_is_verified(tiny_engine, tmp_path, monkeypatch):
    """Engines built and deleted by the hundred (test runs, CI) leave no records in the user's cache."""
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))
    kept, gone, new = (tmp_path / name for name in ("kept", "gone", "new"))
    for engine in (kept, gone):
        shutil.copytree(tiny_engine, engine)
        EngineDir(engine).verify()
    records = tmp_path / "cache" / "verified"
    assert len(list(records.glob("*.json"))) == 2
    shutil.rmtree(gone)
    shutil.copytree(tiny_engine, new)
    EngineDir(new).verify()
    left = sorted(json.loads(f.read_text())["engine"] for f in records.glob("*.json"))
    assert left == sorted([str(kept), str(new)])
    # a record of a release before records named their engine (read by none now) goes too; one naming a path that
    # cannot be looked at (here a name too long for the file system) stays, and opening the engine does not fail
    (records / "old-0123456789abcdef.json").write_text(json.dumps({"manifest.json": ["x", 1, 2, 3, 4, 5]}))
    unlookable = records / "far-0123456789abcdef.json"
    unlookable.write_text(json.dumps({"engine": "/" + "x" * 300 + "/e", "files": {}}))
    shutil.rmtree(new)
    shutil.copytree(tiny_engine, new)  # new inodes: its record is written again
    EngineDir(new).verify()
    assert sorted(f.name for f in records.glob("*.json") if f.name.startswith(("old-", "far-"))) == [unlookable.name]


def test_checksum_mismatch_is_refused_by_generate_and_open_engine(tiny_engine, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_engine, bad)
    weights = bad / "drafter" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit pattern in the last tensor byte; the size is unchanged
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"drafter/model.safetensors: sha256 does not match manifest.json"):
        open_engine(bad)  # what `dflash-trt serve ENGINE` calls
    r = CliRunner().invoke(main, ["generate", str(bad), "-p", "x", "--backend", "torch"])
    assert r.exit_code == 1 and "sha256 does not match" in r.output
    (bad / "manifest.json").write_text("{")
    with pytest.raises(ValueError, match="invalid JSON"):
        EngineDir(bad)


@pytest.mark.parametrize("command", [["inspect"], ["generate", "-p", "x"]])
def test_a_file_missing_from_an_engine_is_named_by_every_command(tiny_engine, tmp_path, command):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_engine, bad)
    (bad / "plan.json").unlink()
    r = CliRunner().invoke(main, [command[0], str(bad), *command[1:]])
    assert r.exit_code == 1 and "plan.json: listed in manifest.json but missing" in r.output, r.output
    (bad / "plan.json").mkdir()
    r = CliRunner().invoke(main, [command[0], str(bad), *command[1:]])
    assert r.exit_code == 1 and "plan.json: listed in manifest.json as a file, but not one" in r.output, r.output


@pytest.mark.parametrize("key, inner", [("sources", None), ("tokenizer", "chat_template")])
def test_inspect_names_the_manifest_key_it_lacks(tiny_engine, tmp_path, key, inner):
    # Without --verify an edited manifest reaches the table (with a note that it was edited).
    bad = tmp_path / "bad"
    shutil.copytree(tiny_engine, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    if inner is None:
        del manifest[key]
    else:
        del manifest[key][inner]
    (bad / "manifest.json").write_text(json.dumps(manifest))
    r = CliRunner().invoke(main, ["inspect", str(bad)])
    assert r.exit_code == 1 and f"manifest.json: missing key {inner or key!r}" in r.output, r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize("name, edited, message", [
    ("plan.json", lambda plan: [], "plan.json: not as dflash-trt writes it"),
    ("manifest.json", lambda m: {**m, "target": None}, "manifest.json: not as dflash-trt writes it"),
    ("manifest.json", lambda m: {**m, "target": [], "format_version": m["format_version"] + 1},
     "format_version=2"),  # of another version: that is what to say
])
def test_inspect_names_json_values_of_the_wrong_type_without_a_traceback(tiny_engine, tmp_path, name, edited,
                                                                         message):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_engine, bad)
    (bad / name).write_text(json.dumps(edited(json.loads((bad / name).read_text()))))
    for flags in ([], ["--verify"]):
        r = CliRunner().invoke(main, ["inspect", str(bad), *flags])
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
        assert "rebuild" in r.output or "format_version" in r.output, r.output
    assert message in CliRunner().invoke(main, ["inspect", str(bad)]).output


@pytest.mark.parametrize("listed", ["../elsewhere/plan.json", "/etc/hostname"])
def test_a_manifest_listing_a_file_outside_the_engine_is_refused(tiny_engine, tmp_path, listed):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_engine, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["files"][listed] = manifest["files"]["plan.json"]
    (bad / "manifest.json").write_text(json.dumps(manifest))
    for args in (["inspect", str(bad), "--verify"], ["generate", str(bad), "-p", "x"]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 1 and f"lists {listed!r}, outside the engine directory" in r.output, r.output


def test_inspect_names_an_unreadable_plan(tiny_engine, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_engine, bad)
    (bad / "plan.json").write_text("{")
    r = CliRunner().invoke(main, ["inspect", str(bad)])
    assert r.exit_code == 1 and "plan.json" in r.output, r.output


def _edited(tiny_engine, tmp_path, name: str, edit) -> Path:
    """A copy of the engine with one JSON file edited."""
    bad = tmp_path / "bad"
    shutil.copytree(tiny_engine, bad)
    data = json.loads((bad / name).read_text())
    edit(data)
    (bad / name).write_text(json.dumps(data))
    return bad


@pytest.mark.parametrize("command", [["inspect"], ["generate", "-p", "hi", "--max-new-tokens", "2"],
                                     ["triton", "export", "--backend", "trtllm", "-o", "REPO"]])
def test_a_plan_without_its_layout_is_named_not_a_traceback(tiny_engine, tmp_path, command):
    # checksums resealed: an edited file is refused for its size before its content is read (triton export)
    bad = _resealed(tiny_engine, tmp_path, "plan.json", lambda plan: plan.pop("layout"))
    args = [str(tmp_path / "repo") if a == "REPO" else a for a in command]
    where = 2 if command[0] == "triton" else 1
    r = CliRunner().invoke(main, [*args[:where], str(bad), *args[where:]])
    assert r.exit_code == 1 and "plan.json" in r.output and "'layout'" in r.output, r.output
    assert "Traceback" not in r.output


def _resealed(tiny_engine, tmp_path, name: str, edit) -> Path:
    """A copy of the engine with one JSON file edited and its checksums written to match, as a version that writes
    other keys under the same format_version would leave it."""
    from dflash_trt.engine_dir import MANIFEST_DIGEST, manifest_digest

    bad = _edited(tiny_engine, tmp_path, name, edit)
    manifest = json.loads((bad / "manifest.json").read_text())
    if name != "manifest.json":
        data = (bad / name).read_bytes()
        manifest["files"][name] = {**manifest["files"][name], "size": len(data),
                                   "sha256": hashlib.sha256(data).hexdigest()}
    manifest[MANIFEST_DIGEST] = manifest_digest(manifest)
    (bad / "manifest.json").write_text(json.dumps(manifest))
    return bad


@pytest.mark.parametrize("name, edit, words", [
    ("plan.json", lambda plan: plan.pop("dtype"), "plan.json: missing key 'dtype'"),
    ("plan.json", lambda plan: plan.update(hardware="cpu"), "plan.json: not as this dflash-trt writes it"),
    ("manifest.json", lambda m: m["build_config"].pop("max_seq_len"), "manifest.json: missing key 'max_seq_len'"),
    ("manifest.json", lambda m: m["build_config"]["speculative_config"].update(draft_len_schedule={"x": 3}),
     "manifest.json: speculative_config holds what is no number"),
    ("manifest.json", lambda m: m["files"]["plan.json"].pop("size"), "manifest.json: missing key 'size'"),
])
def test_an_engine_whose_checksums_agree_but_lacks_a_key_is_named_not_a_traceback(tiny_engine, tmp_path, name, edit,
                                                                                 words):
    bad = _resealed(tiny_engine, tmp_path, name, edit)
    r = CliRunner().invoke(main, ["generate", str(bad), "-p", "hi", "--max-new-tokens", "2"])
    assert r.exit_code == 1 and words in r.output and "rebuild the engine" in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)


@pytest.mark.parametrize("command", [["generate", "-p", "hi"], ["inspect"], ["serve"]])
def test_an_engine_a_killed_build_set_aside_is_pointed_to(tiny_engine, tmp_path, command):
    """A build killed between its two renames (the old engine set aside, the new one not yet in place) leaves no
    engine at its path: the commands that take one say where it is."""
    aside = tmp_path / ".E1.old-4242-0123abcd"
    shutil.copytree(tiny_engine, aside)
    r = CliRunner().invoke(main, [command[0], str(tmp_path / "E1"), *command[1:]])
    assert r.exit_code == 2 and f"left the previous engine at {aside}" in " ".join(r.output.split()), r.output


def test_an_engine_file_it_may_not_read_is_an_error_not_a_traceback(tiny_engine, monkeypatch):
    import dflash_trt.engine_dir as engine_dir

    def unreadable(self):
        raise PermissionError(13, "Permission denied", str(self.path / "plan.json"))

    monkeypatch.setattr(engine_dir.EngineDir, "plan", property(unreadable))
    r = CliRunner().invoke(main, ["generate", str(tiny_engine), "-p", "hi", "--max-new-tokens", "2"])
    assert r.exit_code == 1 and "Permission denied" in r.output and "plan.json" in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_an_engine_of_another_format_is_refused_before_it_runs_and_inspect_says_so(tiny_engine, tmp_path):
    bad = _edited(tiny_engine, tmp_path, "manifest.json", lambda m: m.update(format_version=m["format_version"] + 1))
    for args in (["generate", str(bad), "-p", "hi"], ["triton", "export", str(bad), "-o", str(tmp_path / "repo")]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 1 and "format_version" in r.output, r.output
    assert not (tmp_path / "repo").exists()
    shown = CliRunner().invoke(main, ["inspect", str(bad)])
    assert shown.exit_code == 0 and "note:" in shown.output and "format_version" in shown.output


def test_inspect_shows_a_hand_edited_manifest_with_a_note_that_it_was_edited(tiny_engine, tmp_path):
    bad = _edited(tiny_engine, tmp_path, "manifest.json", lambda m: m.update(max_draft_len=5))
    shown = CliRunner().invoke(main, ["inspect", str(bad)])
    assert shown.exit_code == 0 and "note:" in shown.output and "edited after the build" in shown.output
    r = CliRunner().invoke(main, ["triton", "export", str(bad), "-o", str(tmp_path / "repo")])
    assert r.exit_code == 1 and "edited after the build" in r.output and not (tmp_path / "repo").exists()
    assert "edited after the build" not in CliRunner().invoke(main, ["inspect", str(tiny_engine)]).output


def test_inspect_notes_weights_cut_short_without_reading_them(tiny_engine, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_engine, bad)
    weights = bad / "target" / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)  # a copy or download cut short
    shown = CliRunner().invoke(main, ["inspect", str(bad)])
    assert shown.exit_code == 0, shown.output
    assert f"note: {weights}: {size // 2} bytes, manifest.json says {size} (cut short" in shown.output
    assert "note:" not in CliRunner().invoke(main, ["inspect", str(tiny_engine)]).output
    # nor is it exported for tritonserver to fail on, its reason in the server's log
    r = CliRunner().invoke(main, ["triton", "export", str(bad), "-o", str(tmp_path / "repo")])
    assert r.exit_code == 1 and f"{weights}: {size // 2} bytes" in r.output and not (tmp_path / "repo").exists()


def test_a_format_version_of_another_type_is_shown_as_it_is_written(tiny_engine, tmp_path):
    bad = _edited(tiny_engine, tmp_path, "manifest.json", lambda m: m.update(format_version=str(m["format_version"])))
    r = CliRunner().invoke(main, ["generate", str(bad), "-p", "hi"])
    assert r.exit_code == 1 and "format_version='1', this dflash-trt reads 1" in r.output, r.output


def test_triton_serve_given_an_engine_says_to_export_it_first(tiny_engine):
    r = CliRunner().invoke(main, ["triton", "serve", str(tiny_engine)])
    assert r.exit_code == 1 and "is an engine directory" in r.output and "triton export" in r.output, r.output


def _pairing_error(tiny_dirs, tmp_path, edit, **extra) -> str:
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    cfg = json.loads((tiny_dirs["qwen3_drafter"] / "config.json").read_text())
    edit(cfg)
    (drafter / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        prepare_build(write_config(tmp_path, tiny_dirs["qwen3"], drafter, **extra))
    return str(e.value)


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda c: c.update(hidden_size=32), "hidden_size=32 does not match the target's hidden_size=64"),
        (lambda c: c.update(vocab_size=100), "vocab_size=100 does not match the target's vocab_size=96"),
        (lambda c: c["dflash_config"].update(mask_token_id=96), "mask_token_id=96 is outside the target's embedding"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[1, 4]), "out of range: [4]"),
        (lambda c: c.update(num_target_layers=36), "num_target_layers=36 but the target has 4 layers"),
        (lambda c: c.update(block_size=4), "draft_block_size=4 (checkpoint) allows max_draft_len <= 3"),
    ],
)
def test_each_bad_pairing_fails_with_its_message(tiny_dirs, tmp_path, edit, words):
    msg = _pairing_error(tiny_dirs, tmp_path, edit)
    assert words in msg, msg


@pytest.mark.parametrize("rope, words", [
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
     "rope_type='linear' where the target uses rope_type='default'"),
    ({"rope_type": "default", "rope_theta": 1e6}, "rope_theta=1000000.0 where the target uses rope_theta=10000.0"),
])
def test_a_drafter_with_its_own_rope_builds_with_a_warning(tiny_dirs, tmp_path, caplog, rope, words):
    # z-lab's drafters rotate with their own RoPE whatever the target's (its Qwen3.6 drafter is YaRN): not refused
    drafter = tmp_path / "drafter"
    shutil.copytree(tiny_dirs["qwen3_drafter"], drafter)
    cfg = json.loads((drafter / "config.json").read_text())
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = rope
    (drafter / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level("WARNING"):
        prepare_build(write_config(tmp_path, tiny_dirs["qwen3"], drafter))
    assert any(words in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    caplog.clear()
    with caplog.at_level("WARNING"):
        prepare_build(write_config(tmp_path, tiny_dirs["qwen3"], tiny_dirs["qwen3_drafter"]))
    assert not any("RoPE" in r.getMessage() for r in caplog.records)


def test_the_shipped_gpt_oss_pairing_builds_without_a_rope_warning(tmp_path, caplog):
    # z-lab's drafter leaves YaRN's truncate unset where gpt-oss sets it false: a scaling detail, not another RoPE
    with caplog.at_level("WARNING"):
        prepare_build(Path(__file__).parents[1] / "build_configs" / "gpt-oss-120b-8xb300-latency.yaml",
                      allow_bundled=True)
    assert not any("RoPE" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_a_model_that_is_not_on_disk_says_how_to_fetch_it(tiny_dirs, tmp_path):
    cfg = write_config(tmp_path, tiny_dirs["qwen3"], None, model="nobody/no-such-model")
    with pytest.raises(FileNotFoundError, match="hf download nobody/no-such-model"):
        prepare_build(cfg)


@pytest.mark.parametrize("file", ["config.json", "model.safetensors"])
def test_a_model_file_named_in_its_directorys_place_is_called_a_file(tiny_dirs, tmp_path, file):
    cfg = write_config(tmp_path, tiny_dirs["qwen3"], None)
    r = CliRunner().invoke(main, ["build", str(cfg), "-o", str(tmp_path / "e"),
                                  "--drafter", str(tiny_dirs["qwen3_drafter"] / file)])
    assert r.exit_code == 1 and f"{tiny_dirs['qwen3_drafter'] / file} is a file; name the model directory" in \
        " ".join(r.output.split()), r.output


def test_build_without_drafter_and_existing_output(tiny_dirs, tmp_path):
    cfg = write_config(tmp_path, tiny_dirs["llama"], None)
    out = build_engine(cfg, tmp_path / "plain", progress=False)
    assert EngineDir(out).drafter_dir is None and "speculative_config" not in yaml.safe_load((out / "trtllm/config.yaml").read_text())
    with pytest.raises(FileExistsError, match="--force"):
        build_engine(cfg, out, progress=False)
    assert build_engine(cfg, out, force=True, progress=False) == out
    engine = open_engine(out)
    assert engine.drafter is None


def test_an_output_path_below_a_file_and_a_target_path_that_does_not_exist_are_named(tiny_dirs, tmp_path):
    cfg = write_config(tmp_path, tiny_dirs["llama"], None)
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(FileExistsError, match=f"{tmp_path / 'afile'} is a file, not a directory: -o "):
        build_engine(cfg, tmp_path / "afile" / "sub", progress=False)
    assert (tmp_path / "afile").read_text() == "mine"
    missing = f"model='./no_such_model': {tmp_path / 'no_such_model'} does not exist"
    with pytest.raises(FileNotFoundError, match=missing):
        prepare_build(write_config(tmp_path, tiny_dirs["llama"], None, model="./no_such_model"))
    r = CliRunner().invoke(main, ["build", str(cfg), "-o", str(tmp_path / "e"), "--drafter", "no_such_drafter"])
    assert r.exit_code == 2 and "--drafter" in r.output and "neither a directory nor an HF id" in r.output, r.output
    run = tmp_path / "run"  # a `dflash-trt train` --out: the drafter is run/drafter
    shutil.copytree(tiny_dirs["llama_drafter"], run / "drafter")
    cfg = write_config(tmp_path, tiny_dirs["llama"], None)
    r = CliRunner().invoke(main, ["build", str(cfg), "-o", str(tmp_path / "e"), "--drafter", str(run)])
    assert r.exit_code != 0 and f"its drafter is {run / 'drafter'}" in " ".join(r.output.split()), r.output
    engine = build_engine(cfg, tmp_path / "engine", progress=False)  # an engine as a model: not a train --out
    r = CliRunner().invoke(main, ["build", str(write_config(tmp_path, engine, None)), "-o", str(tmp_path / "e2")])
    assert r.exit_code != 0 and f"{engine} is an engine: its target is {engine / 'target'}" in \
        " ".join(r.output.split()), r.output
    (run / "drafter" / "config.json").rename(run / "drafter" / "config.saved")
    (run / "drafter" / "config.json").mkdir()  # a folder where the file should be: not "no config.json"
    cfg = write_config(tmp_path, tiny_dirs["llama"], None)
    r = CliRunner().invoke(main, ["build", str(cfg), "-o", str(tmp_path / "e"), "--drafter", str(run / "drafter")])
    assert r.exit_code != 0 and f"{run / 'drafter' / 'config.json'}: not a regular file" in \
        " ".join(r.output.split()), r.output


def test_an_output_it_cannot_write_is_named_before_the_checkpoint_is_read(tiny_dirs, tmp_path, monkeypatch):
    import dflash_trt.build as build

    def never(*args, **kwargs):
        raise AssertionError("the checkpoint was read before -o was found unwritable")

    monkeypatch.setattr(build, "prepare_build", never)
    cfg = write_config(tmp_path, tiny_dirs["llama"], None)
    for out in ("/proc/dflash-engine", "/sys/dflash-engine"):  # no file can be made there, not even by root
        r = CliRunner().invoke(main, ["build", str(cfg), "-o", out])
        assert r.exit_code == 1 and f"-o {out}: cannot write in /" in r.output, r.output


def test_an_exception_midway_leaves_no_engine_and_no_temp(tiny_dirs, tmp_path, monkeypatch):
    import dflash_trt.build as build

    def boom(*a, **k):
        raise RuntimeError("injected failure while writing the tokenizer")

    monkeypatch.setattr(build, "_write_tokenizer", boom)
    cfg = write_config(tmp_path, tiny_dirs["qwen3"], tiny_dirs["qwen3_drafter"])
    with pytest.raises(RuntimeError, match="injected"):
        build_engine(cfg, tmp_path / "out" / "e", progress=False)
    assert list((tmp_path / "out").iterdir()) == []


def test_a_build_killed_by_a_signal_leaves_nothing_serve_would_load(tiny_dirs, tmp_path):
    cfg = write_config(tmp_path, tiny_dirs["qwen3"], tiny_dirs["qwen3_drafter"])
    out = tmp_path / "engines" / "e"
    env = {**os.environ, STALL_ENV: "files"}  # stall once every file but the manifest is written
    proc = subprocess.Popen([sys.executable, "-m", "dflash_trt", "build", str(cfg), "-o", str(out)], env=env,
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while not list(out.parent.glob(".e.build-*/trtllm/config.yaml")) and time.time() < deadline:
            assert proc.poll() is None, "the build exited before it could be killed"
            time.sleep(0.05)
        assert list(out.parent.glob(".e.build-*/trtllm/config.yaml")), "the build never reached its stall point"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not out.exists()
    with pytest.raises(FileNotFoundError, match="not an engine directory"):
        EngineDir(out)
    # The next build beside it, of any name, removes the dead build's temporary directory; a live build's stays.
    live = out.parent / f".g.build-{os.getpid()}-0000"
    live.mkdir()
    build_engine(cfg, out.parent / "f", progress=False)
    assert sorted(p.name for p in out.parent.iterdir()) == [live.name, "f"]
    build_engine(cfg, out, progress=False)
    assert sorted(p.name for p in out.parent.iterdir()) == [live.name, "e", "f"]
    EngineDir(out).verify()


@pytest.mark.slow
def test_smollm2_cpu_default_builds_from_gguf_and_generates_like_its_sources(smollm2_dir, tmp_path):
    # The shipped CPU config with a tiny random drafter in place of the trained one (it may still be training).
    drafter = make_drafter(tmp_path / "drafter", smollm2_dir, layers=1, block_size=8, target_layer_ids=(1, 15, 27))
    out = tmp_path / "smollm2"
    r = CliRunner().invoke(main, ["build", str(REPO / "build_configs" / "smollm2-135m-cpu.yaml"), "-o", str(out),
                                  "--drafter", str(drafter)])
    assert r.exit_code == 0, r.output
    assert "fits: yes" in r.output and EngineDir(out).manifest["sources"]["target"]["kind"] == "embedded"
    args = ["--chat", "--dtype", "float32", "--max-model-len", "2048"]
    from_engine = _gen(str(out), *args, tokens=8)
    from_sources = _gen("--target", str(smollm2_dir), "--drafter", str(drafter), *args, tokens=8)
    assert from_engine["token_ids"] == from_sources["token_ids"] and from_engine["text"] == from_sources["text"]


def test_a_checkpoint_missing_a_tensor_fails_before_anything_is_written(tiny_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_dirs["qwen3"], broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.2.mlp.down_proj.weight"]
    save_file(tensors, broken / "model.safetensors")
    cfg = write_config(tmp_path, broken, None)
    with pytest.raises(ValueError, match="missing tensor 'model.layers.2.mlp.down_proj.weight'"):
        build_engine(cfg, tmp_path / "out" / "e", progress=False)
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def _broken_drafter(tmp_path: Path, tiny_dirs, edit) -> Path:
    from safetensors.torch import load_file, save_file

    d = tmp_path / "drafter"
    shutil.copytree(tiny_dirs["qwen3_drafter"], d)
    tensors = load_file(d / "model.safetensors")
    config = json.loads((d / "config.json").read_text())
    edit(tensors, config)
    save_file(tensors, d / "model.safetensors")
    (d / "config.json").write_text(json.dumps(config))
    return d


def _second_layer(tensors: dict, config: dict) -> None:
    """Weights for one layer more than config.json counts: a config that undercounts its checkpoint."""
    tensors.update({k.replace("layers.0.", "layers.1."): v.clone() for k, v in tensors.items() if k.startswith("layers.0.")})


@pytest.mark.parametrize("edit, words", [
    (_second_layer, "hold layer index 1, but config.json says num_hidden_layers=1"),
    (lambda t, c: t.update({"norm.weight": t["norm.weight"].to(torch.int32)}), "'norm.weight' is torch.int32"),
])
def test_a_drafter_whose_weights_do_not_match_its_config_fails_naming_it(tiny_dirs, tmp_path, edit, words):
    d = _broken_drafter(tmp_path, tiny_dirs, edit)
    with pytest.raises(ValueError, match=words):
        build_engine(write_config(tmp_path, tiny_dirs["qwen3"], d), tmp_path / "out" / "e", progress=False)
    r = CliRunner().invoke(main, ["generate", "--target", str(tiny_dirs["qwen3"]), "--drafter", str(d), "-p", "hi"])
    assert r.exit_code != 0 and words in r.output and "Traceback" not in r.output


def _broken_target(tmp_path: Path, tiny_dirs, edit) -> Path:
    from safetensors.torch import load_file, save_file

    t = tmp_path / "target"
    shutil.copytree(tiny_dirs["qwen3"], t)
    tensors = load_file(t / "model.safetensors")
    edit(tensors)
    save_file(tensors, t / "model.safetensors")
    return t


def _poison(name: str, value: float):
    def edit(tensors: dict) -> None:
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[3] = value
    return edit


@pytest.mark.parametrize("edit, words", [
    # an int8 copy of a linear once loaded as small integers, and generate wrote nonsense
    (lambda t: t.update({"model.layers.1.mlp.up_proj.weight": t["model.layers.1.mlp.up_proj.weight"].to(torch.int8)}),
     "'model.layers.1.mlp.up_proj.weight' is torch.int8"),
    # a NaN once built, and generate wrote token 0 forever
    (_poison("model.layers.1.self_attn.o_proj.weight", float("nan")),
     "'model.layers.1.self_attn.o_proj.weight' holds NaN or Inf"),
])
def test_a_target_weight_that_is_not_a_finite_float_fails_the_build_naming_it(tiny_dirs, tmp_path, edit, words):
    t = _broken_target(tmp_path, tiny_dirs, edit)
    with pytest.raises(ValueError, match=words):
        build_engine(write_config(tmp_path, t, None), tmp_path / "out" / "e", progress=False)
    assert not (tmp_path / "out" / "e").exists()
    # nor does generate (or serve) run a directory no build checked
    r = CliRunner().invoke(main, ["generate", "--target", str(t), "--no-spec", "-p", "hi", "--max-new-tokens", "2"])
    assert r.exit_code == 1 and str(t) in r.output and words in r.output, r.output


def test_tensors_of_another_variant_the_runtime_would_drop_are_warned_of_at_build(tiny_dirs, tmp_path, caplog):
    t = _broken_target(tmp_path, tiny_dirs, lambda t: t.update({"model.extra_adapter.weight": torch.ones(3)}))
    d = _broken_drafter(tmp_path, tiny_dirs, lambda t, c: t.update({"extra_gate.weight": torch.ones(3)}))
    with caplog.at_level(logging.WARNING):
        build_engine(write_config(tmp_path, t, d), tmp_path / "e", progress=False)
    assert f"{t}: 1 tensors not used by" in caplog.text and "model.extra_adapter.weight" in caplog.text
    assert f"{d}: 1 tensors not used by DFlashDrafter" in caplog.text and "extra_gate.weight" in caplog.text


@pytest.mark.parametrize("dtype, value, words", [
    (torch.float8_e4m3fn, 1.5, None), (torch.float8_e4m3fn, float("nan"), "'fc.weight' holds NaN or Inf"),
    (torch.float8_e5m2, -448.0, None), (torch.float8_e5m2, float("-inf"), "'fc.weight' holds NaN or Inf"),
    (torch.float8_e5m2, float("nan"), "'fc.weight' holds NaN or Inf")])
def test_a_drafter_weight_in_float8_is_checked_like_any_other(tiny_dirs, tmp_path, dtype, value, words):
    """torch.isfinite takes no float8: the check itself failed ("isfinite" not implemented), naming no tensor."""
    def edit(tensors, config):
        tensors["fc.weight"] = tensors["fc.weight"].clone()
        tensors["fc.weight"].view(-1)[3] = value
        tensors["fc.weight"] = tensors["fc.weight"].to(dtype)
    d = _broken_drafter(tmp_path, tiny_dirs, edit)
    config = write_config(tmp_path, tiny_dirs["qwen3"], d)
    if words is None:
        build_engine(config, tmp_path / "out" / "e", progress=False)
        return
    with pytest.raises(ValueError, match=re.escape(words)):
        build_engine(config, tmp_path / "out" / "e", progress=False)


def test_a_drafter_weight_holding_inf_fails_the_build_naming_it(tiny_dirs, tmp_path):
    d = _broken_drafter(tmp_path, tiny_dirs, lambda t, c: _poison("fc.weight", float("inf"))(t))
    with pytest.raises(ValueError, match="'fc.weight' holds NaN or Inf"):  # it built, and drafted nothing
        build_engine(write_config(tmp_path, tiny_dirs["qwen3"], d), tmp_path / "out" / "e", progress=False)
    r = CliRunner().invoke(main, ["generate", "--target", str(tiny_dirs["qwen3"]), "--drafter", str(d), "-p", "hi",
                                  "--max-new-tokens", "2"])
    assert r.exit_code == 1 and str(d) in r.output and "'fc.weight' holds NaN or Inf" in r.output, r.output


def _shard(checkpoint: Path, placement: dict[str, str]) -> None:
    """Split `checkpoint`'s one file into shards: tensor-name prefix -> shard path, with an index naming them."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(checkpoint / "model.safetensors")
    (checkpoint / "model.safetensors").unlink()
    weight_map = {name: next(f for prefix, f in placement.items() if name.startswith(prefix)) for name in tensors}
    for f in set(weight_map.values()):
        (checkpoint / f).parent.mkdir(parents=True, exist_ok=True)
        save_file({n: t for n, t in tensors.items() if weight_map[n] == f}, checkpoint / f)
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("link", [False, True])
def test_shards_in_folders_of_their_own_go_beside_an_index_naming_them_there(tiny_dirs, tmp_path, link):
    # The shards were copied flat beside an index naming their folders: the engine built and did not load, and two
    # shards of one name in two folders overwrote each other. Flat, as TensorRT-LLM's loader reads them (it globs
    # the *.safetensors beside the index), with the index naming them there.
    t = tmp_path / "target"
    shutil.copytree(tiny_dirs["qwen3"], t)
    _shard(t, {"model.layers.0.": "a/first.safetensors", "": "b/rest.safetensors"})
    out = tmp_path / "e"
    build_engine(write_config(tmp_path, t, None, target_weights="link" if link else "copy"), out, progress=False)
    assert sorted(p.name for p in (out / "target").glob("*.safetensors")) == ["first.safetensors", "rest.safetensors"]
    weight_map = json.loads((out / "target" / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(weight_map.values()) == {"first.safetensors", "rest.safetensors"}
    assert _gen(str(out))["token_ids"] == _gen("--target", str(tiny_dirs["qwen3"]), "--no-spec")["token_ids"]
    EngineDir(out).verify()
    t2 = tmp_path / "t2"
    shutil.copytree(tiny_dirs["qwen3"], t2)
    _shard(t2, {"model.layers.0.": "a/model.safetensors", "": "b/model.safetensors"})
    with pytest.raises(ValueError, match="two shards named model.safetensors in different folders"):
        build_engine(write_config(tmp_path, t2, None), tmp_path / "e2", progress=False)


def test_a_shard_named_outside_the_checkpoint_is_refused(tiny_dirs, tmp_path):
    t = tmp_path / "target"
    shutil.copytree(tiny_dirs["qwen3"], t)
    _shard(t, {"": "../elsewhere/model.safetensors"})  # an engine would read it from outside itself, unchecksummed
    with pytest.raises(ValueError, match="'../elsewhere/model.safetensors' is outside the checkpoint"):
        build_engine(write_config(tmp_path, t, None), tmp_path / "out" / "e", progress=False)


def test_a_tensor_in_two_shards_without_an_index_is_refused(tiny_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "drafter"
    shutil.copytree(tiny_dirs["qwen3_drafter"], d)
    tensors = load_file(d / "model.safetensors")
    save_file({"fc.weight": torch.zeros_like(tensors["fc.weight"])}, d / "zz.safetensors")  # which one was used?
    with pytest.raises(ValueError, match="'fc.weight' is in both model.safetensors and zz.safetensors"):
        build_engine(write_config(tmp_path, tiny_dirs["qwen3"], d), tmp_path / "out" / "e", progress=False)


def test_an_index_with_an_empty_weight_map_says_so(tiny_dirs, tmp_path):
    t = tmp_path / "target"
    shutil.copytree(tiny_dirs["qwen3"], t)
    _shard(t, {"model.layers.0.": "a.safetensors", "": "b.safetensors"})
    (t / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(ValueError, match="index.json: its weight_map is empty"):  # "no *.safetensors weights"
        build_engine(write_config(tmp_path, t, None), tmp_path / "out" / "e", progress=False)


def test_a_weights_file_that_is_a_pipe_is_refused_not_waited_on(tiny_dirs, tmp_path):
    t = tmp_path / "target"
    shutil.copytree(tiny_dirs["qwen3"], t)
    (t / "model.safetensors").unlink()
    os.mkfifo(t / "model.safetensors")  # opened, it waits for a writer: the build hung
    with pytest.raises(ValueError, match="model.safetensors: not a regular file"):
        build_engine(write_config(tmp_path, t, None), tmp_path / "out" / "e", progress=False)


def test_an_index_naming_the_wrong_shard_for_a_tensor_says_so(tiny_dirs, tmp_path):
    t = tmp_path / "target"
    shutil.copytree(tiny_dirs["qwen3"], t)
    _shard(t, {"model.layers.0.": "a.safetensors", "": "b.safetensors"})
    index = t / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    index.write_text(json.dumps({"weight_map": {**weight_map, "model.norm.weight": "a.safetensors"}}))
    with pytest.raises(ValueError, match=r"names a.safetensors for tensor 'model.norm.weight', which that file does"):
        build_engine(write_config(tmp_path, t, None), tmp_path / "out" / "e", progress=False)


@pytest.mark.parametrize("content, words", [("{not json", "invalid JSON"), ("[1]", "expected a JSON object"),
                                            # built, and generate refused the engine
                                            ('{"eos_token_id": "x"}', "'eos_token_id' must be a whole number")])
def test_a_damaged_generation_config_fails_the_build_naming_it(tiny_dirs, tmp_path, content, words):
    # copied unread into the engine, it would fail TensorRT-LLM's load, on the device
    t = tmp_path / "target"
    shutil.copytree(tiny_dirs["qwen3"], t)
    (t / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=re.escape(f"{t / 'generation_config.json'}: {words}")):
        build_engine(write_config(tmp_path, t, None), tmp_path / "out" / "e", progress=False)


def test_a_chat_template_that_does_not_render_fails_the_build(tiny_dirs, tmp_path):
    t = tmp_path / "target"
    shutil.copytree(tiny_dirs["qwen3"], t)
    (t / "chat_template.jinja").write_text("{% for x in %}{{ broken")  # it built, and generate --chat crashed
    with pytest.raises(ValueError, match="the chat template does not render a user message.*TemplateSyntaxError"):
        build_engine(write_config(tmp_path, t, None), tmp_path / "out" / "e", progress=False)
    r = CliRunner().invoke(main, ["generate", "--target", str(t), "--no-spec", "--chat", "-p", "hi"])
    assert r.exit_code == 1 and f"{t}: the chat template does not render a user message (TemplateSyntaxError" in \
        " ".join(r.output.split()), r.output


def test_a_target_config_that_undercounts_its_layers_fails_naming_them(tiny_dirs, tmp_path):
    # Else it built, and generate wrote nonsense from 3 of the target's 4 layers.
    t = tmp_path / "target"
    shutil.copytree(tiny_dirs["qwen3"], t)
    config = json.loads((t / "config.json").read_text())
    (t / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    words = "hold layer index 3, but config.json says num_hidden_layers=3"
    with pytest.raises(ValueError, match=words):
        build_engine(write_config(tmp_path, t, None), tmp_path / "out" / "e", progress=False)
    r = CliRunner().invoke(main, ["generate", "--target", str(t), "--no-spec", "-p", "hi"])
    assert r.exit_code != 0 and words in r.output and "Traceback" not in r.output


def test_a_truncated_safetensors_file_is_named_not_a_traceback(tiny_dirs, tmp_path):
    d = tmp_path / "drafter"
    shutil.copytree(tiny_dirs["qwen3_drafter"], d)
    data = (d / "model.safetensors").read_bytes()
    for cut in (100, len(data) - 1000):  # inside the header; inside the tensors
        (d / "model.safetensors").write_bytes(data[:cut])
        with pytest.raises(ValueError, match=f"{d / 'model.safetensors'}.*truncated"):
            build_engine(write_config(tmp_path, tiny_dirs["qwen3"], d), tmp_path / "out" / "e", progress=False)
        r = CliRunner().invoke(main, ["generate", "--target", str(tiny_dirs["qwen3"]), "--drafter", str(d), "-p", "hi"])
        assert r.exit_code != 0 and "truncated" in r.output and "Traceback" not in r.output


def test_a_target_without_a_tokenizer_fails_before_any_file_is_written(tiny_dirs, tmp_path):
    t = tmp_path / "target"
    shutil.copytree(tiny_dirs["qwen3"], t)
    for f in t.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        build_engine(write_config(tmp_path, t, None), tmp_path / "out" / "e", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["sigterm", "sighup (terminal closed)"])
def test_a_build_stopped_by_sigterm_or_sighup_removes_its_own_temporary_directory(tiny_dirs, tmp_path, sig):
    out = tmp_path / "engines" / "e"
    proc = _stalled_build(tiny_dirs, tmp_path, out, hangup=signal.SIG_DFL)
    try:
        proc.send_signal(sig)
        assert proc.wait(30) == 128 + sig
    finally:
        proc.kill()
    assert list(out.parent.iterdir()) == []


def test_a_build_under_nohup_goes_on_after_sighup(tiny_dirs, tmp_path):
    out = tmp_path / "engines" / "e"
    proc = _stalled_build(tiny_dirs, tmp_path, out, hangup=signal.SIG_IGN)
    try:
        proc.send_signal(signal.SIGHUP)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM
    finally:
        proc.kill()


def _stalled_build(tiny_dirs, tmp_path: Path, out: Path, hangup) -> subprocess.Popen:
    """A build started with SIGHUP's disposition `hangup`, stalled once its files are written."""
    cfg = write_config(tmp_path, tiny_dirs["qwen3"], tiny_dirs["qwen3_drafter"])
    proc = subprocess.Popen([sys.executable, "-m", "dflash_trt", "build", str(cfg), "-o", str(out)],
                            env={**os.environ, STALL_ENV: "files"}, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, preexec_fn=lambda: signal.signal(signal.SIGHUP, hangup))
    deadline = time.time() + 60
    while not list(out.parent.glob(".e.build-*/trtllm/config.yaml")) and time.time() < deadline:
        assert proc.poll() is None, "the build exited before it could be stopped"
        time.sleep(0.05)
    return proc


def _auto_config(tmp_path: Path, tiny_dirs, acceptance: dict) -> Path:
    raw = {"name": "tiny", "model": str(tiny_dirs["qwen3"]), "hardware": "cpu", "dtype": "float32",
           "max_batch_size": 2, "max_seq_len": 256,
           "speculative_config": {"speculative_model": str(tiny_dirs["qwen3_drafter"]), "max_draft_len": 7,
                                  "draft_len_schedule": "auto", "acceptance_by_draft_len": acceptance}}
    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _overhead_bound_cpu():
    # A step costs 1 s whatever it does (bandwidth and FLOP/s effectively unlimited), so tokens per step
    # decide alone: the K with the largest tau wins at every batch size.
    from dflash_trt.hardware import HardwareProfile

    return HardwareProfile("cpu", "cpu", 10**12, 1, 0, mem_bandwidth_bytes_s=1e18, dense_flops=1e21,
                           step_overhead_s=1.0)


def test_auto_schedule_is_written_alike_into_plan_and_trtllm_config(tiny_dirs, tmp_path, monkeypatch):
    import dflash_trt.build as build

    monkeypatch.setattr(build, "profile", lambda name: _overhead_bound_cpu())
    # Measured tau 2.0 at K=3 and 3.0 at K=7; K=1,2,4,5,6 extrapolate below 3.0 (geometric acceptance fitted
    # to both points, alpha about 0.66), so K=7 is best for 1 and 2 rows: TensorRT-LLM form {1: 7, 2: 7}.
    out = build_engine(_auto_config(tmp_path, tiny_dirs, {3: 2.0, 7: 3.0}), tmp_path / "e", progress=False)
    plan = json.loads((out / "plan.json").read_text())
    options = yaml.safe_load((out / "trtllm/config.yaml").read_text())
    assert {int(b): k for b, k in plan["draft_len_schedule"].items()} == {1: 7, 2: 7}
    assert options["speculative_config"]["draft_len_schedule"] == {1: 7, 2: 7}
    assert options["speculative_config"]["max_draft_len"] == plan["max_draft_len"] == 7
    perf = plan["performance"]
    assert perf["schedule_source"] == "auto" and perf["measured_draft_lens"] == [3, 7]
    assert {(p["batch_size"], p["draft_len"]) for p in perf["points"] if p["chosen"]} == {(1, 7), (2, 7)}
    # The torch runtime serves the same schedule.
    cfg = EngineDir(out).engine_config()
    assert cfg.draft_len_schedule == {1: 7, 2: 7} and cfg.max_draft_len == 7


def test_an_auto_schedule_chosen_for_another_kind_of_cpu_is_warned_about_where_it_runs(tiny_dirs, tmp_path,
                                                                                        monkeypatch, caplog):
    """Built on an AMX server, `auto` drafts at batch sizes where an AVX2 laptop's plain steps are faster: the
    runtime says so (a table written in the build config holds on any CPU, as asked, and a schedule passed wins)."""
    import dflash_trt.hardware as hardware

    monkeypatch.setattr(hardware, "cpu_fit", lambda: hardware.CPU_FITS["amx"])
    out = build_engine(_auto_config(tmp_path, tiny_dirs, {3: 2.0, 7: 3.0}), tmp_path / "e", progress=False)
    with caplog.at_level("WARNING", logger="dflash_trt.engine_dir"):
        EngineDir(out).engine_config()
        assert not caplog.records  # where it was built
        monkeypatch.setattr(hardware, "cpu_fit", lambda: hardware.CPU_FITS["avx2"])
        EngineDir(out).engine_config(draft_len_schedule={1: 3})
        assert not caplog.records
        EngineDir(out).engine_config()
    assert "its draft_len_schedule (auto) was chosen for the CPU it was built on, by the figures fitted on an Intel " \
           "Xeon with AMX" in caplog.text and "this CPU's are those fitted on an AMD EPYC with AVX2" in caplog.text
    caplog.clear()  # a fit this release no longer knows (refitted since): nothing to compare with
    plan = json.loads((out / "plan.json").read_text())
    monkeypatch.setattr(hardware, "CPU_FITS", {k: dataclasses.replace(v, source=v.source + " (refit)")
                                               for k, v in hardware.CPU_FITS.items()})
    with caplog.at_level("WARNING", logger="dflash_trt.engine_dir"):
        EngineDir(out)._note_auto_schedule_of_another_cpu(plan)
    assert not caplog.records


def test_auto_schedule_that_never_pays_is_an_error_naming_the_key(tiny_dirs, tmp_path, monkeypatch):
    import dflash_trt.build as build

    monkeypatch.setattr(build, "profile", lambda name: _overhead_bound_cpu())
    # tau 1.0 at K=7: nothing is ever accepted (alpha 0), so every K ties plain decoding and loses the tie.
    with pytest.raises(ValueError, match="draft_len_schedule: auto: the performance model of hardware cpu predicts no K"):
        prepare_build(_auto_config(tmp_path, tiny_dirs, {7: 1.0}))


def _spec_config(tmp_path: Path, tiny_dirs, **spec) -> Path:
    """A tiny CPU build config whose speculative_config (K=3) adds `spec`."""
    raw = {"name": "tiny", "model": str(tiny_dirs["qwen3"]), "hardware": "cpu", "dtype": "float32",
           "max_batch_size": 2, "max_seq_len": 256,
           "speculative_config": {"speculative_model": str(tiny_dirs["qwen3_drafter"]), "max_draft_len": 3, **spec}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_adaptive_draft_len_reaches_the_torch_runtime_and_not_trtllm(tiny_dirs, tmp_path):
    out = build_engine(_spec_config(tmp_path, tiny_dirs, adaptive_draft_len=True), tmp_path / "e", progress=False)
    assert EngineDir(out).engine_config().adaptive_draft_len is True
    assert EngineDir(out).engine_config(adaptive_draft_len=False).adaptive_draft_len is False
    options = yaml.safe_load((out / "trtllm/config.yaml").read_text())
    assert "adaptive_draft_len" not in options["speculative_config"]  # not a TensorRT-LLM key


def test_k_given_when_opening_an_engine_caps_its_draft_len_schedule(tiny_dirs, tmp_path):
    """-k K on generate / serve drafts K at one row, whatever K the engine was built with, and no more at any batch
    size; batch sizes where the schedule turned speculation down stay so (it used to fail below the built K and be
    ignored above it)."""
    out = build_engine(_spec_config(tmp_path, tiny_dirs, max_draft_len=5, draft_len_schedule={1: 5, 2: 4, 3: 0}),
                       tmp_path / "e", progress=False)
    assert EngineDir(out).engine_config().draft_len_schedule == {1: 5, 2: 4, 3: 0}
    assert EngineDir(out).engine_config(max_draft_len=3).draft_len_schedule == {1: 3, 2: 3, 3: 0}
    assert EngineDir(out).engine_config(max_draft_len=7).draft_len_schedule == {1: 7, 2: 4, 3: 0}
    for k in (3, 7):
        engine = open_engine(out, max_draft_len=k)
        assert max(engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=24, ignore_eos=True))[0].draft_lens) == k
    assert EngineDir(out).engine_config(max_draft_len=3, draft_len_schedule={1: 3, 2: 1}).draft_len_schedule == \
        {1: 3, 2: 1}


def test_a_drafter_path_on_the_command_line_is_relative_to_the_current_directory(tiny_dirs, tmp_path, monkeypatch):
    cfg_dir = tmp_path / "configs"
    cfg_dir.mkdir()
    cfg = write_config(cfg_dir, tiny_dirs["qwen3"], tiny_dirs["qwen3_drafter"])
    shutil.copytree(tiny_dirs["qwen3_drafter"], tmp_path / "mine")
    monkeypatch.chdir(tmp_path)
    for ref in ("./mine", "mine"):
        r = CliRunner().invoke(main, ["build", str(cfg), "--plan-only", "--json", "--drafter", ref])
        assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["build", str(cfg), "--plan-only", "--drafter", "./missing"])
    assert r.exit_code != 0 and str(tmp_path / "missing") in r.output
    # a file named without ./ is a path too, not an HF id to download
    r = CliRunner().invoke(main, ["build", str(cfg), "--plan-only", "--drafter", "mine/model.safetensors"])
    assert r.exit_code != 0 and f"{tmp_path / 'mine' / 'model.safetensors'} is a file" in r.output, r.output
    assert "hf download" not in r.output


def test_a_draft_tree_reaches_the_torch_runtime_and_not_trtllm(tiny_dirs, tmp_path):
    out = build_engine(_spec_config(tmp_path, tiny_dirs, draft_tree={1: 5, 2: 3}, draft_tree_without_amx={1: 2}),
                       tmp_path / "e", progress=False)
    assert EngineDir(out).engine_config().draft_tree == {1: 5, 2: 3}
    assert EngineDir(out).engine_config().draft_tree_without_amx == {1: 2}
    shown = CliRunner().invoke(main, ["inspect", str(out)]).output
    assert "{1: 5, 2: 3} (batch size -> nodes); on CPUs without AMX {1: 2}" in shown
    assert EngineDir(out).engine_config(draft_tree={}).draft_tree == {}
    assert EngineDir(out).engine_config(draft_tree={}).draft_tree_without_amx == {}  # asked for: on any CPU
    options = yaml.safe_load((out / "trtllm/config.yaml").read_text())
    assert "draft_tree" not in options["speculative_config"]  # TensorRT-LLM drafts chains


def test_a_draft_len_schedule_without_amx_reaches_the_torch_runtime_and_not_trtllm(tiny_dirs, tmp_path):
    out = build_engine(_spec_config(tmp_path, tiny_dirs, draft_len_schedule={1: 3, 2: 3},
                                    draft_len_schedule_without_amx={1: 3}), tmp_path / "e", progress=False)
    engine = EngineDir(out)
    assert engine.engine_config().draft_len_schedule == {1: 3, 2: 3}
    assert engine.engine_config().draft_len_schedule_without_amx == {1: 3}
    shown = CliRunner().invoke(main, ["inspect", str(out)]).output
    assert "{1: 3, 2: 3} (batch size -> K); on CPUs without AMX {1: 3}" in shown
    assert engine.engine_config(draft_len_schedule={1: 2}).draft_len_schedule_without_amx == {1: 2}  # on any CPU
    assert engine.engine_config(max_draft_len=2).draft_len_schedule_without_amx == {1: 2}  # capped as -k caps both
    options = yaml.safe_load((out / "trtllm/config.yaml").read_text())
    assert options["speculative_config"]["draft_len_schedule"] == {1: 3, 2: 3}
    assert "draft_len_schedule_without_amx" not in options["speculative_config"]


@pytest.mark.parametrize("table, words", [
    ({1: 3, 2: 4}, "draft_len_schedule_without_amx values must be <= max_draft_len=3"),
    ({2: 2}, "draft_len_schedule_without_amx={2: 2} needs a key 1"),
])
def test_a_bad_draft_len_schedule_without_amx_fails_the_build_naming_the_key(tiny_dirs, tmp_path, table, words):
    with pytest.raises(ValueError, match=words):
        prepare_build(_spec_config(tmp_path, tiny_dirs, draft_len_schedule_without_amx=table))


def test_one_row_may_draft_less_than_k_without_amx(tiny_dirs, tmp_path):
    # this runtime's table alone: TensorRT-LLM's own schedule still starts at max_draft_len
    prepare_build(_spec_config(tmp_path, tiny_dirs, draft_len_schedule_without_amx={1: 2}))


def test_auto_with_a_table_without_amx_is_refused_naming_both(tiny_dirs, tmp_path):
    path = _auto_config(tmp_path, tiny_dirs, {3: 2.0})
    raw = yaml.safe_load(path.read_text())
    raw["speculative_config"]["draft_len_schedule_without_amx"] = {1: 7, 2: 2}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="draft_len_schedule: auto chooses K for the CPU the build runs on, which "
                                         "draft_len_schedule_without_amx would override there"):
        prepare_build(path)


@pytest.mark.parametrize("amx", [True, False])
def test_the_plan_marks_the_schedule_this_cpu_runs(tiny_dirs, tmp_path, monkeypatch, amx):
    import dflash_trt.perf_model as perf_model

    monkeypatch.setattr(perf_model, "has_amx_tiles", lambda: amx)
    plan = prepare_build(_spec_config(tmp_path, tiny_dirs, draft_len_schedule={1: 3, 2: 3},
                                      draft_len_schedule_without_amx={1: 3})).plan.to_dict()
    chosen = {p["batch_size"]: p["draft_len"] for p in plan["performance"]["points"] if p["chosen"]}
    assert chosen == ({1: 3, 2: 3} if amx else {1: 3, 2: 0})
    assert plan["performance"]["schedule_source"] == ("config" if amx else "config (without AMX)")
    assert {int(b): k for b, k in plan["draft_len_schedule"].items()} == {1: 3, 2: 3}  # TensorRT-LLM's, either way


def test_a_context_lookup_branch_reaches_the_torch_runtime_and_not_trtllm(tiny_dirs, tmp_path):
    out = build_engine(_spec_config(tmp_path, tiny_dirs, draft_tree={1: 3}, lookup_nodes=2), tmp_path / "e",
                       progress=False)
    assert EngineDir(out).engine_config().lookup_nodes == 2
    assert EngineDir(out).engine_config(lookup_nodes=0).lookup_nodes == 0
    assert "with context lookup branches of up to 2 tokens" in CliRunner().invoke(main, ["inspect", str(out)]).output
    options = yaml.safe_load((out / "trtllm/config.yaml").read_text())
    assert "lookup_nodes" not in options["speculative_config"]


def test_a_lookup_deeper_than_the_drafters_block_or_a_tree_past_its_mask_fails_the_build_naming_the_key(
        tiny_dirs, tmp_path):
    block = json.loads((Path(tiny_dirs["qwen3_drafter"]) / "config.json").read_text())["block_size"]
    with pytest.raises(ValueError, match=rf"speculative_config.lookup_nodes={block}: .* at most {block - 1} tokens"):
        prepare_build(_spec_config(tmp_path, tiny_dirs, lookup_nodes=block))
    with pytest.raises(ValueError, match=r"speculative_config.draft_tree=.*at most 62 nodes"):
        prepare_build(_spec_config(tmp_path, tiny_dirs, draft_tree={1: 63}))
    with pytest.raises(ValueError, match=r"speculative_config.draft_tree_without_amx=.*at most 62 nodes"):
        prepare_build(_spec_config(tmp_path, tiny_dirs, draft_tree_without_amx={1: 63}))
    prepare_build(_spec_config(tmp_path, tiny_dirs, draft_tree={1: block + 4}))  # more nodes than a block: room kept
    with pytest.raises(ValueError, match=rf"acceptance_by_draft_len has K=\[{block}\], past what this drafter drafts"):
        prepare_build(_spec_config(tmp_path, tiny_dirs, acceptance_by_draft_len={2: 1.5, block: 2.0}))


def test_a_drafters_draft_vocabulary_travels_into_the_engine_and_is_used(tiny_dirs, tmp_path):
    drafter = tmp_path / "drafter"
    shutil.copytree(tiny_dirs["qwen3_drafter"], drafter)
    save_draft_vocab(drafter, torch.tensor([7, 3, 50]), torch.tensor([5, 4, 1]))
    engine = build_engine(write_config(tmp_path, tiny_dirs["qwen3"], drafter), tmp_path / "engine", progress=False)
    assert "drafter/draft_vocab.json" in EngineDir(engine).manifest["files"]
    assert EngineDir(engine).plan["performance"]["draft_vocab_size"] == 3  # the CPU plan prices a 3-row draft head
    assert open_engine(engine).runner.proposer.draft_vocab.tolist() == [7, 3, 50]
    assert open_engine(engine, draft_vocab_size=0).runner.proposer.draft_vocab is None


def _vocab_config(tmp_path: Path, tiny_dirs, drafter: Path, size: int) -> Path:
    raw = yaml.safe_load(write_config(tmp_path, tiny_dirs["qwen3"], drafter).read_text())
    raw["speculative_config"]["draft_vocab_size"] = size
    path = tmp_path / "vocab.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_the_build_config_cuts_the_draft_vocabulary_for_the_torch_runtime_only(tiny_dirs, tmp_path):
    drafter = tmp_path / "drafter"
    shutil.copytree(tiny_dirs["qwen3_drafter"], drafter)
    save_draft_vocab(drafter, torch.tensor([7, 3, 50]), torch.tensor([5, 4, 1]))
    engine = build_engine(_vocab_config(tmp_path, tiny_dirs, drafter, 2), tmp_path / "engine", progress=False)
    assert EngineDir(engine).plan["performance"]["draft_vocab_size"] == 2
    assert open_engine(engine).runner.proposer.draft_vocab.tolist() == [7, 3]  # the two most frequent
    assert open_engine(engine, draft_vocab_size=3).runner.proposer.draft_vocab.tolist() == [7, 3, 50]
    options = yaml.safe_load((engine / "trtllm/config.yaml").read_text())
    assert "draft_vocab_size" not in options["speculative_config"]  # not a TensorRT-LLM key
    whole = build_engine(_vocab_config(tmp_path, tiny_dirs, drafter, 0), tmp_path / "whole", progress=False)
    assert EngineDir(whole).plan["performance"]["draft_vocab_size"] is None
    assert open_engine(whole).runner.proposer.draft_vocab is None


def test_a_draft_vocabulary_size_the_drafter_cannot_serve_fails_the_build_naming_the_key(tiny_dirs, tmp_path):
    drafter = tmp_path / "drafter"
    shutil.copytree(tiny_dirs["qwen3_drafter"], drafter)
    with pytest.raises(ValueError, match="speculative_config.draft_vocab_size=2 needs a drafter that ships"):
        prepare_build(_vocab_config(tmp_path, tiny_dirs, drafter, 2))
    save_draft_vocab(drafter, torch.tensor([7, 3, 50]), torch.tensor([5, 4, 1]))
    with pytest.raises(ValueError, match="speculative_config.draft_vocab_size=4 exceeds the 3 tokens"):
        prepare_build(_vocab_config(tmp_path, tiny_dirs, drafter, 4))


def test_force_replaces_only_an_engine_never_another_directory(tiny_dirs, tmp_path):
    cfg = write_config(tmp_path, tiny_dirs["llama"], None)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "keep.txt").write_text("mine")
    checkpoint = tmp_path / "checkpoint"  # -o naming the very target the build reads
    shutil.copytree(tiny_dirs["llama"], checkpoint)
    for victim, config in ((notes, cfg), (checkpoint, write_config(tmp_path, checkpoint, None))):
        before = sorted(p.name for p in victim.iterdir())
        with pytest.raises(FileExistsError, match=f"{victim} exists and is not an engine directory"):
            build_engine(config, victim, force=True, progress=False)
        assert sorted(p.name for p in victim.iterdir()) == before
    assert (notes / "keep.txt").read_text() == "mine"
    webext = tmp_path / "webext"  # a manifest.json of another kind
    webext.mkdir()
    (webext / "manifest.json").write_text('{"manifest_version": 3}')
    (webext / "background.js").write_text("mine")
    with pytest.raises(FileExistsError, match="manifest.json: not a dflash-trt engine's manifest"):
        build_engine(cfg, webext, force=True, progress=False)
    engine = build_engine(cfg, tmp_path / "engine", progress=False)
    (engine / "target" / "notes.txt").write_text("mine")  # a file of the user's inside an engine
    with pytest.raises(FileExistsError, match="holds 1 file.* does not list, e.g. target/notes.txt"):
        build_engine(cfg, engine, force=True, progress=False)
    assert (webext / "background.js").read_text() == "mine" and (engine / "target" / "notes.txt").read_text() == "mine"
    (engine / "target" / "notes.txt").unlink()
    (engine / ".DS_Store").write_bytes(b"\0")  # a Mac's metadata: an engine copied from one is still one to replace
    (engine / "target" / "._model.safetensors").write_bytes(b"\0")
    (engine / "target" / "model.safetensors").write_bytes(b"damaged")  # a damaged engine is still one to replace
    EngineDir(build_engine(cfg, engine, force=True, progress=False)).verify()
    empty = tmp_path / "empty"
    empty.mkdir()  # nothing to lose: no --force needed
    EngineDir(build_engine(cfg, empty, progress=False)).verify()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_build_directory_whose_lock_is_held_or_absent_is_left_alone_whatever_its_pid(tiny_dirs, tmp_path):
    # Another container's build has PIDs of its own namespace: its directory's PID may be dead here. Its lock is what
    # says it is live; a directory with no lock beside it is not provably a build's at all.
    import fcntl

    cfg = write_config(tmp_path, tiny_dirs["llama"], None)
    engines = tmp_path / "engines"
    live, foreign = engines / f".g.build-{_dead_pid()}-0000abcd", engines / ".website.build-2024-backup"
    for d in (live, foreign):
        d.mkdir(parents=True)
        (d / "keep").write_text("mine")
    fd = os.open(engines / (live.name + ".lock"), os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as the other build holds it
        build_engine(cfg, engines / "e", progress=False)
        assert (live / "keep").is_file() and (foreign / "keep").is_file()
    finally:
        os.close(fd)
    build_engine(cfg, engines / "e", force=True, progress=False)  # its build is gone: its lock is free
    assert sorted(p.name for p in engines.iterdir()) == [foreign.name, "e"]


@pytest.mark.parametrize("left_lock", [True, False])  # a killed build's free lock; a build from before locks
def test_a_force_build_killed_between_its_renames_loses_neither_engine(tiny_dirs, tmp_path, left_lock):
    cfg = write_config(tmp_path, tiny_dirs["llama"], None)
    out = build_engine(cfg, tmp_path / "e", progress=False)
    # SIGKILL after the previous engine was set aside and before the new one took its place
    aside = tmp_path / f".e.old-{_dead_pid()}-0000abcd"
    out.rename(aside)
    if left_lock:
        (tmp_path / (aside.name + ".lock")).touch()
    with pytest.raises(FileExistsError, match="--force"):
        build_engine(cfg, out, progress=False)
    EngineDir(out).verify()  # the previous engine is back, whole
    assert not aside.exists()
    # SIGKILL while the previous engine was being deleted, after the swap: the remains go
    shutil.copytree(out, aside)
    build_engine(cfg, out, force=True, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".e.")) == []  # locks too


def test_a_lock_left_without_its_directory_goes_and_a_held_one_stays(tiny_dirs, tmp_path):
    import fcntl

    cfg = write_config(tmp_path, tiny_dirs["llama"], None)
    engines = tmp_path / "engines"
    engines.mkdir()
    free, held = engines / ".a.build-1-0000abcd.lock", engines / ".b.build-2-0000abcd.lock"
    free.touch()
    fd = os.open(held, os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a build that has its lock and is about to make its directory
        build_engine(cfg, engines / "e", progress=False)
        assert sorted(p.name for p in engines.iterdir()) == [held.name, "e"]
    finally:
        os.close(fd)


def test_hidden_safetensors_files_a_copy_left_are_neither_read_nor_built_in(tiny_dirs, tmp_path):
    # macOS copies leave `._NAME` beside every file: the loaders read them as shards, while the engine's checksums
    # (which skip hidden files) passed them
    drafter = tmp_path / "drafter"
    shutil.copytree(tiny_dirs["qwen3_drafter"], drafter)
    (drafter / "._model.safetensors").write_bytes(os.urandom(4096))
    out = build_engine(write_config(tmp_path, tiny_dirs["qwen3"], drafter), tmp_path / "e", progress=False)
    assert not any("._" in f for f in EngineDir(out).manifest["files"])
    (out / "drafter" / "._model.safetensors").write_bytes(os.urandom(4096))
    EngineDir(out).verify()
    assert open_engine(out).drafter is not None


def test_drafter_weights_under_any_file_name_travel_into_the_engine(tiny_dirs, tmp_path):
    drafter = tmp_path / "drafter"
    shutil.copytree(tiny_dirs["qwen3_drafter"], drafter)
    (drafter / "model.safetensors").rename(drafter / "dflash-drafter.safetensors")  # what the loader globs for
    out = build_engine(write_config(tmp_path, tiny_dirs["qwen3"], drafter), tmp_path / "e", progress=False)
    assert "drafter/dflash-drafter.safetensors" in EngineDir(out).manifest["files"]
    assert open_engine(out).drafter is not None


def _sharded(tmp_path: Path, source: Path) -> Path:
    from safetensors.torch import load_file, save_file

    t = tmp_path / "sharded"
    shutil.copytree(source, t)
    tensors = load_file(t / "model.safetensors")
    (t / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {n: f"model-0000{1 + i * 2 // len(names)}-of-00002.safetensors" for i, n in enumerate(names)}
    for shard in set(shards.values()):
        save_file({n: tensors[n] for n, s in shards.items() if s == shard}, t / shard)
    (t / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    return t


def test_a_sharded_checkpoints_index_decides_and_its_problems_are_named(tiny_dirs, tmp_path):
    from safetensors.torch import save_file

    t = _sharded(tmp_path, tiny_dirs["qwen3"])
    save_file({"x": torch.zeros(1)}, t / "consolidated.safetensors")  # not in the index: no loader reads it
    out = build_engine(write_config(tmp_path, t, None), tmp_path / "e", progress=False)
    assert sorted(f for f in EngineDir(out).manifest["files"] if f.endswith(".safetensors")) == \
        ["target/model-00001-of-00002.safetensors", "target/model-00002-of-00002.safetensors"]
    index = t / "model.safetensors.index.json"
    good = index.read_text()
    for text, words in (("{", "not a safetensors index (JSONDecodeError"), ("{}", "not a safetensors index (KeyError")):
        index.write_text(text)
        with pytest.raises(ValueError, match=rf"{index}: {re.escape(words)}"):
            build_engine(write_config(tmp_path, t, None), tmp_path / "e2", progress=False)
    index.write_text(good)
    (t / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match=rf"model-00002-of-00002.safetensors: named in {index} but missing"):
        build_engine(write_config(tmp_path, t, None), tmp_path / "e2", progress=False)
    r = CliRunner().invoke(main, ["build", str(write_config(tmp_path, t, None)), "-o", str(tmp_path / "e2")])
    assert r.exit_code == 1 and "named in" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "e2").exists()


def test_a_gpu_build_refuses_a_truncated_target_checkpoint(tiny_dirs, tmp_path):
    # The torch-runtime tensor check only runs for CPU builds; a GPU build still must not bless a cut-short file.
    t = tmp_path / "target"
    shutil.copytree(tiny_dirs["qwen3"], t)
    data = (t / "model.safetensors").read_bytes()
    (t / "model.safetensors").write_bytes(data[:-5000])
    cfg = write_config(tmp_path, t, tiny_dirs["qwen3_drafter"], hardware="h200", dtype="bfloat16")
    with pytest.raises(ValueError, match=f"{t / 'model.safetensors'}: .*truncated"):
        build_engine(cfg, tmp_path / "out" / "e", progress=False)
    assert not (tmp_path / "out").exists()


def _transposed(name: str):
    def edit(tensors: dict) -> None:
        tensors[name] = tensors[name].T.contiguous()
    return edit


@pytest.mark.parametrize("edit, words", [
    (lambda tensors: tensors.pop("model.layers.1.mlp.up_proj.weight"), "missing tensor 'model.layers.1.mlp.up_proj"),
    (_transposed("model.layers.3.mlp.down_proj.weight"),
     r"'model.layers.3.mlp.down_proj.weight' has shape \(128, 64\)"),
    (lambda tensors: tensors.update({"model.layers.9.mlp.up_proj.weight": torch.zeros(1)}),
     "the weights hold layer index 9"),
])
def test_a_gpu_build_checks_the_targets_tensors_from_their_headers_before_writing(tiny_dirs, tmp_path, edit, words):
    """The GPU target is not read (hundreds of GB), but what its headers say must be what config.json implies."""
    t = _broken_target(tmp_path, tiny_dirs, edit)
    cfg = write_config(tmp_path, t, tiny_dirs["qwen3_drafter"], hardware="h200", dtype="bfloat16")
    with pytest.raises(ValueError, match=words):
        build_engine(cfg, tmp_path / "out" / "e", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_that_does_not_load_or_does_not_fit_fails_the_build_naming_the_target(tiny_dirs, tmp_path):
    t = tmp_path / "target"
    shutil.copytree(tiny_dirs["qwen3"], t)
    good = (t / "tokenizer.json").read_text()
    (t / "tokenizer.json").write_text(good[: len(good) // 2])  # cut short
    cfg = write_config(tmp_path, t, None, hardware="h200", dtype="bfloat16")
    with pytest.raises(ValueError, match=f"{t}: the tokenizer does not load"):
        build_engine(cfg, tmp_path / "out" / "e", progress=False)
    generate = ["generate", "--target", str(t), "--no-spec", "-p", "hi", "--max-new-tokens", "2"]
    r = CliRunner().invoke(main, generate)  # a directory no build checked
    assert r.exit_code == 1 and f"{t}: the tokenizer does not load" in " ".join(r.output.split()), r.output
    (t / "tokenizer.json").write_text(good)
    from transformers import AutoTokenizer

    grown = AutoTokenizer.from_pretrained(t)
    grown.add_tokens(["<a>", "<b>", "<c>", "<d>"])  # 100 tokens for 96 embedding rows
    grown.save_pretrained(t)
    with pytest.raises(ValueError, match=f"{t}: the tokenizer has 100 tokens but config.json's vocab_size is 96"):
        build_engine(cfg, tmp_path / "out" / "e", progress=False)
    assert list((tmp_path / "out").iterdir()) == []
    r = CliRunner().invoke(main, generate)
    assert r.exit_code == 1 and "the tokenizer has 100 tokens" in r.output, r.output
    # another model's, much smaller: it built, and generate wrote that tokenizer's words for this model's ids
    save_char_tokenizer(t, 40)
    with pytest.raises(ValueError, match=f"{t}: the tokenizer has 40 tokens, under half of config.json's vocab_size"):
        build_engine(cfg, tmp_path / "out" / "e", progress=False)


def test_a_manifest_edited_or_a_file_added_after_the_build_is_refused_naming_it(tiny_engine, tmp_path):
    from safetensors.torch import save_file

    bad = tmp_path / "bad"
    shutil.copytree(tiny_engine, bad)
    extra = bad / "target" / "zz-extra.safetensors"  # the loader globs *.safetensors: it would override norms
    save_file({"model.norm.weight": torch.zeros(64)}, extra)
    with pytest.raises(ValueError, match=f"{extra}: not listed in manifest.json"):
        open_engine(bad)
    r = CliRunner().invoke(main, ["generate", str(bad), "-p", "x", "--backend", "torch"])
    assert r.exit_code == 1 and "zz-extra.safetensors: not listed in manifest.json" in r.output
    extra.unlink()
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["build_config"]["max_seq_len"] = 100_000  # what the runtime would then allow
    (bad / "manifest.json").write_text(json.dumps(manifest, indent=4))
    with pytest.raises(ValueError, match=f"{bad / 'manifest.json'}: its content does not match"):
        open_engine(bad)
    manifest["build_config"]["max_seq_len"] = 256
    (bad / "manifest.json").write_text(json.dumps(manifest))  # reformatted only: still the same engine
    EngineDir(bad).verify()
    del manifest["manifest_sha256"]  # an engine built before the manifest carried its own checksum
    (bad / "manifest.json").write_text(json.dumps(manifest))
    EngineDir(bad).verify()


def test_copy_progress_counts_the_drafter_and_the_target_weights(tiny_dirs, tmp_path, monkeypatch):
    import dflash_trt.build as build

    bars = {}

    class Bar:
        def __init__(self, total, desc, enabled):
            self.total, self.done = total, 0
            bars[desc] = self

        def update(self, n):
            self.done += n

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(build, "_progress", Bar)
    build_engine(write_config(tmp_path, tiny_dirs["qwen3"], tiny_dirs["qwen3_drafter"]), tmp_path / "e")
    weights = sum(f.stat().st_size for d in ("qwen3", "qwen3_drafter") for f in tiny_dirs[d].glob("*.safetensors"))
    copies = [b for desc, b in bars.items() if desc != "sha256"]
    assert [(b.total, b.done) for b in copies] == [(weights, weights)]


def test_converting_the_embedded_gguf_says_so_before_its_silent_part(tmp_path, monkeypatch, capsys):
    import transformers

    from dflash_trt.convert import convert_gguf

    def stop(*a, **k):
        raise RuntimeError("stop here")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", stop)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(RuntimeError, match="stop here"):
        convert_gguf(gguf, tmp_path / "out")
    assert f"converting {gguf} into {tmp_path / 'out'}" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_a_cut_short_gguf_is_named_and_a_killed_conversions_leftovers_are_cleared(tmp_path):
    from dflash_trt.convert import convert_gguf
    from dflash_trt.embedded import smollm2_gguf

    left = tmp_path / ".out.convert-4242-0123abcd"  # a conversion killed midway: its directory and free lock
    (left / "half").mkdir(parents=True)
    (tmp_path / (left.name + ".lock")).touch()
    gguf = tmp_path / "m.gguf"
    with open(smollm2_gguf(), "rb") as f:
        gguf.write_bytes(f.read(2 << 20))
    with pytest.raises(ValueError, match=f"{gguf}: not a GGUF checkpoint transformers reads .*truncated or corrupt"):
        convert_gguf(gguf, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_inspect_counts_layers_in_words_and_names_each_version_once(tiny_engine):
    out = CliRunner().invoke(main, ["inspect", str(tiny_engine)]).output
    assert "(1 layer, block 16" in out and "4 layers" in out
    assert "tensorrt_llm_target" not in out and out.count("1.3.0rc20") == 1, out


def test_a_system_error_while_writing_is_a_message_naming_the_engine_and_leaves_nothing(tiny_dirs, tmp_path,
                                                                                        monkeypatch):
    import dflash_trt.build as build

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(build, "_copy", full)
    out = tmp_path / "engines" / "e"
    r = CliRunner().invoke(main, ["build", str(write_config(tmp_path, tiny_dirs["qwen3"], None)), "-o", str(out)])
    assert r.exit_code == 1 and f"No space left on device (building {out})" in r.output, r.output
    assert list(out.parent.iterdir()) == []
    r = CliRunner().invoke(main, ["build", str(write_config(tmp_path, tiny_dirs["qwen3"], None)), "-o", "/proc/e"])
    assert r.exit_code == 1 and "/proc/" in r.output and "Traceback" not in r.output, r.output


def test_linked_target_weights_are_shown_and_never_point_into_the_engine_being_replaced(tiny_dirs, tmp_path):
    out = build_engine(write_config(tmp_path, tiny_dirs["qwen3"], None), tmp_path / "e", progress=False)
    assert "target weights       copied" in CliRunner().invoke(main, ["inspect", str(out)]).output
    for f in tiny_dirs["qwen3"].glob("tokenizer*"):
        shutil.copy(f, out / "target")  # the engine's own target/ as a checkpoint
    cfg = write_config(tmp_path, out / "target", None, target_weights="link")
    # the tokenizer files the engine does not list keep --force from replacing it: links into it would break
    with pytest.raises(FileExistsError, match=f"{out} exists and is not an engine directory .it holds 2 file"):
        build_engine(cfg, out, force=True, progress=False)
    linked = build_engine(cfg, tmp_path / "linked", progress=False)
    assert f"symlinks to {out / 'target'} (the engine breaks if those files move)" in \
        CliRunner().invoke(main, ["inspect", str(linked)]).output
    (out / "target" / "model.safetensors").rename(tmp_path / "moved.safetensors")
    r = CliRunner().invoke(main, ["inspect", str(linked)])
    assert r.exit_code == 1 and f"a link to {out / 'target' / 'model.safetensors'}, which no longer exists" in r.output


@pytest.mark.parametrize("which, edit, words", [
    ("drafter", {"hidden_size": [64]}, "'hidden_size' must be a whole number, got [64]"),
    ("drafter", {"hidden_size": "abc"}, "'hidden_size' must be a whole number, got 'abc'"),
    ("drafter", {"hidden_size": 64.5}, "'hidden_size' must be a whole number, got 64.5"),
    ("drafter", {"target_layer_ids": 5}, "'target_layer_ids' must be a list of whole numbers, got 5"),
    ("drafter", {"target_layer_ids": [1.7, 2]}, "'target_layer_ids[0]' must be a whole number, got 1.7"),
    ("drafter", {"dflash_config": [1, 2]}, "'dflash_config' must be an object of keys"),
    ("drafter", {"layer_types": ["full_attention"] * 3}, "'layer_types' must list one type per layer (1)"),
    ("drafter", {"rms_norm_eps": "abc"}, "'rms_norm_eps' must be a number, got 'abc'"),
    ("drafter", {"num_key_value_heads": 0}, "'num_key_value_heads' must be >= 1, got 0"),  # read as missing once
    ("drafter", {"head_dim": 0}, "'head_dim' must be >= 1, got 0"),
    ("target", {"num_attention_heads": 0, "head_dim": None}, "'num_attention_heads' must be >= 1, got 0"),
    ("target", {"intermediate_size": [128]}, "'intermediate_size' must be a whole number, got [128]"),
    ("target", {"num_hidden_layers": True}, "'num_hidden_layers' must be a whole number, got True"),
    # out of range: each built an engine whose activations were all NaN (it answered token 0, as text nothing)
    ("target", {"rms_norm_eps": -1}, "'rms_norm_eps' must be a finite number above 0, got -1"),
    ("drafter", {"rms_norm_eps": 0}, "'rms_norm_eps' must be a finite number above 0, got 0"),
    ("target", {"rope_parameters": {"rope_type": "default", "rope_theta": 0}},
     "'rope_theta' must be a finite number above 0, got 0"),
    # what a scaled rope divides by (a KeyError's traceback)
    ("target", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}},
     "rope_type 'linear' needs rope_parameters.factor"),
    ("drafter", {"rope_parameters": None,
                 "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192}},
     "rope_type 'llama3' needs rope_scaling.low_freq_factor"),
    ("target", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 4.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 256}},
     "rope_parameters.low_freq_factor and high_freq_factor must differ (both 4.0)"),
    # refused as the model was built, naming no file, after a warning that the drafter's rope differs
    ("target", {"rope_parameters": {"rope_type": "bogus", "rope_theta": 1e4}},
     "rope_type='bogus' is not supported by this project's runtime"),
    # keys the planner reads raw (each a traceback from plan.py or perf_model.py)
    ("target", {"dtype": ["bfloat16"]}, "'dtype' must be a dtype's name, got ['bfloat16']"),
    ("target", {"quantization_config": "fp8"}, "'quantization_config' must be an object, got 'fp8'"),
    ("target", {"layer_types": 5}, "'layer_types' must be a list of layer type names, got 5"),
    ("target", {"sliding_window": "abc"}, "'sliding_window' must be a whole number, got 'abc'"),
    ("target", {"num_local_experts": "8"}, "'num_local_experts' must be a whole number, got '8'"),
])
def test_a_config_value_of_the_wrong_type_fails_naming_its_file_and_key(tiny_dirs, tmp_path, which, edit, words):
    dirs = {}
    for name in ("target", "drafter"):
        dirs[name] = tmp_path / name
        shutil.copytree(tiny_dirs["qwen3" if name == "target" else "qwen3_drafter"], dirs[name])
    path = dirs[which] / "config.json"
    config = json.loads(path.read_text())
    if "target_layer_ids" in edit and "dflash_config" in config:
        config["dflash_config"].pop("target_layer_ids", None)
    path.write_text(json.dumps({**config, **edit}))
    with pytest.raises(ValueError, match=re.escape(words)) as e:
        build_engine(write_config(tmp_path, dirs["target"], dirs["drafter"]), tmp_path / "out" / "e", progress=False)
    assert str(path) in str(e.value) or str(dirs[which]) in str(e.value)
    r = CliRunner().invoke(main, ["generate", "--target", str(dirs["target"]), "--drafter", str(dirs["drafter"]),
                                  "-p", "hi"])
    assert r.exit_code != 0 and words in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("content", [b"[1, 2]", b'{"hidden_size": "\xff"}'])
def test_a_config_json_that_is_not_an_object_or_not_utf8_fails_naming_it(tiny_dirs, tmp_path, content):
    d = tmp_path / "drafter"
    shutil.copytree(tiny_dirs["qwen3_drafter"], d)
    (d / "config.json").write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(str(d / "config.json"))):
        build_engine(write_config(tmp_path, tiny_dirs["qwen3"], d), tmp_path / "out" / "e", progress=False)


@pytest.mark.parametrize("inside", ["sub", "target/sub"])
def test_an_output_inside_an_engine_is_refused_and_leaves_it_whole(tiny_dirs, tmp_path, inside):
    """Built there, the engine above gained files its manifest does not list: in target/, generate and inspect
    --verify refused it; anywhere, --force would no longer replace it."""
    config = write_config(tmp_path, tiny_dirs["qwen3"], tiny_dirs["qwen3_drafter"])
    engine = tmp_path / "engine"
    build_engine(config, engine, progress=False)
    with pytest.raises(FileExistsError, match=re.escape(f"is inside the engine {engine}")):
        build_engine(config, engine / inside, progress=False)
    assert not (engine / inside).exists()
    r = CliRunner().invoke(main, ["inspect", "--verify", str(engine)])
    assert r.exit_code == 0, r.output


def test_a_draft_vocabulary_that_is_not_utf8_fails_naming_it(tiny_dirs, tmp_path):
    d = tmp_path / "drafter"
    shutil.copytree(tiny_dirs["qwen3_drafter"], d)
    (d / "draft_vocab.json").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match=re.escape(f"{d / 'draft_vocab.json'}: not valid JSON")):
        build_engine(write_config(tmp_path, tiny_dirs["qwen3"], d), tmp_path / "out" / "e", progress=False)


def test_an_output_that_is_a_mount_point_is_refused_before_anything_is_copied(tiny_dirs, tmp_path, monkeypatch):
    out = tmp_path / "mnt"
    out.mkdir()
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == out or real(p))
    with pytest.raises(FileExistsError, match="is a mount point"):
        build_engine(write_config(tmp_path, tiny_dirs["llama"], None), out, progress=False)
    assert list(out.iterdir()) == [] and not list(tmp_path.glob(".mnt.*"))


def test_a_file_system_without_locks_builds_with_a_warning(tiny_dirs, tmp_path, monkeypatch, caplog):
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING, logger="dflash_trt"):
        out = build_engine(write_config(tmp_path, tiny_dirs["llama"], None), tmp_path / "e", progress=False)
    EngineDir(out).verify()
    assert any("no lock on this file system" in r.getMessage() for r in caplog.records)


def test_plan_only_shows_the_tensorrt_llm_options_and_the_keys_the_pinned_release_refuses():
    cfg = REPO / "build_configs" / "gpt-oss-120b-8xb300-latency.yaml"
    r = CliRunner().invoke(main, ["build", str(cfg), "--plan-only"])
    assert r.exit_code == 0, r.output
    assert "TensorRT-LLM options (trtllm/config.yaml, for TensorRT-LLM 1.3.0rc20)" in r.output
    assert "attention_backend: TRTLLM" in r.output
    assert "Needs TensorRT-LLM 1.3.0rc25 or later: 1.3.0rc20 refuses speculative_config.attention_backend" in r.output
    r = CliRunner().invoke(main, ["build", str(cfg), "--plan-only", "--json"])
    options = json.loads(r.stdout)["trtllm_options"]
    assert options["speculative_config"]["decoding_type"] == "DFlash" and options["tensor_parallel_size"] == 8


@pytest.mark.parametrize("amx", [True, False])
def test_the_plan_shows_both_cpu_schedules_and_marks_the_one_this_cpu_runs(monkeypatch, amx):
    from dflash_trt import hardware

    cfg = REPO / "build_configs" / "smollm2-135m-cpu.yaml"
    spec = yaml.safe_load(cfg.read_text())["speculative_config"]
    with_amx = str(spec["draft_len_schedule"]).replace("'", "")
    without = str(spec["draft_len_schedule_without_amx"]).replace("'", "")
    monkeypatch.setattr(hardware, "has_amx_tiles", lambda: amx)
    r = CliRunner().invoke(main, ["build", str(cfg), "--plan-only"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    main_row = next(line for line in lines if line.strip().startswith("draft_len_schedule"))
    amx_row = next(line for line in lines if "without AMX tiles" in line)
    assert with_amx in main_row and without in amx_row
    assert ("(this CPU: AMX tiles)" in main_row) == amx and ("(this CPU)" in amx_row) == (not amx)
    planned = json.loads(CliRunner().invoke(main, ["build", str(cfg), "--plan-only", "--json"]).stdout)
    assert {int(b): k for b, k in planned["draft_len_schedule_without_amx"].items()} == \
        spec["draft_len_schedule_without_amx"]


@pytest.mark.parametrize("stored, asked, runs", [("float16", "auto", "bfloat16"), ("float32", "auto", "bfloat16"),
                                                 ("float16", "float16", "float16"), ("bfloat16", "auto", "bfloat16")])
def test_a_cpu_engine_of_a_float16_or_float32_checkpoint_runs_bfloat16_unless_asked_and_says_so(
        tiny_dirs, tmp_path, stored, asked, runs):
    """The CPU kernels take bfloat16: a float16 checkpoint built a float16 engine that ran through torch at about a
    sixth of the speed, without a word."""
    t = tmp_path / "target"
    shutil.copytree(tiny_dirs["qwen3"], t)
    config = json.loads((t / "config.json").read_text())
    config.pop("torch_dtype", None)
    (t / "config.json").write_text(json.dumps({**config, "dtype": stored}))
    r = CliRunner().invoke(main, ["build", str(write_config(tmp_path, t, tiny_dirs["qwen3_drafter"], dtype=asked)),
                                  "-o", str(tmp_path / "e")])
    assert r.exit_code == 0, r.output
    plan = json.loads((tmp_path / "e" / "plan.json").read_text())
    assert plan["dtype"] == runs and open_engine(tmp_path / "e").config.dtype == runs
    said = f"the target is stored in {stored}: this CPU engine runs bfloat16"
    assert (said in " ".join(r.output.split())) == (stored != runs), r.output


@pytest.mark.parametrize("edit", [
    lambda m: m.update(build_settings=m.pop("build_config")),  # a key renamed
    lambda m: m.update(files={f"weights/{rel}": e for rel, e in m["files"].items()}),  # files laid out otherwise
    lambda m: m.update(files=list(m["files"])),
])
def test_an_engine_of_a_newer_format_says_to_upgrade_not_which_key_or_file_it_lacks(tiny_engine, tmp_path, edit):
    """A newer dflash-trt's engine may name its keys and files otherwise: the missing key or file was named (and a
    rebuild advised) where the format is what differs."""
    def newer(m):
        edit(m)
        m["format_version"] += 1

    bad = _edited(tiny_engine, tmp_path, "manifest.json", newer)
    for args in (["generate", str(bad), "-p", "hi"], ["inspect", str(bad)]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 1, r.output
        assert "format_version=2, this dflash-trt reads 1; upgrade dflash-trt" in r.output, r.output


def test_a_qwen3_moe_engine_builds_and_generates_transformers_greedy(tmp_path):
    """A Qwen3-MoE target (tiny, random; an expert layer's tensors each expert's own) with a DFlash drafter: the
    engine's greedy tokens are transformers' own; a checkpoint missing an expert fails the build, naming it, before
    anything is written."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.models.test_qwen3_moe import make_qwen3_moe

    target = make_qwen3_moe(tmp_path / "t")
    drafter = make_drafter(tmp_path / "d", target, layers=1, block_size=8, target_layer_ids=(0, 2, 3))
    engine = build_engine(write_config(tmp_path, target, drafter, max_seq_len=128), tmp_path / "engines" / "moe",
                          progress=False)
    got = _gen(str(engine))
    ids = torch.tensor([AutoTokenizer.from_pretrained(target)("hello")["input_ids"]])
    want = AutoModelForCausalLM.from_pretrained(target).generate(ids, max_new_tokens=24, do_sample=False,
                                                                 pad_token_id=0, eos_token_id=None)
    assert got["token_ids"] == want[0, ids.shape[1]:].tolist() and got["tau"] >= 1.0
    tensors = load_file(target / "model.safetensors")
    del tensors["model.layers.3.mlp.experts.6.down_proj.weight"]
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.3\.mlp\.experts\.6\.down_proj\.weight'"):
        build_engine(write_config(tmp_path, target, drafter, max_seq_len=128), tmp_path / "out" / "e", progress=False)
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []
