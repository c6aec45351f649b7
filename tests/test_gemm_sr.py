"""Stochastic rounding in the quantised GEMM's backward pass (dgrad's and wgrad's `dy`):
the thresholds follow the weight and the key, not `dy`; a training loop without keys
draws fresh rounding every step; and the rounding is unbiased.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    TRAIN,
    K,
    N,
    T,
    assert_trees_same,
    grad_layer_x,
    jit_grad_layer_x,
    make_layer,
    normal_np,
)
from reference import F32, ref_deq

import nvfp4x


def test_sr_same_key_same_gradients_different_keys_differ():
    layer = make_layer(TRAIN)
    x, g = jnp.asarray(normal_np(21, (T, K))), jnp.asarray(normal_np(22, (T, N)))
    k1, k2 = jax.random.key(1), jax.random.key(2)
    a = jit_grad_layer_x(layer, x, g, k1)
    b = jit_grad_layer_x(layer, x, g, k1)
    c = jit_grad_layer_x(layer, x, g, k2)
    assert_trees_same(a, b, "same key")
    assert not np.array_equal(np.asarray(a[1]), np.asarray(c[1])), "dx: keys ignored"
    assert not np.array_equal(np.asarray(a[0].weight), np.asarray(c[0].weight)), "dW: keys ignored"


def test_sr_without_key_is_reproducible():
    layer = make_layer(TRAIN)
    x, g = jnp.asarray(normal_np(23, (T, K))), jnp.asarray(normal_np(24, (T, N)))
    assert_trees_same(grad_layer_x(layer, x, g), grad_layer_x(layer, x, g), "same dy, no key")
    assert_trees_same(
        jit_grad_layer_x(layer, x, g), jit_grad_layer_x(layer, x, g), "same dy, no key, jit"
    )


def test_sr_training_loop_without_key_draws_fresh_rounding():
    """An optimiser loop that never mentions keys: wgrad's stochastic rounding differs
    from step to step. With the same `x` and `dy` every step, the round-to-nearest wgrad
    `Q(H dy)^T Q(H x)` does not depend on the weight at all, so any change between steps
    is fresh rounding."""
    x, g = jnp.asarray(normal_np(25, (T, K))), jnp.asarray(normal_np(26, (T, N)))
    opt = optax.sgd(1e-3)

    def run(recipe):
        layer = make_layer(recipe)
        state = opt.init(layer)
        dws = []
        for _ in range(3):
            grads, _ = jit_grad_layer_x(layer, x, g)
            dws.append(np.asarray(grads.weight))
            updates, state = opt.update(grads, state)
            layer = eqx.apply_updates(layer, updates)
        return dws

    rn = run(nvfp4x.recipes.nvfp4_training(stochastic_rounding=False))
    assert all(np.array_equal(rn[0], d) for d in rn[1:])  # the premise
    sr = run(TRAIN)
    for i in range(len(sr)):
        for j in range(i):
            assert not np.array_equal(sr[i], sr[j]), f"steps {j} and {i} rounded alike"


# dy -> 2*dy and dy -> -dy leave the scaled values of the quantiser unchanged up to an
# exact factor (the tensor scale doubles / the signs flip), so with the same thresholds
# `grad(c * dy) == c * grad(dy)` exactly. Without a key the thresholds are seeded by the
# weight (documented: fresh every optimiser step, identical on every device layout, shared
# by microbatches of one step), so the identity holds; distinct keys break it.
CHANGES = {"double": 2.0, "negate": -1.0}


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
@pytest.mark.parametrize("which", ["dx", "dW"])
def test_sr_thresholds_follow_weight_and_key_not_dy(change, which):
    c = CHANGES[change]
    x, g = jnp.asarray(normal_np(27, (T, K))), jnp.asarray(normal_np(28, (T, N)))
    layer = make_layer(TRAIN)

    def pick(grads):
        return np.asarray(grads[1] if which == "dx" else grads[0].weight)

    sr1, sr2 = pick(jit_grad_layer_x(layer, x, g)), pick(jit_grad_layer_x(layer, x, c * g))
    np.testing.assert_array_equal(sr2, np.float32(c) * sr1)

    # (the key is an argument of the jitted gradient: one compilation for both keys, and
    # for every case of this test)
    k1, k2 = (pick(jit_grad_layer_x(layer, x, g, jax.random.key(i))) for i in (1, 2))
    assert not np.array_equal(k1, k2), f"{which}: different keys rounded alike"


def sr_problem():
    """`dy` with a ±2688 element in every 1x16 block along n *and* along t (and sizes that
    are multiples of 16): every block scale is exactly 448 and the tensor scale 1, so
    no element saturates and stochastic rounding is exactly unbiased."""
    t, n, k = 32, 32, 24
    rng = np.random.default_rng(29)
    u = rng.uniform(-6, 6, (t, n))
    tt, nn = np.meshgrid(np.arange(t), np.arange(n), indexing="ij")
    u = np.where((tt - nn) % 16 == 0, 6.0 * rng.choice([-1.0, 1.0], (t, n)), u)
    g = (448 * u).astype(F32)
    x = normal_np(30, (t, k))
    return x, g


def test_sr_is_unbiased():
    """Mean over keys of dx and dW approaches the rounding-free value (dy unquantised, the
    other operand quantised as usual) better than any single draw, and at the 1/sqrt(K)
    rate of independent unbiased draws."""
    recipe = nvfp4x.recipes.nvfp4_training(rht=False)
    x, g = sr_problem()
    layer = make_layer(recipe, k=x.shape[1], n=g.shape[1], use_bias=False)
    w = np.asarray(layer.weight)
    want_dx = g.astype(np.float64) @ ref_deq(w, tile=True)
    want_dw = g.astype(np.float64).T @ ref_deq(x, axis=0)
    nkeys = 64
    dxs, dws = [], []
    for i in range(nkeys):
        gl, dx = jit_grad_layer_x(layer, jnp.asarray(x), jnp.asarray(g), jax.random.key(100 + i))
        dxs.append(np.asarray(dx, np.float64))
        dws.append(np.asarray(gl.weight, np.float64))
    for what, draws, want in (("dx", dxs, want_dx), ("dW", dws, want_dw)):
        single = np.array([np.linalg.norm(d - want) for d in draws])
        mean_err = np.linalg.norm(np.mean(draws, axis=0) - want)
        rms = np.sqrt(np.mean(single**2))
        assert single.min() > 0, f"{what}: a draw without rounding error?"
        assert mean_err < single.min(), f"{what}: mean {mean_err:.4g} vs best {single.min():.4g}"
        # Independent unbiased draws: E|mean - want|^2 = rms^2 / K. The norms of these
        # ~1000-element errors concentrate; 2x leaves ample room for chance, not for bias.
        assert mean_err < 2 * rms / np.sqrt(nkeys), f"{what}: {mean_err:.4g} vs {rms:.4g}"


@pytest.mark.parametrize("partitionable", [True, False], ids=["partitionable", "original"])
def test_sr_seed_words_are_jax_random_bits(partitionable):
    """The unrolled Threefry-2x32 (`_threefry`) gives `jax.random`'s words bit for bit:
    `fold_in_tags` (the GEMM's dgrad/wgrad keys) and `bits(key, (2,))` (every SR seed), in
    both of `jax.random`'s counter layouts, eagerly and under `jit`; keys of another
    implementation go through `jax.random`."""
    from nvfp4x._numerics import _threefry

    before = jax.config.jax_threefry_partitionable
    jax.config.update("jax_threefry_partitionable", partitionable)
    try:
        rng = np.random.default_rng(5)
        words = rng.integers(0, 2**32, (16, 2), dtype=np.uint64).astype(np.uint32)
        words[0] = 0
        words[1] = 2**32 - 1
        tags = [0, 1, 2, 2**32 - 1]
        keys = jax.random.wrap_key_data(jnp.asarray(words), impl="threefry2x32")
        want = jax.vmap(lambda k: jax.random.bits(k, (2,), jnp.uint32))(keys)
        for fn in (_threefry.seed_words, jax.jit(_threefry.seed_words)):
            np.testing.assert_array_equal(jax.vmap(fn)(keys), want)
        folded = jax.vmap(lambda w: _threefry.fold_in_tags(w, tuple(tags)))
        got = jax.jit(folded)(jnp.asarray(words))  # (words, tags, 2)
        for i, tag in enumerate(tags):
            want = jax.vmap(lambda k, t=tag: jax.random.key_data(jax.random.fold_in(k, t)))(keys)
            np.testing.assert_array_equal(got[:, i], want, f"fold_in {tag}")
        other = jax.random.key(3, impl="rbg")
        assert not _threefry.is_threefry(other) and not _threefry.is_threefry(jnp.asarray(words[2]))
        np.testing.assert_array_equal(
            _threefry.seed_words(other), jax.random.bits(other, (2,), jnp.uint32)
        )
    finally:
        jax.config.update("jax_threefry_partitionable", before)
