"""The NVFP4 quantiser of spec §2–3, in plain `jax.numpy` (the reference path).

Everything is float32, in the order the spec writes it, with IEEE subnormals: the steps
where an operand or a result can fall below 2^-126 (tiny tensors, whose tensor scale
`s_dec` is then subnormal or nearly so, and subnormal inputs) go through `_ieee`, so the
bits do not depend on whether the device flushes subnormals (XLA on CPU does). The
functions here work on arrays whose blocked axes are already padded to multiples of 16.
"""

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from . import _e2m1
from ._bits import widen
from ._constants import (
    BLOCK,
    E2M1_MAX,
    E4M3_MAX,
    E4M3_MIN_NORMAL,
    FLT_MAX,
    INV_E2M1_MAX,
    NVFP4_RANGE,
)
from ._e4m3 import round_e4m3
from ._ieee import (
    INF_BITS,
    MIN_NORMAL_BITS,
    abs_bits,
    constant_over,
    from_bits,
    is_tiny_scale,
    is_zero,
    ldexp_normal,
    mul_exact,
    mul_normal,
    reciprocal_capped,
    reciprocal_of_normal,
    scale_down_149,
)

Block = tuple[int, int]
Rounding = Literal["nearest", "stochastic"]
ScaleRounding = Literal["nearest", "up"]
ROUNDINGS: tuple[str, ...] = ("nearest", "stochastic")
#: How a block scale is rounded to E4M3: `"nearest"` is the spec's (Blackwell's) rule;
#: `"up"` takes the smallest E4M3 scale with which no element of the block exceeds 6.
SCALE_ROUNDINGS: tuple[str, ...] = ("nearest", "up")


def tensor_amax(x: Float[Array, "..."]) -> Float[Array, ""]:
    """`max(|x|)` over the whole array, ignoring NaN (as CUDA's `fmaxf` does, so one NaN
    poisons only its own block). An infinity counts.

    A float max reads subnormals as 0 on a device that flushes them, but is exact when
    the maximum is normal; only when it comes out below 2^-126 is the maximum taken
    again over the bits (an int32 max over a whole array is ~15x slower on XLA:CPU).
    """
    a = jnp.abs(widen(x))
    m = jnp.max(jnp.where(jnp.isnan(a), 0.0, a), initial=0.0)
    return jax.lax.cond(abs_bits(m) < MIN_NORMAL_BITS, _amax_of_bits, _second, x, m)


# Branches of `lax.cond` are module-level functions taking their operands, never fresh
# lambdas or closures: `cond` caches its traced branches by function identity, and an
# eager (un-jitted) call compiles a cond again for every new branch function (~0.1 s).


def amax_of_bits(x: Float[Array, "..."]) -> Float[Array, ""]:
    """`max(|x|)` ignoring NaN, as an int32 max over the bits of `|x|`: exact for
    subnormals on any device (the GPU kernels' tensor amax; `tensor_amax`'s second
    pass where the float max is below 2^-126)."""
    b = abs_bits(x)
    return from_bits(jnp.max(jnp.where(b > INF_BITS, 0, b), initial=0))


def _amax_of_bits(x: Float[Array, "..."], m: Float[Array, ""]) -> Float[Array, ""]:
    return amax_of_bits(x)


def _second(x, m):
    return m


def encode_scale(amax: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """`S_enc = min(2688 / amax, FLT_MAX)`, and 1 for a zero or infinite `amax`; the
    division correctly rounded on every backend (`divide`'s bits, by `constant_over`).

    A subnormal `amax` gives FLT_MAX (2688 / amax > 2^137 overflows), whether or not the
    device reads it as 0; the tests are on the bits, so a subnormal is not mistaken for
    0 on a device that flushes subnormals. A negative `amax` (-0.0 and -inf included)
    gives 1, as its quotient is not positive; NaN gives NaN. Only a positive normal
    `amax` is divided, and its quotient is normal (at least 2688 / FLT_MAX) or overflows.
    """
    amax = jnp.asarray(amax, jnp.float32)
    bits = jax.lax.bitcast_convert_type(amax, jnp.int32)  # negative for a set sign bit
    normal = (bits >= MIN_NORMAL_BITS) & (bits < INF_BITS)
    q = constant_over(NVFP4_RANGE, jnp.where(normal, amax, 1.0))
    q = jnp.where(normal, q, jnp.where((bits > 0) & (bits < MIN_NORMAL_BITS), jnp.inf, 1.0))
    return jnp.minimum(jnp.where(jnp.isnan(amax), jnp.float32(jnp.nan), q), FLT_MAX)


def tensor_scales(amax: Float[Array, ""]) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """`(S_enc, s_dec)` of a tensor with the given amax; `s_dec = 1 / S_enc` is subnormal
    when `S_enc > 2^126` (amax below about 3.2e-35). Both quotients are exact on every
    backend (`constant_over`, `reciprocal_of_normal`: `S_enc` is normal or NaN).

    The two scalars are materialised (`_materialize`, on their bits), so that XLA computes them once
    rather than once per block or element of the loops it would otherwise fuse their
    few dozen integer operations into (an optimisation barrier is dropped before fusion
    on XLA:CPU; a `lax.cond` to skip the exact path would cost two more computations for
    XLA to compile in every quantisation).
    """
    s_enc, s_dec = tensor_scale_values(amax)
    # Materialised as bits: a float max reads a subnormal `s_dec` as 0 on XLA:CPU.
    bits = [jax.lax.bitcast_convert_type(v, jnp.int32) for v in (s_enc, s_dec)]
    s_enc, s_dec = _materialize(*bits)
    return from_bits(s_enc), from_bits(s_dec)


def tensor_scale_values(amax: Float[Array, "*s"]) -> tuple[Float[Array, "*s"], Float[Array, "*s"]]:
    """`tensor_scales`' two quantities, elementwise and not materialised (a kernel's
    prologue, `_kernels._tpu_quantize`, computes them on a vector of one amax)."""
    s_enc = encode_scale(amax)
    return s_enc, reciprocal_of_normal(s_enc)


def _block_scales(
    bamax: Float[Array, "*g"],
    s_enc: Float[Array, ""],
    s_dec: Float[Array, ""],
    scale_rounding: ScaleRounding = "nearest",
) -> tuple[Float[Array, "*g"], Float[Array, "*g"], Float[Array, "*g"]]:
    """`(scale_b, inv_b, inv_b * 2^-149)` from the block maxima (see `mul_normal` for
    the last: it lets a subnormal `x_i` be scaled exactly).

    A subnormal `bamax` is read exactly (`mul_normal`); a product below 2^-103, where
    `mul_normal` is inexact, rounds to a zero E4M3 scale whatever its exact value. For a
    tiny tensor (`s_dec < 2^-64`),
    `scale_b * s_dec` may be subnormal: it is rounded exactly, then inverted
    (`mul_exact`, `reciprocal_capped`); otherwise it is at least 2^-73, and the same two
    functions give the plain float32 product and `min(1 / p, FLT_MAX)` (no `lax.cond`
    between an exact and a plain path: two more computations per quantisation for XLA
    to compile, to save a few dozen ops per block). The results go through a
    reduction (`_materialize`), so that XLA does not fuse these per-block steps into the
    element loops and redo them for every element. `scale_rounding="up"`: see
    `_block_scales_up`.
    """
    if scale_rounding not in SCALE_ROUNDINGS:
        raise ValueError(
            f"`scale_rounding={scale_rounding!r}` is unknown; use one of {SCALE_ROUNDINGS}."
        )
    # XLA:CPU vectorises a loop along its minor axis: a grid whose minor axis holds a
    # few blocks (a few channels per token) is computed with that axis first (moved,
    # not reshaped: a reshape would merge axes that may be sharded differently).
    moved = bamax.ndim > 1 and bamax.shape[-1] < _MINOR_BLOCKS
    grid = jnp.moveaxis(bamax, -1, 0) if moved else bamax
    scales = _materialize(*_BLOCK_SCALES[scale_rounding](grid, s_enc, s_dec))
    scale_b, inv_b, inv_sub = (jnp.moveaxis(a, 0, -1) if moved else a for a in scales)
    return scale_b, inv_b, inv_sub


#: Block grids whose minor axis holds fewer blocks than this have their block scales
#: computed with that axis first (`_block_scales`).
_MINOR_BLOCKS = 8


def _materialize(*arrays: Array) -> tuple[Array, ...]:
    """The arrays, as the result of one variadic max-reduction over pairs `(a, lowest)`:
    XLA does not fuse a reduction into the loops that read its result, so they read
    these values once instead of recomputing them for every element (an optimisation
    barrier is removed before fusion on XLA:CPU; a `lax.cond` costs two more
    computations for XLA to compile)."""
    pairs = [jnp.stack([a, jnp.full_like(a, _lowest(a.dtype))], axis=-1) for a in arrays]
    inits = [jnp.array(_lowest(a.dtype), a.dtype) for a in arrays]
    return tuple(jax.lax.reduce(pairs, inits, _maxima, (arrays[0].ndim,)))


def _lowest(dtype) -> float | int:
    """The identity of `max` in `dtype`: -inf, or an integer type's minimum."""
    return -jnp.inf if jnp.issubdtype(dtype, jnp.floating) else int(jnp.iinfo(dtype).min)


def _block_scale_values(bamax, s_enc):
    scale_b = round_e4m3(jnp.minimum(mul_normal(bamax, s_enc * INV_E2M1_MAX), E4M3_MAX))
    return jnp.where(jnp.isfinite(bamax), scale_b, jnp.nan)


def _inverse_exact(scale_b, s_dec):
    return reciprocal_capped(mul_exact(scale_b, s_dec))


def _block_scales_exact(bamax, s_enc, s_dec):
    scale_b = _block_scale_values(bamax, s_enc)
    inv_b = _inverse_exact(scale_b, s_dec)
    return scale_b, inv_b, scale_down_149(inv_b)


# `scale_rounding="up"`. These E4M3 steps live here rather than in `_e4m3` because only
# this rule needs them; they take E4M3-range float32 values (`0 <= v <= 448`).

#: The smallest positive E4M3 value (subnormal), 2^-9.
_E4M3_MIN_SUBNORMAL = 2.0**-9
#: `1 - 2^-20`: the spec's float32 scale `bamax * (S_enc * f32(1/6))` is within a few
#: float32 ulps (2^-23) of the real `bamax / (6 s_dec)`; starting the search this far
#: below it never skips the smallest E4M3 scale that fits (see `_block_scales_up`).
_BELOW = 1.0 - 2.0**-20


def _ceil_e4m3(v: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """The smallest E4M3 value `>= v`, for `0 <= v <= 448`: normal range by rounding the
    float32 significand up to 3 bits on the bits, subnormal range (below 2^-6) to
    multiples of 2^-9. (A subnormal float32 `v` gives 0 on a device that flushes it;
    `_block_scales_up` asks for at least 2^-9 anyway.)"""
    normal = from_bits((abs_bits(v) + 0xFFFFF) & ~0xFFFFF)
    sub = jnp.ceil(v * 512.0) * (1.0 / 512.0)
    return jnp.where(v < E4M3_MIN_NORMAL, sub, jnp.minimum(normal, E4M3_MAX))


def _next_e4m3(s: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """The E4M3 value after `s` (an E4M3 value `>= 0`), saturating at 448."""
    normal = jnp.minimum(from_bits(abs_bits(s) + (1 << 20)), E4M3_MAX)
    return jnp.where(s < E4M3_MIN_NORMAL, s + _E4M3_MIN_SUBNORMAL, normal)


def _block_scales_up(bamax, s_enc, s_dec):
    """Block scales rounded up: the smallest E4M3 `scale_b <= 448` with which the
    block's largest element scales to at most 6 (`mul_normal(bamax, inv_b) <= 6`, the
    very product the element loops compute, and every other element's is at most that)
    and whose `inv_b` is not capped at FLT_MAX, so that nothing saturates, the element
    scaling is the inverse of the decoding, and stochastic rounding is unbiased. A zero
    block keeps a zero scale.

    Candidates: `lo`, the E4M3 ceiling of the spec's float32 scale lowered by 2^-20 (so
    a float32 rounding error above an E4M3 value does not cost a whole E4M3 step), at
    least 2^-9 (a block far below the tensor's amax is not flushed to zero, as the
    nearest rule does) and at least `2^-128 * S_enc` (below it `1 / (scale_b * s_dec)`
    exceeds FLT_MAX; above 2^-9 only for tensors with an amax below about 4e-33),
    and the E4M3 value after it. Both real bounds are within a few float32 ulps (2^-21
    where `s_dec` is subnormal) of their float32 estimates, so every scale below `lo`
    fails, and the next value (at least 1/16 above `lo`) fits. 448 is the cap: the
    block holding the tensor's amax has a real scale of 448 within float32 rounding, so
    there `|x| * inv_b` may exceed 6 by a few ulps (and by more only when the given
    `amax` is below the tensor's, or is infinite); it is then clamped, as with
    `"nearest"`. A block holding NaN or inf gets a NaN scale, as with `"nearest"`.
    """
    t = jnp.minimum(mul_normal(bamax, s_enc * INV_E2M1_MAX), E4M3_MAX)
    big = s_enc >= 2.0**100
    least = jnp.where(big, ldexp_normal(jnp.where(big, s_enc, 1.0), -128), _E4M3_MIN_SUBNORMAL)
    zero = is_zero(bamax)
    lo = jnp.where(zero, 0.0, _ceil_e4m3(jnp.maximum(t, least) * _BELOW))
    inv_lo = _inverse_exact(lo, s_dec)
    fits = zero | ((mul_normal(bamax, inv_lo) <= E2M1_MAX) & (inv_lo < FLT_MAX))
    hi = _next_e4m3(lo)
    finite = jnp.isfinite(bamax)
    scale_b = jnp.where(finite, jnp.where(fits, lo, hi), jnp.nan)
    inv_b = jnp.where(finite, jnp.where(fits, inv_lo, _inverse_exact(hi, s_dec)), jnp.nan)
    return scale_b, inv_b, scale_down_149(inv_b)


#: The block scales per scale rounding.
_BLOCK_SCALES = {"nearest": _block_scales_exact, "up": _block_scales_up}


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


def expand(scale: Array, block: Block) -> Array:
    """Broadcast a block grid against `to_blocks` output."""
    if block[0] == 1:
        return scale[..., None]
    return scale[..., :, None, :] if block[1] == 1 else scale[..., :, None, :, None]


def block_absmax(xp: Float[Array, "..."], block: Block) -> Float[Array, "..."]:
    """Per block, `max|x|` with NaN propagating (a block holding NaN gets NaN), on the
    padded array, in the shape of the block grid (`to_blocks` with the block axes gone).

    The maximum is taken over the bits of `|x|` as int32 (ordered as the magnitudes, NaN
    above inf): a float max reads subnormals as 0 on a device that flushes them. On
    XLA:CPU an int32 max over a minor axis of 16 is as fast as a float `reduce_window`
    for 1x16 blocks and ~10x faster for 16x16 and 16x1 ones (an int32 `reduce_window`
    is ~10x slower); 16x16 tiles reduce each row's 16 first, then 16 rows.
    """
    return from_bits(_block_max(block, abs_bits(xp))[0])


def block_maxima(
    xp: Float[Array, "..."], block: Block
) -> tuple[Float[Array, "..."], Float[Array, "..."]]:
    """`(block_absmax(xp, block), the same ignoring NaN)`, in one pass over `xp` (one
    variadic reduction): the second gives the tensor amax without a second pass over
    the array when some block holds a NaN."""
    bits = abs_bits(xp)
    out, ignoring_nan = _block_max(block, bits, jnp.where(bits > INF_BITS, 0, bits))
    return from_bits(out), from_bits(ignoring_nan)


def _block_max(block: Block, *bits: Array) -> list[Array]:
    """The int32 max of each of `bits` (same shape) per block, in one reduction."""

    def reduce(arrays, axis):
        zeros = [jnp.int32(0)] * len(arrays)
        return jax.lax.reduce(arrays, zeros, _maxima, (axis % arrays[0].ndim,))

    if block[0] == 1:
        return reduce([to_blocks(b, block) for b in bits], -1)
    *lead, r, c = bits[0].shape
    if block[1] == 1:
        return reduce([b.reshape(*lead, r // BLOCK, BLOCK, c) for b in bits], -2)
    rows = reduce([b.reshape(*lead, r, c // BLOCK, BLOCK) for b in bits], -1)
    return reduce([b.reshape(*lead, r // BLOCK, BLOCK, c // BLOCK) for b in rows], -2)


def _maxima(a, b):
    return [jax.lax.max(x, y) for x, y in zip(a, b, strict=True)]


def _amax_of_block_maxima(bamax: Float[Array, "..."]) -> Float[Array, ""]:
    """`tensor_amax(x)` from its block maxima ignoring NaN (`block_maxima`): one int32
    max over their bits (ordered as the magnitudes; exact for subnormals on a device
    that flushes them). Over the block grid, 1/16 of the array, an int32 max costs about
    what a float one does on XLA:CPU, and one reduction replaces the float maximum and
    its second, subnormal pass (two reductions, each split by XLA:CPU into a
    `reduce-window` and a `reduce`: four kernels more in every quantisation)."""
    return from_bits(jnp.max(abs_bits(bamax), initial=0))


def _prepare(
    xp: Float[Array, "..."],
    block: Block,
    amax: Float[Array, ""] | None,
    scale_rounding: ScaleRounding = "nearest",
):
    """Everything of §2 above the elements: `(xb, scale_b, inv_b, inv_sub, s_dec, tiny)`,
    `xb` the float32 `to_blocks` view, `inv_sub = inv_b * 2^-149` (for `mul_normal`),
    `tiny` whether `s_dec < 2^-64` (products with it may be subnormal)."""
    # The barrier keeps XLA from constant-folding the block reduction when `xp` is a
    # compile-time constant (a closed-over weight): its evaluator takes seconds on it.
    # It holds the input as given: the float32 cast after it fuses into each reader, so
    # a bfloat16 input is never copied to a float32 array in memory.
    xp = jax.lax.optimization_barrier(xp)
    xf = widen(xp)  # on the bits: bfloat16 and float16 subnormals kept
    if amax is None:
        bamax, ignoring_nan = block_maxima(xf, block)
        amax = _amax_of_block_maxima(ignoring_nan)
    else:
        bamax = block_absmax(xf, block)
    s_enc, s_dec = tensor_scales(amax)
    scale_b, inv_b, inv_sub = _block_scales(bamax, s_enc, s_dec, scale_rounding)
    return to_blocks(xf, block), scale_b, inv_b, inv_sub, s_dec, is_tiny_scale(s_dec)


def scale_blocks(
    xp: Float[Array, "..."],
    block: Block,
    amax: Float[Array, ""] | None,
    scale_rounding: ScaleRounding = "nearest",
) -> tuple[Float[Array, "..."], Float[Array, "..."], Float[Array, ""]]:
    """The scale part of §2 on a padded array, the block scales rounded as
    `scale_rounding` says (`"nearest"`: the spec's rule; `"up"`: see `_block_scales_up`).

    **Returns:** `(v, scale_b, s_dec)`: `v = x_i * inv_b` in the `to_blocks` view (ready
    for E2M1 rounding; a subnormal `x_i` is read exactly), the block scales (float32
    copies of E4M3 values; NaN for a block holding a non-finite value) and the float32
    tensor decode scale.
    """
    xb, scale_b, inv_b, inv_sub, s_dec, _ = _prepare(xp, block, amax, scale_rounding)
    return mul_normal(xb, expand(inv_b, block), expand(inv_sub, block)), scale_b, s_dec


def _round(
    v: Float[Array, "..."], rounding: Rounding, key: jax.Array | None
) -> Float[Array, "..."]:
    if rounding == "nearest":
        return _e2m1.round_nearest(v)
    if key is None:
        raise ValueError("`rounding='stochastic'` needs a PRNG key: pass `key=...`.")
    return _e2m1.round_stochastic(v, _e2m1.uniform(key, v.shape))


def quantize_blocks(
    xp: Float[Array, "..."],
    block: Block,
    rounding: Rounding,
    key: jax.Array | None,
    amax: Float[Array, ""] | None,
    scale_rounding: ScaleRounding = "nearest",
) -> tuple[Float[Array, "..."], Float[Array, "..."], Float[Array, ""]]:
    """Quantise a padded float32 array, the block scales rounded as `scale_rounding`
    says (see `scale_blocks`).

    **Returns:** `(q, scale_b, s_dec)`: `q` the E2M1 values (float32, on the grid, in the
    `to_blocks` view), `scale_b` the block scales (float32 copies of E4M3 values; NaN for
    a block holding a non-finite value), `s_dec` the float32 tensor decode scale.
    """
    v, scale_b, s_dec = scale_blocks(xp, block, amax, scale_rounding)
    return _round(v, rounding, key), scale_b, s_dec


def fake_quantize_blocks(
    xp: Float[Array, "..."],
    block: Block,
    rounding: Rounding,
    key: jax.Array | None,
    amax: Float[Array, ""] | None,
    scale_rounding: ScaleRounding = "nearest",
) -> Float[Array, "..."]:
    """Quantise and dequantise a padded float32 array in one per-element loop: the
    values `(e2m1_value * block_scale) * s_dec` of `quantize_blocks(...)`, in float32,
    back in the padded (unblocked) view. The block product is exact; its product with
    `s_dec` is the IEEE one even where that is subnormal.

    Only a tiny tensor (`s_dec < 2^-64`) can meet subnormal products: it takes the exact
    loop (`mul_normal`, `mul_exact`); the rest the plain one (a subnormal `x_i` then
    gives a code of 0 in a nonzero-scale block whatever it is read as, and any code
    decodes to 0 in a zero-scale block). The `cond` runs one loop, and is a `select`
    of both under `vmap`.
    """
    xb, scale_b, inv_b, inv_sub, s_dec, tiny = _prepare(xp, block, amax, scale_rounding)
    exact, plain = _fake_quantize_loops(block, rounding)
    return jax.lax.cond(tiny, exact, plain, xb, scale_b, inv_b, inv_sub, s_dec, key)


@functools.cache
def _fake_quantize_loops(block: Block, rounding: Rounding):
    """The two per-element loops of `fake_quantize_blocks` (cached: see `_second`)."""

    def loop(exact, xb, scale_b, inv_b, inv_sub, s_dec, key):
        if exact:
            v = mul_normal(xb, expand(inv_b, block), expand(inv_sub, block))
        else:
            v = xb * expand(inv_b, block)
        p = _round(v, rounding, key) * expand(scale_b, block)
        return from_blocks(mul_exact(p, s_dec) if exact else p * s_dec, block)

    return functools.partial(loop, True), functools.partial(loop, False)
