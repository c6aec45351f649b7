"""A pytest plugin that gives XLA:CPU a TPU's flushing of subnormals everywhere.

XLA:CPU already runs its float arithmetic with denormals-are-zero and flush-to-zero
(multiplications, additions, comparisons, max/min, rounding to integers: measured with
jax 0.10), but it computes some operations on the bits, and those keep subnormals:
float-to-float casts (`convert`, to and from bfloat16, float16 and the float8 types),
`reduce_precision`, `abs` and `neg` (and so `jnp.copysign`). A TPU flushes float32
subnormals in arithmetic, inputs and results, and need not keep them in those
operations either. Loaded first (`python -m pytest -p flush_subnormals`, with `tests/`
on the path), this plugin makes XLA:CPU flush them there too: each of those operations
reads a subnormal operand (of the operand's type) as a zero of its sign, and writes a
result that is subnormal in the result's type as a zero of its sign. That is the most a
backend that flushes may do, so a library giving the spec's bits under it gives them
on a TPU whatever XLA:TPU does with a subnormal in a cast.

Bits are moved unchanged by `bitcast_convert_type`, selects, reshapes and reductions
over integers: what the library computes on the bits is not touched. 4-bit float types
(`float4_e2m1fn`) are left as they are: no integer type of their width to work on.

`tests/test_exactness.py` runs the format tests under it (and `inexact_arithmetic`) in
a subprocess: their bits must not change. Import-time side effect only; nothing here is
part of nvfp4x.
"""

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.interpreters import mlir
from jax._src.lax import lax as lax_internal

#: The operations XLA:CPU computes on the bits (keeping subnormals) that a TPU may flush.
FLUSHED = (
    lax_internal.convert_element_type_p,
    lax_internal.reduce_precision_p,
    lax_internal.abs_p,
    lax_internal.neg_p,
)


def _subnormal_fields(dtype) -> tuple[type, int, int] | None:
    """`(unsigned type, exponent mask, sign bit)` of a float type that has subnormals (an
    all-zero exponent field with a nonzero significand), else None."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        return None
    fi = jnp.finfo(dtype)
    if fi.nmant == 0 or fi.smallest_subnormal == fi.smallest_normal:  # e8m0: no subnormals
        return None
    width = dtype.itemsize * 8
    if fi.bits != width:  # (4-bit types: no integer type of their width to bitcast to)
        return None
    uint = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}[width]
    exponent = ((1 << fi.nexp) - 1) << fi.nmant
    return uint, exponent, 1 << (width - 1)


def flush(x):
    """`x` with its subnormals replaced by zeros of their sign, on the bits."""
    fields = _subnormal_fields(x.dtype)
    if fields is None:
        return x
    uint, exponent, sign = fields
    b = lax.bitcast_convert_type(x, uint)
    sub = (b & uint(exponent)) == uint(0)
    return lax.select(sub, lax.bitcast_convert_type(b & uint(sign), x.dtype), x)


_lower_flush = mlir.lower_fun(flush, multiple_results=False)


def _rule(entry):
    return getattr(entry, "rule", entry)


def _single(out):
    """The one value of a lowering rule's result."""
    while isinstance(out, (list, tuple)):
        (out,) = out
    return out


def _flushing(prim):
    rules = mlir._platform_specific_lowerings["cpu"]
    exact = _rule(rules.get(prim) or mlir._lowerings[prim])

    def rule(ctx, x, **params):
        a_in, a_out = ctx.avals_in[0], ctx.avals_out[0]
        if _subnormal_fields(a_in.dtype) is not None:
            x = _single(_lower_flush(ctx.replace(avals_in=[a_in], avals_out=[a_in]), x))
        out = _single(exact(ctx, x, **params))
        if _subnormal_fields(a_out.dtype) is not None:
            out = _single(_lower_flush(ctx.replace(avals_in=[a_out], avals_out=[a_out]), out))
        return [out]

    mlir.register_lowering(prim, rule, platform="cpu")


for _prim in FLUSHED:
    _flushing(_prim)
