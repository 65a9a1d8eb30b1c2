"""`dflash-trt generate` as a user runs it."""

import json

import click
import pytest
import yaml
from click.testing import CliRunner

from dflash_trt.cli import main


def _run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_generate_json_reports_text_ids_and_statistics(tiny_dirs):
    r = _run("generate", "--target", str(tiny_dirs["qwen3"]), "--drafter", str(tiny_dirs["qwen3_drafter"]),
             "-p", "x", "--max-new-tokens", "20", "--ignore-eos", "-k", "7", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    for key in ("text", "token_ids", "num_tokens", "tau", "tokens_per_s", "acceptance_histogram"):
        assert key in out
    assert out["num_tokens"] == len(out["token_ids"]) == 20
    assert len(out["acceptance_histogram"]) == 8 and sum(out["acceptance_histogram"]) == len(out["acceptance_lengths"])
    assert out["tau"] >= 1.0


def test_no_spec_needs_no_drafter_and_gives_the_same_greedy_tokens(tiny_dirs):
    args = ["generate", "--target", str(tiny_dirs["qwen3"]), "-p", "x", "--max-new-tokens", "20", "--ignore-eos", "--json"]
    plain = json.loads(_run(*args, "--no-spec").stdout)
    spec = json.loads(_run(*args, "--drafter", str(tiny_dirs["qwen3_drafter"])).stdout)
    assert plain["token_ids"] == spec["token_ids"]
    assert plain["tau"] is None


def test_a_one_token_answer_ran_no_speculative_step_and_reports_no_tau(tiny_dirs):
    # tau is tokens a step, never below 1: 0.0 said a step ran that accepted nothing
    out = json.loads(_run("generate", "--target", str(tiny_dirs["qwen3"]), "--drafter", str(tiny_dirs["qwen3_drafter"]),
                          "-p", "x", "--max-new-tokens", "1", "--json").stdout)
    assert out["num_tokens"] == 1 and out["acceptance_lengths"] == [] and out["tau"] is None
    r = _run("generate", "--target", str(tiny_dirs["qwen3"]), "--drafter", str(tiny_dirs["qwen3_drafter"]),
             "-p", "x", "--max-new-tokens", "1")  # the text report too
    assert r.exit_code == 0 and ": 1 token (length), no speculative step," in r.stderr, r.stderr


@pytest.mark.parametrize("flag", ["--tree-nodes", "--lookup-nodes"])
def test_trees_and_lookups_with_the_rejection_rule_are_a_usage_error_not_dropped(tiny_dirs, flag):
    r = CliRunner().invoke(main, ["generate", "--target", str(tiny_dirs["qwen3"]), "--drafter",
                                  str(tiny_dirs["qwen3_drafter"]), "-p", "x", "--temperature", "0.9",
                                  "--acceptance", "rejection", flag, "3"])
    assert r.exit_code == 2 and f"{flag} apply to greedy and --acceptance match requests" in r.output, r.output


def test_max_tokens_is_an_alias_of_max_new_tokens(tiny_dirs):
    # the OpenAI API's and `bench speed`'s name for the same limit
    args = ["generate", "--target", str(tiny_dirs["qwen3"]), "-p", "x", "--ignore-eos", "--no-spec", "--json"]
    assert json.loads(_run(*args, "--max-tokens", "5").stdout)["num_tokens"] == 5


def test_a_draft_tree_gives_the_same_greedy_tokens(tiny_dirs):
    args = ["generate", "--target", str(tiny_dirs["qwen3"]), "-p", "x", "--max-new-tokens", "20", "--ignore-eos",
            "--json"]
    plain = json.loads(_run(*args, "--no-spec").stdout)
    drafter = ["--drafter", str(tiny_dirs["qwen3_drafter"]), "-k", "3"]
    tree = json.loads(_run(*args, *drafter, "--tree-nodes", "5").stdout)
    assert tree["token_ids"] == plain["token_ids"]
    too_big = CliRunner().invoke(main, [*args, *drafter, "--tree-nodes", "99"])  # reaches the engine, which refuses
    assert too_big.exit_code == 1 and "draft_tree" in too_big.output
    negative = CliRunner().invoke(main, [*args, *drafter, "--tree-nodes", "-1"])
    assert negative.exit_code == 2 and "--tree-nodes" in negative.output
    lookup = json.loads(_run(*args, *drafter, "--tree-nodes", "3", "--lookup-nodes", "3").stdout)
    assert lookup["token_ids"] == plain["token_ids"]
    too_deep = CliRunner().invoke(main, [*args, *drafter, "--tree-nodes", "3", "--lookup-nodes", "99"])
    assert too_deep.exit_code == 1 and "lookup_nodes" in too_deep.output


def test_missing_drafter_is_a_usage_error(tiny_dirs):
    r = CliRunner().invoke(main, ["generate", "--target", str(tiny_dirs["qwen3"]), "-p", "x"])
    assert r.exit_code != 0 and "--drafter" in r.output


def test_no_spec_with_a_drafter_is_a_usage_error_not_an_ignored_flag(tiny_dirs):
    r = CliRunner().invoke(main, ["generate", "--target", str(tiny_dirs["qwen3"]), "--drafter",
                                  str(tiny_dirs["qwen3_drafter"]), "--no-spec", "-p", "x"])
    assert r.exit_code == 2 and "--no-spec decodes without a drafter" in r.output


@pytest.mark.parametrize("args, flag", [(["-k", "3"], "--max-draft-len"), (["--tree-nodes", "6"], "--tree-nodes"),
                                        (["--lookup-nodes", "4"], "--lookup-nodes"),
                                        (["--acceptance", "rejection"], "--acceptance")])
def test_no_spec_with_a_drafting_flag_is_a_usage_error_not_an_ignored_flag(tiny_dirs, args, flag):
    r = CliRunner().invoke(main, ["generate", "--target", str(tiny_dirs["qwen3"]), "--no-spec", "-p", "x", *args])
    assert r.exit_code == 2 and flag in r.output and "--no-spec" in r.output, r.output


def test_a_context_too_short_for_max_new_tokens_is_said_not_silently_cut(tiny_dirs):
    r = CliRunner().invoke(main, ["generate", "--target", str(tiny_dirs["qwen3"]), "--no-spec", "-p", "x y z",
                                  "--max-model-len", "6", "--max-new-tokens", "20", "--ignore-eos", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["finish_reason"] == "length" and out["num_tokens"] < 20
    left = f"{out['num_tokens']} new token" + ("s" if out["num_tokens"] != 1 else "")  # "1 new token", said so
    assert "--max-model-len" in r.stderr and f"at most {left}, not 20" in r.stderr, r.stderr
    # a prompt that fills the context is an error, said once
    r = CliRunner().invoke(main, ["generate", "--target", str(tiny_dirs["qwen3"]), "--no-spec", "-p", "x y z w v",
                                  "--max-model-len", "6", "--max-new-tokens", "4"])
    assert r.exit_code == 1 and "leaves no room to generate" in r.output and "note:" not in r.output, r.output


@pytest.mark.parametrize("flag, value", [("--top-p", "1.5"), ("--top-p", "0"), ("--temperature", "-1"),
                                         ("--top-k", "-2")])
def test_bad_sampling_values_are_named_by_their_flag_before_the_model_loads(tmp_path, flag, value):
    r = CliRunner().invoke(main, ["generate", "--target", str(tmp_path), "--no-spec", "-p", "x", flag, value])
    assert r.exit_code == 2 and f"Invalid value for '{flag}'" in r.output, r.output


# --- what a user walking through the README sees (flags, defaults, refusals) ---



@pytest.fixture(scope="module")
def tiny_engine_dir(tiny_dirs, tmp_path_factory):
    """A built engine over the tiny Qwen3 target and drafter: 2 rows, a 3-node tree at one row (on any CPU)."""
    root = tmp_path_factory.mktemp("cli_engine")
    return _tiny_engine(tiny_dirs, root, draft_tree={1: 3}, draft_tree_without_amx={1: 3})


def _tiny_engine(tiny_dirs, root, **speculative):
    """An engine over the tiny Qwen3 target and drafter, K=3, 2 rows, these speculative_config keys -> (dir, yaml)."""
    from dflash_trt.build import build_engine

    config = root / "tiny.yaml"
    config.write_text(yaml.safe_dump({
        "name": "tiny", "model": str(tiny_dirs["qwen3"]), "hardware": "cpu", "dtype": "float32", "max_batch_size": 2,
        "max_seq_len": 256, "speculative_config": {"speculative_model": str(tiny_dirs["qwen3_drafter"]),
                                                   "max_draft_len": 3, **speculative}}))
    return build_engine(config, root / "engine", progress=False), config


@pytest.mark.parametrize("value", ["0", "1", "-5"])
def test_generate_refuses_a_max_model_len_too_small_naming_the_option(value):
    # 0 used to mean the default (4096) silently, while -5 reached the engine's check
    r = CliRunner().invoke(main, ["generate", "--no-spec", "-p", "x", "--max-model-len", value])
    assert r.exit_code == 2 and "--max-model-len" in r.output and "Traceback" not in r.output, r.output


def test_generate_warns_of_an_asked_for_max_model_len_past_the_targets_positions(tiny_dirs):
    # capped silently before; the default (4096, past the tiny target's 512) is capped without a word
    args = ["generate", "--target", str(tiny_dirs["qwen3"]), "--no-spec", "-p", "x", "--max-new-tokens", "2"]
    r = CliRunner().invoke(main, [*args, "--max-model-len", "4096"])
    assert r.exit_code == 0 and "--max-model-len 4096 is past the target's max_position_embeddings (512" in r.stderr
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0 and "max_position_embeddings" not in r.stderr


def test_generate_summary_names_the_draft_tree_it_verifies(tiny_engine_dir):
    engine, _ = tiny_engine_dir
    r = CliRunner().invoke(main, ["generate", str(engine), "-p", "x", "--max-new-tokens", "8", "--ignore-eos"])
    assert r.exit_code == 0, r.output
    assert "DFlash K=3, tree of 3 nodes:" in r.stderr
    r = CliRunner().invoke(main, ["generate", str(engine), "-p", "x", "--max-new-tokens", "8", "--ignore-eos",
                                  "--tree-nodes", "0", "--lookup-nodes", "2"])
    assert r.exit_code == 0, r.output
    assert "DFlash K=3, lookups of up to 2:" in r.stderr
    # a "rejection" row drafts a plain chain, whatever tree the engine verifies for greedy and "match" rows
    # (LLMEngine._tree_nodes)
    r = CliRunner().invoke(main, ["generate", str(engine), "-p", "x", "--max-new-tokens", "8", "--ignore-eos",
                                  "--temperature", "0.8", "--seed", "1", "--acceptance", "rejection"])
    assert r.exit_code == 0, r.output
    assert "DFlash K=3: 8 tokens (length), tau " in r.stderr and " speculative steps" in r.stderr


@pytest.mark.parametrize("layout, k", [("tiles", 3), ("panels", 2)])
def test_generate_summary_names_the_k_a_row_drafts_on_this_cpu(tiny_dirs, tmp_path, monkeypatch, layout, k):
    from dflash_trt.engine import llm_engine

    engine, _ = _tiny_engine(tiny_dirs, tmp_path, draft_len_schedule={1: 3}, draft_len_schedule_without_amx={1: 2})
    monkeypatch.setattr(llm_engine, "kernel_layout", lambda model: layout)  # AMX tiles, or a CPU without them
    r = CliRunner().invoke(main, ["generate", str(engine), "-p", "x", "--max-new-tokens", "8", "--ignore-eos"])
    assert r.exit_code == 0, r.output
    assert f"DFlash K={k}:" in r.stderr


@pytest.mark.parametrize("args, flag", [(["-k", "20"], "--max-draft-len"), (["--tree-nodes", "63"], "--tree-nodes")])
def test_an_engine_setting_out_of_range_is_named_by_its_flag(tiny_engine_dir, args, flag):
    engine, _ = tiny_engine_dir
    r = CliRunner().invoke(main, ["generate", str(engine), "-p", "x", *args])
    assert r.exit_code == 1 and f"Error: {flag}: " in r.output, r.output


@pytest.mark.parametrize("layout, k", [("tiles", 3), ("panels", 2)])
def test_generate_json_names_the_k_a_row_drafts_on_this_cpu(tiny_dirs, tmp_path, monkeypatch, layout, k):
    from dflash_trt.engine import llm_engine

    engine, _ = _tiny_engine(tiny_dirs, tmp_path, draft_len_schedule={1: 3}, draft_len_schedule_without_amx={1: 2})
    monkeypatch.setattr(llm_engine, "kernel_layout", lambda model: layout)
    r = CliRunner().invoke(main, ["generate", str(engine), "-p", "x", "--max-new-tokens", "8", "--ignore-eos",
                                  "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["max_draft_len"] == k, r.output


@pytest.mark.parametrize("args, flag", [(["-p", "caf\udce9"], "--prompt"), (["-p", "x", "--stop", "\udcff"], "--stop")])
def test_text_that_is_no_utf8_is_named_by_its_flag_before_the_model_loads(tmp_path, args, flag):
    """A shell passes the bytes it is given; Python keeps those that are no UTF-8 as lone surrogates, which the
    tokenizer refused with a TypeError traceback."""
    r = CliRunner().invoke(main, ["generate", "--target", str(tmp_path), "--no-spec", *args])
    assert r.exit_code == 2 and f"Invalid value for '{flag}': not UTF-8 text" in r.output, r.output


@pytest.mark.parametrize("args, flag", [
    (["--chat"], "--chat"), (["--stop", "."], "--stop"), (["--ignore-eos"], "--ignore-eos"), (["-k", "2"], "--max-draft-len"),
    (["--acceptance", "rejection"], "--acceptance"), (["--dtype", "bfloat16"], "--dtype"),
    (["--repetition-penalty", "1.2"], "--repetition-penalty"), (["--logprobs", "1", "--json"], "--logprobs"),
])
def test_generate_on_trtllm_refuses_the_flags_it_would_drop(tiny_engine_dir, args, flag):
    engine, _ = tiny_engine_dir
    r = CliRunner().invoke(main, ["generate", str(engine), "--backend", "trtllm", "-p", "x", *args])
    assert r.exit_code == 2 and flag in r.output and "--backend torch" in r.output, r.output


def test_generate_on_trtllm_takes_what_it_passes_on_and_defaults_given_again(tiny_dirs, tmp_path):
    from dflash_trt.build import build_engine
    from tests.test_build import write_config

    config = write_config(tmp_path, tiny_dirs["qwen3"], tiny_dirs["qwen3_drafter"], hardware="h200", dtype="bfloat16")
    engine = build_engine(config, tmp_path / "e", progress=False)
    r = CliRunner().invoke(main, ["generate", str(engine), "--backend", "trtllm", "-p", "x", "--temperature", "0.5",
                                  "--top-k", "3", "--seed", "1", "--max-new-tokens", "4", "--acceptance", "match",
                                  "--repetition-penalty", "1.0", "--json"])
    assert r.exit_code == 1 and "does not take" not in r.output and "tensorrt_llm is not importable" in r.output, \
        r.output


@pytest.mark.parametrize("command", [["generate", "-p", "x"], ["serve"]])
def test_an_engine_planned_for_the_cpu_is_not_run_on_tensorrt_llm(tiny_engine_dir, command, monkeypatch):
    from dflash_trt.trtllm import launch

    monkeypatch.setattr(launch.shutil, "which", lambda name: f"/opt/bin/{name}")  # as if trtllm-serve were installed
    engine, _ = tiny_engine_dir
    r = CliRunner().invoke(main, [command[0], str(engine), "--backend", "trtllm", *command[1:]])
    assert r.exit_code == 1 and "planned for this project's runtime (plan.json layout 'torch')" in r.output, r.output
    assert "--backend torch" in r.output


def test_build_plan_only_with_an_output_is_a_usage_error_not_an_ignored_flag(tiny_engine_dir, tmp_path):
    _, config = tiny_engine_dir
    r = CliRunner().invoke(main, ["build", str(config), "--plan-only", "-o", str(tmp_path / "e")])
    assert r.exit_code == 2 and "--plan-only writes nothing" in r.output
    assert not (tmp_path / "e").exists()


def test_a_build_with_several_problems_states_each_as_its_own_clause(tiny_engine_dir):
    _, config = tiny_engine_dir
    r = CliRunner().invoke(main, ["build", str(config), "--plan-only", "--max-batch-size", "100000",
                                  "--max-seq-len", "100000000"])
    assert r.exit_code != 0
    message = " ".join(r.output.split())
    assert "lower max_seq_len; the build does not fit" in message, message


def test_build_overrides_out_of_the_schemas_range_are_refused_naming_the_flag_not_the_yaml(tiny_engine_dir):
    _, config = tiny_engine_dir
    r = CliRunner().invoke(main, ["build", str(config), "--plan-only", "--max-seq-len", "1"])
    assert r.exit_code == 2 and "Invalid value for '--max-seq-len'" in r.output and ".yaml" not in r.output, r.output


def test_a_plan_without_a_schedule_says_what_every_batch_size_drafts(tiny_engine_dir):
    _, config = tiny_engine_dir
    r = CliRunner().invoke(main, ["build", str(config), "--plan-only"])
    assert r.exit_code == 0, r.output
    line = next(x for x in r.output.splitlines() if x.strip().startswith("draft_len_schedule"))
    assert "none (K=3 at every batch size)" in line and "None" not in line


def test_triton_export_of_an_engine_keeps_its_rows_unless_told(tiny_engine_dir, tmp_path):
    engine, _ = tiny_engine_dir

    def rows(*args):
        repo = tmp_path / f"repo{len(args)}"
        r = CliRunner().invoke(main, ["triton", "export", str(engine), "-o", str(repo), *args])
        assert r.exit_code == 0, r.output
        text = (repo / "dflash" / "config.pbtxt").read_text()
        return text.split('key: "max_batch_size", value: { string_value: "')[1].split('"')[0]

    assert rows() == "2"  # the engine's max_batch_size, not 8
    assert rows("--max-batch-size", "3") == "3"
    # past the target's 512 positions: capped where the model loads, with a log line there only
    r = CliRunner().invoke(main, ["triton", "export", str(engine), "-o", str(tmp_path / "long"), "--max-model-len",
                                  "100000"])
    assert r.exit_code == 0 and "--max-model-len 100000 is past the target's max_position_embeddings (512" in r.output


def test_serve_and_triton_export_help_state_the_defaults_they_keep():
    import dataclasses

    from dflash_trt.engine.llm_engine import EngineConfig
    from dflash_trt.server import cli as server_cli
    from dflash_trt.server.triton import ModelSettings

    cfg = EngineConfig()
    assert server_cli.DEFAULT_MAX_MODEL_LEN == cfg.max_model_len
    assert server_cli.DEFAULT_MAX_QUEUE_LEN == cfg.max_queue_len
    assert server_cli.DEFAULT_MAX_PREFILL_TOKENS == cfg.max_prefill_tokens
    assert server_cli.TRITON_DEFAULT_MAX_BATCH_SIZE == {f.name: f.default for f in dataclasses.fields(ModelSettings)}[
        "max_batch_size"]
    serve_help = " ".join(CliRunner().invoke(main, ["serve", "--help"]).output.split())
    for text in (f"else {cfg.max_model_len})", f"(default: {cfg.max_queue_len})", f"(default: {cfg.max_prefill_tokens})",
                 "drafters/smollm2-135m-dflash", "else K at every batch size"):
        assert text in serve_help, text
    export_help = " ".join(CliRunner().invoke(main, ["triton", "export", "--help"]).output.split())
    assert f"max_seq_len, else {cfg.max_model_len})" in export_help
    assert "the engine's max_batch_size, else 8" in export_help


@pytest.mark.parametrize("args, option", [
    (["--max-queue-len", "-1"], "--max-queue-len"), (["--max-prefill-tokens", "0"], "--max-prefill-tokens"),
    (["--draft-vocab-size", "-1"], "--draft-vocab-size"), (["--max-model-len", "1"], "--max-model-len"),
])
def test_serve_refuses_out_of_range_numbers_before_loading_a_model(args, option):
    r = CliRunner().invoke(main, ["serve", "--no-spec", *args])
    assert r.exit_code == 2 and option in r.output and "Traceback" not in r.output, r.output


def test_generate_takes_penalties_and_reports_the_targets_logprobs(tiny_dirs):
    """The answer is transformers' decoding under the same penalties; each token's logprob is transformers'."""
    import torch
    from transformers import AutoTokenizer

    from tests.engine.test_logits_processors import hf_penalized_greedy
    from tests.server.test_logprobs import hf_logprobs

    r = _run("generate", "--target", str(tiny_dirs["qwen3"]), "--drafter", str(tiny_dirs["qwen3_drafter"]), "-p", "x",
             "--max-new-tokens", "16", "--ignore-eos", "-k", "3", "--repetition-penalty", "1.4", "--frequency-penalty",
             "0.5", "--logprobs", "2", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    prompt = AutoTokenizer.from_pretrained(tiny_dirs["qwen3"])("x")["input_ids"]
    assert out["token_ids"] == hf_penalized_greedy(tiny_dirs["qwen3"], prompt,
                                                   dict(repetition_penalty=1.4, frequency_penalty=0.5), 16)
    ref = hf_logprobs(tiny_dirs["qwen3"], prompt, out["token_ids"])
    want = ref.gather(1, torch.tensor(out["token_ids"])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([e["logprob"] for e in out["logprobs"]]), want, atol=1e-4, rtol=0)
    assert all(len(e["top"]) == 2 for e in out["logprobs"])
    bare = CliRunner().invoke(main, ["generate", "--target", str(tiny_dirs["qwen3"]), "--no-spec", "-p", "x",
                                     "--logprobs", "1"])
    assert bare.exit_code == 2 and "add --json" in bare.output


def test_the_cli_tells_its_version_and_takes_h_for_help():
    from dflash_trt import __version__

    assert CliRunner().invoke(main, ["--version"]).output.strip().endswith(__version__)
    assert "Usage:" in CliRunner().invoke(main, ["-h"]).output


def hf_greedy_text(target_dir, prompt: str, n: int) -> str:
    """transformers' greedy continuation of the prompt, decoded as a client reads it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype="float32")
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, ids.shape[1]:]
    return tok.decode(out, skip_special_tokens=True)


def test_generate_writes_the_answer_as_the_steps_make_it(tiny_dirs, monkeypatch):
    """Text on stdout before the answer is done, and all of it the target's own greedy answer."""
    echo, pieces = click.echo, []

    def spy(message=None, *args, **kwargs):
        if message and not kwargs.get("err"):
            pieces.append(message)
        return echo(message, *args, **kwargs)

    monkeypatch.setattr(click, "echo", spy)
    r = _run("generate", "--target", str(tiny_dirs["qwen3"]), "--drafter", str(tiny_dirs["qwen3_drafter"]), "-p", "x",
             "--max-new-tokens", "24", "--ignore-eos", "-k", "3")
    assert r.exit_code == 0, r.output
    want = hf_greedy_text(tiny_dirs["qwen3"], "x", 24)
    assert r.stdout == want + "\n"
    assert len(pieces) > 3 and "".join(pieces) == want


def test_a_streamed_answer_ends_before_its_stop_string_as_the_json_one_does(tiny_dirs):
    want = hf_greedy_text(tiny_dirs["qwen3"], "x", 24)
    stop = want[9:12]  # a string the answer holds: it ends just before it
    r = _run("generate", "--target", str(tiny_dirs["qwen3"]), "--drafter", str(tiny_dirs["qwen3_drafter"]), "-p", "x",
             "--max-new-tokens", "24", "--ignore-eos", "-k", "3", "--stop", stop)
    assert r.exit_code == 0, r.output
    assert r.stdout == want[:want.find(stop)] + "\n"


def test_ctrl_c_keeps_the_text_so_far_and_says_how_far_it_came(tiny_dirs, monkeypatch):
    from dflash_trt.engine.llm_engine import LLMEngine

    step, steps = LLMEngine.step, []

    def interrupted_step(self):
        if len(steps) == 4:
            raise KeyboardInterrupt
        steps.append(1)
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", interrupted_step)
    r = CliRunner().invoke(main, ["generate", "--target", str(tiny_dirs["qwen3"]), "--no-spec", "-p", "x",
                                  "--max-new-tokens", "24", "--ignore-eos"])
    assert r.exit_code == 130, r.output
    want = hf_greedy_text(tiny_dirs["qwen3"], "x", 24)
    assert r.stdout.strip() and want.startswith(r.stdout.rstrip("\n"))
    assert "interrupted after 4 tokens" in r.stderr  # the prompt's forward gave one, three plain steps three more


def option_names(*path: str) -> set[str]:
    command = main
    for name in path:
        command = command.commands[name]
    return {opt for p in command.params for opt in (*p.opts, *p.secondary_opts)}


@pytest.mark.parametrize("flags, commands", [
    (("--max-model-len",), [("generate",), ("serve",), ("build",), ("triton", "export")]),
    (("--adaptive-draft-len", "--fixed-draft-len"), [("serve",), ("bench", "speed")]),
    (("--threads",), [("generate",), ("serve",), ("triton", "export"), ("bench", "speed")]),
    (("-o",), [("build",), ("train",), ("triton", "export"), ("bench", "speed"), ("bench", "sweep")]),
])
def test_one_concept_takes_one_flag_name_across_commands(flags, commands):
    for path in commands:
        assert set(flags) <= option_names(*path), path


def test_builds_max_model_len_is_its_max_seq_len():
    from pathlib import Path

    cfg = Path(__file__).resolve().parents[1] / "build_configs" / "smollm2-135m-cpu.yaml"
    r = _run("build", str(cfg), "--plan-only", "--json", "--max-model-len", "1024")
    assert json.loads(r.stdout)["max_seq_len"] == 1024


def test_a_prompt_of_dash_is_read_from_stdin(tiny_dirs):
    args = ["generate", "--target", str(tiny_dirs["qwen3"]), "--no-spec", "--max-new-tokens", "6", "--ignore-eos",
            "--json"]
    piped = CliRunner().invoke(main, [*args, "-p", "-"], input="hello there\n")
    typed = CliRunner().invoke(main, [*args, "-p", "hello there"])
    assert piped.exit_code == 0, piped.output
    assert json.loads(piped.stdout)["token_ids"] == json.loads(typed.stdout)["token_ids"]
    latin1 = CliRunner().invoke(main, [*args, "-p", "-"], input=b"caf\xe9 au lait")  # as -p with those bytes
    assert latin1.exit_code == 2 and "Invalid value for '--prompt': stdin is not UTF-8 text (a byte at position 3)" \
        in latin1.output and latin1.exc_info[0] is SystemExit, latin1.output


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_an_empty_prompt_is_refused_as_one(tiny_dirs, json_flag):
    r = CliRunner().invoke(main, ["generate", "--target", str(tiny_dirs["qwen3"]), "--no-spec", "-p", "", *json_flag])
    assert r.exit_code == 1 and "empty prompt: at least one token is needed" in r.output, r.output


def test_a_sampled_run_reports_its_seed_and_that_seed_gives_the_sample_again(tiny_dirs):
    args = ["generate", "--target", str(tiny_dirs["qwen3"]), "--no-spec", "-p", "x", "--max-new-tokens", "12",
            "--ignore-eos", "--temperature", "1.0", "--json"]
    first = json.loads(_run(*args).stdout)
    assert isinstance(first["seed"], int)
    again = json.loads(_run(*args, "--seed", str(first["seed"])).stdout)
    assert again["token_ids"] == first["token_ids"] and again["seed"] == first["seed"]
    r = _run(*args[:-1])
    assert ", seed " in r.stderr


def test_a_prompt_the_context_cannot_hold_names_the_flag(tiny_dirs):
    r = CliRunner().invoke(main, ["generate", "--target", str(tiny_dirs["qwen3"]), "--no-spec", "-p", "x" * 40,
                                  "--max-model-len", "16"])
    assert r.exit_code == 1 and "--max-model-len: prompt has" in r.output, r.output


def test_ctrl_c_while_the_model_loads_exits_as_interrupted(tiny_dirs, monkeypatch):
    from dflash_trt.engine.llm_engine import LLMEngine

    monkeypatch.setattr(LLMEngine, "from_dirs", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    r = CliRunner().invoke(main, ["generate", "--target", str(tiny_dirs["qwen3"]), "--no-spec", "-p", "x"])
    assert r.exit_code == 130 and "interrupted" in r.output and "Aborted" not in r.output, r.output


def test_ctrl_c_before_a_command_says_more_itself_exits_as_interrupted(tiny_dirs, monkeypatch):
    from dflash_trt import cli

    monkeypatch.setattr(cli, "use_threads", lambda threads: (_ for _ in ()).throw(KeyboardInterrupt))
    r = CliRunner().invoke(main, ["generate", "--target", str(tiny_dirs["qwen3"]), "--no-spec", "-p", "x"])
    assert r.exit_code == 130 and "interrupted" in r.output and "Aborted" not in r.output, r.output


@pytest.mark.parametrize("flag, reader", [("", "head -c 5"), ("--json", "true")])  # true: gone before the write
def test_a_reader_that_goes_away_ends_the_answer_quietly(tiny_dirs, flag, reader):
    """`generate ... | head -c 5`: no error on stderr, the status a SIGPIPE gives, streamed or as one JSON object."""
    import subprocess
    import sys

    cmd = (f"{sys.executable} -m dflash_trt generate --target {tiny_dirs['qwen3']} --no-spec -p x --ignore-eos "
           f"--max-new-tokens 120 {flag} | {reader}; echo \" ${{PIPESTATUS[0]}}\"")
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert r.stdout.endswith(" 141\n") and "Error" not in r.stderr and "Traceback" not in r.stderr, (r.stdout, r.stderr)


def test_a_predicted_answer_from_a_file_is_drafted_and_changes_no_token(tiny_dirs, tmp_path):
    """--prediction: a file the answer is expected to repeat; the answer its own answer is drafted deeper (fewer
    steps), and is the same tokens; beside --no-spec it is refused, as the drafting flags are."""
    args = ["generate", "--target", str(tiny_dirs["qwen3"]), "--drafter", str(tiny_dirs["qwen3_drafter"]), "-p", "x",
            "--max-new-tokens", "30", "--ignore-eos", "--json"]
    plain = json.loads(_run(*args).stdout)
    (tmp_path / "answer.txt").write_text(plain["text"], encoding="utf-8")
    predicted = json.loads(_run(*args, "--prediction", str(tmp_path / "answer.txt")).stdout)
    assert predicted["token_ids"] == plain["token_ids"]
    assert len(predicted["acceptance_lengths"]) < len(plain["acceptance_lengths"]) / 2
    r = CliRunner().invoke(main, [*args[:3], "--no-spec", "-p", "x", "--prediction", str(tmp_path / "answer.txt")])
    assert r.exit_code == 2 and "--prediction" in r.output, r.output
    (tmp_path / "bytes.bin").write_bytes(b"\xff\xfe")
    r = CliRunner().invoke(main, [*args, "--prediction", str(tmp_path / "bytes.bin")])
    assert r.exit_code == 2 and "not UTF-8" in r.output and "--prediction" in r.output, r.output
