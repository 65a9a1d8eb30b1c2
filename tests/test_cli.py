"""`dflash-trt generate` as a user runs it."""

import json

from click.testing import CliRunner

from dflash_trt.cli import main
from tests.engine.test_lossless import hf_greedy


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


def test_bad_sampling_values_are_reported_not_crashed(tiny_dirs):
    r = CliRunner().invoke(main, ["generate", "--target", str(tiny_dirs["qwen3"]), "--no-spec", "-p", "x", "--top-p", "1.5"])
    assert r.exit_code == 1 and "top_p must be in (0, 1]" in r.output
