"""MXFP8, all of it: E4M3 elements, an E8M0 power-of-two scale per 32 elements along the
GEMM's contraction axis, no tensor scale. The format as a GEMM operand (`MXFP8Spec`),
its packed array (`MXFP8Array`, made by `to_mxfp8`)."""

import functools
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Shaped, UInt8

from .._axes import follows_input_sharding
from .._checks import check_float, check_ndim
from .._kernels import _native
from .._numerics._bits import fp8_bits, fp8_values
from .._numerics._constants import MX_BLOCK
from .._numerics._fp8 import mx_pad, quantize_mxfp8
from .._numerics._ieee import mul_exact
from .._numerics._subnormal import from_float32, to_float32
from .._packed import PackedArray
from ._spec import Format, FormatSpec


class MXFP8Array(PackedArray):
    """MXFP8 along the last axis: `data` (`float8_e4m3fn`, last axis padded to 32) and
    `scales` (`float8_e8m0fnu`, one per 32 elements), both held as uint8 bit patterns
    (`data_bits`, `scale_bits`) so Equinox serialisation round-trips them. Make one with
    [`nvfp4x.to_mxfp8`][].

    **Fields:** `data_bits`, `scale_bits`, and (static) `logical_last` (the unpadded
    length of the last axis) and `dtype` (the dtype that was quantised).

    ```python
    m = nvfp4x.to_mxfp8(jax.random.normal(jax.random.key(0), (4, 40)))
    m.shape, m.data.shape, m.scales.shape   # (4, 40), (4, 64), (4, 2)
    m.nbytes                                # 264
    m.dequantize().shape                    # (4, 40)
    ```
    """

    data_bits: UInt8[Array, "..."]
    scale_bits: UInt8[Array, "..."]
    logical_last: int = eqx.field(static=True)
    dtype: np.dtype = eqx.field(static=True, converter=np.dtype)

    per_block: ClassVar[tuple[str, ...]] = ("data_bits", "scale_bits")

    @property
    def data(self) -> Shaped[Array, "..."]:
        """The elements as `float8_e4m3fn`, last axis padded to a multiple of 32."""
        return jax.lax.bitcast_convert_type(self.data_bits, jnp.float8_e4m3fn)

    @property
    def scales(self) -> Shaped[Array, "..."]:
        """The block scales as `float8_e8m0fnu` (powers of two), one per 32 elements."""
        return jax.lax.bitcast_convert_type(self.scale_bits, jnp.float8_e8m0fnu)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape (without the padding of the last axis)."""
        return tuple(self.data_bits.shape[:-1]) + (self.logical_last,)

    @property
    def shard_blocks(self) -> tuple[int, ...]:
        return (1, MX_BLOCK)

    @follows_input_sharding(like=lambda self: self.data_bits)
    def operand(self) -> tuple[Shaped[Array, "..."], None]:
        """The GEMM operand form.

        **Returns:** `(values, None)`: element × block scale in bfloat16 (exact), in the
        logical shape; MXFP8 has no tensor scale.
        """
        d = fp8_values(self.data_bits, jnp.float8_e4m3fn)
        d = d.reshape(*d.shape[:-1], d.shape[-1] // MX_BLOCK, MX_BLOCK)
        scales = fp8_values(self.scale_bits, jnp.float8_e8m0fnu)
        v = (d * scales[..., None]).reshape(d.shape[:-2] + (-1,))
        return v[..., : self.logical_last].astype(jnp.bfloat16), None

    def dequantize(self, dtype=None) -> Shaped[Array, "..."]:
        """The array's values, element × block scale, in the logical shape.

        **Arguments:**

        - `dtype`: the output dtype; by default the dtype that was quantised.

        **Returns:** an array of shape `self.shape`: the IEEE float32 products, subnormal
        ones included (`mul_exact`: the same bits on a device that flushes subnormals),
        in `dtype`.
        """
        v = _dequantize(self.data_bits, self.scale_bits, self.logical_last)
        return from_float32(v, self.dtype if dtype is None else dtype)


# Jitted: called eagerly, it is one dispatch rather than `mul_exact`'s ops one by one.
@functools.partial(jax.jit, static_argnames="last")
def _dequantize(data_bits: Array, scale_bits: Array, last: int) -> Float[Array, "..."]:
    """Element times block scale in float32 (IEEE, subnormal products included), the
    padding of the last axis cut off; both decoded from their bits (`fp8_values`)."""
    d = fp8_values(data_bits, jnp.float8_e4m3fn)
    blocks = d.reshape(*d.shape[:-1], d.shape[-1] // MX_BLOCK, MX_BLOCK)
    scales = fp8_values(scale_bits, jnp.float8_e8m0fnu)
    v = mul_exact(blocks, scales[..., None]).reshape(d.shape)
    return v[..., :last]


@follows_input_sharding
def to_mxfp8(x: ArrayLike) -> MXFP8Array:
    """Quantise to MXFP8 along the last axis (E4M3 elements, power-of-two scale per 32).

    **Arguments:**

    - `x`: a floating-point array with at least one axis; the last axis is blocked
      (zero-padded to a multiple of 32 internally), leading axes are batch axes.

    **Returns:** an [`nvfp4x.MXFP8Array`][] of `x`'s shape. Its scales are
    `2^ceil(log2(bamax / 448))` (spec §6); a finite input always dequantises to finite
    values (elements saturate so that element × scale stays below the float32 maximum),
    and a block holding NaN or ±inf dequantises to NaN.

    **Raises:** `TypeError` for a non-float `x` (integer, boolean, complex); `ValueError`
    for a 0-d `x`.

    ```python
    m = nvfp4x.to_mxfp8(jax.random.normal(jax.random.key(0), (4, 40)))
    m.scales.shape, m.dequantize().shape   # (4, 2), (4, 40)
    ```
    """
    x = check_float(x)
    check_ndim(x, 1, "MXFP8 (blocks of 32 along the last axis)")
    data_bits, scale_bits = _quantize(x)
    return MXFP8Array(
        data_bits=data_bits, scale_bits=scale_bits, logical_last=x.shape[-1], dtype=x.dtype
    )


# Jitted: called eagerly, it is one dispatch (one compilation per shape) rather than
# every operation dispatched and compiled on its own.
@jax.jit
def _quantize(x: Array) -> tuple[Array, Array]:
    """`to_mxfp8` of a checked array: the E4M3 elements' and E8M0 scales' bits."""
    q, scale = quantize_mxfp8(mx_pad(to_float32(x)))  # (float64: subnormals kept)
    # on the bits: FP8 subnormals kept
    return fp8_bits(q, jnp.float8_e4m3fn), fp8_bits(scale, jnp.float8_e8m0fnu)


class MXFP8Spec(FormatSpec):
    name = "mxfp8"
    description = "FP8 E4M3 elements, E8M0 power-of-two scale per 32 elements"
    bits_per_element = 8 + 8 / MX_BLOCK
    blocks = ((1, MX_BLOCK),)
    native = _native.MXFP8
    sign_symmetric = True

    def quantize(
        self, a: Float[Array, "..."], fmt: Format, axis: int, key: jax.Array | None
    ) -> tuple[Array, None]:
        moved = jnp.moveaxis(a, axis, -1)
        n = moved.shape[-1]
        q, scale = quantize_mxfp8(mx_pad(moved))
        vals = (q.reshape(*scale.shape, MX_BLOCK) * scale[..., None]).reshape(q.shape)
        return jnp.moveaxis(vals[..., :n], -1, axis).astype(jnp.bfloat16), None

    def pack(self, w: Float[Array, "n k"], fmt: Format, amax: Array | None = None) -> MXFP8Array:
        return to_mxfp8(w)


MXFP8 = MXFP8Spec()
