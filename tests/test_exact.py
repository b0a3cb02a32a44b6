"""spotline.exact: the gradient sum over logical workers is bitwise the same for every
grouping of the workers onto processes (real gloo processes), close to the exact sum, and
refuses non-finite gradients."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_ranks

from spotline.exact import BLOCK, NonFiniteGradient, exact_sum, fraction_bits, ordered_sum

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


def test_the_exact_sum_is_within_its_rounding_bound_of_the_true_sum() -> None:
    g = gradients(None)
    total = exact_sum(list(enumerate(g)), num_logical_workers=NUM_LOGICAL_WORKERS)
    truth = ordered_sum(list(enumerate(g)))
    # Rounding to fixed point: at most half a unit of 2**(e - F) per worker; then one
    # rounding to float32 of the result.
    largest = max(float(x.abs().max()) for x in g)
    unit = 2.0 ** (
        torch.frexp(torch.tensor(largest, dtype=torch.float64))[1].item() - fraction_bits(6)
    )
    bound = NUM_LOGICAL_WORKERS * unit / 2 + truth.abs() * 2.0**-24
    assert bool(((total.double() - truth).abs() <= bound).all())
    assert g[0].numel() % BLOCK != 0  # the ragged last block is covered


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


GROUPINGS = {
    "2x3": "0,1,2;3,4,5",
    "3x2": "0,1;2,3;4,5",
    "4-1-1": "0,1,2,3;4;5",
    "1-3-2 shuffled": "5;0,2,4;1,3",
    # Chunks of a block per process: several chunks, the last ragged with an empty shard.
    "2x3 in 2-block chunks": "0,1,2;3,4,5#1",
    "1-3-2 in 3-block chunks": "5;0,2,4;1,3#1",
}
# Which groupings take the sharded step 3 (no process hosts more than SHARDED_MAX_HOSTED).
SHARDED = {name for name in GROUPINGS if name != "4-1-1"}
POISONED = "0,1,2;3,4,5@4"


@pytest.fixture(scope="module")
def ranks_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[int, dict[str, Any]]]:
    """Every grouping and the poisoned case, each on its own gloo group of one launch of
    three processes: per case, each member rank's result."""
    out = tmp_path_factory.mktemp("exact")
    cases = [*GROUPINGS.values(), POISONED]
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
        # Both ways of summing across processes ran, each to the one process's bits.
        assert {r["sharded"] for r in results.values()} == {name in SHARDED}, name


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_non_finite_gradient_stops_every_process(
    ranks_results: list[dict[int, dict[str, Any]]],
) -> None:
    poisoned = ranks_results[len(GROUPINGS)]
    assert poisoned == {0: {"non_finite": [4]}, 1: {"non_finite": [4]}}


def _two_halves(flat: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """The scaling by 2**shift per block as two float32 powers of two (the general path)."""
    low = torch.div(shift, 2, rounding_mode="floor")
    one = torch.ones(shift.shape, dtype=torch.float32)
    factor = torch.repeat_interleave(torch.ldexp(one, low), BLOCK)[: flat.numel()]
    second = torch.repeat_interleave(torch.ldexp(one, shift - low), BLOCK)[: flat.numel()]
    return flat * factor * second


def test_one_multiplication_where_the_power_fits_gives_the_two_halves_bits() -> None:
    """The fast path of the scaling (one float32 power of two a block) against the two
    halves, on the values it meets: to fixed point a block scaled by its own shift and
    rounded (block maxima from 2**-60 to 2**100, small values in each), back from fixed
    point integer sums up to 2**62 with every shift in float32's range."""
    from spotline.exact import _exponents, _scaled, fraction_bits

    gen = torch.Generator().manual_seed(7)
    bits = fraction_bits(4)
    block_scale = torch.arange(-60, 101, 2, dtype=torch.int64)
    blocks = block_scale.numel()
    flat = torch.randn(blocks * BLOCK, generator=gen).view(blocks, BLOCK)
    flat *= torch.ldexp(torch.ones(blocks, 1), block_scale[:, None])
    flat[:, :64] *= 1e-30  # tiny values beside a block's large ones
    flat = flat.reshape(-1)
    head = flat.view(blocks, BLOCK)
    shift = bits - _exponents(head.abs().amax(dim=1)).to(torch.int64)
    assert bool(((shift >= -126) & (shift <= 127)).all())  # the fast path is taken
    assert torch.equal(_scaled(flat, shift).round(), _two_halves(flat, shift).round())
    sums = torch.randint(-(2**62), 2**62, (blocks * BLOCK,), generator=gen).to(torch.float32)
    sums[::7] = torch.randint(-5, 5, (sums[::7].numel(),), generator=gen).to(torch.float32)
    back = torch.arange(-126, 128, dtype=torch.int64)[:blocks]
    assert torch.equal(_scaled(sums, -back), _two_halves(sums, -back))


def test_the_chunked_sum_equals_one_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of the reduction (reused buffers, an all-reduce a chunk) change no bit: sizes
    around the chunk's edge, zero and tiny blocks (the two-halves path), several workers."""
    from spotline import exact

    gen = torch.Generator().manual_seed(3)
    for numel in (exact.CHUNK - 1, exact.CHUNK, 2 * exact.CHUNK + BLOCK + 5):
        grads = [(w, torch.randn(numel, generator=gen) * 1e-3) for w in range(3)]
        for _, g in grads:
            g[: 2 * BLOCK] = 0  # zero blocks on every worker
        grads[1][1][3 * BLOCK : 4 * BLOCK] *= 1e-35  # a block of tiny values
        out = torch.empty(numel)
        chunked = exact_sum(grads, num_logical_workers=3, local=True, out=out)
        assert chunked.data_ptr() == out.data_ptr()
        monkeypatch.setattr(exact, "CHUNK", 1 << 40)
        whole = exact_sum(grads, num_logical_workers=3, local=True)
        monkeypatch.undo()
        assert torch.equal(chunked, whole), numel


def test_the_sharded_sum_sends_a_float_all_reduce_s_bytes_when_each_process_hosts_one() -> None:
    from spotline.exact import SHARDED_MAX_HOSTED, bytes_sent_per_process

    n = 1_000_000
    ring_float = 2 * 4 * n * 3 // 4  # a float32 ring all-reduce over 4 processes
    assert bytes_sent_per_process(n, [1, 1, 1, 1]) == ring_float
    assert bytes_sent_per_process(n, [2, 2, 2, 2]) == ring_float * 3 // 2
    crowded = [SHARDED_MAX_HOSTED + 1, 1, 1, 1]  # the int64 ring: twice the float bytes
    assert bytes_sent_per_process(n, crowded) == 2 * ring_float
    assert bytes_sent_per_process(n, [6]) == 0


def test_one_logical_worker_is_its_own_sum_bit_for_bit() -> None:
    g = gradients(1)[0].clone()
    # 2**-45 of its block's largest: the fixed-point round trip would round it away.
    g[5] = float(g[:BLOCK].abs().max()) * 2.0**-45
    out = torch.empty(g.numel())
    total = exact_sum([(0, g)], num_logical_workers=1, out=out)
    assert torch.equal(total, g) and total.data_ptr() == out.data_ptr()
    assert torch.equal(exact_sum([(0, g)], num_logical_workers=1, scale=0.5), g * 0.5)
    for bad in (float("nan"), float("inf"), float("-inf")):
        poisoned = g.clone()
        poisoned[3] = bad
        with pytest.raises(NonFiniteGradient, match=r"logical worker\(s\) \[0\]"):
            exact_sum([(0, poisoned)], num_logical_workers=1)
