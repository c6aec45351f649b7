"""FP8 (E4M3 or E5M2) with one current (amax) scale per tensor, as a GEMM operand
format."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._format._fp8 import quantize_fp8
from .._format._nvfp4 import tensor_amax
from .._packed import FP8Array, to_fp8
from ._spec import Format, FormatSpec


class FP8Spec(FormatSpec):
    """`fp8_<kind>`: FP8 elements of `kind` (`"e4m3"` or `"e5m2"`), one decode scale per
    tensor that maps its amax to the kind's largest finite value."""

    bits_per_element = 8.0

    def __init__(self, kind: str):
        self.kind = kind
        self.name = f"fp8_{kind}"
        self.description = f"FP8 {kind.upper()} with one current (amax) scale per tensor"

    def quantize(
        self, a: Float[Array, "..."], fmt: Format, axis: int, key: jax.Array | None
    ) -> tuple[Array, Float[Array, ""]]:
        q, scale = quantize_fp8(a, self.kind, tensor_amax(a))
        return q.astype(jnp.bfloat16), scale

    def pack(self, w: Float[Array, "n k"], fmt: Format, amax: Array | None = None) -> FP8Array:
        return to_fp8(w, kind=self.kind)


FP8_E4M3 = FP8Spec("e4m3")
FP8_E5M2 = FP8Spec("e5m2")
