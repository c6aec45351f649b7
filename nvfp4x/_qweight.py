"""`QWeight`: a weight that the policy selected for NVFP4, wherever it is read.

`nvfp4x.quantize` replaces each selected weight array by a `QWeight` (master array,
recipe, path). Whatever the user's code does with it, every GEMM that consumes it runs
quantised, because a `QWeight` is a [quax](https://github.com/patrick-kidger/quax) value:
inside a module's `__call__` (see `interpreted`) and in its own operators (`w.T`, `x @ w`,
`w * g`), each JAX primitive applied to it is dispatched here:

- `dot_general` (`x @ w.T`, `w @ x`, `jnp.einsum`, `jnp.dot`, `lax.dot_general`,
  called Linears) runs as the quantised GEMM `nvfp4x.qdot` on the *effective* weight:
  fprop `Q(x) @ Q(W).T` (x and W blocked along the contraction axis), dgrad
  `Q(dy) @ Q(W)` (along the output features), wgrad `Q(dy).T @ Q(x)` (along tokens).
- Layout and linear elementwise primitives (transpose, reshape, slicing, dtype casts,
  `w * g`, `w / norm`, ...) give a `QWeight` of their result: the effective weight of
  `eqx.nn.WeightNorm`, `eqx.nn.SpectralNorm` or a user's scaling is what gets quantised.
  (SpectralNorm's normaliser σ is computed from the master weight: `_spectral_norm_call`.)
- Anything else (reductions, gathers such as an embedding lookup, `stop_gradient`)
  reads the master array: those are not GEMMs.
- `jax.checkpoint` and `jax.custom_vjp` bodies are looked into; a primitive nvfp4x
  cannot look into that holds a GEMM warns, naming the weight.

Outside an interpreted call, a `QWeight` reads as its master array in `jax.numpy`
functions (`jnp.linalg.norm(g)`, `jnp.sum(g)`, `jnp.where(g > 0, g, 0)`): gradients of
a quantised model hold `QWeight`s, and clipping and logging code reads them so. The
`jax.numpy` functions that would multiply it as a matrix (`jnp.dot`, `jnp.einsum`, ...)
and `lax` functions refuse it with a `TypeError` naming the weight's path and the fix,
so a silent float GEMM is never possible (`_array_read`). `nvfp4x.quantized(fn)` makes
any function interpreted.
"""

import dataclasses
import functools
import math
import operator
import sys
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import quax
from jax import lax
from jaxtyping import Array, ArrayLike

from ._axes import explicit_axes_as_auto
from ._conv import check_conv_kernel, conv_gemm, conv_qdot, gemm_matrix, runs_fast
from ._formats import widest_float
from ._internals import install_custom_vjp, refuse_lax_operand, tracer_value
from ._policy import Recipe
from ._prims import (
    GEMM_PRIMITIVES as GEMM_PRIMITIVES,  # (for `_coverage`)
    Jaxpr,
    eval_jaxpr,
    jaxpr_has_gemm,
    ragged_dot_general_p,
    remat_p,
    shaped,
)
from ._probe import gemm_with_probe
from ._ragged import grouped_qdot


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

    @staticmethod
    def default(primitive, values, params):
        return default_rule(primitive, values, params)


def _op(fn: Callable) -> Callable:
    return quax.quaxify(fn)


def quantized(fn: Callable) -> Callable:
    """Run `fn` with every GEMM on a quantised weight quantised, however `fn` reads it.

    Modules that [`nvfp4x.quantize`][] returns already run their `__call__` this way;
    use this for other functions that read quantised weights directly, e.g. a loss
    function computing tied logits with `jnp.einsum("td,vd->tv", h, model.embed.weight)`.

    **Arguments:**

    - `fn`: any function; arguments may hold quantised weights anywhere.

    **Returns:** a function with the same signature and results.

    ```python
    logits = nvfp4x.quantized(lambda m, h: jnp.einsum("td,vd->tv", h, m.lm_head.weight))(
        qmodel, h
    )
    ```
    """
    return _Interpreted(fn)


#: How many interpreted calls are running (their bodies may trace layers whose weights
#: are plain tracers that the interpretation sees afterwards).
_DEPTH = [0]


def interpreting() -> bool:
    """Whether an interpreted call (a quantised module's `__call__`, `quantized`) runs."""
    return _DEPTH[0] > 0


class _Interpreted:
    def __init__(self, fn: Callable):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        _DEPTH[0] += 1
        try:
            return quax.quaxify(self.fn)(*args, **kwargs)
        finally:
            _DEPTH[0] -= 1


# --- the GEMM rule ---


@dataclasses.dataclass(frozen=True)
class Layout:
    """How `weight_gemm` arranges a weight for its GEMM: `layout(e)` is the weight array
    `e` as `(batch..., N, K)`, its axes taken in `order` (batch axes, output features,
    contraction) and reshaped to `shape`.

    The batch axes are the `dot_general`'s batch axes of the weight, then its *stack*
    axes: the leading axes (all but the last two) that the product leaves free. A weight
    of more than two axes is a stack of matrices (`eqx.filter_vmap`-built layers,
    experts), each slice an independent problem with its own scales, as `freeze`,
    telemetry and `QWeight.enabled` count it; a `jax.vmap` over such a stack inside a
    quantised module arrives here as those free leading axes. `stack` is the order of
    the weight's leading axes as batch axes when the batch axes are exactly those (a
    per-slice array, the probe or the mask, is then arranged by `per_slice`), else None.
    `stored`: the arranged weight is the stored array itself."""

    order: tuple[int, ...]
    shape: tuple[int, ...]
    stored: bool
    stack: tuple[int, ...] | None

    def __call__(self, e: Array) -> Array:
        if self.stored:
            return e
        return jnp.transpose(e, self.order).reshape(self.shape)

    def per_slice(self, p: Array | None) -> Array | None:
        """A per-slice array (leading axes: the weight's stack axes) in batch order."""
        if p is None or self.stack is None or self.stack == tuple(range(len(self.stack))):
            return p
        return jnp.transpose(p, (*self.stack, *range(len(self.stack), p.ndim)))


def weight_gemm(
    shape: tuple, a: ArrayLike, w_is_lhs: bool, dimension_numbers, out_dtype, gemm: Callable
) -> Array:
    """`dot_general` of a weight of shape `shape` with the activation `a`, as one GEMM
    `gemm(x, layout, nbatch)` on `x: (batch..., tokens..., K)`, `layout` a `Layout` (the
    weight as `(batch..., N, K)`; its stack axes are batch axes, `x` broadcast along
    them). The output is put back in `dot_general`'s layout."""
    (lc, rc), (lb, rb) = dimension_numbers
    wc, ac = (lc, rc) if w_is_lhs else (rc, lc)
    wb, ab = (lb, rb) if w_is_lhs else (rb, lb)
    a = jnp.asarray(a)
    ndim = len(shape)
    free = [i for i in range(ndim) if i not in wc and i not in wb]
    stack = [i for i in free if i < ndim - 2]  # each slice its own problem
    wf = [i for i in free if i >= ndim - 2]
    af = [i for i in range(a.ndim) if i not in ac and i not in ab]
    k = math.prod(shape[i] for i in wc)
    n_shape = tuple(shape[i] for i in wf)
    batch = (*wb, *stack)
    batch_shape = tuple(shape[i] for i in batch)
    x = jnp.transpose(a, (*ab, *af, *ac))
    x = x.reshape(x.shape[: len(ab) + len(af)] + (k,))
    if stack:  # the activation is shared by every slice of the stack
        x = jnp.expand_dims(x, tuple(range(len(ab), len(batch))))
        x = jnp.broadcast_to(x, batch_shape + x.shape[len(batch) :])
    order = (*batch, *wf, *wc)
    arranged = batch_shape + (math.prod(n_shape), k)
    leading = tuple(range(ndim - 2))
    layout = Layout(
        order=order,
        shape=arranged,
        stored=order == tuple(range(ndim)) and arranged == tuple(shape),
        stack=batch if sorted(batch) == list(leading) else None,
    )
    y = gemm(x, layout, len(batch))  # (batch..., tokens..., N)
    y = y.reshape(y.shape[:-1] + n_shape)
    nb, ns, nt, nn = len(wb), len(stack), len(af), len(n_shape)
    # dot_general's layout: (batch..., lhs free..., rhs free...), the weight's free axes
    # being its stack axes, then its other free axes.
    tokens = tuple(range(nb + ns, nb + ns + nt))
    stacked = tuple(range(nb, nb + ns))
    features = tuple(range(nb + ns + nt, nb + ns + nt + nn))
    if w_is_lhs:
        perm = (*range(nb), *stacked, *features, *tokens)
    else:
        perm = (*range(nb), *tokens, *stacked, *features)
    return jnp.transpose(y, perm).astype(out_dtype)


def _qweight_gemm(w: QWeight, x: Array, layout: Layout, nb: int) -> Array:
    """The quantised GEMM of a `QWeight` (its array arranged by `layout`)."""
    wm = layout(w.array)
    probe, enabled = layout.per_slice(w.probe), layout.per_slice(w.enabled)
    fn = functools.partial(_gemm, recipe=w.recipe, fast=w.fast, name=w.path)
    for _ in range(nb):
        axes = (None if v is None else 0 for v in (probe, enabled))
        fn = jax.vmap(fn, in_axes=(0, 0, *axes))
    return fn(x, wm, probe, enabled)


def _gemm(x, w, probe, enabled, *, recipe: Recipe, fast: bool, name: str) -> Array:
    seed = jnp.zeros((2,), jnp.uint32)
    matmul = functools.partial(gemm_with_probe, recipe=recipe, fast=fast, name=name)
    return explicit_axes_as_auto(matmul, x, (w, seed, probe, enabled), (w.shape, w))


def gemm_out_dtype(a, b, preferred_element_type):
    if preferred_element_type is not None:
        return preferred_element_type
    return widest_float(jnp.result_type(a), jnp.result_type(b))


def _dot_rule(lhs, rhs, *, dimension_numbers, precision=None, preferred_element_type=None, **_):
    dtype = gemm_out_dtype(lhs, rhs, preferred_element_type)
    if isinstance(lhs, QWeight) and isinstance(rhs, QWeight):
        _report_unquantised(lhs.path, "a product of two quantised weights")
        return lax.dot_general(
            lhs.array,
            rhs.array,
            dimension_numbers,
            precision=precision,
            preferred_element_type=dtype,
        )
    w_is_lhs = isinstance(lhs, QWeight)
    w, a = (lhs, rhs) if w_is_lhs else (rhs, lhs)
    gemm = functools.partial(_qweight_gemm, w)
    return weight_gemm(w.array.shape, a, w_is_lhs, dimension_numbers, dtype, gemm)


@quax.register(lax.dot_general_p)
def _(lhs: QWeight, rhs: ArrayLike, **params):
    return _dot_rule(lhs, rhs, **params)


@quax.register(lax.dot_general_p)
def _(lhs: ArrayLike, rhs: QWeight, **params):
    return _dot_rule(lhs, rhs, **params)


@quax.register(lax.dot_general_p)
def _(lhs: QWeight, rhs: QWeight, **params):
    return _dot_rule(lhs, rhs, **params)


def ragged_rule(lhs, rhs, group_sizes, gemm: Callable, *, ragged_dot_dimension_numbers, **params):
    """`lax.ragged_dot` / `ragged_dot_general` with a quantised expert weight (a mixture
    of experts: tokens `(T, k)` sorted by expert times experts `(G, n, k)` or `(G, k, n)`),
    run as `gemm(w, x, experts_kn, group_sizes)` (`experts_kn`: the weight is stored
    `(G, k, n)`); for a `QWeight` the NVFP4 grouped GEMM (`_ragged.py`): fprop, dgrad and
    wgrad per expert on its own tokens, each expert its own scales. Other layouts (the
    weight as the ragged operand, batch or contracting raggedness, a `group_offset`) and
    a stack with an `enabled` mask are reported and run unquantised."""
    dims = ragged_dot_dimension_numbers
    (lc, rc), (lb, rb) = dims.dot_dimension_numbers
    w, a = rhs, lhs
    supported = (
        isinstance(w, WeightValue)
        and not isinstance(a, quax.ArrayValue)
        and params.get("group_offset") is None
        and jnp.ndim(a) == 2
        and len(w.shape) == 3
        and tuple(dims.lhs_ragged_dimensions) == (0,)
        and tuple(dims.rhs_group_dimensions) == (0,)
        and not lb
        and not rb
        and tuple(lc) == (1,)
        and tuple(rc) in ((1,), (2,))
        and getattr(w, "enabled", None) is None
    )
    if not supported:
        for v in (lhs, rhs):
            if isinstance(v, WeightValue):
                why = "a `ragged_dot` in a layout other than tokens `(T, k)` times experts "
                why += "`(G, n, k)` or `(G, k, n)`, or with an `enabled` mask"
                _report_unquantised(getattr(v, "path", ""), why)
        arrays = [type(v).materialise(v) if isinstance(v, quax.ArrayValue) else v
                  for v in (lhs, rhs, group_sizes)]  # fmt: skip
        return ragged_dot_general_p.bind(*arrays, ragged_dot_dimension_numbers=dims, **params)
    dtype = gemm_out_dtype(lhs, rhs, params.get("preferred_element_type"))
    sizes = jnp.asarray(group_sizes).astype(jnp.int32)
    return gemm(w, jnp.asarray(a), tuple(rc) == (1,), sizes).astype(dtype)


def _qweight_grouped(w: QWeight, x: Array, experts_kn: bool, sizes: Array) -> Array:
    experts = jnp.swapaxes(w.array, 1, 2) if experts_kn else w.array  # (G, n, k)
    return grouped_qdot(x, experts, sizes, recipe=w.recipe, fast=w.fast, name=w.path)


@quax.register(ragged_dot_general_p)
def _(lhs: ArrayLike, rhs: QWeight, group_sizes: ArrayLike, **params):
    return ragged_rule(lhs, rhs, group_sizes, _qweight_grouped, **params)


@quax.register(ragged_dot_general_p)
def _(lhs: QWeight, rhs: ArrayLike | QWeight, group_sizes: ArrayLike, **params):
    return ragged_rule(lhs, rhs, group_sizes, _qweight_grouped, **params)


# --- convolutions: their GEMM (`_conv.py`) ---


@quax.register(lax.conv_general_dilated_p)
def _(lhs: ArrayLike, rhs: QWeight, **params):
    """A convolution whose kernel is quantised, run as its GEMM (`_conv.py`): the
    input's patches (kernel window x input channels, the contraction) times the kernel
    as `(out channels, window x in channels)` (`gemm_matrix`); a grouped convolution as
    one such GEMM per group, each its own problem with its own scales. fprop, dgrad and
    wgrad are `qdot`'s on the patches (the reference), or the same GEMMs as real
    convolutions when the input channels fill whole blocks (`runs_fast`)."""
    axes = check_conv_kernel(rhs, params["dimension_numbers"][1], params["feature_group_count"])
    wm = gemm_matrix(rhs.array, axes, rhs.groups)

    def gemm(x, nb):
        fn = functools.partial(_gemm, recipe=rhs.recipe, fast=rhs.fast, name=rhs.path)
        if nb:  # feature groups: the probe (if any) has one row per group
            fn = jax.vmap(fn, in_axes=(0, 0, None if rhs.probe is None else 0, None))
        return fn(x, wm, rhs.probe, rhs.enabled)

    def fast(x, geom, nb):
        fn = functools.partial(
            conv_qdot, recipe=rhs.recipe, fast=rhs.fast, name=rhs.path, geom=geom
        )
        return (jax.vmap(fn) if nb else fn)(x, wm)

    shape = tuple(rhs.array.shape)
    quick = len(shape) == len(axes) and runs_fast(
        rhs.recipe, shape[axes[1]], rhs.probe, rhs.enabled
    )
    return conv_gemm(
        lhs,
        shape,
        gemm,
        path=rhs.path,
        rhs_dtype=rhs.array.dtype,
        fast=fast if quick else None,
        **params,
    )


# --- everything else ---

#: Primitives after which an array is still the same values, laid out or typed anew.
LAYOUT = frozenset(
    {
        lax.transpose_p,
        lax.reshape_p,
        lax.squeeze_p,
        lax.broadcast_in_dim_p,
        lax.convert_element_type_p,
        lax.copy_p,
        lax.reduce_precision_p,
    }
)

# Primitives whose result is still "the weight" (its effective value) when it has the
# weight's shape: layout changes, casts and the linear elementwise operations.
_CARRY = LAYOUT | {
    lax.neg_p,
    lax.mul_p,
    lax.div_p,
    lax.add_p,
    lax.sub_p,
    lax.slice_p,
    lax.rev_p,
    lax.select_n_p,
}


def default_rule(primitive, values, params):
    """Every primitive without a rule of its own, applied to quantised weights (a
    `QWeight` or a frozen weight, anything with `materialise`, `recipe`, `path`, `fast`
    and `probe`): computed on the master (or decoded) values; the result is a `QWeight`
    again when it is still the weight (see `_CARRY`)."""
    # QWeights or frozen weights: both have `recipe`, `path`, `fast`, `shape`
    weights: list[Any] = [v for v in values if isinstance(v, WeightValue)]
    arrays = [type(v).materialise(v) if isinstance(v, quax.ArrayValue) else v for v in values]
    if _holds_gemm(params):
        for w in weights:
            _report_unquantised(w.path, f"`{primitive.name}`, which nvfp4x cannot look into")
    out = primitive.bind(*arrays, **params)
    if primitive.multiple_results or primitive not in _CARRY:
        return out
    src = weights[0]
    carried = out.ndim >= 2 and jnp.issubdtype(out.dtype, jnp.inexact)
    if primitive in (lax.reshape_p, lax.broadcast_in_dim_p):
        carried = carried and out.size == math.prod(src.shape)
    elif primitive is lax.slice_p:
        carried = carried and out.ndim == len(src.shape)
    elif primitive not in (lax.transpose_p, lax.squeeze_p):
        # Elementwise: the weight was not broadcast up into something larger.
        carried = carried and any(tuple(w.shape) == out.shape for w in weights)
    if not carried:
        return out
    probe, enabled = getattr(src, "probe", None), getattr(src, "enabled", None)
    # A convolution kernel laid out or scaled anew is still one (same axes' roles).
    same = out.ndim == len(src.shape)
    kernel_axes = getattr(src, "kernel_axes", None) if same else None
    if kernel_axes is not None and primitive is lax.transpose_p:
        perm = list(params["permutation"])
        kernel_axes = tuple(perm.index(a) for a in kernel_axes)
    groups = getattr(src, "groups", 1) if kernel_axes is not None else 1
    return QWeight(out, src.recipe, src.path, src.fast, probe, enabled, None, kernel_axes, groups)


def _holds_gemm(params: dict) -> bool:
    """Whether a higher-order primitive's parameters hold a jaxpr with a GEMM."""
    for v in params.values():
        jaxpr = getattr(v, "jaxpr", v)
        if isinstance(jaxpr, Jaxpr) and jaxpr_has_gemm(jaxpr):
            return True
    return False


#: Open `record_unquantised()` blocks: each collects `(path, why)` of weights that
#: reached a GEMM unquantised while it is open (`nvfp4x.coverage` reads them).
_RECORDERS: list[list[tuple[str, str]]] = []


class record_unquantised:  # noqa: N801 - a context manager, used as a function
    """`with record_unquantised() as seen:` collects the unquantised uses traced inside."""

    def __enter__(self) -> list[tuple[str, str]]:
        self.seen: list[tuple[str, str]] = []
        _RECORDERS.append(self.seen)
        return self.seen

    def __exit__(self, *exc) -> None:
        _RECORDERS.remove(self.seen)


def _report_unquantised(path: str, why: str) -> None:
    for seen in _RECORDERS:
        seen.append((path, why))
    warnings.warn(
        f"nvfp4x: the weight `{path}` selected by the policy reached {why}; the GEMMs "
        "there run unquantised. Rewrite that use as `x @ w.T`, `jnp.einsum` or "
        "`lax.dot_general` on the weight, or exclude the weight in the policy.",
        UserWarning,
        stacklevel=2,
    )


# `jax.checkpoint`: look into the body (quax itself would read the master array).
@quax.register(remat_p)
def _(*args: quax.ArrayValue | ArrayLike, jaxpr, prevent_cse, differentiated, policy):
    body = quax.quaxify(functools.partial(eval_jaxpr, jaxpr, ()))
    fn = jax.checkpoint(lambda *a: body(*a), prevent_cse=prevent_cse, policy=policy)
    return fn(*args)


def _custom_vjp_operand(v: Any) -> Any:
    """A quax value entering a `jax.custom_vjp` call (which runs on plain arrays, with
    the user's own backward): a quantised weight is reported, and its master array
    enters."""
    if isinstance(v, QWeight):
        _report_unquantised(v.path, "a `jax.custom_vjp` function")
        return v.array
    return v


install_custom_vjp(_custom_vjp_operand)


# --- modules whose calls are interpreted ---


def as_qweight(x: Any) -> Any:
    """The `QWeight` behind `x`: `x` itself, or, inside an interpreted call, the value
    its tracer carries (a layer that runs its own GEMM reads it directly)."""
    return tracer_value(x)


_M = TypeVar("_M", bound=eqx.Module)


#: The name scope of a weight's normaliser (`eqx.nn.SpectralNorm`'s σ): its
#: matrix-vector products read the master weight on purpose (`nvfp4x.coverage` lists
#: them as `normaliser` GEMMs, not as a selected weight that reached a GEMM unquantised).
NORMALISER = "nvfp4x_normaliser"


def _power_iteration(weight: Array, u: Array, v: Array, eps: float) -> tuple[Array, Array]:
    # Equinox's `eqx.nn.SpectralNorm` power iteration, the same arithmetic.
    u = weight @ v
    u = u / jnp.maximum(eps, jnp.sqrt(jnp.sum(u**2)))
    v = weight.T @ u
    v = v / jnp.maximum(eps, jnp.sqrt(jnp.sum(v**2)))
    return u, v


def _spectral_norm_call(self, x, state, *, key=None, inference=None):
    """`eqx.nn.SpectralNorm.__call__` with σ, the estimate of the weight's largest
    singular value, computed from the master weight (for a frozen weight, what it reads
    outside GEMMs): σ normalises the weight, its matrix-vector products are not a GEMM of
    the layer. Only the layer's own GEMM, on `W / σ`, is quantised."""
    del key
    u, v = state.get(self.uv_index)
    weight = getattr(self.layer, self.weight_name)
    weight_shape = weight.shape
    weight = jnp.reshape(weight, (weight.shape[0], -1))
    value = as_qweight(weight)
    master = type(value).materialise(value) if isinstance(value, WeightValue) else weight
    if inference is None:
        inference = self.inference
    with jax.named_scope(NORMALISER):
        if not inference:
            stop = lax.stop_gradient(jnp.asarray(master))
            for _ in range(self.num_power_iterations):
                u, v = _power_iteration(stop, u, v, self.eps)
            state = state.set(self.uv_index, (u, v))
        sigma = jnp.einsum("i,ij,j->", u, master, v)
    layer = eqx.tree_at(
        lambda m: getattr(m, self.weight_name),
        self.layer,
        jnp.reshape(weight / sigma, weight_shape),
    )
    return layer(x), state


@functools.cache
def interpreted_class(cls: type) -> type:
    """A subclass of the module class `cls`, named like it, whose `__call__` runs under
    `quantized`: every read of a quantised weight inside it is seen. `isinstance` and
    attribute reads behave as for `cls`; `nvfp4x.dequantize` restores `cls`.
    (`eqx.nn.SpectralNorm` computes its normaliser σ from the master weight: see
    `_spectral_norm_call`.)"""
    base_call = cls.__call__
    if base_call is eqx.nn.SpectralNorm.__call__:
        base_call = _spectral_norm_call

    def __call__(self, *args, **kwargs):  # noqa: N807
        return _Interpreted(base_call)(self, *args, **kwargs)

    __call__.__doc__ = base_call.__doc__
    namespace = {
        "__call__": __call__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        "_nvfp4x_base": cls,
    }
    return type(cls)(cls.__name__, (cls,), namespace)


def base_class(cls: type) -> type:
    return cls.__dict__.get("_nvfp4x_base", cls)


def with_class(module: eqx.Module, cls: type[_M]) -> _M:
    """`module` as an instance of `cls` (same fields)."""
    if type(module) is cls:
        return module
    new = object.__new__(cls)
    for name, value in vars(module).items():
        object.__setattr__(new, name, value)
    return new
