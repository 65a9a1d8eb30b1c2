"""trtllm/config.yaml against the pinned TensorRT-LLM version's accepted LLM-API keys, and the lazy backend."""

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_trt.build import prepare_build
from dflash_trt.trtllm import launch
from dflash_trt.trtllm.llm_api_keys import ALLOWED_VALUES, NESTED_KEYS, TOP_LEVEL_KEYS

CONFIGS = Path(__file__).resolve().parents[2] / "build_configs"
PLANNABLE_HERE = ["gpt-oss-120b-8xb300-latency", "gpt-oss-120b-8xb300-throughput", "qwen3-8b-1xh200"]


def _walk(options: dict):
    """(dotted key, value) for every key written, two levels deep (the depth of LLM-API sections)."""
    for key, value in options.items():
        yield key, value
        if key in NESTED_KEYS:
            for sub, v in value.items():
                yield f"{key}.{sub}", v


@pytest.mark.parametrize("name", PLANNABLE_HERE)
def test_every_key_written_is_accepted_by_the_pinned_version(name):
    options = prepare_build(CONFIGS / f"{name}.yaml", allow_bundled=True).trtllm_options
    for dotted, value in _walk(options):
        section, _, sub = dotted.partition(".")
        assert section in TOP_LEVEL_KEYS, dotted
        if sub:
            assert sub in NESTED_KEYS[section], dotted
        if dotted in ALLOWED_VALUES:
            assert value in ALLOWED_VALUES[dotted], (dotted, value)
    # What the engine needs pinned is pinned.
    assert options["max_seq_len"] and options["max_batch_size"]
    assert options["speculative_config"]["decoding_type"] == "DFlash"
    assert options["speculative_config"]["speculative_model"] == "drafter"


def test_gpt_oss_latency_config_carries_the_recipe():
    o = prepare_build(CONFIGS / "gpt-oss-120b-8xb300-latency.yaml", allow_bundled=True).trtllm_options
    assert (o["tensor_parallel_size"], o["moe_expert_parallel_size"], o["moe_tensor_parallel_size"]) == (8, 8, 1)
    assert o["cuda_graph_config"] == {"enable_padding": True, "batch_sizes": [1, 2, 4, 8, 16]}
    assert o["kv_cache_config"]["dtype"] == "fp8" and o["moe_config"] == {"backend": "TRTLLM"}
    assert o["speculative_config"]["attention_backend"] == "TRTLLM" and o["speculative_config"]["max_draft_len"] == 9
    assert o["env_overrides"]["TRTLLM_ENABLE_PDL"] == "1"


def test_throughput_config_uses_attention_dp_and_a_draft_schedule():
    o = prepare_build(CONFIGS / "gpt-oss-120b-8xb300-throughput.yaml", allow_bundled=True).trtllm_options
    assert o["enable_attention_dp"] is True and o["attention_dp_config"]["enable_balance"] is True
    s = o["speculative_config"]["draft_len_schedule"]
    # TensorRT-LLM's rule: key 1 holds max_draft_len; thresholds are batch sizes with a captured graph
    assert s[1] == o["speculative_config"]["max_draft_len"]
    assert set(s) <= set(o["cuda_graph_config"]["batch_sizes"])
    assert list(s.values()) == sorted(s.values(), reverse=True)  # K falls as batches grow


@pytest.mark.parametrize("options, message", [
    ("max_tokens_in_paged_kv_cache: 100", "max_tokens_in_paged_kv_cache not accepted by the pinned TensorRT-LLM"),
    ("max_seq_len: 100", "trtllm_options.max_seq_len: set by the build config itself"),
    ("kv_cache_config:\n    tokens_per_block: 64", "trtllm_options.kv_cache_config.tokens_per_block: set by the build "
     "config itself; set the build-config key 'kv_cache_config.tokens_per_block'"),
    # one the build config models but left out (VANILLA is written as no key) is the build config's too, and checked
    # there (TRTLLM needs SM100/SM103)
    ("speculative_config:\n    attention_backend: TRTLLM",
     "set the build-config key 'speculative_config.attention_backend'"),
    ("kv_cache_config:\n    bogus: 1", "kv_cache_config.bogus not accepted by the pinned TensorRT-LLM"),
    # LLM(model=..., tokenizer=..., **options) would get them twice; trtllm-serve would serve another model
    ("model: /elsewhere", "trtllm_options.model: set by the launcher from the engine directory"),
    ("tokenizer: /elsewhere", "trtllm_options.tokenizer: set by the launcher from the engine directory"),
    ("guided_decoding_backend: outlines", "guided_decoding_backend='outlines' (accepted: ['llguidance', 'xgrammar'])"),
])
def test_a_passthrough_key_that_is_not_accepted_or_not_the_passthroughs_is_refused(tmp_path, options, message):
    path = tmp_path / "c.yaml"
    path.write_text((CONFIGS / "qwen3-8b-1xh200.yaml").read_text() + f"trtllm_options:\n  {options}\n")
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        prepare_build(path, allow_bundled=True)
    assert str(e.value).startswith(f"{path}: ")  # the file they are written in


def test_a_section_the_build_config_leaves_out_cannot_come_through_the_passthrough(tmp_path):
    # a drafter the plan never sized, on attention the H200 cannot run, would be written
    import yaml

    raw = yaml.safe_load((CONFIGS / "qwen3-8b-1xh200.yaml").read_text())
    del raw["speculative_config"]
    raw["trtllm_options"] = {"speculative_config": {"decoding_type": "DFlash", "speculative_model": "/x/drafter",
                                                    "max_draft_len": 15, "attention_backend": "TRTLLM"}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="set the build-config key 'speculative_config.attention_backend'"):
        prepare_build(path, allow_bundled=True)


def test_passthrough_keys_of_a_section_the_build_config_writes_join_that_section(tmp_path):
    # llm_api_keys accepts kv_cache_config.host_cache_size and the like, which no build-config key sets
    import yaml

    raw = yaml.safe_load((CONFIGS / "gpt-oss-120b-8xb300-latency.yaml").read_text())  # HF ids, no relative paths
    written = prepare_build(CONFIGS / "gpt-oss-120b-8xb300-latency.yaml", allow_bundled=True).trtllm_options
    raw["trtllm_options"] = {"kv_cache_config": {"host_cache_size": 10**9}, "moe_config": {"max_num_tokens": 8192}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    o = prepare_build(path, allow_bundled=True).trtllm_options
    assert o["kv_cache_config"] == {**written["kv_cache_config"], "host_cache_size": 10**9}
    assert o["moe_config"] == {**written["moe_config"], "max_num_tokens": 8192}


def test_a_guided_decoder_for_structured_output_comes_through_the_passthrough(tmp_path):
    """trtllm-serve enforces response_format and the guided_* fields only with a guided decoding backend."""
    path = tmp_path / "c.yaml"
    path.write_text((CONFIGS / "qwen3-8b-1xh200.yaml").read_text()
                    + "trtllm_options:\n  guided_decoding_backend: llguidance\n")
    assert prepare_build(path, allow_bundled=True).trtllm_options["guided_decoding_backend"] == "llguidance"


def test_llama_config_without_its_drafter_on_disk_says_how_to_fetch_it():
    with pytest.raises(FileNotFoundError, match="hf download z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"):
        prepare_build(CONFIGS / "llama3.1-8b-1xh200.yaml", allow_bundled=True)


@pytest.mark.skipif(launch.tensorrt_llm_available(), reason="tensorrt_llm is installed; this checks its absence")
def test_without_tensorrt_llm_the_backend_says_what_to_install(tiny_dirs, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="install TensorRT-LLM 1.3.0rc20 .* or use --backend torch"):
        launch.require_tensorrt_llm()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # an install would not help without a GPU
    with pytest.raises(RuntimeError, match="runs on NVIDIA GPUs and torch sees none here: use --backend torch"):
        launch.require_tensorrt_llm()
    # the B300 configs' keys need a later release than the pin: the advice names the one the engine needs
    options = prepare_build(CONFIGS / "gpt-oss-120b-8xb300-latency.yaml", allow_bundled=True).trtllm_options
    with pytest.raises(RuntimeError, match=r"TensorRT-LLM 1\.3\.0rc25 or later \(this engine's config needs it\)"):
        launch.require_tensorrt_llm(options)
    from tests.test_build import write_config
    from dflash_trt.build import build_engine
    from dflash_trt.cli import main

    config = write_config(tmp_path, tiny_dirs["qwen3"], None, hardware="h200", dtype="bfloat16")
    out = build_engine(config, tmp_path / "e", progress=False)
    r = CliRunner().invoke(main, ["generate", str(out), "-p", "x", "--backend", "trtllm"])
    assert r.exit_code == 1 and "tensorrt_llm is not importable" in r.output


@pytest.mark.trtllm
@pytest.mark.skipif(not launch.tensorrt_llm_available(), reason="needs tensorrt_llm (NVIDIA index or NGC container)")
def test_pinned_version_accepts_the_written_config():
    from tensorrt_llm.llmapi.llm_args import TorchLlmArgs

    options = prepare_build(CONFIGS / "qwen3-8b-1xh200.yaml", allow_bundled=True).trtllm_options
    TorchLlmArgs(model="Qwen/Qwen3-8B", **options)



def test_keys_the_pinned_release_refuses_are_named_and_a_pinned_install_is_refused_before_launch():
    # The B300 configs draft with TRTLLM-gen attention, a key that came after the pinned release (which forbids
    # unknown keys): the engine says which release it needs, and the launcher refuses the pinned one up front.
    from dflash_trt.trtllm.llm_api_keys import TENSORRT_LLM_VERSION, keys_missing_from

    b300 = prepare_build(CONFIGS / "gpt-oss-120b-8xb300-latency.yaml", allow_bundled=True).trtllm_options
    assert b300["speculative_config"]["attention_backend"] == "TRTLLM"
    (newer,) = keys_missing_from(b300)
    assert newer.startswith("speculative_config.attention_backend (") and "#16914" in newer
    h200 = prepare_build(CONFIGS / "qwen3-8b-1xh200.yaml", allow_bundled=True).trtllm_options
    assert keys_missing_from(h200) == []  # VANILLA: the key is left out
    # every release before the key's first is refused, compared as releases (rc9 before rc25), not as strings
    for before in (TENSORRT_LLM_VERSION, "1.3.0rc24", "1.3.0rc9", "1.2.1"):
        with pytest.raises(RuntimeError, match=rf"tensorrt_llm {before} refuses speculative_config.attention_backend "
                                               r"\(needs 1.3.0rc25 or later: .*#16914"):
            launch.check_release(b300, before)
    for later in ("1.3.0rc25", "1.3.0", "1.4.0rc1", "1.3.0rc25.post1"):
        launch.check_release(b300, later)
    launch.check_release(b300, "unknown")  # no release to compare (a source build): TensorRT-LLM's own check
    launch.check_release(h200, TENSORRT_LLM_VERSION)


def test_every_llm_api_launch_refuses_a_release_older_than_its_options_before_building(tmp_path):
    # generate --backend trtllm and the Triton model share new_llm: both refused rc21-rc24 only in TensorRT-LLM's own
    # validation (the Triton model did not check at all)
    import types

    import yaml

    (tmp_path / "drafter").mkdir()
    (tmp_path / "trtllm").mkdir()
    spec = {"decoding_type": "DFlash", "max_draft_len": 3, "speculative_model": "drafter",
            "attention_backend": "TRTLLM"}
    (tmp_path / "trtllm" / "config.yaml").write_text(yaml.safe_dump({"speculative_config": spec}))
    engine = types.SimpleNamespace(path=tmp_path, target_dir=tmp_path / "target", tokenizer_dir=tmp_path / "tokenizer")
    built = []

    def release(version):
        return types.SimpleNamespace(__version__=version, LLM=lambda **kw: built.append(kw) or "llm")

    with pytest.raises(RuntimeError, match=r"tensorrt_llm 1.3.0rc24 refuses speculative_config.attention_backend"):
        launch.new_llm(release("1.3.0rc24"), engine)
    assert built == []
    assert launch.new_llm(release("1.3.0rc25"), engine) == "llm"
    assert built[0]["speculative_config"]["speculative_model"] == str(tmp_path / "drafter")  # made absolute
    assert built[0]["model"] == str(tmp_path / "target")


def test_a_vanilla_drafter_without_flash_attn_is_refused_before_tensorrt_llm_loads_the_target(tmp_path, monkeypatch):
    # TensorRT-LLM's VANILLA DFlash attention imports flash_attn as it builds the drafter, after the target has loaded
    import types

    import yaml

    (tmp_path / "drafter").mkdir()
    (tmp_path / "trtllm").mkdir()
    engine = types.SimpleNamespace(path=tmp_path, target_dir=tmp_path / "target", tokenizer_dir=tmp_path / "tokenizer")
    release = types.SimpleNamespace(__version__="1.3.0rc25", LLM=lambda **kw: "llm")
    find_spec = launch.importlib.util.find_spec
    monkeypatch.setattr(launch.importlib.util, "find_spec",
                        lambda name: None if name == "flash_attn" else find_spec(name))
    for backend, refused in ((None, True), ("VANILLA", True), ("TRTLLM", False)):
        spec = {"decoding_type": "DFlash", "max_draft_len": 3, "speculative_model": "drafter",
                **({"attention_backend": backend} if backend else {})}
        (tmp_path / "trtllm" / "config.yaml").write_text(yaml.safe_dump({"speculative_config": spec}))
        if refused:
            with pytest.raises(RuntimeError, match="VANILLA backend, which needs flash-attn, not installed here"):
                launch.new_llm(release, engine)
        else:
            assert launch.new_llm(release, engine) == "llm"
    (tmp_path / "trtllm" / "config.yaml").write_text(yaml.safe_dump({"max_batch_size": 4}))  # autoregressive
    assert launch.new_llm(release, engine) == "llm"


def test_dflash_engines_turn_kv_block_reuse_off_unless_the_config_asks(tmp_path):
    # TensorRT-LLM's DFlash drafter keeps only the context it prefills itself: a prompt prefix from reused blocks would
    # be missing from it, at shifted positions
    import yaml

    source = CONFIGS / "qwen3-8b-1xh200.yaml"
    assert prepare_build(source, allow_bundled=True).trtllm_options["kv_cache_config"]["enable_block_reuse"] is False
    cfg = yaml.safe_load(source.read_text())
    cfg["kv_cache_config"]["enable_block_reuse"] = True
    asked = tmp_path / "reuse.yaml"
    asked.write_text(yaml.safe_dump(cfg))
    assert prepare_build(asked, allow_bundled=True).trtllm_options["kv_cache_config"]["enable_block_reuse"] is True
    cfg.pop("speculative_config")
    cfg["kv_cache_config"].pop("enable_block_reuse")
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump(cfg))
    assert "enable_block_reuse" not in prepare_build(plain, allow_bundled=True).trtllm_options["kv_cache_config"]


def test_a_schedule_of_several_k_under_attention_dp_is_noted_and_one_k_is_not(tmp_path):
    import yaml

    source = CONFIGS / "gpt-oss-120b-8xb300-throughput.yaml"
    notes = prepare_build(source, allow_bundled=True).plan.notes
    assert any("under attention data parallelism" in n and "#16888" in n for n in notes), notes
    cfg = yaml.safe_load(source.read_text())
    cfg["speculative_config"]["draft_len_schedule"] = {1: 7, 512: 7}
    one = tmp_path / "one_k.yaml"
    one.write_text(yaml.safe_dump(cfg))
    assert not any("attention data parallelism" in n for n in prepare_build(one, allow_bundled=True).plan.notes)


@pytest.mark.parametrize("version, warns", [("1.3.0rc25", False), ("1.3.0rc20", False), ("1.3.1", False),
                                            ("1.3.0rc19", True), ("1.2.0", True), ("source-build", True)])
def test_only_a_release_older_than_the_pin_is_warned_of(monkeypatch, caplog, version, warns):
    # The B300 configs need a release after the pin: installing it must not read as a mismatch.
    import sys
    import types

    monkeypatch.setitem(sys.modules, "tensorrt_llm", types.SimpleNamespace(__version__=version))
    with caplog.at_level("WARNING", logger=launch.logger.name):
        launch.require_tensorrt_llm()
    assert ("this engine's config targets" in caplog.text) == warns


@pytest.mark.parametrize("spec, words", [
    ({"draft_len_schedule": {1: 7, 64: 3}}, "draft_len_schedule={1: 7, 64: 3} drafts nothing at a batch of 65 "
     "(max_batch_size=512)"),
    ({"draft_len_schedule": {1: 7, 64: 0, 512: 2}}, "drafts nothing at a batch of 2"),
    ({"max_concurrency": 64}, "max_concurrency=64 drafts nothing above 64 requests"),
])
def test_a_gpu_build_that_would_draft_k0_somewhere_is_refused_by_key(tmp_path, spec, words):
    """TensorRT-LLM's DFlash stores no drafter context in a K=0 step, and acceptance collapses after it (PR #16888)."""
    import yaml

    cfg = yaml.safe_load((CONFIGS / "gpt-oss-120b-8xb300-throughput.yaml").read_text())
    del cfg["speculative_config"]["draft_len_schedule"]
    cfg["speculative_config"].update(max_draft_len=7, **spec)
    path = tmp_path / "b300.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ValueError, match="#16888") as e:
        prepare_build(path, allow_bundled=True)
    assert words in str(e.value) and str(path) in str(e.value)
    cfg["speculative_config"].pop("max_concurrency", None)
    cfg["speculative_config"]["draft_len_schedule"] = {1: 7, 64: 3, 512: 1}  # the least K above the cut: taken
    path.write_text(yaml.safe_dump(cfg))
    assert prepare_build(path, allow_bundled=True).trtllm_options["speculative_config"]["draft_len_schedule"] == {
        1: 7, 64: 3, 512: 1}


@pytest.mark.parametrize("name", PLANNABLE_HERE)
def test_every_batch_size_up_to_the_largest_drafts_under_trtllm(name):
    from dflash_trt.draft_schedule import expand

    o = prepare_build(CONFIGS / f"{name}.yaml", allow_bundled=True).trtllm_options
    if (schedule := o["speculative_config"].get("draft_len_schedule")) is not None:
        assert all(expand(schedule, b) >= 1 for b in range(1, o["max_batch_size"] + 1)), schedule


def test_auto_on_a_gpu_drafts_k1_where_plain_decoding_would_win(tmp_path):
    """With a drafter that accepts little, plain decoding wins at large batches; TensorRT-LLM's DFlash then drafts
    the least K, to the largest batch size, rather than none."""
    import yaml

    from dflash_trt.draft_schedule import expand

    cfg = yaml.safe_load((CONFIGS / "gpt-oss-120b-8xb300-throughput.yaml").read_text())
    cfg["speculative_config"]["acceptance_by_draft_len"] = {1: 1.3, 3: 1.5, 7: 1.6}
    path = tmp_path / "weak.yaml"
    path.write_text(yaml.safe_dump(cfg))
    p = prepare_build(path, allow_bundled=True)
    schedule = p.trtllm_options["speculative_config"]["draft_len_schedule"]
    assert max(schedule) == 512 and schedule[512] == 1, schedule
    plain_wins = [pt["batch_size"] for pt in p.plan.performance["points"] if pt["draft_len"] == 0
                  and pt["tok_s_gpu"] >= max(q["tok_s_gpu"] for q in p.plan.performance["points"]
                                              if q["batch_size"] == pt["batch_size"])]
    assert plain_wins and all(expand(schedule, b) == 1 for b in plain_wins)  # where K=0 would have been chosen
