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


def test_global_norm_clipping_with_optax_sees_the_master_gradients():
    qmodel, x = model_and_batch()
    optim = optax.chain(optax.clip_by_global_norm(1e-3), optax.adamw(1e-2))
    opt_state = optim.init(eqx.filter(qmodel, eqx.is_array))

    @eqx.filter_jit
    def step(qmodel, opt_state, x):
        value, grads = eqx.filter_value_and_grad(loss)(qmodel, x)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(qmodel, eqx.is_array))
        return eqx.apply_updates(qmodel, updates), opt_state, value, grads

    with jax.numpy_dtype_promotion("standard"):  # optax's AdamW mixes weak and strong types
        new, opt_state, _, grads = step(qmodel, opt_state, x)
        _, opt_state2, value, _ = step(new, opt_state, x)
    # A weight's gradient is a `QWeight` whose array is the master weight's gradient:
    # `dequantize` gives the float model's gradient tree, and the norms agree.
    plain = nvfp4x.dequantize(grads)
    assert isinstance(grads.layers[0].weight, nvfp4x.QWeight)
    assert isinstance(plain.layers[0].weight, jax.Array)
    float_params = eqx.filter(nvfp4x.dequantize(qmodel), eqx.is_inexact_array)
    assert jax.tree.structure(plain) == jax.tree.structure(float_params)
    np.testing.assert_array_equal(plain.layers[0].weight, grads.layers[0].weight.array)
    with pytest.raises(TypeError, match="QWeight"):  # not an array outside `quantized`
        jnp.linalg.norm(grads.layers[0].weight)
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
    plain = nvfp4x.dequantize(per_example)
    norms = jax.vmap(lambda g: jnp.linalg.norm(g.weight))(plain)
    want = [jnp.linalg.norm(per_example.weight.array[i]) for i in range(B)]
    np.testing.assert_allclose(norms, jnp.stack(want), rtol=1e-6)  # summed in another order
    # Under `nvfp4x.quantized`, a non-GEMM read of a quantised weight is its array.
    read = nvfp4x.quantized(lambda g: jnp.linalg.norm(g.weight[0]))(per_example)
    np.testing.assert_array_equal(read, want[0])
