"""Paths that compute several things in one program to give XLA less to compile (issue
37), bit for bit what computing each on its own gives, eagerly and under `jit`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_bits

from nvfp4x._numerics._hadamard import rht, rht_columns

F32 = np.float32

#: `(tokens, columns of the first operand, of the second)`: multiples of 16 and not.
RHT_SHAPES = [(64, 48, 32), (40, 24, 8), (7, 3, 5), (33, 16, 17)]
#: What the columns hold: each kind the transform treats on a path of its own.
RHT_KINDS = ["gaussian", "big", "tiny", "non_finite", "near_max", "spread"]


def _rht_operands(kind: str, shape: tuple[int, int, int], seed: int):
    t, n, k = shape
    rng = np.random.default_rng(seed)
    g = rng.standard_normal((t, n)).astype(F32)
    a = rng.standard_normal((t, k)).astype(F32)
    if kind == "big":  # only the first operand takes the guarded path
        g[:, 0] *= F32(2.0**126)
    elif kind == "tiny":  # subnormal columns in the second operand
        a[:, :2] *= F32(2.0**-140)
        a[0, 1] = F32(1e-45)
    elif kind == "non_finite":
        g[0, 0], a[-1, -1] = np.nan, -np.inf
    elif kind == "near_max":  # results in the top binades, recomputed exactly
        g[:, :2] = np.abs(g[:, :2]) * F32(2.0**126)
    elif kind == "spread":
        g *= (2.0 ** rng.integers(-60, 60, (1, n))).astype(F32)
        a *= (2.0 ** rng.integers(-60, 60, (1, k))).astype(F32)
    return jnp.asarray(g), jnp.asarray(a)


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("shape", RHT_SHAPES, ids=[f"{t}x{n}+{k}" for t, n, k in RHT_SHAPES])
def test_rht_columns_is_rht_of_each(shape, mode):
    def separate(g, a):
        return rht(g, axis=0), rht(a, axis=0)

    def together(g, a):
        return rht_columns(g, a)

    if mode == "jit":  # (one compilation per shape, every kind through it)
        separate, together = jax.jit(separate), jax.jit(together)
    for kind in RHT_KINDS:
        g, a = _rht_operands(kind, shape, seed=sum(shape))
        assert_same_bits(together(g, a), separate(g, a), f"{kind} {shape}")


def test_rht_columns_of_different_lengths():
    """A convolution's wgrad transforms its output gradient and its distinct input
    chunks, of different lengths: one by one, the same bits."""
    g, _ = _rht_operands("spread", (70, 16, 1), seed=5)
    _, a = _rht_operands("tiny", (720, 1, 16), seed=6)
    assert_same_bits(rht_columns(g, a), (rht(g, axis=0), rht(a, axis=0)), "lengths")


def test_rht_columns_of_bfloat16_and_float32():
    g, a = _rht_operands("gaussian", (32, 16, 16), seed=1)
    b = a.astype(jnp.bfloat16)
    assert_same_bits(rht_columns(g, b), (rht(g, axis=0), rht(b, axis=0)), "mixed dtypes")


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_grad_keys_are_jax_fold_in(mode):
    # dgrad's and wgrad's keys come from one vectorised hash of both tags
    # (`fold_in_tags`): each is `jax.random.fold_in` of the seed's key with its tag.
    from nvfp4x._gemm import GRAD_TAGS, grad_key

    words = np.random.default_rng(3).integers(0, 2**32, (5, 2), dtype=np.uint32)
    words[0] = 0
    for tag in GRAD_TAGS:
        fn = lambda s, t=tag: jax.random.key_data(grad_key(s, t))
        fn = jax.jit(fn) if mode == "jit" else fn
        for w in words:
            key = jax.random.wrap_key_data(jnp.asarray(w), impl="threefry2x32")
            want = jax.random.key_data(jax.random.fold_in(key, tag))
            np.testing.assert_array_equal(fn(jnp.asarray(w)), want, f"tag {tag}")
