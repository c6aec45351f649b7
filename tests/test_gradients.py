"""What gradients of a quantised model hold, used the way training code
uses them (optax's global-norm clipping, per-example gradient norms, logging one weight's
gradient norm), as the training guide shows."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import TRAIN, normal

import nvfp4x

B, D = 8, 32


def model_and_batch():
    model = eqx.nn.MLP(D, 4, 64, 1, key=jax.random.key(0))
    return nvfp4x.quantize(model, TRAIN), normal(1, (B, D))


def loss(model, x):
    return jnp.mean(jax.vmap(model)(x) ** 2)


def optax_step(optim):
    """The training step users write, jitted, with `optim` (an optax transformation):
    `(model, opt_state, x) -> (model, opt_state, loss, grads, norms)`, `norms` each
    layer's gradient norm (logged as floats) and a `jnp.where` guard dropping the
    updates of a step whose gradients are not finite, all read from the gradients."""

    @eqx.filter_jit
    def step(qmodel, opt_state, x):
        value, grads = eqx.filter_value_and_grad(loss)(qmodel, x)
        norms = [jnp.linalg.norm(layer.weight) for layer in grads.layers]
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g.weight)) for g in grads.layers]))
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(qmodel, eqx.is_array))
        updates = jax.tree.map(lambda u: jnp.where(finite, u, 0.0), updates)
        return eqx.apply_updates(qmodel, updates), opt_state, value, grads, norms

    return step


def test_global_norm_clipping_with_optax_sees_the_master_gradients():
    qmodel, x = model_and_batch()
    optim = optax.chain(optax.clip_by_global_norm(1e-3), optax.adamw(1e-2))
    opt_state = optim.init(eqx.filter(qmodel, eqx.is_array))
    step = optax_step(optim)
    with jax.numpy_dtype_promotion("standard"):  # optax's AdamW mixes weak and strong types
        new, opt_state, _, grads, _ = step(qmodel, opt_state, x)
        _, opt_state2, value, _, _ = step(new, opt_state, x)
    # A weight's gradient is a `QWeight` whose array is the master weight's gradient:
    # `dequantize` gives the float model's gradient tree, and the norms agree.
    plain = nvfp4x.dequantize(grads)
    assert isinstance(grads.layers[0].weight, nvfp4x.QWeight)
    assert isinstance(plain.layers[0].weight, jax.Array)
    float_params = eqx.filter(nvfp4x.dequantize(qmodel), eqx.is_inexact_array)
    assert jax.tree.structure(plain) == jax.tree.structure(float_params)
    np.testing.assert_array_equal(plain.layers[0].weight, grads.layers[0].weight.array)
    assert jnp.linalg.norm(grads.layers[0].weight) == jnp.linalg.norm(plain.layers[0].weight)
    assert float(optax.tree.norm(grads)) == float(optax.tree.norm(plain))
    assert float(optax.tree.norm(grads)) > 1e-3  # so the clipping acts
    # The step kept the model quantised and the optimiser state's structure.
    assert isinstance(new.layers[0].weight, nvfp4x.QWeight)
    assert jax.tree.structure(opt_state2) == jax.tree.structure(opt_state)
    assert float(value) < float(loss(qmodel, x))


def test_per_example_gradient_norms():
    qmodel, x = model_and_batch()
    layer = qmodel.layers[0]
    per_example = jax.vmap(eqx.filter_grad(lambda m, x: jnp.sum(m(x) ** 2)), in_axes=(None, 0))(
        layer, x
    )
    assert per_example.weight.shape == (B, 64, D)
    norms = jax.vmap(lambda g: jnp.linalg.norm(g.weight))(per_example)  # the QWeights
    want = [jnp.linalg.norm(per_example.weight.array[i]) for i in range(B)]
    np.testing.assert_allclose(norms, jnp.stack(want), rtol=1e-6)  # summed in another order
    plain = nvfp4x.dequantize(per_example)
    np.testing.assert_array_equal(jax.vmap(lambda g: jnp.linalg.norm(g.weight))(plain), norms)
    # Under `nvfp4x.quantized`, a non-GEMM read of a quantised weight is its array.
    read = nvfp4x.quantized(lambda g: jnp.linalg.norm(g.weight[0]))(per_example)
    np.testing.assert_array_equal(read, want[0])


# --- a gradient's `QWeight` read as an array: every jnp function but the GEMMs ---


@pytest.fixture(scope="module")
def weight_grad():
    qmodel, x = model_and_batch()
    grads = eqx.filter_grad(loss)(qmodel, x)
    g = grads.layers[0].weight
    assert isinstance(g, nvfp4x.QWeight)
    return g


READS = {
    "norm": jnp.linalg.norm,
    "sum": jnp.sum,
    "mean": jnp.mean,
    "abs": jnp.abs,
    "square": jnp.square,
    "max": jnp.max,
    "where": lambda g: jnp.where(g > 0, g, 0.0),
    "isfinite": jnp.isfinite,
    "clip": lambda g: jnp.clip(g, -1e-3, 1e-3),
    "astype": lambda g: jnp.asarray(g.astype(jnp.bfloat16)),
    "pow_operator": lambda g: g**2,
    "abs_operator": abs,
    "comparisons": lambda g: jnp.stack([g > 0, g < 0, g >= 0, g <= 0]),
}


@pytest.mark.parametrize("read", list(READS))
def test_a_gradient_reads_as_its_array_in_jax_numpy(weight_grad, read):
    fn = READS[read]
    want = fn(weight_grad.array)
    got = fn(weight_grad)
    assert isinstance(got, jax.Array) and not isinstance(got, nvfp4x.QWeight)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(jax.jit(fn)(weight_grad), want)


def test_a_gradient_has_its_arrays_shape_attributes_and_converts_to_a_float(weight_grad):
    a = weight_grad.array
    assert (weight_grad.shape, weight_grad.dtype) == (a.shape, a.dtype)
    assert (weight_grad.ndim, weight_grad.size) == (a.ndim, a.size)
    assert float(jnp.sum(weight_grad)) == float(jnp.sum(a))
    np.testing.assert_array_equal(jnp.asarray(weight_grad), a)


#: Every `jax.numpy` entry point to a GEMM, with the weight on either side.
GEMMS = {
    "dot": lambda w, v: jnp.dot(w, v),
    "dot_rhs": lambda w, v: jnp.dot(v, w.T),
    "matmul": lambda w, v: jnp.matmul(w, v),
    "matmul_rhs": lambda w, v: jnp.matmul(v, w.T),
    "einsum": lambda w, v: jnp.einsum("ok,k->o", w, v),
    "tensordot": lambda w, v: jnp.tensordot(w, v, 1),
    "inner": lambda w, v: jnp.inner(w, v),
    "vdot": lambda w, v: jnp.vdot(w, w),
    "multi_dot": lambda w, v: jnp.linalg.multi_dot([w, v]),
}


@pytest.mark.parametrize("gemm", list(GEMMS))
def test_a_jnp_gemm_on_a_quantised_weight_outside_a_quantised_call_is_refused(gemm):
    qmodel, x = model_and_batch()
    w, v = qmodel.layers[0].weight, x[0]
    message = r"`jnp\..*` would multiply the quantised weight `layers\[0\]`.*nvfp4x.quantized"
    with pytest.raises(TypeError, match=message):
        GEMMS[gemm](w, v)
    with pytest.raises(TypeError, match=message):
        jax.jit(GEMMS[gemm])(w, v)
    # Under `nvfp4x.quantized`, the same function runs the quantised GEMM.
    got = nvfp4x.quantized(GEMMS[gemm])(w, v)
    assert got.shape == GEMMS[gemm](w.array, v).shape


def test_convolve_and_lax_gemms_on_a_quantised_weight_are_refused_naming_it():
    w = nvfp4x.QWeight(normal(2, (16,)), TRAIN, "taps")
    with pytest.raises(TypeError, match=r"`jnp.convolve` would multiply .* `taps`"):
        jnp.convolve(normal(3, (40,)), w)
    qmodel, x = model_and_batch()
    w = qmodel.layers[0].weight
    dims = (((1,), (1,)), ((), ()))
    message = r"`lax.dot_general` would multiply the quantised weight `layers\[0\]`"
    with pytest.raises(ValueError, match=message):
        jax.lax.dot_general(x, w, dims)
    with pytest.raises(ValueError, match=message):
        jax.jit(lambda w: jax.lax.dot_general(x, w, dims))(w)
    with pytest.raises(ValueError, match=r"`lax.add` got the quantised weight `layers\[0\]`"):
        jax.lax.add(w, w.array)


def test_the_matmul_operator_on_a_quantised_weight_runs_quantised_on_either_side():
    qmodel, x = model_and_batch()
    w = qmodel.layers[0].weight
    for fn in (lambda w, x: x @ w.T, lambda w, x: (w @ x.T).T):
        got = fn(w, x)
        np.testing.assert_array_equal(got, nvfp4x.quantized(fn)(w, x))
        assert not np.array_equal(got, fn(w.array, x))  # not the float GEMM


def test_a_frozen_weight_in_a_gemm_outside_the_model_call_is_refused_naming_it():
    class Head(eqx.Module):  # a user linear class: its frozen weight is a FrozenWeight
        weight: jax.Array

        def __call__(self, x):
            return self.weight @ x

    frozen = nvfp4x.freeze(nvfp4x.quantize(Head(normal(4, (16, D))), TRAIN))
    x = normal(5, (D,))
    with pytest.raises(TypeError, match=r"`jnp.dot` would multiply the frozen weight"):
        jnp.dot(frozen.weight, x)
    with pytest.raises(ValueError, match=r"`lax.dot_general` would multiply the frozen"):
        jax.lax.dot_general(frozen.weight, x, (((1,), (0,)), ((), ())))
    with pytest.raises(TypeError, match=r"frozen weight.*nvfp4x.quantized"):
        jnp.sum(frozen.weight)
    np.testing.assert_array_equal(frozen.weight @ x, frozen(x))
    assert float(nvfp4x.quantized(jnp.sum)(frozen.weight)) == float(
        jnp.sum(np.asarray(frozen.weight))
    )


def test_a_training_loop_that_clips_and_logs_gradient_norms():
    """The loop users write (`optax_step`): global-norm clipping, per-layer gradient
    norms logged as floats, a `jnp.where` guard against non-finite gradients."""
    qmodel, x = model_and_batch()
    optim = optax.chain(optax.clip_by_global_norm(1e-2), optax.sgd(1e-1))
    opt_state = optim.init(eqx.filter(qmodel, eqx.is_array))
    step = optax_step(optim)
    log = []
    for _ in range(3):
        qmodel, opt_state, value, _, norms = step(qmodel, opt_state, x)
        log.append((float(value), [float(n) for n in norms]))
    assert isinstance(qmodel.layers[0].weight, nvfp4x.QWeight)
    assert log[-1][0] < log[0][0]
    assert all(n > 0 and np.isfinite(n) for _, norms in log for n in norms)
    grads = eqx.filter_grad(loss)(qmodel, x)
    want = [float(jnp.linalg.norm(g.weight.array)) for g in grads.layers]
    assert [float(jnp.linalg.norm(g.weight)) for g in grads.layers] == want
