"""The NVFP4 quantiser of spec §2–3, in plain `jax.numpy` (the reference path).

Everything is float32, in the order the spec writes it. The functions here work on
arrays whose blocked axes are already padded to multiples of 16.
"""

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from . import _e2m1
from ._constants import BLOCK, FLT_MAX, INV_E2M1_MAX, NVFP4_RANGE
from ._e4m3 import round_e4m3

Block = tuple[int, int]
Rounding = Literal["nearest", "stochastic"]
BLOCKS: tuple[Block, ...] = ((1, BLOCK), (BLOCK, BLOCK))
ROUNDINGS: tuple[str, ...] = ("nearest", "stochastic")


def tensor_amax(x: Float[Array, "..."]) -> Float[Array, ""]:
    """`max(|x|)` over the whole array, ignoring NaN (as CUDA's `fmaxf` does, so one NaN
    poisons only its own block). An infinity counts."""
    a = jnp.abs(x.astype(jnp.float32))
    return jnp.max(jnp.where(jnp.isnan(a), 0.0, a), initial=0.0)


def encode_scale(amax: Float[Array, ""]) -> Float[Array, ""]:
    """`S_enc = min(2688 / amax, FLT_MAX)`, and 1 for a zero or infinite `amax`."""
    amax = jnp.asarray(amax, jnp.float32)
    s_enc = jnp.minimum(NVFP4_RANGE / amax, FLT_MAX)
    return jnp.where((amax == 0.0) | (s_enc == 0.0), jnp.float32(1.0), s_enc)


def pad_to_blocks(x: Array, block: Block) -> Array:
    """Zero-pad the blocked axes of `x` to multiples of 16."""
    pads = [(0, 0)] * x.ndim
    if block[1] == BLOCK:
        pads[-1] = (0, -x.shape[-1] % BLOCK)
    if block[0] == BLOCK:
        pads[-2] = (0, -x.shape[-2] % BLOCK)
    if any(p[1] for p in pads):
        x = jnp.pad(x, pads)
    return x


def to_blocks(x: Array, block: Block) -> Array:
    """View a padded array as blocks: `(..., K/16, 16)` for 1x16, `(..., R/16, 16, C/16, 16)`
    for 16x16, and `(..., R/16, 16, C)` for 16x1 (blocks down the columns: the internal
    layout of operands quantised along their leading axis, such as wgrad's tokens)."""
    *lead, c = x.shape
    if block[0] == 1:
        return x.reshape(*lead, c // BLOCK, BLOCK)
    *lead, r = lead
    if block[1] == 1:
        return x.reshape(*lead, r // BLOCK, BLOCK, c)
    return x.reshape(*lead, r // BLOCK, BLOCK, c // BLOCK, BLOCK)


def from_blocks(xb: Array, block: Block) -> Array:
    """Inverse of `to_blocks`."""
    if block[0] == 1:
        return xb.reshape(*xb.shape[:-2], xb.shape[-2] * BLOCK)
    if block[1] == 1:
        *lead, r, _, c = xb.shape
        return xb.reshape(*lead, r * BLOCK, c)
    *lead, r, _, c, _ = xb.shape
    return xb.reshape(*lead, r * BLOCK, c * BLOCK)


def _expand(scale: Array, block: Block) -> Array:
    """Broadcast a block grid against `to_blocks` output."""
    if block[0] == 1:
        return scale[..., None]
    return scale[..., :, None, :] if block[1] == 1 else scale[..., :, None, :, None]


def block_absmax(xp: Float[Array, "..."], block: Block) -> Float[Array, "..."]:
    """Per block, `max|x|` with NaN propagating (a block holding NaN gets NaN), on the
    padded array, in the shape of the block grid (`to_blocks` with the block axes gone).

    A `reduce_window` rather than a reduction over the `to_blocks` view: XLA:CPU
    vectorises it about 9x better than a reduction over a minor axis of 16."""
    window = (1,) * (xp.ndim - 1) + (BLOCK,) if block[0] == 1 else (1,) * (xp.ndim - 2) + block
    return jax.lax.reduce_window(jnp.abs(xp), np.float32(0.0), jax.lax.max, window, window, "VALID")


def _amax_given_blocks(x: Float[Array, "..."], bamax: Float[Array, "..."]) -> Float[Array, ""]:
    """`tensor_amax(x)`, from the block maxima when no block holds a NaN (the common case:
    XLA:CPU's NaN-ignoring reduction over the whole array is ~8x slower). The max of the
    block maxima propagates NaN, so it is also the test: one reduction (one all-reduce
    when sharded) in the common case."""
    m = jnp.max(bamax, initial=0.0)
    return jax.lax.cond(jnp.isnan(m), lambda: tensor_amax(x), lambda: m)


def scale_blocks(
    xp: Float[Array, "..."], block: Block, amax: Float[Array, ""] | None
) -> tuple[Float[Array, "..."], Float[Array, "..."], Float[Array, ""]]:
    """The scale part of §2 on a padded array.

    **Returns:** `(v, scale_b, s_dec)`: `v = x_i * inv_b` in the `to_blocks` view (ready
    for E2M1 rounding), the block scales (float32 copies of E4M3 values; NaN for a block
    holding a non-finite value) and the float32 tensor decode scale.
    """
    # The barrier keeps XLA from constant-folding the block reduction when `xp` is a
    # compile-time constant (a closed-over weight): its evaluator takes seconds on it.
    xf = jax.lax.optimization_barrier(xp.astype(jnp.float32))
    bamax = block_absmax(xf, block)
    if amax is None:
        amax = _amax_given_blocks(xf, bamax)
    xb = to_blocks(xf, block)
    s_enc = encode_scale(amax)
    s_dec = 1.0 / s_enc
    scale_b = round_e4m3(jnp.minimum(bamax * (s_enc * INV_E2M1_MAX), 448.0))
    scale_b = jnp.where(jnp.isfinite(bamax), scale_b, jnp.nan)
    inv_b = jnp.minimum(1.0 / (scale_b * s_dec), FLT_MAX)
    return xb * _expand(inv_b, block), scale_b, s_dec


def quantize_blocks(
    xp: Float[Array, "..."],
    block: Block,
    rounding: Rounding,
    key: jax.Array | None,
    amax: Float[Array, ""] | None,
) -> tuple[Float[Array, "..."], Float[Array, "..."], Float[Array, ""]]:
    """Quantise a padded float32 array.

    **Returns:** `(q, scale_b, s_dec)`: `q` the E2M1 values (float32, on the grid, in the
    `to_blocks` view), `scale_b` the block scales (float32 copies of E4M3 values; NaN for
    a block holding a non-finite value), `s_dec` the float32 tensor decode scale.
    """
    v, scale_b, s_dec = scale_blocks(xp, block, amax)
    if rounding == "nearest":
        q = _e2m1.round_nearest(v)
    else:
        if key is None:
            raise ValueError("`rounding='stochastic'` needs a PRNG key: pass `key=...`.")
        q = _e2m1.round_stochastic(v, _e2m1.uniform(key, v.shape))
    return q, scale_b, s_dec


def dequantize_blocks(
    q: Float[Array, "..."], scale_b: Float[Array, "..."], s_dec: Float[Array, ""], block: Block
) -> Float[Array, "..."]:
    """`(e2m1_value * block_scale) * s_dec` in float32, back in the padded (unblocked) view."""
    return from_blocks((q * _expand(scale_b, block)) * s_dec, block)
