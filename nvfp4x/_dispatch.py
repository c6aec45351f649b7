"""The rules by which quantised weights (`QWeight`, frozen weights) run: quax's rules
for the JAX primitives applied to them, and the interpreted calls that apply them.

Inside a module's `__call__` (see `interpreted_class`), a function under
`nvfp4x.quantized`, and a weight's own operators (`w.T`, `x @ w`, `w * g`), each JAX
primitive applied to a quantised weight is dispatched here:

- `dot_general` (`x @ w.T`, `w @ x`, `jnp.einsum`, `jnp.dot`, `lax.dot_general`,
  called Linears) runs as the quantised GEMM `nvfp4x.qdot` on the *effective* weight:
  fprop `Q(x) @ Q(W).T` (x and W blocked along the contraction axis), dgrad
  `Q(dy) @ Q(W)` (along the output features), wgrad `Q(dy).T @ Q(x)` (along tokens).
  `ragged_dot` (experts) runs as the grouped GEMM (`_ragged.py`), a convolution as its
  GEMM (`_conv.py`), each with the same three GEMMs.
- Layout and linear elementwise primitives (transpose, reshape, slicing, dtype casts,
  `w * g`, `w / norm`, ...) give a `QWeight` of their result: the effective weight of
  `eqx.nn.WeightNorm`, `eqx.nn.SpectralNorm` or a user's scaling is what gets quantised.
  (SpectralNorm's normaliser σ is computed from the master weight: `_spectral_norm_call`.)
- Anything else (reductions, gathers such as an embedding lookup, `stop_gradient`)
  reads the master array: those are not GEMMs (`default_rule`, `QWeight.default`).
- `jax.checkpoint` and `jax.custom_vjp` bodies are looked into; a primitive nvfp4x
  cannot look into that holds a GEMM warns, naming the weight (`record_unquantised`).

The weight type itself, and its refusals outside an interpreted call, are `_qweight.py`;
the private quax/JAX internals these rules touch, `_internals.py`.
"""

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import quax
from jax import lax
from jaxtyping import Array, ArrayLike

from ._axes import explicit_axes_as_auto
from ._checks import check_group_sizes, layer_name, layer_operand
from ._conv import check_conv_kernel, conv_gemm, conv_qdot, gemm_matrix, runs_fast
from ._formats import widest_float
from ._internals import install_custom_vjp, tracer_value
from ._policy import Recipe
from ._prims import (
    PLACEMENT,
    PLACEMENT_MANY,
    Jaxpr,
    eval_jaxpr,
    jaxpr_has_gemm,
    ragged_dot_general_p,
    remat_p,
)
from ._probe import gemm_with_probe
from ._qweight import QWeight, WeightValue
from ._ragged import grouped_qdot

# --- interpreted calls ---


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


def dot_operand(a: ArrayLike, w: Any) -> Array:
    """The activation `a` of a `dot_general` with the quantised weight `w`, as the float
    product would take it (`layer_operand`: integers cast, complex refused)."""
    return layer_operand(jnp.asarray(a), f"The quantised product{layer_name(w.path)}", w.dtype)


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
    a = dot_operand(a, w)
    dtype = gemm_out_dtype(a, w, preferred_element_type)
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
    weights = [v for v in (lhs, rhs) if isinstance(v, WeightValue)]
    path = getattr(weights[0], "path", "")
    who = f"The quantised grouped GEMM (`ragged_dot`){layer_name(path)}"
    sizes = check_group_sizes(group_sizes, who)
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
    x = layer_operand(jnp.asarray(a), who, w.dtype)
    dtype = gemm_out_dtype(x, w, params.get("preferred_element_type"))
    return gemm(w, x, tuple(rc) == (1,), sizes).astype(dtype)


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

    fast_ok = functools.partial(runs_fast, rhs.recipe, probe=rhs.probe, enabled=rhs.enabled)
    kernel = (tuple(rhs.array.shape), rhs.array.dtype, rhs.path, axes)
    return kernel_conv(lhs, kernel, gemm, fast, fast_ok, params)


def kernel_conv(lhs, kernel: tuple, gemm: Callable, fast: Callable, fast_ok, params) -> Array:
    """The convolution of `lhs` with a quantised kernel (a `QWeight` or a frozen
    weight), `kernel` its `(shape, stored dtype, path, axes' roles)`, run as its GEMM
    (`conv_gemm`): by `gemm`, or by `fast` where it is one kernel (no stack) and
    `fast_ok(in_channels)` holds (`runs_fast`)."""
    shape, dtype, path, axes = kernel
    quick = len(shape) == len(axes) and fast_ok(shape[axes[1]])
    chosen = fast if quick else None
    return conv_gemm(lhs, shape, gemm, path=path, rhs_dtype=dtype, fast=chosen, **params)


# --- everything else ---

#: Primitives after which an array is still the same values, laid out or typed anew.
LAYOUT = (
    frozenset(
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
    | PLACEMENT
)  # (sharding constraints, reshards: the same values, placed anew)

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
    if primitive in PLACEMENT_MANY:  # each weight placed anew is still the weight
        return [
            _carried(v, o, getattr(v, "kernel_axes", None)) if isinstance(v, WeightValue) else o
            for v, o in zip(values, out, strict=True)
        ]
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
    # A convolution kernel laid out or scaled anew is still one (same axes' roles).
    same = out.ndim == len(src.shape)
    kernel_axes = getattr(src, "kernel_axes", None) if same else None
    if kernel_axes is not None and primitive is lax.transpose_p:
        perm = list(params["permutation"])
        kernel_axes = tuple(perm.index(a) for a in kernel_axes)
    return _carried(src, out, kernel_axes)


def _carried(src: Any, out: Array, kernel_axes: tuple[int, ...] | None) -> QWeight:
    """`out`, computed from the weight `src`, as a `QWeight` of `src`'s recipe and path."""
    probe, enabled = getattr(src, "probe", None), getattr(src, "enabled", None)
    groups = getattr(src, "groups", 1) if kernel_axes is not None else 1
    return QWeight(out, src.recipe, src.path, src.fast, probe, enabled, None, kernel_axes, groups)


# quax asks a value's `default` for every primitive without a rule of its own.
QWeight.default = staticmethod(default_rule)


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
