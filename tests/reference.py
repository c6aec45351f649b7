"""The NumPy references of the formats (spec §1, §2 and §6) and of the quantised GEMMs
(§4, §5), shared by the tests.

Written from `shared/spec/nvfp4.md` with NumPy float32 arithmetic (IEEE: subnormals kept)
and `ml_dtypes` casts only (the GEMMs multiply in float64); nothing here calls into
`nvfp4x`. Comparisons with the formats are bit for bit (`assert_bits`), with the GEMMs to
a relative error (`helpers.assert_close`: float32 summation order).

Documented choices of the library that the references follow:
- the tensor amax is `max(|x|)` ignoring NaN (CUDA's `fmaxf`) but counting infinities;
- a block holding a NaN or ±inf gets a NaN block scale, so all its elements dequantise
  to NaN (its codes are then irrelevant and are not compared);
- blocked axes that are not multiples of 16 are zero-padded: the codes have the padded
  shape with the last axis halved, the scales one entry per padded block.
"""

from typing import NamedTuple

import ml_dtypes
import numpy as np

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max
E4M3 = ml_dtypes.float8_e4m3fn
E5M2 = ml_dtypes.float8_e5m2
E2M1 = ml_dtypes.float4_e2m1fn
#: Magnitudes of the E2M1 codes 0..7 (spec §1).
GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], F32)


def pad(x: np.ndarray, block) -> np.ndarray:
    pads = [(0, 0)] * x.ndim
    pads[-1] = (0, -x.shape[-1] % 16)
    if block[0] == 16:
        pads[-2] = (0, -x.shape[-2] % 16)
    return np.pad(x, pads)


def to_blocks(xp: np.ndarray, block) -> np.ndarray:
    if block[0] == 1:
        return xp.reshape(*xp.shape[:-1], xp.shape[-1] // 16, 16)
    *lead, r, c = xp.shape
    return xp.reshape(*lead, r // 16, 16, c // 16, 16)


def per_element(s: np.ndarray, block) -> np.ndarray:
    """A per-block array broadcast against the `_to_blocks` view."""
    return s[..., None] if block[0] == 1 else s[..., :, None, :, None]


def logical(xb: np.ndarray, padded_shape, shape) -> np.ndarray:
    """From the `_to_blocks` view back to the logical (unpadded) shape."""
    xp = xb.reshape(padded_shape)
    return xp[tuple(slice(0, n) for n in shape)]


class Ref(NamedTuple):
    codes: np.ndarray  # uint8 4-bit codes, padded shape (unpacked)
    valid: np.ndarray  # bool, padded shape: the element's block is finite
    scales: np.ndarray  # float8_e4m3fn block scales
    tensor_scale: np.float32  # s_dec
    deq: np.ndarray  # dequantised, logical shape, input dtype
    v: np.ndarray  # float32 scaled values x * inv_b, padded shape
    sbf: np.ndarray  # float32 block scale per element, padded shape


def ref_nvfp4(x, block, amax=None) -> Ref:
    """Spec §2 step by step in NumPy float32, rounding by ml_dtypes casts."""
    x = np.asarray(x)
    x32 = x.astype(F32)
    xp = pad(x32, block)
    xb = to_blocks(xp, block)
    with np.errstate(all="ignore"):
        if amax is None:
            a = np.abs(xp)
            amax = np.max(np.where(np.isnan(a), F32(0), a), initial=F32(0))
        amax = F32(amax)
        s_enc = np.minimum(F32(2688) / amax, FLT_MAX)
        if amax == 0 or s_enc == 0:
            s_enc = F32(1)
        s_dec = F32(1) / s_enc
        axes = (-1,) if block[0] == 1 else (-3, -1)
        bamax = np.max(np.abs(xb), axis=axes)  # NaN propagates: the non-finite flag
        finite = np.isfinite(bamax)
        # Clamp to 448 before the cast: ml_dtypes maps anything above 464 to NaN.
        sb = np.minimum(bamax * (s_enc * (F32(1) / F32(6))), F32(448))
        sb = np.where(finite, sb, F32(np.nan)).astype(E4M3)
        sbf = sb.astype(F32)
        inv = np.minimum(F32(1) / (sbf * s_dec), FLT_MAX)
        v = xb * per_element(inv, block)
        # Saturate at ±6 before the cast (E2M1 has no inf/NaN); NaN blocks get code 0.
        vc = np.clip(np.where(np.isnan(v), F32(0), v), F32(-6), F32(6))
        codes = vc.astype(E2M1).view(np.uint8)
        values = codes.view(E2M1).astype(F32)
        deq = (values * per_element(sbf, block)) * s_dec
    valid = np.broadcast_to(per_element(finite, block), xb.shape)
    sbf_e = np.broadcast_to(per_element(sbf, block), xb.shape)
    return Ref(
        codes=codes.reshape(xp.shape),
        valid=valid.reshape(xp.shape),
        scales=sb,
        tensor_scale=F32(s_dec),
        deq=logical(deq, xp.shape, x.shape).astype(x.dtype),
        v=v.reshape(xp.shape),
        sbf=sbf_e.reshape(xp.shape),
    )


def ref_neighbours(ref: Ref, shape, dtype):
    """The two E2M1 grid values around each scaled value, as codes and dequantised.

    Saturating values (|v| > 6) have both neighbours at ±6; exact grid values have
    `lo == hi`. Returns `(lo_code, hi_code, lo_deq, hi_deq)`; codes in the padded shape,
    dequantised values in the logical shape and `dtype`.
    """
    with np.errstate(all="ignore"):
        a = np.minimum(np.abs(np.where(np.isnan(ref.v), F32(0), ref.v)), F32(6))
        hi_i = np.searchsorted(GRID, a, side="left")  # smallest grid value >= a
        lo_i = np.searchsorted(GRID, a, side="right") - 1  # largest grid value <= a
        sign = np.signbit(ref.v)
        s_dec = ref.tensor_scale
        out = []
        for i in (lo_i, hi_i):
            code = (i + 8 * sign).astype(np.uint8)
            deq = (code.view(E2M1).astype(F32) * ref.sbf) * s_dec
            out.append((code, deq[tuple(slice(0, n) for n in shape)].astype(dtype)))
    (lo_code, lo_deq), (hi_code, hi_deq) = out
    return lo_code, hi_code, lo_deq, hi_deq


def unpack(packed) -> np.ndarray:
    """Packed bytes -> 4-bit codes: element 2i is the low nibble (spec §1)."""
    p = np.asarray(packed)
    return np.stack([p & 0x0F, p >> 4], axis=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


def assert_bits(got, want, what: str) -> None:
    """Bitwise equality, with every NaN counting as equal to every NaN."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    nan_got = np.isnan(got.astype(F32))
    nan_want = np.isnan(want.astype(F32))
    np.testing.assert_array_equal(nan_got, nan_want, err_msg=f"{what}: NaN positions")
    uint = {1: np.uint8, 2: np.uint16, 4: np.uint32}[got.dtype.itemsize]
    np.testing.assert_array_equal(
        np.where(nan_want, 0, got.view(uint)),
        np.where(nan_want, 0, want.view(uint)),
        err_msg=f"{what}: bits",
    )


def assert_bits_bf16_flush(got, want, what: str, flush: bool) -> None:
    """`assert_bits`, except that with `flush` (on a TPU: `bf16_arrays_flush()`) a value
    whose bfloat16 is subnormal may come out as the zero of its sign, and only so: a TPU
    reads and writes a bfloat16 array's subnormals as ±0 in every operation."""
    got, want = np.asarray(got), np.asarray(want)
    if flush:
        w = want.astype(F32)
        tiny = (np.abs(w) < F32(2.0**-126)) & (w != 0)
        zero = got.astype(F32) == 0
        flushed = tiny & zero & (np.signbit(got.astype(F32)) == np.signbit(w))
        got = np.where(flushed, want, got)
    assert_bits(got, want, what)


def bf16_arrays_flush() -> bool:
    """Whether this backend reads and writes bfloat16 arrays' subnormals as ±0 (a TPU:
    measured on a v5e, 2026-12-05, even through a bitcast; see docs/format.md)."""
    import jax

    return jax.default_backend() == "tpu"


class MXRef(NamedTuple):
    data: np.ndarray  # float8_e4m3fn elements, padded shape
    scales: np.ndarray  # float32 power-of-two block scales
    deq: np.ndarray  # float32 dequantised, logical shape


class FP8Ref(NamedTuple):
    data: np.ndarray  # FP8 elements
    scale: np.ndarray  # float32 decode scale
    deq: np.ndarray  # float32 dequantised


def bits(a) -> np.ndarray:
    """The bit patterns of `a` as unsigned integers of its width."""
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def ref_mxfp8(x: np.ndarray) -> MXRef:
    """Spec §6 in NumPy: `scale = 2^ceil(log2(bamax / 448))`, with the library's
    documented clamps (exponent in [-126, 120], 1 for a zero block) and saturation of
    each element at the largest E4M3 value `v` with `v * scale <= FLT_MAX`."""
    x32 = np.asarray(x).astype(F32)
    xp = np.pad(x32, [(0, 0)] * (x32.ndim - 1) + [(0, -x32.shape[-1] % 32)])
    xb = xp.reshape(*xp.shape[:-1], -1, 32)
    with np.errstate(all="ignore"):
        bamax = np.max(np.abs(xb), axis=-1)
        mant, exp = np.frexp(bamax.astype(np.float64))  # exact; bamax = mant * 2^exp
        e = exp - 9 + (mant > 0.875)  # 448 = 0.875 * 2^9
        e = np.where(bamax == 0, 0, np.clip(e, -126, 127))
        finite = np.isfinite(bamax)
        e = np.where(finite, e, 0)
        scale = np.where(finite, np.ldexp(F32(1), e).astype(F32), F32(np.nan))
        grid = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float64)
        limit = np.array(
            [grid[grid * 2.0**k <= FLT_MAX].max() for k in e.ravel()], np.float64
        ).reshape(e.shape)
        y = (xb.astype(np.float64) / np.ldexp(1.0, e)[..., None]).astype(F32)
        y = np.clip(np.where(np.isnan(y), 0, y), -448, 448).astype(E4M3).astype(np.float64)
        q = np.clip(y, -limit[..., None], limit[..., None]).astype(E4M3)
        deq = (q.astype(F32) * scale[..., None]).reshape(xp.shape)[..., : x32.shape[-1]]
    return MXRef(data=q.reshape(xp.shape), scales=scale, deq=deq)


def ref_fp8(x: np.ndarray, kind: str) -> FP8Ref:
    """§6 per-tensor FP8: `scale = amax * f32(1/max)` (the library's documented form of
    `amax / max`), 1 for a zero or non-finite amax; non-finite elements give NaN."""
    fp8, top = (E4M3, 448.0) if kind == "e4m3" else (E5M2, 57344.0)
    x32 = np.asarray(x).astype(F32)
    with np.errstate(all="ignore"):
        a = np.abs(x32)
        amax = np.max(np.where(np.isnan(a), F32(0), a), initial=F32(0))
        scale = amax * F32(1.0 / top)
        if scale == 0 or not np.isfinite(scale):
            scale = F32(1)
        y = np.clip(x32 / scale, F32(-top), F32(top))
        q = np.where(np.isfinite(x32), y, F32(np.nan)).astype(fp8)
        deq = q.astype(F32) * scale
    return FP8Ref(data=q, scale=np.asarray(scale, F32), deq=deq)


# ---------------------------------------------------------------------------------------
# The GEMMs (spec §4, §5): float64 products of the quantised operands.
# ---------------------------------------------------------------------------------------

#: Transformer Engine's RHT sign vector (spec §4).
TE_SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], np.float64)


def sylvester16() -> np.ndarray:
    """The 16x16 Sylvester Hadamard matrix (entries ±1)."""
    i = np.arange(16)
    parity = np.vectorize(lambda v: bin(v).count("1") % 2)(i[:, None] & i[None, :])
    return np.where(parity == 0, 1.0, -1.0)


def ref_quantize(a, axis: int = -1, tile: bool = False) -> tuple[np.ndarray, np.float32]:
    """A GEMM operand quantised as spec §2 (`ref_nvfp4`, round to nearest even):
    `(block values, s_dec)`.

    `block values` are `e2m1_value * block_scale` (exact; float64 here) in `a`'s shape, so
    the dequantised tensor is `values * s_dec`. 1x16 blocks run along `axis`; `tile=True`
    uses 16x16 tiles of a 2-D weight. Padding is zeros.
    """
    a = np.asarray(a, F32)
    if not tile:
        a = np.moveaxis(a, axis, -1)
    ref = ref_nvfp4(a, (16, 16) if tile else (1, 16))
    vals = (ref.codes.view(E2M1).astype(F32) * ref.sbf).astype(np.float64)
    vals = vals[tuple(slice(0, n) for n in a.shape)]
    return (vals if tile else np.moveaxis(vals, -1, axis)), ref.tensor_scale


def ref_deq(a, axis: int = -1, tile: bool = False) -> np.ndarray:
    vals, s = ref_quantize(a, axis, tile)
    return vals * np.float64(s)


def ref_rht_tokens(a: np.ndarray) -> np.ndarray:
    """`H = diag(s) @ H16 / 4` applied to each chunk of 16 rows (tokens) of a 2-D array,
    rows zero-padded to a multiple of 16 (spec §4). Float64, returned as float32."""
    h = np.diag(TE_SIGNS) @ sylvester16() / 4
    a = np.asarray(a, np.float64)
    ap = np.pad(a, [(0, -a.shape[0] % 16), (0, 0)])
    chunks = ap.reshape(-1, 16, ap.shape[1])
    return np.einsum("ij,cjk->cik", h, chunks).reshape(ap.shape).astype(F32)


def ref_rht_float32(a: np.ndarray) -> np.ndarray:
    """`nvfp4x.rht`'s float32 arithmetic along axis 0 of a 2-D array whose 16-row chunk
    columns need no range scaling (magnitudes from 2^-100 below 2^124, or all zero), in
    NumPy float32 in the order the library defines: each chunk times 1/4, the 16-point
    fast Walsh-Hadamard transform's butterflies `a + b`, `a - b` over rows `j` and
    `j + 2^s` for s = 0, 1, 2, 3 in turn, then times the signs (spec §4)."""
    a = np.asarray(a, np.float32)
    ap = np.pad(a, [(0, -a.shape[0] % 16), (0, 0)])
    y = ap.reshape(-1, 16, ap.shape[1]) * np.float32(0.25)
    half = 1
    while half < 16:
        y = y.copy()
        for j in range(16):
            if not j & half:
                lo, hi = y[:, j].copy(), y[:, j + half].copy()
                y[:, j], y[:, j + half] = lo + hi, lo - hi
        half *= 2
    return (y * np.asarray(TE_SIGNS, np.float32)[None, :, None]).reshape(ap.shape)


def ref_gemms(x, w, g, *, rht: bool = False):
    """The three GEMMs of `nvfp4_training(rht=..., stochastic_rounding=False)`.

    `x: (t, k)`, `w: (n, k)`, `g = dy: (t, n)`. Each operand has its own tensor scale.
    """
    x, w, g = (np.asarray(v, F32) for v in (x, w, g))
    xv, xs = ref_quantize(x, axis=1)  # x along k
    wv, ws = ref_quantize(w, tile=True)  # W 16x16
    gv, gs = ref_quantize(g, axis=1)  # dy along n
    y = (xv @ wv.T) * (np.float64(xs) * np.float64(ws))
    dx = (gv @ wv) * (np.float64(gs) * np.float64(ws))
    if rht:
        g, x = ref_rht_tokens(g), ref_rht_tokens(x)
    gt, gts = ref_quantize(g, axis=0)  # dy along t
    xt, xts = ref_quantize(x, axis=0)  # x along t
    dw = (gt.T @ xt) * (np.float64(gts) * np.float64(xts))
    return y, dx, dw
