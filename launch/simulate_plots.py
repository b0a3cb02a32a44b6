"""``spotline simulate``'s figures: a trace run's timeline (live nodes, throughput,
committed samples per policy) and a sweep's metrics against the preemption rate.

Drawn on matplotlib's Agg canvas with no pyplot state; matplotlib is imported only when a
figure is drawn (it costs a second)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from spotline.plan.traces import Trace, live_nodes_over_time
from spotline.sim.results import PolicyResult
from spotline.sim.sim_config import PolicyName
from spotline.sim.sweep import Aggregate

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def trace_run_figure(trace: Trace, results: Mapping[PolicyName, PolicyResult]) -> Figure:
    """The trace run's figure (what ``timeline.png`` shows): live spot nodes over the trace,
    and per policy with a recorded timeline its windowed throughput and committed samples.
    Drawn on matplotlib's Agg canvas, no pyplot state; returned so that tests can read its
    series."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    hours = 1.0 / 3600.0
    figure = Figure(figsize=(10, 9))
    FigureCanvasAgg(figure)
    top, middle, bottom = figure.subplots(3, 1, sharex=True)
    points = live_nodes_over_time(trace)
    xs = [t * hours for t, _ in points] + [trace.duration_s * hours]
    ys = [count for _, count in points] + [points[-1][1]]
    top.step(xs, ys, where="post", color="black")
    top.set_ylabel("live spot nodes")
    top.set_title(f"trace: {trace.source}")
    num_bins = 48
    window_s = trace.duration_s / num_bins if trace.duration_s > 0 else 1.0
    grid = [window_s * i for i in range(num_bins + 1)]
    for policy, result in results.items():
        if not result.timeline:
            continue
        done = [_committed_at(result, t) for t in grid]
        rates = [(done[i + 1] - done[i]) / window_s for i in range(num_bins)]
        middle.step([t * hours for t in grid], rates + [rates[-1]], where="post", label=policy)
        bottom.plot([t * hours for t in grid], done, label=policy)
    middle.set_ylabel(f"samples/s ({window_s / 60:.0f}-min windows)")
    middle.legend(loc="lower right", fontsize="small")
    bottom.set_ylabel("committed samples")
    bottom.set_xlabel("hours")
    bottom.legend(loc="upper left", fontsize="small")
    figure.tight_layout()
    return figure


def plot_trace_run(
    output: Path, trace: Trace, results: dict[PolicyName, PolicyResult]
) -> list[Path]:
    path = output / "timeline.png"
    trace_run_figure(trace, results).savefig(path, dpi=100)
    return [path]


def _committed_at(result: PolicyResult, t_s: float) -> float:
    """Committed samples at ``t_s`` from a recorded timeline: the last recorded state plus
    its rate since then (steps commit one at a time, so this is exact to one step)."""
    current = result.timeline[0]
    for point in result.timeline:
        if point.t_s > t_s:
            break
        current = point
    return current.committed_samples + current.samples_per_s * max(0.0, t_s - current.t_s)


# (metric, y-axis label, file name) of each sweep plot
SWEEP_PLOTS: tuple[tuple[str, str, str], ...] = (
    ("samples_per_usd", "samples per $", "value_vs_rate.png"),
    ("samples_per_s", "samples/s", "throughput_vs_rate.png"),
)


def sweep_figures(results: Mapping[float, Mapping[PolicyName, Aggregate]]) -> dict[str, Figure]:
    """One figure per :data:`SWEEP_PLOTS` entry, by file name: the metric against the
    preemption rate, one line per policy (Agg canvas, no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rates = sorted(results)
    policies = list(next(iter(results.values())))
    figures: dict[str, Figure] = {}
    for metric, label, name in SWEEP_PLOTS:
        figure = Figure(figsize=(8, 5))
        FigureCanvasAgg(figure)
        axes = figure.subplots()
        for policy in policies:
            axes.plot(
                rates, [results[r][policy].get(metric) for r in rates], marker="o", label=policy
            )
        axes.set_xlabel("preemptions per node-hour")
        axes.set_ylabel(label)
        axes.legend()
        axes.grid(True, alpha=0.3)
        figure.tight_layout()
        figures[name] = figure
    return figures


def plot_sweep(output: Path, results: dict[float, dict[PolicyName, Aggregate]]) -> list[Path]:
    written: list[Path] = []
    for name, figure in sweep_figures(results).items():
        path = output / name
        figure.savefig(path, dpi=100)
        written.append(path)
    return written
