"""The private internals of quax and JAX that nvfp4x relies on, each behind one function
here: a new quax or JAX release that moves them breaks this module only.

- quax's tracer (`tracer_value`: the value an interpreted call's tracer carries) and
  its trace (`install_custom_vjp`: quax has no rule for `jax.custom_vjp` calls);
- JAX's hook for a `lax` operand of a foreign type (`refuse_lax_operand`: a quantised
  weight passed to a `lax` function gets nvfp4x's message instead of JAX's).
"""

from collections.abc import Callable
from typing import Any

import jax
from jax._src import dtypes as _jax_dtypes
from quax._trace import _QuaxTrace, _QuaxTracer
from quax._values import _dense, _DenseArrayValue


def tracer_value(x: Any) -> Any:
    """The quax value behind `x`: the value its tracer carries inside an interpreted
    call (a `QWeight`, say), else `x` itself."""
    return x.value if isinstance(x, _QuaxTracer) else x


def install_custom_vjp(unwrap: Callable[[Any], Any]) -> None:
    """Give quax a rule for `jax.custom_vjp` calls (it has none): they run on plain
    arrays, with the user's own backward; `unwrap(value)` turns each quax value that
    enters one into its array (and may report it). Installed once, also across reloads."""

    def process_custom_vjp_call(self, primitive, fun, fwd, bwd, tracers, **params):
        arrays = []
        for t in tracers:
            v = self.to_value(t)
            arrays.append(v.array if isinstance(v, _DenseArrayValue) else unwrap(v))
        avals = tuple(jax.typeof(a) for a in arrays)
        outs = primitive.bind_with_trace(
            self.parent_trace, tuple(arrays), avals, dict(params, subfuns=(fun, fwd, bwd))
        )
        return [_QuaxTracer(self, _dense(o)) for o in outs]

    if not hasattr(_QuaxTrace, "_nvfp4x_custom_vjp"):
        _QuaxTrace.process_custom_vjp_call = process_custom_vjp_call
        # a marker of nvfp4x's on quax's class
        _QuaxTrace._nvfp4x_custom_vjp = True  # pyright: ignore[reportAttributeAccessIssue]


def refuse_lax_operand(cls: type, refuse: Callable[[Any], None]) -> None:
    """Make a `lax` function given an instance of `cls` (not a JAX type) call
    `refuse(instance)`, which raises a `ValueError` (JAX rewraps a `TypeError` into its
    own message, naming neither the operand nor the fix)."""
    _jax_dtypes.canonicalize_value_handlers[cls] = refuse
