"""solar.synthetic: samples are pure functions of (seed, index); the demo's generator poses a learning
problem (the target is a function of the input) where the tests' generator does not."""

from __future__ import annotations

import numpy as np
import pytest

from solar.synthetic import ptycho_block, ptycho_posed_block, ptycho_posed_sample, ptycho_sample


@pytest.mark.parametrize("sample, block", [(ptycho_sample, ptycho_block), (ptycho_posed_sample, ptycho_posed_block)])
def test_samples_are_pure_functions_of_seed_and_index(sample, block):
    x, y = block(3, 7, 16, 5)
    assert x.shape == (4, 1, 16, 16) and y.shape == (4, 2, 16, 16) and x.dtype == y.dtype == np.float32
    for k, i in enumerate(range(3, 7)):
        sx, sy = sample(i, 16, 5)
        assert np.array_equal(x[k], sx) and np.array_equal(y[k], sy)
    assert not np.array_equal(sample(3, 16, 6)[1], y[0])  # another seed, another object
    empty = block(2, 2, 8)
    assert empty[0].shape == (0, 1, 8, 8) and empty[1].shape == (0, 2, 8, 8)


def test_the_posed_generators_ranges():
    x, y = ptycho_posed_block(0, 64, 32)
    assert 0 <= x.min() and x.max() <= 1
    assert 0.19 <= y[:, 0].min() and y[:, 0].max() <= 1 and 0 <= y[:, 1].min() and y[:, 1].max() <= 2


def _ridge_vs_mean(block, n=512, m=128, size=16, lam=0.1) -> float:
    """Validation MSE of ridge regression from x to y, over the mean predictor's."""
    x, y = (a.reshape(n, -1).astype(np.float64) for a in block(0, n, size, 0))
    vx, vy = (a.reshape(m, -1).astype(np.float64) for a in block(n, n + m, size, 0))
    mx, my = x.mean(0), y.mean(0)
    weights = np.linalg.solve((x - mx) @ (x - mx).T + lam * np.eye(n), y - my)
    pred = (vx - mx) @ (x - mx).T @ weights + my
    return float(((pred - vy) ** 2).mean() / ((vy - my) ** 2).mean())


def test_the_posed_target_is_a_function_of_the_input_and_the_old_one_is_not():
    """Even a linear map from x to y leaves a fraction of the mean predictor's error on held-out
    samples of the posed generator; on ptycho_sample's (an object and its shifted copy share x) it
    does no better than the mean."""
    assert _ridge_vs_mean(ptycho_posed_block) < 0.3
    assert _ridge_vs_mean(ptycho_block) > 0.9
