"""MXFP8 (E4M3 elements, 32-element blocks, E8M0 scales) and FP8 with per-tensor current
scaling (E4M3 / E5M2), spec §6. Plain `jax.numpy`, float32 math."""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ._constants import E4M3_MAX, E5M2_MAX, FLT_MAX, MX_BLOCK
from ._e4m3 import round_e4m3, round_e5m2
from ._ieee import INF_BITS, abs_bits, divide, from_bits, mul_normal

FP8_KINDS = {"e4m3": (E4M3_MAX, round_e4m3), "e5m2": (E5M2_MAX, round_e5m2)}


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
    xb = xp.astype(jnp.float32).reshape(*xp.shape[:-1], xp.shape[-1] // MX_BLOCK, MX_BLOCK)
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


def fp8_scale(amax: Float[Array, ""], kind: str) -> Float[Array, ""]:
    """Current per-tensor decode scale `amax * f32(1 / max)`; 1 for a zero or non-finite
    amax. (Multiplying by the rounded reciprocal, rather than dividing by a constant that
    XLA may or may not rewrite, gives the same bits eagerly and under `jit`.)"""
    maxval, _ = FP8_KINDS[kind]
    s = jnp.asarray(amax, jnp.float32) * np.float32(1.0 / maxval)
    return jnp.where((s == 0.0) | ~jnp.isfinite(s), jnp.float32(1.0), s)


def quantize_fp8(
    x: Float[Array, "..."], kind: str, amax: Float[Array, ""]
) -> tuple[Float[Array, "..."], Float[Array, ""]]:
    """FP8 with one decode scale per tensor. **Returns:** `(q, scale)`, value `q * scale`.
    Non-finite elements become NaN (never a saturated finite value). `x / scale` is
    correctly rounded on every backend (`divide`)."""
    _, rnd = FP8_KINDS[kind]
    scale = fp8_scale(amax, kind)
    x = x.astype(jnp.float32)
    q = rnd(divide(x, scale))
    return jnp.where(jnp.isfinite(x), q, jnp.nan), scale
