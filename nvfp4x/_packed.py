"""`PackedArray`, what the packed arrays of every format have in common, and the packed
array of per-tensor FP8."""

import abc
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Shaped, UInt8

from ._axes import follows_input_sharding
from ._checks import check_float, check_fp8_kind
from ._format._fp8 import quantize_fp8
from ._format._nvfp4 import tensor_amax


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


class FP8Array(PackedArray):
    """FP8 with one float32 decode scale per tensor: value = `data * scale`, `data` held
    as uint8 bit patterns (`data_bits`) of `kind` ("e4m3" or "e5m2"). Make one with
    [`nvfp4x.to_fp8`][].

    **Fields:** `data_bits`, `scale` (float32 decode scale: a scalar, one per slice when
    made under `jax.vmap`), and (static) `kind` and `dtype` (the dtype that was quantised).

    ```python
    f = nvfp4x.to_fp8(jax.random.normal(jax.random.key(0), (4, 40)), kind="e5m2")
    f.data.dtype, f.scale.shape   # float8_e5m2, ()
    f.nbytes                      # 164: 160 bytes of data, 4 of scale
    f.dequantize().shape          # (4, 40)
    ```
    """

    data_bits: UInt8[Array, "..."]
    scale: Float[Array, "*batch"]
    kind: str = eqx.field(static=True)
    dtype: np.dtype = eqx.field(static=True, converter=np.dtype)

    per_block: ClassVar[tuple[str, ...]] = ("data_bits",)
    per_tensor: ClassVar[tuple[str, ...]] = ("scale",)

    @property
    def data(self) -> Shaped[Array, "..."]:
        """The elements as `float8_e4m3fn` or `float8_e5m2` (per `kind`), unscaled."""
        fp8 = jnp.float8_e4m3fn if self.kind == "e4m3" else jnp.float8_e5m2
        return jax.lax.bitcast_convert_type(self.data_bits, fp8)

    @property
    def shape(self) -> tuple[int, ...]:
        """The array's shape."""
        return tuple(self.data_bits.shape)

    @property
    def shard_blocks(self) -> tuple[int, ...]:
        return ()

    def operand(self) -> tuple[Shaped[Array, "..."], Float[Array, "*batch"]]:
        """The GEMM operand form.

        **Returns:** `(values, scale)`: the FP8 elements in bfloat16 (exact) and the
        float32 tensor decode scale; the array is `values * scale`.
        """
        return self.data.astype(jnp.bfloat16), self.scale

    def dequantize(self, dtype=None) -> Shaped[Array, "..."]:
        """The array's values, `data * scale`, computed in float32.

        **Arguments:**

        - `dtype`: the output dtype; by default the dtype that was quantised.

        **Returns:** an array of shape `self.shape`.
        """
        scale = self.scale.reshape(self.scale.shape + (1,) * (self.data.ndim - self.scale.ndim))
        out = self.data.astype(jnp.float32) * scale
        return out.astype(self.dtype if dtype is None else dtype)


@follows_input_sharding
def to_fp8(x: ArrayLike, kind: str = "e4m3") -> FP8Array:
    """Quantise to FP8 (`kind` "e4m3" or "e5m2") with a current per-tensor scale.

    **Arguments:**

    - `x`: a floating-point array (a 0-d array too: there are no blocks).
    - `kind`: `"e4m3"` (the default; weights and activations) or `"e5m2"` (gradients).

    **Returns:** an [`nvfp4x.FP8Array`][] whose scale maps `max(|x|)` to the format's
    largest finite value. Non-finite elements dequantise to NaN.

    **Raises:** `TypeError` for a non-float `x` (integer, boolean, complex); `ValueError`
    for an unknown `kind`.

    ```python
    f = nvfp4x.to_fp8(jax.random.normal(jax.random.key(0), (4, 40)))
    f.data.dtype, f.dequantize().shape   # float8_e4m3fn, (4, 40)
    ```
    """
    x = check_float(x)
    kind = check_fp8_kind(kind)
    q, scale = quantize_fp8(x, kind, tensor_amax(x))
    dtype = jnp.float8_e4m3fn if kind == "e4m3" else jnp.float8_e5m2
    return FP8Array(data_bits=as_bits(q, dtype), scale=scale, kind=kind, dtype=x.dtype)
