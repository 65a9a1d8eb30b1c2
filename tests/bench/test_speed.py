"""`bench speed`: per-category tau and speedup, with every DFlash output checked against the target's greedy output."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_trt.bench.datasets import BenchPrompt
from dflash_trt.bench.speed import SpeedConfig, run_speed
from dflash_trt.cli import main
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine
from tests.engine.test_lossless import hf_greedy

PROMPTS = [BenchPrompt("a/0", "a", "xy", 12), BenchPrompt("a/1", "a", "hello", 12), BenchPrompt("b/0", "b", "zzz", 9)]


@pytest.fixture(scope="module")
def result(tiny_dirs):
    engine = LLMEngine.from_dirs(tiny_dirs["qwen3"], tiny_dirs["qwen3_drafter"], EngineConfig(dtype="float32"))
    return engine, run_speed(engine, PROMPTS, SpeedConfig(draft_lens=[3, 7], rounds=1), chat=False)


def test_every_category_reports_every_system(result):
    _, r = result
    assert r["systems"] == ["ar", "K=3", "K=7"]
    assert set(r["categories"]) == {"a", "b"}


def test_token_counts_match_transformers_greedy_and_fp32_outputs_are_identical(result, tiny_dirs):
    engine, r = result
    eos = engine.eos_token_ids[0] if len(engine.eos_token_ids) == 1 else list(engine.eos_token_ids)
    for cat in ("a", "b"):
        expected = sum(len(hf_greedy(tiny_dirs["qwen3"], engine.encode(p.text), p.max_tokens, eos))
                       for p in PROMPTS if p.category == cat)
        n = sum(p.category == cat for p in PROMPTS)
        for system in ("ar", "K=3", "K=7"):
            assert r["categories"][cat][system]["tokens"] == expected
        for system in ("K=3", "K=7"):
            assert r["categories"][cat][system]["identical_outputs"] == f"{n}/{n}"


def test_tau_and_histogram_agree_with_their_definitions(result):
    _, r = result
    for k in (3, 7):
        row = r["overall"][f"K={k}"]
        hist = row["acceptance_histogram"]
        assert len(hist) <= k + 1
        steps = sum(hist)
        committed = sum((i + 1) * c for i, c in enumerate(hist))
        assert row["tau"] == pytest.approx(committed / steps, abs=1e-3)
        assert 1.0 <= row["tau"] <= k + 1
        # every generated token after the first (prefill's) is committed by exactly one verify step
        assert committed == row["tokens"] - len(PROMPTS)
        assert row["speedup"] > 0 and row["tok_s"] > 0


def test_an_adaptive_engines_systems_say_so_and_fixed_k_drafts_every_step(tiny_dirs):
    """An engine built with adaptive_draft_len runs plain steps where they measure faster: its systems are named for
    it (their tau counts the speculative steps only), and --fixed-k drafts at every step as the name says."""
    engine = LLMEngine.from_dirs(tiny_dirs["qwen3"], tiny_dirs["qwen3_drafter"],
                                 EngineConfig(dtype="float32", adaptive_draft_len=True))
    adaptive = run_speed(engine, PROMPTS[:1], SpeedConfig(draft_lens=[3], rounds=1), chat=False)
    assert adaptive["systems"] == ["ar", "K=3 adaptive"] and adaptive["adaptive_draft_len"] is True
    fixed = run_speed(engine, PROMPTS, SpeedConfig(draft_lens=[3], rounds=1, adaptive=False), chat=False)
    assert fixed["adaptive_draft_len"] is False  # recorded in the result
    row = fixed["overall"]["K=3"]
    assert sum((i + 1) * c for i, c in enumerate(row["acceptance_histogram"])) == row["tokens"] - len(PROMPTS)


def test_overall_merges_the_categories(result):
    _, r = result
    for system in r["systems"]:
        assert r["overall"][system]["tokens"] == sum(c[system]["tokens"] for c in r["categories"].values())


def test_cli_json(tiny_dirs, tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": t, "category": c}) for t, c in [("ab", "x"), ("cd", "y")]))
    out = tmp_path / "speed.json"
    r = CliRunner().invoke(main, ["bench", "speed", "--target", str(tiny_dirs["qwen3"]), "--drafter",
                                  str(tiny_dirs["qwen3_drafter"]), "--dataset", str(data), "--max-tokens", "6", "-k", "3",
                                  "--rounds", "1", "--dtype", "float32", "--json", "-o", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert set(res["categories"]) == {"x", "y"} and res["draft_lens"] == [3]
    assert json.loads(out.read_text()) == res
    r = CliRunner().invoke(main, ["bench", "speed", "--target", str(tiny_dirs["qwen3"]), "--drafter",
                                  str(tiny_dirs["qwen3_drafter"]), "--dataset", str(data), "-k", "99"])
    assert r.exit_code != 0 and "K=99" in r.output
    r = CliRunner().invoke(main, ["bench", "speed", "--target", str(tiny_dirs["qwen3"]), "--drafter",
                                  str(tiny_dirs["qwen3_drafter"]), "--dataset", str(data), "--tree-nodes", "3,63"])
    assert r.exit_code == 2 and "--tree-nodes" in r.output and "63 nodes exceed 62" in r.output
    assert "Traceback" not in r.output
    r = CliRunner().invoke(main, ["bench", "speed", "--target", str(tiny_dirs["qwen3"]), "--drafter",
                                  str(tiny_dirs["qwen3_drafter"]), "--dataset", str(data), "--lookup-nodes", "99"])
    assert r.exit_code == 2 and "--lookup-nodes" in r.output and "99 nodes" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["bench", "speed", "--target", str(tiny_dirs["qwen3"]), "--drafter",
                                  str(tiny_dirs["qwen3_drafter"]), "--dataset", str(data), "--draft-vocab-sizes", "all,5"])
    assert r.exit_code == 2 and "--draft-vocab-sizes" in r.output and "Traceback" not in r.output
    assert "size=5 needs a drafter that ships draft_vocab.json" in r.output


def test_zlab_peer_runs_on_the_same_weights_and_agrees_step_by_step(tiny_dirs):
    pytest.importorskip("dflash.model", reason="z-lab's dflash==0.1.0 is the peer")
    import torch

    from dflash_trt.bench.speed import zlab_runner

    engine = LLMEngine.from_dirs(tiny_dirs["qwen3"], tiny_dirs["qwen3_drafter"], EngineConfig(dtype="float32"))
    zlab = zlab_runner(str(tiny_dirs["qwen3"]), str(tiny_dirs["qwen3_drafter"]), torch.float32, list(engine.eos_token_ids))
    r = run_speed(engine, PROMPTS, SpeedConfig(draft_lens=[3], rounds=1), chat=False, zlab=zlab)
    ours, peer = r["overall"]["K=3"], r["overall"]["zlab K=3"]
    # an independent implementation of the same algorithm: same tokens, same acceptance per step
    assert peer["identical_outputs"] == f"{len(PROMPTS)}/{len(PROMPTS)}"
    assert peer["tokens"] == ours["tokens"]
    assert peer["tau"] == ours["tau"] and peer["acceptance_histogram"] == ours["acceptance_histogram"]


def test_draft_vocabularies_are_compared_side_by_side_and_stay_lossless(tiny_dirs):
    import torch

    engine = LLMEngine.from_dirs(tiny_dirs["qwen3"], tiny_dirs["qwen3_drafter"], EngineConfig(dtype="float32"))
    engine.drafter.draft_vocab = torch.arange(0, 96, 3)
    r = run_speed(engine, PROMPTS, SpeedConfig(draft_lens=[3], rounds=1, draft_vocab_sizes=[None, 0, 8]), chat=False)
    assert r["systems"] == ["ar", "K=3 vocab=all", "K=3 vocab=0", "K=3 vocab=8"]
    assert r["draft_vocab_size"] == {"K=3 vocab=all": 32, "K=3 vocab=0": None, "K=3 vocab=8": 8}
    for system in r["systems"][1:]:
        assert r["overall"][system]["identical_outputs"] == "3/3"
        assert r["overall"][system]["tokens"] == r["overall"]["ar"]["tokens"]


def test_draft_trees_are_compared_with_chains_and_stay_lossless(tiny_dirs):
    engine = LLMEngine.from_dirs(tiny_dirs["qwen3"], tiny_dirs["qwen3_drafter"], EngineConfig(dtype="float32"))
    r = run_speed(engine, PROMPTS, SpeedConfig(draft_lens=[3], rounds=1, tree_nodes=[0, 5]), chat=False)
    assert r["systems"] == ["ar", "K=3", "K=3 tree=5"]
    for system in r["systems"][1:]:
        assert r["overall"][system]["identical_outputs"] == "3/3"
        assert r["overall"][system]["tokens"] == r["overall"]["ar"]["tokens"]


def test_systems_with_context_lookups_are_compared_and_stay_lossless(tiny_dirs):
    engine = LLMEngine.from_dirs(tiny_dirs["qwen3"], tiny_dirs["qwen3_drafter"], EngineConfig(dtype="float32"))
    r = run_speed(engine, PROMPTS, SpeedConfig(draft_lens=[3], rounds=1, tree_nodes=[0, 3], lookup_nodes=[0, 3]),
                  chat=False)
    assert r["systems"] == ["ar", "K=3", "K=3 lookup=3", "K=3 tree=3", "K=3 tree=3 lookup=3"]
    for system in r["systems"][1:]:
        assert r["overall"][system]["identical_outputs"] == "3/3"
        assert r["overall"][system]["tokens"] == r["overall"]["ar"]["tokens"]


def test_the_cli_parses_draft_vocabulary_sizes():
    from dflash_trt.bench.cli import parse_vocab_sizes

    assert parse_vocab_sizes("all,0, 8192") == [None, 0, 8192]
    with pytest.raises(Exception, match="'most' is not 'all' or a token count"):
        parse_vocab_sizes("all,most")
    with pytest.raises(Exception, match="repeats a size"):
        parse_vocab_sizes("0,all,0")


def test_an_engine_is_measured_at_its_own_k_and_tree_unless_told_otherwise(tiny_dirs, tmp_path):
    from dflash_trt.build import build_engine
    from tests.test_build import write_config

    cfg = write_config(tmp_path, tiny_dirs["qwen3"], None, speculative_config={
        "speculative_model": str(tiny_dirs["qwen3_drafter"]), "max_draft_len": 2, "draft_tree": {1: 4}})
    engine = build_engine(cfg, tmp_path / "engine", progress=False)
    data = one_prompt(tmp_path)
    args = ["bench", "speed", str(engine), "--dataset", str(data), "--max-tokens", "4", "--rounds", "1", "--json"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["draft_lens"] == [2] and json.loads(r.stdout)["tree_nodes"] == [4]
    r = CliRunner().invoke(main, [*args, "--tree-nodes", "0"])
    assert json.loads(r.stdout)["systems"] == ["ar", "K=2"]
    # past the engine's own K=2 as generate's --max-draft-len goes: up to the drafter's block_size - 1 (16 - 1)
    r = CliRunner().invoke(main, [*args, "-k", "3", "--tree-nodes", "0"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["systems"] == ["ar", "K=3"]
    r = CliRunner().invoke(main, [*args, "-k", "16"])
    assert r.exit_code != 0 and "K=16 exceeds the drafter's limit 15 (its block_size - 1)" in r.output
    plain = build_engine(write_config(tmp_path, tiny_dirs["qwen3"], None), tmp_path / "plain", progress=False)
    r = CliRunner().invoke(main, ["bench", "speed", str(plain), *args[3:]])
    assert r.exit_code != 0 and "has no drafter" in r.output
    # the rejection rule verifies sampled chains: the engine's tree is not what runs, so neither is it named
    rejection = [*args, "--temperature", "0.8", "--acceptance", "rejection"]
    r = CliRunner().invoke(main, rejection)
    assert r.exit_code == 0 and json.loads(r.stdout)["systems"] == ["ar", "K=2"], r.output
    r = CliRunner().invoke(main, [*rejection, "--tree-nodes", "4"])
    assert r.exit_code == 2 and "--acceptance rejection drafts chains" in r.output


@pytest.mark.parametrize("layout, k", [("tiles", 2), ("panels", 1)])
def test_an_engine_is_measured_at_the_k_it_drafts_at_one_row_on_this_cpu(tiny_dirs, tmp_path, monkeypatch, layout, k):
    from dflash_trt.build import build_engine
    from dflash_trt.engine import llm_engine
    from tests.test_build import write_config

    cfg = write_config(tmp_path, tiny_dirs["qwen3"], None, speculative_config={
        "speculative_model": str(tiny_dirs["qwen3_drafter"]), "max_draft_len": 2, "draft_len_schedule": {1: 2},
        "draft_len_schedule_without_amx": {1: 1}})
    engine = build_engine(cfg, tmp_path / "engine", progress=False)
    data = one_prompt(tmp_path)
    monkeypatch.setattr(llm_engine, "kernel_layout", lambda model: layout)  # AMX tiles, or a CPU without them
    r = CliRunner().invoke(main, ["bench", "speed", str(engine), "--dataset", str(data), "--max-tokens", "4",
                                  "--rounds", "1", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["draft_lens"] == [k]


def one_prompt(folder: Path) -> Path:
    """A prompt file of one short prompt, for the tests of what bench speed does around its measurements."""
    data = folder / "p.jsonl"
    data.write_text(json.dumps({"prompt": "ab", "category": "x"}))
    return data


def speed_cli(tiny_dirs, data, *args):
    return CliRunner().invoke(main, ["bench", "speed", "--target", str(tiny_dirs["qwen3"]), "--drafter",
                                     str(tiny_dirs["qwen3_drafter"]), "--dataset", str(data), *args])


@pytest.mark.parametrize("args, option", [
    (["-k", "0"], "--draft-lens"), (["-k", "3,3"], "--draft-lens"), (["--tree-nodes", "0,0"], "--tree-nodes"),
    (["--rounds", "0"], "--rounds"), (["--max-tokens", "0"], "--max-tokens"),
    (["--limit-per-category", "0"], "--limit-per-category"), (["--threads", "-1"], "--threads"),
])
def test_out_of_range_numbers_are_usage_errors_that_name_the_option(tiny_dirs, tmp_path, args, option):
    data = one_prompt(tmp_path)
    r = speed_cli(tiny_dirs, data, *args)
    assert r.exit_code == 2 and option in r.output and "Traceback" not in r.output, r.output


def test_target_without_drafter_asks_for_the_drafter_only(tiny_dirs):
    r = CliRunner().invoke(main, ["bench", "speed", "--target", str(tiny_dirs["qwen3"])])
    assert r.exit_code == 2 and "--drafter" in r.output and "--no-spec" not in r.output, r.output


def test_an_engine_cannot_be_combined_with_another_target_or_drafter(tiny_dirs, tmp_path):
    r = CliRunner().invoke(main, ["bench", "speed", str(tmp_path), "--drafter", str(tiny_dirs["qwen3_drafter"])])
    assert r.exit_code == 2 and "ENGINE or --target/--drafter, not both" in r.output, r.output


def test_the_table_is_printed_and_the_result_written_into_new_folders(tiny_dirs, tmp_path):
    data = one_prompt(tmp_path)
    out = tmp_path / "new" / "dir" / "speed.json"
    r = speed_cli(tiny_dirs, data, "--max-tokens", "4", "-k", "3", "--rounds", "1", "-o", str(out))
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("category") and json.loads(out.read_text())["draft_lens"] == [3]


def test_an_output_that_cannot_be_a_file_is_refused_before_the_run(tiny_dirs, tmp_path):
    data = one_prompt(tmp_path)
    (tmp_path / "file").write_text("")
    r = speed_cli(tiny_dirs, data, "-o", str(tmp_path / "file" / "speed.json"))
    assert r.exit_code == 2 and "--output" in r.output and "Traceback" not in r.output, r.output


def test_a_result_that_cannot_be_written_is_still_printed(tiny_dirs, tmp_path, monkeypatch):
    import errno
    from pathlib import Path

    data = one_prompt(tmp_path)

    def disk_full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", disk_full)
    r = speed_cli(tiny_dirs, data, "--max-tokens", "4", "-k", "3", "--rounds", "1", "-o", str(tmp_path / "speed.json"))
    assert r.exit_code == 1 and r.stdout.startswith("category") and "speed.json" in r.output
    assert "No space left" in r.output and "Traceback" not in r.output


def test_table_columns_stay_aligned_with_long_labels():
    import re

    from dflash_trt.bench.speed import format_table

    row = {"tokens": 10, "wall_s": 1.0, "tok_s": 10.0}
    spec = row | {"speedup": 1.5, "identical_outputs": "3/3", "tau": 2.25, "acceptance_histogram": [1]}
    systems = {"ar": row, "K=2 vocab=all tree=3 lookup=3": spec, "K=2 vocab=0 tree=3 lookup=3": spec}
    table = format_table({"categories": {"summarization-long": systems, "x": systems}, "overall": systems})
    header, *lines = table.splitlines()

    def ends(line):  # where the four numeric columns end (right-aligned)
        return [m.end() for m in re.finditer(r"\S+", line)][-4:]

    for line, system in zip(lines, [*systems] * 3):
        assert ends(line) == ends(header), table
        assert line[header.index("system"):].startswith(system), table


def test_sampled_prompt_i_draws_the_targets_own_samples_with_seed_plus_i(tiny_dirs, monkeypatch):
    """Sampled, every system runs prompt i with seed SEED + i: its tokens are transformers' samples with that seed's
    positional uniforms (the oracle), under "match" with or without drafts."""
    from tests.engine.test_lossless import hf_sample

    engine = LLMEngine.from_dirs(tiny_dirs["qwen3"], tiny_dirs["qwen3_drafter"], EngineConfig(dtype="float32"))
    eos = set(engine.eos_token_ids)
    expected = {}
    for i, p in enumerate(PROMPTS):
        ref = hf_sample(tiny_dirs["qwen3"], engine.encode(p.text), 5 + i, 1.0, new=p.max_tokens)
        expected[tuple(engine.encode(p.text))] = ref[:next((j + 1 for j, t in enumerate(ref) if t in eos), len(ref))]
    seen = []
    generate = LLMEngine.generate

    def spy(self, prompts, params):
        outs = generate(self, prompts, params)
        seen.extend((tuple(q), o.token_ids) for q, o in zip(prompts, outs))
        return outs

    monkeypatch.setattr(LLMEngine, "generate", spy)
    cfg = SpeedConfig(draft_lens=[3, 7], rounds=1, tree_nodes=[0, 3], temperature=1.0, seed=5, warmup=False)
    r = run_speed(engine, PROMPTS, cfg, chat=False)
    assert len(seen) == 5 * len(PROMPTS)  # AR and four DFlash systems
    for prompt, tokens in seen:
        assert tokens == expected[prompt]
    assert r["sampling"] == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 5, "acceptance": "match"}
    assert r["systems"] == ["ar", "K=3", "K=3 tree=3", "K=7", "K=7 tree=3"]
    for system in r["systems"][1:]:
        assert r["overall"][system]["identical_outputs"] == "3/3"


def test_rejection_sampling_reports_no_identity_count_and_greedy_reports_no_sampling(tiny_dirs, result):
    engine, greedy = result
    assert greedy["sampling"] is None
    r = run_speed(engine, PROMPTS, SpeedConfig(draft_lens=[3], rounds=1, temperature=0.8, top_k=20,
                                               acceptance="rejection"), chat=False)
    row = r["overall"]["K=3"]
    assert "identical_outputs" not in row  # equal in distribution only: a count would mean nothing
    assert 1.0 <= row["tau"] <= 4 and row["tokens"] > 0
    assert r["sampling"]["acceptance"] == "rejection" and r["sampling"]["top_k"] == 20


def test_the_cli_samples_and_says_so(tiny_dirs, tmp_path):
    data = one_prompt(tmp_path)
    base = ["bench", "speed", "--target", str(tiny_dirs["qwen3"]), "--drafter", str(tiny_dirs["qwen3_drafter"]),
            "--dataset", str(data), "--max-tokens", "6", "-k", "3", "--rounds", "1", "--dtype", "float32"]
    r = CliRunner().invoke(main, [*base, "--temperature", "0.7", "--top-p", "0.9", "--seed", "3"])
    assert r.exit_code == 0, r.output
    assert "sampled: temperature 0.7, top_p 0.9" in r.output and "seed 3 + i, match rule" in r.output
    r = CliRunner().invoke(main, [*base, "--temperature", "0.7", "--zlab-peer"])
    assert r.exit_code == 2 and "greedy only" in r.output
    r = CliRunner().invoke(main, [*base, "--top-p", "0"])
    assert r.exit_code == 2 and "--top-p" in r.output


def test_a_prompt_the_engines_context_cannot_hold_is_named_before_any_system_runs(tiny_dirs, tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(LLMEngine, "generate", lambda *a, **k: ran.append(1))
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "ab", "category": "x"}) + "\n" +
                    json.dumps({"prompt": "y" * 600, "category": "long"}) + "\n")
    r = speed_cli(tiny_dirs, data, "--max-tokens", "4", "-k", "3", "--rounds", "1")
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert "(long) has 6" in r.output and "the engine's context (max_model_len 512) leaves no room" in r.output
    assert "--dataset" in r.output
    assert ran == []


def test_ctrl_c_keeps_the_rounds_that_finished_and_writes_them_whole(tiny_dirs, tmp_path, monkeypatch):
    generate, calls = LLMEngine.generate, []

    def interrupted(self, *args, **kwargs):  # AR and K=3 once each to warm up, then round 1, then round 2 cut short
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return generate(self, *args, **kwargs)

    data = one_prompt(tmp_path)
    out = tmp_path / "speed.json"
    out.write_text("an earlier result")
    monkeypatch.setattr(LLMEngine, "generate", interrupted)
    r = speed_cli(tiny_dirs, data, "--max-tokens", "4", "-k", "3", "--rounds", "3", "-o", str(out))
    assert r.exit_code == 130, r.output
    assert "the 1 of 3 rounds that finished" in r.output and r.stdout.startswith("category")
    written = json.loads(out.read_text())
    assert written["interrupted"] == {"rounds_done": 1, "rounds": 3} and written["overall"]["ar"]["tokens"] > 0
    calls.clear()
    monkeypatch.setattr(LLMEngine, "generate", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    r = speed_cli(tiny_dirs, data, "--max-tokens", "4", "-k", "3", "--rounds", "3", "-o", str(out))
    assert r.exit_code == 130 and "nothing measured" in r.output and json.loads(out.read_text()) == written


def test_a_failed_run_leaves_no_folder_of_its_output_behind(tiny_dirs, tmp_path, monkeypatch):
    from dflash_trt.server import cli as server_cli

    data = one_prompt(tmp_path)
    for failure, code in ((ValueError("weights do not load"), 1), (KeyboardInterrupt(), 130)):
        monkeypatch.setattr(server_cli, "load_engine", lambda *a, _e=failure, **k: (_ for _ in ()).throw(_e))
        r = speed_cli(tiny_dirs, data, "-o", str(tmp_path / "new" / "speed.json"))
        assert r.exit_code == code and "Traceback" not in r.output, r.output
        assert not (tmp_path / "new").exists()
    assert "Interrupted while the model loaded: nothing measured" in r.output


def test_an_output_folder_that_cannot_be_written_is_refused_before_the_model_loads(tiny_dirs, tmp_path):
    data = one_prompt(tmp_path)
    r = speed_cli(tiny_dirs, data, "-o", "/proc/dflash-trt-test/speed.json")  # root may write anywhere but there
    assert r.exit_code == 2 and "Invalid value for --output" in r.output and "cannot write in /proc" in r.output, \
        r.output


def test_without_zlabs_package_the_peer_is_refused_before_the_model_loads(tiny_dirs, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "dflash.model", None)  # as where the package is not installed
    data = one_prompt(tmp_path)
    r = speed_cli(tiny_dirs, data, "--zlab-peer")
    assert r.exit_code == 2 and "pip install --no-deps dflash==0.1.0" in r.output and "Traceback" not in r.output, \
        r.output


def test_a_prompt_timed_again_is_prefilled_again(tiny_dirs, monkeypatch):
    """One prompt over several rounds (and the warm-up's prompt in the first) took over its earlier run's cached
    chunks: rounds after the first timed no prefill."""
    engine = LLMEngine.from_dirs(tiny_dirs["qwen3"], tiny_dirs["qwen3_drafter"],
                                 EngineConfig(dtype="float32", prefill_chunk=32))
    cached, generate = [], LLMEngine.generate

    def noting(self, *args, **kwargs):
        outs = generate(self, *args, **kwargs)
        cached.extend(o.num_cached_tokens for o in outs)
        return outs

    monkeypatch.setattr(LLMEngine, "generate", noting)
    long = BenchPrompt("a/0", "a", "the quick brown fox " * 4, 4)  # 80 tokens: two whole chunks of 32 to keep
    run_speed(engine, [long], SpeedConfig(draft_lens=[3], rounds=2), chat=False)
    assert len(cached) == 6 and set(cached) == {0}, cached  # AR and K=3: a warm-up and two rounds each
