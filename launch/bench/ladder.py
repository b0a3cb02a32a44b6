"""The model ladder: the same benchmark on models of growing size, in one invocation.

Spotline's fixed per-step costs (the commit barrier, the exact clip norm, the seeding, the
store writes) weigh the most on the tiny model, where a step is tens of milliseconds. A rung
is a model with the shape of the batch it is measured on (``seq_len`` tokens a sequence,
``micro_batch_size`` sequences a micro-batch), sized for a 2-core CPU host: ``*-tiny`` as
every earlier figure, ``*-mid`` a few million parameters, ``*-big`` a step of 1-3 s.

``spotline bench <name> --model gpt2-big`` runs one rung; ``--ladder gpt2`` runs every rung
of a family and :func:`format_ladder` prints each headline ratio against the parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotline.errors import UserError


@dataclass(frozen=True)
class Rung:
    """A ladder model and the batch shape it is benchmarked with."""

    model: str
    seq_len: int
    micro_batch_size: int


RUNGS: dict[str, Rung] = {
    r.model: r
    for r in (
        # The tiny rungs keep the shape of configs/default.json: the earlier figures.
        Rung("gpt2-tiny", seq_len=32, micro_batch_size=8),
        Rung("gpt2-mid", seq_len=128, micro_batch_size=2),
        Rung("gpt2-big", seq_len=128, micro_batch_size=2),
        Rung("llama-tiny", seq_len=32, micro_batch_size=8),
        Rung("llama-mid", seq_len=128, micro_batch_size=2),
        Rung("llama-big", seq_len=128, micro_batch_size=2),
    )
}
LADDERS: dict[str, tuple[str, ...]] = {
    "gpt2": ("gpt2-tiny", "gpt2-mid", "gpt2-big"),
    "llama": ("llama-tiny", "llama-mid", "llama-big"),
}
# The benchmarks a ladder runs (the cluster ones time losses on namespaces, not a model).
LADDER_BENCHES = ("foundation", "redundancy", "easyscale", "reduce", "recovery", "takeover")


def model_overrides(model: str) -> dict[str, Any]:
    """Config overrides for ``--model``: the model, and a rung's batch shape.

    A model off the ladder (another preset, a ``save_pretrained`` directory) keeps the base
    config's sequence length and micro-batch size.
    """
    overrides: dict[str, Any] = {"spotline.model.name": model}
    rung = RUNGS.get(model)
    if rung is not None:
        overrides["spotline.model.seq_len"] = rung.seq_len
        overrides["train_micro_batch_size_per_gpu"] = rung.micro_batch_size
    return overrides


def ladder_models(family: str) -> tuple[str, ...]:
    if family not in LADDERS:
        raise UserError(f"--ladder {family!r}: no such ladder; use one of {', '.join(LADDERS)}")
    return LADDERS[family]


def parameters(model: str) -> int:
    """The model's parameter count (tied weights once), from its config; imports torch."""
    from spotline.models import layers as models

    hf_config = models.load_hf_config(model)
    module = models.reference_model(hf_config, 0)
    return sum(p.numel() for p in module.parameters())


Spread = dict[str, float]


def _foundation(report: dict[str, Any]) -> dict[str, Spread]:
    return {
        "spotline / stock step": report["spread"]["step_time_s"],
        "spotline (redundancy off) / stock step": report["spread"]["off_step_time_s"],
    }


def _redundancy(report: dict[str, Any]) -> dict[str, Spread]:
    out = {}
    for case in report["cases"]:
        # The modes the case ran (``--modes`` may leave some out), each over off.
        for mode, m in case["modes"].items():
            if mode != "off":
                out[f"{mode} / off step, {case['case']}"] = m["spread_to_off"]
    return out


def _easyscale(report: dict[str, Any]) -> dict[str, Spread]:
    return {
        "dp_engine / stock step": report["spread"]["exact"],
        "spotline train / stock step": report["spread"]["spotline"],
    }


def _reduce(report: dict[str, Any]) -> dict[str, Spread]:
    return {"exact / float reduction": report["time_ratio_spread"]}


def _recovery(report: dict[str, Any]) -> dict[str, Spread]:
    goodput = report["ratios"]["goodput_ratio"]
    return {
        "failover / checkpoint-restart goodput": {"min": goodput, "median": goodput, "max": goodput}
    }


def _takeover(report: dict[str, Any]) -> dict[str, Spread]:
    return {
        "takeover s (noticed to next committed step)": report["recovery_s"],
        "takeover s over its state time (redo left out)": report["over_state_s"],
    }


HEADLINES: dict[str, Callable[[dict[str, Any]], dict[str, Spread]]] = {
    "foundation": _foundation,
    "redundancy": _redundancy,
    "easyscale": _easyscale,
    "reduce": _reduce,
    "recovery": _recovery,
    "takeover": _takeover,
}


def ladder_report(bench: str, rungs: Sequence[tuple[str, int, dict[str, Any]]]) -> dict[str, Any]:
    """The ladder's record: per rung (model, parameters, report) its headline spreads."""
    return {
        "bench": f"{bench}-ladder",
        "statistic": "per rung the median, min and max over interleaved rounds",
        "rungs": [
            {
                "model": model,
                "parameters": params,
                "headline": HEADLINES[bench](report),
                "report": report,
            }
            for model, params, report in rungs
        ],
    }


def format_ladder(report: dict[str, Any]) -> str:
    """One row per rung and headline: the ratio against the model's size."""
    rows = [
        f"### {report['bench']}: ratio against model size (median, min-max over rounds)",
        "",
        "| model | parameters | ratio | median | min | max |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for rung in report["rungs"]:
        for name, s in rung["headline"].items():
            rows.append(
                f"| {rung['model']} | {rung['parameters']:,} | {name} | {s['median']:.3f} "
                f"| {s['min']:.3f} | {s['max']:.3f} |"
            )
    return "\n".join(rows)


def plot_ladder(report: dict[str, Any], path: Path) -> None:
    """Each headline ratio against the parameters (log scale): the median with its min-max
    over rounds as an error bar; a dashed line at 1 (no cost). PNG, written atomically."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from spotline.atomic_files import write_bytes_atomic

    figure = Figure(figsize=(7, 4.2))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    names = list(dict.fromkeys(n for rung in report["rungs"] for n in rung["headline"]))
    for name in names:
        rows = [
            (r["parameters"], r["headline"][name]) for r in report["rungs"] if name in r["headline"]
        ]
        xs = [p for p, _ in rows]
        med = [s["median"] for _, s in rows]
        low = [s["median"] - s["min"] for _, s in rows]
        high = [s["max"] - s["median"] for _, s in rows]
        axes.errorbar(xs, med, yerr=[low, high], marker="o", capsize=4, label=name)
    for rung in report["rungs"]:
        axes.annotate(
            rung["model"],
            (rung["parameters"], 1.0),
            textcoords="offset points",
            xytext=(0, -14),
            ha="center",
            fontsize=8,
        )
    axes.axhline(1.0, linestyle="--", color="grey", linewidth=1)
    axes.set_xscale("log")
    axes.set_xlabel("parameters")
    axes.set_ylabel("ratio (median, min-max over rounds)")
    axes.set_title(f"{report['bench']}: ratio against model size")
    axes.legend(fontsize=8)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    write_bytes_atomic(path, buffer.getvalue())
