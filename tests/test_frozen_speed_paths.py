"""The frozen layer's fast path at a few tokens (issue 17): on a CPU, a GEMM of at most
`CHUNKED_MAX_TOKENS` tokens runs as `chunked_dot`, a fixed-order multiply-add loop,
and the frozen layer runs the same loop on its packed codes (decoded chunk by chunk,
inside the loop). Checked here: the arithmetic decoders equal the reference decoders
bit for bit, and the frozen forward equals the unfrozen one bit for bit on that path
(and next to it), non-finite weights included."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4x
from nvfp4x._formats._dot import CHUNKED_MAX_TOKENS
from nvfp4x._numerics import _e2m1
from nvfp4x._numerics._pack import NIBBLE_SCALE, decode_e4m3, nibble_values, unpack

BYTES = jnp.arange(256, dtype=jnp.uint8)


def decode_nibbles(packed):
    """The E2M1 values of each byte's nibbles: `nibble_values` times `2^14`."""
    lo, hi = nibble_values(packed)
    return lo * (1 / NIBBLE_SCALE), hi * (1 / NIBBLE_SCALE)


def bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("jit", [False, True])
def test_nibble_decode_equals_the_reference_for_every_byte(jit):
    fn = jax.jit(decode_nibbles) if jit else decode_nibbles
    lo, hi = fn(BYTES)
    ref = np.asarray(_e2m1.decode(unpack(BYTES))).reshape(256, 2)
    np.testing.assert_array_equal(bits(lo), bits(ref[:, 0]))
    np.testing.assert_array_equal(bits(hi), bits(ref[:, 1]))
    lo_s, _ = nibble_values(BYTES)
    np.testing.assert_array_equal(bits(lo_s), bits(ref[:, 0] * np.float32(NIBBLE_SCALE)))


@pytest.mark.parametrize("jit", [False, True])
def test_e4m3_decode_equals_xla_for_every_byte(jit):
    fn = jax.jit(decode_e4m3) if jit else decode_e4m3
    ref = jax.lax.bitcast_convert_type(BYTES, jnp.float8_e4m3fn).astype(jnp.float32)
    np.testing.assert_array_equal(bits(fn(BYTES)), bits(ref))


def _pair(recipe, n, k, seed=0):
    lin = eqx.nn.Linear(k, n, key=jax.random.key(seed))
    q = nvfp4x.quantize(lin, recipe)
    return q, nvfp4x.freeze(q)


RECIPES = [
    nvfp4x.recipes.nvfp4_weight_only(),
    nvfp4x.recipes.nvfp4_inference(),
    nvfp4x.recipes.nvfp4_inference(weight_block=(16, 16)),
]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.name}{r.weight.block}")
@pytest.mark.parametrize("shape", [(48, 64), (40, 100), (33, 250), (64, 1024)])
def test_frozen_equals_unfrozen_at_a_few_tokens(recipe, shape):
    n, k = shape
    q, f = _pair(recipe, n, k)
    fwd = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    for m in range(1, CHUNKED_MAX_TOKENS + 2):
        x = jax.random.normal(jax.random.key(m), (m, k))
        np.testing.assert_array_equal(jax.vmap(f)(x), jax.vmap(q)(x))
        np.testing.assert_array_equal(fwd(f, x), fwd(q, x))
        y = fwd(f, x)
        ref = x @ q.weight.array.T  # close to the float product (quantisation error)
        assert np.all(np.isfinite(y)) and y.shape == ref.shape


def test_the_chunked_loop_runs_on_a_cpu_at_one_token():
    if jax.default_backend() != "cpu":
        pytest.skip("the chunked path is for CPUs")
    _, f = _pair(nvfp4x.recipes.nvfp4_weight_only(), 64, 256)
    text = jax.jit(lambda m, x: jax.vmap(m)(x)).lower(f, jnp.ones((1, 256))).as_text()
    assert "while" in text
    text = jax.jit(lambda m, x: jax.vmap(m)(x)).lower(f, jnp.ones((64, 256))).as_text()
    assert "while" not in text


@pytest.mark.parametrize("recipe", RECIPES[:2], ids=lambda r: r.name)
def test_non_finite_weights_stay_non_finite(recipe):
    k = 100  # not a multiple of 16: a padded block holds the NaN
    lin = eqx.nn.Linear(k, 32, key=jax.random.key(0))
    w = lin.weight.at[3, 97].set(jnp.nan).at[5, 2].set(jnp.inf)
    lin = eqx.tree_at(lambda m: m.weight, lin, w)
    q = nvfp4x.quantize(lin, recipe)
    f = nvfp4x.freeze(q)
    x = jax.random.normal(jax.random.key(1), (1, k))
    yf, yq = jax.vmap(f)(x), jax.vmap(q)(x)
    np.testing.assert_array_equal(np.isfinite(yf), np.isfinite(yq))
    assert not np.all(np.isfinite(yf))
    np.testing.assert_array_equal(yf, yq)
