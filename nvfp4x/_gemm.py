"""The quantised dot product `y = x @ W.T` with its own rules for fprop, dgrad and wgrad.

Three GEMMs (spec §5), for `x: (tokens..., k)`, `W: (n, k)`, `dy: (tokens..., n)`:

| GEMM  | math                          | operands quantised (layout)                       |
| ----- | ----------------------------- | ------------------------------------------------- |
| fprop | `y[t,n] = Σ_k x[t,k] W[n,k]`  | x along k (recipe.input); W (recipe.weight)       |
| dgrad | `dx[t,k] = Σ_n dy[t,n] W[n,k]` | dy along n (recipe.grad, may be stochastic); W    |
| wgrad | `dW[n,k] = Σ_t dy[t,n] x[t,k]` | dy and x along t, after the RHT if recipe.rht     |

Design: JAX primitives rather than `custom_vjp`, because the numbers must not depend on
whether a layer is called on a batch or `jax.vmap`-ed over it (Equinox layers are called
per example). A tensor amax or a 16-token wgrad block must cover everything the layer
processes in one call, and only a primitive's batching rule can see that:

- `qdot_p(x, W, Wq, sW, seed)` (fprop). The weight is quantised once, outside the
  primitive (it does not depend on the batch): `(Wq, sW)` are its values, already in the
  GEMM's operand dtype, and tensor scale. Batching: a vmapped axis of `x` alone is
  folded into the token axes (one call over the stacked batch, bit for bit); a vmapped
  weight (an ensemble, or `vmap` over stacked layers) makes independent problems,
  counted by the static `nbatch` (leading axes of every operand).
- JVP: `y' = tx_p(x', Wq', sW') + tw_p(x, W')`, two primitives linear in `x'` and `W'`
  (straight-through: the quantiser's Jacobian is the identity). Their transposes run
  the quantised dgrad and wgrad. dgrad's weight `(Wq', sW')` is fprop's own arrays when
  the two layouts agree (16x16 tiles, per-tensor FP8, unquantised; `shares_weight`):
  one weight quantisation per step and, under FSDP, one all-gather of it, as the plain
  program gathers its weight once. Otherwise (1x16, MXFP8) the weight is quantised
  along n in the JVP. Under `jax.grad(jax.vmap(f))` the batch has been folded before
  differentiation, so dgrad and wgrad see every token at once; under
  `jax.vmap(jax.grad(f))` the transposes are traced per example and give per-example
  gradients.
- Stochastic rounding keys: `seed` (two uint32 words, zero when the caller gave no key)
  is mixed with an integer checksum of the layer's weight, which changes every optimiser
  step: a loop that never mentions keys still rounds with fresh thresholds each step, the
  same key and weights give the same bits, and every device layout gives the same bits
  (an integer sum is exact in any order). Microbatches of one step share thresholds
  unless the caller passes different keys.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, ArrayLike, Float, UInt32

from . import _kernels
from ._checks import check_bool, check_float, check_str
from ._formats import (
    Format,
    batched_gemm_dtype,
    gemm_dtype,
    quantize_operand,
    quantize_rht_operands,
    scaled_dot,
)
from ._formats._dot import apply_scales
from ._numerics._constants import GOLDEN_RATIO_32
from ._numerics._threefry import fold_in_tags
from ._policy import RECIPE_NAMES, Recipe, RecipeLike, as_recipe
from ._prims import (
    Primitive,
    def_jvp,
    def_transpose,
    is_undefined,
    is_zero,
    primitive,
    vmapped,
    zero,
    zero_tangent,
)

#: The tags folded into the seed for the stochastic-rounding keys of dgrad (1) and wgrad (2).
GRAD_TAGS = (1, 2)


def grad_key(seed: UInt32[Array, "2"], tag: int) -> jax.Array:
    """`jax.random.fold_in` of the Threefry key holding `seed` with `tag` (one of
    `GRAD_TAGS`), bit for bit (its hash unrolled: `_threefry`, which compiles smaller than
    `jax.random`'s loop). Both tags are hashed in one vectorised program
    (`fold_in_tags`), the same in dgrad and wgrad, so that XLA keeps one of the two."""
    words = fold_in_tags(seed, GRAD_TAGS)[GRAD_TAGS.index(tag)]
    return jax.random.wrap_key_data(words, impl="threefry2x32")


def mix_weight(seed: UInt32[Array, "*nb 2"], w: Array) -> UInt32[Array, "*nb 2"]:
    """Mix an integer checksum of the weight into the seed. The weight changes every
    optimiser step, so a loop that never mentions keys still draws fresh thresholds each
    step; an integer sum is exact in any order, so every device layout draws the same.

    The checksum sums each element's upper 16 bits (its bfloat16 truncation): an update
    changes them, but a difference in the last float32 bits does not (runs whose
    all-reduces sum in another order, e.g. on another number of processes, differ there
    and must still draw the same thresholds, or they would drift apart)."""
    bits = lax.bitcast_convert_type(w.astype(jnp.float32), jnp.uint32) >> 16
    c = jnp.sum(bits, axis=(-2, -1), dtype=jnp.uint32)
    return seed ^ jnp.stack([c, c * jnp.uint32(GOLDEN_RATIO_32)], axis=-1)


def needs_key(recipe: Recipe) -> bool:
    return recipe.grad is not None and recipe.grad.rounding == "stochastic"


# --- the reference maths of each GEMM, for one problem (no independent batch axes) ---


def shares_weight(recipe: Recipe) -> bool:
    """Whether fprop and dgrad use the same quantised weight: true unless the weight's
    blocks run along one GEMM's contraction axis (NVFP4 1x16, MXFP8). 16x16 tiles, a
    per-tensor FP8 scale or no quantisation give the same values in both layouts."""
    fmt = recipe.weight
    return fmt is None or fmt.spec.layouts_agree(fmt)


# Jitted: called eagerly, it is one dispatch, as the primitives' own computations are.
@functools.partial(jax.jit, static_argnames=("recipe", "axis", "dtype"))
def quantize_weight(w: Array, *, recipe: Recipe, axis: int, dtype) -> tuple[Array, Array]:
    """The weight operand of fprop (`axis=-1`, blocks along k) or dgrad (`axis=0`, along
    n) as `(values, scale)`, the values already in the GEMM's operand dtype `dtype` (so
    that both GEMMs consume one array: under FSDP, one all-gather), the scale 1 for
    formats without a tensor scale (an exact multiplication) so that every primitive
    operand is an array."""
    wv, ws = quantize_operand(w, recipe.weight, axis=axis)
    if dtype is not None and wv.dtype == jnp.bfloat16:
        wv = wv.astype(dtype)
    return wv, jnp.float32(1.0) if ws is None else ws


def quantised_dot(
    a: Array,
    a_scale: ArrayLike | None,
    a_format: Format | None,
    b: Array,
    b_scale: ArrayLike | None,
    b_format: Format | None,
    dims: tuple[tuple[int, ...], tuple[int, ...]],
    *,
    dtype,
) -> Float[Array, "..."]:
    """`scaled_dot` of two quantised operands (values `a`, `b` in the formats
    `a_format`, `b_format`; None: unquantised): by the native low-precision GEMM that
    `nvfp4x._kernels` picks for the two formats when the GEMM is a fast one (`dtype`
    given), else emulated on `dtype` operands. The same products, only the float32
    accumulation differs."""
    if dtype is not None:
        native = lambda fmt: None if fmt is None else fmt.spec.native
        out = _kernels.native_gemm(a, native(a_format), b, native(b_format), dims)
        if out is not None:
            return apply_scales(out, a_scale, b_scale)
    return scaled_dot(a, a_scale, b, b_scale, dims, dtype=dtype)


def fprop(
    x: Array, wv: Array, ws: Float[ArrayLike, ""], *, recipe: Recipe, dtype
) -> Float[Array, "..."]:
    """fprop: `Q(x) @ Q(W).T`, x quantised along k; `(wv, ws)` the quantised weight."""
    xv, xs = quantize_operand(x, recipe.input, axis=-1)
    dims = ((x.ndim - 1,), (1,))
    return quantised_dot(xv, xs, recipe.input, wv, ws, recipe.weight, dims, dtype=dtype)


def tangent_x(
    xt: Array, wv: Array, ws: Float[ArrayLike, ""], seed: Array, *, recipe: Recipe, dtype
) -> Array:
    """Forward-mode tangent along x: `x' @ Q(W).T` (straight-through), with `(wv, ws)`
    the weight quantised for dgrad."""
    return scaled_dot(xt, None, wv, ws, ((xt.ndim - 1,), (1,)), dtype=dtype)


def tangent_w(x: Array, wt: Array, seed: Array, *, recipe: Recipe, dtype) -> Array:
    """Forward-mode tangent along W: `Q(x) @ W'.T` (straight-through)."""
    xv, xs = quantize_operand(x, recipe.input, axis=-1)
    return scaled_dot(xv, xs, wt, None, ((x.ndim - 1,), (1,)), dtype=dtype)


def dgrad(
    dy: Array, wv: Array, ws: Float[ArrayLike, ""], seed: Array, *, recipe: Recipe, dtype
) -> Float[Array, "..."]:
    """dgrad: `Q(dy) @ Q(W)`, dy quantised along n (stochastically if the recipe says);
    `(wv, ws)` the weight quantised along n (`quantize_weight(w, recipe, axis=0)`)."""
    key = grad_key(seed, 1) if needs_key(recipe) else None
    gv, gs = quantize_operand(dy, recipe.grad, axis=-1, key=key)
    dims = ((dy.ndim - 1,), (0,))
    return quantised_dot(gv, gs, recipe.grad, wv, ws, recipe.weight, dims, dtype=dtype)


def wgrad_operands(dy: Array, x: Array, recipe: Recipe) -> tuple[Array, Array]:
    """wgrad's operands as `(T, n)` and `(T, k)`, after the RHT along the token axis if
    the recipe says (tokens then padded to a multiple of 16). Two transforms, not one of
    both side by side: under tensor or FSDP sharding their concatenation moved data
    between devices (`tests/multidevice/test_sharding.py`)."""
    g = dy.reshape(-1, dy.shape[-1])
    a = x.reshape(-1, x.shape[-1])
    if recipe.rht:
        g, a = _kernels.rht(g, axis=0), _kernels.rht(a, axis=0)
    return g, a


def wgrad_quantised(
    dy: Array, x: Array, seed: Array, recipe: Recipe
) -> tuple[Array, Array | None, Array, Array | None]:
    """wgrad's quantised operands `(gv, gs, xv, xs)`: `Q(H dy)` and `Q(H x)` as `(T, n)`
    and `(T, k)` values with their tensor scales, both quantised along the token axis
    (with the RHT: `quantize_rht_operand`, the transform and the quantiser one kernel
    where `_kernels` picks it; the same bits as `wgrad_operands` then the quantiser)."""
    key = grad_key(seed, 2) if needs_key(recipe) else None
    if recipe.rht:
        g, a = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        (gv, gs), (xv, xs) = quantize_rht_operands([(g, recipe.grad, key), (a, recipe.input, None)])
        return gv, gs, xv, xs
    g, a = wgrad_operands(dy, x, recipe)
    gv, gs = quantize_operand(g, recipe.grad, axis=0, key=key)
    xv, xs = quantize_operand(a, recipe.input, axis=0)
    return gv, gs, xv, xs


def wgrad(dy: Array, x: Array, seed: Array, *, recipe: Recipe, dtype) -> Float[Array, "n k"]:
    """wgrad: `Q(H dy).T @ Q(H x)`, both quantised along the token axis, `H` the RHT."""
    gv, gs, xv, xs = wgrad_quantised(dy, x, seed, recipe)
    return quantised_dot(gv, gs, recipe.grad, xv, xs, recipe.input, ((0,), (0,)), dtype=dtype)


# --- primitives ---
#
# Operands: the activation-side operand first (x, x' or nothing else), the weight-side
# operands after it, the seed last. `qdot_p(x, w, wv, ws, seed)` takes the master weight
# `w` (for the JVP: its tangent and checksum) and the quantised weight `(wv, ws)`, made
# once by `qdot` outside the primitive and reused by dgrad when `shares_weight(recipe)`:
# one quantisation per step, and under FSDP one all-gather of the quantised weight for
# both GEMMs, as the unquantised program gathers its weight once.


def batched_problem(params: dict) -> dict:
    """A GEMM's parameters when it is one of independent problems (vmapped): operands
    in `batched_gemm_dtype`."""
    return {**params, "dtype": batched_gemm_dtype(params["dtype"])}


def _make_primitive(name: str, fn, abstract, *, stack: bool = False) -> Primitive:
    """A GEMM primitive running `fn` (one problem) vmapped over `nbatch` leading axes.
    Its operands: the activation-side operand first, the weight-side operands, the seed
    last. Its parameters: `recipe`, `dtype` (the GEMM operand dtype, `gemm_dtype`),
    `nbatch` and `name` (the layer's path, for reports such as `nvfp4x.coverage`; not
    part of the computation)."""
    return primitive(
        name, fn, abstract, act=1, seed=-1, stack=stack, labels=("name",), problem=batched_problem
    )


def _fprop_operands(x, w, wv, ws, seed, *, recipe, dtype):
    del w, seed  # the master weight and seed matter to the derivatives only
    return fprop(x, wv, ws, recipe=recipe, dtype=dtype)


def _fprop_abstract(a, w, *_, **__):
    return a.shape[:-1] + (w.shape[-2],), jnp.float32


def _dgrad_abstract(ct, wv, ws, seed, **_):
    return ct.shape[:-1] + (wv.shape[-1],), jnp.float32


def _wgrad_abstract(ct, a, seed, *, nbatch, **_):
    return ct.shape[:nbatch] + (ct.shape[-1], a.shape[-1]), jnp.float32


qdot_p = _make_primitive("nvfp4x_qdot", _fprop_operands, _fprop_abstract)
tx_p = _make_primitive("nvfp4x_qdot_tangent_x", tangent_x, _fprop_abstract)
tw_p = _make_primitive("nvfp4x_qdot_tangent_w", tangent_w, _fprop_abstract)
#: The backward GEMMs, as their own primitives so that a traced step shows them. Under
#: `jax.vmap(jax.grad(f))` each example's gradient is its own problem (`stack`).
dgrad_p = _make_primitive("nvfp4x_dgrad", dgrad, _dgrad_abstract, stack=True)
wgrad_p = _make_primitive("nvfp4x_wgrad", wgrad, _wgrad_abstract, stack=True)


def _second_order():
    return NotImplementedError(
        "nvfp4x: second-order derivatives (jax.hessian, jacfwd/jvp of a gradient, "
        "grad of grad) of a quantised GEMM are not supported: the quantiser has no "
        "second derivative. Take them on `nvfp4x.dequantize(model)` instead."
    )


def _no_derivative(primals, tangents, **params):
    raise _second_order()


def def_gemm_rules(fprop_p, tx_p, tw_p, dgrad_p, wgrad_p) -> None:
    """The derivative rules of a quantised GEMM's five primitives (operands as
    `qdot_p`'s: `x, w, wv, ws, seed`): fprop's JVP runs the tangent GEMMs `tx_p` (on the
    quantised weight) and `tw_p`, whose transposes are dgrad (`dgrad_p`) and wgrad
    (`wgrad_p`); none of the four has a derivative of its own (second order raises).
    Shared by the dense GEMM here and the convolution's (`_conv`)."""

    def jvp(primals, tangents, **params):
        x, w, wv, ws, seed = primals
        tx, tw = tangents[:2]
        recipe, dtype, nbatch = params["recipe"], params["dtype"], params["nbatch"]
        y = fprop_p.bind(x, w, wv, ws, seed, **params)
        if needs_key(recipe):
            seed = mix_weight(seed, w)
        parts = []
        if not is_zero(tx):
            if not shares_weight(recipe):
                quant = functools.partial(quantize_weight, recipe=recipe, axis=0, dtype=dtype)
                wv, ws = vmapped(quant, nbatch)(w)
            parts.append(tx_p.bind(tx, wv, ws, seed, **params))
        if not is_zero(tw):
            parts.append(tw_p.bind(x, tw, seed, **params))
        if not parts:
            return y, zero_tangent(y)
        return y, parts[0] if len(parts) == 1 else parts[0] + parts[1]

    def tx_transpose(ct, a, wv, ws, seed, **params):
        if is_undefined(wv) or is_undefined(ws):
            raise _second_order()
        if is_zero(ct):
            return [zero(a.aval), None, None, None]
        dx = dgrad_p.bind(ct, wv, ws, seed, **params)
        return [dx.astype(a.aval.dtype), None, None, None]

    def tw_transpose(ct, a, b, seed, **params):
        if is_undefined(a):
            raise _second_order()
        if is_zero(ct):
            return [None, zero(b.aval), None]
        return [None, wgrad_p.bind(ct, a, seed, **params).astype(b.aval.dtype), None]

    def_jvp(fprop_p, jvp)
    def_transpose(tx_p, tx_transpose)
    def_transpose(tw_p, tw_transpose)
    for p in (tx_p, tw_p, dgrad_p, wgrad_p):  # derivatives of a derivative
        def_jvp(p, _no_derivative)


def_gemm_rules(qdot_p, tx_p, tw_p, dgrad_p, wgrad_p)


def qdot(
    x: Float[Array, "*tokens k"],
    w: Float[Array, "n k"],
    *,
    recipe: RecipeLike,
    seed: UInt32[Array, "2"] | None = None,
    fast: bool = True,
    name: str = "",
) -> Float[Array, "*tokens n"]:
    """`x @ w.T` under `recipe`: fprop, dgrad and wgrad each quantise their own operands.

    **Arguments:**

    - `x`: activations `(tokens..., k)`, at least 1-D; `w`: weight `(n, k)` (Equinox
      layout). Both floating-point.
    - `recipe`: the formats of W, x and dy, and whether wgrad uses the RHT: an
      [`nvfp4x.Recipe`][] or a recipe name (as [`nvfp4x.quantize`][] accepts).
    - `seed`: None, or two uint32 words (shape `(2,)`, e.g.
      `jax.random.bits(key, (2,), jnp.uint32)`) mixed into the stochastic-rounding keys of dgrad
      (dy along n) and wgrad (dy along tokens). A checksum of `w` is mixed in too, so
      each optimiser step draws fresh thresholds even with the default seed.
    - `fast`: run the GEMMs on the device's fastest exact operand dtype (bfloat16 where
      it is multiplied natively, float32 on other CPUs; `NVFP4X_GEMM_DTYPE` overrides)
      instead of the float32 reference; only the summation order differs.
    - `name`: the layer's path, shown by reports (`nvfp4x.coverage`); no effect on the
      numbers.

    **Returns:** float32 `(tokens..., n)`, accumulated in float32 and multiplied by both
    operands' tensor scales. With no tokens or `k = 0` it is the (empty or zero)
    product, computed without quantising anything.

    **Raises:** `TypeError` for a non-float `x` or `w`, a `recipe` that is not a recipe or
    a recipe name (None included: use `x @ w.T` for an unquantised product), a `seed`
    that is not a `(2,)` uint32 array (a PRNG key included), or a non-bool `fast`;
    `ValueError` for a 0-d `x`, a `w` that is not 2-D, mismatched `k`, or an unknown
    recipe name.

    The three GEMMs: fprop `y = Q(x) @ Q(W).T` (x and W blocked along k); dgrad
    `dx = Q(dy) @ Q(W)` (dy and W along n; 16x16 weight tiles are the same in both);
    wgrad `dW = Q(dy).T @ Q(x)` (both along the tokens, after the RHT when `recipe.rht`).

    ```python
    x = jax.random.normal(jax.random.key(0), (64, 32))
    w = jax.random.normal(jax.random.key(1), (16, 32))
    recipe = nvfp4x.recipes.nvfp4_training()
    y = nvfp4x.qdot(x, w, recipe=recipe)                                   # (64, 16)
    dw = jax.grad(lambda w: nvfp4x.qdot(x, w, recipe=recipe).sum())(w)     # (16, 32)
    ```
    """
    x, w, recipe, seed = _qdot_arguments(x, w, recipe, seed)
    fast = check_bool(fast, "fast")
    check_str(name, "name", '`"blocks[0].mlp"`')
    if x.size == 0 or w.size == 0:  # nothing to quantise; the product is empty or zero
        return jnp.zeros(x.shape[:-1] + w.shape[:1], jnp.float32)
    dtype = gemm_dtype(fast)
    wv, ws = quantize_weight(lax.stop_gradient(w), recipe=recipe, axis=-1, dtype=dtype)
    return qdot_p.bind(x, w, wv, ws, seed, recipe=recipe, dtype=dtype, nbatch=0, name=name)


def _qdot_arguments(x, w, recipe, seed) -> tuple[Array, Array, Recipe, Array]:
    """`qdot`'s arguments checked (static information only: works under `jit`)."""
    x, w = check_float(x, "x"), check_float(w, "w")
    if x.ndim == 0:
        raise ValueError(
            "`x` is 0-d; `qdot` needs activations `(tokens..., k)`, e.g. `x[None]` for one feature."
        )
    if w.ndim != 2:
        raise ValueError(
            f"`w` has shape {tuple(w.shape)}; `qdot` needs a 2-D weight `(n, k)` (for stacked "
            "weights, `jax.vmap` over the stack)."
        )
    if x.shape[-1] != w.shape[-1]:
        raise ValueError(
            f"`x` has {x.shape[-1]} features (last axis) but `w` has shape {tuple(w.shape)}; "
            "`qdot` computes `x @ w.T`, so their last axes must match."
        )
    checked = as_recipe(recipe, "`qdot(recipe=...)`")
    if checked is None:
        raise TypeError(
            "`recipe=None`: `qdot` needs a recipe, e.g. `nvfp4x.recipes.nvfp4_training()` or "
            f"a name from {RECIPE_NAMES}; for an unquantised product use `x @ w.T`."
        )
    if seed is None:
        return x, w, checked, jnp.zeros((2,), jnp.uint32)
    dtype, shape = getattr(seed, "dtype", None), tuple(getattr(seed, "shape", (None,)))
    if dtype != jnp.uint32 or shape != (2,):
        what = f"dtype {dtype}, shape {shape}" if dtype is not None else type(seed).__name__
        raise TypeError(
            f"`seed` must be two uint32 words (a `(2,)` uint32 array), got {what}; make it "
            "from a key with `jax.random.bits(key, (2,), jnp.uint32)`, or pass None."
        )
    return x, w, checked, seed
