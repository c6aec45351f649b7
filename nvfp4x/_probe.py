"""The telemetry probe: a primitive that is the identity on a GEMM's output and whose
transpose computes the quantisation statistics of the GEMM's operands (see
`nvfp4x.telemetry`). Low in the package: the GEMM rules attach it, the telemetry API
reads what it returns."""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from ._formats import Format
from ._gemm import grad_key, mix_weight, needs_key, qdot, wgrad_operands
from ._policy import Recipe
from ._prims import compiled, def_jvp, def_transpose, is_zero, primitive, zero, zero_tangent

OPERANDS = ("fprop_x", "weight", "dgrad_dy", "wgrad_x", "wgrad_dy")
STATS = ("amax", "zero_frac", "saturated_frac", "sqnr_db")
PROBE_SHAPE = (len(OPERANDS), len(STATS))


def operand_stats(
    a: Array, fmt: Format | None, axis: int, key: jax.Array | None
) -> Float[Array, "4"]:
    """`(amax, zero_frac, saturated_frac, sqnr_db)` of quantising `a` along `axis`.

    The statistics ride on the quantiser's work: the format's `quantize_saturated` gives
    the quantised values and the saturation mask from one block computation, the same
    computation as the GEMMs' `quantize_operand` (same operand, axis and key), so that in
    a compiled step XLA computes the quantised operand and its block scales once for the
    GEMM and the statistics, and the statistics add one pass, a single variadic
    reduction over the operand and its quantised values."""
    a = a.astype(jnp.float32)
    if fmt is None:  # unquantised, as `quantize_operand` leaves it
        vals, scale, sat = a, None, jnp.zeros(a.shape, jnp.bool_)
    else:
        vals, scale, sat = fmt.spec.quantize_saturated(a, fmt, axis, key)
    deq = vals.astype(jnp.float32) * (1.0 if scale is None else scale)
    nonzero = a != 0
    count = jnp.int32
    amax, n_nonzero, n_zero, n_sat, signal, err = lax.reduce(
        (
            jnp.abs(a),
            nonzero.astype(count),
            (nonzero & (deq == 0)).astype(count),
            sat.astype(count),
            a * a,
            (a - deq) ** 2,
        ),
        (jnp.float32(0), count(0), count(0), count(0), jnp.float32(0), jnp.float32(0)),
        _stats_sum,
        tuple(range(a.ndim)),
    )
    zero = n_zero.astype(jnp.float32) / jnp.maximum(n_nonzero, 1).astype(jnp.float32)
    sqnr = 10.0 * jnp.log10(signal / err)
    return jnp.stack([amax, zero, n_sat.astype(jnp.float32) / a.size, sqnr])


def _stats_sum(x: tuple, y: tuple) -> tuple:
    """The reduction of `operand_stats`: a max (amax), then sums."""
    return (jnp.maximum(x[0], y[0]), *(u + v for u, v in zip(x[1:], y[1:], strict=True)))


def layer_stats(dy: Array, x: Array, w: Array, seed: Array, *, recipe: Recipe) -> Array:
    """The `(5, 4)` statistics table of one problem (no independent batch axes)."""
    dy = dy.astype(jnp.float32)
    g, a = wgrad_operands(dy, x.astype(jnp.float32), recipe)
    sr = needs_key(recipe)
    rows = [
        operand_stats(x, recipe.input, -1, None),
        operand_stats(w, recipe.weight, -1, None),
        operand_stats(dy, recipe.grad, -1, grad_key(seed, 1) if sr else None),
        operand_stats(a, recipe.input, 0, None),
        operand_stats(g, recipe.grad, 0, grad_key(seed, 2) if sr else None),
    ]
    return jnp.stack(rows)


def _probe_abstract(y, *_, **__):
    return y.shape, y.dtype


def _tangent(x, w, seed, tprobe, *, recipe, n):
    return jnp.zeros(x.shape[:-1] + (n,), jnp.float32) + 0.0 * jnp.sum(tprobe)


def _tangent_abstract(x, w, seed, tprobe, *, n, **_):
    return x.shape[:-1] + (n,), jnp.float32


# Batched as the GEMM primitives are (the kit's one rule): `y` and `x` are activations
# (a vmapped axis folds into their token axes), the seed is combined into one seed, a
# vmapped weight or probe makes independent problems.
#: `probe_p(y, x, w, seed, probe) -> y`, the identity on `y`.
probe_p = primitive("nvfp4x_probe", lambda y, *_, **__: y, _probe_abstract, act=2, seed=3)
#: `probe_tangent_p(x, w, seed, tprobe)`: zeros like `y`, linear in `tprobe`.
probe_tangent_p = primitive("nvfp4x_probe_tangent", _tangent, _tangent_abstract, act=1, seed=2)


def _probe_jvp(primals, tangents, **params):
    y, x, w, seed, probe = primals
    ty, _, _, _, tprobe = tangents
    out = probe_p.bind(y, x, w, seed, probe, **params)
    parts = [] if is_zero(ty) else [ty]
    if not is_zero(tprobe):
        mixed = mix_weight(seed, w) if needs_key(params["recipe"]) else seed
        parts.append(probe_tangent_p.bind(x, w, mixed, tprobe, **params))
    if not parts:
        return out, zero_tangent(out)
    return out, functools.reduce(jnp.add, parts)


def _tangent_transpose(ct, x, w, seed, tprobe, *, recipe, nbatch, n, picks):
    del picks  # (in force here: `_prims.def_transpose`)
    if is_zero(ct):
        return [None, None, None, zero(tprobe.aval)]
    return [None, None, None, compiled(layer_stats, nbatch, recipe=recipe)(ct, x, w, seed)]


def_jvp(probe_p, _probe_jvp)
def_transpose(probe_tangent_p, _tangent_transpose)


def probe(y: Array, x: Array, w: Array, seed: Array, p: Array, recipe: Recipe) -> Array:
    """Attach a layer's telemetry probe to its output `y` (identity in the forward)."""
    return probe_p.bind(y, x, w, seed, p, recipe=recipe, nbatch=0, n=y.shape[-1])


def gemm_with_probe(
    x, w, seed, probe_array, enabled=None, *, recipe: Recipe, fast: bool, name: str = ""
) -> Array:
    """`qdot(x, w)` with a layer's telemetry probe attached, if it has one. With a
    boolean `enabled`, the quantised product where it is true and the plain float32
    product `x @ w.T` where it is false (the weight is routed through `enabled`, so that
    under `jax.vmap` over it every variant is its own problem, with its own scales)."""
    if enabled is not None:
        w = jnp.where(enabled, w, w)
    y = qdot(x, w, recipe=recipe, seed=seed, fast=fast, name=name)
    if probe_array is not None:
        s = jnp.zeros((2,), jnp.uint32) if seed is None else seed
        y = probe(y, x, w, s, probe_array, recipe)
    if enabled is not None:
        plain = jnp.matmul(x, w.T, preferred_element_type=jnp.float32)
        y = jnp.where(enabled, y, plain)
    return y
