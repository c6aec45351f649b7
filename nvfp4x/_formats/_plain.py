"""bfloat16 and float32 as GEMM operand formats: a dtype, no scaling."""

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from ._spec import Format, FormatSpec


def round_to(a: Array, dtype) -> Array:
    """`a` cast to the float `dtype`, rounded to it on every backend.

    A bare narrowing cast is not enough: XLA:GPU removes a pair of casts that returns to
    the type it started from (`f32 -> bf16 -> f32`, its `simplify-fp-conversions` pass,
    on by default with `xla_allow_excess_precision`), so a reference GEMM that promotes
    the cast operand back to float32 would multiply the unrounded values. XLA keeps a
    `reduce_precision` (it exists to round), and the cast after it is exact. (Where the
    two types have the same exponent range, as float32 and bfloat16: there
    `reduce_precision` rounds exactly as the cast does, subnormals included.)"""
    dtype = jnp.dtype(dtype)
    narrow, wide = jnp.finfo(dtype), jnp.finfo(a.dtype)
    if narrow.nmant < wide.nmant and narrow.nexp == wide.nexp:
        a = lax.reduce_precision(a, exponent_bits=narrow.nexp, mantissa_bits=narrow.nmant)
    return a.astype(dtype)


class Plain(FormatSpec):
    """A plain dtype: the operand cast to it, no scales; a weight is stored cast."""

    quantised = False

    def __init__(self, name: str, dtype, description: str, bits: float):
        self.name, self.dtype, self.description, self.bits_per_element = (
            name,
            jnp.dtype(dtype),
            description,
            bits,
        )

    def quantize(
        self, a: Float[Array, "..."], fmt: Format, axis: int, key: jax.Array | None
    ) -> tuple[Array, None]:
        return round_to(a, self.dtype), None


BF16 = Plain("bf16", jnp.bfloat16, "bfloat16, no scaling", 16.0)
FLOAT32 = Plain("float32", jnp.float32, "float32, no quantisation", 32.0)
