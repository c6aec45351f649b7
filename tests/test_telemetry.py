"""Quantisation telemetry: statistics returned as the gradient of probe arrays."""

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import assert_same_sums

import nvfp4x
from nvfp4x._probe import operand_stats
from nvfp4x._telemetry import OPERANDS, STATS


def _model():
    return eqx.nn.MLP(40, 24, 64, 1, key=jax.random.key(0))


def _x():
    return jax.random.normal(jax.random.key(1), (32, 40))


def _loss(model, x):
    return jnp.mean(jax.vmap(model)(x) ** 2)


# Jitted: one compilation per model structure (an eager gradient of a quantised model
# dispatches and compiles every op on its own, which costs more). The probes test below
# stays eager: there the gradients are compared bit for bit, and under jit the probes'
# extra outputs may change XLA's fusion of a bias gradient by an ulp.
_value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(_loss))


_fake_quantize_jit = jax.jit(nvfp4x.fake_quantize, static_argnames="block")


def _nvfp4_stats(a: np.ndarray, block: str) -> tuple[float, float, float, float]:
    """Independent statistics of one NVFP4 round trip (numpy), for rows quantised along
    the last axis (1x16) or in 16x16 tiles; sizes here are multiples of 16."""
    deq = np.asarray(
        _fake_quantize_jit(jnp.asarray(a), block=(1, 16) if block == "1x16" else (16, 16))
    )
    nonzero = a != 0
    zero = (nonzero & (deq == 0)).sum() / max(nonzero.sum(), 1)
    sqnr = 10 * np.log10(
        (a.astype(np.float64) ** 2).sum() / ((a - deq).astype(np.float64) ** 2).sum()
    )
    return float(np.abs(a).max()), float(zero), float(sqnr)


def test_statistics_match_an_independent_computation():
    q = nvfp4x.telemetry.enable(nvfp4x.quantize(_model(), nvfp4x.recipes.nvfp4_inference()))
    _, grads = _value_and_grad(q, _x())
    table = nvfp4x.telemetry.collect(grads)
    assert set(table) == {"layers[0]", "layers[1]"}
    assert set(table["layers[0]"]) == set(OPERANDS)
    assert set(table["layers[0]"]["fprop_x"]) == set(STATS)
    x = np.asarray(_x())
    amax, zero, sqnr = _nvfp4_stats(x, "1x16")
    got = table["layers[0]"]["fprop_x"]
    np.testing.assert_allclose(float(got["amax"]), amax, rtol=0)
    np.testing.assert_allclose(float(got["zero_frac"]), zero, rtol=1e-6)
    np.testing.assert_allclose(float(got["sqnr_db"]), sqnr, rtol=1e-4)
    w = np.asarray(q.layers[0].weight)
    amax, zero, sqnr = _nvfp4_stats(w, "1x16")
    got = table["layers[0]"]["weight"]
    np.testing.assert_allclose(float(got["amax"]), amax, rtol=0)
    np.testing.assert_allclose(float(got["sqnr_db"]), sqnr, rtol=1e-4)
    for layer in table.values():
        for op in OPERANDS:
            s = layer[op]
            assert 0 <= float(s["zero_frac"]) <= 1 and 0 <= float(s["saturated_frac"]) <= 1
            # nvfp4_inference leaves dy unquantised: no error, infinite SQNR
            quantised = op in ("fprop_x", "weight", "wgrad_x")
            assert np.isfinite(float(s["sqnr_db"])) == quantised


def test_probes_change_neither_loss_nor_gradients():
    q = nvfp4x.quantize(_model(), nvfp4x.recipes.nvfp4_training())
    qt = nvfp4x.telemetry.enable(q)
    l0, g0 = eqx.filter_value_and_grad(_loss)(q, _x())
    l1, g1 = eqx.filter_value_and_grad(_loss)(qt, _x())
    # The probed GEMMs are other programs (their statistics are extra outputs): bit for
    # bit on a CPU, up to float32 summation order where XLA may order them otherwise.
    assert_same_sums((l1, nvfp4x.telemetry.disable(g1)), (l0, g0), "with probes vs without")
    assert eqx.tree_equal(nvfp4x.telemetry.disable(qt), q)


def test_statistics_come_out_of_a_jitted_step_and_follow_vmap():
    # One layer: the two programs compared here are the costliest of this file to compile,
    # and how statistics follow vmap does not depend on the depth of the model.
    layer = eqx.nn.Linear(40, 24, key=jax.random.key(0))
    qt = nvfp4x.telemetry.enable(nvfp4x.quantize(layer, nvfp4x.recipes.nvfp4_training()))
    vmapped = nvfp4x.telemetry.collect(_value_and_grad(qt, _x())[1])
    assert set(vmapped) == {""} and set(vmapped[""]) == set(OPERANDS)
    batched = nvfp4x.telemetry.collect(
        eqx.filter_jit(eqx.filter_grad(lambda m, x: jnp.mean(m(x) ** 2)))(qt, _x())
    )
    for a, b in zip(jax.tree.leaves(vmapped), jax.tree.leaves(batched), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5)


def test_statistics_under_vmap_with_keys_are_whole_call_statistics():
    """`jax.vmap` over examples *and* their stochastic-rounding keys: the GEMM folds the
    batch into one problem with one combined seed, and so must the probe (it once
    stacked per-example problems and summed them: an amax of 147.9 for a true 3.83)."""
    layer = eqx.nn.Linear(40, 24, key=jax.random.key(0))
    qt = nvfp4x.telemetry.enable(nvfp4x.quantize(layer, nvfp4x.recipes.nvfp4_training()))
    x = _x()
    keys = jax.random.split(jax.random.key(7), x.shape[0])

    def loss(m, x, keys):
        y = jax.vmap(lambda xi, k: m(xi, key=k))(x, keys)
        return jnp.mean(y**2), y

    (_, y), grads = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))(qt, x, keys)
    table = nvfp4x.telemetry.collect(grads)[""]
    dy = 2.0 * np.asarray(y, np.float64) / y.size
    np.testing.assert_allclose(float(table["fprop_x"]["amax"]), np.abs(np.asarray(x)).max(), rtol=0)
    np.testing.assert_allclose(
        float(table["weight"]["amax"]), np.abs(np.asarray(qt.weight)).max(), rtol=0
    )
    np.testing.assert_allclose(float(table["dgrad_dy"]["amax"]), np.abs(dy).max(), rtol=1e-6)
    for op in OPERANDS:
        assert 0 <= float(table[op]["zero_frac"]) <= 1
        assert 0 <= float(table[op]["saturated_frac"]) <= 1
    # the same statistics as the unkeyed call for the operands that are not SR-rounded
    plain = nvfp4x.telemetry.collect(_value_and_grad(qt, x)[1])[""]
    for op in ("fprop_x", "weight", "wgrad_x"):
        for st in STATS:
            np.testing.assert_allclose(table[op][st], plain[op][st], rtol=1e-6, err_msg=op + st)


def test_saturation_is_counted():
    # Row 0 sets amax = 6 (S_enc = 448). Every other row's block amax b gives
    # b * 448 / 6 = 6.2, whose E4M3 scale rounds down to 6: all its elements land at
    # 6.2 > 6 and saturate.
    b = np.float32(6.2 * 6 / 448)
    x = jnp.full((16, 16), b).at[0].set(6.0)
    lin = nvfp4x.telemetry.enable(
        nvfp4x.quantize(
            eqx.nn.Linear(16, 16, key=jax.random.key(0)), nvfp4x.recipes.nvfp4_inference()
        )
    )
    grads = eqx.filter_grad(lambda m: jnp.sum(m(x)))(lin)
    sat = float(nvfp4x.telemetry.collect(grads)[""]["fprop_x"]["saturated_frac"])
    s_dec = np.float32(1) / np.float32(2688 / 6)
    scale = (np.abs(np.asarray(x)).max(axis=1) * np.float32(448 / 6)).astype(
        ml_dtypes.float8_e4m3fn
    )
    top = 6 * scale.astype(np.float32) * s_dec
    assert scale[1].astype(np.float32) == 6.0
    assert sat == pytest.approx(np.mean(np.abs(np.asarray(x)) > top[:, None]), abs=1e-6)
    assert sat == pytest.approx(15 / 16)


def test_stacked_layers_get_one_row_per_layer():
    keys = jax.random.split(jax.random.key(0), 3)
    stack = eqx.filter_vmap(lambda k: eqx.nn.Linear(32, 32, key=k))(keys)
    qt = nvfp4x.telemetry.enable(nvfp4x.quantize(stack, nvfp4x.recipes.nvfp4_training()))
    assert qt.probe.shape == (3, 5, 4)

    def loss(layers, x):
        params, static = eqx.partition(layers, eqx.is_array)

        def body(h, p):
            return jax.vmap(eqx.combine(p, static))(h), None

        return jnp.mean(jax.lax.scan(body, x, params)[0] ** 2)

    grads = eqx.filter_grad(loss)(qt, jax.random.normal(jax.random.key(2), (16, 32)))
    amax = nvfp4x.telemetry.collect(grads)[""]["weight"]["amax"]
    assert amax.shape == (3,)
    np.testing.assert_allclose(amax, jnp.max(jnp.abs(stack.weight), axis=(1, 2)), rtol=0)


@pytest.mark.parametrize("layout", ["tokens", "tile"])
def test_saturation_is_counted_in_every_block_layout(layout):
    # `test_saturation_is_counted`'s blocks, down the columns (wgrad's token axis,
    # axis 0) or as 16x16 tiles. The probe's saturation mask is computed in the
    # quantiser's own block layout (to share its block scales), so each layout must count
    # the elements of the blocks whose E4M3 scale rounds down: the blocks of amax b.
    b = np.float32(6.2 * 6 / 448)
    if layout == "tokens":
        # column 0 holds the amax 6 (S_enc = 448); the 15 other columns saturate
        x = jnp.full((16, 16), b).at[:, 0].set(6.0)
        fmt, axis, want = nvfp4x.Format("nvfp4"), 0, 15 / 16
    else:
        # tile 0 holds the amax 6; tile 1 (all b) saturates
        x = jnp.full((16, 32), b).at[0, 0].set(6.0)
        fmt, axis, want = nvfp4x.Format("nvfp4", block=(16, 16)), -1, 1 / 2
    stats = operand_stats(x, fmt, axis, None)
    assert float(stats[STATS.index("saturated_frac")]) == pytest.approx(want, abs=1e-6)
    assert float(stats[STATS.index("amax")]) == 6.0
