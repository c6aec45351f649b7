"""Native low-precision GEMMs: a quantised GEMM run on the operands' own low-precision
dtypes by the device's GEMM units, instead of on their exact bfloat16 or float32 values
(the emulated GEMM, `scaled_dot`). `nvfp4x._kernels.native_gemm` picks them.

Both take the operands as the emulated GEMM does: the exact element (times block scale)
values of each quantised operand, with the contraction along one axis of each. They
return the float32 product without the tensor scales (the caller multiplies by them,
as after the emulated GEMM). The operands are the same numbers; only the GEMM's float32
accumulation differs (its summation order, and whatever the GPU's GEMM unit does inside
a block), which the tests bound.

- `fp8_dot`: per-tensor-scaled FP8 (the `fp8` recipe): the values cast to
  `float8_e4m3fn` / `float8_e5m2` (exact: they are FP8 values), then `lax.dot_general`
  with `preferred_element_type=float32` and `precision=HIGHEST`, which XLA:GPU rewrites
  to a cuBLASLt FP8 GEMM on devices with FP8 tensor cores (compute capability 8.9+),
  with float32 accumulation (at DEFAULT precision XLA asks for cuBLASLt's FP8 fast
  accumulation, which keeps partial sums in less than float32: the likely cause of
  the H200 run's differences beyond summation order, before this was set). Each operand is laid out
  with its contraction axis last (`(M, K) x (N, K)`, the "TN" layout cuBLASLt's FP8
  GEMMs take): fprop `x (T, k) . W (n, k)` needs no transpose; dgrad transposes the
  weight to `(k, n)`, wgrad both operands to `(n, T)` and `(k, T)` (on FP8 bytes).
- `block_scaled_dot`: NVFP4 (E2M1 elements, E4M3 scales per 16) or MXFP8 (E4M3
  elements, E8M0 scales per 32) along the contraction: each operand's values written as
  codes times block scales (`split_blocks`), then `jax.nn.scaled_matmul` (cuDNN's
  block-scaled GEMM on Blackwell) or `jax.lax.scaled_dot` (decomposed by XLA where it
  has no native form, e.g. on a CPU: how the tests run this path). The tensor scales
  multiply the result. A 16x16 weight tile is 16 blocks of 1x16 in either GEMM
  (fprop's rows, dgrad's columns): its values split along whichever axis the GEMM
  contracts. Not run on a Blackwell GPU (none was at hand).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float

from .._numerics._bits import fp8_bits
from .._numerics._ieee import divide
from ._exact import round_e4m3_nonneg


class NativeOperand(NamedTuple):
    """How a format's operand runs in a native GEMM (`FormatSpec.native`)."""

    #: The element dtype (`float8_e4m3fn`, `float8_e5m2`, `float4_e2m1fn`).
    element: np.dtype
    #: The block-scale dtype (`float8_e4m3fn`, `float8_e8m0fnu`); None: no block scales.
    scale: np.dtype | None = None
    #: Elements per block scale along the contraction; 0: no block scales.
    block: int = 0


FP8_E4M3 = NativeOperand(np.dtype(jnp.float8_e4m3fn))
FP8_E5M2 = NativeOperand(np.dtype(jnp.float8_e5m2))
NVFP4 = NativeOperand(np.dtype(jnp.float4_e2m1fn), np.dtype(jnp.float8_e4m3fn), 16)
MXFP8 = NativeOperand(np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e8m0fnu), 32)

#: The positive E2M1 magnitudes a block's largest element may have, most likely first:
#: the candidates for its block scale, `max|block| / c` (`split_blocks`).
_E2M1_TOPS = (6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5)


def _rows(x: Array, axis: int) -> tuple[Array, tuple[int, ...]]:
    """`x` as a 2-D `(rows, K)` array with the contraction axis `axis` last, and the
    shape of its other axes."""
    moved = jnp.moveaxis(x, axis, -1)
    return moved.reshape(-1, moved.shape[-1]), moved.shape[:-1]


def fp8_dot(
    a: Array, a_native: NativeOperand, b: Array, b_native: NativeOperand, dims
) -> Float[Array, "..."]:
    """`dot_general(a, b, dims)` in float32 on FP8 operands (`a`, `b`: their exact
    values, cast to their element dtypes first)."""
    a2, lead_a = _rows(a.astype(a_native.element), dims[0][0])
    b2, lead_b = _rows(b.astype(b_native.element), dims[1][0])
    # HIGHEST: XLA:GPU asks cuBLASLt for its FP8 "fast accumulation" mode (partial sums
    # kept in less than float32 inside the tensor cores) when an FP8 dot's precision is
    # DEFAULT; any other precision keeps float32 accumulation, as the emulated GEMM has.
    out = lax.dot_general(
        a2,
        b2,
        (((1,), (1,)), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return out.reshape(*lead_a, *lead_b)


def block_scaled_dot(
    a: Array, b: Array, native: NativeOperand, dims, *, implementation: str
) -> Float[Array, "..."]:
    """`dot_general(a, b, dims)` in float32 by a block-scaled GEMM, both operands in the
    block format `native` along their contraction (`a`, `b`: their exact values)."""
    a2, lead_a = _rows(a, dims[0][0])
    b2, lead_b = _rows(b, dims[1][0])
    pad = -a2.shape[1] % native.block
    if pad:  # zeros: a zero block adds nothing
        a2, b2 = (jnp.pad(v, ((0, 0), (0, pad))) for v in (a2, b2))
    a_codes, a_scales = split_blocks(a2, native)
    b_codes, b_scales = split_blocks(b2, native)
    if implementation == "scaled_matmul":
        out = jax.nn.scaled_matmul(
            a_codes[None], b_codes[None], a_scales[None], b_scales[None], jnp.float32
        )[0]
    else:
        out = lax.scaled_dot(
            a_codes,
            b_codes,
            lhs_scale=a_scales,
            rhs_scale=b_scales,
            dimension_numbers=(((1,), (1,)), ((), ())),
            preferred_element_type=jnp.float32,
        )
    return out.reshape(*lead_a, *lead_b)


def split_blocks(x: Float[Array, "m k"], native: NativeOperand) -> tuple[Array, Array]:
    """Blocks of `native.block` elements along the last axis of `x` (their count a
    multiple of it) written as `(codes, scales)`: `codes` in `native.element`, `scales`
    (one per block) in `native.scale`, with `codes * scale == x` exactly for every block
    of exact values of the format. A block holding a non-finite value (or values the
    format cannot hold) gets a NaN scale: its products are NaN, never finite.

    - E4M3 scales (NVFP4): a block's values are `e2m1 x s` with `s` in E4M3; the scale
      is `max|block| / c` for the first E2M1 magnitude `c` (6, 4, 3, ...) that makes
      `s` an E4M3 value and every element an E2M1 code. nvfp4x's quantiser maps the
      block's amax to about 6, so this is its own scale whenever the largest code is 6
      (always, with round-to-nearest elements and normal scales).
    - E8M0 scales (MXFP8): a power of two `2^e`, the least (`e >= -127`) with
      `max|block| / 2^e <= 448`: the elements are then the block's E4M3 values scaled
      by a power of two, still E4M3.
    """
    m, k = x.shape
    xb = x.astype(jnp.float32).reshape(m, k // native.block, native.block)
    finite = jnp.all(jnp.isfinite(xb), axis=-1, keepdims=True)
    xb = jnp.where(finite, xb, 0.0)
    vmax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    if native.scale == jnp.float8_e8m0fnu:
        frac, exp = jnp.frexp(vmax)  # vmax = frac 2^exp, frac in [0.5, 1)
        e = jnp.where(frac * 512 <= 448, exp - 9, exp - 8)
        e = jnp.clip(jnp.where(vmax == 0, 0, e), -127, 127)
        codes = jnp.ldexp(xb, -e)
        exact = codes.astype(native.element).astype(jnp.float32) == codes
        ok = finite & jnp.all(exact, axis=-1, keepdims=True)
        bits = jnp.where(ok, e + 127, 255).astype(jnp.uint8)  # 0xFF: E8M0's NaN
        scales = lax.bitcast_convert_type(bits, jnp.float8_e8m0fnu)
    else:
        tops = jnp.asarray(_E2M1_TOPS, jnp.float32)
        s = divide(vmax[..., None], tops)  # (m, blocks, 1, candidates)
        c = divide(xb[..., None], jnp.where(s == 0, 1.0, s))
        exact = (c.astype(native.element).astype(jnp.float32) == c) & (c * s == xb[..., None])
        valid = jnp.all(exact, axis=-2, keepdims=True)
        # `s` an E4M3 value and its bits, by bit arithmetic rather than XLA's converts: on
        # a TPU v5e the split lost the blocks whose scales are E4M3 subnormals (2^-9 to
        # 7 x 2^-9; issue 36).
        valid &= (s >= 2.0**-9) & (s <= 448.0)
        valid &= round_e4m3_nonneg(jnp.clip(s, 0.0, 448.0)) == s
        first = jnp.argmax(valid, axis=-1, keepdims=True)
        pick = lambda v: jnp.take_along_axis(v, first, axis=-1)[..., 0]
        ok = finite & (jnp.any(valid, axis=-1) | (vmax == 0))
        codes = jnp.where(vmax == 0, xb, pick(jnp.broadcast_to(c, (*xb.shape, len(_E2M1_TOPS)))))
        scale = jnp.where(vmax == 0, 1.0, pick(s))
        scale_dtype = jnp.dtype(jnp.float8_e4m3fn)  # (NVFP4's `native.scale`)
        bits = fp8_bits(jnp.where(ok, scale, jnp.nan), scale_dtype)
        scales = lax.bitcast_convert_type(bits, scale_dtype)
    codes = jnp.where(ok, codes, 0.0).astype(native.element)
    return codes.reshape(m, k), scales.reshape(m, k // native.block)
