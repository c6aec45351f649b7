"""bfloat16 and float32 as GEMM operand formats: a dtype, no scaling."""

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from .._numerics._bits import bfloat16_bits
from ._spec import Format, FormatSpec


def round_to(a: Array, dtype) -> Array:
    """`a` cast to the float `dtype`, rounded to it on every backend.

    float32 (and float16, widened first) to bfloat16, the `bf16` format's rounding, is done
    on the bits:
    round to nearest, ties to even, on the uint32 pattern (`bfloat16_bits`), so that the
    result is IEEE's, subnormals included, whatever the backend does with float
    subnormals (a TPU flushes them: there `lax.reduce_precision` and float arithmetic
    read and write a subnormal as 0; XLA:CPU's `reduce_precision` keeps them). The
    bfloat16 result is a bitcast, so no cast pair (`f32 -> bf16 -> f32`) can be removed
    by XLA:GPU's `simplify-fp-conversions` (on by default with
    `xla_allow_excess_precision`), which would leave a reference GEMM multiplying
    unrounded values.

    Other narrowings keep a `reduce_precision` (which XLA keeps: it exists to round)
    where the two types share an exponent range, then the cast."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bfloat16 and a.dtype in (jnp.float32, jnp.float16):
        return bfloat16_bits(a)
    narrow, wide = jnp.finfo(dtype), jnp.finfo(a.dtype)
    if narrow.nmant < wide.nmant and narrow.nexp == wide.nexp:
        a = lax.reduce_precision(a, exponent_bits=narrow.nexp, mantissa_bits=narrow.nmant)
    return a.astype(dtype)


class Plain(FormatSpec):
    """A plain dtype: the operand cast to it, no scales; a weight is stored cast."""

    quantised = False
    sign_symmetric = True

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
