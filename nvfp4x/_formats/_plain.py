"""bfloat16 and float32 as GEMM operand formats: a dtype, no scaling."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ._spec import Format, FormatSpec


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
        return a.astype(self.dtype), None


BF16 = Plain("bf16", jnp.bfloat16, "bfloat16, no scaling", 16.0)
FLOAT32 = Plain("float32", jnp.float32, "float32, no quantisation", 32.0)
