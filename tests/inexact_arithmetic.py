"""A pytest plugin that gives XLA:CPU a GPU's loose float arithmetic.

XLA:GPU's float32 `/` is not correctly rounded (measured 1 ulp off for 1.15% of
reciprocals on an H200) and its float32 dots at default precision multiply in TF32 (10
mantissa bits). A CPU does neither, so a library leaning on either passes every test
on a CPU and fails on a GPU. Loaded first (`python -m pytest -p inexact_arithmetic`,
with `tests/` on the path), this plugin changes how XLA:CPU lowers two primitives:

- every float `div` (float32, bfloat16, float16) gives the correctly rounded quotient
  nudged one ulp up or down for about one quotient in eight, chosen by a hash of its
  bits (so the same inputs give the same result, eagerly and under `jit`), unless the
  divisor is a power of two (exact on every backend);
- every float32 `dot_general` that does not ask for `precision=HIGHEST` on both
  operands rounds them to bfloat16's precision (8 significant bits, to nearest) first:
  coarser than TF32 (11), as some GPU dot algorithms are, so that exactly the operands
  the library may leave at default precision (those exact in bfloat16) pass unchanged;
- a float cast whose operand is a chain of float casts starting from its own type
  (`f32 -> bf16 -> f32`) reads that start, unrounded, as after XLA:GPU's
  `simplify-fp-conversions` pass (on by default, `xla_allow_excess_precision`), so a
  narrowing cast meant to round must be a `lax.reduce_precision`, which XLA keeps.
  (Rewritten in each lowered program, function by function: XLA's pass also sees
  chains through calls, after inlining.)

`tests/test_exactness.py` runs the format and GEMM tests under it in a subprocess: their
bits must not change. Import-time side effect only; nothing here is part of nvfp4x.
"""

import jax.numpy as jnp
from jax import lax
from jax._src.interpreters import mlir
from jax._src.lax import lax as lax_internal
from jax._src.lib.mlir import ir

#: `(int dtype, uint dtype, odd multiplier, shift, mantissa mask)` per float dtype: the
#: quotient's bits times the multiplier, shifted down to 4 bits, pick the nudge (2 of 16).
_HASH = {
    jnp.dtype(jnp.float32): (jnp.int32, jnp.uint32, 0x9E3779B1, 28, 0x7FFFFF),
    jnp.dtype(jnp.bfloat16): (jnp.int16, jnp.uint16, 0x9E37, 12, 0x7F),
    jnp.dtype(jnp.float16): (jnp.int16, jnp.uint16, 0x9E37, 12, 0x3FF),
}
#: Stored mantissa bits a default-precision float32 dot keeps here (TF32: 10, bfloat16: 7).
LOOSE_MANTISSA_BITS = 7


def _nudge(q, y):
    """`q` one ulp up (hash 0) or down (hash 1) of sixteen, where `y` is not a power of two
    and `q` is finite and nonzero."""
    ity, uty, mul, shift, mantissa = _HASH[q.dtype]
    y = jnp.broadcast_to(y.astype(q.dtype), q.shape)
    pow2 = (lax.bitcast_convert_type(y, ity) & jnp.array(mantissa, ity)) == jnp.array(0, ity)
    bits = lax.bitcast_convert_type(q, ity)
    h = (lax.bitcast_convert_type(bits, uty) * jnp.array(mul, uty)) >> jnp.array(shift, uty)
    one = jnp.array(1, ity)
    step = jnp.where(h == jnp.array(0, uty), one, jnp.where(h == jnp.array(1, uty), -one, 0 * one))
    ok = jnp.isfinite(q) & (q != jnp.zeros((), q.dtype)) & ~pow2
    return jnp.where(ok, lax.bitcast_convert_type(bits + step, q.dtype), q)


def _rule(entry):
    return getattr(entry, "rule", entry)


_exact_div = _rule(mlir._lowerings[lax_internal.div_p])
_lower_nudge = mlir.lower_fun(_nudge, multiple_results=False)


def _inexact_div(ctx, x, y):
    out = _exact_div(ctx, x, y)
    aval = ctx.avals_out[0]
    if aval.dtype not in _HASH:
        return out
    q = out[0] if isinstance(out, (list, tuple)) else out
    return _lower_nudge(ctx.replace(avals_in=[aval, ctx.avals_in[1]]), q, y)


_cpu_rules = mlir._platform_specific_lowerings["cpu"]
_exact_dot = _rule(_cpu_rules.get(lax_internal.dot_general_p) or mlir._lowerings[lax.dot_general_p])
_HIGHEST = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)


def _loose_dot(lhs, rhs, **params):
    def loose(v):
        return lax.reduce_precision(v, exponent_bits=8, mantissa_bits=LOOSE_MANTISSA_BITS)

    return lax.dot_general_p.bind(loose(lhs), loose(rhs), **dict(params, precision=_HIGHEST))


def _inexact_dot(ctx, lhs, rhs, **params):
    f32 = jnp.dtype(jnp.float32)
    loose = params.get("precision") != _HIGHEST
    if loose and any(a.dtype == f32 for a in ctx.avals_in):
        lower = mlir.lower_fun(lambda a, b: _loose_dot(a, b, **params), multiple_results=False)
        return lower(ctx, lhs, rhs)
    return _exact_dot(ctx, lhs, rhs, **params)


mlir.register_lowering(lax_internal.div_p, _inexact_div, platform="cpu")
mlir.register_lowering(lax.dot_general_p, _inexact_dot, platform="cpu")


def _float_convert(value) -> ir.Operation | None:
    """The `stablehlo.convert` whose float result `value` is, or None."""
    owner = value.owner
    op = getattr(owner, "operation", owner)
    if not isinstance(op, ir.Operation) or op.name != "stablehlo.convert":
        return None
    return op if isinstance(ir.RankedTensorType(value.type).element_type, ir.FloatType) else None


def _elide_cast_chains(op: ir.Operation) -> None:
    """Within each function of `op`, a float cast whose operand is a chain of float
    casts starting from its own type reads that start instead (XLA:GPU's
    `simplify-fp-conversions`)."""
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                inner = inner.operation
                _elide_cast_chains(inner)
                if inner.name != "stablehlo.convert" or _float_convert(inner.results[0]) is None:
                    continue
                start = inner.operands[0]
                while (cast := _float_convert(start)) is not None:
                    start = cast.operands[0]
                if start != inner.operands[0] and start.type == inner.results[0].type:
                    inner.results[0].replace_all_uses_with(start)


_lower_jaxpr_to_module = mlir.lower_jaxpr_to_module


def _lower_with_cast_chains_elided(*args, **kwargs):
    result = _lower_jaxpr_to_module(*args, **kwargs)
    _elide_cast_chains(result.module.operation)
    return result


mlir.lower_jaxpr_to_module = _lower_with_cast_chains_elided
