"""`QWeight`: a weight that the policy selected for NVFP4, wherever it is read.

`nvfp4x.quantize` replaces each selected weight array by a `QWeight` (master array,
recipe, path). Whatever the user's code does with it, every GEMM that consumes it runs
quantised, because a `QWeight` is a [quax](https://github.com/patrick-kidger/quax) value:
inside a module's `__call__` (an interpreted call) and in its own operators (`w.T`,
`x @ w`, `w * g`), each JAX primitive applied to it runs through nvfp4x's rules
(`_dispatch.py`: GEMMs quantised, layout and linear elementwise primitives giving the
weight again, everything else reading the master array).

Outside an interpreted call, a `QWeight` reads as its master array in `jax.numpy`
functions (`jnp.linalg.norm(g)`, `jnp.sum(g)`, `jnp.where(g > 0, g, 0)`): gradients of
a quantised model hold `QWeight`s, and clipping and logging code reads them so. The
`jax.numpy` functions that would multiply it as a matrix (`jnp.dot`, `jnp.einsum`, ...)
and `lax` functions refuse it with a `TypeError` naming the weight's path and the fix,
so a silent float GEMM is never possible (`_array_read`). `nvfp4x.quantized(fn)` makes
any function interpreted.

This module holds the type and its misuse errors only, below the GEMMs: `_sites` ("is
this a quantised weight?") and every feature that asks it import the type without the
rules; the rules (`QWeight.default` included) are installed by `_dispatch.py`.
"""

import functools
import operator
import sys
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import quax
from jaxtyping import Array, ArrayLike

from ._internals import refuse_lax_operand
from ._policy import Recipe
from ._prims import shaped


class WeightValue(quax.ArrayValue):
    """What quantised weights have in common (a `QWeight` and a frozen weight): a quax
    value with a `recipe`, a `path` and a `fast` flag, whose GEMMs nvfp4x runs, and
    the array operators (`w.T`, `x @ w`, `w * g`...), each run through the rules."""

    #: Whether `jax.numpy` functions other than GEMMs read it as an array outside an
    #: interpreted call (a `QWeight`, as a gradient is one; a frozen weight is not).
    reads_as_array = True

    def __array__(self, dtype=None, copy=None):
        # Host reads (`np.asarray(w)`, printing) see the master values.
        return np.asarray(type(self).materialise(self), dtype=dtype)

    @property
    def __jax_array__(self) -> Callable[[], ArrayLike]:
        # A property, as on JAX's own tracers: who asks decides (see `_array_read`).
        return _array_read(self, sys._getframe(1))

    # Array-like operators outside an interpreted call: each runs through the rules.
    @property
    def T(self):  # noqa: N802 - numpy's name
        return _op(lambda a: a.T)(self)

    @property
    def mT(self):  # noqa: N802 - numpy's name
        return _op(lambda a: a.mT)(self)

    def transpose(self, *axes):
        return _op(lambda a: a.transpose(*axes))(self)

    def reshape(self, *shape, **kwargs):
        return _op(lambda a: a.reshape(*shape, **kwargs))(self)

    def astype(self, dtype):
        return _op(lambda a: a.astype(dtype))(self)

    def __getitem__(self, index):
        return _op(lambda a: a[index])(self)

    def __matmul__(self, other):
        return _op(operator.matmul)(self, other)

    def __rmatmul__(self, other):
        return _op(operator.matmul)(other, self)

    def __mul__(self, other):
        return _op(operator.mul)(self, other)

    def __rmul__(self, other):
        return _op(operator.mul)(other, self)

    def __truediv__(self, other):
        return _op(operator.truediv)(self, other)

    def __add__(self, other):
        return _op(operator.add)(self, other)

    def __radd__(self, other):
        return _op(operator.add)(other, self)

    def __sub__(self, other):
        return _op(operator.sub)(self, other)

    def __rsub__(self, other):
        return _op(operator.sub)(other, self)

    def __neg__(self):
        return _op(operator.neg)(self)

    # Operators whose result is not the weight: arrays (through the rules, as above).
    def __pow__(self, other):
        return _op(operator.pow)(self, other)

    def __rpow__(self, other):
        return _op(operator.pow)(other, self)

    def __abs__(self):
        return _op(operator.abs)(self)

    def __lt__(self, other):
        return _op(operator.lt)(self, other)

    def __le__(self, other):
        return _op(operator.le)(self, other)

    def __gt__(self, other):
        return _op(operator.gt)(self, other)

    def __ge__(self, other):
        return _op(operator.ge)(self, other)


#: The `jax.numpy` (and `jax.scipy`, `jax.nn`) functions that multiply their operands
#: as matrices: a quantised weight read by one of them outside an interpreted call
#: would run its GEMM in float, so it refuses them.
GEMM_READERS = frozenset(
    {
        "dot",
        "vdot",
        "vecdot",
        "matmul",
        "matvec",
        "vecmat",
        "inner",
        "tensordot",
        "einsum",
        "multi_dot",
        "matrix_power",
        "convolve",
        "correlate",
        "convolve2d",
        "correlate2d",
        "cov",
        "corrcoef",
        "dot_product_attention",
    }
)

#: `lax` functions that are GEMMs (named in the refusal's message).
_LAX_GEMMS = frozenset(
    {
        "dot",
        "dot_general",
        "batch_matmul",
        "ragged_dot",
        "ragged_dot_general",
        "conv",
        "conv_general_dilated",
        "conv_with_general_padding",
        "conv_transpose",
    }
)

#: JAX array operators (`x @ w`, `x * w`, `x + w`, `x - w` with `x` an array) that
#: leave their turn to the weight's own reflected operator, which runs through the
#: rules: the product is quantised, and a scaled weight is still the weight.
_OWN_OPERATORS = frozenset({"_operator_matmul", "_operator_mul", "_operator_add", "_operator_sub"})

#: The modules where JAX asks for `__jax_array__` only to refuse it while abstracting a
#: `lax` function's operand (JAX no longer converts there): the weight refuses first.
_ABSTRACTIFY = ("jax._src.core", "jax._src.dtypes")

_NUMPY_LIKE = ("jax._src.numpy.", "jax._src.scipy.", "jax._src.nn.")

_PUBLIC = (
    ("jax._src.numpy.linalg", "jnp.linalg."),
    ("jax._src.numpy.", "jnp."),
    ("jax._src.scipy.signal", "jax.scipy.signal."),
    ("jax._src.nn.", "jax.nn."),
    ("jax._src.lax.", "lax."),
)


def _public_name(module: str, name: str) -> str:
    for prefix, public in _PUBLIC:
        if module.startswith(prefix):
            return public + name
    return name


#: Modules whose frames stand between a caller and the weight's own code: Equinox's
#: attribute access and the jaxtyping/beartype wrappers (the test run checks types).
_WRAPPERS = ("equinox._module", "jaxtyping.", "beartype.")


def _caller(frame: Any) -> Any:
    """`frame`, or the first frame above it that is not one of `_WRAPPERS`."""
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith(_WRAPPERS):
        frame = frame.f_back
    return frame


def _array_read(w: Any, frame: Any) -> Callable[[], ArrayLike]:
    """`w.__jax_array__`, as looked up from `frame`: JAX's conversion to an array.

    JAX's `jax.numpy` functions and array operators convert an object with
    `__jax_array__` to an array. A quantised weight lets them, except where that array
    would be multiplied as a matrix (a GEMM would run unquantised, silently): the
    `jax.numpy` GEMMs (`GEMM_READERS`) raise a `TypeError`, `lax` functions (which JAX
    does not convert for) a `ValueError`, naming the weight and the fix. JAX's array operators for
    which the weight has its own (`x @ w`, `x * w`, ...) see no `__jax_array__`, so that
    the weight's operator runs; so does every caller outside JAX (`eqx.is_array_like`,
    quax: a quantised weight is a quax value, not an array)."""
    frame = _caller(frame)
    module = frame.f_globals.get("__name__", "")
    if not module.startswith("jax."):
        raise AttributeError("__jax_array__")
    if module == "jax._src.numpy.array_methods" and frame.f_code.co_name in _OWN_OPERATORS:
        raise AttributeError("__jax_array__")
    abstractify = module in _ABSTRACTIFY
    reader = None  # the JAX function that reads the weight, as (module, name)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("jax."):
            break
        name = frame.f_code.co_name
        if abstractify and module.startswith("jax._src.lax."):
            reader = (module, name)  # the outermost `lax` function
        elif not abstractify and name in GEMM_READERS and module.startswith(_NUMPY_LIKE):
            reader = reader or (module, name)
        frame = frame.f_back
    if abstractify:  # a ValueError, as JAX's own here: JAX rewraps a TypeError
        raise ValueError(_misuse(w, reader, abstractify))
    if reader is not None:
        raise TypeError(_misuse(w, reader, abstractify))
    if not w.reads_as_array:
        raise TypeError(
            f"nvfp4x: `{w.path}` is a frozen weight, read by a `jax.numpy` function "
            "outside the model's call. Run that code under `nvfp4x.quantized(fn)`: there "
            "every read but a GEMM sees what training read."
        )
    return functools.partial(type(w).materialise, w)


def _lax_operand(w: Any) -> None:
    """JAX's hook for a `lax` function's operand that is not an array (see
    `_install_lax_refusal`): refuse it, naming the weight and the `lax` function."""
    frame, reader = _caller(sys._getframe(1)), None
    while frame is not None and frame.f_globals.get("__name__", "").startswith("jax."):
        if frame.f_globals["__name__"].startswith("jax._src.lax."):
            reader = (frame.f_globals["__name__"], frame.f_code.co_name)
        frame = frame.f_back
    raise ValueError(_misuse(w, reader, True))


def _misuse(w: Any, reader: tuple[str, str] | None, lax_operand: bool) -> str:
    """The message of a quantised weight's refused read (see `_array_read`)."""
    fn = "a `lax` function" if reader is None else f"`{_public_name(*reader)}`"
    kind = "quantised" if w.reads_as_array else "frozen"
    array = " `.array` is its master (or gradient) array." if w.reads_as_array else ""
    if lax_operand and (reader is None or reader[1] not in _LAX_GEMMS):
        return (
            f"nvfp4x: {fn} got the {kind} weight `{w.path}` ({type(w).__name__}), not an "
            "array. Run the code under `nvfp4x.quantized(fn)`, where a quantised weight "
            "is its array in every use but a GEMM, or read it with a `jax.numpy` "
            f"function.{array}"
        )
    return (
        f"nvfp4x: {fn} would multiply the {kind} weight `{w.path}` as a plain float "
        "array, outside a quantised call: its GEMM would run unquantised. Call the "
        "model or layer that holds it (its `__call__` runs quantised), or run the code "
        f"under `nvfp4x.quantized(fn)`.{array}"
    )


refuse_lax_operand(WeightValue, _lax_operand)


class QWeight(WeightValue):
    """A weight selected for NVFP4 (or another recipe) by [`nvfp4x.quantize`][].

    It behaves as its master array in every non-GEMM use and runs every GEMM that
    consumes it under `recipe`. An optimiser steps `array` (the only float leaf besides
    a telemetry `probe`); [`nvfp4x.dequantize`][] puts `array` back.

    **Fields:** `array` (the master weight, any float dtype, possibly stacked), `probe`
    (None unless telemetry is on), `enabled` (None, or a boolean array of the weight's
    stack shape: where false, the GEMMs run unquantised in float32; e.g. a scanned stack
    whose first and last slices stay high-precision), `recipe` and `path` (static: the
    policy's recipe, and the path the policy matched, used by reports), `fast` (static:
    run GEMMs on the device's fast exact operand dtype), `scale_group` (static: the
    tensor scale group the policy's `tensor_scale_groups` put the weight in, or None;
    [`nvfp4x.freeze`][] gives a group's NVFP4 weights one tensor scale), `kernel_axes`
    and `groups` (static: for a convolution kernel, its axes' roles as
    `lax.conv_general_dilated`'s kernel spec, (out channels, in channels, window...), and
    its feature group count; the kernel's GEMM matrix is `gemm_matrix(array, ...)`; None
    and 1 for a linear layer's weight).
    """

    array: Array
    recipe: Recipe = eqx.field(static=True)
    path: str = eqx.field(static=True)
    fast: bool = eqx.field(static=True, default=True)
    probe: Array | None = None
    enabled: Array | None = None
    scale_group: str | None = eqx.field(static=True, default=None)
    kernel_axes: tuple[int, ...] | None = eqx.field(static=True, default=None)
    groups: int = eqx.field(static=True, default=1)

    @property
    def stack_shape(self) -> tuple[int, ...]:
        """The leading axes of a stack of layers (`eqx.filter_vmap`-made): the weight's
        axes before its matrix `(out, in)` (or, for a convolution, before its kernel)."""
        per_layer = 2 if self.kernel_axes is None else len(self.kernel_axes)
        return tuple(self.array.shape[: self.array.ndim - per_layer])

    @property
    def problem_shape(self) -> tuple[int, ...]:
        """`stack_shape`, then the feature groups of a grouped convolution: the leading
        axes of the weight's independent GEMMs (each its own scales)."""
        return self.stack_shape + ((self.groups,) if self.groups > 1 else ())

    def __check_init__(self):
        dtype = getattr(self.array, "dtype", None)
        if dtype is not None and jnp.issubdtype(dtype, jnp.complexfloating):
            where = f"layer `{self.path}`" if self.path else "the layer"
            raise TypeError(
                f"The weight of {where} is complex ({dtype}); nvfp4x's recipes compute real "
                "products and would drop its imaginary part. Leave the layer out of the "
                "policy (a rule `(path, None)`)."
            )

    def aval(self):
        return shaped(self.array.shape, self.array.dtype)

    def materialise(self) -> Array:
        return self.array


def _op(fn: Callable) -> Callable:
    return quax.quaxify(fn)
