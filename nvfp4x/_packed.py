"""`PackedArray`, what the packed arrays of every format have in common. (Each format's
own packed array lives with its format: `_array.py` for NVFP4, `_formats/` for the
others.)"""

import abc
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Shaped, UInt8


def as_bits(x: Shaped[Array, "..."], dtype) -> UInt8[Array, "..."]:
    """The uint8 bit patterns of an 8-bit float array (given as `dtype` or as bits)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.uint8:
        return x
    return jax.lax.bitcast_convert_type(x.astype(dtype), jnp.uint8)


class PackedArray(eqx.Module):
    """A weight packed in its format (an [`nvfp4x.NVFP4Array`][],
    [`nvfp4x.MXFP8Array`][], [`nvfp4x.FP8Array`][]): an `eqx.Module` whose array fields
    are each either *per block* (elements and block scales: laid out like the logical
    array, sharded like it) or *per tensor* (tensor scales: one per stacked slice,
    sharded like the leading axes only), as the class declares in `per_block` and
    `per_tensor`; [`nvfp4x.packed_sharding`][] reads the declaration.

    Every packed array has a logical `shape`, the `dtype` that was quantised, `nbytes`,
    the GEMM operand form `operand()` and `dequantize()`.
    """

    #: The fields laid out like the logical array (elements, block scales).
    per_block: ClassVar[tuple[str, ...]]
    #: The fields with one value per tensor (per stacked slice): tensor scales.
    per_tensor: ClassVar[tuple[str, ...]] = ()
    dtype: eqx.AbstractVar[np.dtype]

    @property
    @abc.abstractmethod
    def shape(self) -> tuple[int, ...]:
        """The logical shape (without padding)."""

    @property
    @abc.abstractmethod
    def shard_blocks(self) -> tuple[int, ...]:
        """The blocks along the last two axes that a shard must not cut, e.g. `(1, 16)`
        (empty: any shard will do)."""

    @abc.abstractmethod
    def operand(self) -> tuple[Shaped[Array, "..."], Float[Array, "*batch"] | None]:
        """The GEMM operand form `(values, tensor scale or None)`, values in bfloat16."""

    @property
    def nbytes(self) -> int:
        """Bytes held: every array field (elements, block scales, tensor scales)."""
        return int(sum(getattr(self, f).nbytes for f in self.per_block + self.per_tensor))
