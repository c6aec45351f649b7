"""Two E2M1 codes per byte: element `2i` in the low nibble, `2i+1` in the high nibble."""

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, UInt8

from ._bits import (
    decode_e4m3 as decode_e4m3,  # (its home; the kernels read it here)
    widen,
)


def pack(codes: UInt8[Array, "*lead k"]) -> UInt8[Array, "*lead k//2"]:
    """Pack 4-bit codes (even last axis) two per byte.

    Each pair is read as one little-endian uint16 (`lo | hi << 8`) and folded to
    `lo | hi << 4`: one contiguous read per pair. (Selecting the even and odd elements
    instead makes XLA:CPU fuse the whole quantiser into two strided loops, ~3x slower.)
    """
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    word = lax.bitcast_convert_type(pairs, jnp.uint16)
    return ((word & 0x0F) | ((word >> 4) & 0xF0)).astype(jnp.uint8)


def unpack(packed: UInt8[Array, "*lead h"]) -> UInt8[Array, "*lead h*2"]:
    """Inverse of `pack`."""
    lo = packed & 0x0F
    hi = packed >> 4
    return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


#: `nibble_values` gives E2M1 values times `2^-14`.
NIBBLE_SCALE = 2.0**-14


def nibble_values(packed: UInt8[Array, "*s"]) -> tuple[Float[Array, "*s"], Float[Array, "*s"]]:
    """The E2M1 values of each byte's low and high nibble (elements `2i` and `2i+1`),
    times `NIBBLE_SCALE` (`2^-14`, exactly), as float32, for callers that fold `2^14`
    into a scale of their own (the frozen GEMM folds it into the block scales).

    Without a table (a gather), so that it vectorises: E2M1 is a float16 with two
    exponent bits, so a code's bits placed in a float16 (`s e1 e0 m` as the sign, the
    exponent's two low bits and the mantissa's top bit) are its value times `2^-14`,
    subnormals (code 1: 0.5, the float16 2^-15) included, widened to float32 on the
    bits (`widen`: a TPU's `convert` may read a float16 subnormal as 0).
    """
    b = packed.astype(jnp.uint16)
    lo = ((b << 9) & 0x0E00) | ((b << 12) & 0x8000)
    hi = ((b << 5) & 0x0E00) | ((b << 8) & 0x8000)
    value = lambda bits: widen(lax.bitcast_convert_type(bits, jnp.float16))
    return value(lo), value(hi)
