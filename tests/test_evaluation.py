"""Evaluation: the held-out rows, the micro-batches by index, the exact reduction, the best
model written atomically, the coordinator's reports, and one real run with a kill between
two evaluations whose every number equals the single-process reference's."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from conftest import NO_DROPOUT, read_summary, run_spotline, small_config, write_config

from spotline.config import parse_config, with_overrides
from spotline.data.corpus import PackedCorpus
from spotline.data.instructions import IGNORE_INDEX
from spotline.errors import UserError
from spotline.launch.control.metrics import RunMetrics
from spotline.launch.flags import FLAG_KEYS
from spotline.plan.evaluation import (
    EvalBatches,
    LossSum,
    best_step,
    eval_steps,
    holdout_split,
    improves,
    is_due,
    reduce_losses,
)
from spotline.reference import train_reference
from spotline.reports.tracking import BEST_MODEL
from spotline.runtime import param_sha256
from spotline.wire.protocol import EvalResult, eval_key
from spotline.worker.export import EVAL_NOTE
from spotline.worker.validator import (
    EVAL_MODELS,
    EvalSet,
    evaluate_model,
    prepare_eval_set,
    publish_best,
    token_loss_sum,
)

# -- the config ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("evaluation", "needles"),
    [
        (
            {"data": "eval.txt", "holdout_fraction": 0.1},
            ["'spotline.evaluation.data' and 'spotline.evaluation.holdout_fraction'", "not both"],
        ),
        ({"holdout_fraction": 0.0}, ["holdout_fraction' is 0.0", "between 0 and 1"]),
        ({"holdout_fraction": 1}, ["holdout_fraction' is 1.0", "between 0 and 1"]),
        ({"holdout_fraction": -0.5}, ["holdout_fraction' is -0.5"]),
        (
            {"holdout_fraction": 0.1, "interval_steps": 0},
            ["'spotline.evaluation.interval_steps' is 0", "positive integer"],
        ),
        ({"data": "e.txt", "max_samples": 0}, ["'spotline.evaluation.max_samples' is 0"]),
        ({"interval_steps": 5}, ["interval_steps' is set but there is no evaluation set"]),
        ({"holdout_fractoin": 0.1}, ["'spotline.evaluation.holdout_fractoin' is unknown"]),
        ({"holdout_fraction": "10%"}, ['is "10%"; expected a number or null']),
    ],
)
def test_bad_evaluation_settings_are_one_line(evaluation: dict[str, Any], needles: list[str]):
    with pytest.raises(UserError) as refused:
        parse_config(small_config(evaluation=evaluation))
    message = str(refused.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_evaluation_flags_and_defaults() -> None:
    assert {k: v for k, v in FLAG_KEYS.items() if k.startswith("eval")} == {
        "eval_data": "spotline.evaluation.data",
        "eval_holdout": "spotline.evaluation.holdout_fraction",
        "eval_every": "spotline.evaluation.interval_steps",
        "eval_max_samples": "spotline.evaluation.max_samples",
    }
    assert not parse_config({}).spotline.evaluation.enabled
    cfg = with_overrides(
        parse_config(small_config()), {"spotline.evaluation.holdout_fraction": 0.2}
    )
    assert cfg.spotline.evaluation.enabled and cfg.spotline.evaluation.interval_steps is None


def test_a_resume_keeps_the_evaluation() -> None:
    """A held-out fraction decides the rows trained on, and the evaluations so far are the
    stopped run's: a resume must keep the section (one line naming the key)."""
    from spotline.config_resume import resume_mismatch

    stopped = parse_config(small_config(evaluation={"holdout_fraction": 0.1, "interval_steps": 2}))
    assert resume_mismatch(stopped, stopped) is None
    moved = with_overrides(stopped, {"spotline.evaluation.holdout_fraction": 0.2})
    assert resume_mismatch(stopped, moved) == (
        "spotline.evaluation.holdout_fraction is 0.2 here but 0.1 in the stopped run; it "
        "decides the math and must match"
    )


# -- the rows --------------------------------------------------------------------------


def test_holdout_split_is_seeded_disjoint_and_complete() -> None:
    split = holdout_split(1000, 0.15, seed=7)
    assert len(split.held_out) == 150 and len(split.train) == 850
    assert set(split.held_out).isdisjoint(split.train)
    assert sorted(split.held_out + split.train) == list(range(1000))
    assert list(split.held_out) == sorted(split.held_out)
    # The run's seed decides it, and nothing else: the same in every process and run.
    assert holdout_split(1000, 0.15, seed=7) == split
    assert holdout_split(1000, 0.15, seed=8).held_out != split.held_out
    # Spread over the data, not its first rows.
    assert split.held_out[-1] > 500 and split.held_out[0] < 500
    assert holdout_split(9, 0.1, seed=7).held_out == ()  # floor: a caller refuses that


def _corpus(rows: int, row_len: int = 9) -> PackedCorpus:
    return PackedCorpus(np.arange(rows * row_len, dtype=np.int64).reshape(rows, row_len))


def test_held_out_rows_are_never_trained_on() -> None:
    """The sampler draws from the training corpus's rows only: the held-out rows are gone
    from it, and the eval set holds exactly them (then the first max_samples)."""
    corpus = _corpus(200)
    cfg = parse_config(small_config(evaluation={"holdout_fraction": 0.25, "max_samples": 30}))
    train, eval_set = prepare_eval_set(cfg, corpus)
    assert eval_set is not None
    split = holdout_split(200, 0.25, cfg.spotline.training.seed)
    assert np.array_equal(train.tokens, corpus.tokens[list(split.train)])
    assert np.array_equal(eval_set.corpus.tokens, corpus.tokens[list(split.held_out[:30])])
    trained = {tuple(row) for row in train.tokens.tolist()}
    assert not trained & {tuple(row) for row in eval_set.corpus.tokens.tolist()}
    assert dict(eval_set.description) == {
        "source": "holdout",
        "holdout_fraction": 0.25,
        "held_out_rows": 50,
        "train_rows": 150,
        "rows": 30,
        "micro_batches": 8,  # 30 rows of micro-batches of 4: the last one topped up
    }


def test_too_small_sets_are_refused_in_one_line() -> None:
    cfg = parse_config(small_config(evaluation={"holdout_fraction": 0.02}))
    with pytest.raises(UserError, match="smaller than one micro-batch of 4 rows"):
        prepare_eval_set(cfg, _corpus(100))  # 2 rows held out
    # The rows left must still fill a training step (2 logical workers x 2 x 4 = 16).
    cfg = parse_config(small_config(evaluation={"holdout_fraction": 0.9}))
    with pytest.raises(UserError, match="leaving 2, fewer than the 16 one training step needs"):
        prepare_eval_set(cfg, _corpus(20))
    cfg = parse_config(small_config(evaluation={"holdout_fraction": 0.5, "max_samples": 3}))
    with pytest.raises(UserError, match="limited to 3 by --eval-max-samples"):
        prepare_eval_set(cfg, _corpus(100))


# -- the micro-batches and the reduction -----------------------------------------------


@pytest.mark.parametrize("num_rows", [4, 9, 30])
def test_eval_micro_batches_do_not_depend_on_the_placement(num_rows: int) -> None:
    batches = EvalBatches(num_rows, 4)
    rows = [list(batches.rows(m)) for m in range(batches.num_micro_batches)]
    assert sum(rows, []) == list(range(num_rows))  # by index, in order
    for pipelines in range(1, 6):
        # However many pipelines there are, each micro-batch is run once, with its rows.
        ran = sorted(m for p in range(pipelines) for m in batches.of_pipeline(p, pipelines))
        assert ran == list(range(batches.num_micro_batches))


def test_a_topped_up_micro_batch_counts_only_its_rows() -> None:
    corpus = _corpus(6, row_len=5)
    eval_set = EvalSet(corpus, EvalBatches(6, 4), {})
    input_ids, labels = eval_set.batch(1)  # rows 4 and 5, and two ignored rows
    assert input_ids.shape == labels.shape == (4, 4)
    assert torch.equal(labels[:2], corpus.batch([4, 5])[1])
    assert bool((labels[2:] == IGNORE_INDEX).all())
    logits = torch.randn(4, 4, 16, generator=torch.Generator().manual_seed(0))
    labels = torch.where(labels == IGNORE_INDEX, labels, labels % 16)  # within 16 classes
    loss_sum, tokens = token_loss_sum(logits, labels).tolist()
    alone_sum, alone_tokens = token_loss_sum(logits[:2], labels[:2]).tolist()
    assert tokens == alone_tokens == 8
    assert loss_sum == pytest.approx(alone_sum, rel=1e-6)


def test_the_reduction_is_exact_in_any_order() -> None:
    # Float addition is not associative: summed naively, the order changes the result.
    sums = [1e16, 1.0, -1e16, 3.0, 0.1, 2.5e-8]
    assert (sums[0] + sums[1]) + sums[2] != (sums[0] + sums[2]) + sums[1]
    parts = [LossSum(m, value, 2) for m, value in enumerate(sums)]
    mean, tokens = reduce_losses(parts, len(parts))
    assert tokens == 12 and mean == math.fsum(sums) / 12
    for shift in range(1, len(parts)):
        assert reduce_losses(parts[shift:] + parts[:shift], len(parts)) == (mean, tokens)
    assert reduce_losses(list(reversed(parts)), len(parts)) == (mean, tokens)
    with pytest.raises(ValueError, match="once each"):
        reduce_losses(parts[1:], len(parts))
    with pytest.raises(ValueError, match="no counted token"):
        reduce_losses([LossSum(0, 0.0, 0)], 1)


def test_when_to_evaluate_and_which_is_best() -> None:
    assert eval_steps(2, 6) == (2, 4, 6)
    assert eval_steps(4, 6) == (4, 6)
    assert eval_steps(None, 5) == (5,)
    assert [s for s in range(8) if is_due(s, 3, 7)] == [3, 6, 7]
    earlier = {2: 4.0, 4: 3.5, 6: 3.5}
    assert improves(3.4, 8, earlier)
    assert not improves(3.5, 8, earlier)  # a tie keeps the earlier best
    assert improves(3.9, 4, {2: 4.0, 4: 3.0, 6: 1.0})  # later ones (a replay) are ignored
    assert best_step(earlier) == 4 and best_step({}) is None


# -- the best model ----------------------------------------------------------------------


def _write_model(contents: str) -> Any:
    """A stand-in for save_pretrained: files in a temporary directory, renamed into place."""

    def write(directory: Path) -> None:
        staged = directory.with_name(f".{directory.name}.tmp")
        staged.mkdir()
        (staged / "weights").write_text(contents)
        os.rename(staged, directory)

    return write


def test_best_is_swapped_atomically(tmp_path: Path) -> None:
    first = publish_best(tmp_path, _write_model("step 2"), 2)
    best = tmp_path / BEST_MODEL
    assert best.is_symlink() and best.resolve() == first.resolve()
    assert os.readlink(best) == os.path.join(EVAL_MODELS, first.name)  # relative: movable

    def crash(directory: Path) -> None:
        _write_model("half")(directory.with_name("unrelated"))
        directory.with_name(f".{directory.name}.tmp").mkdir()
        raise OSError("No space left on device")

    with pytest.raises(OSError):
        publish_best(tmp_path, crash, 4)
    # The crash left the previous best, whole, behind the link.
    assert (best / "weights").read_text() == "step 2"
    second = publish_best(tmp_path, _write_model("step 6"), 6)
    assert (best / "weights").read_text() == "step 6"
    # Earlier bests and what the crash left are gone; no staged link is left over.
    assert [p.name for p in (tmp_path / EVAL_MODELS).iterdir()] == [second.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == [BEST_MODEL, EVAL_MODELS]


# -- the coordinator's reports ------------------------------------------------------------


class _Store:
    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value

    def get(self, key: str) -> bytes:
        return self.values[key].encode()

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def add(self, key: str, value: int) -> int:
        raise AssertionError("not used")


def test_the_coordinator_takes_each_evaluation_once(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = parse_config(small_config(evaluation={"holdout_fraction": 0.1, "interval_steps": 2}))
    store = _Store()
    metrics = RunMetrics(cfg, store, snapshot=lambda: (0, 2, {"w0": "p0:s0", "w1": "p0:s1"}))
    first = EvalResult(2, 5.25, math.exp(5.25), 640, best=True)
    later = EvalResult(4, 5.5, math.exp(5.5), 640, best=False)
    metrics.collect_evaluations()
    assert metrics.evaluations == {}
    store.set(eval_key(2), first.encode())
    for _ in range(3):  # polled again and again; a replay writes the same value again
        metrics.collect_evaluations()
        store.set(eval_key(2), first.encode())
    store.set(eval_key(4), later.encode())
    metrics.collect_evaluations()
    assert metrics.evaluations == {2: first, 4: later}
    lines = [line for line in capsys.readouterr().err.splitlines() if "eval loss" in line]
    assert lines == [
        "spotline: step 2/4 eval loss 5.2500 ppl 190.57 (best)",
        "spotline: step 4/4 eval loss 5.5000 ppl 244.69",
    ]
    assert [(row.event, row.step, row.eval_loss) for row in metrics.timeline.rows] == [
        ("eval", 2, 5.25),
        ("eval", 4, 5.5),
    ]
    summary = metrics.summary(
        wall=1.0,
        train_wall_s=1.0,
        layout=None,
        generations=1,
        checkpoint_interval_steps=0,
        resumed_from_step=None,
    )
    assert summary["eval"] == [first.to_json(), later.to_json()]
    assert summary["best_eval"] == {**first.to_json(), "model": BEST_MODEL}
    assert EvalResult.decode(first.encode()) == first and eval_key(2) == "evaluation/2"


def test_a_checkpoint_keeps_the_evaluations_up_to_its_step(tmp_path: Path) -> None:
    """What a ``--resume`` from it reports again and puts back in the store for rank 0."""
    import hashlib

    from spotline.checkpointing.manifest import read_metadata, step_dir
    from spotline.launch.control.checkpoints import EVALUATIONS, CheckpointCommits

    cfg = parse_config(small_config(evaluation={"holdout_fraction": 0.1, "interval_steps": 2}))
    store = _Store()
    metrics = RunMetrics(cfg, store, snapshot=lambda: (0, 2, {}))
    checkpoints = CheckpointCommits(cfg, store, metrics, tmp_path, interval_steps=2)
    at_two = EvalResult(2, 5.25, math.exp(5.25), 640, best=True)
    store.set(eval_key(2), at_two.encode())
    directory = step_dir(cfg.checkpoint_root(tmp_path), 2)
    directory.mkdir(parents=True)
    for label in ("stage-0", "stage-1"):
        data = label.encode()
        (directory / f"{label}.pt").write_bytes(data)
        meta = {"file": f"{label}.pt", "size": 7, "sha256": hashlib.sha256(data).hexdigest()}
        (directory / f"{label}.meta.json").write_text(json.dumps(meta))
    checkpoints.commit(last=2)
    assert checkpoints.committed == {2}
    saved = read_metadata(checkpoints.root, 2)[EVALUATIONS]
    assert {int(s): EvalResult.from_json(raw) for s, raw in saved.items()} == {2: at_two}


# -- end to end ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--eval-holdout", "1.5"], ["holdout_fraction' is 1.5"]),
        (["--eval-data", "{tiny}"], ["--eval-data", "tiny.txt", "smaller than one micro-batch"]),
    ],
    ids=["fraction", "too-small-file"],
)
def test_bad_evaluation_input_is_one_line_and_writes_nothing(
    tmp_path: Path, flags: list[str], needles: list[str]
) -> None:
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("only a few words\n")
    out = tmp_path / "out"
    proc = run_spotline(
        ["train", *[flag.format(tiny=tiny) for flag in flags], "--output", str(out)], timeout=120
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("spotline: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    assert not out.exists()


EVAL_TEXT = (
    "The river ran past the mill and under the old stone bridge.\n"
    "A small boat waited by the steps, its rope wet from the morning rain.\n"
    "Children counted the ducks that came to the bank for bread.\n"
    "The baker opened his shop at six and the street smelled of warm loaves.\n"
    "In the evening the lamps came on one by one along the quay.\n"
) * 2  # 19 rows of 33 tokens: 5 micro-batches, the last one topped up


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_evaluation_is_exact_through_a_kill_and_the_best_model_loads(tmp_path: Path) -> None:
    """4 workers x 2 stages, evaluated every 2 steps on a file, worker 1 SIGKILLed in step
    4 (between the evaluations after steps 2 and 4; the next generation runs one pipeline).
    Every evaluation, loss and the parameter hash equal the single-process reference's
    bit for bit; evaluating did not change training (the reference without evaluation
    ends with the same hash); the best model and its tokenizer load with transformers and
    give its evaluation's loss again."""
    eval_file = tmp_path / "eval.txt"
    eval_file.write_text(EVAL_TEXT)
    config = small_config(
        model={"name": "gpt2-tiny", "overrides": NO_DROPOUT},
        evaluation={"data": str(eval_file), "interval_steps": 2},
    )
    out = tmp_path / "run"
    proc = run_spotline(
        ["train", "--config", str(write_config(tmp_path / "c.json", config))]
        + ["--workers", "4", "--stages", "2", "--inject", "kill:4:1:forward", "--output", str(out)]
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = read_summary(out)
    assert (summary["preemptions"], summary["recoveries"], summary["checkpoint_fallbacks"]) == (
        1,
        1,
        0,
    )

    placement = {"spotline.topology.workers": 4, "spotline.topology.stages": 2}
    cfg = with_overrides(parse_config(config), placement)
    reference = train_reference(cfg)
    assert [e["step"] for e in summary["eval"]] == [2, 4]
    assert summary["eval"] == reference["eval"]  # every number, ==
    assert summary["best_eval"] == reference["best_eval"]
    assert summary["losses"] == reference["losses"]
    assert summary["param_sha256"] == reference["param_sha256"]
    without = train_reference(with_overrides(cfg, {"spotline.evaluation.data": None}))
    assert without["param_sha256"] == reference["param_sha256"]
    assert summary["data"]["eval"] == {
        "source": "file",
        "path": str(eval_file),
        "format": "text",
        "rows": 19,
        "micro_batches": 5,
    }

    # Each evaluation reported once, on its own progress line.
    for result in summary["eval"]:
        lines = [
            line for line in proc.stderr.splitlines() if f"step {result['step']}/4 eval" in line
        ]
        assert lines == [
            f"spotline: step {result['step']}/4 eval loss {result['loss']:.4f} "
            f"ppl {result['perplexity']:.2f}{' (best)' if result['best'] else ''}"
        ]
    timeline = (out / "timeline.csv").read_text().splitlines()
    assert timeline[0].endswith(",eval_loss")
    evals = [line for line in timeline if ",eval," in line]
    assert [float(line.rsplit(",", 1)[1]) for line in evals] == [e["loss"] for e in summary["eval"]]

    # The best model: a complete save_pretrained directory, the tokenizer beside it.
    best = out / BEST_MODEL
    assert best.is_symlink()
    note = json.loads((best / EVAL_NOTE).read_text())
    assert {**note, "model": BEST_MODEL} == summary["best_eval"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(best)
    expected = reference["best_parameters"]
    assert param_sha256(dict(loaded.named_parameters())) == param_sha256(expected)
    _, eval_set = prepare_eval_set(cfg, PackedCorpus(np.zeros((16, 33), dtype=np.int64)))
    assert eval_set is not None
    assert evaluate_model(loaded, eval_set) == (note["loss"], note["tokens"])
    twin = transformers.AutoModelForCausalLM.from_pretrained(best)
    with torch.no_grad():
        for name, param in twin.named_parameters():
            param.copy_(expected[name])
        input_ids = eval_set.batch(0)[0]
        assert torch.equal(loaded(input_ids=input_ids).logits, twin(input_ids=input_ids).logits)
    for directory in (best, out / "model"):
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
        assert tokenizer("river")["input_ids"] == list(b"river")
