"""The random Hadamard transform of spec §4: `H = diag(s) @ H16 / 4` on 16-row chunks."""

import math

import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from .._checks import check_axis, check_float, check_ndim
from ._constants import BLOCK, RHT_SIGNS
from ._ieee import abs_bits
from ._subnormal import tiny_down, tiny_up

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


def rht(x: ArrayLike, axis: int = 0) -> Float[Array, "..."]:
    """Apply `H` to consecutive 16-element chunks of `x` along `axis` (float32).

    The axis is zero-padded to a multiple of 16 and the padded length is kept: padding
    rows are mixed into the transform, so cutting them off again would lose information.
    For two operands transformed along their shared contraction axis, the padded zero
    rows contribute nothing, and `rht(a).T @ rht(b) == a.T @ b` up to rounding.

    **Arguments:**

    - `x`: an array of any shape and float dtype (computed in float32).
    - `axis`: the axis to transform (wgrad's token axis).

    **Returns:** a float32 array of `x`'s shape, except that `axis` has its length
    rounded up to a multiple of 16. Finite input gives finite output wherever the exact
    transform is finite, up to float32's maximum (chunk columns near it are transformed
    scaled down by a power of two); a non-finite element makes its chunk column's
    outputs non-finite. Chunk columns below 2^-100 are transformed scaled up and
    rounded once back into float32, so subnormal inputs and outputs are kept, not
    flushed to zero, on every device. A float64 `x` is rounded to float32 first
    (beyond its range: ±inf).

    **Raises:** `TypeError` for a non-float `x` (integer, boolean, complex) or a
    non-integer `axis`; `ValueError` for a 0-d `x` or an `axis` out of range.

    ```python
    a = jax.random.normal(jax.random.key(0), (20, 3))
    b = jax.random.normal(jax.random.key(1), (20, 5))
    nvfp4x.rht(a).shape                                          # (32, 3)
    jnp.allclose(nvfp4x.rht(a).T @ nvfp4x.rht(b), a.T @ b, atol=1e-5)   # True
    ```
    """
    x = check_float(x)
    check_ndim(x, 1, "`rht` (a transform along `axis`)")
    axis = check_axis(axis, x.ndim)
    x = jnp.moveaxis(x.astype(jnp.float32), axis, 0)
    pad = -x.shape[0] % BLOCK
    if pad:
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    # Chunks of 16 rows times H: one small batched matrix product, no transposes.
    chunks = x.reshape(x.shape[0] // BLOCK, BLOCK, math.prod(x.shape[1:]))
    chunks, masks = _scaled_into_range(chunks)
    h = jnp.asarray(hadamard_matrix())
    y = jnp.einsum("ij,cjm->cim", h, chunks, precision="highest")
    y = _scaled_back(y, masks).reshape(x.shape)
    return jnp.moveaxis(y, 0, axis)


def _scaled_into_range(
    chunks: Float[Array, "c 16 m"],
) -> tuple[Float[Array, "c 16 m"], tuple[Array, Array]]:
    """Chunk columns whose magnitudes reach 2^124 scaled by `_RANGE_SHIFT` (exactly: a
    power of two applied to values far above the subnormal range, the column's small
    elements, below the precision of its large ones, aside), so that no partial sum of
    the transform overflows where the result is finite; columns below 2^-100 scaled up
    by 2^64 (`tiny_up`), so that none of their values is read or made as a subnormal.
    Every other column is returned as it is, so their bits do not change.
    **Returns:** `(chunks, (big, tiny))`, the masks of scaled columns `(c, 1, m)` for
    `_scaled_back`. Inf and NaN count as big: scaling keeps them as they are."""
    amax_bits = jnp.max(abs_bits(chunks), axis=1, keepdims=True, initial=0)
    big, tiny = amax_bits >= _BIG_BITS, amax_bits < _TINY_BITS
    scaled = jnp.where(big, chunks * _RANGE_SHIFT, chunks)
    return jnp.where(tiny, tiny_up(chunks), scaled), (big, tiny)


def _scaled_back(y: Float[Array, "c 16 m"], masks: tuple[Array, Array]) -> Float[Array, "c 16 m"]:
    """Undo `_scaled_into_range` on the transformed columns: big ones exactly (a power of
    two on values of at least 2^-10 times the column's amax), or ±inf where the result
    exceeds float32's range; tiny ones rounded once to float32, subnormals included."""
    big, tiny = masks
    return jnp.where(tiny, tiny_down(y), jnp.where(big, y * (1.0 / _RANGE_SHIFT), y))
