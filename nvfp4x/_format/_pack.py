"""Two E2M1 codes per byte: element `2i` in the low nibble, `2i+1` in the high nibble."""

import jax.numpy as jnp
from jaxtyping import Array, UInt8


def pack(codes: UInt8[Array, "*lead k"]) -> UInt8[Array, "*lead k//2"]:
    """Pack 4-bit codes (even last axis) two per byte."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack(packed: UInt8[Array, "*lead h"]) -> UInt8[Array, "*lead h*2"]:
    """Inverse of `pack`."""
    lo = packed & 0x0F
    hi = packed >> 4
    return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
