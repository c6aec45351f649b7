"""Unbiased stochastic rounding: E4M3 block scales rounded up.

With the spec's round-to-nearest block scale (the default, bit for bit Blackwell's), a
block whose scale rounds down has elements beyond E2M1's 6 after scaling; they are
clamped to 6, which biases stochastic rounding towards zero. `scale_rounding="up"`
(`nvfp4x.Format(..., scale_rounding="up")`, `to_nvfp4`/`fake_quantize(...,
scale_rounding="up")`, `nvfp4x.recipes.nvfp4_training(unbiased_sr=True)`) takes the
smallest E4M3 scale with which nothing is clamped. Checked here:

1. the default path is unchanged, bit for bit (pinned digests of outputs computed before
   the option existed, and the default against an explicit `"nearest"`);
2. with `"up"` nothing is clamped and each scale is the smallest E4M3 value that does it,
   against a NumPy/ml_dtypes computation independent of nvfp4x;
3. the quantiser is unbiased with `"up"` and measurably biased without (statistics over
   keys, on an input crafted so that most block scales round down);
4. the recipe keyword reaches dgrad and wgrad: gradients of `qdot` averaged over seeds;
5. eager and jitted calls give the same bits.

`python tests/test_unbiased_sr.py` prints the bias figures of the default and of `"up"`
on Gaussian data (see `measure_bias`).
"""

import functools
import hashlib
import inspect

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import FINITE_KINDS, tensors
from hypothesis import given, settings

import nvfp4x
from nvfp4x._formats import Format, quantize_operand
from nvfp4x._numerics._nvfp4 import scale_blocks

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
#: Every finite non-negative E4M3 value, ascending (0, 2^-9, ..., 448), from ml_dtypes.
_ALL = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
E4M3_VALUES = np.unique(np.abs(_ALL[np.isfinite(_ALL)]))  # +0.0 first
#: Magnitudes of the E2M1 grid.
GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])

layouts = pytest.mark.parametrize("block", [(1, 16), (16, 16)], ids=["1x16", "16x16"])


# ---------------------------------------------------------------------------------------
# An independent reference of the spec's tensor scale and of the "up" block scale.
# ---------------------------------------------------------------------------------------


def ref_tensor_scales(x: np.ndarray) -> tuple[np.float32, np.float32]:
    """`(S_enc, s_dec)` of spec §2 in NumPy float32 (finite `x`)."""
    amax = F32(np.max(np.abs(x.astype(F32)), initial=F32(0)))
    with np.errstate(divide="ignore", over="ignore"):
        s_enc = np.minimum(F32(2688) / amax, FLT_MAX) if amax > 0 else F32(1)
    return F32(s_enc), F32(F32(1) / s_enc)


def ref_tensor_scale(x: np.ndarray) -> np.float32:
    """`s_dec` of spec §2."""
    return ref_tensor_scales(x)[1]


def block_maxima(x: np.ndarray, block) -> np.ndarray:
    """`max|x|` per block (padded with zeros), as float32."""
    a = np.abs(x.astype(F32))
    pads = [(0, 0)] * a.ndim
    pads[-1] = (0, -a.shape[-1] % 16)
    if block[0] == 16:
        pads[-2] = (0, -a.shape[-2] % 16)
    a = np.pad(a, pads)
    if block[0] == 1:
        return a.reshape(*a.shape[:-1], -1, 16).max(-1)
    *lead, r, c = a.shape
    return a.reshape(*lead, r // 16, 16, c // 16, 16).max(axis=(-3, -1))


def scaled_max(bamax: np.ndarray, scale: np.ndarray, s_dec) -> tuple[np.ndarray, np.ndarray]:
    """`(bamax * inv_b, inv_b)` in IEEE float32 (NumPy keeps subnormals), with the spec's
    `inv_b = min(1 / (scale * s_dec), FLT_MAX)`."""
    with np.errstate(divide="ignore", over="ignore"):
        inv = np.minimum(F32(1) / (scale.astype(F32) * F32(s_dec)), FLT_MAX)
        return bamax.astype(F32) * inv, inv


def check_up_scales(scales: np.ndarray, bamax: np.ndarray, s_dec, what: str) -> None:
    """Every block scale of a finite block is the smallest E4M3 value with which the
    block's largest element scales to at most 6 and `inv_b` is not capped at FLT_MAX,
    and it is within float32 rounding of the smallest E4M3 value at or above the real
    scale `bamax / (6 s_dec)`."""
    s = scales.astype(np.float64)
    assert np.isin(s, E4M3_VALUES).all(), f"{what}: scales off the E4M3 grid"
    nonzero = bamax > 0
    assert ((s == 0) == ~nonzero).all(), f"{what}: zero scale iff zero block"
    v, inv = scaled_max(bamax, s, s_dec)
    # Nothing clamped, except by float32 rounding in the block holding the tensor's
    # amax, whose real scale is 448 within rounding (and 448 cannot be exceeded).
    over = v > 6
    assert (s[over] == 448).all(), f"{what}: clamped below 448: {v[over & (s != 448)][:4]}"
    assert (v <= 6 * (1 + 2.0**-21)).all(), f"{what}: clamped by {v.max() / 6 - 1}"
    assert (inv[nonzero] < FLT_MAX).all(), f"{what}: inv_b capped"
    # Minimal: the E4M3 value below each scale (from 2^-9 on) would clamp or cap.
    idx = np.searchsorted(E4M3_VALUES, s)
    prev = E4M3_VALUES[np.maximum(idx - 1, 0)]
    check = nonzero & (prev > 0) & (s < 448)
    pv, pinv = scaled_max(bamax, prev, s_dec)
    fails = (pv > 6) | (pinv >= FLT_MAX)
    assert fails[check].all(), f"{what}: a smaller scale fits: {s[check & ~fails][:4]}"
    # Against the real-number bound (float64): the smallest E4M3 value at or above
    # max(bamax / (6 s_dec), 2^-128 / s_dec, 2^-9), or its neighbour where that bound
    # is within 2^-20 of an E4M3 value (float32 rounding decides there).
    sd = np.float64(s_dec)
    need = np.maximum(np.maximum(bamax / (6 * sd), 2.0**-128 / sd), 2.0**-9)
    need = np.where(nonzero, np.minimum(need, 448.0), 0.0)
    up = E4M3_VALUES[np.minimum(np.searchsorted(E4M3_VALUES, need), len(E4M3_VALUES) - 1)]
    near = E4M3_VALUES[np.abs(E4M3_VALUES[:, None] - need.ravel()).argmin(0)].reshape(s.shape)
    tie = np.abs(near - need) <= 2.0**-20 * need
    nxt = E4M3_VALUES[np.minimum(np.searchsorted(E4M3_VALUES, near) + 1, len(E4M3_VALUES) - 1)]
    ok = (s == up) | (tie & ((s == near) | (s == nxt)))
    assert ok.all(), f"{what}: scale {s[~ok][:4]} for real bound {need[~ok][:4]}"


# ---------------------------------------------------------------------------------------
# Inputs.
# ---------------------------------------------------------------------------------------


def spread(shape=(32, 64), seed=0) -> np.ndarray:
    """Gaussian rows with spread magnitudes, a zero block, subnormal and tiny values."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp(2 * rng.standard_normal((shape[0], 1)))
    x[3, 5] = 0.0
    x[7, :16] = 0.0
    x[9, 17] = 1e-40
    x[11, :] *= 1e-30
    return x.astype(F32)


# ---------------------------------------------------------------------------------------
# 1. The default path is unchanged.
# ---------------------------------------------------------------------------------------

#: sha256 of `default_outputs()`, computed with nvfp4x before `scale_rounding` existed
#: (commit 4b07a0a), eagerly and under `jit`. The inputs come from NumPy's PCG64, whose
#: streams are stable; only deterministic outputs are hashed (no PRNG key is used).
DEFAULT_DIGEST = "f9eb5af4a67b6dc67d386bfae5ae26208af7d24586de3cc81139a98957570541"


def default_outputs(x: jax.Array, tiny: jax.Array) -> list[jax.Array]:
    """Outputs of the quantisers with default arguments: codes, scale bits and tensor
    scales of `to_nvfp4` (1x16 and 16x16 blocks), `fake_quantize`, and `quantize_operand`
    along the first axis (wgrad's 16x1 path), for an ordinary tensor; `to_nvfp4` and
    `fake_quantize` (1x16) of a tiny one (subnormal tensor scale: the exact path)."""
    out = []
    for block in ((1, 16), (16, 16)):
        q = nvfp4x.to_nvfp4(x, block=block)
        out += [q.codes, q.scale_bits, q.tensor_scale]
    v, s = quantize_operand(x, Format("nvfp4"), 0)
    out += [nvfp4x.fake_quantize(x), v.astype(jnp.float32), s]
    q = nvfp4x.to_nvfp4(tiny)
    return out + [q.codes, q.scale_bits, q.tensor_scale, nvfp4x.fake_quantize(tiny)]


def digest(arrays: list[jax.Array]) -> str:
    h = hashlib.sha256()
    for a in map(np.asarray, arrays):
        h.update(str(a.dtype).encode() + str(a.shape).encode() + a.tobytes())
    return h.hexdigest()


def test_default_unchanged_pinned():
    # Under jit; `test_format.py` checks the default eagerly and under jit against its
    # NumPy reference of the spec.
    x, tiny = jnp.asarray(spread()), jnp.asarray(spread(seed=1) * F32(1e-39))
    assert digest(jax.jit(default_outputs)(x, tiny)) == DEFAULT_DIGEST


def test_default_is_nearest():
    assert Format("nvfp4").scale_rounding == "nearest"
    fmt = Format("nvfp4", rounding="stochastic")
    explicit = Format("nvfp4", rounding="stochastic", scale_rounding="nearest")
    assert fmt == explicit and hash(fmt) == hash(explicit) and str(fmt) == str(explicit)
    for fn in (nvfp4x.to_nvfp4, nvfp4x.fake_quantize):
        assert inspect.signature(fn).parameters["scale_rounding"].default == "nearest"


SHAPE = (8, 64)  # every input below: one compilation of `quantise_all`


@jax.jit
def quantise_all(x: jax.Array) -> dict:
    """Everything the checks below read, in one program: `to_nvfp4(x)` with default and
    with "up" block scales for both layouts, `to_nvfp4(x.T)` with "up", `fake_quantize`
    with "up" and the dequantised 1x16 "up" array, and `quantize_operand` with an "up"
    format along both axes (the 1x16 path of dgrad's dy, and the 16x1 path of wgrad's,
    along the tokens)."""
    up = {"scale_rounding": "up"}
    fmt = Format("nvfp4", scale_rounding="up")
    out = {
        f"{name} {block[0]}x{block[1]}": nvfp4x.to_nvfp4(x, block=block, **kw)
        for name, kw in (("default", {}), ("up", up))
        for block in ((1, 16), (16, 16))
    }
    out["up_T"] = nvfp4x.to_nvfp4(x.T, **up)
    out["fake_up"] = nvfp4x.fake_quantize(x, **up)
    out["dequantized_up"] = out["up 1x16"].dequantize()
    out["operand -1"] = quantize_operand(x, fmt, -1)
    out["operand 0"] = quantize_operand(x, fmt, 0)
    return out


@settings(max_examples=30, deadline=None)
@given(data=tensors([SHAPE], FINITE_KINDS))
def test_default_scales_are_the_spec(data):
    # The default block scales: the spec's e4m3_rne(min(bamax * (S_enc * f32(1/6)), 448)).
    kind, x = data
    s_enc, s_dec = ref_tensor_scales(x)
    out = quantise_all(x)
    for block in ((1, 16), (16, 16)):
        q = out[f"default {block[0]}x{block[1]}"]
        want = np.minimum(block_maxima(x, block) * (s_enc * (F32(1) / F32(6))), F32(448))
        want = want.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        np.testing.assert_array_equal(q.scale_bits, want, f"{kind} {block}")
        assert np.asarray(q.tensor_scale) == s_dec


# ---------------------------------------------------------------------------------------
# 2. "up": nothing clamped, the smallest such scale.
# ---------------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(data=tensors([SHAPE], FINITE_KINDS))
def test_up_scales_are_minimal_and_never_clamp(data):
    kind, x = data
    s_dec = ref_tensor_scale(x)
    out = quantise_all(x)
    for key, block, xx in (
        ("up 1x16", (1, 16), x),
        ("up 16x16", (16, 16), x),
        ("up_T", (1, 16), x.T),
    ):
        q = out[key]
        what = f"{kind} {key}"
        assert np.asarray(q.tensor_scale) == s_dec, what  # the tensor scale is the spec's
        scales = np.asarray(q.scales).astype(np.float64)
        check_up_scales(scales, block_maxima(xx, block), s_dec, what)
    # The GEMM operands (values = E2M1 value x block scale, and the tensor scale) read the
    # format's scale rounding: along the last axis they are to_nvfp4's, along the first
    # those of to_nvfp4 of the transpose.
    for axis, q, t in ((-1, out["up 1x16"], False), (0, out["up_T"], True)):
        v, s = out[f"operand {axis}"]
        want, want_s = q.operand()
        np.testing.assert_array_equal(v, want.T if t else want, f"{kind} axis {axis}")
        np.testing.assert_array_equal(s, want_s, f"{kind} axis {axis}")
    np.testing.assert_array_equal(out["fake_up"], out["dequantized_up"], kind)


def test_up_edge_cases():
    def up(x):
        out = quantise_all(jnp.asarray(np.broadcast_to(np.asarray(x, F32), SHAPE)))
        q = out["up 1x16"]
        return np.asarray(q.scales).astype(np.float64)[0], out

    # amax 0: zero scales, zero values.
    s, out = up(np.zeros(64))
    assert (s == 0).all() and (np.asarray(out["fake_up"]) == 0).all()
    # A block far below the tensor's amax keeps a nonzero (E4M3 subnormal) scale, where
    # "nearest" flushes it to zero.
    s, out = up(np.concatenate([np.full(16, 1e3), np.linspace(0, 1e-4, 16), np.zeros(32)]))
    near = np.asarray(out["default 1x16"].scales).astype(np.float64)[0]
    assert s[1] == 2.0**-9 and near[1] == 0
    # The block holding the amax gets 448, never more.
    s, _ = up(np.linspace(-5, 5, 64))
    assert s.max() == 448
    # NaN and inf stay non-finite: their blocks get NaN scales and dequantise to NaN, the
    # other blocks do not. With an inf, S_enc is 1 and blocks above 2688 stop at 448
    # (and are clamped, as with "nearest": so are blocks above a given `amax`).
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones(64, F32)
        x[20] = bad
        x[48:] = 1e4
        s, out = up(x)
        y = np.asarray(out["fake_up"])[0]
        assert np.isnan(s[1]) and np.isfinite(np.delete(s, 1)).all()
        assert np.isnan(y[16:32]).all() and np.isfinite(np.delete(y, np.s_[16:32])).all()
        if np.isinf(bad):
            assert s[3] == 448


def test_validation():
    with pytest.raises(ValueError, match="scale_rounding='down'.*'nearest', 'up'"):
        Format("nvfp4", scale_rounding="down")
    with pytest.raises(ValueError, match="scale_rounding='up'.*not `mxfp8`"):
        Format("mxfp8", scale_rounding="up")
    for fn in (nvfp4x.to_nvfp4, nvfp4x.fake_quantize):
        with pytest.raises(ValueError, match="scale_rounding='ceil'.*'nearest', 'up'"):
            fn(np.ones(16, F32), scale_rounding="ceil")
    # Allowed with round-to-nearest elements too; shown in str().
    assert str(Format("nvfp4", scale_rounding="up")) == "nvfp4 1x16, scale up"
    fmt = Format("nvfp4", rounding="stochastic", scale_rounding="up")
    assert str(fmt) == "nvfp4 1x16, SR, scale up"
    # Not on weights: freeze packs them with round-to-nearest scales.
    with pytest.raises(ValueError, match="Recipe.weight.*scale_rounding='up'"):
        nvfp4x.Recipe(weight=Format("nvfp4", (16, 16), scale_rounding="up"), input=None, grad=None)
    # The recipe keyword: only the grad format changes; the name stays.
    default, unbiased = (
        nvfp4x.recipes.nvfp4_training(),
        nvfp4x.recipes.nvfp4_training(unbiased_sr=True),
    )
    assert unbiased.grad == fmt and unbiased.name == "nvfp4_training"
    assert unbiased.replace(grad=default.grad) == default
    assert nvfp4x.recipes.get("nvfp4_training") == default
    assert "dy=nvfp4 1x16, SR, scale up" in str(unbiased)
    no_sr = nvfp4x.recipes.nvfp4_training(unbiased_sr=True, stochastic_rounding=False)
    assert no_sr.grad == Format("nvfp4", scale_rounding="up")


# ---------------------------------------------------------------------------------------
# 3. Unbiasedness of the quantiser.
# ---------------------------------------------------------------------------------------


def crafted(shape=SHAPE, seed=0) -> np.ndarray:
    """Blocks whose real scale lies 1-6% above a power of two, so that round to nearest
    takes the power of two (a step of 1/8 below) and the block's largest element scales
    to 6.06-6.36: clamped. An anchor block with amax 2688 makes the tensor scale 1."""
    rng = np.random.default_rng(seed)
    rows, nb = shape[0], shape[1] // 16
    bamax = 6.0 * 2.0 ** rng.integers(-6, 3, (rows, nb, 1)) * rng.uniform(1.01, 1.06, (rows, nb, 1))
    x = rng.uniform(-1, 1, (rows, nb, 16)) * bamax
    top = rng.integers(0, 16, (rows, nb, 1))
    np.put_along_axis(x, top, bamax * rng.choice([-1.0, 1.0], (rows, nb, 1)), axis=-1)
    x = x.reshape(shape)
    x[0, :16] = 0.0
    x[0, 0] = 2688.0
    return x.astype(F32)


#: Keys per statistical test: the mean of N samples has a standard deviation of at most
#: half a grid step / sqrt(N), about 0.6% of a step.
N_KEYS = 8000


@jax.jit
def sample(x: jax.Array, keys: jax.Array) -> dict[str, jax.Array]:
    """`fake_quantize(x)` stochastically rounded with each key, with nearest and with "up"
    block scales (vmapped over the keys, jitted)."""

    def one(key):
        return {
            sr: nvfp4x.fake_quantize(x, rounding="stochastic", key=key, scale_rounding=sr)
            for sr in ("nearest", "up")
        }

    return jax.vmap(one)(keys)


def sr_keys() -> jax.Array:
    return jax.random.split(jax.random.key(14), N_KEYS)


def test_stochastic_rounding_is_unbiased_with_scales_up():
    # Each dequantised element D is lo or hi, its two neighbouring grid values times the
    # scales, with P(hi) = p, so E[D] = x when nothing is clamped. Over N keys the mean
    # has standard deviation sigma = (hi - lo) sqrt(p (1 - p) / N). Per element, allow
    # 5 sigma plus two extra round-ups ((hi - lo) * 2 / N: the binomial tail of a rare
    # round-up is heavier than the normal one) and float32 rounding; in aggregate the
    # signed error, summed towards each element's sign, must be within 5 sigma of the sum.
    # The default scales on the same input: biased by far more than 6 sigma.
    n = N_KEYS
    x = crafted()
    samples = sample(x, sr_keys())
    scales = quantise_all(x)
    ax = np.abs(x).astype(np.float64)
    s_dec = ref_tensor_scale(x)
    results = {}
    for sr, q in (("nearest", scales["default 1x16"]), ("up", scales["up 1x16"])):
        d = np.asarray(samples[sr], np.float64)
        scale = np.repeat(np.asarray(q.scales).astype(np.float64), 16, axis=-1) * np.float64(s_dec)
        v = ax / scale  # the scaled magnitude, in float64
        i = np.clip(np.searchsorted(GRID, v, side="right") - 1, 0, len(GRID) - 2)
        lo, hi = GRID[i] * scale, GRID[i + 1] * scale
        p = np.clip((ax - lo) / (hi - lo), 0, 1)
        sigma = (hi - lo) * np.sqrt(p * (1 - p) / n)
        err = (d.mean(axis=0) - x) * np.sign(x)
        z = err.sum() / np.sqrt((sigma**2).sum())
        results[sr] = (err, sigma, hi - lo, v, z)
    err, sigma, step, v, z = results["up"]
    assert v.max() <= 6
    bound = 5 * sigma + 2 * step / n + 1e-6 * ax
    assert (np.abs(err) <= bound).all(), f"biased at {np.argwhere(np.abs(err) > bound)[:5]}"
    assert abs(z) < 5, z
    err, sigma, step, v, z = results["nearest"]
    clamped = v > 6
    assert clamped.mean() > 0.05  # the input does what it is meant to
    assert z < -6, z  # towards zero
    # The clamped elements lose up to 6% each (the crafted maxima 1-6%), deterministically.
    rel = -err[clamped] / ax[clamped]
    assert (rel > 0).all() and (rel < 0.07).all() and rel.mean() > 0.02


# ---------------------------------------------------------------------------------------
# 4. The recipe keyword reaches dgrad and wgrad.
# ---------------------------------------------------------------------------------------


def gradient_bias(x, ws, dy) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Relative bias towards zero of dgrad and wgrad, `1 - <g, g_ref> / <g_ref, g_ref>`,
    averaged over independent problems (one weight each; the stochastic-rounding seed
    mixes in each weight's checksum, so each problem draws its own thresholds), with its
    standard error, for the default recipe and for `unbiased_sr=True`. `g_ref` is the
    gradient with `dy` unquantised: the straight-through expectation (the same quantised
    W in dgrad, the same RHT and quantised x in wgrad)."""
    ref = nvfp4x.recipes.nvfp4_training().replace(grad=None)
    recipes = {
        "default": nvfp4x.recipes.nvfp4_training(),
        "unbiased_sr": nvfp4x.recipes.nvfp4_training(unbiased_sr=True),
    }

    @jax.jit
    @jax.vmap
    def grads(w):
        def g(recipe):
            def f(x, w):
                return jnp.sum(nvfp4x.qdot(x, w, recipe=recipe) * dy)

            return jax.grad(f, argnums=(0, 1))(x, w)

        return g(ref), {name: g(r) for name, r in recipes.items()}

    want, got = grads(ws)
    out = {}
    for name, g in got.items():
        b = []
        for a, r in zip(g, want, strict=True):
            a = np.asarray(a, np.float64).reshape(len(ws), -1)
            r = np.asarray(r, np.float64).reshape(len(ws), -1)
            b.append(1 - (a * r).sum(1) / (r * r).sum(1))
        b = np.stack(b, axis=1)  # (problems, [dgrad, wgrad])
        out[name] = (b.mean(0), b.std(0, ddof=1) / np.sqrt(len(b)))
    return out


def test_recipe_unbiased_sr_reaches_dgrad_and_wgrad():
    # Gaussian data: the default's dgrad and wgrad are biased by about 0.35% towards zero
    # (z ~ 19 over 400 problems); with unbiased_sr=True the bias is within noise.
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
    ws = jnp.asarray(rng.standard_normal((400, 64, 64)) / 8, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
    out = gradient_bias(x, ws, dy)
    bias, se = out["default"]
    assert (bias > 6 * se).all() and (bias > 0.002).all(), (bias, se)
    bias, se = out["unbiased_sr"]
    assert (np.abs(bias) < 5 * se).all() and (np.abs(bias) < 0.001).all(), (bias, se)


# ---------------------------------------------------------------------------------------
# 5. Eager and jitted calls agree.
# ---------------------------------------------------------------------------------------

INPUTS = {
    "spread": lambda: spread()[:8],
    "tiny": lambda: spread(seed=1)[:8] * F32(1e-39),  # subnormal tensor scale
    "crafted": crafted,
}


@pytest.mark.parametrize("name", list(INPUTS))
def test_up_eager_equals_jit(name):
    # Eager calls (1x16, the gradients' layout) against the jitted program and against
    # the first of the jitted, vmapped stochastic samples (same key).
    x = jnp.asarray(INPUTS[name]())
    assert x.shape == SHAPE
    jitted = quantise_all(x)
    eager = nvfp4x.to_nvfp4(x, scale_rounding="up")
    for field in ("codes", "scale_bits", "tensor_scale"):
        want = getattr(jitted["up 1x16"], field)
        np.testing.assert_array_equal(getattr(eager, field), want, field)
    np.testing.assert_array_equal(eager.dequantize(), jitted["dequantized_up"])
    keys = sr_keys()
    want = sample(x, keys)["up"][0]
    got = nvfp4x.fake_quantize(x, rounding="stochastic", key=keys[0], scale_rounding="up")
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------------------
# The bias figures (`python tests/test_unbiased_sr.py`).
# ---------------------------------------------------------------------------------------


def measure_bias(size: int = 256, keys: int = 4000) -> dict[str, dict[str, float]]:
    """On Gaussian `x`, `W / 16` and `dy` of `size x size`, for the default recipe and
    for `unbiased_sr=True`: the share of `dy`'s elements clamped at 6 in dgrad's 1x16
    blocks and their mean relative shortfall, and the relative bias of dgrad and wgrad
    averaged over `keys` seeds, towards zero (`1 - <mean, ref> / <ref, ref>`) and in norm
    (`|E[g] - ref| / |ref|`, from two independent halves of the seeds so that the noise
    cancels: `sqrt(<m1 - ref, m2 - ref> / <ref, ref>)`)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((size, size)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((size, size)) / 16, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((size, size)), jnp.float32)

    def grads(recipe, seed):
        def f(x, w):
            return jnp.sum(nvfp4x.qdot(x, w, recipe=recipe, seed=seed) * dy)

        return jax.grad(f, argnums=(0, 1))(x, w)

    @functools.partial(jax.jit, static_argnums=0)
    def total(recipe, seeds):
        def body(acc, seed):
            return jax.tree.map(jnp.add, acc, grads(recipe, seed)), None

        return jax.lax.scan(body, (jnp.zeros_like(x), jnp.zeros_like(w)), seeds)[0]

    def mean_grads(recipe, seeds):
        return [np.asarray(t, np.float64) / len(seeds) for t in total(recipe, seeds)]

    half = keys // 2
    seeds = jnp.stack([jnp.arange(keys, dtype=jnp.uint32), jnp.full(keys, 3, jnp.uint32)], 1)
    out = {}
    for unbiased in (False, True):
        recipe = nvfp4x.recipes.nvfp4_training(unbiased_sr=unbiased)
        v = np.abs(np.asarray(scale_blocks(dy, (1, 16), None, recipe.grad.scale_rounding)[0]))
        clamped = v > 6
        short = ((v[clamped] - 6) / v[clamped]).mean() if clamped.any() else 0.0
        row = {"% clamped": 100 * clamped.mean(), "mean shortfall %": 100 * short}
        ref = grads(recipe.replace(grad=None), jnp.zeros(2, jnp.uint32))
        m1, m2 = mean_grads(recipe, seeds[:half]), mean_grads(recipe, seeds[half:])
        for name, a1, a2, r in zip(("dgrad", "wgrad"), m1, m2, ref, strict=True):
            r = np.asarray(r, np.float64)
            rr = np.vdot(r, r)
            row[f"{name} bias towards 0 %"] = 100 * (1 - np.vdot((a1 + a2) / 2, r) / rr)
            row[f"{name} |bias| %"] = 100 * np.sqrt(max(np.vdot(a1 - r, a2 - r) / rr, 0.0))
        out["unbiased_sr=True" if unbiased else "default"] = row
    return out


if __name__ == "__main__":
    for name, row in measure_bias().items():
        print(name, {k: round(float(v), 4) for k, v in row.items()})


def test_telemetry_saturation_follows_scale_rounding():
    """Telemetry's `saturated_frac` counts the elements beyond the largest magnitude
    their block can hold, `(6 x scale_b) x s_dec` (the dequantised value of code 6: the
    first product exact, one rounding): some with the spec's nearest block scales, none
    with scales rounded up but the tensor's amax, by an ulp. The input comes from NumPy
    (the same on every backend) and holds an element within an ulp of its block's
    limit, which `6 x (scale_b x s_dec)` (two roundings) puts on the other side (as on a
    TPU with `jax.random.normal`'s values there: 293 elements counted, 292 by that)."""
    from nvfp4x._probe import STATS, operand_stats

    x = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32)
    col = STATS.index("saturated_frac")
    key = jax.random.key(0)
    near = operand_stats(jnp.asarray(x), Format("nvfp4", rounding="stochastic"), -1, key)
    up_format = Format("nvfp4", rounding="stochastic", scale_rounding="up")
    up = operand_stats(jnp.asarray(x), up_format, -1, key)
    # reference: |x| > (6 x its block's scale as the format rounds it) x s_dec, in IEEE
    # float32 (NumPy)
    for fmt_stats, rounding in ((near, "nearest"), (up, "up")):
        _, sb, s_dec = scale_blocks(jnp.asarray(x), (1, 16), None, rounding)
        top = (np.float32(6.0) * np.asarray(sb)) * np.float32(s_dec)
        clamped = np.abs(x.reshape(64, 8, 16)) > top.reshape(64, 8, 1)
        assert float(fmt_stats[col]) * x.size == clamped.sum()
    assert float(near[col]) > 0.005
    # Rounded up, none but the tensor's amax (its block's real scale is 448 within
    # float32 rounding, where `"up"` caps it: `_block_scales_up`).
    assert float(up[col]) * x.size <= (np.abs(x) == np.abs(x).max()).sum()
