"""The GEMM of two quantised operands (`scaled_dot`) and its operand dtype."""

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, ArrayLike, Float

from .. import _kernels
from .._kernels import GEMM_DTYPE_ENV as GEMM_DTYPE_ENV


def widest_float(*dtypes) -> jnp.dtype:
    """The widest of some float dtypes (no implicit promotion: works under strict mode)."""
    return max((jnp.dtype(d) for d in dtypes), key=lambda d: (d.itemsize, d == jnp.float16))


# --- the GEMM operand dtype: decided here, once per traced GEMM ---
#
# A layer's `fast` flag allows the fast path (`True`) or asks for the float32 reference;
# `gemm_dtype` turns it into the operand dtype, once, when the GEMM is traced (`qdot`
# and the frozen layer's GEMM call it and pass the result to their primitives as the
# static parameter `dtype`); the functions below the primitive receive that dtype.
# Which dtype the fast path uses is `nvfp4x._kernels`'s choice (`"gemm_operands"`), as
# is whether a GEMM of two low-precision operands runs natively (`native_gemm`, asked
# by `_gemm`'s GEMMs when a fast one is traced). Quantised values are exact in
# bfloat16 and float32, so the choice changes only speed and float32 summation order.


def fast_gemm_dtype() -> jnp.dtype:
    """The operand dtype of `fast=True` GEMMs: bfloat16 where the device multiplies it
    natively (GPUs, TPUs, CPUs with bf16 instructions), float32 on other CPUs: the pick
    of `nvfp4x._kernels` for `"gemm_operands"`.

    Override with the environment variable `NVFP4X_GEMM_DTYPE` (`auto`, `bfloat16` or
    `float32`), read when a GEMM is traced (by `gemm_dtype`), or with
    `nvfp4x._kernels.use("gemm_operands", ...)`.
    """
    return jnp.dtype(_kernels.pick("gemm_operands"))


def gemm_dtype(fast: bool) -> jnp.dtype | None:
    """The operand dtype of a GEMM whose layer has this `fast` flag: `fast_gemm_dtype()`
    for `fast=True`, `None` (the float32 reference: operands promoted to float32 or
    wider, and no native GEMM) for `fast=False`. The one place the flag is read."""
    return fast_gemm_dtype() if fast else None


def batched_gemm_dtype(dtype: jnp.dtype | None) -> jnp.dtype | None:
    """The operand dtype of a GEMM that runs vmapped over independent problems (it then
    has batch dimensions): XLA:CPU multiplies bfloat16 with batch dimensions only in
    some layouts (elsewhere: "Unsupported element type for DotThunk: BF16 x BF16 =
    F32"), so on a CPU such GEMMs take float32 operands (exact for quantised values)."""
    if dtype == jnp.bfloat16 and _kernels.backend() == "cpu":
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
    differ only in float32 summation order. A few tokens against a 2-D `b` on a CPU run
    as `chunked_dot` (see `runs_chunked`), a fixed float32 summation order.
    """
    if runs_chunked(a, b, dims, dtype):
        k = a.shape[-1]
        pairs = dense_pairs(b, chunk_steps(k))
        return apply_scales(chunked_dot(a, pairs, b.shape[0], k), a_scale, b_scale)
    bf16 = jnp.dtype(jnp.bfloat16)
    if not (dtype is not None and a.dtype == bf16 and b.dtype == bf16):
        dtype = widest_float(a.dtype, b.dtype, jnp.float32)
    a, b = a.astype(dtype), b.astype(dtype)
    out = jax.lax.dot_general(
        a, b, (dims, ((), ())), precision=dot_precision(dtype), preferred_element_type=jnp.float32
    )
    return apply_scales(out, a_scale, b_scale)


def dot_precision(dtype: jnp.dtype) -> lax.Precision:
    """The precision a `dot_general` on `dtype` operands asks for: `HIGHEST` for float32
    (and wider), so that a GPU, whose float32 dots default to TF32 (10 mantissa bits),
    multiplies them in float32 as a CPU does; `DEFAULT` for bfloat16 and float16, which
    every backend multiplies exactly."""
    if jnp.dtype(dtype).itemsize >= 4:
        return lax.Precision.HIGHEST
    return lax.Precision.DEFAULT


def apply_scales(out: Array, a_scale: ArrayLike | None, b_scale: ArrayLike | None) -> Array:
    """`out * (a_scale * b_scale)` (either scale may be None: no factor)."""
    scales = [s for s in (a_scale, b_scale) if s is not None]
    if len(scales) == 2:
        return out * (scales[0] * scales[1])
    return out * scales[0] if scales else out


# --- a few tokens on a CPU: the GEMM as a fixed-order float32 multiply-add loop ---
#
# At a few tokens a GEMM `x @ W.T` reads the whole weight to do two flops per element:
# its speed is the speed of reading the weight. A frozen (packed) weight is 4.5 bits per
# element; decoding it to a float array and calling a dot writes and reads 32 bits per
# element again. `chunked_dot` instead runs the product as a loop over column chunks of
# the weight whose body XLA fuses with the weight's producer (the frozen layer's decode
# of its packed codes, `_frozen.py`): only the packed bytes are read. Its float32
# summation order is fixed by its definition, not by a BLAS kernel, and both the frozen
# layer and the unfrozen one (through `scaled_dot`) run it on the same values, so that
# the frozen forward stays bit-equal to the unfrozen one.

#: The most tokens (rows of `a`, its free axes together) that run as `chunked_dot`.
CHUNKED_MAX_TOKENS = 4
#: Element pairs of each weight row per step of `chunked_dot` (64 elements: 32 bytes
#: of packed NVFP4 codes, four 16-element blocks).
CHUNK = 32


def runs_chunked(a: Array, b: Array | jax.ShapeDtypeStruct, dims, dtype: jnp.dtype | None) -> bool:
    """Whether `scaled_dot(a, ., b, ., dims, dtype=dtype)` runs as `chunked_dot`: a fast
    GEMM (`dtype` given) on a CPU, `a @ b.T` with `b` 2-D, at most
    `CHUNKED_MAX_TOKENS` rows of `a`, operands float32 or narrower. Decided from shapes
    and dtypes only, when the GEMM is traced; the frozen layer asks the same question."""
    narrow = all(jnp.dtype(t).itemsize <= 4 for t in (a.dtype, b.dtype))
    return (
        dtype is not None
        and narrow
        and _kernels.backend() == "cpu"
        and len(b.shape) == 2
        and a.ndim >= 1
        and tuple(map(tuple, dims)) == ((a.ndim - 1,), (1,))
        and math.prod(a.shape[:-1]) <= CHUNKED_MAX_TOKENS
    )


def chunk_steps(k: int) -> int:
    """The steps of `chunked_dot` over a contraction of `k` elements."""
    return max(1, -(-k // (2 * CHUNK)))


#: `pairs(i)`: step `i`'s columns of the weight, `(even, odd)`: its elements `2j` and
#: `2j + 1` for `j` in `[i * CHUNK, (i + 1) * CHUNK)`, each `(n, CHUNK)` float32, zero
#: past the contraction's end.
Pairs = Callable[[Array], tuple[Array, Array]]


def dense_pairs(b: Float[Array, "n k"], steps: int) -> Pairs:
    """`chunked_dot`'s weight columns read from a dense `(n, k)` weight."""
    n, k = b.shape
    b = b.astype(jnp.float32)
    if k != 2 * CHUNK * steps:
        b = jnp.pad(b, ((0, 0), (0, 2 * CHUNK * steps - k)))
    b = b.reshape(n, CHUNK * steps, 2)

    def pairs(i):
        chunk = lax.dynamic_slice_in_dim(b, i * CHUNK, CHUNK, axis=1)
        return chunk[..., 0], chunk[..., 1]

    return pairs


def chunked_dot(a: Float[Array, "*m k"], pairs: Pairs, n: int, k: int) -> Float[Array, "*m n"]:
    """`a @ W.T` in float32 in a fixed order, with `W` given by `pairs` (its columns,
    step by step; see `Pairs`).

    For each row of `a` and of `W`: step `i` forms, for each of `CHUNK` lanes `j`,
    `a[2c] * W[2c] + a[2c+1] * W[2c+1]` with `c = i * CHUNK + j`; each lane adds its
    steps' terms to +0 in step order; the lanes are then added in a fixed halving tree (lane
    `j` with lane `j + CHUNK/2`, and so on). Positions past `k` are zero in both
    operands. The order depends on `k` alone, so two callers whose weights have the same
    values get the same bits.
    """
    steps = chunk_steps(k)
    lead = a.shape[:-1]
    a = a.reshape(-1, k).astype(jnp.float32)
    if k != 2 * CHUNK * steps:
        a = jnp.pad(a, ((0, 0), (0, 2 * CHUNK * steps - k)))
    a = a.reshape(a.shape[0], CHUNK * steps, 2)
    a_even, a_odd = a[..., 0], a[..., 1]

    def term(i):
        w_even, w_odd = pairs(i)
        xe = lax.dynamic_slice_in_dim(a_even, i * CHUNK, CHUNK, axis=1)[:, None, :]
        xo = lax.dynamic_slice_in_dim(a_odd, i * CHUNK, CHUNK, axis=1)[:, None, :]
        return xe * w_even[None] + xo * w_odd[None]

    # Every step inside the loop (a first step peeled off it would be fused with the
    # producer of `a` and recompute it per weight element): the sum starts at +0.
    acc = jnp.zeros((a.shape[0], n, CHUNK), jnp.float32)
    acc = lax.fori_loop(0, steps, lambda i, acc: acc + term(i), acc)
    while acc.shape[-1] > 1:
        half = acc.shape[-1] // 2
        acc = acc[..., :half] + acc[..., half:]
    return acc[..., 0].reshape(*lead, n)
