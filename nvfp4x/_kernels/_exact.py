"""Bit-deciding float32 steps of the NVFP4 quantiser in operations every Pallas backend
lowers (Triton has no `round`, no `reduce_precision`, and its float32 `/` is not the
IEEE one): integer operations on bit patterns, `floor`, and float products and sums
whose results are exact, so that a fused multiply-add gives the same bits.

Each function equals, bit for bit, the `nvfp4x._numerics` step it names (tested in
`tests/test_kernels.py`), on every backend and in any subnormal mode.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._numerics import _ieee
from .._numerics._constants import (
    BLOCK,
    E2M1_MAX,
    E4M3_MAX,
    E4M3_MIN_NORMAL,
    INV_E2M1_MAX,
    ROW_BLOCK,
    TILE,
)
from .._numerics._ieee import (
    INF_BITS,
    abs_bits,
    from_bits,
    is_tiny_scale,
    mul_normal,
    scale_down_149,
)
from .._numerics._nvfp4 import _inverse_exact, amax_of_bits, tensor_scales

#: E4M3 bit patterns of a block scale `>= 0` (NaN's, 0x7F, last).
E4M3_CODES = 128


def _bits(x: Array) -> Array:
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def round_half_even(t: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """`jnp.round(t)` (half to even) for `0 <= t < 2^24`, by `floor` and exact steps."""
    r = jnp.floor(t)
    d = t - r  # exact
    odd = (r - 2.0 * jnp.floor(r * 0.5)) == 1.0
    return r + jnp.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)


def round_mantissa(a: Float[Array, "*s"], mantissa_bits: int) -> Float[Array, "*s"]:
    """`lax.reduce_precision(a, exponent_bits=8, mantissa_bits=...)` for a finite `a >= 0`
    (round half to even on the bits; NaN and inf give garbage: mask them)."""
    drop = 23 - mantissa_bits
    b = _bits(a)
    b = b + ((1 << (drop - 1)) - 1) + ((b >> drop) & 1)
    return from_bits(b & ~((1 << drop) - 1))


def round_e4m3_nonneg(a: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """`_numerics._e4m3.round_e4m3(a)` for `0 <= a <= 448` (NaN gives garbage: mask it)."""
    normal = round_mantissa(a, 3)
    sub = round_half_even(a * 512.0) * (1.0 / 512.0)
    return jnp.where(a < E4M3_MIN_NORMAL, sub, jnp.minimum(normal, E4M3_MAX))


def encode_nearest(v: Float[Array, "*s"]) -> Array:
    """`_numerics._e2m1.encode_nearest(v)` as int32 codes (0..15)."""
    b = _bits(v)
    a = from_bits(b & 0x7FFFFFFF)
    big = round_mantissa(jnp.minimum(a, 7.0), 1)
    high = jnp.minimum((_bits(big) >> 22) - 252, 7)
    low = round_half_even(a * 2.0).astype(jnp.int32)
    mag = jnp.where(a < 1.0, low, high)
    mag = jnp.where(jnp.isnan(v), 0, mag)
    return mag | ((b >> 28) & 8)


def encode_stochastic(v: Float[Array, "*s"], u: Float[Array, "*s"]) -> Array:
    """`_numerics._e2m1.encode(_e2m1.round_stochastic(v, u))` as int32 codes (NaN: 0)."""
    b = _bits(v)
    a = jnp.minimum(from_bits(b & 0x7FFFFFFF), E2M1_MAX)
    step = jnp.where(a < 2.0, 0.5, jnp.where(a < 4.0, 1.0, 2.0))
    inv_step = jnp.where(a < 2.0, 2.0, jnp.where(a < 4.0, 1.0, 0.5))
    lo = jnp.floor(a * inv_step) * step
    q = jnp.where(u < (a - lo) * inv_step, lo + step, lo)
    mag = jnp.where(q <= 2.0, 2.0 * q, jnp.minimum(q + 2.0, 7.0)).astype(jnp.int32)
    return jnp.where(jnp.isnan(v), 0, mag | ((b >> 28) & 8))


def decode(code: Array) -> Float[Array, "*s"]:
    """`_numerics._e2m1.decode` of int32 codes: the float32 E2M1 values, the sign set on
    the bits (Triton's `-x` is `0 - x`, which would decode code 8 as `+0.0`)."""
    code = code.astype(jnp.int32)
    m = (code & 7).astype(jnp.float32)
    mag = jnp.where(m <= 4.0, 0.5 * m, jnp.where(m == 7.0, 6.0, m - 2.0))
    return from_bits(_bits(mag) | ((code & 8) << 28))


def e4m3_bits(scale: Float[Array, "*s"]) -> Array:
    """The `float8_e4m3fn` bit pattern (int32, 0..127) of a float32 E4M3 value `>= 0`, or
    `0x7F` for NaN: what `scale.astype(jnp.float8_e4m3fn)` stores."""
    b = _bits(scale)
    normal = (((b >> 23) - 120) << 3) | ((b >> 20) & 7)
    sub = (scale * 512.0).astype(jnp.int32)
    out = jnp.where(scale < E4M3_MIN_NORMAL, sub, normal)
    return jnp.where(jnp.isnan(scale), 0x7F, out)


def mul_exact(p: Float[Array, "..."], s: Float[Array, "..."], tiny: Array) -> Float[Array, "..."]:
    """`_numerics._ieee.mul_exact(p, s)` (see there for the method and preconditions), with
    `round_half_even` in place of `jnp.round`, and `tiny = is_tiny_scale(s)` given
    (Triton does not bitcast the constant it compares with)."""
    return _ieee.mul_exact(p, s, tiny, rint=round_half_even)


def block_scale(bamax: Float[Array, "*g"], c: Array, c_sub: Array) -> tuple[Array, Array]:
    """`(scale_b, bits)`: the reference's block scale (`_nvfp4._block_scales_exact`,
    `scale_rounding="nearest"`) from the block maxima `bamax` (subnormals read exactly;
    `c = S_enc * f32(1/6)`, `c_sub = scale_down_149(c)`), as a float32 E4M3 value (NaN
    for a block holding NaN or inf) and its `float8_e4m3fn` bits (int32, 127 for NaN).
    Both kernels' per-block step."""
    t = jnp.minimum(mul_normal(bamax, c, c_sub), E4M3_MAX)
    finite = abs_bits(bamax) < INF_BITS
    scale_b = jnp.where(finite, round_e4m3_nonneg(t), jnp.nan)
    return scale_b, e4m3_bits(scale_b)


def e4m3_value(bits: Array) -> Float[Array, "*s"]:
    """The float32 value of `float8_e4m3fn` bit patterns `0 <= bits < 128` (int32), by
    integer steps (Mosaic has no float8 conversion on every TPU): `2^(e-7) (1 + m/8)`
    built on its bits, `m 2^-9` for a subnormal code (a normal float32), NaN for 127."""
    bits = bits.astype(jnp.int32)
    e, m = bits >> 3, bits & 7
    normal = from_bits(((e + 120) << 23) | (m << 20))
    value = jnp.where(e == 0, m.astype(jnp.float32) * (1.0 / 512.0), normal)
    return jnp.where(bits == E4M3_CODES - 1, jnp.nan, value)


def inverse_entries(bits: Array, s_dec: Float[Array, "*s"]) -> tuple[Array, Array]:
    """`inverse_table(s_dec)`'s entries at the E4M3 bit patterns `bits` (int32, below
    128; `s_dec` broadcast against them): `(inv_b, inv_b * 2^-149)`."""
    inv_b = _inverse_exact(e4m3_value(bits), s_dec)
    return inv_b, scale_down_149(inv_b)


def inverse_table(s_dec: Float[Array, ""]) -> Float[Array, "256"]:
    """The reference's `inv_b = min(1 / (scale_b * s_dec), FLT_MAX)` for every E4M3
    block scale `scale_b >= 0`, indexed by its bits (127: NaN), then `inv_b * 2^-149`
    (`scale_down_149`, for `mul_normal`): a block scale takes one of 128 values, so a
    kernel looks its inverse up instead of dividing (the reference's own
    `_inverse_exact`, in XLA once per call: the same bits by construction)."""
    inv_b, inv_sub = inverse_entries(jnp.arange(E4M3_CODES, dtype=jnp.int32), s_dec)
    return jnp.concatenate([inv_b, inv_sub])


def head_values(s_enc: Array, s_dec: Array) -> list[Array]:
    """The four float32 parameters every block step reads, from the tensor scales:
    `[s_enc / 6, that * 2^-149, s_dec, tiny]` (`tiny`: 1.0 where `s_dec` needs the
    exact tiny-scale path), each of `s_enc`'s shape."""
    c = s_enc * INV_E2M1_MAX
    tiny = is_tiny_scale(s_dec).astype(jnp.float32)
    return [c, scale_down_149(c), jnp.broadcast_to(s_dec, c.shape), tiny]


#: The block layouts the quantiser kernels take: 1x16, 16x16 tiles, and 16x1 (down the
#: columns).
BLOCKS_2D = (ROW_BLOCK, TILE, (BLOCK, 1))
#: What a quantiser kernel's call writes: packed codes and scale bits (`to_nvfp4`),
#: bfloat16 block values `e2m1 * scale_b` (the GEMM operand path), or the dequantised
#: values in the input's dtype (`fake_quantize`).
OUTPUTS = ("codes", "values", "dequantized")


def tensor_parameters(x: Array, amax: Array | None, block, output: str):
    """The quantiser kernels' shared prologue: checks a padded 2-D `x`'s `block` and
    `output`, and gives `(s_dec, head, table)`: the tensor decode scale, the four float32
    parameters every block step reads, `[s_enc / 6, that / 2^149, s_dec, tiny]`
    (`tiny`: 1.0 where `s_dec` needs the exact tiny-scale path), and the inverse table
    (`inverse_table(s_dec)`). `amax` None: the tensor's own (`amax_of_bits`)."""
    return scale_parameters(checked_amax(x, amax, block, output))


def checked_amax(x: Array, amax: Array | None, block, output: str) -> Array:
    """A quantiser kernel's tensor amax for the padded 2-D `x` (`amax`, or None: the
    tensor's own, `amax_of_bits`), float32, once `x`'s `block` and `output` are checked."""
    rows, cols = x.shape
    br, bc = block
    if block not in BLOCKS_2D or rows % br or cols % bc or cols % 2 or output not in OUTPUTS:
        raise ValueError(
            f"`quantize_2d` takes blocks {BLOCKS_2D} on padded shapes and an output in "
            f"{OUTPUTS}, got {block} on {x.shape}, `output={output!r}`."
        )
    return jnp.asarray(amax_of_bits(x) if amax is None else amax, jnp.float32)


@jax.jit
def scale_parameters(amax: Float[Array, ""]) -> tuple[Array, Array, Array]:
    """`tensor_parameters`' scalars from the tensor amax: `(s_dec, head, table)`.

    Jitted, so traced once per process and lowered once per program however many
    tensors a program quantises (XLA inlines the call: the same program as the
    operations written out). The exact scalar arithmetic here is long to trace: in a
    2-block training step lowered for a TPU v5e (profiled, 2026-12-07) the dozen
    quantisations' prologues took ~5.8 of 15.3 s (`benchmarks/tpu_compile_check.py
    --only lowering`). Nothing in it depends on the backend or on `nvfp4x._kernels`'
    picks. (The TPU kernels make the same bits in a kernel of their own,
    `_tpu_quantize.prologue`: in XLA, ~400 operations at every quantisation were most
    of a step's program and ~7 s of its compile on a TPU v5e.)"""
    s_enc, s_dec = tensor_scales(amax)
    return s_dec, jnp.stack(head_values(s_enc, s_dec)), inverse_table(s_dec)
