"""MXFP8 (E4M3 elements, 32-element blocks, E8M0 scales) and FP8 with per-tensor current
scaling (E4M3 / E5M2), spec §6. Plain `jax.numpy`, float32 math."""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ._bits import widen
from ._constants import E4M3_MAX, E5M2_MAX, FLT_MAX, MX_BLOCK
from ._e4m3 import round_e4m3, round_e5m2
from ._ieee import INF_BITS, abs_bits, divide, from_bits, is_zero, mul_normal
from ._subnormal import mul_tiny, tiny_up

#: Each FP8 kind's largest finite magnitude and rounding.
FP8_KINDS = {"e4m3": (E4M3_MAX, round_e4m3), "e5m2": (E5M2_MAX, round_e5m2)}
#: Each FP8 kind's dtype.
FP8_DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


def mx_pad(x: Array) -> Array:
    pad = -x.shape[-1] % MX_BLOCK
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x


def quantize_mxfp8(
    xp: Float[Array, "*lead k"],
) -> tuple[Float[Array, "*lead k"], Float[Array, "*lead kb"]]:
    """MXFP8 along the last axis (a multiple of 32).

    **Returns:** `(q, scale)`: `q` the E4M3 element values (float32), `scale` the
    power-of-two block scales `2^ceil(log2(bamax / 448))` (NaN for a non-finite block; 1
    for a zero block), exponent clamped to [-126, 120]. Dequantised value: `q * scale`.

    - The exponent never exceeds 120 (`ceil(log2(FLT_MAX / 448))`). At 120, an element
      rounding up to 256 would dequantise to 2^128 = inf, so elements saturate at the
      largest E4M3 value whose product with the scale is finite (240 there, 448 below),
      as the spec's "saturate" asks: a finite input never becomes inf.
    - The lower clamp is -126, not E8M0's -127, so that every scale is a normal float32
      (2^-127 is subnormal, read as 0 by devices that flush subnormals).
    - Block maxima and elements are read through their bits (`_ieee`), so subnormal
      inputs are quantised the same on every device.
    """
    xb = widen(xp).reshape(*xp.shape[:-1], xp.shape[-1] // MX_BLOCK, MX_BLOCK)
    bits = jnp.max(abs_bits(xb), axis=-1)  # NaN (above inf) propagates
    finite = bits < INF_BITS
    # bamax = 1.m * 2^(E - 127) and 448 = 1.75 * 2^8, so
    # ceil(log2(bamax / 448)) = E - 135 + (1.m > 1.75); 0.75 * 2^23 = 0x600000.
    e = (bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).astype(jnp.int32)
    e = jnp.where(bits == 0, 0, jnp.clip(e, -126, 127))  # (subnormal maxima: -126)
    e = jnp.where(finite, e, 0)
    inv = from_bits((127 - e) << 23)[..., None]  # 2^-e, normal for e in [-126, 127]
    scale = jnp.where(finite, from_bits((127 + e) << 23), jnp.nan)
    # The largest E4M3 value v with v * 2^e <= FLT_MAX: FLT_MAX * 2^-e truncated to 3
    # mantissa bits (keeping the top 12 bits), at most 448.
    limit = jnp.minimum(FLT_MAX * inv, E4M3_MAX)
    limit = from_bits(jax.lax.bitcast_convert_type(limit, jnp.int32) & ~0xFFFFF)
    q = jnp.clip(round_e4m3(mul_normal(xb, inv)), -limit, limit)
    return q.reshape(xp.shape), scale


#: Below this amax (2^-90), `fp8_scale` and `quantize_fp8` take their exact paths: only
#: there can the scale be subnormal, or a subnormal element quantise to a non-zero value.
_TINY_AMAX_BITS = (127 - 90) << 23


def fp8_scale(amax: Float[Array, ""], kind: str) -> Float[Array, ""]:
    """Current per-tensor decode scale `amax * f32(1 / max)`; 1 for a zero or non-finite
    amax. (Multiplying by the rounded reciprocal, rather than dividing by a constant that
    XLA may or may not rewrite, gives the same bits eagerly and under `jit`.) The IEEE
    float32 product, subnormal scales of tiny tensors included (`mul_tiny`), on every
    device."""
    maxval, _ = FP8_KINDS[kind]
    amax = jnp.asarray(amax, jnp.float32)
    c = np.float32(1.0 / maxval)
    tiny = abs_bits(amax) < _TINY_AMAX_BITS
    s = jnp.where(tiny, mul_tiny(jnp.where(tiny, amax, 0.0), float(c)), amax * c)
    return jnp.where(is_zero(s) | ~jnp.isfinite(s), jnp.float32(1.0), s)


def quantize_fp8(
    x: Float[Array, "..."], kind: str, amax: Float[Array, ""]
) -> tuple[Float[Array, "..."], Float[Array, ""]]:
    """FP8 with one decode scale per tensor. **Returns:** `(q, scale)`, value `q * scale`.
    Non-finite elements become NaN (never a saturated finite value).

    For a tiny tensor (amax below 2^-90) the quotients `x / scale` are taken with both
    operands scaled up by 2^64 (`tiny_up`: exact, subnormals read from their bits), the
    same IEEE quotients on a device that flushes subnormals. `x / scale` is correctly
    rounded on every backend (`divide`)."""
    _, rnd = FP8_KINDS[kind]
    scale = fp8_scale(amax, kind)
    x = widen(x)
    tiny = abs_bits(jnp.asarray(amax, jnp.float32)) < _TINY_AMAX_BITS
    num = jnp.where(tiny, tiny_up(jnp.where(tiny & jnp.isfinite(x), x, 0.0)), x)
    den = jnp.where(tiny, tiny_up(scale), scale)
    q = rnd(divide(num, den))
    return jnp.where(jnp.isfinite(x), q, jnp.nan), scale
