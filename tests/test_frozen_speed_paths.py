"""The frozen layer's fast path at a few tokens: on a CPU, a GEMM of at most
`CHUNKED_MAX_TOKENS` tokens runs as `chunked_dot`, a fixed-order multiply-add loop,
and the frozen layer runs the same loop on its packed codes (decoded chunk by chunk,
inside the loop). Checked here: the arithmetic decoders equal the reference decoders
bit for bit, and the frozen forward equals the unfrozen one bit for bit on that path
(and next to it), non-finite weights included. On a TPU the frozen GEMM is a kernel
summing the same products in another order: equal up to that there."""

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
    """Bit for bit, but for the sign of NaN: XLA:TPU's conversion gives every NaN
    positive (`0xFF` decodes to `0x7FC00000` there, seen on a v5e), XLA:CPU's keeps the
    sign, as `decode_e4m3` does."""
    fn = jax.jit(decode_e4m3) if jit else decode_e4m3
    ref = jax.lax.bitcast_convert_type(BYTES, jnp.float8_e4m3fn).astype(jnp.float32)
    got, want = bits(fn(BYTES)), bits(ref)
    nan = np.isnan(np.asarray(ref))
    assert nan.sum() == 2 and np.isnan(np.asarray(fn(BYTES))[nan]).all()
    np.testing.assert_array_equal(got[~nan], want[~nan])
    np.testing.assert_array_equal(got[nan] & 0x7FFFFFFF, want[nan] & 0x7FFFFFFF)


def assert_frozen_equals(y_f, y_q, err_msg: str = "") -> None:
    """Bit for bit on a CPU (the chunked loop, or XLA, on both sides). Elsewhere the
    frozen layer's GEMM may be a kernel (a TPU's, for bfloat16 or float32 activations)
    that sums the same exact products in another float32 order: equal up to that
    (a few units in the last place; non-finite outputs where the unfrozen ones are)."""
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(y_f, y_q, err_msg=err_msg)
        return
    y_f, y_q = np.asarray(y_f), np.asarray(y_q)
    np.testing.assert_array_equal(np.isfinite(y_f), np.isfinite(y_q), err_msg=err_msg)
    finite = np.isfinite(y_q)
    scale = np.abs(y_q[finite]).max() if finite.any() else 1.0
    np.testing.assert_allclose(y_f, y_q, rtol=1e-5, atol=1e-6 * scale, err_msg=err_msg)


def _pair(recipe, n, k, seed=0):
    lin = eqx.nn.Linear(k, n, key=jax.random.key(seed))
    q = nvfp4x.quantize(lin, recipe)
    return q, nvfp4x.freeze(q)


RECIPES = [
    nvfp4x.recipes.nvfp4_weight_only(),
    nvfp4x.recipes.nvfp4_inference(),
    nvfp4x.recipes.nvfp4_inference(weight_block=(16, 16)),
]


#: `(out, in)` of the layers: one chunk of the loop, no padding; several chunks, with
#: padded rows (for 16x16 tiles), a padded block and a padded chunk.
SHAPES = [(16, 64), (33, 250)]
#: On the chunked path (one token, the most it takes) and next to it.
TOKENS = [1, CHUNKED_MAX_TOKENS, CHUNKED_MAX_TOKENS + 1]


@eqx.filter_jit
def _both(frozen, trained, xs):
    """Every layer of both models on each of its inputs, in one compile."""
    run = lambda layers: [
        [jax.vmap(layer)(x) for x in inputs] for layer, inputs in zip(layers, xs, strict=True)
    ]
    return run(frozen), run(trained)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.name}{r.weight.block}")
def test_frozen_equals_unfrozen_at_a_few_tokens(recipe):
    pairs = [_pair(recipe, n, k, seed) for seed, (n, k) in enumerate(SHAPES)]
    trained, frozen = [q for q, _ in pairs], [f for _, f in pairs]
    xs = [[jax.random.normal(jax.random.key(m), (m, k)) for m in TOKENS] for _, k in SHAPES]
    ys_f, ys_q = _both(frozen, trained, xs)
    for shape, row_f, row_q in zip(SHAPES, ys_f, ys_q, strict=True):
        for m, y_f, y_q in zip(TOKENS, row_f, row_q, strict=True):
            assert_frozen_equals(y_f, y_q, err_msg=f"jit, {m} tokens, {shape}")
            assert y_f.shape == (m, shape[0]) and np.all(np.isfinite(y_f)), (m, shape)
    # Eagerly too (every primitive run on its own), at one token, on the padded layer.
    x = xs[-1][0]
    assert_frozen_equals(jax.vmap(frozen[-1])(x), jax.vmap(trained[-1])(x))


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
    assert_frozen_equals(yf, yq)
