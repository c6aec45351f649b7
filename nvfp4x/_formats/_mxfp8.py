"""MXFP8 as a GEMM operand format: E4M3 elements, an E8M0 power-of-two scale per 32
elements along the GEMM's contraction axis, no tensor scale."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._format._constants import MX_BLOCK
from .._format._fp8 import mx_pad, quantize_mxfp8
from .._packed import MXFP8Array, to_mxfp8
from ._spec import Format, FormatSpec


class MXFP8Spec(FormatSpec):
    name = "mxfp8"
    description = "FP8 E4M3 elements, E8M0 power-of-two scale per 32 elements"
    bits_per_element = 8 + 8 / MX_BLOCK
    blocks = ((1, MX_BLOCK),)

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
