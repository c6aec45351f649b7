"""The primitive kit: the one module that speaks to JAX's primitive machinery
(`jax.extend.core`, `jax.interpreters`, `jax.core`). Every nvfp4x primitive (the GEMMs
of `_gemm`, the frozen layer's GEMM, the telemetry probe) is made here, with one
batching rule; the rest of the package defines what a primitive computes for one
problem and its derivative rules, with the helpers below.

Why primitives: the numbers must not depend on whether a layer is called on a batch or
`jax.vmap`-ed over it (Equinox layers are called per example). A tensor amax or a
16-token wgrad block must cover everything the layer processes in one call, and only a
primitive's batching rule can see that. The one rule, for operands in three roles:

- *activations* (the first `act` operands): a vmapped axis is folded into their token
  axes, at position `nbatch` (one problem over the whole batch, bit for bit the same as
  a call on the stacked batch);
- the *seed* (two uint32 words of stochastic-rounding key, at index `seed`): a vmapped
  seed is combined into one seed (`combine_seeds`), as for one call every key counts;
- *weights* (every other operand): a vmapped weight (an ensemble, `vmap` over stacked
  layers) makes independent problems, stacked as a new leading axis of every operand
  and counted by the static parameter `nbatch`.

A primitive made with `stack=True` always stacks (the backward GEMMs under
`jax.vmap(jax.grad(f))`: each example's gradient is its own problem). A primitive runs
its one-problem function vmapped over `nbatch` leading axes, jitted (`compiled`).
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import ad_checkpoint, core as _core, dispatch, pjit
from jax._src.lax import lax as _lax
from jax.core import ShapedArray, Tracer, eval_jaxpr
from jax.extend.core import Jaxpr, Literal, Primitive, jaxprs_in_params
from jax.interpreters import ad, batching, mlir

from . import _kernels

__all__ = [
    "Jaxpr",
    "GEMM_PRIMITIVES",
    "PLACEMENT",
    "PLACEMENT_MANY",
    "Literal",
    "Primitive",
    "combine_seeds",
    "compiled",
    "def_jvp",
    "def_transpose",
    "eval_jaxpr",
    "gemm_eqns",
    "is_traced",
    "is_undefined",
    "is_zero",
    "jaxpr_has_gemm",
    "jaxprs_in_params",
    "primitive",
    "ragged_dot_general_p",
    "remat_p",
    "shaped",
    "vmapped",
    "zero",
    "zero_tangent",
]

#: `jax.checkpoint`'s primitive (quax needs a rule for it).
remat_p = ad_checkpoint.remat_p
#: `lax.ragged_dot` / `ragged_dot_general`'s primitive (not exported by `jax.lax` or
#: `jax.extend` in jax 0.10).
ragged_dot_general_p = _lax.ragged_dot_general_p
#: Primitives whose result is their operand's values, placed anew (sharding
#: constraints, `jax.sharding.reshard`, `pvary` in `shard_map`); `PLACEMENT_MANY`: those
#: of several operands and results, result `i` operand `i`'s values
#: (`jax.device_put` of a tuple, `lax.optimization_barrier`).
PLACEMENT = frozenset(
    {pjit.sharding_constraint_p, pjit.reshard_p, pjit.layout_constraint_p, _core.pvary_p}
)
PLACEMENT_MANY = frozenset({dispatch.device_put_p, _lax.optimization_barrier_p})
#: The JAX primitives that are GEMMs.
GEMM_PRIMITIVES = (_lax.dot_general_p, ragged_dot_general_p, jax.lax.conv_general_dilated_p)


def gemm_eqns(jaxpr: Jaxpr) -> list:
    """The GEMM equations of `jaxpr` (`dot_general`, `ragged_dot_general`, convolutions:
    `GEMM_PRIMITIVES`), those of the jaxprs inside its equations included, in order: the
    one jaxpr walker ("does this call run a GEMM?") that `_sites` and `_qweight` ask."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive in GEMM_PRIMITIVES:
            out.append(eqn)
        for sub in jaxprs_in_params(eqn.params):
            out += gemm_eqns(sub)
    return out


def jaxpr_has_gemm(jaxpr: Jaxpr) -> bool:
    """Whether `jaxpr` (or a jaxpr inside one of its equations) holds a GEMM."""
    return bool(gemm_eqns(jaxpr))


def shaped(shape: tuple, dtype) -> ShapedArray:
    """The abstract value of an array of `shape` and `dtype`."""
    return ShapedArray(tuple(shape), dtype)


def is_traced(x: Any) -> bool:
    """Whether `x` is a tracer (its value is not known while tracing)."""
    return isinstance(x, Tracer)


# --- differentiation ---


def is_zero(t: Any) -> bool:
    """Whether a tangent or cotangent is JAX's symbolic zero."""
    return type(t) is ad.Zero


def zero(aval: Any) -> Any:
    """The symbolic zero (co)tangent of an abstract value."""
    return ad.Zero(aval)


def zero_tangent(primal: Any) -> Any:
    """The symbolic zero tangent of a primal value."""
    # (`ad.Zero.from_primal_value` is gone from jax 0.10)
    return ad.Zero(jax.typeof(primal).to_tangent_aval())


def is_undefined(x: Any) -> bool:
    """Whether a transpose rule's operand is the linear input being transposed."""
    return ad.is_undefined_primal(x)


def def_jvp(prim: Primitive, rule: Callable) -> None:
    """`rule(primals, tangents, **params) -> (out, tangent_out)`, run under the kernel
    picks of the primitive's binding (`_under_picks`)."""
    ad.primitive_jvps[prim] = _under_picks(rule)


def def_transpose(prim: Primitive, rule: Callable) -> None:
    """`rule(cotangent, *operands, **params) -> [cotangent of each operand or None]`,
    run under the kernel picks of the primitive's binding (`_under_picks`)."""
    ad.primitive_transposes[prim] = _under_picks(rule)


def _under_picks(rule: Callable) -> Callable:
    """`rule` run under `params["picks"]` (`_Primitive`: the picks in force when the
    primitive was bound; none for others), which it also receives: what it computes
    itself and the primitives it binds (with `**params`) run what the forward was
    traced with."""

    @functools.wraps(rule)
    def wrapped(*args, **params):
        with _kernels.picked(params.get("picks", ())):
            return rule(*args, **params)

    return wrapped


# --- running one problem, vmapped ---


def vmapped(fn: Callable, nbatch: int) -> Callable:
    """`fn` vmapped over `nbatch` leading axes of every argument."""
    for _ in range(nbatch):
        fn = jax.vmap(fn)
    return fn


def compiled(fn: Callable, nbatch: int, **static: Any) -> Callable:
    """`fn` with `static` bound, vmapped over `nbatch` leading axes, jitted (cached per
    function, `nbatch`, parameters and the implementations `nvfp4x._kernels` picks now,
    which `fn` may ask when it is traced): a primitive's impl or a transpose rule runs
    it once per call, so an eager `jax.grad` is one dispatch per GEMM rather than one
    per operation (under an outer `jit` it is inlined)."""
    return _compiled(fn, nbatch, tuple(sorted(static.items())), _kernels.picks())


@functools.cache
def _compiled(fn: Callable, nbatch: int, static: tuple, picks: tuple) -> Callable:
    return jax.jit(vmapped(functools.partial(fn, **dict(static)), nbatch))


# --- batching ---


def combine_seeds(seed: jax.Array, axis: int) -> jax.Array:
    """One seed from a batch of seeds (every key counts)."""
    seed = jnp.moveaxis(seed, axis, 0)
    weights = (2 * jnp.arange(seed.shape[0], dtype=jnp.uint32) + 1).reshape(
        (-1,) + (1,) * (seed.ndim - 1)
    )
    return jnp.sum(seed * weights, axis=0, dtype=jnp.uint32)


def _stack(prim: Primitive, args: list, dims: list, params: dict) -> tuple[Any, int]:
    """Independent problems, as a new leading batch axis of every operand."""
    size = next(v.shape[d] for v, d in zip(args, dims, strict=True) if d is not None)

    def lead(v, d):
        return jnp.broadcast_to(v, (size,) + v.shape) if d is None else jnp.moveaxis(v, d, 0)

    new = [lead(v, d) for v, d in zip(args, dims, strict=True)]
    return prim.bind(*new, **{**params, "nbatch": params["nbatch"] + 1}), 0


def _batch(
    prim: Primitive, act: int, seed: int | None, stack: bool, args, dims, **params
) -> tuple[Any, Any]:
    """The batching rule of every nvfp4x primitive (see the module docstring)."""
    args, dims = list(args), list(dims)
    nbatch = params["nbatch"]
    seed = None if seed is None else seed % len(args)
    weights = [d for i, d in enumerate(dims[act:], act) if i != seed]
    if stack or any(d is not None for d in weights):
        return _stack(prim, args, dims, params)
    if seed is not None and dims[seed] is not None:
        args[seed] = combine_seeds(args[seed], dims[seed])
        dims[seed] = None
    acts, dacts = args[:act], dims[:act]
    if all(d is None for d in dacts):
        return prim.bind(*args, **params), None  # not mapped
    # Every activation folds at the same place (they share token axes).
    size = next(a.shape[d] for a, d in zip(acts, dacts, strict=True) if d is not None)
    folded = [
        jnp.broadcast_to(jnp.expand_dims(a, nbatch), a.shape[:nbatch] + (size,) + a.shape[nbatch:])
        if d is None
        else jnp.moveaxis(a, d, nbatch)
        for a, d in zip(acts, dacts, strict=True)
    ]
    return prim.bind(*folded, *args[act:], **params), nbatch


class _Primitive(Primitive):
    """A primitive that records, when it is bound, the implementations `nvfp4x._kernels`
    picks then (its parameter `picks`, `_kernels.picks()`; a rebinding keeps the one it
    is given): its impl and lowering run under those picks, so a GEMM runs what was in
    force when it was traced, however much later it is lowered (`jax.jit(f).lower`
    outside a `_kernels.use` block that `f`'s trace ran in, or a cached lowering reused
    for a trace under other picks)."""

    def bind(self, *args, **params):
        params.setdefault("picks", _kernels.picks())
        return super().bind(*args, **params)


def primitive(
    name: str,
    fn: Callable,
    abstract: Callable[..., tuple[tuple, Any]],
    *,
    act: int = 1,
    seed: int | None = None,
    stack: bool = False,
    labels: tuple[str, ...] = (),
    problem: Callable[[dict], dict] | None = None,
) -> Primitive:
    """A primitive running `fn` (one problem) vmapped over `nbatch` leading axes.

    **Arguments:**

    - `name`: the primitive's name, as jaxprs show it.
    - `fn`: `fn(*operands, **params) -> array` for one problem; `params` are the
      primitive's parameters except `nbatch` and `labels`.
    - `abstract`: `abstract(*avals, **params) -> (shape, dtype)` of the output, for
      `nbatch` leading axes (every parameter, `nbatch` included).
    - `act`, `seed`, `stack`: the operands' roles in batching (the module docstring):
      the first `act` operands are activations, the one at index `seed` (if any; `-1`:
      the last) the seed, the rest weights; `stack=True` makes every vmapped axis its own problem.
    - `labels`: parameters that name rather than compute (a layer's path for reports);
      `fn` does not receive them.
    - `problem`: how the parameters of each problem change when there are independent
      problems (`nbatch > 0`), e.g. the GEMM operand dtype (`batched_gemm_dtype`).

    **Returns:** the primitive. Its parameters are those `fn` takes, `nbatch`,
    `labels` and `picks` (added when it is bound: `_Primitive`); bind it with
    `nbatch=0`. Give it derivative rules with `def_jvp` / `def_transpose`.
    """
    prim = _Primitive(name)

    def impl(*args, nbatch, picks=(), **params):
        for label in labels:
            del params[label]
        if nbatch and problem is not None:
            params = problem(params)
        with _kernels.picked(picks):
            return compiled(fn, nbatch, **params)(*args)

    def abstract_eval(*avals, picks=(), **params):
        shape, dtype = abstract(*avals, **params)
        return shaped(shape, dtype)

    prim.def_impl(impl)
    prim.def_abstract_eval(abstract_eval)
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=False))
    batching.primitive_batchers[prim] = functools.partial(_batch, prim, act, seed, stack)
    return prim
