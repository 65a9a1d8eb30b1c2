"""Repeated sweeps: the median round per point, and paired ratios of two systems swept in alternation.

On a small shared machine one sweep point (a few seconds of requests) moves by up to 20% between passes, more
than the differences worth measuring. peers.sh therefore sweeps every system ROUNDS times in alternation
(AR, engine, AR, engine, ...), so that each round of one system has a neighbour of the other taken under the same
conditions. `merge` keeps, per concurrency, the round whose output tokens/s is the median: one real measurement
with all its latencies, not an average of percentiles. `compare` pairs two merged systems round by round.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence

from dflash_trt.bench.plot import is_real, stopped_why

METRIC = "output_tok_s"


def _points_by_concurrency(run: dict, where: str) -> dict[int, dict]:
    points = run.get("points")
    if not isinstance(points, list):
        raise ValueError(f"{where}: no 'points' (not a bench sweep result)")
    if not points:  # a sweep stopped before its first point, as `bench plot` says of it
        raise ValueError(f"{where}: has no points{stopped_why(run)}")
    out = {}
    for i, p in enumerate(points):
        if not isinstance(p, dict) or "concurrency" not in p or METRIC not in p:
            raise ValueError(f"{where}: points[{i}] lacks 'concurrency' or '{METRIC}'")
        c = p["concurrency"]
        if not is_real(c) or c != int(c) or c < 1:
            raise ValueError(f"{where}: points[{i}].concurrency is {c!r}, not a positive whole number")
        rounds = p.get("rounds_output_tok_s")
        for key, value in ((METRIC, p[METRIC]), *((f"rounds_output_tok_s[{j}]", v) for j, v in
                                                 enumerate(rounds if isinstance(rounds, list) else []))):
            if not is_real(value) or value < 0:
                raise ValueError(f"{where}: points[{i}].{key} is {value!r}, not a rate (a number >= 0)")
        if int(c) in out:
            raise ValueError(f"{where}: two points at concurrency {int(c)} (points[{i}] and an earlier one)")
        out[int(c)] = p
    return out


def merge_rounds(runs: Sequence[dict], names: Sequence[str] | None = None) -> dict:
    """One run from rounds of the same sweep: per concurrency, the round with the median output tokens/s (the
    lower middle of an even count), with every round's value under 'rounds_output_tok_s' in round order (the
    order of the rounds' dates where all record one, else as given)."""
    if not runs:
        raise ValueError("no rounds to merge")
    names = list(names) if names is not None else [f"round {i + 1}" for i in range(len(runs))]
    for run, name in zip(runs, names):
        points = run.get("points") if isinstance(run.get("points"), list) else []
        if "rounds" in run or any(isinstance(p, dict) and "rounds_output_tok_s" in p for p in points):
            raise ValueError(f"{name}: already a merge of {run.get('rounds', 'several')} rounds, not a round: "
                             "merge the round files it was made of instead")
    dates = [r.get("date") for r in runs]
    if all(isinstance(d, str) for d in dates):  # in the order they ran, which `compare` pairs by, whatever was passed
        order = sorted(range(len(runs)), key=lambda i: dates[i])
        runs, names = [runs[i] for i in order], [names[i] for i in order]
    labels = {r.get("label") for r in runs}
    if len(labels) > 1:
        raise ValueError(f"rounds of different systems: labels {sorted(map(str, labels))}")
    # A round is known by its start time and its measurements, so a copy under another name is the same round too.
    # The date alone is only to the second and absent from hand-made or older files; every latency of every point
    # alike as well is what two real rounds never record.
    seen: dict[str, str] = {}
    for run, name in zip(runs, names):
        key = json.dumps([run.get("date"), run.get("points")], sort_keys=True, default=repr)
        if key in seen:
            raise ValueError(f"{name} is the same round as {seen[key]} (date {run.get('date')!r} and the same "
                             "points): it would count twice")
        seen[key] = name
    first = _sweep_identity(runs[0])
    for run, name in zip(runs[1:], names[1:]):
        this = _sweep_identity(run)
        # a setting either round records: one that only the first round records must not pass unseen
        differ = [f"{key} {first.get(key)!r} in {names[0]}, {this.get(key)!r} here"
                  for key in dict.fromkeys([*first, *this]) if first.get(key) != this.get(key)]
        if differ:  # two systems under one label (the model name), or rounds of different sweeps
            raise ValueError(f"{name}: not a round of {names[0]}'s sweep ({'; '.join(differ[:3])})")
    by_round = [_points_by_concurrency(r, n) for r, n in zip(runs, names)]
    concurrencies = sorted(by_round[0])
    for pts, name in zip(by_round[1:], names[1:]):
        if sorted(pts) != concurrencies:
            raise ValueError(f"{name}: concurrencies {sorted(pts)} differ from {names[0]}'s {concurrencies}")
    points = []
    for c in concurrencies:
        values = [pts[c][METRIC] for pts in by_round]
        middle = sorted(range(len(values)), key=lambda i: values[i])[(len(values) - 1) // 2]
        points.append({**by_round[middle][c], "rounds_output_tok_s": values, "median_round": middle + 1})
    merged = {k: v for k, v in runs[0].items() if k != "points"}
    merged.update(points=points, rounds=len(runs), round_dates=[r.get("date") for r in runs])
    return merged


def _sweep_identity(run: dict) -> dict:
    """What rounds of one sweep share: the endpoint, the model, the dataset (where named) and the sweep's settings
    (all but the seed of the prompt order and how often /metrics is read, which a release may add or change)."""
    config = run.get("config") if isinstance(run.get("config"), dict) else {}
    dataset = run.get("dataset") if isinstance(run.get("dataset"), dict) else {}
    named = {"dataset": dataset["name"]} if dataset.get("name") is not None else {}
    from dflash_trt.bench.sweep import server_root  # (the sweep's HTTP client, loaded only where rounds are merged)

    def endpoint(url):  # given with or without its /v1, one endpoint
        return server_root(url) if isinstance(url, str) else url

    return {"url": endpoint(run.get("url")), "model": run.get("model"), **named,
            **{f"config.{k}": endpoint(v) if k == "url" else v for k, v in config.items()
               if k not in ("label", "seed", "metrics_settle_s", "metrics_every_s")}}


# What two systems compared on one workload share: the prompts (dataset, input length, the tokenizer that cut them,
# the system prompt they share, the turns a conversation holds), the output length and how requests ask for it.
# Endpoints, models and extra request fields are the systems' own.
WORKLOAD = ("dataset", "config.isl", "config.tokenizer", "config.prefix_len", "config.turns", "config.osl",
            "config.api", "config.temperature", "config.ignore_eos")


def workload_differences(run: dict, base: dict, names: Sequence[str] = ("run", "base")) -> list[str]:
    """The WORKLOAD settings in which two runs differ, each naming both values; a setting one of them does not
    record (an older result) is not taken to differ."""
    mine, theirs = _sweep_identity(run), _sweep_identity(base)
    return [f"{k} {mine[k]!r} in {names[0]}, {theirs[k]!r} in {names[1]}"
            for k in WORKLOAD if k in mine and k in theirs and mine[k] != theirs[k]]


def compare_runs(run: dict, base: dict, names: tuple[str, str] = ("run", "base")) -> list[dict]:
    """Per concurrency both measured: run over base by the merged (median-round) points, and round by round, where
    both were swept in the same number of alternating rounds. `names` (their files) name them in errors."""
    mine, theirs = _points_by_concurrency(run, names[0]), _points_by_concurrency(base, names[1])
    rows = []
    for c in sorted(mine.keys() & theirs.keys()):
        a, b = mine[c], theirs[c]
        if not b[METRIC]:
            raise ValueError(f"{names[1]}: {METRIC} 0 at concurrency {c} (every request failed?): no ratio to take")
        if 0 in (b.get("rounds_output_tok_s") or []):
            raise ValueError(f"{names[1]}: rounds_output_tok_s[{b['rounds_output_tok_s'].index(0)}] is 0 at "
                             f"concurrency {c} (every request of that round failed?): no paired ratio to take")
        row = {"concurrency": c, METRIC: a[METRIC], f"base_{METRIC}": b[METRIC], "ratio": a[METRIC] / b[METRIC]}
        ra, rb = a.get("rounds_output_tok_s"), b.get("rounds_output_tok_s")
        if ra and rb and len(ra) == len(rb):
            paired = [x / y for x, y in zip(ra, rb)]
            row.update(paired_ratios=paired, paired_median=statistics.median(paired),
                       paired_min=min(paired), paired_max=max(paired))
        rows.append(row)
    if not rows:
        raise ValueError(f"{names[0]} and {names[1]} share no concurrency")
    return rows
