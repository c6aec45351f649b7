"""The quantised GEMM with JAX, Equinox and optax: eager vs jit, `filter_jit`, `grad`,
`jax.checkpoint`, `jvp`, bfloat16 parameters, an optax loop; and non-finite input.

Comparisons between two runs of the library (eager vs jit, jit vs filter_jit,
checkpoint) are bit for bit; with the NumPy reference (`tests/reference.py`), to a
relative error of 1e-5.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    RECIPES,
    TRAIN,
    K,
    N,
    T,
    TwoLayer,
    assert_close,
    assert_same,
    assert_same_sums,
    assert_trees_same,
    cot_loss,
    fasts,
    grad_layer_x,
    jit_call,
    jit_grad_layer_x,
    make_layer,
    normal_np,
    rel_err,
)
from reference import F32, ref_deq

import nvfp4x

# ---------------------------------------------------------------------------------------
# Eager and jit; composition with JAX / Equinox / optax: one test each.
# ---------------------------------------------------------------------------------------


def test_eager_equals_jit():
    # Without a bias the GEMMs give the same bits eagerly and under jit.
    layer = make_layer(TRAIN, use_bias=False)
    x, g = jnp.asarray(normal_np(18, (T, K))), jnp.asarray(normal_np(19, (T, N)))
    assert_same(layer(x), jit_call(layer, x), "fprop")
    assert_same(layer(x), eqx.filter_jit(layer)(x), "fprop (filter_jit)")
    assert_trees_same(grad_layer_x(layer, x, g), jit_grad_layer_x(layer, x, g), "grads")


def test_eager_and_jit_with_bias_differ_by_at_most_one_fused_rounding():
    # Under jit XLA fuses `acc * scale + bias` (an FMA on CPU): one rounding fewer than
    # the eager sequence, so outputs may differ by one float32 ulp, never more.
    layer = make_layer(TRAIN)
    x = jnp.asarray(normal_np(18, (T, K)))
    eager, jitted = np.asarray(layer(x)), np.asarray(jit_call(layer, x))
    bias = np.asarray(layer.bias)
    # eager rounds the product and then the sum, the FMA only the sum: at most one ulp
    # of each summand apart
    ulp = np.spacing(np.maximum(np.abs(eager - bias), np.abs(bias)).astype(F32))
    assert np.all(np.abs(eager - jitted) <= 2 * ulp)
    assert not np.array_equal(eager, np.zeros_like(eager))


def test_jit_and_filter_jit():
    model = nvfp4x.quantize(TwoLayer(K, N, jax.random.key(3)), TRAIN)
    x = jnp.asarray(normal_np(31, (T, K)))
    y = eqx.filter_jit(model)(x)
    assert_same(y, jax.jit(lambda m, x: m(x))(model, x), "filter_jit vs jax.jit")
    assert_close(y, model(x), "jit vs eager")  # bit for bit: test_eager_equals_jit


def test_grad_and_filter_grad():
    layer = make_layer(TRAIN)
    x, g = jnp.asarray(normal_np(32, (T, K))), jnp.asarray(normal_np(33, (T, N)))
    gf = eqx.filter_jit(eqx.filter_grad(cot_loss))(layer, x, g)
    gj, _ = jit_grad_layer_x(layer, x, g)
    assert isinstance(gf, nvfp4x.QuantizedLinear) and gf.recipe == TRAIN
    assert gf.weight.shape == layer.weight.shape and gf.bias.shape == layer.bias.shape
    assert all(np.all(np.isfinite(np.asarray(v))) for v in jax.tree_util.tree_leaves(gf))
    assert_trees_same(gf, gj, "filter_grad vs jax.grad")


def test_checkpoint():
    """Rematerialised, the gradient is the plain one: bit for bit on a CPU; on a GPU
    another program may sum its GEMMs and the bias gradient (a float32 sum over the
    tokens) in another order (`assert_same_sums`)."""
    layer = make_layer(TRAIN)
    x, g = jnp.asarray(normal_np(37, (T, K))), jnp.asarray(normal_np(38, (T, N)))
    got = jax.jit(jax.grad(jax.checkpoint(cot_loss), argnums=(0, 1)))(layer, x, g)
    assert_same_sums(got, jit_grad_layer_x(layer, x, g), "jax.checkpoint")


def test_jvp_is_straight_through():
    x, w = normal_np(39, (T, K)), normal_np(40, (N, K))
    xt, wt = normal_np(41, (T, K)), normal_np(42, (N, K))

    def f(x, w):
        return nvfp4x.qdot(x, w, recipe=TRAIN)

    y, ty = jax.jvp(f, tuple(map(jnp.asarray, (x, w))), tuple(map(jnp.asarray, (xt, wt))))
    qx, qw = ref_deq(x, axis=1), ref_deq(w, tile=True)
    assert_close(y, qx @ qw.T, "primal")
    assert_close(ty, xt.astype(np.float64) @ qw.T + qx @ wt.T.astype(np.float64), "tangent")


def test_bfloat16_parameters_and_inputs():
    bf = jnp.bfloat16
    layer = make_layer(TRAIN, dtype=bf)
    assert layer.weight.dtype == bf
    x, g = jnp.asarray(normal_np(43, (T, K)), bf), jnp.asarray(normal_np(44, (T, N)))
    y = layer(x)
    assert y.dtype == bf and y.shape == (T, N)
    gl, gx = grad_layer_x(layer, x, g)
    assert gl.weight.dtype == bf and gl.bias.dtype == bf and gx.dtype == bf
    for v in (y, gl.weight, gx):
        assert np.all(np.isfinite(np.asarray(v, F32)))
    # The same numbers as the float32 layer on the same (bf16-representable) values,
    # up to the final bfloat16 rounding.
    layer32 = jax.tree_util.tree_map(
        lambda a: a.astype(jnp.float32) if eqx.is_array(a) else a, layer
    )
    y32 = layer32(x.astype(jnp.float32))
    assert rel_err(y, y32) < 2**-7


def test_optax_adam_steps_master_weights():
    model = make_layer(TRAIN)
    x = jnp.asarray(normal_np(45, (64, K)))
    target = jnp.asarray(normal_np(46, (64, K)) @ normal_np(47, (K, N)) / np.sqrt(K))
    opt = optax.adam(1e-2)
    state = opt.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(m, s):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(m)
        updates, s = opt.update(grads, s, eqx.filter(m, eqx.is_array))
        return eqx.apply_updates(m, updates), s, loss

    m, losses = model, []
    # optax's bias correction computes `float ** int32`, which strict promotion rejects.
    with jax.numpy_dtype_promotion("standard"):
        for _ in range(15):
            m, state, loss = step(m, state)
            losses.append(float(loss))
    assert isinstance(m, nvfp4x.QuantizedLinear) and m.recipe == TRAIN
    for new, old in zip(
        jax.tree_util.tree_leaves(m), jax.tree_util.tree_leaves(model), strict=True
    ):
        assert new.dtype == old.dtype == jnp.float32
        assert not np.array_equal(np.asarray(new), np.asarray(old))
    assert losses[-1] < 0.7 * losses[0], losses


# ---------------------------------------------------------------------------------------
# Non-finite input.
# ---------------------------------------------------------------------------------------

NONFINITE_RECIPES = ["nvfp4_training", "nvfp4_inference", "mxfp8", "fp8", "bf16", "float32"]


@pytest.mark.parametrize("name", NONFINITE_RECIPES, ids=NONFINITE_RECIPES)
@fasts
def test_nan_in_x_gives_nan_rows(name, fast):
    layer = make_layer(RECIPES[name](), fast=fast)
    x = normal_np(47, (T, K))
    x[2, 5] = np.nan
    x[30, 39] = np.nan  # in the padded last block of k
    for y in (jit_call(layer, jnp.asarray(x)),):
        y = np.asarray(y)
        bad = np.isin(np.arange(T), [2, 30])
        assert np.all(np.isnan(y[bad])), "a NaN input must give NaN outputs in its row"
        assert np.all(np.isfinite(y[~bad])), "other rows stay finite"


@pytest.mark.parametrize("name", ["nvfp4_training", "nvfp4_inference"])
def test_inf_in_x_is_never_finite_garbage(name):
    layer = make_layer(RECIPES[name]())
    x = normal_np(48, (T, K))
    x[4, 0] = np.inf
    y = np.asarray(layer(jnp.asarray(x)))
    assert np.all(np.isnan(y[4])), "an infinite input poisons its NVFP4 block: NaN row"
    assert np.all(np.isfinite(np.delete(y, 4, axis=0)))


def test_nan_in_weight_gives_nan_columns_of_its_tile():
    layer = make_layer(TRAIN)
    w = np.asarray(layer.weight).copy()
    w[3, 7] = np.nan  # 16x16 tile (0, 0): output features 0..15
    layer = eqx.tree_at(lambda m: m.weight.array, layer, jnp.asarray(w))
    y = np.asarray(layer(jnp.asarray(normal_np(49, (T, K)))))
    assert np.all(np.isnan(y[:, :16]))
    assert np.all(np.isfinite(y[:, 16:]))


def test_nan_in_output_gradient():
    layer = make_layer(TRAIN)
    x, g = normal_np(50, (T, K)), normal_np(51, (T, N))
    g[1, 3] = np.nan
    gl, dx = jit_grad_layer_x(layer, jnp.asarray(x), jnp.asarray(g))
    dx, dw = np.asarray(dx), np.asarray(gl.weight)
    assert np.all(np.isnan(dx[1])) and np.all(np.isfinite(np.delete(dx, 1, axis=0)))
    # wgrad: dy's column 3 holds the NaN (its 16-token block, mixed by the RHT).
    assert np.all(np.isnan(dw[3])) and np.all(np.isfinite(np.delete(dw, 3, axis=0)))
