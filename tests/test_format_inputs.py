"""Every public quantiser's input checks, and the numbers at float32's extremes.

- One set of checks for `to_nvfp4`, `fake_quantize`, `to_mxfp8`, `to_fp8` and `rht`:
  non-float arrays, 0-d arrays, malformed `block` and `amax`, eagerly and under `jit`.
- Non-finite input never comes out finite, from any quantiser.
- MXFP8 near float32's maximum stays finite (spec §6: the scale rounds up, elements
  saturate).
- NVFP4 of tiny tensors, down to the smallest subnormal amax, bit for bit against the
  spec's float32 formulas (§2) in NumPy, which keeps subnormals. XLA on CPU runs with
  denormals-are-zero and flush-to-zero (checked below), so this is what catches any step
  of the library that does float arithmetic on a subnormal.

The references (`tests/reference.py`) are written from `shared/spec/nvfp4.md` with NumPy
float32 and `ml_dtypes` casts only; they never call into `nvfp4x`.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from reference import (
    E2M1,
    E4M3,
    F32,
    FLT_MAX,
    assert_bits,
    ref_fp8,
    ref_mxfp8,
    ref_nvfp4,
    unpack,
)

import nvfp4x

LAYOUTS = {"1x16": (1, 16), "16x16": (16, 16)}
#: The shape of (almost) every array below: one compile per function, layout and mode
#: (eager calls compile each primitive once per shape); 20 and 40 exercise the padding.
SHAPE = (20, 40)
layouts = pytest.mark.parametrize("block", list(LAYOUTS.values()), ids=list(LAYOUTS))
MODES = pytest.mark.parametrize("mode", ["eager", "jit"])


def call(fn, mode, *args, **kwargs):
    """`fn(*args, **kwargs)` eagerly, or under `jit` with the array keyword arguments traced
    and the others static (jitted functions are cached: one compile per signature)."""
    if mode == "eager":
        return fn(*args, **kwargs)
    static = tuple(sorted(k for k, v in kwargs.items() if not hasattr(v, "shape")))
    return _jitted(fn, static)(*args, **kwargs)


@functools.cache
def _jitted(fn, static: tuple[str, ...]):
    return jax.jit(fn, static_argnames=static)


# ---------------------------------------------------------------------------------------
# 1. One set of input checks.
# ---------------------------------------------------------------------------------------

QUANTISERS = {
    "to_nvfp4": nvfp4x.to_nvfp4,
    "fake_quantize": nvfp4x.fake_quantize,
    "to_mxfp8": nvfp4x.to_mxfp8,
    "to_fp8": nvfp4x.to_fp8,
    "rht": nvfp4x.rht,
}
all_quantisers = pytest.mark.parametrize("fn", list(QUANTISERS.values()), ids=list(QUANTISERS))
blocked = pytest.mark.parametrize(
    "fn",
    [nvfp4x.to_nvfp4, nvfp4x.fake_quantize, nvfp4x.to_mxfp8, nvfp4x.rht],
    ids=["to_nvfp4", "fake_quantize", "to_mxfp8", "rht"],
)
nvfp4_quantisers = pytest.mark.parametrize(
    "fn", [nvfp4x.to_nvfp4, nvfp4x.fake_quantize], ids=["to_nvfp4", "fake_quantize"]
)
BAD_DTYPES = {
    "int32": np.arange(32, dtype=np.int32),
    "uint8": np.arange(32, dtype=np.uint8),
    "bool": np.ones(32, dtype=bool),
    "complex64": np.ones(32, dtype=np.complex64),
}


@all_quantisers
@MODES
@pytest.mark.parametrize("x", list(BAD_DTYPES.values()), ids=list(BAD_DTYPES))
def test_non_float_dtype(fn, mode, x):
    for arg in (x, jnp.asarray(x)):
        with pytest.raises(TypeError, match=rf"`x` has dtype `{x.dtype.name}`.*astype"):
            call(fn, mode, arg)


@blocked
@MODES
def test_zero_dimensional(fn, mode):
    with pytest.raises(ValueError, match=r"`x` has shape \(\).*at least 1 dimension"):
        call(fn, mode, jnp.float32(1.5))


@MODES
def test_fp8_zero_dimensional(mode):
    # Per-tensor FP8 has no blocks: a scalar is fine, and gives the reference's numbers.
    for kind in ("e4m3", "e5m2"):
        for v in (F32(1.5), F32(-3.0e-3), F32(0.0)):
            f = call(nvfp4x.to_fp8, mode, jnp.asarray(v), kind=kind)
            ref = ref_fp8(v, kind)
            assert_bits(f.data, ref.data, f"{kind} {v} data")
            assert_bits(f.scale, ref.scale, f"{kind} {v} scale")
            assert_bits(f.dequantize(), ref.deq, f"{kind} {v} dequantize")


BAD_BLOCKS = {
    "float 1.5": (1.5, 16),
    "floats 1.0, 16.0": (1.0, 16.0),
    "string": "16x16",
    "string 1x16": "1x16",
    "one entry": (16,),
    "three entries": (1, 16, 16),
    "bools": (True, 16),
    "numpy array": np.array([1, 16]),
    "wrong size": (2, 16),
    "mxfp8 size": (1, 32),
    "none entries": (None, 16),
}


@nvfp4_quantisers
@MODES
@pytest.mark.parametrize("block", list(BAD_BLOCKS.values()), ids=list(BAD_BLOCKS))
def test_bad_block(fn, mode, block):
    x = jnp.ones((32, 32))
    with pytest.raises(ValueError, match=r"not supported; use `\(1, 16\)`.*`\(16, 16\)`"):
        if mode == "eager" or isinstance(block, np.ndarray):  # (not hashable: not static)
            fn(x, block=block)
        else:
            call(fn, mode, x, block=block)


@nvfp4_quantisers
def test_block_spellings(fn):
    # A list, and NumPy integers, are the same block as the tuple of Python ints.
    x = np.random.default_rng(0).standard_normal(SHAPE).astype(F32)
    want = fn(x, block=(16, 16))
    for block in ([16, 16], (np.int64(16), np.int32(16))):
        got = fn(x, block=block)
        for a, b in zip(
            jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True
        ):
            assert_bits(a, b, f"block={block!r}")


@nvfp4_quantisers
@MODES
def test_tile_block_needs_two_axes(fn, mode):
    with pytest.raises(ValueError, match=r"`block=\(16, 16\)` needs .* at least 2 dim"):
        call(fn, mode, jnp.ones(32), block=(16, 16))


@nvfp4_quantisers
def test_bad_rounding(fn):
    with pytest.raises(ValueError, match=r"`rounding='up'`.*nearest.*stochastic"):
        fn(jnp.ones(32), rounding="up")
    with pytest.raises(ValueError, match=r"`key"):
        fn(jnp.ones(32), rounding="stochastic")


@nvfp4_quantisers
def test_negative_amax(fn):
    with pytest.raises(ValueError, match=r"`amax=-1.0`.*negative"):
        fn(jnp.ones(32), amax=-1.0)


BAD_AMAX_TYPES = {
    "str": "3",
    "bytes": b"3",
    "bool": True,
    "complex": 1 + 2j,
    "complex array": np.ones((), np.complex64),
    "bool array": np.ones((), bool),
    "list": [3.0],
    "none in list": [None],
}


@nvfp4_quantisers
@pytest.mark.parametrize("amax", list(BAD_AMAX_TYPES.values()), ids=list(BAD_AMAX_TYPES))
def test_amax_must_be_real(fn, amax):
    with pytest.raises(TypeError, match=r"`amax` must be a real number"):
        fn(jnp.ones(32), amax=amax)


@nvfp4_quantisers
def test_amax_traced_must_be_real(fn):
    f = jax.jit(lambda x, a: fn(x, amax=a))
    with pytest.raises(TypeError, match=r"`amax` must be a real number.*bool"):
        f(jnp.ones(32), jnp.ones((), bool))
    with pytest.raises(ValueError, match=r"`amax` must be a scalar, got shape \(2,\)"):
        f(jnp.ones(32), jnp.ones(2))


@nvfp4_quantisers
@MODES
def test_amax_real_spellings(fn, mode):
    # An int, a NumPy scalar, 0-d and 1-element arrays (float or int) are all amax=3.
    x = np.random.default_rng(1).standard_normal(SHAPE).astype(F32)
    want = call(fn, mode, x, amax=3.0)
    for amax in (3, np.float64(3.0), np.int32(3), np.full((1,), 3.0, F32), jnp.int32(3)):
        got = call(fn, mode, x, amax=amax)
        for a, b in zip(
            jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True
        ):
            assert_bits(a, b, f"amax={amax!r}")
    with pytest.raises(ValueError, match=r"`amax` must be a scalar"):
        fn(x, amax=np.ones(3))


@nvfp4_quantisers
@MODES
def test_nan_amax_poisons_everything(fn, mode):
    # A NaN amax (a diverged calibration) is let through, and nothing comes out finite.
    x = jnp.ones(SHAPE)
    for amax in (float("nan"), jnp.float32(np.nan)):
        out = call(fn, mode, x, amax=amax)
        y = np.asarray(out if isinstance(out, jax.Array) else out.dequantize())
        assert np.isnan(y).all()


@MODES
def test_rht_axis(mode):
    x = jnp.ones(SHAPE)
    with pytest.raises(ValueError, match=r"`axis=2` is out of range .* \[-2, 1\]"):
        call(nvfp4x.rht, mode, x, axis=2)
    # A negative axis counts from the end, as in NumPy.
    a = np.random.default_rng(2).standard_normal(SHAPE).astype(F32)
    np.testing.assert_array_equal(
        np.asarray(call(nvfp4x.rht, mode, a, axis=-1)), np.asarray(nvfp4x.rht(a, axis=1))
    )


def test_hadamard_signs():
    with pytest.raises(ValueError, match=r"`signs` must be 16 values of \+1 or -1"):
        nvfp4x.hadamard_matrix((1,) * 15)
    with pytest.raises(ValueError, match=r"`signs` must be 16 values of \+1 or -1"):
        nvfp4x.hadamard_matrix((2,) * 16)


def test_fp8_kind():
    with pytest.raises(ValueError, match=r"`kind='e3m4'` is unknown; use 'e4m3' or 'e5m2'"):
        nvfp4x.to_fp8(jnp.ones(4), kind="e3m4")


# ---------------------------------------------------------------------------------------
# Non-finite input never comes out finite.
# ---------------------------------------------------------------------------------------


@all_quantisers
@MODES
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "+inf", "-inf"])
def test_non_finite_stays_non_finite(fn, mode, bad):
    x = np.random.default_rng(3).standard_normal(SHAPE).astype(F32)
    x[5, 20] = bad
    out = call(fn, mode, x)
    y = np.asarray(out if isinstance(out, jax.Array) else out.dequantize())
    if fn is nvfp4x.rht:  # rows 0..15 of column 20 mix x[5, 20] in
        assert not np.isfinite(y[:16, 20]).any()
        assert np.isfinite(np.delete(y, 20, axis=1)).all() and np.isfinite(y[16:, 20]).all()
    else:
        assert not np.isfinite(y[5, 20]), f"{bad} became {y[5, 20]}"


# ---------------------------------------------------------------------------------------
# 2. MXFP8 near float32's maximum.
# ---------------------------------------------------------------------------------------

NEAR_MAX = [
    FLT_MAX,
    F32(3.4e38),
    F32(248 * 2.0**120),  # x / 2^120 = 248: the tie between 240 and 256 (rounds to 256)
    np.nextafter(F32(248 * 2.0**120), F32(0)),
    F32(240 * 2.0**120),
    F32(448 * 2.0**119),  # the largest block maximum of the next smaller scale
    np.nextafter(F32(448 * 2.0**119), F32(np.inf)),
    F32(1e38),
]


@MODES
def test_mxfp8_near_float32_max(mode):
    rng = np.random.default_rng(4)
    x = np.zeros(SHAPE, F32)
    for i, v in enumerate(NEAR_MAX):
        x[i, :32] = v * rng.uniform(-1, 1, 32).astype(F32)
        x[i, 3] = v
        x[i, 32:] = -v
    # Random magnitudes in the top binades of float32, both signs.
    n = len(NEAR_MAX)
    x[n:] = rng.choice([-1, 1], (20 - n, 40)) * FLT_MAX * rng.uniform(0.5, 1, (20 - n, 40))
    assert np.isfinite(x).all()
    m = call(nvfp4x.to_mxfp8, mode, x)
    ref = ref_mxfp8(x)
    assert_bits(m.data, ref.data, "elements")
    assert_bits(np.asarray(m.scales).astype(F32), ref.scales, "scales")
    deq = np.asarray(m.dequantize())
    assert np.isfinite(deq).all(), deq[~np.isfinite(deq)]
    assert_bits(deq, ref.deq, "dequantize")
    assert np.abs(np.asarray(m.scales).astype(F32)).max() == 2.0**120


@MODES
def test_mxfp8_matches_reference(mode):
    # Ordinary data, and blocks across float32's range (no element is subnormal after
    # scaling, so nothing depends on the device's subnormal mode).
    rng = np.random.default_rng(5)
    x = rng.standard_normal(SHAPE) * 2.0 ** rng.integers(-100, 120, (20, 1))
    x = x.astype(F32)
    m = call(nvfp4x.to_mxfp8, mode, x)
    ref = ref_mxfp8(x)
    assert_bits(m.data, ref.data, "elements")
    assert_bits(np.asarray(m.scales).astype(F32), ref.scales, "scales")
    assert_bits(m.dequantize(), ref.deq, "dequantize")


@MODES
@pytest.mark.parametrize("kind", ["e4m3", "e5m2"])
def test_fp8_near_float32_max(mode, kind):
    x = np.array([FLT_MAX, -FLT_MAX, F32(3.0e38), F32(1.0), F32(-1.0e30)], F32)
    f = call(nvfp4x.to_fp8, mode, x, kind=kind)
    ref = ref_fp8(x, kind)
    assert_bits(f.data, ref.data, "data")
    assert_bits(f.scale, ref.scale, "scale")
    assert np.isfinite(np.asarray(f.dequantize())).all()
    assert_bits(f.dequantize(), ref.deq, "dequantize")


# ---------------------------------------------------------------------------------------
# 3. NVFP4 of tiny tensors: the spec's float32 numbers, subnormals included.
# ---------------------------------------------------------------------------------------


def test_cpu_flushes_subnormals_but_numpy_does_not():
    # The premise of the tests below, measured: XLA:CPU runs with FTZ/DAZ (eagerly and
    # under jit), NumPy keeps IEEE subnormals. On other devices the first may not hold.
    tiny = F32(2.0**-140)
    assert tiny * F32(2) == F32(2.0**-139)  # NumPy: IEEE
    if jax.default_backend() == "cpu":
        assert float(jnp.asarray(tiny) * 2) == 0.0
        assert float(jax.jit(lambda t: t * 2)(jnp.asarray(tiny))) == 0.0


def check_nvfp4(x: np.ndarray, block, mode: str, amax=None, what: str = "") -> None:
    ref = ref_nvfp4(x, block, amax)
    if mode == "eager":
        q = nvfp4x.to_nvfp4(x, block=block, amax=amax)
        deq, fake = q.dequantize(), nvfp4x.fake_quantize(x, block=block, amax=amax)
    else:
        q, deq, fake = _nvfp4_jit(jnp.asarray(x), block, amax)
    codes = unpack(q.codes)
    np.testing.assert_array_equal(
        np.where(ref.valid, codes, 0), np.where(ref.valid, ref.codes, 0), what
    )
    assert_bits(q.scales, ref.scales, f"{what}: block scales")
    assert_bits(q.tensor_scale, ref.tensor_scale, f"{what}: tensor scale")
    assert_bits(deq, ref.deq, f"{what}: dequantize")
    assert_bits(fake, ref.deq, f"{what}: fake_quantize")


@functools.partial(jax.jit, static_argnames="block")
def _nvfp4_jit(x, block, amax):
    q = nvfp4x.to_nvfp4(x, block=block, amax=amax)
    return q, q.dequantize(), nvfp4x.fake_quantize(x, block=block, amax=amax)


@layouts
@settings(max_examples=40, deadline=None)
@given(k=st.integers(0, 149), seed=st.integers(0, 2**32 - 1), spread=st.integers(0, 40))
def test_tiny_tensors_match_the_spec(block, k, seed, spread):
    # Normal values times 2^-k, each block further scaled down by up to 2^-spread: from
    # ordinary tensors (k = 0) through a subnormal tensor scale (amax below ~3.2e-35,
    # k >= 115) to subnormal inputs and amax (k >= 127), down to all-2^-149 values.
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(SHAPE)
    shifts = rng.integers(0, spread + 1, (2 if block[0] == 16 else 20, 3))
    x *= 2.0 ** -shifts.repeat(block[0], 0)[:20].repeat(16, 1)[:, :40]
    x = (x * 2.0**-k).astype(F32)
    for mode in ("eager", "jit"):
        check_nvfp4(x, block, mode, what=f"{mode} k={k} spread={spread}")


TINY_CASES = {
    # amax at which s_dec = 1 / S_enc becomes subnormal: 2688 * 2^-126 and its neighbours
    "s_dec at 2^-126": np.full(16, F32(2688 * 2.0**-126)),
    "s_dec just subnormal": np.full(16, np.nextafter(F32(2688 * 2.0**-126), F32(0))),
    # 2688 / amax just overflows (S_enc clamps to FLT_MAX)
    "S_enc overflows": np.full(16, F32(2688) / FLT_MAX * F32(0.999)),
    "smallest normal amax": np.full(16, np.finfo(F32).tiny),
    "largest subnormal amax": np.full(16, np.nextafter(np.finfo(F32).tiny, F32(0))),
    "single 2^-149": np.where(np.arange(16) == 3, F32(2.0**-149), F32(0)),
    "all -2^-149": np.full(16, F32(-(2.0**-149))),
    "mixed normal and subnormal": np.array([1e-38, -3e-39, 1.2e-38, 5e-40] * 4, F32),
    # scale_b * s_dec subnormal although s_dec is normal: small blocks of a ~1e-33 tensor
    "subnormal block product": np.concatenate(
        [np.full(16, F32(1e-33)), np.linspace(1e-38, 1e-37, 16, dtype=F32)]
    ),
    "zeros": np.zeros(16, F32),
    "negative zeros": np.full(16, F32(-0.0)),
}


@layouts
@MODES
@pytest.mark.parametrize("x", list(TINY_CASES.values()), ids=list(TINY_CASES))
def test_tiny_hand_picked(block, mode, x):
    x = np.resize(np.tile(x, 3), SHAPE)  # the case in every row, padded blocks too
    x = x * np.where(np.arange(40) % 3 == 1, F32(-1), F32(1))  # both signs
    check_nvfp4(x.astype(F32), block, mode, what=f"{mode} {block}")


SUBNORMAL_AMAX = [F32(2.0**-149), F32(1e-40), np.nextafter(np.finfo(F32).tiny, F32(0))]


@layouts
@MODES
@pytest.mark.parametrize("amax", SUBNORMAL_AMAX, ids=[f"{a:.3g}" for a in SUBNORMAL_AMAX])
def test_subnormal_amax_argument(block, mode, amax):
    # A given subnormal amax, concrete or traced, is not mistaken for zero.
    rng = np.random.default_rng(6)
    x = (rng.standard_normal(SHAPE) * amax / 4).astype(F32)
    check_nvfp4(x, block, mode, amax=amax, what=f"{mode} amax={amax}")
    assert float(nvfp4x.to_nvfp4(x, block=block, amax=amax).tensor_scale) == 1 / FLT_MAX


def test_tiny_under_vmap():
    # Under vmap the library's per-tensor branches become selects of both paths; slices
    # with ordinary, tiny and subnormal amax side by side.
    rng = np.random.default_rng(7)
    ks = np.array([0, 100, 118, 130, 140, 149])
    x = (rng.standard_normal((len(ks), *SHAPE)) * 2.0 ** -ks[:, None, None]).astype(F32)

    @jax.jit
    def batched(x):
        q = jax.vmap(nvfp4x.to_nvfp4)(x)
        return q, jax.vmap(lambda t: t.dequantize())(q), jax.vmap(nvfp4x.fake_quantize)(x)

    q, deq, fake = batched(jnp.asarray(x))
    for i, k in enumerate(ks):
        ref = ref_nvfp4(x[i], (1, 16))
        np.testing.assert_array_equal(unpack(q.codes[i]), ref.codes, f"k={k}")
        assert_bits(q.tensor_scale[i], ref.tensor_scale, f"k={k} tensor scale")
        assert_bits(deq[i], ref.deq, f"k={k} vmapped dequantize")
        assert_bits(fake[i], ref.deq, f"k={k} vmapped fake_quantize")
    assert_bits(q.dequantize(), np.stack([ref_nvfp4(s, (1, 16)).deq for s in x]), "batch")


def test_tiny_bfloat16():
    # bfloat16 has float32's exponent range: its subnormals go through the same path.
    rng = np.random.default_rng(8)
    x = (rng.standard_normal(SHAPE) * 2.0**-128).astype(ml_dtypes.bfloat16)
    for mode in ("eager", "jit"):
        check_nvfp4(x, (1, 16), mode, what=f"bfloat16 {mode}")


# The float32 helpers behind the above, against NumPy's IEEE arithmetic on many values.


def _e2m1_times_e4m3() -> np.ndarray:
    e2m1 = np.arange(16, dtype=np.uint8).view(E2M1).astype(F32)
    e4m3 = np.arange(256, dtype=np.uint8).view(E4M3).astype(F32)
    p = (e2m1[:, None] * e4m3[None, :]).ravel()
    return p[np.isfinite(p)]


@MODES
def test_mul_exact_matches_ieee(mode):
    from nvfp4x._numerics._ieee import mul_exact

    rng = np.random.default_rng(9)
    p = _e2m1_times_e4m3()  # every block product (and E4M3 scales: times 1.0)
    s = np.concatenate(
        [
            rng.integers(1, 2**23, 64).astype(np.uint32).view(F32),  # subnormal
            (2.0 ** rng.uniform(-126, -60, 64)).astype(F32),  # tiny normal
            (2.0 ** rng.uniform(-60, 100, 16)).astype(F32),
            np.array([2.0**-149, 2.0**-126, 2.0**-64, 1 / FLT_MAX], F32),
        ]
    )
    want = p[:, None] * s[None, :]  # NumPy: IEEE, subnormal results included
    got = call(mul_exact, mode, jnp.asarray(p[:, None]), jnp.asarray(s[None, :]))
    assert_bits(got, want, "mul_exact")


@MODES
def test_reciprocals_match_ieee(mode):
    from nvfp4x._numerics._ieee import reciprocal, reciprocal_capped

    rng = np.random.default_rng(10)
    # S_enc above 2^126 (subnormal reciprocal), every significand pattern class.
    big = rng.integers(0x7E800001, 0x7F7FFFFF, 20000, dtype=np.uint32).view(F32)
    normal = (2.0 ** rng.uniform(-120, 126, 2000)).astype(F32)
    s = np.concatenate([big, normal, np.array([2.0**126, FLT_MAX], F32)])
    with np.errstate(all="ignore"):
        assert_bits(call(reciprocal, mode, jnp.asarray(s)), F32(1) / s, "reciprocal")
        p = np.concatenate(
            [
                rng.integers(0, 2**23, 20000, dtype=np.uint32).view(F32),  # 0 and subnormal
                (2.0 ** rng.uniform(-126, 100, 2000)).astype(F32),
                np.array([np.nan, np.finfo(F32).tiny, 2.0**-128, 2.0**-149], F32),
            ]
        )
        want = np.minimum(F32(1) / p, FLT_MAX)
    assert_bits(call(reciprocal_capped, mode, jnp.asarray(p)), want, "reciprocal_capped")


@MODES
def test_mul_normal_matches_ieee(mode):
    from nvfp4x._numerics._ieee import mul_normal

    rng = np.random.default_rng(11)
    x = np.concatenate(
        [
            rng.integers(0, 2**23, 3000, dtype=np.uint32).view(F32),  # subnormal
            (rng.standard_normal(1000) * 2.0 ** rng.uniform(-126, 0, 1000)).astype(F32),
        ]
    )
    x[::2] *= -1
    c = (2.0 ** rng.uniform(-110, 127, x.size)).astype(F32)
    got = np.asarray(call(mul_normal, mode, jnp.asarray(x), jnp.asarray(c)))
    with np.errstate(all="ignore"):
        want = x * c
    # Exact from 2^-103 up (and for every normal product of a normal x); below that only
    # the sign and "below 2^-103" are promised (such values round to zero codes/scales).
    exact = (np.abs(want) >= 2.0**-103) | (
        (np.abs(want) >= np.finfo(F32).tiny) & (np.abs(x) >= np.finfo(F32).tiny)
    )
    assert exact.sum() > 1000 and (~exact).sum() > 100
    assert_bits(got[exact], want[exact], "products from 2^-103 up")
    assert (np.abs(got[~exact]) < 2.0**-103).all()
    np.testing.assert_array_equal(np.signbit(got[~exact]), np.signbit(want[~exact]))


@pytest.mark.parametrize("block", [(1.0, 16.0), (1.5, 16), "16x16", (True, 16)], ids=str)
def test_format_block_must_be_two_ints(block):
    # (the runtime type checker of the tests may refuse it first, as a TypeError)
    with pytest.raises((ValueError, TypeError), match="block"):
        nvfp4x.Format("nvfp4", block=block)


# ---------------------------------------------------------------------------------------
# 4. Inputs at the edges: empty arrays, a traced negative amax, float64 beyond float32,
#    the RHT near float32's maximum.
# ---------------------------------------------------------------------------------------

EMPTY = {"no rows": (0, 32), "no columns": (4, 0), "none in a batch": (2, 0, 20)}


def _values(fn, block=None):
    """`fn`'s output as an array (dequantised), for `jax.eval_shape`."""

    def values(x):
        out = fn(x) if block is None else fn(x, block=block)
        return out if isinstance(out, jax.Array) else out.dequantize()

    return values


@all_quantisers
@pytest.mark.parametrize("shape", list(EMPTY.values()), ids=list(EMPTY))
def test_empty_arrays(fn, shape):
    # An array with a zero-size axis quantises to an empty array of its shape (the RHT
    # pads its axis to a multiple of 16: 0 stays 0). Empty arrays hold no numbers, so
    # tracing (`eval_shape`, nothing compiled) is the whole computation to check.
    want = ((shape[0] + 15) // 16 * 16,) + shape[1:] if fn is nvfp4x.rht else shape
    out = jax.eval_shape(_values(fn), jax.ShapeDtypeStruct(shape, jnp.float32))
    assert out.shape == want and out.dtype == jnp.float32


@nvfp4_quantisers
def test_empty_arrays_in_tiles(fn):
    for shape in EMPTY.values():
        x = jax.ShapeDtypeStruct(shape, jnp.float32)
        assert jax.eval_shape(_values(fn, (16, 16)), x).shape == shape


@nvfp4_quantisers
def test_traced_negative_amax(fn):
    # Checked where it runs (`eqx.error_if`), as a concrete one is before tracing.
    f = jax.jit(lambda x, a: jax.tree_util.tree_leaves(fn(x, amax=a))[0])
    x = jnp.ones(32)
    jax.block_until_ready(f(x, jnp.float32(2.0)))
    with pytest.raises((ValueError, RuntimeError), match=r"`amax` is negative"):
        jax.block_until_ready(f(x, jnp.float32(-1.0)))


@functools.cache
def _dequantized(fn):
    """`fn`'s values, jitted (one compile per input dtype, shared by the float64 tests):
    the quantised array dequantised in the input's dtype, or the RHT's output."""

    def values(x):
        out = fn(x)
        return out if isinstance(out, jax.Array) else out.dequantize()

    return jax.jit(values)


@all_quantisers
def test_float64_beyond_float32(fn):
    # Defined as: computed in float32, a float64 array rounded to float32 first. Beyond
    # FLT_MAX that is ±inf, a non-finite value, which never comes out finite (its NVFP4
    # or MXFP8 block NaN, its FP8 element NaN, its RHT column ±inf or NaN); below half the
    # smallest subnormal it is 0. The other blocks are those of the float32 input.
    x = np.ones((4, 32))
    x[0, 3], x[1, 3], x[2, 4] = 1e39, -1e300, 1e-300

    with jax.enable_x64(True):  # (jitted: eager dispatch compiles op by op, ~10 s)
        y = np.asarray(_dequantized(fn)(jnp.asarray(x, jnp.float64))).astype(F32)
    with np.errstate(over="ignore"):
        want = np.asarray(_dequantized(fn)(jnp.asarray(x.astype(F32))))
    if fn is nvfp4x.rht:  # one 16-row chunk: column 3 mixes its rows
        assert not np.isfinite(y[:, 3]).any()
        assert_bits(np.delete(y, 3, axis=1), np.delete(want, 3, axis=1), "other columns")
        return
    assert not np.isfinite(y[0, 3]) and not np.isfinite(y[1, 3]) and y[2, 4] == 0
    assert_bits(y[2:], want[2:], "rows within float32's range")


@all_quantisers
def test_float64_subnormals_are_kept(fn):
    # A float64 array of values in float32's subnormal range is rounded once to float32
    # (XLA:CPU's conversion flushed them to zero), and dequantised into float64 exactly
    # (the conversion back flushed them too): the float32 input's numbers.
    rng = np.random.default_rng(11)
    x = rng.uniform(-1, 1, (4, 32)) * 2.0**-127
    x[0, :4] = [1e-45, -0.7e-45, 2.0**-150 * 3, 2.0**-126 * (1 - 2.0**-30)]  # rounding
    x32 = x.astype(F32)  # NumPy's conversion keeps subnormals

    with jax.enable_x64(True):
        y = np.asarray(_dequantized(fn)(jnp.asarray(x, jnp.float64)))
    want = np.asarray(_dequantized(fn)(jnp.asarray(x32)))
    assert np.count_nonzero(want) > 64
    assert_bits(y.astype(F32), want, "float64 input")
    assert y.dtype == (F32 if fn is nvfp4x.rht else np.float64)
    np.testing.assert_array_equal(y, want.astype(y.dtype))  # (NumPy: exact)


@nvfp4_quantisers
def test_traced_negative_subnormal_amax(fn):
    # A float `amax < 0` reads a negative subnormal as 0 on XLA:CPU: the sign is read
    # from the bits (NaN aside).
    f = jax.jit(lambda x, a: jax.tree_util.tree_leaves(fn(x, amax=a))[0])
    x = jnp.ones(32)
    jax.block_until_ready(f(x, jnp.float32(-0.0)))
    with pytest.raises((ValueError, RuntimeError), match=r"`amax` is negative"):
        jax.block_until_ready(f(x, jnp.asarray(F32(-1e-40))))


def _exact_rht(x: np.ndarray) -> np.ndarray:
    """The transform in float64 (exact for float32 input: 16 terms of 25 bits)."""
    h = nvfp4x.hadamard_matrix().astype(np.float64)
    xp = np.concatenate([x, np.zeros((-x.shape[0] % 16, x.shape[1]))]).astype(np.float64)
    return np.concatenate([h @ c for c in np.split(xp, xp.shape[0] // 16)])


@MODES
def test_rht_near_float32_max(mode):
    # Finite in, finite out wherever the exact transform is finite (float32 partial sums
    # of the 16-point transform would overflow); beyond FLT_MAX, ±inf.
    rng = np.random.default_rng(7)
    x = (rng.uniform(-1, 1, SHAPE) * FLT_MAX).astype(F32)
    x[:, :8] = np.abs(x[:, :8])  # columns whose sums reach 4 x FLT_MAX
    x[:, 8] = x[:, 8] * F32(2.0**-20)  # a column below the scaled range: untouched
    x[3, 9] = F32(1.0)  # a small element among big ones
    y = np.asarray(call(nvfp4x.rht, mode, x)).astype(np.float64)
    exact = _exact_rht(x)
    inside = np.abs(exact) <= float(FLT_MAX) * (1 - 2.0**-20)
    outside = np.abs(exact) >= float(FLT_MAX) * (1 + 2.0**-20)
    assert inside.sum() > 500 and outside.sum() > 20
    assert np.isfinite(y[inside]).all(), exact[inside & ~np.isfinite(y)]
    assert np.isinf(y[outside]).all()
    amax = np.abs(x).max(axis=0).astype(np.float64)
    assert (np.abs(y - exact)[inside] <= (2.0**-21 * amax * np.ones_like(exact))[inside]).all()
    # A column not in the scaled range has the bits it has on its own.
    alone = np.asarray(call(nvfp4x.rht, mode, np.ascontiguousarray(x[:, 8:9])))
    assert_bits(y[:, 8:9].astype(F32), alone, "unscaled column")


@MODES
def test_rht_at_float32_max(mode):
    # Sums of multiples of FLT_MAX and their neighbours: exact results of exactly ±FLT_MAX
    # (and others in the top binade) came out ±inf where the float32 einsum's summation
    # error crossed the overflow threshold. Results from 2^127 up are the exact
    # transform rounded once to float32 (±inf from the midpoint above FLT_MAX); every
    # result whose exact value rounds to a finite float32 is finite.
    rng = np.random.default_rng(12)
    x = (FLT_MAX * rng.choice([-1, 1, 0.5, -0.5, 0.25, 0, 0.75], SHAPE)).astype(F32)
    x = np.where(rng.random(SHAPE) < 0.5, np.nextafter(x, F32(0)), x)
    y = np.asarray(call(nvfp4x.rht, mode, x))
    exact = _exact_rht(x)  # (exact in float64: the terms' exponents are close)
    with np.errstate(over="ignore"):
        want = exact.astype(F32)  # rounded once; beyond the midpoint, ±inf
    assert np.isfinite(y[np.isfinite(want)]).all()
    top = np.abs(exact) >= 2.0**127
    assert top.sum() > 100 and (np.abs(want[top]) == FLT_MAX).sum() > 5
    assert_bits(y[top], want[top], "results in the top binade")


def test_rht_near_float32_max_a_few_chunks_at_a_time(monkeypatch):
    """The top binade's accurate transform (`_hadamard._accurate`) and the scaled path
    (`_guarded`) run a few chunks at a time: with batches of 3 chunks of 7 (the last
    batch partial; the scaled path's batches divide the chunks) the same bits as all at
    once, and the top binade's results the exact transform rounded once (two of these
    results are exactly -2^127, which the butterflies put 1-2 ulps below: they are
    recomputed too, `_NEAR_MAX_BITS`)."""
    from nvfp4x._numerics import _hadamard

    def rht(a):  # (traced anew: `jax.jit` keeps traces by function, not by the sizes)
        jax.clear_caches()
        fn = jax.jit(lambda a: nvfp4x.rht(a))
        return np.asarray(fn(jnp.asarray(a))), str(fn.trace(jnp.asarray(a)).jaxpr)

    rng = np.random.default_rng(12)
    x = (FLT_MAX * rng.choice([-1, 1, 0.5, -0.5, 0.25, 0, 0.75], (112, 24))).astype(F32)
    x = np.where(rng.random(x.shape) < 0.5, np.nextafter(x, F32(0)), x)
    whole, text = rht(x)
    assert text.count("scan[") == 0
    monkeypatch.setattr(_hadamard, "_ACCURATE_ELEMENTS", 3 * 16 * x.shape[1])
    batched, text = rht(x)
    assert text.count("scan[") == 1  # (`lax.map`: the accurate path's loop)
    assert_bits(batched, whole, "3 chunks at a time")
    # The scaled path (`_guarded`) in batches too: of a divisor of the 7 chunks (1), and
    # of 4 of 8 chunks with a tiny column among them.
    monkeypatch.setattr(_hadamard, "_GUARDED_ELEMENTS", 3 * 16 * x.shape[1])
    got, text = rht(x)
    assert "length=7" in text  # (the scaled path's loop; a batch's accurate path whole)
    assert_bits(got, whole, "scaled path, 1 chunk at a time")
    y = np.concatenate([x, x[:16]])
    y[:, 5] = F32(1e-38) * rng.standard_normal(y.shape[0]).astype(F32)
    monkeypatch.setattr(_hadamard, "_GUARDED_ELEMENTS", 2**20)
    want_y, _ = rht(y)
    monkeypatch.setattr(_hadamard, "_GUARDED_ELEMENTS", 4 * 16 * x.shape[1])
    got_y, text = rht(y)
    assert "length=2" in text
    assert_bits(got_y, want_y, "scaled path, 4 chunks at a time")
    exact = _exact_rht(x)
    with np.errstate(over="ignore"):
        want = exact.astype(F32)
    top = np.abs(exact) >= 2.0**127
    assert top.sum() > 50
    assert_bits(batched[top], want[top], "results in the top binade")


@MODES
def test_mxfp8_subnormal_blocks(mode):
    # Blocks of subnormals (and a normal block): the elements, scales and dequantised
    # values (subnormal products of an E4M3 value and the 2^-126 scale) are the spec's
    # IEEE float32 ones, on a device that flushes subnormals too.
    x = np.random.default_rng(8).standard_normal(SHAPE).astype(F32)  # (shares compiles)
    x[0, :32] = 0
    x[0, :6] = [1e-40, -3e-41, 2e-39, 1e-45, 1.5e-38, -1.1e-38]
    x[1] = x[1] * F32(2.0**-120)
    m = call(nvfp4x.to_mxfp8, mode, x)
    ref = ref_mxfp8(x)
    assert_bits(m.data, ref.data, "elements")
    assert_bits(np.asarray(m.scales).astype(F32), ref.scales, "scales")
    deq = call(lambda m: m.dequantize(), mode, m)
    assert_bits(deq, ref.deq, "dequantize")
    assert np.count_nonzero(np.asarray(deq)[0, :6]) == 5  # 1e-45 rounds to 0


@MODES
def test_rht_subnormals(mode):
    # Columns of subnormals and of tiny normals are transformed, not flushed to zero:
    # within one unit of the smallest subnormal (2^-149), plus float32's summation error
    # (relative to the column's amax), of the exact transform.
    rng = np.random.default_rng(9)
    fields = rng.integers(1, 2**23, SHAPE).astype(np.uint32)
    x = fields.view(F32) * rng.choice([-1, 1], SHAPE).astype(F32)
    x[:, 30:] = (rng.standard_normal((20, 10)) * 2.0**-120).astype(F32)
    y = np.asarray(call(nvfp4x.rht, mode, x)).astype(np.float64)
    exact = _exact_rht(x)
    amax = np.abs(x).max(axis=0).astype(np.float64)
    assert (np.abs(y - exact) <= 2.0**-149 + 2.0**-22 * amax).all()
    assert np.count_nonzero(y[:16, :30]) == np.count_nonzero(exact[:16, :30])


FP8_TINY = {
    "subnormal tensor": lambda rng: rng.integers(1, 2**23, SHAPE).astype(np.uint32).view(F32),
    "tiny normal amax": lambda rng: (rng.standard_normal(SHAPE) * 2.0**-118).astype(F32),
    "subnormals under amax 2^-112": lambda rng: np.where(
        np.arange(40) == 0,
        F32(2.0**-112),
        rng.integers(1, 2**23, SHAPE).astype(np.uint32).view(F32),
    ),
}


@MODES
@pytest.mark.parametrize("kind", ["e4m3", "e5m2"])
@pytest.mark.parametrize("make", list(FP8_TINY.values()), ids=list(FP8_TINY))
def test_fp8_tiny_tensors(mode, kind, make):
    # A tiny tensor's scale `amax * f32(1/max)` is subnormal, or its subnormal elements
    # quantise to non-zero values: the spec's IEEE float32 numbers, on a device that
    # flushes subnormals too.
    rng = np.random.default_rng(10)
    x = (make(rng) * rng.choice([-1, 1], SHAPE)).astype(F32)
    f = call(nvfp4x.to_fp8, mode, x, kind=kind)
    ref = ref_fp8(x, kind)
    assert_bits(f.data, ref.data, "data")
    assert_bits(f.scale, ref.scale, "scale")
    assert_bits(f.dequantize(), ref.deq, "dequantize")
    assert np.count_nonzero(np.asarray(f.dequantize())) > 100
