"""Float32 arithmetic on values near the subnormal range, with IEEE results on every device.

XLA:CPU flushes subnormals (see `_ieee`). Where a computation on tiny values (the RHT of
a column of subnormals, the FP8 scale of a tiny tensor) must give its IEEE float32
result, it runs scaled up by 2^`TINY_SHIFT`, where nothing is subnormal: `tiny_up`
scales the operands exactly, reading subnormals from their bits, and `tiny_down` rounds
the scaled result back once, building a subnormal result from its bits.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ._bits import narrow, widen
from ._ieee import (
    MIN_NORMAL_BITS,
    abs_bits,
    from_bits,
    ldexp_normal,
    round_with_remainder,
    split_12,
)

#: The power of two by which tiny values are scaled up.
TINY_SHIFT = 64

_SIGN = -(2**31)  # the sign bit, as an int32


def to_float32(x: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """`x` rounded once to float32 (to nearest, ties to even), subnormal results kept on
    every device. Only a float64 `x` needs care: XLA:CPU's conversion flushes results
    below 2^-126 to zero; those are built from their bits (the 23-bit field is `|x| *
    2^149` rounded to an integer in float64, where it is normal). Narrower floats
    convert exactly, on the bits (`_bits.widen`: a TPU's convert may flush them)."""
    if x.dtype != jnp.float64:
        return widen(x)
    a = jnp.abs(x)
    tiny = a < np.float64(2.0**-126)  # (NaN: not tiny)
    field = jnp.round(jnp.where(tiny, a, 0.0) * np.float64(2.0**149))  # half to even
    mag = field.astype(jnp.int32)  # at most 2^23: the bits of 2^-126
    sign = jnp.where(jnp.signbit(x), jnp.int32(_SIGN), jnp.int32(0))
    sub = from_bits(mag | sign)
    return jnp.where(tiny, sub, x.astype(jnp.float32))


def float64_to_float32(x: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """A float64 `x` as float32 (`to_float32`: subnormals kept); any other `x` as it is
    (the quantisers and their kernels take bfloat16 and float16 as they are)."""
    return to_float32(x) if x.dtype == jnp.float64 else x


def from_float32(y: Float[Array, "*s"], dtype) -> Array:
    """The float32 `y` in `dtype`: for float64, exactly, subnormals included (XLA:CPU's
    conversion reads a float32 subnormal as zero; it is built from its 23-bit field,
    `field * 2^-149`, a normal float64). Other dtypes as `_bits.narrow` gives them
    (bfloat16 on the bits)."""
    if jnp.dtype(dtype) != jnp.float64:
        return narrow(y.astype(jnp.float32), dtype)
    bits = jax.lax.bitcast_convert_type(y.astype(jnp.float32), jnp.int32)
    mag = bits & 0x7FFFFFFF
    sub = mag.astype(jnp.float64) * np.float64(2.0**-149)
    sub = jnp.where(bits < 0, -sub, sub)
    return jnp.where(mag < MIN_NORMAL_BITS, sub, y.astype(jnp.float64))


def tiny_up(x: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """`x * 2^64` exactly, for finite `|x| < 2^64`: a subnormal `x = m * 2^-149` is read
    from its bits (as `m * 2^-85`), a normal one has 64 added to its exponent. (Any other
    `x` gives garbage: mask it.)"""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    mag = bits & 0x7FFFFFFF
    sub = mag < MIN_NORMAL_BITS
    m = mag.astype(jnp.float32)  # the 23-bit field of a subnormal, exactly
    up_sub = jnp.where(mag == 0, 0.0, ldexp_normal(jnp.where(mag == 0, 1.0, m), TINY_SHIFT - 149))
    up = jnp.where(sub, up_sub, ldexp_normal(jnp.where(sub, 1.0, x), TINY_SHIFT))
    return from_bits(jax.lax.bitcast_convert_type(up, jnp.int32) | (bits & _SIGN))


def tiny_down(y: Float[Array, "*s"], err: Float[Array, "*s"] | None = None) -> Float[Array, "*s"]:
    """`(y + err) * 2^-64` rounded once to float32 (to nearest, ties to even), for a
    finite `y` that is 0 or normal and `|y| < 2^62`; `err` (default 0) is an exact
    remainder below half an ulp of `y` (such as `two_product`'s), which decides ties.

    A result of at least 2^-126 is `y * 2^-64` (exact); below, the subnormal's 23-bit
    field is `|y| * 2^85` (exact, < 2^23) rounded to an integer, and built from bits.
    """
    y = y.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(y, jnp.int32)
    a = from_bits(bits & 0x7FFFFFFF)
    normal = abs_bits(a) >= MIN_NORMAL_BITS + (TINY_SHIFT << 23)  # a * 2^-64 >= 2^-126
    down = ldexp_normal(jnp.where(normal, a, 1.0), -TINY_SHIFT)
    zero = abs_bits(a) < MIN_NORMAL_BITS  # (0; `y` is never subnormal here)
    field = ldexp_normal(jnp.where(zero | normal, 1.0, a), 149 - TINY_SHIFT)
    if err is None:
        n = jnp.round(field)  # half to even
    else:  # a tie broken by the sign of the remainder (of |y|)
        n = round_with_remainder(field, jnp.where(bits < 0, -err, err))
    sub = from_bits(jnp.where(zero | normal, 0, n.astype(jnp.int32)))
    mag = jnp.where(normal, down, sub)
    return from_bits(jax.lax.bitcast_convert_type(mag, jnp.int32) | (bits & _SIGN))


def mul_tiny(a: Float[Array, "*s"], c: float) -> Float[Array, "*s"]:
    """The IEEE float32 product `a * c` for finite `0 <= a < 2^-64` (subnormal `a`
    included) and a positive normal constant `c <= 1`, subnormal results included.

    `a * 2^64` (exact) times `c` is rounded in the normal range (`p`), its exact
    remainder found by Dekker's product of 12-bit halves (every partial product exact;
    Ogita, Rump and Oishi's TwoProduct), and `tiny_down` rounds `p` back once, the
    remainder breaking a tie.
    """
    ap = tiny_up(a)
    c32 = np.float32(c)
    p = ap * c32
    ah, al = split_12(ap)
    ch = np.asarray(np.asarray(c32).view(np.int32) & np.int32(~0xFFF)).view(np.float32)[()]
    cl = np.float32(c32 - ch)
    err = al * cl - (((p - ah * ch) - al * ch) - ah * cl)
    return tiny_down(p, err)
