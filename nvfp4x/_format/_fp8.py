"""MXFP8 (E4M3 elements, 32-element blocks, E8M0 scales) and FP8 with per-tensor current
scaling (E4M3 / E5M2), spec §6. Plain `jax.numpy`, float32 math."""

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ._constants import E4M3_MAX, E5M2_MAX, MX_BLOCK
from ._e4m3 import round_e4m3, round_e5m2

FP8_KINDS = {"e4m3": (E4M3_MAX, round_e4m3), "e5m2": (E5M2_MAX, round_e5m2)}


def mx_pad(x: Array) -> Array:
    pad = -x.shape[-1] % MX_BLOCK
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x


def quantize_mxfp8(
    xp: Float[Array, "*lead k"],
) -> tuple[Float[Array, "*lead k"], Float[Array, "*lead kb"]]:
    """MXFP8 along the last axis (a multiple of 32).

    **Returns:** `(q, scale)`: `q` the E4M3 element values (float32), `scale` the
    power-of-two block scales `2^ceil(log2(bamax / 448))` (NaN for a non-finite block),
    exponent clamped to E8M0's range [-127, 127]. Dequantised value: `q * scale`.
    """
    xb = xp.astype(jnp.float32).reshape(*xp.shape[:-1], xp.shape[-1] // MX_BLOCK, MX_BLOCK)
    bamax = jnp.max(jnp.abs(xb), axis=-1)
    # ceil(log2(bamax / 448)) without a division: bamax = m * 2^E (m in [0.5, 1)) and
    # 448 = 0.875 * 2^9, so the ratio is (m / 0.875) * 2^(E - 9).
    mant, exp = jnp.frexp(bamax)
    e = exp - 9 + (mant > 0.875).astype(exp.dtype)
    e = jnp.where(bamax == 0.0, 0, jnp.clip(e, -126, 127))
    finite = jnp.isfinite(bamax)
    e = jnp.where(finite, e, 0)
    q = round_e4m3(jnp.ldexp(xb, -e[..., None]))
    scale = jnp.where(finite, jnp.ldexp(jnp.ones_like(bamax), e), jnp.nan)
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
    Non-finite elements become NaN (never a saturated finite value)."""
    _, rnd = FP8_KINDS[kind]
    scale = fp8_scale(amax, kind)
    x = x.astype(jnp.float32)
    q = rnd(x / scale)
    return jnp.where(jnp.isfinite(x), q, jnp.nan), scale
