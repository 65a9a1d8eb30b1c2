"""`bench plot`: throughput-versus-interactivity Pareto plots of `bench sweep` results
(tokens/s/GPU against tokens/s/user, one series per run, each run's frontier drawn as a line)."""

from __future__ import annotations

import json
import math
import os
import textwrap
from collections.abc import Sequence
from itertools import groupby
from pathlib import Path

from dflash_trt import dir_swap

X_KEY, Y_KEY = "tok_s_per_user", "tok_s_per_gpu"
LABEL_WIDTH, TITLE_WIDTH = 100, 75  # characters a legend label / the title runs to before wrapping


class UnsupportedFormat(ValueError):
    """The output's extension names an image format matplotlib cannot write."""


def pareto_frontier(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates (both coordinates maximised), ordered by x.
    Equal points do not dominate each other, so all copies of a frontier point are kept."""
    order = sorted(range(len(points)), key=lambda i: (-points[i][0], -points[i][1]))
    best_y = float("-inf")  # highest y among points with a strictly larger x
    frontier: list[int] = []
    for _, group in groupby(order, key=lambda i: points[i][0]):
        group = list(group)
        top = points[group[0]][1]  # the group is sorted by y, highest first
        if top > best_y:
            frontier.extend(i for i in group if points[i][1] == top)
            best_y = top
    return sorted(frontier, key=lambda i: (points[i][0], i))


def load_runs(paths: Sequence[str | Path]) -> list[dict]:
    """Sweep results (JSON written by `bench sweep`); a run without a label is named after its file."""
    runs = []
    for path in map(Path, paths):
        try:
            run = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot read a sweep result: {e}") from e
        points = run.get("points") if isinstance(run, dict) else None
        if not isinstance(points, list) or not all(
                isinstance(p, dict) and {"concurrency", X_KEY, Y_KEY} <= p.keys() for p in points):
            raise ValueError(f"{path}: not a bench sweep result (expected 'points' with concurrency, {X_KEY} "
                             f"and {Y_KEY})")
        label = run.get("label")
        if isinstance(label, bool) or not isinstance(label, (str, int, float, type(None))):
            raise ValueError(f"{path}: 'label' is {label!r}, not a string")
        # a hand-edited label of digits may have lost its quotes: it names the run all the same
        run["label"] = path.stem if label in (None, "") else str(label)
        for p in points:
            concurrency = p["concurrency"]
            if isinstance(concurrency, bool) or not isinstance(concurrency, int):
                raise ValueError(f"{path}: a point has concurrency={concurrency!r}, not a whole number")
            for key in (X_KEY, Y_KEY):  # None where a figure is undefined (a sweep writes that); else a number
                if p[key] is not None and not is_real(p[key]):
                    raise ValueError(f"{path}: the point at concurrency {p['concurrency']} has {key}={p[key]!r}, "
                                     "not a number")
            # Older sweeps recorded the mean of per-request 1 / TPOT, up to 30% above 1 / median TPOT where TPOT
            # varies (more with speculative decoding than without): every run, old or new, on one axis.
            tpot = p.get("tpot_s")
            p50 = tpot.get("p50") if isinstance(tpot, dict) else None
            if p50 is not None and not is_real(p50):
                raise ValueError(f"{path}: the point at concurrency {concurrency} has tpot_s.p50={p50!r}, not a "
                                 "number")
            if p50 is not None and p50 > 0:
                p[X_KEY] = 1.0 / p50
            # caveats() reports failures as "N of M": a count of failures needs the count of requests beside it
            failed, requests = p.get("num_failed"), p.get("num_requests")
            if failed is not None and (isinstance(failed, bool) or not isinstance(failed, int)):
                raise ValueError(f"{path}: the point at concurrency {concurrency} has num_failed={failed!r}, "
                                 "not a whole number")
            if failed and (isinstance(requests, bool) or not isinstance(requests, int)):
                raise ValueError(f"{path}: the point at concurrency {concurrency} has num_failed {failed} but "
                                 f"num_requests={requests!r}, not a whole number")
        runs.append(run)
    return runs


def is_real(value: object) -> bool:
    """A finite number, as a result file holds it (not a bool, which Python counts as one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _stopped(run: dict) -> dict:
    return run.get("stopped") if isinstance(run.get("stopped"), dict) else {}


def stopped_why(run: dict) -> str:
    """" (the sweep stopped: ERROR)" where the sweep recorded the error it stopped at, else ""."""
    error = _stopped(run).get("error")
    return f" (the sweep stopped: {error})" if error else ""


def plottable(run: dict) -> bool:
    """Whether a run has a point with both axes (a sweep of 1-token outputs has no TPOT, so no tok/s/user)."""
    return any(p.get(X_KEY) is not None and p.get(Y_KEY) is not None for p in run["points"])


def incomplete(run: dict) -> str | None:
    """Why a sweep did not run all its points ('complete': false), e.g. "stopped at concurrency 8: interrupted";
    None for a whole one, or an older result that does not say."""
    if run.get("complete") is not False:
        return None
    stopped = _stopped(run)
    if not stopped:  # written after each point: the sweep was killed, or is still running
        return "it did not finish: killed, or still running"
    where = f"stopped at concurrency {stopped['concurrency']}" if "concurrency" in stopped else "stopped in the warm-up"
    return f"{where}: {stopped['error']}" if stopped.get("error") else where


def caveats(run: dict) -> list[str]:
    """What makes a run's figures less than they seem, which its sweep recorded: requests that failed (a point's
    figures count only the answers that completed) and tokens counted from stream chunks (a speculative server
    sends several tokens a chunk, so they undercount)."""
    failed = [f"c={p['concurrency']}: {p['num_failed']} of {p['num_requests']}" for p in run["points"]
              if p.get("num_failed")]
    notes = ([f"requests failed ({', '.join(failed)}): those points count only the answers that completed"]
             if failed else [])
    if any(p.get("tokens_from") == "chunks" for p in run["points"]):
        notes.append("its tokens were counted from stream chunks, which undercount a server that sends several "
                     "tokens a chunk (sweep with --tokenizer where the endpoint sends no usage)")
    return notes


def mark_incomplete(runs: Sequence[dict]) -> None:
    """An incomplete sweep's label says so, as its frontier lacks the points it did not reach."""
    for run in runs:
        if incomplete(run) is not None:
            run["label"] = f"{run['label']} (incomplete)"


def distinct_labels(runs: Sequence[dict], paths: Sequence[str | Path]) -> None:
    """Runs sharing a label (two systems serving one model name, swept without --label) get after it the shortest
    trailing piece of their file's path that no other of them has: the file's stem ("m (ar)"), else with as many of
    its folders as it takes ("m (ar/run)" and "m (dflash/run)"), so a legend or a comparison can tell them apart."""
    labels = [r["label"] for r in runs]
    # absolute, so that "run.json" and "../dflash/run.json" are told apart by folder names, not by ".."
    parts = [Path(os.path.abspath(p)).parts[1:] for p in paths]

    def piece(i: int, depth: int) -> str:
        return "/".join([*parts[i][-depth:-1], Path(parts[i][-1]).stem])

    for i, run in enumerate(runs):
        if labels.count(labels[i]) < 2:
            continue
        # one file given twice cannot be told from itself: it is named alike
        others = [j for j, label in enumerate(labels) if label == labels[i] and parts[j] != parts[i]]
        depth = next((d for d in range(1, len(parts[i]) + 1) if all(piece(i, d) != piece(j, d) for j in others)),
                     None)
        # each run's own shortest piece: two runs' cannot be equal, as a folder name holds no "/", so the deeper
        # run's piece at the shallower depth would be that same string, which that depth ruled out
        run["label"] = f"{labels[i]} ({piece(i, depth) if depth else os.path.abspath(paths[i])})"


def plot_pareto(runs: Sequence[dict], out: str | Path, title: str | None = None) -> Path:
    """One image, in the format `out`'s extension names (PNG without one): every point of every run, annotated with
    its concurrency, and each run's frontier."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    out = Path(out)
    # explicit, as matplotlib would append ".png" to a name without an extension and write elsewhere than asked
    fmt = out.suffix[1:].lower() or "png"
    formats = FigureCanvasAgg.get_supported_filetypes()
    if fmt not in formats:
        raise UnsupportedFormat(f"{out}: matplotlib cannot write {fmt!r} images; use one of "
                                f"{', '.join(sorted(formats))}")
    fig = pareto_figure(runs, title)
    out.parent.mkdir(parents=True, exist_ok=True)
    # an image whole or the previous one: never half a PNG
    dir_swap.replace_file(out, lambda tmp: fig.savefig(tmp, dpi=120, format=fmt), output=True)
    return out


def pareto_figure(runs: Sequence[dict], title: str | None = None):
    """The matplotlib Figure plot_pareto saves."""
    # The Agg canvas is bound to this figure only: no pyplot, no process-wide backend switch.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, run in enumerate(runs):
        pts = [p for p in run["points"] if p.get(X_KEY) is not None and p.get(Y_KEY) is not None]
        if not pts:
            continue
        color = f"C{i % 10}"
        xy = [(p[X_KEY], p[Y_KEY]) for p in pts]
        ax.scatter([x for x, _ in xy], [y for _, y in xy], color=color, s=28, zorder=3)
        front = pareto_frontier(xy)
        # long labels (an engine's schedule and trees) wrap rather than run off the figure
        label = textwrap.fill(run.get("label") or f"run {i + 1}", LABEL_WIDTH)
        ax.plot([xy[j][0] for j in front], [xy[j][1] for j in front], color=color, marker="o", linewidth=1.8,
                label=label, zorder=2)
        for p, (x, y) in zip(pts, xy):
            ax.annotate(f"c={p['concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7,
                        color=color)
    ax.set_xlabel("tokens/s/user")
    ax.set_ylabel("tokens/s/GPU")
    ax.set_title(textwrap.fill(title or "Throughput vs interactivity", TITLE_WIDTH))
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        # below the axes, where constrained layout makes room for it: inside, five runs' labels covered the points
        fig.legend(loc="outside lower center", fontsize=8)
    return fig
