"""Repeated sweeps: the merged point is a real round's, the median one; paired ratios pair rounds in order."""

from __future__ import annotations

import json
import statistics

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_trt.bench.rounds import compare_runs, merge_rounds
from dflash_trt.cli import main


def sweep_run(label: str, tok_s: dict[int, float], date: str = "d") -> dict:
    return {"label": label, "date": date, "points": [
        {"concurrency": c, "output_tok_s": v, "tok_s_per_user": v / c, "tok_s_per_gpu": v, "ttft_s": {"p50": 1.0 / v}}
        for c, v in tok_s.items()]}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.floats(1, 1000), min_size=3, max_size=3), min_size=1, max_size=7))
def test_each_point_is_the_round_with_the_median_throughput(values):
    runs = [sweep_run("ar", dict(zip((1, 2, 4), v)), date=f"r{i}") for i, v in enumerate(values)]
    merged = merge_rounds(runs)
    assert merged["rounds"] == len(values) and merged["round_dates"] == [f"r{i}" for i in range(len(values))]
    for j, p in enumerate(merged["points"]):
        column = [v[j] for v in values]
        assert p["rounds_output_tok_s"] == column
        assert p["output_tok_s"] == sorted(column)[(len(column) - 1) // 2]
        if len(column) % 2:
            assert p["output_tok_s"] == statistics.median(column)
        # the whole point comes from that one round: its latencies too
        assert p["ttft_s"]["p50"] == 1.0 / p["output_tok_s"]
        assert column[p["median_round"] - 1] == p["output_tok_s"]


def test_rounds_of_different_systems_or_concurrencies_are_refused():
    with pytest.raises(ValueError, match="different systems"):
        merge_rounds([sweep_run("ar", {1: 1.0}), sweep_run("engine", {1: 1.0})])
    with pytest.raises(ValueError, match=r"r2\.json: concurrencies \[1\] differ"):
        merge_rounds([sweep_run("ar", {1: 1.0, 2: 2.0}), sweep_run("ar", {1: 1.0})], names=["r1.json", "r2.json"])
    with pytest.raises(ValueError, match="no 'points'"):
        merge_rounds([{"label": "ar"}])


def test_rounds_read_with_other_metrics_cadences_are_one_sweep():
    """How often a sweep reads /metrics is how it reads, not what it measures: rounds from before a release added
    metrics_every_s merge with rounds after it; a setting of the workload still tells sweeps apart."""
    config = {"concurrencies": [1], "osl": 64, "metrics_settle_s": 0.2}
    old, new = sweep_run("ar", {1: 1.0}, "r1"), sweep_run("ar", {1: 2.0}, "r2")
    old["config"], new["config"] = config, {**config, "metrics_every_s": 2.0, "metrics_settle_s": 0.5}
    assert merge_rounds([old, new])["rounds"] == 2
    new["config"]["osl"] = 32
    with pytest.raises(ValueError, match="osl"):
        merge_rounds([old, new])


def test_rounds_against_one_endpoint_given_with_and_without_v1_are_one_sweep():
    """`--url` takes the server with or without /v1: two rounds against one server were refused as other endpoints."""
    old, new = sweep_run("ar", {1: 1.0}, "r1"), sweep_run("ar", {1: 2.0}, "r2")
    for run, url in ((old, "http://127.0.0.1:8000/v1"), (new, "http://127.0.0.1:8000/")):
        run["url"], run["config"] = url, {"url": url, "osl": 64}
    assert merge_rounds([old, new])["rounds"] == 2
    new["url"] = new["config"]["url"] = "http://127.0.0.1:8001"
    with pytest.raises(ValueError, match="url"):
        merge_rounds([old, new])


def test_paired_ratios_pair_the_rounds_in_order():
    ar = merge_rounds([sweep_run("ar", {1: v, 8: 10 * v}) for v in (100.0, 80.0, 120.0)])
    engine = merge_rounds([sweep_run("engine", {1: v, 8: 10 * v}) for v in (110.0, 84.0, 114.0)])
    rows = compare_runs(engine, ar)
    assert [r["concurrency"] for r in rows] == [1, 8]
    assert rows[0]["ratio"] == pytest.approx(110.0 / 100.0)  # median round against median round
    assert rows[0]["paired_ratios"] == pytest.approx([1.1, 1.05, 0.95])
    assert rows[0]["paired_median"] == pytest.approx(1.05)
    assert (rows[0]["paired_min"], rows[0]["paired_max"]) == pytest.approx((0.95, 1.1))
    single = compare_runs(sweep_run("engine", {1: 50.0}), sweep_run("ar", {1: 100.0, 2: 1.0}))
    assert single == [{"concurrency": 1, "output_tok_s": 50.0, "base_output_tok_s": 100.0, "ratio": 0.5}]  # no rounds
    with pytest.raises(ValueError, match="share no concurrency"):
        compare_runs(sweep_run("engine", {1: 50.0}), sweep_run("ar", {2: 1.0}))


def test_rounds_merge_in_the_order_they_ran_whatever_order_they_are_given():
    # compare pairs rounds by position: ar's round 2 must meet engine's round 2, taken beside it
    rounds = [sweep_run("ar", {1: v}, date=f"2026-12-05T10:0{i}:00+00:00") for i, v in enumerate((100.0, 80.0, 120.0))]
    merged = merge_rounds([rounds[2], rounds[0], rounds[1]], names=["c.json", "a.json", "b.json"])
    assert merged["points"][0]["rounds_output_tok_s"] == [100.0, 80.0, 120.0]
    assert merged["round_dates"] == [r["date"] for r in rounds]


def test_merge_plot_and_compare_warn_of_failed_requests_and_tokens_counted_from_chunks(tmp_path):
    run = sweep_run("ar", {1: 100.0, 2: 150.0})
    run["points"][1].update(num_failed=2, num_requests=8)
    run["points"][0]["tokens_from"] = "chunks"
    (tmp_path / "a.json").write_text(json.dumps(run))
    (tmp_path / "b.json").write_text(json.dumps(sweep_run("engine", {1: 90.0, 2: 140.0})))
    for args in (["merge", str(tmp_path / "a.json"), "-o", str(tmp_path / "m.json")],
                 ["plot", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "-o", str(tmp_path / "p.png")],
                 ["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]):
        res = CliRunner().invoke(main, ["bench", *args])
        assert res.exit_code == 0, res.output
        assert "requests failed (c=2: 2 of 8)" in res.output and "counted from stream chunks" in res.output, args
        assert res.output.count("warning: ") == 2


def test_merge_and_compare_commands(tmp_path):
    for system, values in (("ar", (100.0, 90.0, 95.0)), ("engine", (99.0, 97.0, 96.0))):
        for i, v in enumerate(values):
            (tmp_path / f"{system}.r{i}.json").write_text(json.dumps(sweep_run(system, {1: v})))
        res = CliRunner().invoke(main, ["bench", "merge", *(str(tmp_path / f"{system}.r{i}.json") for i in range(3)),
                                        "-o", str(tmp_path / f"{system}.json")])
        assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "ar.json").read_text())["points"][0]["output_tok_s"] == 95.0
    assert (tmp_path / "ar.csv").read_text().splitlines()[1].count("[100.0, 90.0, 95.0]") == 1
    res = CliRunner().invoke(main, ["bench", "compare", str(tmp_path / "engine.json"), str(tmp_path / "ar.json"), "--json"])
    assert res.exit_code == 0, res.output
    row = json.loads(res.output)[0]
    assert row["ratio"] == pytest.approx(97.0 / 95.0) and row["paired_ratios"] == pytest.approx([0.99, 97 / 90, 96 / 95])
    text = CliRunner().invoke(main, ["bench", "compare", str(tmp_path / "engine.json"), str(tmp_path / "ar.json")])
    assert text.exit_code == 0 and "engine vs ar" in text.output and "1.02x" in text.output
    bad = CliRunner().invoke(main, ["bench", "merge", str(tmp_path / "ar.r0.json"), str(tmp_path / "engine.r0.json"),
                                    "-o", str(tmp_path / "x.json")])
    assert bad.exit_code != 0 and "different systems" in bad.output and not (tmp_path / "x.json").exists()


def test_rounds_of_another_sweep_under_the_same_label_are_refused_naming_what_differs():
    # Two systems serving one model name share the default label; their endpoints and settings tell them apart.
    a = sweep_run("smollm2", {1: 1.0}) | {"url": "http://127.0.0.1:8000", "config": {"osl": 64, "seed": 0}}
    b = sweep_run("smollm2", {1: 2.0}) | {"url": "http://127.0.0.1:8001", "config": {"osl": 64, "seed": 1}}
    with pytest.raises(ValueError, match=r"b\.json: not a round of a\.json's sweep \(url 'http://127.0.0.1:8000'"):
        merge_rounds([a, b], names=["a.json", "b.json"])
    c = sweep_run("smollm2", {1: 2.0}) | {"url": "http://127.0.0.1:8000", "config": {"osl": 128, "seed": 1}}
    with pytest.raises(ValueError, match="config.osl 64 in a.json, 128 here"):
        merge_rounds([a, c], names=["a.json", "c.json"])
    same = sweep_run("smollm2", {1: 3.0}) | {"url": "http://127.0.0.1:8000", "config": {"osl": 64, "seed": 7}}
    assert merge_rounds([a, same])["rounds"] == 2  # another seed of the prompt order is another round


def test_a_round_that_lacks_a_setting_the_other_records_is_refused_in_either_order():
    # an older result without isl against one swept with --isl: which file comes first must not decide
    new = sweep_run("m", {1: 1.0}) | {"config": {"osl": 64, "isl": 1024}}
    old = sweep_run("m", {1: 2.0}) | {"config": {"osl": 64}}
    for runs, names in (([new, old], ["new.json", "old.json"]), ([old, new], ["old.json", "new.json"])):
        with pytest.raises(ValueError, match=f"{names[1]}: not a round of {names[0]}'s sweep.*config.isl"):
            merge_rounds(runs, names=names)


@pytest.mark.parametrize("setting, mine, theirs", [
    ("config.isl", 1024, 8192), ("config.tokenizer", "Qwen/Qwen3-8B", None), ("config.osl", 64, 128),
    ("dataset", "cpu-small", "gpu-1k1k"), ("config.turns", 1, 4),
])
def test_compare_warns_naming_the_files_where_the_workloads_differ(tmp_path, setting, mine, theirs):
    def with_setting(run: dict, value) -> dict:
        run |= {"config": {"osl": 64, "isl": None, "tokenizer": None, "api": "chat"}, "dataset": {"name": "cpu-small"}}
        if setting == "dataset":
            run["dataset"]["name"] = value
        else:
            run["config"][setting.removeprefix("config.")] = value
        return run

    (tmp_path / "a.json").write_text(json.dumps(with_setting(sweep_run("a", {1: 2.0}), mine)))
    (tmp_path / "b.json").write_text(json.dumps(with_setting(sweep_run("b", {1: 1.0}), theirs)))
    res = CliRunner().invoke(main, ["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert res.exit_code == 0 and "2.00x" in res.stdout, res.output
    warning = " ".join(res.stderr.split())
    assert "warning" in warning and setting in warning and repr(mine) in warning and repr(theirs) in warning, warning
    assert str(tmp_path / "a.json") in warning and str(tmp_path / "b.json") in warning
    # the same workload under other systems' settings (endpoint, extra request fields) compares without a word
    (tmp_path / "c.json").write_text(json.dumps(with_setting(sweep_run("c", {1: 1.0}), mine)
                                                | {"url": "http://other:8000"}))
    res = CliRunner().invoke(main, ["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "c.json")])
    assert res.exit_code == 0 and res.stderr == "", res.output


def test_compare_tells_runs_of_one_label_apart_by_their_files_and_refuses_a_zero_base(tmp_path):
    (tmp_path / "ar.json").write_text(json.dumps(sweep_run("m", {1: 50.0})))
    (tmp_path / "dflash.json").write_text(json.dumps(sweep_run("m", {1: 75.0})))
    res = CliRunner().invoke(main, ["bench", "compare", str(tmp_path / "dflash.json"), str(tmp_path / "ar.json")])
    assert res.exit_code == 0 and "m (dflash) vs m (ar)" in res.output and "1.50x" in res.output, res.output
    zero = sweep_run("z", {1: 1.0})
    zero["points"][0]["output_tok_s"] = 0.0
    (tmp_path / "zero.json").write_text(json.dumps(zero))
    res = CliRunner().invoke(main, ["bench", "compare", str(tmp_path / "ar.json"), str(tmp_path / "zero.json")])
    assert res.exit_code == 1 and "output_tok_s 0 at concurrency 1" in res.output and "Traceback" not in res.output


def test_a_sweep_stopped_before_its_first_point_is_named_so(tmp_path):
    """It was called "not a bench sweep result", as `bench plot` does not."""
    stopped = sweep_run("s", {}) | {"stopped": {"error": "ConnectError: refused"}}
    with pytest.raises(ValueError, match=r"s\.json: has no points \(the sweep stopped: ConnectError: refused\)"):
        compare_runs(stopped, sweep_run("b", {1: 1.0}), ("s.json", "b.json"))
    with pytest.raises(ValueError, match=r"s\.json: no 'points' \(not a bench sweep result\)"):
        compare_runs({"label": "s"}, sweep_run("b", {1: 1.0}), ("s.json", "b.json"))


def test_a_zero_round_in_the_base_is_named_as_the_round(tmp_path):
    """The merged figure was 102.3; the message blamed it, not the round."""
    base = sweep_run("b", {1: 102.3})
    base["points"][0]["rounds_output_tok_s"] = [101.0, 102.3, 0.0]
    with pytest.raises(ValueError, match=r"b\.json: rounds_output_tok_s\[2\] is 0 at concurrency 1 \(every request "
                                         r"of that round failed\?\)"):
        compare_runs(sweep_run("a", {1: 90.0}), base, ("a.json", "b.json"))


@pytest.mark.parametrize("field, value, words", [
    ("output_tok_s", True, r"points\[1\]\.output_tok_s is True, not a rate"),  # read as 1.0: "128.85x"
    ("output_tok_s", float("nan"), r"points\[1\]\.output_tok_s is nan, not a rate"),  # "nanx", and NaN in --json
    ("output_tok_s", -5.0, r"points\[1\]\.output_tok_s is -5\.0, not a rate"),  # "-25.77x"
    ("output_tok_s", None, r"points\[1\]\.output_tok_s is None, not a rate"),
    ("rounds_output_tok_s", [1.0, "x"], r"points\[1\]\.rounds_output_tok_s\[1\] is 'x', not a rate"),
    ("concurrency", 1, r"two points at concurrency 1 \(points\[1\]"),  # the last one was silently kept
    ("concurrency", 2.5, r"points\[1\]\.concurrency is 2\.5, not a positive whole number"),
    ("concurrency", float("inf"), r"points\[1\]\.concurrency is inf, not a positive whole number"),  # JSON's Infinity
])
def test_compare_names_the_point_and_field_a_hand_edited_run_gets_wrong(tmp_path, field, value, words):
    run = sweep_run("a", {1: 10.0, 4: 20.0})
    run["points"][1][field] = value
    with pytest.raises(ValueError, match=r"a\.json: " + words):
        compare_runs(run, sweep_run("b", {1: 5.0, 4: 10.0}), ("a.json", "b.json"))


def test_merge_refuses_a_csv_output_that_would_overwrite_its_own_json(tmp_path):
    (tmp_path / "r1.json").write_text(json.dumps(sweep_run("ar", {1: 1.0})))
    res = CliRunner().invoke(main, ["bench", "merge", str(tmp_path / "r1.json"), "-o", str(tmp_path / "run.csv")])
    assert res.exit_code == 2 and "--output" in res.output and "RESULT.json" in res.output, res.output
    assert not (tmp_path / "run.csv").exists()


def test_merge_refuses_a_round_given_twice_or_copied_naming_both_files(tmp_path):
    r1 = sweep_run("ar", {1: 100.0, 2: 150.0}, date="2026-12-05T10:00:00+00:00")
    r2 = sweep_run("ar", {1: 90.0, 2: 140.0}, date="2026-12-05T10:02:00+00:00")
    (tmp_path / "r1.json").write_text(json.dumps(r1))
    (tmp_path / "r2.json").write_text(json.dumps(r2))
    (tmp_path / "copy.json").write_text(json.dumps(r1, indent=1))  # a copy of r1 is r1, whatever its name
    for again in ("r1.json", "copy.json"):
        res = CliRunner().invoke(main, ["bench", "merge", str(tmp_path / "r1.json"), str(tmp_path / "r2.json"),
                                        str(tmp_path / again), "-o", str(tmp_path / "m.json")])
        assert res.exit_code == 1 and "Traceback" not in res.output, res.output
        assert f"{tmp_path / again} is the same round as {tmp_path / 'r1.json'}" in res.output, res.output
        assert "count twice" in res.output
        assert not (tmp_path / "m.json").exists()
    # rounds that only share a date (to the second), or only their numbers, are two rounds
    same_date = sweep_run("ar", {1: 95.0, 2: 150.0}, date=r1["date"])
    same_numbers = sweep_run("ar", {1: 100.0, 2: 150.0}, date="2026-12-05T10:04:00+00:00")
    assert merge_rounds([r1, same_date, same_numbers])["rounds"] == 3


def test_merge_refuses_an_already_merged_result_as_a_round(tmp_path):
    merged = merge_rounds([sweep_run("ar", {1: v}, date=f"r{i}") for i, v in enumerate((100.0, 90.0, 95.0))])
    (tmp_path / "ar.json").write_text(json.dumps(merged))
    (tmp_path / "r4.json").write_text(json.dumps(sweep_run("ar", {1: 80.0}, date="r4")))
    for rounds in (["ar.json", "r4.json"], ["r4.json", "ar.json"], ["ar.json"]):
        res = CliRunner().invoke(main, ["bench", "merge", *(str(tmp_path / r) for r in rounds),
                                        "-o", str(tmp_path / "m.json")])
        assert res.exit_code == 1 and "Traceback" not in res.output, res.output
        assert f"{tmp_path / 'ar.json'}: already a merge of 3 rounds" in " ".join(res.output.split()), res.output
        assert not (tmp_path / "m.json").exists()
