"""spotline.exact.reduction: the gradient sum over logical workers is bitwise the same for every
grouping of the workers onto processes (real gloo processes), the float32 fold in logical
worker order, and refuses non-finite gradients."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_ranks

from spotline.exact.reduction import NonFiniteGradient, exact_sum, ordered_sum

WORKER = Path(__file__).parent / "workers" / "exact_worker.py"
sys.path.insert(0, str(WORKER.parent))
from exact_worker import NUM_LOGICAL_WORKERS, gradients  # noqa: E402


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.numpy().tobytes()).hexdigest()


def one_process() -> str:
    grads = gradients(None)
    return digest(exact_sum(list(enumerate(grads)), num_logical_workers=NUM_LOGICAL_WORKERS))


def test_float_sums_depend_on_the_grouping_so_a_plain_all_reduce_would_not_do() -> None:
    g = gradients(None)
    flat = g[0] + g[1] + g[2] + g[3] + g[4] + g[5]
    paired = (g[0] + g[1]) + (g[2] + g[3]) + (g[4] + g[5])
    assert not torch.equal(flat, paired)


def test_the_sum_is_the_float32_fold_in_logical_worker_order_close_to_the_true_sum() -> None:
    g = gradients(None)
    shuffled = [(w, g[w]) for w in (3, 0, 5, 1, 4, 2)]
    total = exact_sum(shuffled, num_logical_workers=NUM_LOGICAL_WORKERS)
    assert torch.equal(total, g[0] + g[1] + g[2] + g[3] + g[4] + g[5])
    # A float32 sum's error: at most (N - 1) units of 2**-24 of the sum of magnitudes.
    truth = ordered_sum(list(enumerate(g)))
    magnitudes = sum(x.abs().double() for x in g)
    assert bool(((total.double() - truth).abs() <= 5 * 2.0**-24 * magnitudes).all())
    scaled = exact_sum(shuffled, num_logical_workers=NUM_LOGICAL_WORKERS, scale=1 / 6)
    assert torch.equal(scaled, (g[0] + g[1] + g[2] + g[3] + g[4] + g[5]) * (1 / 6))


def test_zero_gradients_sum_to_zero_and_order_of_the_list_does_not_matter() -> None:
    zeros = [(w, torch.zeros(5)) for w in range(3)]
    assert torch.equal(exact_sum(zeros, num_logical_workers=3), torch.zeros(5))
    g = list(enumerate(gradients(None)))
    forward = exact_sum(g, num_logical_workers=6)
    backward = exact_sum(list(reversed(g)), num_logical_workers=6)
    assert torch.equal(forward, backward)


def test_a_non_finite_gradient_is_reported_with_its_worker() -> None:
    g = list(enumerate(gradients(4)))
    with pytest.raises(NonFiniteGradient, match=r"logical worker\(s\) \[4\]"):
        exact_sum(g, num_logical_workers=6)
    # Finite gradients whose sum overflows float32: refused too, naming no worker.
    big = [(w, torch.full((3,), 3e38)) for w in range(2)]
    with pytest.raises(NonFiniteGradient, match="overflowed float32") as caught:
        exact_sum(big, num_logical_workers=2)
    assert caught.value.logical_workers == ()


def test_a_logical_worker_twice_or_out_of_range_is_refused() -> None:
    g = gradients(None)
    with pytest.raises(ValueError, match="not distinct"):
        exact_sum([(0, g[0]), (0, g[1])], num_logical_workers=6)
    with pytest.raises(ValueError, match="not distinct"):
        exact_sum([(6, g[0])], num_logical_workers=6)


GROUPINGS = {
    "2x3": "0,1,2;3,4,5",
    "3x2": "0,1;2,3;4,5",
    "4-1-1": "0,1,2,3;4;5",
    "1-3-2 shuffled": "5;0,2,4;1,3",
    # Chunks of 3000 elements: several chunks, the last ragged with an empty shard.
    "2x3 in 3000-element chunks": "0,1,2;3,4,5#3000",
    "1-3-2 in 3000-element chunks": "5;0,2,4;1,3#3000",
}
POISONED = "0,1,2;3,4,5@4"
# Two logical workers on two processes: summed by a plain float all-reduce (spotline.exact.reduction's
# pair path), which must give the one-process fold's bits, g0 + g1; and its NaN refused.
PAIR = "0;1"
PAIR_POISONED = "0;1@1"


@pytest.fixture(scope="module")
def ranks_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[int, dict[str, Any]]]:
    """Every grouping and the poisoned case, each on its own gloo group of one launch of
    three processes: per case, each member rank's result."""
    out = tmp_path_factory.mktemp("exact")
    cases = [*GROUPINGS.values(), POISONED, PAIR, PAIR_POISONED]
    world = max(len(case.partition("#")[0].partition("@")[0].split(";")) for case in cases)
    codes = run_ranks(WORKER, world, [str(out), *cases], timeout=240)
    assert codes == [0] * world
    return [
        {
            rank: json.loads((out / f"case{i}-rank{rank}.json").read_text())
            for rank in range(len(case.partition("#")[0].partition("@")[0].split(";")))
        }
        for i, case in enumerate(cases)
    ]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_grouping_onto_processes_gives_the_same_bits(
    ranks_results: list[dict[int, dict[str, Any]]],
) -> None:
    expected = one_process()
    for name, results in zip(GROUPINGS, ranks_results, strict=False):
        assert {r["sha256"] for r in results.values()} == {expected}, name


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_non_finite_gradient_stops_every_process(
    ranks_results: list[dict[int, dict[str, Any]]],
) -> None:
    poisoned = ranks_results[len(GROUPINGS)]
    assert poisoned == {0: {"non_finite": [4]}, 1: {"non_finite": [4]}}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_workers_on_two_processes_give_the_one_process_fold(
    ranks_results: list[dict[int, dict[str, Any]]],
) -> None:
    g = gradients(None)
    local = exact_sum([(1, g[1]), (0, g[0])], num_logical_workers=2)
    assert torch.equal(local, g[0] + g[1])
    pair, poisoned = ranks_results[len(GROUPINGS) + 1 :]
    assert {r["sha256"] for r in pair.values()} == {digest(local)}
    assert poisoned == {0: {"non_finite": [1]}, 1: {"non_finite": [1]}}


def test_the_chunked_sum_equals_one_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of the reduction (reused buffers, a collective a chunk) change no bit: sizes
    around the chunk's edge, zeros and tiny values, several workers."""
    from spotline.exact import reduction as exact

    gen = torch.Generator().manual_seed(3)
    for numel in (exact.CHUNK - 1, exact.CHUNK, 2 * exact.CHUNK + 4101):
        grads = [(w, torch.randn(numel, generator=gen) * 1e-3) for w in range(3)]
        for _, g in grads:
            g[:8192] = 0  # zeros on every worker
        grads[1][1][12288:16384] *= 1e-35  # tiny values
        out = torch.empty(numel)
        chunked = exact_sum(grads, num_logical_workers=3, local=True, out=out)
        assert chunked.data_ptr() == out.data_ptr()
        monkeypatch.setattr(exact, "CHUNK", 1 << 40)
        whole = exact_sum(grads, num_logical_workers=3, local=True)
        monkeypatch.undo()
        assert torch.equal(chunked, whole), numel


def test_the_sharded_sum_sends_a_float_all_reduce_s_bytes_when_each_process_hosts_one() -> None:
    from spotline.exact.reduction import bytes_sent_per_process

    n = 1_000_000
    ring_float = 2 * 4 * n * 3 // 4  # a float32 ring all-reduce over 4 processes
    assert bytes_sent_per_process(n, [1, 1, 1, 1]) == ring_float
    assert bytes_sent_per_process(n, [2, 2, 2, 2]) == ring_float * 3 // 2
    assert bytes_sent_per_process(n, [4, 1, 1, 1]) == ring_float * 5 // 2  # the busiest
    assert bytes_sent_per_process(n, [6]) == 0


def test_one_logical_worker_is_its_own_sum_bit_for_bit() -> None:
    g = gradients(1)[0].clone()
    g[5] = float(g.abs().max()) * 2.0**-45  # tiny beside the largest: kept as it is
    out = torch.empty(g.numel())
    total = exact_sum([(0, g)], num_logical_workers=1, out=out)
    assert torch.equal(total, g) and total.data_ptr() == out.data_ptr()
    assert torch.equal(exact_sum([(0, g)], num_logical_workers=1, scale=0.5), g * 0.5)
    for bad in (float("nan"), float("inf"), float("-inf")):
        poisoned = g.clone()
        poisoned[3] = bad
        with pytest.raises(NonFiniteGradient, match=r"logical worker\(s\) \[0\]"):
            exact_sum([(0, poisoned)], num_logical_workers=1)


def test_reduced_gradients_are_sent_from_the_sum_s_buffer_without_a_copy() -> None:
    from spotline.exact.reduction import LogicalGradients
    from spotline.pipeline.replica_transport import joined_view

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in ((3, 4), (5,), (2, 2, 2))]
    logical = LogicalGradients(params, num_logical_workers=2)
    for worker in (0, 1):
        for p in params:
            p.grad = torch.randn_like(p)
        logical.keep(worker, zero=worker == 0)
    logical.reduce(local=True)
    grads = [p.grad.reshape(-1) for p in params if p.grad is not None]
    joined = joined_view(grads)
    # The replica's send: the very buffer the gradients are views of, equal to their cat.
    assert joined is not None and torch.equal(joined, torch.cat(grads))
    assert joined.data_ptr() == grads[0].data_ptr()
    # Not back to back, not in order, not one storage, or not one dtype: no view (a cat).
    assert joined_view(grads[::-1]) is None
    assert joined_view([grads[0], grads[2]]) is None
    assert joined_view([grads[0], grads[1].clone()]) is None
    assert joined_view([grads[0][:4], grads[0][5:]]) is None
    assert joined_view([grads[0], grads[1].view(torch.int32)]) is None
    assert joined_view([]) is None
    # A piece of the buffer mid-way is one too (its offset kept).
    middle = joined_view([grads[0][6:], grads[1]])
    assert middle is not None and middle.data_ptr() == grads[0][6:].data_ptr()
    assert torch.equal(middle, torch.cat([grads[0][6:], grads[1]]))


def test_a_gradient_kept_and_reduced_in_two_spans_has_the_whole_s_bits() -> None:
    """The last logical worker's untied gradients are reduced before its tied ones are final
    (``GradPart``): the sum is elementwise, so the two spans give the bits of one."""
    from spotline.exact.reduction import LogicalGradients

    shapes = ((3, 4), (5,), (2, 2, 2), (7,))
    split = 12 + 5  # the first two parameters are untied
    torch.manual_seed(0)
    grads = [[torch.randn(shape) for shape in shapes] for _ in range(3)]
    # The tied reduction changes the last worker's tied gradients after its untied ones
    # were kept and reduced.
    tied_final = [g * 3.0 for g in grads[2][2:]]

    def run(split_last: bool) -> torch.Tensor:
        params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
        logical = LogicalGradients(params, num_logical_workers=3)
        for worker in (0, 1):
            for p, g in zip(params, grads[worker], strict=True):
                p.grad = g.clone()
            logical.keep(worker)
        for p, g in zip(params, grads[2], strict=True):
            p.grad = g.clone()
        if split_last:
            logical.keep(2, zero=False, span=(0, split))
            logical.reduce(local=True, span=(0, split))
            assert logical.kept
        for p, g in zip(params[2:], tied_final, strict=True):
            p.grad = g.clone()
        if split_last:
            logical.keep(2, zero=False, span=(split, 32))
            logical.reduce(local=True, span=(split, 32))
        else:
            logical.keep(2, zero=False)
            logical.reduce(local=True)
        assert not logical.kept  # dropped with the span that ends the gradient
        return torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])

    assert torch.equal(run(split_last=True), run(split_last=False))
    with pytest.raises(AssertionError, match="cuts a parameter"):
        LogicalGradients([torch.nn.Parameter(torch.zeros(4))], 1).keep(0, span=(0, 2))


def test_a_gradient_kept_and_reduced_layer_by_layer_last_first_has_the_whole_s_bits() -> None:
    """Stage 0 keeps and reduces each layer as its backward pass makes it final, last layer
    first, and its tied prefix last (``StreamUntiedGrads``): any order of disjoint spans
    gives the bits of one reduction, and the kept gradients go once all are reduced."""
    from spotline.exact.reduction import LogicalGradients

    shapes = ((3,), (2, 2), (5,), (6,))  # spans (0, 3) tied; (3, 7), (7, 12), (12, 18)
    torch.manual_seed(1)
    grads = [[torch.randn(shape) for shape in shapes] for _ in range(2)]

    def run(spans: list[tuple[int, int]] | None) -> torch.Tensor:
        params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
        logical = LogicalGradients(params, num_logical_workers=2)
        for worker in (0, 1):
            for p, g in zip(params, grads[worker], strict=True):
                p.grad = g.clone()
            if worker == 0 or spans is None:
                logical.keep(worker, zero=worker == 0)
                continue
            for index, span in enumerate(spans):
                logical.keep(worker, zero=False, span=span)
                logical.reduce(local=True, span=span)
                assert bool(logical.kept) == (index < len(spans) - 1)
        if spans is None:
            logical.reduce(local=True)
        assert not logical.kept
        return torch.cat([p.grad.reshape(-1) for p in params])

    whole = run(None)
    assert torch.equal(run([(12, 18), (7, 12), (3, 7), (0, 3)]), whole)
    assert torch.equal(run([(7, 12), (12, 18), (0, 3), (3, 7)]), whole)
    # A span kept twice for one logical worker is a worker run twice.
    logical = LogicalGradients([torch.nn.Parameter(torch.zeros(3))] * 1, 1)
    logical.params[0].grad = torch.ones(3)
    logical.keep(0, zero=False, span=(0, 3))
    with pytest.raises(ValueError, match="ran twice"):
        logical.keep(0, zero=False, span=(0, 3))


def test_stage_0_streams_the_layers_after_its_tied_ones_last_first() -> None:
    """The layers a backward pass may send as it makes them final, and the messages owner
    and holder agree on (``streamed_layers``, ``replica_messages``)."""
    from spotline.pipeline.engine import replica_messages, streamed_layers

    # Stage 0 of a GPT-2: the embedding layer (a tied wte and a wpe), then two blocks.
    stage0 = [("0.wte", 10), ("0.wpe", 4), ("1.w", 6), ("1.b", 2), ("2.w", 6), ("2.b", 2)]
    tied = {"0.wte", "5.head"}
    assert streamed_layers(stage0, tied) == [(22, 30), (14, 22)]
    assert replica_messages(stage0, tied, streamed=True) == [(22, 30), (14, 22), (0, 14)]
    assert replica_messages(stage0, tied, streamed=False) == [(0, 30)]
    # Untied embeddings: every layer streams, nothing is left for after the pass.
    assert streamed_layers(stage0, set()) == [(22, 30), (14, 22), (0, 14)]
    assert replica_messages(stage0, set(), streamed=True) == [(22, 30), (14, 22), (0, 14)]
    # The last stage: its tied LM head is its last layer, so nothing streams; unstreamed,
    # its untied gradients and its tied suffix are two messages.
    last = [("3.w", 6), ("4.ln", 2), ("5.head", 10)]
    assert streamed_layers(last, tied) == []
    assert replica_messages(last, tied, streamed=False) == [(0, 8), (8, 18)]
    # A tied parameter in a middle layer: only the layers after that one stream.
    assert streamed_layers(stage0, {"1.b"}) == [(22, 30)]


def test_only_a_tied_suffix_after_untied_parameters_splits_a_stage() -> None:
    from spotline.pipeline.engine import untied_prefix

    params = [("3.a", 4), ("3.b", 5), ("4.head", 6)]
    assert untied_prefix(params, {"4.head", "0.wte"}) == 9
    assert untied_prefix(params, set()) is None  # nothing tied
    assert untied_prefix(params, {"3.a", "3.b", "4.head"}) is None  # nothing before it
    assert untied_prefix(params, {"3.a"}) is None  # stage 0's: tied first
    assert untied_prefix(params, {"3.b"}) is None  # tied among the others
