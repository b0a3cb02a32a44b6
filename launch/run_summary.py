"""A finished run's summary on the console (``spotline train``'s last lines, and
``launch/train.py``'s): the counts of ``summary.json`` in words."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spotline.plan.memory_estimate import COUNTED_KINDS, size
from spotline.reports.timeline import counted


def format_summary(s: dict[str, Any], output: Path) -> str:
    """The run's summary on the console. Each count is ``summary.json``'s key of that name:
    ``recoveries`` is every recovery from a loss, in memory or from a checkpoint (one per
    ``recovery_events`` entry, ``recovery_summary.num_recoveries``), ``checkpoint_fallbacks``
    those losses that went back to a checkpoint, ``hung_workers`` (shown when any) workers
    killed as hung, which are losses but not preemptions."""
    first, last = s["losses"][0], s["final_loss"]
    loss = (
        f"loss {first:.4f} -> {last:.4f}" if first is not None and last is not None else "loss n/a"
    )
    hung = s.get("hung_workers", 0)
    return "\n".join(
        [
            f"spotline: trained {s['model']} for {counted(s['steps'], 'step')} on "
            f"{counted(s['workers'], 'worker')} ({counted(s['stages'], 'stage')} x "
            f"{counted(s['pipelines'], 'pipeline')} running {s['logical_workers']} logical, "
            f"redundancy {s['redundancy']})",
            f"  {loss}   {s['samples_per_s']:.1f} samples/s   {s['wall_s']:.1f} s",
            f"  preemptions {s['preemptions']}  {f'hung workers {hung}  ' if hung else ''}"
            f"recoveries {s['recoveries']}  checkpoint fallbacks {s['checkpoint_fallbacks']}  "
            f"steps redone {s.get('steps_redone', 0)}",
            *recovery_lines(s),
            *memory_lines(s),
            *eval_lines(s, output),
            f"  param_sha256 {s['param_sha256']}",
            f"  summary: {output / 'summary.json'}   model: {output / 'model'}",
            # Last, where it is read: the hash above is then not a promise.
            *(f"  not bitwise reproducible: {why}" for why in s.get("bitwise_caveats", [])),
        ]
    )


def memory_lines(s: dict[str, Any]) -> list[str]:
    """The largest worker's model state as estimated before the start (the fields the
    workers count) beside the largest one counted from the tensors, and its activations'
    estimate (a formula; they are not counted)."""
    estimates = s.get("memory_estimate_per_stage") or []
    counted = s.get("model_state_bytes_per_rank") or []
    if not estimates or not counted:
        return []
    estimate = max(sum(e[kind] for kind in COUNTED_KINDS) for e in estimates)
    activations = max(e["activations"] for e in estimates)
    largest = max(sum(c[kind] for kind in COUNTED_KINDS) for c in counted)
    return [
        f"  memory per worker: model state {size(estimate)} estimated, {size(largest)} counted; "
        f"activations {size(activations)} estimated"
    ]


def eval_lines(s: dict[str, Any], output: Path) -> list[str]:
    """The last evaluation and the best one (whose model is ``best`` in the output)."""
    evaluations = s.get("eval") or []
    best = s.get("best_eval")
    if not evaluations or best is None:
        return []
    last = evaluations[-1]
    return [
        f"  eval loss {last['loss']:.4f} ppl {last['perplexity']:.2f} at step {last['step']}; "
        f"best {best['loss']:.4f} at step {best['step']}: {output / best['model']}"
    ]


def recovery_lines(s: dict[str, Any]) -> list[str]:
    """What the recoveries were, in words: in memory (Spotline's point) or from disk.

    Whether the parameters equal an undisturbed run's cannot be known inside one run (that
    needs the other run): only what this run did is said."""
    events = s.get("recovery_events", [])
    in_memory = [e["recovery_s"] for e in events if e.get("in_memory")]
    if not in_memory:
        return []
    times = ", ".join(f"{t:.2f} s" for t in in_memory)
    takeovers = counted(len(in_memory), "takeover")
    fallbacks = s.get("checkpoint_fallbacks", 0)
    if fallbacks:
        return [f"  {takeovers} in memory in {times}; {fallbacks} fallback(s) to a checkpoint"]
    # What was lost, by the summary's counts: workers killed as hung are losses, not
    # preemptions (and "the loss" alone read as the training loss).
    lost = [
        counted(count, noun)
        for count, noun in (
            (s["preemptions"], "preemption"),
            (s.get("hung_workers", 0), "hung worker"),
        )
        if count
    ]
    what = " and ".join(lost) or counted(len(in_memory), "failure")
    if len(in_memory) == 1:
        return [f"  {what} survived in memory in {times} (no checkpoint read)"]
    return [f"  {what} survived in memory ({takeovers}: {times}; no checkpoint read)"]
