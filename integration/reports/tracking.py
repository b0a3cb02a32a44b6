"""What a run reports: ``summary.json``, wandb, and the progress display (rank 0 only)."""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from spotline.atomic_files import write_json_atomic
from spotline.config import TrackingSection
from spotline.plan.evaluation import best_step

# Named in spotline.run_dir with everything else a run writes; imported from here too.
from spotline.run_dir import BEST_MODEL as BEST_MODEL
from spotline.run_dir import SUMMARY_NAME as SUMMARY_NAME
from spotline.run_dir import WANDB_RUN_NAME as WANDB_RUN_NAME
from spotline.wire.protocol import EvalResult


def wandb_run_of(output_dir: Path) -> tuple[str, int, int]:
    """The output directory's wandb run id (a new one for a new directory), the number of
    steps already logged to it (steps below it are not logged again) and the number of the
    run's events already logged (the run's events are one list over its parts)."""
    path = output_dir / WANDB_RUN_NAME
    if path.is_file():
        saved = json.loads(path.read_text())
        return str(saved["id"]), int(saved["logged_steps"]), int(saved.get("logged_events", 0))
    return uuid.uuid4().hex[:16], 0, 0


def eval_fields(evaluations: Mapping[int, EvalResult]) -> dict[str, Any]:
    """``summary.json``'s evaluations: ``eval``, every one in step order (``step``, ``loss``,
    ``perplexity``, ``tokens``, ``best``: it beat every earlier one), and ``best_eval``, the
    lowest loss (the earliest on a tie) with ``model``, the directory its model was saved
    to (None without evaluations)."""
    best = best_step({step: r.loss for step, r in evaluations.items()})
    return {
        "eval": [evaluations[step].to_json() for step in sorted(evaluations)],
        "best_eval": (
            None if best is None else {**evaluations[best].to_json(), "model": BEST_MODEL}
        ),
    }


class Tracker:
    """Per-step metrics to wandb and a progress bar, both on rank 0 only.

    wandb runs offline by default (no account, no network); ``tracking.wandb = "online"``
    uses the user's configured account, ``"disabled"`` turns it off.
    """

    def __init__(
        self,
        settings: TrackingSection,
        *,
        enabled: bool,
        output_dir: Path,
        total_steps: int,
        run_config: dict[str, Any],
    ) -> None:
        self.enabled = enabled
        self._run: Any = None
        self._bar: Any = None
        self.logged_events = 0
        if not enabled:
            return
        if settings.wandb != "disabled":
            import wandb

            mode = os.environ.get("WANDB_MODE", settings.wandb)
            self._run_id, self._logged, self.logged_events = wandb_run_of(output_dir)
            self._next = self._logged
            self._output_dir = output_dir
            self._save_run()
            self._run = wandb.init(
                id=self._run_id,
                resume="allow",
                project=settings.project,
                name=settings.run_name,
                dir=str(output_dir),
                # wandb's annotation omits modes its settings accept (e.g. "dryrun")
                mode=mode,  # type: ignore[arg-type]
                config=run_config,
                reinit="finish_previous",
                settings=wandb.Settings(silent=True, console="off"),
            )
        if settings.progress and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, desc="spotline", unit="step", dynamic_ncols=True)
        self._plain_progress = settings.progress and self._bar is None
        self._total = total_steps

    def _save_run(self) -> None:
        record = {
            "id": self._run_id,
            "logged_steps": self._next,
            "logged_events": self.logged_events,
        }
        write_json_atomic(self._output_dir / WANDB_RUN_NAME, record)

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        # A resumed run does not log again the steps its earlier part logged.
        if self._run is not None and step >= self._logged:
            self._run.log(metrics, step=step)
            self._next = max(self._next, step + 1)
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{metrics['loss']:.4f}")
            self._bar.update(1)
        elif self._plain_progress and (step + 1) % max(1, self._total // 10) == 0:
            # Not a terminal (CI, a pipe): a line every tenth of the run instead of a bar.
            print(
                f"spotline: step {step + 1}/{self._total} loss {metrics['loss']:.4f}",
                file=sys.stderr,
                flush=True,
            )

    def log_eval(self, result: EvalResult) -> None:
        """An evaluation: ``eval/loss`` and ``eval/perplexity`` to wandb at its step (the
        step whose loss the same parameters give), and a progress line."""
        if not self.enabled:
            return
        if self._run is not None and result.step >= self._logged:
            self._run.log(
                {"eval/loss": result.loss, "eval/perplexity": result.perplexity}, step=result.step
            )
        if self._bar is not None or self._plain_progress:
            line = eval_line(result, self._total)
            if self._bar is not None:
                self._bar.write(line, file=sys.stderr)
            else:
                print(line, file=sys.stderr, flush=True)

    def log_event(self, name: str, payload: Mapping[str, Any], *, step: int) -> None:
        """The run's next event, at ``step`` (wandb's steps only grow: a step below the last
        one logged is raised to it), counted in ``logged_events``."""
        if self.enabled and self._run is not None:
            values = {f"event/{name}/{k}": v for k, v in payload.items()}
            # The earliest step still open: this part's last logged one, or the first step
            # this part logs (the earlier parts' steps are closed).
            floor = max(self._logged, self._next - 1)
            self._run.log({f"event/{name}": 1, **values}, step=max(step, floor))
            self.logged_events += 1

    def finish(self, summary: dict[str, Any] | None) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        if self._run is not None:
            if summary is not None:
                for key, value in summary.items():
                    if isinstance(value, (int, float, str)):
                        self._run.summary[key] = value
            self._run.finish()
            self._save_run()


def eval_line(result: EvalResult, total_steps: int) -> str:
    """The progress line of an evaluation (both entry points print it)."""
    return (
        f"spotline: step {result.step}/{total_steps} eval loss {result.loss:.4f} "
        f"ppl {result.perplexity:.2f}{' (best)' if result.best else ''}"
    )
