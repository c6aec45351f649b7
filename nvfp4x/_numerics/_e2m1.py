"""FP4 E2M1 element rounding, codes and decoding, on float32 arrays.

Rounding works on the E2M1 grid directly: between 0 and 2 the grid step is 0.5, between
2 and 4 it is 1, between 4 and 6 it is 2. Scaling by a power of two is exact, so
`round_half_even(a / step) * step` is exact round-to-nearest-even on the grid (every tie
lands on the value with an even code).
"""

from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, UInt8

from ._constants import E2M1_MAX, GOLDEN_RATIO_32
from ._threefry import seed_words


def _step(a: Float[Array, "*s"]) -> Float[Array, "*s"]:
    return jnp.where(a < 2.0, 0.5, jnp.where(a < 4.0, 1.0, 2.0)).astype(jnp.float32)


def encode_nearest(v: Float[Array, "*s"]) -> UInt8[Array, "*s"]:
    """The code of the nearest E2M1 value (ties to even), saturating at ±6.

    From 1 up, the E2M1 grid is float32 with one mantissa bit, so `reduce_precision`
    rounds there (ties to the even code), and the code is the exponent and that bit:
    `(bits >> 22) - 252` (1.0 gives 2, 6.0 gives 7; 8.0, from anything at least 7,
    clamps to 7). Below 1 the step is 0.5: the code is `round(2|v|)`. NaN gets code 0
    or 8 (its block scale is NaN anyway). Equal, code for code, to seven comparisons
    against the midpoints (`>` at 0.25, 1.25, 2.5, 5 and `>=` at 0.75, 1.75, 3.5), in
    fewer operations.
    """
    v = v.astype(jnp.float32)
    a = jnp.abs(v)
    big = jax.lax.reduce_precision(jnp.minimum(a, 7.0), exponent_bits=8, mantissa_bits=1)
    high = jnp.minimum((jax.lax.bitcast_convert_type(big, jnp.int32) >> 22) - 252, 7)
    mag = jnp.where(a < 1.0, jnp.round(a * 2.0).astype(jnp.int32), high)
    mag = jnp.where(jnp.isnan(v), 0, mag).astype(jnp.uint8)
    sign = (jax.lax.bitcast_convert_type(v, jnp.uint32) >> 28) & 8
    return mag | sign.astype(jnp.uint8)


def round_nearest(v: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """Round to the nearest E2M1 value (ties to even), saturating at ±6, as float32:
    `decode(encode_nearest(v))`, bit for bit (NaN gives ±0, with `v`'s sign).

    From 1 up, the E2M1 grid is float32 with one mantissa bit (1, 1.5, 2, 3, 4, 6), so
    `reduce_precision` rounds there, ties to the even code; below 1 the step is 0.5.
    A dozen operations per element where the codes take thirty.
    """
    a = jnp.abs(v)
    big = jax.lax.reduce_precision(jnp.minimum(a, 7.0), exponent_bits=8, mantissa_bits=1)
    q = jnp.where(a < 1.0, jnp.round(a * 2.0) * 0.5, jnp.minimum(big, E2M1_MAX))
    return jnp.copysign(jnp.where(jnp.isnan(v), 0.0, q), v)


def round_stochastic(v: Float[Array, "*s"], u: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """Round to one of the two neighbouring E2M1 values, up with probability equal to the
    position of `|v|` between them, using uniform samples `u` in [0, 1). Saturates at ±6.

    `E[round_stochastic(v, U)] == v` for `|v| <= 6`.
    """
    a = jnp.minimum(jnp.abs(v), E2M1_MAX)
    step = _step(a)
    inv_step = jnp.where(a < 2.0, 2.0, jnp.where(a < 4.0, 1.0, 0.5)).astype(jnp.float32)
    lo = jnp.floor(a * inv_step) * step
    p = (a - lo) * inv_step
    q = jnp.where(u < p, lo + step, lo)
    q = jnp.where(jnp.isnan(v), v, q)
    return jnp.copysign(q, v)


def encode(q: Float[Array, "*s"]) -> UInt8[Array, "*s"]:
    """The 4-bit code (0..15) of a value already on the E2M1 grid. NaN gets code 0."""
    a = jnp.abs(q)
    mag = jnp.where(a <= 2.0, 2.0 * a, jnp.minimum(a + 2.0, 7.0))
    mag = jnp.where(jnp.isnan(q), 0.0, mag).astype(jnp.uint8)
    sign = jnp.where(jnp.signbit(q) & ~jnp.isnan(q), 8, 0).astype(jnp.uint8)
    return mag | sign


def decode(code: UInt8[Array, "*s"]) -> Float[Array, "*s"]:
    """The float32 value of 4-bit E2M1 codes."""
    m = (code & 7).astype(jnp.float32)
    mag = jnp.where(m <= 4.0, 0.5 * m, jnp.where(m == 7.0, 6.0, m - 2.0))
    return jnp.where((code & 8) != 0, -mag, mag)


#: uint32 words, of jax (stochastic rounding) or NumPy (checkpoint checksums).
_Words = TypeVar("_Words", Array, np.ndarray)


def _fmix32(h: _Words) -> _Words:
    """MurmurHash3's 32-bit finaliser: a bijective, well-mixing integer hash, on uint32
    jax or NumPy arrays (stochastic rounding's samples and checkpoint checksums)."""
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def uniform(key: jax.Array, shape: tuple[int, ...], offset: ArrayLike = 0) -> Float[Array, "..."]:
    """Uniform samples in (0, 1) for stochastic rounding: `(r + 1/2) / 2^16` with `r` 16
    bits of a counter-based hash of (element index, key).

    Two words drawn from `key` seed a MurmurHash3 finaliser applied to each element's
    flat index. Unlike drawing from `jax.random` per element (whose threefry rounds cost
    more than the rest of stochastic rounding on a CPU), the hash fuses into the rounding
    loop; like it, the samples depend only on the key and the element's position, so
    they are reproducible for a key and identical under any sharding. The probability of
    rounding up differs from the exact position by less than 2^-16.

    `offset` is added to every flat index (modulo 2^32): a piece of a larger array,
    starting at flat index `offset` of it, draws what the larger array draws there (the
    grouped GEMM quantises each group's rows with its group's key and their positions
    in the group).
    """
    seed = seed_words(key)  # `jax.random.bits(key, (2,), jnp.uint32)`, unrolled
    index = jnp.zeros(shape, jnp.uint32) + jnp.asarray(offset).astype(jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride)
        stride = (stride * shape[axis]) % 2**32
    h = _fmix32(index * jnp.uint32(GOLDEN_RATIO_32) + seed[0])
    h = _fmix32(h ^ seed[1])
    return ((h >> 16).astype(jnp.float32) + 0.5) * (1.0 / 65536.0)
