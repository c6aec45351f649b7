"""Quantisation telemetry, returned from the jitted step as the gradient of probe arrays.

`nvfp4x.telemetry.enable(qmodel)` gives every `QuantizedLinear` a `probe`: a float32
zero array of shape `(*stack, 5, 4)` that the forward pass ignores. Differentiating a loss
with respect to the model (as every training step does) then yields, in the probe's slot
of the gradient, one row per quantised operand and one column per statistic:

| row | operand                       | column | statistic                               |
| --- | ----------------------------- | ------ | --------------------------------------- |
| 0   | fprop x (along features)      | 0      | tensor amax                             |
| 1   | weight W (fprop layout)       | 1      | fraction of non-zeros flushed to zero   |
| 2   | dgrad dy (along out features) | 2      | fraction saturated (NVFP4: beyond 6 x   |
|     |                               |        | block scale x tensor scale)             |
| 3   | wgrad x (tokens, after RHT)   | 3      | SQNR of the quantised operand, in dB    |
| 4   | wgrad dy (tokens, after RHT)  |        |                                         |

How: a primitive `probe_p(y, x, w, seed, probe) -> y` is the identity on `y`; its JVP
adds the tangent of a primitive linear in the probe's tangent whose transpose receives
the output gradient `dy` and returns these statistics instead of a true transpose. So
the statistics are computed inside the compiled step, on exactly the operands the GEMMs
quantise (the same stochastic-rounding keys), with no host callback, and they follow
`jax.vmap` like the GEMM does (a folded batch gives whole-call statistics;
`jax.vmap(jax.grad(f))` gives per-example ones). `nvfp4x.telemetry.collect(grads)` turns
the gradient into a `{path: {operand: {stat: array}}}` table; an optimiser stepping the
probes is harmless (nothing reads them) but `nvfp4x.telemetry.disable` removes them.
"""

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jaxtyping import Array, Float

from ._format._constants import E2M1_MAX
from ._format._nvfp4 import pad_to_blocks, quantize_blocks, to_blocks
from ._formats import Format, quantize_operand
from ._gemm import _grad_key, _mix_weight, _needs_key, compiled, wgrad_operands
from ._policy import Recipe

#: The public names of `nvfp4x.telemetry`; the rest is machinery.
__all__ = ["OPERANDS", "STATS", "collect", "disable", "enable"]

OPERANDS = ("fprop_x", "weight", "dgrad_dy", "wgrad_x", "wgrad_dy")
STATS = ("amax", "zero_frac", "saturated_frac", "sqnr_db")
PROBE_SHAPE = (len(OPERANDS), len(STATS))


def operand_stats(
    a: Array, fmt: Format | None, axis: int, key: jax.Array | None
) -> Float[Array, "4"]:
    """`(amax, zero_frac, saturated_frac, sqnr_db)` of quantising `a` along `axis`."""
    a = a.astype(jnp.float32)
    vals, scale = quantize_operand(a, fmt, axis, key)
    deq = vals.astype(jnp.float32) * (1.0 if scale is None else scale)
    amax = jnp.max(jnp.abs(a))
    nonzero = a != 0
    zero = jnp.sum(nonzero & (deq == 0)) / jnp.maximum(jnp.sum(nonzero), 1)
    if fmt is not None and fmt.name == "nvfp4":
        # Saturated: beyond the largest magnitude of its block, 6 x block scale x s_dec.
        # That magnitude is the block's largest |deq| whenever any element hit it.
        blk = fmt.block
        moved = a if blk == (16, 16) else jnp.moveaxis(a, axis, -1)
        _, sb, s_dec = quantize_blocks(pad_to_blocks(moved, blk), blk, "nearest", None, None)
        top = E2M1_MAX * sb * s_dec
        top = top[..., None] if blk[0] == 1 else top[..., :, None, :, None]
        magnitude = to_blocks(pad_to_blocks(jnp.abs(moved), blk), blk)
        sat = jnp.sum(magnitude > top) / a.size
    else:
        sat = jnp.float32(0.0)
    err = jnp.sum((a - deq) ** 2)
    sqnr = 10.0 * jnp.log10(jnp.sum(a**2) / err)
    return jnp.stack([amax, zero, sat, sqnr]).astype(jnp.float32)


def layer_stats(dy: Array, x: Array, w: Array, seed: Array, *, recipe: Recipe) -> Array:
    """The `(5, 4)` statistics table of one problem (no independent batch axes)."""
    dy = dy.astype(jnp.float32)
    g, a = wgrad_operands(dy, x.astype(jnp.float32), recipe)
    sr = _needs_key(recipe)
    rows = [
        operand_stats(x, recipe.input, -1, None),
        operand_stats(w, recipe.weight, -1, None),
        operand_stats(dy, recipe.grad, -1, _grad_key(seed, 1) if sr else None),
        operand_stats(a, recipe.input, 0, None),
        operand_stats(g, recipe.grad, 0, _grad_key(seed, 2) if sr else None),
    ]
    return jnp.stack(rows)


def _fold_or_stack(prim, args, dims, params, n_act: int):
    """Batching shared by both probe primitives: the first `n_act` operands are
    activation-like (a vmapped axis folds into their token axes), the rest weight-like
    (a vmapped axis makes independent problems)."""
    nbatch = params["nbatch"]
    act, rest = args[:n_act], args[n_act:]
    dact, drest = dims[:n_act], dims[n_act:]
    if all(d is None for d in drest):
        # every activation operand folds at the same place (they share token axes)
        size = next(a.shape[d] for a, d in zip(act, dact, strict=True) if d is not None)
        act = [
            jnp.broadcast_to(
                jnp.expand_dims(a, nbatch), a.shape[:nbatch] + (size,) + a.shape[nbatch:]
            )
            if d is None
            else jnp.moveaxis(a, d, nbatch)
            for a, d in zip(act, dact, strict=True)
        ]
        return prim.bind(*act, *rest, **params), nbatch
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)

    def lead(v, d):
        return jnp.broadcast_to(v, (size,) + v.shape) if d is None else jnp.moveaxis(v, d, 0)

    args = [lead(v, d) for v, d in zip(args, dims, strict=True)]
    return prim.bind(*args, **{**params, "nbatch": nbatch + 1}), 0


# probe_p(y, x, w, seed, probe) -> y
probe_p = Primitive("nvfp4x_probe")
# probe_tangent_p(x, w, seed, tprobe) -> zeros like y (linear in tprobe)
probe_tangent_p = Primitive("nvfp4x_probe_tangent")


def _probe_impl(y, x, w, seed, probe, *, recipe, nbatch, n):
    return y


def _tangent_impl(x, w, seed, tprobe, *, recipe, nbatch, n):
    return jnp.zeros(x.shape[:-1] + (n,), jnp.float32) + 0.0 * jnp.sum(tprobe)


probe_p.def_impl(_probe_impl)
probe_p.def_abstract_eval(lambda y, *a, **p: jax.core.ShapedArray(y.shape, y.dtype))
mlir.register_lowering(probe_p, mlir.lower_fun(_probe_impl, multiple_results=False))
probe_tangent_p.def_impl(_tangent_impl)
probe_tangent_p.def_abstract_eval(
    lambda x, w, s, t, *, n, **p: jax.core.ShapedArray(x.shape[:-1] + (n,), jnp.float32)
)
mlir.register_lowering(probe_tangent_p, mlir.lower_fun(_tangent_impl, multiple_results=False))
batching.primitive_batchers[probe_p] = lambda args, dims, **p: _fold_or_stack(
    probe_p, args, dims, p, 2
)
batching.primitive_batchers[probe_tangent_p] = lambda args, dims, **p: _fold_or_stack(
    probe_tangent_p, args, dims, p, 1
)


def _probe_jvp(primals, tangents, **params):
    y, x, w, seed, probe = primals
    ty, _, _, _, tprobe = tangents
    out = probe_p.bind(y, x, w, seed, probe, **params)
    parts = [] if type(ty) is ad.Zero else [ty]
    if type(tprobe) is not ad.Zero:
        mixed = _mix_weight(seed, w) if _needs_key(params["recipe"]) else seed
        parts.append(probe_tangent_p.bind(x, w, mixed, tprobe, **params))
    if not parts:
        return out, ad.Zero.from_primal_value(out)
    return out, functools.reduce(jnp.add, parts)


def _tangent_transpose(ct, x, w, seed, tprobe, *, recipe, nbatch, n):
    if type(ct) is ad.Zero:
        return [None, None, None, ad.Zero(tprobe.aval)]
    return [None, None, None, compiled(layer_stats, nbatch, recipe=recipe)(ct, x, w, seed)]


ad.primitive_jvps[probe_p] = _probe_jvp
ad.primitive_transposes[probe_tangent_p] = _tangent_transpose


def probe(y: Array, x: Array, w: Array, seed: Array, p: Array, recipe: Recipe) -> Array:
    """Attach a layer's telemetry probe to its output `y` (identity in the forward)."""
    return probe_p.bind(y, x, w, seed, p, recipe=recipe, nbatch=0, n=y.shape[-1])


def _is_qlinear(x) -> bool:
    from ._linear import QuantizedLinear

    return isinstance(x, QuantizedLinear)


def enable(model: Any, where: Callable[[str, Any], bool] | None = None) -> Any:
    """Give every `QuantizedLinear` (for which `where(path, layer)` is true, if given) a
    zero `probe` of shape `(*stack, 5, 4)`; the gradient of a loss then carries the
    quantisation statistics, read with [`nvfp4x.telemetry.collect`][]. The forward pass
    ignores the probe, so outputs are unchanged.

    **Arguments:**

    - `model`: a model returned by [`nvfp4x.quantize`][]; layers that are not
      `QuantizedLinear` are left as they are.
    - `where`: optional `(path, layer) -> bool` choosing layers by path (as
      [`nvfp4x.summary`][] shows it); by default every `QuantizedLinear`.

    **Returns:** the model with probes.

    ```python
    qmodel = nvfp4x.quantize([eqx.nn.Linear(32, 32, key=jax.random.key(0))], "nvfp4_training")
    qmodel = nvfp4x.telemetry.enable(qmodel)
    qmodel[0].probe.shape   # (5, 4)
    ```
    """
    from ._transform import path_str

    def one(path, layer):
        if not _is_qlinear(layer) or (where is not None and not where(path_str(path), layer)):
            return layer
        shape = layer.weight.shape[:-2] + PROBE_SHAPE
        return eqx.tree_at(
            lambda m: m.probe, layer, jnp.zeros(shape, jnp.float32), is_leaf=lambda v: v is None
        )

    return jax.tree_util.tree_map_with_path(one, model, is_leaf=_is_qlinear)


def disable(model: Any) -> Any:
    """Remove the probes again (set every `QuantizedLinear`'s `probe` to None).

    **Arguments:**

    - `model`: a model, with or without probes.

    **Returns:** the model without probes.

    ```python
    qmodel = nvfp4x.telemetry.disable(qmodel)
    qmodel[0].probe   # None
    ```
    """

    def one(layer):
        if not _is_qlinear(layer) or layer.probe is None:
            return layer
        return eqx.tree_at(lambda m: m.probe, layer, None, is_leaf=lambda v: v is None)

    return jax.tree_util.tree_map(one, model, is_leaf=_is_qlinear)


def collect(grads: Any) -> dict[str, dict[str, dict[str, Array]]]:
    """`{layer path: {operand: {statistic: array}}}` from a gradient of a model with
    probes (arrays have the stack's leading shape for stacked layers).

    **Arguments:**

    - `grads`: the gradient, with respect to the model, of a loss of a model that
      [`nvfp4x.telemetry.enable`][] gave probes (as `eqx.filter_grad` returns it).

    **Returns:** a dict keyed by layer path; for each layer, the operands `"fprop_x"`,
    `"weight"`, `"dgrad_dy"`, `"wgrad_x"`, `"wgrad_dy"`, each with the statistics
    `"amax"`, `"zero_frac"` (fraction of non-zeros flushed to zero), `"saturated_frac"`
    and `"sqnr_db"`. Layers without probes are left out.

    ```python
    qmodel = nvfp4x.quantize([eqx.nn.Linear(32, 32, key=jax.random.key(0))], "nvfp4_training")
    qmodel = nvfp4x.telemetry.enable(qmodel)
    x = jax.random.normal(jax.random.key(1), (64, 32))
    grads = eqx.filter_grad(lambda m: jnp.mean(m[0](x) ** 2))(qmodel)
    stats = nvfp4x.telemetry.collect(grads)
    stats["[0]"]["fprop_x"]["sqnr_db"]   # a float32 scalar, about 20 dB
    ```
    """
    from ._transform import path_str

    out = {}
    for path, layer in jax.tree_util.tree_flatten_with_path(grads, is_leaf=_is_qlinear)[0]:
        if _is_qlinear(layer) and layer.probe is not None:
            table = layer.probe
            out[path_str(path)] = {
                op: {st: table[..., i, j] for j, st in enumerate(STATS)}
                for i, op in enumerate(OPERANDS)
            }
    return out
