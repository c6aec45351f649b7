"""The GEMM of two quantised operands (`scaled_dot`) and its operand dtype."""

import functools
import os

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float


def widest_float(*dtypes) -> jnp.dtype:
    """The widest of some float dtypes (no implicit promotion: works under strict mode)."""
    return max((jnp.dtype(d) for d in dtypes), key=lambda d: (d.itemsize, d == jnp.float16))


# --- the GEMM operand dtype: decided here, once per traced GEMM ---
#
# A layer's `fast` flag asks for the fast path or the float32 reference; `gemm_dtype`
# turns it into the operand dtype, once, when the GEMM is traced (`qdot` and the frozen
# layer's GEMM call it and pass the result to their primitives as the static parameter
# `dtype`); every function below the primitive receives that dtype and decides nothing.
# Quantised values are exact in bfloat16 and float32, so the choice changes only speed
# and float32 summation order.

GEMM_DTYPE_ENV = "NVFP4X_GEMM_DTYPE"


@functools.cache
def _cpu_multiplies_bf16() -> bool:
    """Whether this CPU has bfloat16 dot-product instructions (x86 AVX512-BF16 or AMX,
    Arm BF16). Without them XLA:CPU converts bfloat16 operands in software, which is
    slower than multiplying in float32."""
    try:
        with open("/proc/cpuinfo") as f:
            words = set(f.read().split())
    except OSError:
        return False
    return bool(words & {"avx512_bf16", "amx_bf16", "bf16"})


def fast_gemm_dtype() -> jnp.dtype:
    """The operand dtype of `fast=True` GEMMs: bfloat16 where the device multiplies it
    natively (GPUs, TPUs, CPUs with bf16 instructions), float32 on other CPUs.

    Override with the environment variable `NVFP4X_GEMM_DTYPE` (`auto`, `bfloat16` or
    `float32`), read when a GEMM is traced (by `gemm_dtype`).
    """
    choice = os.environ.get(GEMM_DTYPE_ENV, "auto")
    if choice == "bfloat16":
        return jnp.dtype(jnp.bfloat16)
    if choice == "float32":
        return jnp.dtype(jnp.float32)
    if choice != "auto":
        raise ValueError(
            f"{GEMM_DTYPE_ENV}={choice!r} is not a GEMM operand dtype; use 'auto' (the "
            "default), 'bfloat16' or 'float32'."
        )
    if jax.default_backend() != "cpu" or _cpu_multiplies_bf16():
        return jnp.dtype(jnp.bfloat16)
    return jnp.dtype(jnp.float32)


def gemm_dtype(fast: bool) -> jnp.dtype | None:
    """The operand dtype of a GEMM whose layer has this `fast` flag: `fast_gemm_dtype()`
    for `fast=True`, `None` (the float32 reference: operands promoted to float32 or
    wider) for `fast=False`. The one place the choice is made."""
    return fast_gemm_dtype() if fast else None


def batched_gemm_dtype(dtype: jnp.dtype | None) -> jnp.dtype | None:
    """The operand dtype of a GEMM that runs vmapped over independent problems (it then
    has batch dimensions): XLA:CPU multiplies bfloat16 with batch dimensions only in
    some layouts (elsewhere: "Unsupported element type for DotThunk: BF16 x BF16 =
    F32"), so on a CPU such GEMMs take float32 operands (exact for quantised values)."""
    if dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
        return jnp.dtype(jnp.float32)
    return dtype


def scaled_dot(
    a: Array,
    a_scale: ArrayLike | None,
    b: Array,
    b_scale: ArrayLike | None,
    dims: tuple[tuple[int, ...], tuple[int, ...]],
    *,
    dtype: jnp.dtype | None,
) -> Float[Array, "..."]:
    """`dot_general(a, b)` accumulated in float32, then times `a_scale * b_scale`.

    With a `dtype` (see `gemm_dtype`) and both operands in bfloat16 (quantised values
    always are: they are exact there), the product runs on `dtype` operands; otherwise
    (the reference, `dtype=None`) both are promoted to float32 or wider first. The two
    differ only in float32 summation order.
    """
    bf16 = jnp.dtype(jnp.bfloat16)
    if not (dtype is not None and a.dtype == bf16 and b.dtype == bf16):
        dtype = widest_float(a.dtype, b.dtype, jnp.float32)
    a, b = a.astype(dtype), b.astype(dtype)
    out = jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)
    scales = [s for s in (a_scale, b_scale) if s is not None]
    if len(scales) == 2:
        return out * (scales[0] * scales[1])
    return out * scales[0] if scales else out
