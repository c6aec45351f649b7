"""The NVFP4 format core (spec §1-4) against an independent NumPy reference.

The reference (`tests/reference.py`) is written from `shared/spec/nvfp4.md` with NumPy
float32 arithmetic and `ml_dtypes` casts only; it never calls into `nvfp4x`. Every
comparison with it is bit for bit: packed codes (unpacked here), block scales (as E4M3
bit patterns), the tensor scale and the dequantised values, eagerly and under `jax.jit`.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import TENSOR_KINDS, tensors
from hypothesis import given, settings, strategies as st
from reference import (
    E2M1,
    E4M3,
    F32,
    GRID,
    TE_SIGNS,
    Ref,
    assert_bits,
    ref_neighbours,
    ref_nvfp4,
    ref_rht_float32,
    sylvester16,
    unpack,
)

import nvfp4x

LAYOUTS = {"1x16": (1, 16), "16x16": (16, 16)}
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
layouts = pytest.mark.parametrize("block", list(LAYOUTS.values()), ids=list(LAYOUTS))
dtypes = pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))


def check_against_ref(
    q: nvfp4x.NVFP4Array, ref: Ref, x: np.ndarray, block, what: str, dequantize: bool = True
) -> None:
    """Shape, dtype, codes, scales and (unless `dequantize=False`) `q.dequantize()`."""
    assert isinstance(q, nvfp4x.NVFP4Array), what
    assert q.shape == x.shape, f"{what}: shape {q.shape} != {x.shape}"
    assert q.dtype == x.dtype, f"{what}: dtype {q.dtype} != {x.dtype}"
    assert q.codes.dtype == np.uint8, what
    assert q.codes.shape == ref.codes.shape[:-1] + (ref.codes.shape[-1] // 2,), what
    codes = unpack(q.codes)
    np.testing.assert_array_equal(
        np.where(ref.valid, codes, 0), np.where(ref.valid, ref.codes, 0), err_msg=f"{what}: codes"
    )
    assert_bits(q.scales, ref.scales, f"{what}: block scales")
    assert_bits(q.tensor_scale, np.asarray(ref.tensor_scale), f"{what}: tensor scale")
    if dequantize:
        assert_bits(q.dequantize(), ref.deq, f"{what}: dequantize()")


def sqnr_db(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(10 * np.log10(np.sum(x**2) / np.sum((x - y) ** 2)))


# Compiled once per (shape, dtype, static options): shapes come from small fixed sets.
to_nvfp4_jit = jax.jit(nvfp4x.to_nvfp4, static_argnames=("block", "rounding"))
fake_quantize_jit = jax.jit(nvfp4x.fake_quantize, static_argnames=("block", "rounding"))
dequantize_jit = jax.jit(lambda q: q.dequantize())
rht_jit = jax.jit(nvfp4x.rht, static_argnames="axis")


def quantise_nearest(x, block):
    """Every public quantiser on `x`, rounding to nearest."""
    q = nvfp4x.to_nvfp4(x, block=block)
    return q, q.dequantize(), nvfp4x.fake_quantize(x, block=block)


def quantise_stochastic(x, key, block):
    """Every public quantiser on `x`, rounding stochastically with `key`."""
    q = nvfp4x.to_nvfp4(x, block=block, rounding="stochastic", key=key)
    fake = nvfp4x.fake_quantize(x, block=block, rounding="stochastic", key=key)
    return q, q.dequantize(), fake


quantise_nearest_jit = jax.jit(quantise_nearest, static_argnames="block")
quantise_stochastic_jit = jax.jit(quantise_stochastic, static_argnames="block")

# ---------------------------------------------------------------------------------------
# Property tests against the reference (hypothesis).
# ---------------------------------------------------------------------------------------

# Every example is checked under `jit`; each (layout, shape, dtype) costs one compile
# (~0.5 s on CPU for rounding to nearest, ~3x that with the PRNG of stochastic rounding).
# bfloat16 differs from float32 only in the casts at both ends, so it gets one shape per
# layout, and stochastic rounding (whose shape handling is the nearest path's) only
# (20, 40). Eager (op-by-op) calls compile each of ~100 primitives once per shape (a few
# seconds per new shape), so examples also run eagerly only for (20, 40), the shape most
# other tests use. Eager and jit differ only in XLA's fusion, which does not depend on
# the shape.
SHAPES = {
    ((1, 16), "float32"): [(16,), (20, 40), (2, 3, 33)],
    ((16, 16), "float32"): [(20, 40), (2, 17, 33)],
    ((1, 16), "bfloat16"): [(20, 40)],
    ((16, 16), "bfloat16"): [(20, 40)],
}
STOCHASTIC_SHAPES = [(20, 40)]
EAGER_SHAPES = {(20, 40)}
#: Tiny tensors (subnormal scales) are checked against the spec in NumPy, which keeps
#: subnormals, in `test_format_inputs.py`.
KINDS = tuple(k for k in TENSOR_KINDS if k != "tiny")


def run_modes(fn, jitted, x: np.ndarray, *args, block) -> dict[str, tuple]:
    """`fn` under jit, and eagerly too where the shape is in `EAGER_SHAPES`."""
    out = {"jit": jitted(jnp.asarray(x), *args, block=block)}
    if x.shape in EAGER_SHAPES:
        out["eager"] = fn(x, *args, block=block)
    return out


@layouts
@dtypes
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_matches_reference(block, dtype, data):
    kind, x = data.draw(tensors(SHAPES[block, np.dtype(dtype).name], KINDS, dtype), label="tensor")
    ref = ref_nvfp4(x, block)
    what = f"{kind} {x.shape} {dtype.name} block={block}"
    non_finite = ~np.isfinite(x.astype(F32))
    for mode, (q, deq, fake) in run_modes(
        quantise_nearest, quantise_nearest_jit, x, block=block
    ).items():
        # (q.dequantize() was computed in the same mode: no eager call on other shapes.)
        check_against_ref(q, ref, x, block, f"{mode} {what}", dequantize=False)
        assert_bits(deq, ref.deq, f"{mode} dequantize {what}")
        # fake_quantize is to_nvfp4(...).dequantize(), bit for bit.
        assert_bits(fake, ref.deq, f"{mode} fake_quantize {what}")
        # Never finite out of non-finite in.
        assert np.isnan(np.asarray(deq).astype(F32)[non_finite]).all(), f"{mode} {what}"


@layouts
@dtypes
@settings(max_examples=15, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**31 - 1))
def test_stochastic_rounds_to_a_neighbour(block, dtype, data, seed):
    kind, x = data.draw(tensors(STOCHASTIC_SHAPES, KINDS, dtype), label="tensor")
    what = f"{kind} {x.shape} {dtype.name} block={block}"
    ref = ref_nvfp4(x, block)  # nearest: the scales must be the same
    lo_code, hi_code, lo_deq, hi_deq = ref_neighbours(ref, x.shape, dtype)
    lo, hi = lo_deq.astype(F32), hi_deq.astype(F32)
    key = jax.random.key(seed)
    results = run_modes(quantise_stochastic, quantise_stochastic_jit, x, key, block=block)
    first = np.asarray(results["jit"][1])
    for mode, (s, deq, fake) in results.items():
        assert_bits(s.scales, ref.scales, f"{mode} {what}: block scales")
        assert_bits(s.tensor_scale, np.asarray(ref.tensor_scale), f"{mode} {what}: tensor scale")
        codes = unpack(s.codes)
        ok = (codes == lo_code) | (codes == hi_code) | ~ref.valid
        assert ok.all(), f"{mode} {what}: codes off the two neighbours"
        # Every dequantised value is one of the two neighbouring grid values (or NaN).
        d = np.asarray(deq).astype(F32)
        assert (np.isnan(d) == np.isnan(lo)).all(), what
        assert ((d == lo) | (d == hi) | np.isnan(lo)).all(), f"{mode} {what}: off the grid"
        # Same key, same bits: eagerly, under jit, and through fake_quantize.
        assert_bits(fake, np.asarray(deq), f"{mode} fake_quantize {what}")
        assert_bits(deq, first, f"{mode} vs jit {what}")


# ---------------------------------------------------------------------------------------
# Tables: codes, ties, saturation, packing, scale clamping and underflow.
# ---------------------------------------------------------------------------------------

# With amax=2688 the tensor scale is exactly 1, and a block whose amax is 6 gets block
# scale 6 * f32(1/6) -> 1.0, so scaled values equal the inputs.
UNIT = dict(amax=2688.0)
SIGNED_GRID = np.concatenate([GRID, -GRID]).astype(F32)  # codes 0..15 in order


def test_every_code_decodes():
    # Decoding alone: hand-built NVFP4Array with unit scales holding codes 0..15.
    want = np.arange(16, dtype=np.uint8).view(E2M1).astype(F32)
    assert_bits(want, SIGNED_GRID, "ml_dtypes table vs spec table")
    packed = (np.arange(0, 16, 2) | (np.arange(1, 16, 2) << 4)).astype(np.uint8)
    q = nvfp4x.NVFP4Array(
        codes=jnp.asarray(packed),
        scales=jnp.ones((1,), jnp.float8_e4m3fn),
        tensor_scale=jnp.ones((), jnp.float32),
        block=(1, 16),
        logical_tail=(16,),
        dtype=np.float32,
    )
    assert_bits(dequantize_jit(q), want, "decode of codes 0..15")
    # Encoding: the 16 grid values (with -0.0) quantise to codes 0..15 and back.
    r = to_nvfp4_jit(jnp.asarray(SIGNED_GRID), **UNIT)
    np.testing.assert_array_equal(unpack(r.codes), np.arange(16))
    assert_bits(r.scales, np.ones(1, E4M3), "unit block scale")
    assert_bits(r.tensor_scale, np.asarray(F32(1)), "unit tensor scale")
    assert_bits(dequantize_jit(r), SIGNED_GRID, "round trip of the grid")


TIES = [  # (value at scale 1, expected code): ties go to the even code
    (0.25, 0),
    (0.75, 2),
    (1.25, 2),
    (1.75, 4),
    (2.5, 4),
    (3.5, 6),
    (5.0, 6),
    (-0.25, 8),
    (-0.75, 10),
    (-1.25, 10),
    (-1.75, 12),
    (-2.5, 12),
    (-3.5, 14),
    (-5.0, 14),
    # not ties, but next to them
    (0.2, 0),
    (0.3, 1),
    (2.6, 5),
    (4.9, 6),
    (5.1, 7),
]


# The 1-D tables run under jit (one compile for all of them); an eager call on a new shape
# would compile ~100 primitives. The eager path is checked on the (20, 40) shape below.


@pytest.mark.parametrize("value,code", TIES, ids=[f"{v}->{c}" for v, c in TIES])
def test_rounding_ties(value, code):
    x = np.zeros(16, F32)
    x[3] = value
    x[10] = 6.0  # block amax 6: block scale exactly 1
    q = to_nvfp4_jit(jnp.asarray(x), **UNIT)
    assert_bits(q.scales, np.ones(1, E4M3), "block scale")
    assert unpack(q.codes)[3] == code


def test_rounding_ties_eager():
    # All the table at once, one block per value, eagerly, in the (20, 40) shape.
    x = np.zeros((20, 40), F32)
    for i, (value, _) in enumerate(TIES):
        x[i, 0], x[i, 15] = value, 6.0
    q = nvfp4x.to_nvfp4(x, **UNIT)
    assert (np.asarray(q.scales).view(np.uint8)[: len(TIES), 0] == 0x38).all()  # 1.0
    np.testing.assert_array_equal(unpack(q.codes)[: len(TIES), 0], [c for _, c in TIES])


SATURATING = [6.2, 6.375, -6.3]  # block scale rounds down to 1.0, so |x / scale| > 6


@pytest.mark.parametrize("value", SATURATING, ids=[str(v) for v in SATURATING])
def test_saturation(value):
    x = np.zeros(16, F32)
    x[5] = value
    q = to_nvfp4_jit(jnp.asarray(x), **UNIT)
    assert_bits(q.scales, np.ones(1, E4M3), "block scale rounds to 1")
    assert unpack(q.codes)[5] == (7 if value > 0 else 15)
    deq = dequantize_jit(q)
    assert np.asarray(deq)[5] == math.copysign(6.0, value)
    assert_bits(deq, ref_nvfp4(x, (1, 16), amax=2688.0).deq, "vs reference")


# With amax=448, S_enc = 2688 / 448 = 6 and S_enc * f32(1/6) rounds to exactly 1.0 in
# float32, so the block scale is e4m3_rne(min(bamax, 448)): the E4M3 rounding laid bare.
E4M3_CASES = [  # (block amax, expected E4M3 block scale)
    (2.0**-10, 0.0),  # half the smallest subnormal: tie to even (0), not up
    (1.5 * 2.0**-9, 2.0**-8),  # subnormal tie between 1 and 2 (x 2^-9): to 2
    (2.5 * 2.0**-9, 2.0**-8),  # subnormal tie between 2 and 3: to 2, not 3
    (3.0 * 2.0**-9, 3.0 * 2.0**-9),  # subnormal, exact
    (7.5 * 2.0**-9, 2.0**-6),  # largest-subnormal tie rounds up into the normals
    (2.0**-6 * 1.0625, 2.0**-6),  # smallest normal binade tie: to even
    (1.0625, 1.0),  # tie between 1.0 and 1.125: to even (1.0)
    (1.1875, 1.25),  # tie between 1.125 and 1.25: to even (1.25)
    (1.07, 1.125),
    (400.0, 384.0),  # tie between 384 and 416: to even (384)
    (432.0, 448.0),  # tie between 416 and 448: to even (448)
    (448.0, 448.0),
    (460.0, 448.0),  # clamped before the cast (ml_dtypes would round 464+ to NaN)
    (1.0e6, 448.0),
]


@pytest.mark.parametrize(
    "bamax,scale", E4M3_CASES, ids=[f"{b:.6g}->{s:.6g}" for b, s in E4M3_CASES]
)
def test_block_scale_rounding(bamax, scale):
    assert F32(scale).astype(E4M3).astype(F32) == F32(scale)  # the table is E4M3 values
    x = np.zeros(16, F32)
    x[2], x[9] = bamax, -bamax / 3
    q = to_nvfp4_jit(jnp.asarray(x), amax=448.0)
    assert_bits(q.tensor_scale, np.asarray(F32(1) / F32(6)), "tensor scale")
    assert_bits(q.scales, np.asarray([scale], F32).astype(E4M3), "block scale")
    ref = ref_nvfp4(x, (1, 16), amax=448.0)
    check_against_ref(q, ref, x, (1, 16), "E4M3 table")


def test_nibble_order():
    x = np.zeros(16, F32)
    x[0], x[1] = 0.5, 6.0  # codes 1 and 7
    x[14], x[15] = -1.0, 3.0  # codes 10 and 5
    q = to_nvfp4_jit(jnp.asarray(x), **UNIT)
    packed = np.asarray(q.codes)
    assert packed[0] == 0x71, hex(packed[0])  # element 0 in the low nibble
    assert packed[7] == 0x5A, hex(packed[7])
    q = to_nvfp4_jit(jnp.asarray(SIGNED_GRID), **UNIT)
    want = [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    np.testing.assert_array_equal(np.asarray(q.codes), want)


@layouts
def test_block_scale_clamps_at_448(block):
    # A too-small amax forces bamax * S_enc / 6 far above 448: the scale must saturate
    # at 448 (E4M3 0x7E), never become NaN, and the codes saturate at ±6.
    x = np.full((20, 40), 100.0, F32)
    x[:, 1::2] *= -1
    q = nvfp4x.to_nvfp4(x, block=block, amax=1.0)
    scales = np.asarray(q.scales).view(np.uint8)
    assert (scales == 0x7E).all(), scales
    codes = unpack(q.codes)[:20, :40]
    np.testing.assert_array_equal(codes[:, 0::2], 7)
    np.testing.assert_array_equal(codes[:, 1::2], 15)
    check_against_ref(q, ref_nvfp4(x, block, amax=1.0), x, block, "clamped")
    assert np.isfinite(np.asarray(q.dequantize())).all()


@layouts
def test_block_scale_underflows_to_zero(block):
    x = np.ones((20, 40), F32)
    x[:, :16] *= 2.0**20
    x[:, 16:] *= 2.0**-20  # 2^-20 * 2688 / 2^20 / 6 = 448 * 2^-40: rounds to E4M3 zero
    for q in (nvfp4x.to_nvfp4(x, block=block), to_nvfp4_jit(jnp.asarray(x), block=block)):
        scales = np.asarray(q.scales).view(np.uint8)
        assert (scales[..., 1:] == 0).all(), scales  # column blocks 1, 2 (both layouts)
        assert (scales[..., 0] != 0).all(), scales
        codes = unpack(q.codes)
        assert (codes < 16).all()
        deq = np.asarray(q.dequantize())
        assert np.isfinite(deq).all(), "a zero block scale must not produce NaN"
        assert (deq[:, 16:] == 0).all()
        check_against_ref(q, ref_nvfp4(x, block), x, block, "underflow")


# ---------------------------------------------------------------------------------------
# Non-finite input.
# ---------------------------------------------------------------------------------------

NON_FINITE = {"nan": np.nan, "+inf": np.inf, "-inf": -np.inf}


@layouts
@pytest.mark.parametrize("bad", list(NON_FINITE.values()), ids=list(NON_FINITE))
def test_non_finite_poisons_only_its_block(block, bad):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((20, 40)).astype(F32)
    x[5, 20] = bad
    poisoned = np.zeros(x.shape, bool)
    if block[0] == 1:
        poisoned[5, 16:32] = True
    else:
        poisoned[0:16, 16:32] = True
    ref = ref_nvfp4(x, block)
    results = {
        "eager": nvfp4x.to_nvfp4(x, block=block).dequantize(),
        "jit": dequantize_jit(to_nvfp4_jit(jnp.asarray(x), block=block)),
        "fake_quantize": nvfp4x.fake_quantize(x, block=block),
        "jit fake_quantize": fake_quantize_jit(jnp.asarray(x), block=block),
    }
    for name, deq in results.items():
        deq = np.asarray(deq)
        np.testing.assert_array_equal(np.isnan(deq), poisoned, err_msg=name)
        assert np.isfinite(deq[~poisoned]).all(), name
        assert_bits(deq, ref.deq, name)
    q = nvfp4x.to_nvfp4(x, block=block)
    scales = np.asarray(q.scales).astype(F32)
    assert np.isnan(scales).sum() == 1
    # NaN is ignored by the tensor amax; an infinity makes it inf, so S_enc = 1.
    expected_ts = F32(1) if np.isinf(bad) else F32(1) / (F32(2688) / np.abs(x[~poisoned]).max())
    assert_bits(q.tensor_scale, np.asarray(expected_ts), "tensor scale")


# ---------------------------------------------------------------------------------------
# Stochastic rounding.
# ---------------------------------------------------------------------------------------


@layouts
def test_stochastic_is_unbiased(block):
    # For each element the dequantised value D is lo or hi (its neighbouring grid values
    # times the scales) with P(hi) = p = (|v| - lo_v) / (hi_v - lo_v), so E[D] = x up to
    # float32 rounding of v = x * inv_b and of the final products (relative 2^-23 each,
    # covered by a 1e-6 relative slack). Over N independent keys the sample mean has
    # standard deviation sigma = (hi - lo) * sqrt(p (1 - p) / N) <= (hi - lo) / (2 sqrt N).
    # With 16*64 elements a 6-sigma bound per element gives a family-wise false alarm
    # below 1024 * 2e-9 ~ 2e-6, and with N = 1000 the bound is <= 0.1 grid steps; the
    # seed is fixed, so the test is deterministic anyway.
    # The sum of the errors over all elements is also checked against 6 sigma of the sum,
    # which catches a small systematic bias (e.g. `u <= p` instead of `u < p`).
    n = 1000
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((16, 64)) * rng.uniform(0.1, 10, (16, 1))).astype(F32)
    keys = jax.random.split(jax.random.key(42), n)
    sample = jax.jit(
        jax.vmap(lambda k: nvfp4x.fake_quantize(x, block=block, rounding="stochastic", key=k))
    )
    d = np.asarray(sample(keys), np.float64)
    ref = ref_nvfp4(x, block)
    _, _, lo, hi = ref_neighbours(ref, x.shape, np.float32)
    lo, hi = np.abs(lo.astype(np.float64)), np.abs(hi.astype(np.float64))
    in_range = np.abs(ref.v[: x.shape[0], : x.shape[1]]) <= 6
    assert in_range.mean() > 0.9
    ax = np.abs(x.astype(np.float64))
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.where(hi > lo, (ax - lo) / (hi - lo), 0.0)
    p = np.clip(p, 0, 1)
    sigma = (hi - lo) * np.sqrt(p * (1 - p) / n)
    err = d.mean(axis=0) - x
    bound = 6 * sigma + 1e-6 * ax + 1e-30
    bad = in_range & (np.abs(err) > bound)
    assert not bad.any(), f"biased at {np.argwhere(bad)[:5]}: err {err[bad][:5]}"
    z = err[in_range].sum() / np.sqrt((sigma[in_range] ** 2).sum())
    assert abs(z) < 6, z
    # Values strictly between grid points really are randomised (both neighbours seen).
    between = in_range & (p > 0.05) & (p < 0.95)
    seen_lo = (np.abs(d) == lo).any(axis=0)
    seen_hi = (np.abs(d) == hi).any(axis=0)
    assert (seen_lo & seen_hi)[between].all()


def test_stochastic_keys():
    x = np.random.default_rng(2).standard_normal((20, 40)).astype(F32)
    k1, k2 = jax.random.key(1), jax.random.key(2)
    a = nvfp4x.to_nvfp4(x, rounding="stochastic", key=k1)
    b = nvfp4x.to_nvfp4(x, rounding="stochastic", key=k1)
    c = nvfp4x.to_nvfp4(x, rounding="stochastic", key=k2)
    np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
    assert (np.asarray(a.codes) != np.asarray(c.codes)).mean() > 0.1
    # Legacy uint32 keys work too.
    d = nvfp4x.to_nvfp4(x, rounding="stochastic", key=jax.random.PRNGKey(1))
    assert d.codes.shape == a.codes.shape
    # Scales are the nearest-rounding ones whatever the key.
    n = nvfp4x.to_nvfp4(x)
    for r in (a, c, d):
        assert_bits(r.scales, np.asarray(n.scales), "stochastic block scales")
        assert_bits(r.tensor_scale, np.asarray(n.tensor_scale), "stochastic tensor scale")


# ---------------------------------------------------------------------------------------
# The `amax=` argument.
# ---------------------------------------------------------------------------------------


@layouts
def test_amax_argument(block):
    x = np.random.default_rng(3).standard_normal((20, 40)).astype(F32)
    amax = np.abs(x).max()
    q0 = nvfp4x.to_nvfp4(x, block=block)
    for a in (amax, float(amax), jnp.asarray(amax)):
        q1 = nvfp4x.to_nvfp4(x, block=block, amax=a)
        for f0, f1 in zip(
            jax.tree_util.tree_leaves(q0), jax.tree_util.tree_leaves(q1), strict=True
        ):
            assert_bits(f1, np.asarray(f0), "same amax")
    # Under jit the amax may be traced.
    q2 = jax.jit(lambda x, a: nvfp4x.to_nvfp4(x, block=block, amax=a))(x, amax)
    assert_bits(q2.dequantize(), np.asarray(q0.dequantize()), "traced amax")
    # A larger amax: tensor scale grows in proportion, everything else as the reference.
    big = F32(4 * amax)
    q3 = nvfp4x.to_nvfp4(x, block=block, amax=big)
    check_against_ref(q3, ref_nvfp4(x, block, amax=big), x, block, "amax=4*max|x|")
    ratio = float(q3.tensor_scale) / float(q0.tensor_scale)
    assert ratio == pytest.approx(4.0, rel=1e-6)
    assert_bits(q3.tensor_scale, np.asarray(F32(1) / (F32(2688) / big)), "s_dec")


# ---------------------------------------------------------------------------------------
# The derivative of fake_quantize: straight-through (spec §5).
# ---------------------------------------------------------------------------------------

STE_CASES = {
    "nearest": {},
    "16x16 tiles": {"block": (16, 16)},
    "stochastic": {"rounding": "stochastic", "key": jax.random.key(0)},
    "saturating amax": {"amax": 0.5},  # most elements clamp at their block's largest
    "scale up": {"scale_rounding": "up"},
}


@pytest.mark.parametrize("kwargs", list(STE_CASES.values()), ids=list(STE_CASES))
def test_fake_quantize_gradient_is_straight_through(kwargs):
    # The incoming gradient passes unchanged, for saturated and NaN elements too.
    x = np.random.default_rng(9).standard_normal((20, 40)).astype(F32)
    x[3, 5] = np.nan
    ct = np.random.default_rng(10).standard_normal((20, 40)).astype(F32)

    def loss(x):
        return jnp.sum(nvfp4x.fake_quantize(x, **kwargs) * ct)

    # (Jitted only: the rule is the same eagerly, where differentiating compiles the
    # quantiser op by op, ~10 s.)
    assert_bits(jax.jit(jax.grad(loss))(x), ct, "grad")


def test_fake_quantize_gradient_vmap_and_higher_order():
    x = jnp.asarray(np.random.default_rng(11).standard_normal((4, 32)).astype(F32))
    ones = np.ones((4, 32), F32)
    row = jax.grad(lambda r: nvfp4x.fake_quantize(r).sum())
    assert_bits(jax.jit(jax.vmap(row))(x), ones, "vmap(grad)")
    # A bfloat16 input gets a bfloat16 gradient; the Hessian is zero; amax gets nothing.
    xb = x.astype(jnp.bfloat16)
    gb = jax.jit(jax.grad(lambda v: nvfp4x.fake_quantize(v).astype(jnp.float32).sum()))(xb)
    assert gb.dtype == jnp.bfloat16 and np.all(np.asarray(gb, F32) == 1)
    h = jax.jit(jax.hessian(lambda v: nvfp4x.fake_quantize(v).sum()))(x[0, :16])
    assert_bits(h, np.zeros((16, 16), F32), "hessian")
    da = jax.jit(jax.grad(lambda a: nvfp4x.fake_quantize(x, amax=a).sum()))(jnp.float32(3.0))
    assert float(da) == 0.0


# ---------------------------------------------------------------------------------------
# Random Hadamard transform (spec §4).
# ---------------------------------------------------------------------------------------


def test_hadamard_matrix():
    h = np.asarray(nvfp4x.hadamard_matrix())
    assert h.shape == (16, 16)
    np.testing.assert_allclose(h @ h.T, np.eye(16), atol=1e-6)
    np.testing.assert_array_equal(h, np.diag(TE_SIGNS) @ sylvester16() / 4)
    # rht on the identity returns H itself (one 16-row chunk), eagerly.
    np.testing.assert_allclose(np.asarray(nvfp4x.rht(jnp.eye(16), axis=0)), h, atol=1e-7)


RHT_LENGTHS = [16, 48, 40, 100, 7]


@pytest.mark.parametrize("n", RHT_LENGTHS, ids=[f"n={n}" for n in RHT_LENGTHS])
def test_rht_preserves_products(n):
    rng = np.random.default_rng(n)
    a = rng.standard_normal((n, 8)).astype(F32)
    b = rng.standard_normal((n, 12)).astype(F32)
    # rht acts on each column separately: transform both operands in one call.
    rab = np.asarray(rht_jit(jnp.asarray(np.concatenate([a, b], axis=1)), axis=0))
    ra, rb = rab[:, :8], rab[:, 8:]
    padded = n + (-n % 16)
    assert ra.shape == (padded, 8) and rb.shape == (padded, 12)
    got = ra.astype(np.float64).T @ rb.astype(np.float64)
    want = a.astype(np.float64).T @ b.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * math.sqrt(n))
    # Each 16-row chunk is H @ chunk; the transform is orthogonal, so norms are kept.
    h = np.diag(TE_SIGNS) @ sylvester16() / 4
    ap = np.pad(a, [(0, padded - n), (0, 0)]).astype(np.float64)
    for c in range(padded // 16):
        np.testing.assert_allclose(
            ra[16 * c : 16 * c + 16], h @ ap[16 * c : 16 * c + 16], atol=1e-5
        )
    np.testing.assert_allclose(np.linalg.norm(ra, axis=0), np.linalg.norm(a, axis=0), rtol=1e-5)
    # Along another axis it is the same transform.
    np.testing.assert_allclose(np.asarray(rht_jit(jnp.asarray(a.T), axis=1)), ra.T, atol=1e-6)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_rht_sums_in_its_defined_order(mode):
    """Each output of `rht` is its 16 terms `±x_j / 4` summed in one defined float32
    order (the fast Walsh-Hadamard transform's butterflies), the same on every backend:
    bit for bit a NumPy float32 implementation of that order, on data spanning 2^-90 to
    2^110 (columns within the range that needs no scaling) with exact cancellations,
    zero columns and a length that pads."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((100, 24)) * np.exp2(rng.integers(-90, 110, (100, 24)))
    x[:, 3] = 0.0
    x[::2, 5] = -x[1::2, 5]  # pairs that cancel exactly in the first butterflies
    x[:, 7] = np.float32(2.0**-99)  # (normal, small: no scaling)
    x = x.astype(F32)
    fn = nvfp4x.rht if mode == "eager" else rht_jit
    got = np.asarray(fn(jnp.asarray(x), axis=0))
    assert_bits(got, ref_rht_float32(x), "rht against its defined order")
    # Along another axis, the same bits.
    assert_bits(np.asarray(fn(jnp.asarray(x.T), axis=1)), ref_rht_float32(x).T, "axis 1")


# ---------------------------------------------------------------------------------------
# Accuracy.
# ---------------------------------------------------------------------------------------

# Measured on N(0, 1) 256x256 float32 (numpy default_rng(0), the data below), nvfp4x 0.1.0,
# SQNR in float64: 1x16 20.45 dB, 16x16 19.08 dB (the coarser tiles cost ~1.4 dB); seeds
# 0-5 give 20.40-20.45 and 18.99-19.12 dB. Thresholds sit 0.5 dB below the measured ones.
SQNR_DB = {(1, 16): 20.45 - 0.5, (16, 16): 19.08 - 0.5}


@layouts
def test_sqnr(block):
    x = np.random.default_rng(0).standard_normal((256, 256)).astype(F32)
    _, y, fake = quantise_nearest_jit(jnp.asarray(x), block=block)  # one program
    assert sqnr_db(x, y) > SQNR_DB[block]
    assert_bits(fake, np.asarray(y), "fake_quantize")


# ---------------------------------------------------------------------------------------
# NVFP4Array as a pytree.
# ---------------------------------------------------------------------------------------


def assert_same_array(a: nvfp4x.NVFP4Array, b: nvfp4x.NVFP4Array, what: str) -> None:
    assert type(a) is type(b), what
    assert (a.shape, a.dtype, a.block) == (b.shape, b.dtype, b.block), what
    for name in ("codes", "scales", "tensor_scale"):
        assert_bits(getattr(a, name), np.asarray(getattr(b, name)), f"{what}: {name}")


@layouts
def test_jit_argument_and_return(block):
    x = np.random.default_rng(4).standard_normal((20, 40)).astype(F32)
    q = nvfp4x.to_nvfp4(x, block=block)
    assert_same_array(jax.jit(lambda q: q)(q), q, "identity under jit")
    assert_bits(dequantize_jit(q), np.asarray(q.dequantize()), "dequantize under jit")
    doubled = jax.jit(lambda q: eqx.tree_at(lambda t: t.tensor_scale, q, 2 * q.tensor_scale))(q)
    assert_bits(doubled.dequantize(), 2 * np.asarray(q.dequantize()), "tree_at under jit")
    assert_same_array(to_nvfp4_jit(jnp.asarray(x), block=block), q, "to_nvfp4 under jit")


VMAP_SHAPES = {(1, 16): (4, 20, 40), (16, 16): (4, 20, 40)}


@layouts
def test_vmap_gives_per_slice_scales(block):
    rng = np.random.default_rng(5)
    x = rng.standard_normal(VMAP_SHAPES[block])
    x = (x * 2.0 ** (8 * np.arange(4) - 12)[:, None, None]).astype(F32)  # slices differ

    @jax.jit
    def batched(x):
        q = jax.vmap(lambda s: nvfp4x.to_nvfp4(s, block=block))(x)
        fake = jax.vmap(lambda s: nvfp4x.fake_quantize(s, block=block))(x)
        return q, q.dequantize(), jax.vmap(lambda t: t.dequantize())(q), fake

    q, deq, vmapped_deq, fake = batched(jnp.asarray(x))
    assert q.tensor_scale.shape == (4,)
    assert q.shape == x.shape
    assert len(set(np.asarray(q.tensor_scale).tolist())) == 4
    # Each slice alone, through the program `test_matches_reference` compiled for (20, 40)
    # (jit equals eager there).
    slices = [quantise_nearest_jit(jnp.asarray(x[i]), block=block) for i in range(4)]
    for i, (s, _, _) in enumerate(slices):
        assert_bits(q.codes[i], np.asarray(s.codes), f"slice {i} codes")
        assert_bits(q.scales[i], np.asarray(s.scales), f"slice {i} scales")
        assert_bits(q.tensor_scale[i], np.asarray(s.tensor_scale), f"slice {i} tensor scale")
    want = np.stack([np.asarray(deq) for _, deq, _ in slices])
    assert_bits(deq, want, "dequantize of the batch")
    assert_bits(vmapped_deq, want, "vmapped dequantize")
    assert_bits(fake, want, "vmapped fake_quantize")


def test_tree_map():
    q = nvfp4x.to_nvfp4(np.random.default_rng(6).standard_normal((20, 40)).astype(F32))
    leaves = jax.tree_util.tree_leaves(q)
    assert len(leaves) == 3  # codes, block scales, tensor scale
    assert sum(leaf.nbytes for leaf in leaves) == q.nbytes
    assert_same_array(jax.tree_util.tree_map(jnp.copy, q), q, "tree_map copy")
    doubled = jax.tree_util.tree_map(lambda a: a * 2 if a.dtype == np.float32 else a, q)
    assert_bits(doubled.dequantize(), 2 * np.asarray(q.dequantize()), "tree_map on a leaf")


def test_repr():
    q = nvfp4x.to_nvfp4(jnp.ones((20, 40), jnp.bfloat16), block=(16, 16))
    assert repr(q) == "NVFP4Array(shape=(20, 40), dtype=bfloat16, block=(16, 16))"
    # Leaves replaced by shardings (as when building `out_shardings`) still print.
    shardings = jax.tree_util.tree_map(lambda a: a.sharding, q)
    text = repr(shardings)
    assert text.startswith("NVFP4Array(") and "codes=" in text and "Sharding" in text


@layouts
def test_serialise_round_trip(block, tmp_path):
    x = np.random.default_rng(7).standard_normal((20, 40)).astype(F32)
    x[3, 5] = np.nan  # a NaN block scale must survive too
    q = nvfp4x.to_nvfp4(x, block=block)
    path = tmp_path / "q.eqx"
    eqx.tree_serialise_leaves(path, q)
    r = eqx.tree_deserialise_leaves(path, q)
    assert_same_array(r, q, "deserialised")
    assert_bits(r.dequantize(), np.asarray(q.dequantize()), "deserialised dequantize")


@pytest.mark.parametrize("block,bits", [((1, 16), 4.5), ((16, 16), 4 + 8 / 256)], ids=list(LAYOUTS))
def test_nbytes(block, bits):
    n = 4096
    # An argument, not a constant inside jit: XLA would constant-fold the whole cast.
    q = to_nvfp4_jit(jnp.zeros((n, n), jnp.float32), block=block)
    assert q.nbytes == n * n * bits / 8 + 4
    assert q.nbytes == q.codes.nbytes + q.scales.nbytes + q.tensor_scale.nbytes
    # Padding is paid for: (20, 40) -> codes (20, 24), scales (20, 3).
    small = nvfp4x.to_nvfp4(jnp.ones((20, 40)))
    assert small.codes.shape == (20, 24) and small.scales.shape == (20, 3)
    assert small.nbytes == 20 * 24 + 20 * 3 + 4
    tile = nvfp4x.to_nvfp4(jnp.ones((20, 40)), block=(16, 16))
    assert tile.codes.shape == (32, 24) and tile.scales.shape == (2, 3)
    assert tile.nbytes == 32 * 24 + 2 * 3 + 4
