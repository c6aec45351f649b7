"""Rounding to FP8 E4M3 (`float8_e4m3fn`) and E5M2 in float32 arithmetic.

The result is an exact float32 copy of the FP8 value, so no cast can be fused away by
XLA under `jit` (it removes `f32 -> fp8 -> f32` pairs on some backends).
"""

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from ._constants import E4M3_MAX, E4M3_MIN_NORMAL, E5M2_MAX, E5M2_MIN_NORMAL


def round_e4m3(v: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """Round to the nearest E4M3 value (ties to even), saturating at ±448. NaN stays NaN.

    Normal range: `reduce_precision` to 3 mantissa bits with a wide exponent (exact
    there); subnormal range (below 2^-6): multiples of 2^-9.
    """
    a = jnp.minimum(jnp.abs(v), E4M3_MAX)
    normal = lax.reduce_precision(a, exponent_bits=8, mantissa_bits=3)
    sub = jnp.round(a * 512.0) * (1.0 / 512.0)
    q = jnp.where(a < E4M3_MIN_NORMAL, sub, jnp.minimum(normal, E4M3_MAX))
    return jnp.copysign(q, v)


def round_e5m2(v: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """Round to the nearest E5M2 value (ties to even), saturating at ±57344. NaN stays NaN."""
    a = jnp.minimum(jnp.abs(v), E5M2_MAX)
    normal = lax.reduce_precision(a, exponent_bits=8, mantissa_bits=2)
    sub = jnp.round(a * 65536.0) * (1.0 / 65536.0)
    q = jnp.where(a < E5M2_MIN_NORMAL, sub, jnp.minimum(normal, E5M2_MAX))
    return jnp.copysign(q, v)
