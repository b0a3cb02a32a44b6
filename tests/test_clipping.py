"""spotline.pipeline.clipping's squared norm: a function of the gradient's values alone (the same
bits for a tensor and for the same values at any offset of a larger buffer, as a reduced
gradient is a view of the sum's buffer), accurate against a float64 sum, for sizes below,
at and around the row length. Pure: no processes."""

from __future__ import annotations

import torch

from spotline.pipeline.clipping import SQ_NORM_ROW, per_layer_sq_norms, sq_norm


def test_the_squared_norm_is_the_values_function_and_accurate() -> None:
    gen = torch.Generator().manual_seed(7)
    for n in (1, 17, SQ_NORM_ROW - 1, SQ_NORM_ROW, SQ_NORM_ROW + 1, 5 * SQ_NORM_ROW + 123):
        g = torch.randn(n, generator=gen) * 1e-3
        # The same values at an odd offset of a buffer (a view, as a reduced gradient is).
        buffer = torch.randn(n + 2 * 37, generator=gen)
        view = buffer[37 : 37 + n]
        view.copy_(g)
        assert torch.equal(sq_norm(g), sq_norm(view)), n
        assert torch.equal(sq_norm(g.view(1, n)), sq_norm(g)), n
        exact = g.double().pow(2).sum()
        assert sq_norm(g).dtype == torch.float64
        assert abs(float(sq_norm(g)) - float(exact)) <= 1e-6 * float(exact), n
    assert float(sq_norm(torch.zeros(SQ_NORM_ROW + 3))) == 0.0


def test_per_layer_norms_count_each_owned_layer_once_and_skip_tied_copies() -> None:
    g = torch.ones(3, SQ_NORM_ROW)  # squared norm 3 * SQ_NORM_ROW
    named = [("1.weight", g), ("1.bias", torch.ones(4)), ("2.weight", g), ("3.weight", None)]
    values = per_layer_sq_norms(named, num_layers=4, owned_layers=range(1, 3), skip={"2.weight"})
    assert values.tolist() == [0.0, 3.0 * SQ_NORM_ROW + 4.0, 0.0, 0.0]
