"""FP8 (E4M3 or E5M2) with one current (amax) scale per tensor, all of it: the format as
a GEMM operand (`FP8Spec`, two of them), its packed array (`FP8Array`, made by
`to_fp8`)."""

import functools
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Shaped, UInt8

from .._axes import follows_input_sharding
from .._checks import check_float, check_fp8_kind
from .._kernels import _native
from .._numerics._bits import fp8_bits, fp8_values
from .._numerics._fp8 import FP8_DTYPES, quantize_fp8
from .._numerics._ieee import mul_exact
from .._numerics._nvfp4 import tensor_amax
from .._numerics._subnormal import from_float32, to_float32
from .._packed import PackedArray
from ._spec import Format, FormatSpec


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
        return jax.lax.bitcast_convert_type(self.data_bits, FP8_DTYPES[self.kind])

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
        return fp8_values(self.data_bits, FP8_DTYPES[self.kind]).astype(jnp.bfloat16), self.scale

    def dequantize(self, dtype=None) -> Shaped[Array, "..."]:
        """The array's values, `data * scale`, computed in float32.

        **Arguments:**

        - `dtype`: the output dtype; by default the dtype that was quantised.

        **Returns:** an array of shape `self.shape`.
        """
        scale = self.scale.reshape(self.scale.shape + (1,) * (self.data.ndim - self.scale.ndim))
        out = _dequantize(self.data_bits, scale, self.kind)
        return from_float32(out, self.dtype if dtype is None else dtype)


# Jitted: called eagerly, it is one dispatch rather than `mul_exact`'s ops one by one.
@functools.partial(jax.jit, static_argnames="kind")
def _dequantize(data_bits: Array, scale: Array, kind: str) -> Float[Array, "..."]:
    """`data * scale`, the IEEE float32 products (subnormal ones of tiny tensors
    included, `mul_exact`)."""
    data = fp8_values(data_bits, FP8_DTYPES[kind])  # on the bits: FP8 subnormals kept
    return mul_exact(data, scale)


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
    bits, scale = _quantize(x, kind)
    return FP8Array(data_bits=bits, scale=scale, kind=kind, dtype=x.dtype)


# Jitted: called eagerly, it is one dispatch (one compilation per shape and kind) rather
# than every operation dispatched and compiled on its own.
@functools.partial(jax.jit, static_argnames="kind")
def _quantize(x: Array, kind: str) -> tuple[Array, Array]:
    """`to_fp8` of checked arguments: the FP8 elements' bits and the decode scale."""
    x32 = to_float32(x)  # (float64: subnormals kept)
    q, scale = quantize_fp8(x32, kind, tensor_amax(x32))
    return fp8_bits(q, FP8_DTYPES[kind]), scale  # on the bits: FP8 subnormals kept


class FP8Spec(FormatSpec):
    """`fp8_<kind>`: FP8 elements of `kind` (`"e4m3"` or `"e5m2"`), one decode scale per
    tensor that maps its amax to the kind's largest finite value."""

    bits_per_element = 8.0
    sign_symmetric = True

    def __init__(self, kind: str):
        self.kind = kind
        self.name = f"fp8_{kind}"
        self.description = f"FP8 {kind.upper()} with one current (amax) scale per tensor"
        self.native = _native.FP8_E4M3 if kind == "e4m3" else _native.FP8_E5M2

    def quantize(
        self, a: Float[Array, "..."], fmt: Format, axis: int, key: jax.Array | None
    ) -> tuple[Array, Float[Array, ""]]:
        q, scale = quantize_fp8(a, self.kind, tensor_amax(a))
        return q.astype(jnp.bfloat16), scale

    def pack(self, w: Float[Array, "n k"], fmt: Format, amax: Array | None = None) -> FP8Array:
        return to_fp8(w, kind=self.kind)


FP8_E4M3 = FP8Spec("e4m3")
FP8_E5M2 = FP8Spec("e5m2")
