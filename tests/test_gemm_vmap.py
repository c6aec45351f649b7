"""The quantised GEMM under `jax.vmap`: vmapped calls, per-example gradients, stacked
weights and `lax.scan` over them give the batched call's numbers.

Comparisons between two runs of the library are bit for bit (on a CPU only where two
programs' float32 sums may be ordered differently: `assert_same_sums`); `lax.scan` vs
an unrolled loop is compared to float32 rounding (XLA fuses a scan body differently).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    TRAIN,
    K,
    N,
    T,
    TwoLayer,
    assert_close,
    assert_same,
    assert_same_sums,
    assert_trees_same,
    grad_layer_x,
    jit_call,
    jit_grad_layer_x,
    make_layer,
    normal_np,
)

import nvfp4x


def test_vmap_equals_batch_call():
    layer = make_layer(TRAIN)
    xs = jnp.asarray(normal_np(11, (6, K)))
    assert_same(jax.vmap(layer)(xs), layer(xs), "vmap over tokens")
    xs3 = jnp.asarray(normal_np(12, (4, 5, K)))
    assert_same(jax.vmap(layer)(xs3), layer(xs3), "vmap over examples (seq, k)")


def test_nested_vmap_equals_batch_call():
    layer = make_layer(TRAIN)
    xs = jnp.asarray(normal_np(13, (3, 5, K)))
    assert_same(jax.vmap(jax.vmap(layer))(xs), layer(xs), "vmap(vmap(layer))")
    assert_same(
        jax.jit(jax.vmap(jax.vmap(layer)))(xs), jit_call(layer, xs), "jit(vmap(vmap(layer)))"
    )


@pytest.mark.parametrize("use_key", [False, True], ids=["no-key", "key"])
def test_weight_gradient_of_vmapped_model_equals_batched(use_key):
    model = nvfp4x.quantize(TwoLayer(K, N, jax.random.key(1)), TRAIN)
    xs = jnp.asarray(normal_np(14, (4, 9, K)))
    g = jnp.asarray(normal_np(15, (4, 9, K)))
    key = jax.random.key(7) if use_key else None

    def loss_vmap(m):
        return jnp.sum(jax.vmap(lambda x: m(x, key=key))(xs) * g)

    def loss_batch(m):
        return jnp.sum(m(xs, key=key) * g)

    gv = eqx.filter_jit(eqx.filter_grad(loss_vmap))(model)
    gb = eqx.filter_jit(eqx.filter_grad(loss_batch))(model)
    assert_trees_same(gv, gb, "grad of vmapped model vs batched call")


def test_vmap_of_grad_gives_per_example_gradients():
    """Per-example gradients of the vmapped program equal separate runs': bit for bit on
    a CPU; elsewhere up to float32 summation order (`assert_same_sums`): the bias
    gradient sums 7 tokens in one program and 4 x 7 in the other, which XLA:TPU orders
    differently (12 of 24 per-example bias gradients 1-2 ulps apart on a v5e)."""
    layer = make_layer(TRAIN)
    xs = jnp.asarray(normal_np(16, (4, 7, K)))
    gs = jnp.asarray(normal_np(17, (4, 7, N)))
    gl, gx = jax.jit(jax.vmap(grad_layer_x, in_axes=(None, 0, 0)))(layer, xs, gs)
    assert gl.weight.shape == (4, N, K)
    for i in range(4):
        li, xi = jit_grad_layer_x(layer, xs[i], gs[i])
        assert_same_sums(gl.weight[i], li.weight, f"example {i}: dW")
        assert_same_sums(gl.bias[i], li.bias, f"example {i}: db")
        assert_same_sums(gx[i], xi, f"example {i}: dx")
    # Not the batch's total gradient handed to every example.
    total = jit_grad_layer_x(layer, xs, gs)[0].weight
    assert not np.allclose(np.asarray(gl.weight[0]), np.asarray(total))


def test_vmap_over_stacked_weights_is_independent_layers():
    """A vmapped weight (ensemble / stacked layers): independent problems."""
    lins = eqx.filter_vmap(lambda k: eqx.nn.Linear(K, N, key=k))(
        jax.random.split(jax.random.key(2), 3)
    )
    stack = nvfp4x.quantize(lins, TRAIN)
    assert stack.weight.shape == (3, N, K)
    x = jnp.asarray(normal_np(20, (5, K)))
    ys = eqx.filter_vmap(lambda lay: lay(x))(stack)
    params, static = eqx.partition(stack, eqx.is_array)
    for i in range(3):
        one = eqx.combine(jax.tree_util.tree_map(lambda a, i=i: a[i], params), static)
        assert_same(ys[i], one(x), f"stacked layer {i}")


def test_vmap_composes():
    """`jax.vmap` of a whole quantised model (per-example calls) equals the batched call."""
    model = nvfp4x.quantize(TwoLayer(K, N, jax.random.key(5)), TRAIN)
    xs = jnp.asarray(normal_np(34, (6, 3, K)))
    assert_same(jax.vmap(model)(xs), model(xs), "vmap(model)")


def test_scan_over_stacked_layers_matches_unrolled_loop():
    d, nlayers = 24, 2
    keys = jax.random.split(jax.random.key(6), nlayers)
    stack = eqx.filter_vmap(lambda k: eqx.nn.Linear(d, d, key=k))(keys)
    qstack = nvfp4x.quantize(stack, TRAIN)
    assert isinstance(qstack, nvfp4x.QuantizedLinear) and qstack.weight.shape == (nlayers, d, d)
    x, g = jnp.asarray(normal_np(35, (T, d))), jnp.asarray(normal_np(36, (T, d)))

    def loss_scan(q):
        params, static = eqx.partition(q, eqx.is_array)

        def body(h, p):
            return jnp.tanh(eqx.combine(p, static)(h)), None

        h, _ = jax.lax.scan(body, x, params)
        return jnp.sum(h * g)

    def loss_loop(q):
        params, static = eqx.partition(q, eqx.is_array)
        h = x
        for i in range(nlayers):
            layer = eqx.combine(jax.tree_util.tree_map(lambda a, i=i: a[i], params), static)
            h = jnp.tanh(layer(h))
        return jnp.sum(h * g)

    # (one compiled program per loss gives both the loss and its gradient)
    jit = eqx.filter_jit
    loss_s, gs = jit(eqx.filter_value_and_grad(loss_scan))(qstack)
    loss_l, gl = jit(eqx.filter_value_and_grad(loss_loop))(qstack)
    assert_close(loss_s, loss_l, "loss")
    assert gs.weight.shape == (nlayers, d, d)
    # XLA fuses a scan body differently from the unrolled loop: float32 rounding only.
    assert_close(gs.weight, gl.weight, "scan vs unrolled loop dW")
    assert_close(gs.bias, gl.bias, "scan vs unrolled loop db")
