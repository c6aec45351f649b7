"""`nvfp4x.rht`, the random Hadamard transform with its input checks: the checked
public face of `_numerics._hadamard.rht` (which imports nothing from above it), its
product by the implementation of `"rht"` that `nvfp4x._kernels` picks (on a TPU a Mosaic
kernel, elsewhere XLA's; the same bits)."""

from jax.typing import ArrayLike
from jaxtyping import Array, Float

from . import _kernels
from ._checks import check_axis, check_float, check_ndim


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
    transform rounds to a finite float32, up to float32's maximum (chunk columns near it
    are transformed scaled down by a power of two, and their results from 2^127 up are
    the exact ones rounded once: ±inf only beyond the midpoint above FLT_MAX); a
    non-finite element makes its chunk column's
    outputs non-finite. Chunk columns below 2^-100 are transformed scaled up and
    rounded once back into float32, so subnormal inputs and outputs are kept, not
    flushed to zero, on every device. A float64 `x` is rounded to float32 first, once
    (beyond its range: ±inf; in its subnormal range: the subnormal, not zero).

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
    return _kernels.rht(x, check_axis(axis, x.ndim))
