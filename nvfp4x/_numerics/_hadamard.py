"""The random Hadamard transform of spec §4: `H = diag(s) @ H16 / 4` on 16-row chunks."""

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ._constants import BLOCK, RHT_SIGNS
from ._ieee import INF_BITS, abs_bits
from ._subnormal import tiny_down, tiny_up, to_float32

#: Chunk columns whose largest magnitude reaches this (2^124) are transformed scaled by
#: `_RANGE_SHIFT`: otherwise a float32 partial sum of 16 terms of up to `max/4` each may
#: overflow (up to `4 max`) although the result is finite.
_BIG_BITS = (127 + 124) << 23
#: The power of two by which such columns are scaled down, then their results up again.
_RANGE_SHIFT = 2.0**-4
#: Chunk columns whose largest magnitude is below this (2^-100) are transformed scaled up
#: by 2^`TINY_SHIFT` (`_subnormal`): otherwise a device that flushes subnormals
#: (XLA:CPU) reads them, and the results below 2^-126, as zero.
_TINY_BITS = (127 - 100) << 23
#: Scaled results of big columns from this magnitude are computed again exactly: 2^123
#: less 64 units in the last place below it (2^-18 of it), more than the butterflies'
#: float32 error there (at most 2^-20 of a column's scaled amax, below 2^124), so that
#: every result whose exact value reaches 2^123 (2^127 scaled back) is among them.
_NEAR_MAX_BITS = ((127 + 123) << 23) - 64


def hadamard_matrix(signs: tuple[int, ...] = RHT_SIGNS) -> np.ndarray:
    """The 16x16 orthogonal matrix `diag(signs) @ H16 / 4` (float32), with `H16` the
    Sylvester Hadamard matrix of order 16.

    **Arguments:**

    - `signs`: 16 values of +1 or -1 on the diagonal; by default the fixed signs that
      [`nvfp4x.rht`][] uses (the same in every call, on every device).

    **Returns:** a float32 NumPy array of shape `(16, 16)`, `h @ h.T == I`.

    **Raises:** `ValueError` unless `signs` holds 16 values, each +1 or -1.

    ```python
    h = nvfp4x.hadamard_matrix()
    np.allclose(h @ h.T, np.eye(16))   # True
    ```
    """
    s = np.asarray(signs)
    if s.shape != (BLOCK,) or not np.isin(s, (1, -1)).all():
        raise ValueError(f"`signs` must be {BLOCK} values of +1 or -1, got {signs!r}.")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < BLOCK:
        h = np.block([[h, h], [h, -h]])
    return (np.asarray(signs, np.float32)[:, None] * h / 4.0).astype(np.float32)


def rht(
    x: Float[Array, "..."],
    axis: int = 0,
    unguarded: Callable[[Array, Array], Array] | None = None,
    guarded: Callable[[Array, Array], Array] | None = None,
) -> Float[Array, "..."]:
    """`nvfp4x.rht` on a float array and a valid axis, without input checks (its callers:
    `nvfp4x.rht`, which checks them, and the GEMMs, whose operands are checked already);
    see `nvfp4x.rht` (`_rht.py`) for what it computes. `unguarded`: the branch where no
    chunk column needs scaling, `(chunks, amax_bits) -> _plain(chunks)` bit for bit (a
    kernel's, picked in `nvfp4x._kernels`); default `_unguarded`. `guarded`: the other
    branch, `_guarded` bit for bit (default `_guarded`). Module-level functions, so that
    `lax.cond` reuses their traced branches."""
    x = padded_rows(jnp.moveaxis(x, axis % x.ndim, 0))
    chunks, amax_bits = _chunk_columns(x)
    # Where no chunk column is big (or non-finite) or tiny but not zero, the scalings
    # below leave every value as it is: the product alone, skipping their work (one
    # `cond` on that path, as the other has one for `near_max`).
    special = special_columns(amax_bits)
    unguarded = _unguarded if unguarded is None else unguarded
    guarded = _guarded if guarded is None else guarded
    y = jax.lax.cond(jnp.any(special), guarded, unguarded, chunks, amax_bits)
    y = y.reshape(x.shape)
    return jnp.moveaxis(y, 0, axis)


def rht_scaled(x: Float[Array, "r m"]) -> Float[Array, "r m"]:
    """`rht(x, axis=0)` of a float32 `x` of whole chunks of rows (`padded_rows`), every
    chunk by `_guarded`: the same bits (it transforms the columns that need no scaling as
    `_plain` does), without `rht`'s `cond`, for callers that know a column needs the
    scaling (the other branch of the fused TPU operand, `_kernels.rht_operand`), so that
    only this branch is compiled there."""
    return _guarded(*_chunk_columns(x)).reshape(x.shape)


def _chunk_columns(x: Float[Array, "r ..."]) -> tuple[Float[Array, "c 16 m"], Array]:
    """`(chunks, amax_bits)` of `padded_rows`' result: its chunks of 16 rows `(c, 16, m)`
    (times H: one small batched product, no transposes) and each chunk column's largest
    `abs_bits` `(c, 1, m)`, which decide its scaling (`special_columns`)."""
    chunks = x.reshape(x.shape[0] // BLOCK, BLOCK, math.prod(x.shape[1:]))
    return chunks, jnp.max(abs_bits(chunks), axis=1, keepdims=True, initial=0)


def padded_rows(x: Array) -> Float[Array, "..."]:
    """`x` in float32 (`to_float32`: subnormals read exactly), its leading axis padded
    with zeros to whole chunks of 16: what `rht` transforms along that axis (the fused
    TPU operand of `_kernels.rht_operand` too)."""
    x = to_float32(x)
    if pad := -x.shape[0] % BLOCK:
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    return x


def special_columns(amax_bits: Array) -> Array:
    """Where a chunk column whose largest `abs_bits` is `amax_bits` needs `_guarded`'s
    scaling: big (from 2^124), non-finite, or tiny (below 2^-100) but not zero."""
    return (amax_bits >= _BIG_BITS) | ((amax_bits < _TINY_BITS) & (amax_bits > 0))


# Branches of `lax.cond`: module-level functions (`cond` caches traced branches by identity).


def _plain(chunks: Array) -> Array:
    """`H` times each chunk (no column big, non-finite or tiny but nonzero: an all-zero
    column's results are the same signed zeros `_guarded`'s scalings give), as the
    16-point fast Walsh-Hadamard transform in float32 elementwise operations, so the
    order of every sum is defined and the same on every backend (a dot's is the
    backend's: XLA:CPU's, a GPU's autotuned algorithm, a TPU's bfloat16 passes): the
    chunk times 1/4 (exact but for elements below 2^-124, at most 2^-24 of their
    column's largest, whose quarters are subnormal: flushed to zero where the device
    flushes subnormals, as XLA:CPU and TPUs do), four butterfly stages `a + b`, `a - b`
    over rows `j` and `j + 2^s` (s = 0..3: two per pass over the data), then times the
    signs (exact). Each output is the pairwise sum, in that tree, of its 16 terms
    `±x_j / 4`. (All four stages as one fused pass, each `partner + sign * row` with the
    row pairs reversed, has half the instructions and the same bits, but XLA:CPU
    recomputes each output's 16 reads in it: 2.2x slower on a depthwise `Conv1d`'s
    wgrad, whose chunks have few columns.)"""
    c, _, m = chunks.shape
    y = chunks * np.float32(0.25)
    for half in (1, 4):  # two stages a pass: rows j, j + half, j + 2 half, j + 3 half
        v = y.reshape(c, BLOCK // (4 * half), 4, half, m)
        a, b, d, e = (v[:, :, i] for i in range(4))
        s0, d0, s1, d1 = a + b, a - b, d + e, d - e
        parts = [s0 + s1, d0 + d1, s0 - s1, d0 - d1]
        if half == 4:  # the last pass: part i holds rows 4i..4i+3
            signs = np.asarray(RHT_SIGNS, np.float32).reshape(4, 1, 4, 1)
            parts = [p * jnp.asarray(signs[i]) for i, p in enumerate(parts)]
        y = jnp.stack(parts, axis=2).reshape(chunks.shape)
    return y


def _unguarded(chunks: Array, amax_bits: Array) -> Array:
    del amax_bits
    return _plain(chunks)


def _guarded(chunks: Array, amax_bits: Array) -> Array:
    """`H` times each chunk, big and tiny columns (by their `amax_bits`) scaled into
    range and back (`_scaled_into_range`), results near float32's maximum computed
    again; a few chunks at a time (`lax.map`, `_GUARDED_ELEMENTS` values a batch): a
    branch's buffers are allocated whether or not it runs, and this rare one's steps
    would otherwise hold several copies of the operand."""
    c, _, m = chunks.shape
    batch = chunk_batch(c, m, _GUARDED_ELEMENTS)
    if batch == c:
        return _guarded_chunks((chunks, amax_bits))
    # Each batch one step of a loop (not `lax.map`'s `batch_size`, which vmaps the step
    # and so runs both sides of its `cond`).
    parts = (
        chunks.reshape(c // batch, batch, BLOCK, m),
        amax_bits.reshape(c // batch, batch, 1, m),
    )
    return jax.lax.map(_guarded_chunks, parts).reshape(chunks.shape)


def chunk_batch(chunks: int, columns: int, elements: int) -> int:
    """How many chunks of 16 rows of `columns` values a loop over `chunks` of them takes
    at a time to hold about `elements` values: the largest divisor of `chunks` within
    that (at least 1; all of them, none included, where they fit), so that the batches
    need no padded copy."""
    most = max(1, elements // (BLOCK * max(1, columns)))
    if chunks <= most:
        return chunks
    return max(d for d in range(1, most + 1) if chunks % d == 0)


#: Values `_guarded` transforms at a time.
_GUARDED_ELEMENTS = 2**20


def _guarded_chunks(args: tuple[Array, Array]) -> Array:
    """`_guarded` of the chunks `(c, 16, m)` with their `amax_bits` `(c, 1, m)`."""
    chunks, amax_bits = args
    chunks, masks = _scaled_into_range(chunks, amax_bits)
    y = _plain(chunks)
    # Scaled results in the top binades (|y| from just below 2^123, `_NEAR_MAX_BITS`: every
    # result whose exact value is 2^127 or more) of finite big columns: there the
    # transform's summation error could decide whether scaling back overflows; they are
    # computed again, to float32's nearest (`_accurate`).
    near_max = near_maximum(y, masks)
    y = jax.lax.cond(jnp.any(near_max), _accurate, _as_is, chunks, y, near_max)
    return scaled_back(y, masks)


def near_maximum(y: Float[Array, "*s"], masks: tuple[Array, Array]) -> Array:
    """Where a scaled result `y` of a big finite column (`masks`: `range_masks`') lies in
    the top binades (`_NEAR_MAX_BITS`), so that `_accurate` computes it again."""
    bits = abs_bits(y)
    return masks[0] & (bits >= _NEAR_MAX_BITS) & (bits < INF_BITS)


def _as_is(chunks: Array, y: Array, near_max: Array) -> Array:
    del chunks, near_max
    return y


def _accurate(chunks: Array, y: Array, near_max: Array) -> Array:
    """`y` where `near_max` is false; elsewhere the transform of the scaled `chunks`
    rounded once to float32 (to within 2^-40 of it: a tie closer than that may round
    either way): the 16-point fast Walsh-Hadamard transform carried as unevaluated sums
    `hi + lo` (each butterfly `a ± b` by Knuth's TwoSum, exact, its error added into
    `lo`), then times the signs and 1/4 (exact). A few chunks at a time (`lax.map`,
    `_ACCURATE_ELEMENTS` values a batch): a branch's buffers are allocated whether or not
    it runs, and this rare one's sums would otherwise be several copies of the operand."""
    batch = max(1, _ACCURATE_ELEMENTS // (BLOCK * max(1, chunks.shape[-1])))
    return jax.lax.map(_accurate_chunk, (chunks, y, near_max), batch_size=batch)


#: Values `_accurate` transforms at a time.
_ACCURATE_ELEMENTS = 2**18


def _accurate_chunk(args: tuple[Array, Array, Array]) -> Array:
    """`_accurate` of one chunk `(16, m)`."""
    chunk, y, near_max = args
    hi, lo = chunk, jnp.zeros_like(chunk)
    half = 1
    while half < BLOCK:
        shape = (BLOCK // (2 * half), 2, half, chunk.shape[-1])
        ah, bh = jnp.moveaxis(hi.reshape(shape), 1, 0)
        al, bl = jnp.moveaxis(lo.reshape(shape), 1, 0)
        sh, sl = _sum_of_sums(ah, al, bh, bl)
        dh, dl = _sum_of_sums(ah, al, -bh, -bl)
        hi = jnp.stack([sh, dh], axis=1).reshape(chunk.shape)
        lo = jnp.stack([sl, dl], axis=1).reshape(chunk.shape)
        half *= 2
    signs = jnp.asarray(np.asarray(RHT_SIGNS, np.float32) / 4)[:, None]
    return jnp.where(near_max, hi * signs, y)


def _sum_of_sums(ah: Array, al: Array, bh: Array, bl: Array) -> tuple[Array, Array]:
    """`(ah + al) + (bh + bl)` as `hi + lo` with `hi` its float32 rounding (`al`, `bl`
    below an ulp of `ah`, `bh`): TwoSum of the high parts (exact), the low parts and its
    error summed, renormalised by Fast2Sum."""
    s = ah + bh
    bv = s - ah
    err = (ah - (s - bv)) + (bh - bv)
    t = (al + bl) + err
    hi = s + t
    return hi, t - (hi - s)


def _scaled_into_range(
    chunks: Float[Array, "c 16 m"], amax_bits: Array
) -> tuple[Float[Array, "c 16 m"], tuple[Array, Array]]:
    """Chunk columns whose magnitudes reach 2^124 scaled by `_RANGE_SHIFT` (exactly: a
    power of two applied to values far above the subnormal range, the column's small
    elements, below the precision of its large ones, aside), so that no partial sum of
    the transform overflows where the result is finite; columns below 2^-100 scaled up
    by 2^64 (`tiny_up`), so that none of their values is read or made as a subnormal.
    Every other column is returned as it is, so their bits do not change. `amax_bits`:
    each column's largest `abs_bits` `(c, 1, m)`, as `rht` computes it.
    **Returns:** `(chunks, (big, tiny))`, the masks of scaled columns `(c, 1, m)` for
    `_scaled_back`. Inf and NaN count as big: scaling keeps them as they are."""
    masks = range_masks(amax_bits)
    return scaled_into_range(chunks, masks), masks


def range_masks(amax_bits: Array) -> tuple[Array, Array]:
    """`(big, tiny)`: the columns (by their largest `abs_bits`) that `_scaled_into_range`
    scales down (from 2^124, inf and NaN included) and up (below 2^-100, zero included)."""
    return amax_bits >= _BIG_BITS, amax_bits < _TINY_BITS


def scaled_into_range(x: Float[Array, "*s"], masks: tuple[Array, Array]) -> Float[Array, "*s"]:
    """`_scaled_into_range`'s scaling of `x` by its columns' `range_masks` (any shapes that
    broadcast: chunks here, one row of a group of chunks in `_tpu_rht`'s kernel)."""
    big, tiny = masks
    return jnp.where(tiny, tiny_up(x), jnp.where(big, x * _RANGE_SHIFT, x))


def scaled_back(y: Float[Array, "*s"], masks: tuple[Array, Array]) -> Float[Array, "*s"]:
    """Undo `_scaled_into_range` on the transformed columns: big ones exactly (a power of
    two on values of at least 2^-10 times the column's amax), or ±inf where the result
    exceeds float32's range; tiny ones rounded once to float32, subnormals included."""
    big, tiny = masks
    return jnp.where(tiny, tiny_down(y), jnp.where(big, y * (1.0 / _RANGE_SHIFT), y))
