"""`benchmarks/long_run.py`, the 10,000-step study's runner: a run killed and
resumed from its checkpoint equals an uninterrupted one bit for bit, across a precision
switch too. (The study itself is a benchmark, not a test.)"""

import equinox as eqx
import jax
import numpy as np
import pytest

from benchmarks import long_run

CFG = long_run.SMOKE  # 12 steps; nvfp4_then_bf16 switches to bf16 at step 10


@pytest.fixture(scope="module")
def data():
    return long_run.lm.load_data(CFG)


def _run(out, data, stop_after=None):
    with jax.numpy_dtype_promotion("standard"):  # optax's AdamW, as the script runs
        return long_run.run_variant(
            "nvfp4_then_bf16",
            CFG,
            data,
            out,
            checkpoint_every=4,
            eval_every=4,
            stop_after=stop_after,
            progress=False,
        )


def test_resumed_run_equals_uninterrupted_bit_for_bit(tmp_path, data):
    assert long_run.switch_step(CFG, long_run.VARIANTS["nvfp4_then_bf16"]) == 10
    whole, model = _run(tmp_path / "whole", data)
    # killed after 6 steps (checkpoint at 6), then after 11 (past the switch), resumed
    _run(tmp_path / "resumed", data, stop_after=6)
    assert [s for s, _ in long_run._checkpoints(tmp_path / "resumed" / "nvfp4_then_bf16")] == [6]
    partial, _ = _run(tmp_path / "resumed", data, stop_after=11)
    assert np.isnan(partial[11]) and np.all(np.isfinite(partial[:11]))
    resumed, model_r = _run(tmp_path / "resumed", data)
    np.testing.assert_array_equal(resumed, whole)
    assert all(np.isfinite(whole))
    assert {
        layer.recipe.name
        for layer in model_r.blocks[0].mlp.__dict__.values()
        if hasattr(layer, "recipe")
    } == {"bf16"}  # the switch happened
    for a, b in zip(
        jax.tree.leaves(eqx.filter(model, eqx.is_array)),
        jax.tree.leaves(eqx.filter(model_r, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for name in ("losses.csv", "val.csv"):
        a = (tmp_path / "whole" / "nvfp4_then_bf16" / name).read_text()
        assert a == (tmp_path / "resumed" / "nvfp4_then_bf16" / name).read_text()


def test_gap_slope_recovers_a_known_trend():
    rng = np.random.default_rng(0)
    steps = np.arange(10_000)
    gap = 0.01 + 2e-6 * steps + rng.normal(0, 0.002, steps.size)  # +0.2 pp per 1k steps
    slope, se = long_run.gap_slope(gap, 400, 8000, 380)
    assert abs(slope - 2e-3) < 4 * se and se < 5e-4
    flat, se_flat = long_run.gap_slope(gap - 2e-6 * steps, 400, 8000, 380)
    assert abs(flat) < 4 * se_flat
