"""`QuantizedLinear`: `eqx.nn.Linear` whose three GEMMs follow a recipe."""

import functools
from collections.abc import Callable
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from ._formats import widest_float
from ._gemm import qdot
from ._policy import Recipe


class QuantizedLinear(eqx.Module):
    """A linear layer `y = x @ W.T + b` whose fprop, dgrad and wgrad GEMMs quantise their
    operands as `recipe` says (spec §5).

    Made by [`nvfp4x.quantize`][] from an `eqx.nn.Linear`; turned back by
    [`nvfp4x.dequantize`][]. The master `weight` and `bias` stay in their own dtype and
    are what an optimiser steps.

    **Fields:** `weight` `(out_features, in_features)` (or stacked `(L, out, in)`),
    `bias` or None, `in_features`, `out_features`, `use_bias`, `recipe` (static) and
    `fast` (static: run the GEMMs on bfloat16 operands where the device multiplies them
    natively, exact for quantised values; `False` runs the float32 reference), and
    `probe` (None unless telemetry is switched on with `nvfp4x.telemetry.enable`).

    The layer acts on one example `(in_features,)` like `eqx.nn.Linear`, and also on a
    batch `(..., in_features)`. `jax.vmap(layer)(xs)` gives the same bits as `layer(xs)`:
    the tensor scales and wgrad's token blocks cover the whole call either way.

    ```python
    linear = eqx.nn.Linear(32, 16, key=jax.random.key(0))
    layer = nvfp4x.QuantizedLinear.from_linear(linear, nvfp4x.recipes.nvfp4_training())
    xs = jax.random.normal(jax.random.key(1), (8, 32))
    layer(xs).shape                                  # (8, 16)
    jnp.array_equal(jax.vmap(layer)(xs), layer(xs))  # True
    ```
    """

    weight: Float[Array, "*stack out in"]
    bias: Float[Array, "*stack out"] | None
    in_features: int | Literal["scalar"] = eqx.field(static=True)
    out_features: int | Literal["scalar"] = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    recipe: Recipe = eqx.field(static=True)
    fast: bool = eqx.field(static=True, default=True)
    probe: Float[Array, "*stack 5 4"] | None = None

    def __check_init__(self):
        if not isinstance(self.recipe, Recipe):
            raise TypeError(
                f"`recipe` must be an `nvfp4x.Recipe`, got {type(self.recipe).__name__}."
            )

    @classmethod
    def from_linear(
        cls, linear: eqx.nn.Linear, recipe: Recipe, *, fast: bool = True
    ) -> "QuantizedLinear":
        """Wrap an `eqx.nn.Linear` (its arrays are shared, not copied).

        **Arguments:**

        - `linear`: the layer to wrap (possibly stacked).
        - `recipe`: an [`nvfp4x.Recipe`][] (a recipe name is not accepted here).
        - `fast`: run the GEMMs on the device's fast operand dtype (bfloat16 where it is
          native) rather than the float32 reference.

        **Returns:** a `QuantizedLinear` with `linear`'s weight, bias and features.
        """
        return cls(
            weight=linear.weight,
            bias=linear.bias,
            in_features=linear.in_features,
            out_features=linear.out_features,
            use_bias=linear.use_bias,
            recipe=recipe,
            fast=fast,
        )

    def to_linear(self) -> eqx.nn.Linear:
        """The plain `eqx.nn.Linear` with these master weights.

        **Returns:** an `eqx.nn.Linear` holding this layer's `weight` and `bias` (the
        recipe and any telemetry probe are dropped).
        """
        skeleton = eqx.filter_eval_shape(
            eqx.nn.Linear,
            self.in_features,
            self.out_features,
            self.use_bias,
            key=jax.random.key(0),
        )
        return eqx.tree_at(
            lambda m: (m.weight, m.bias),
            skeleton,
            (self.weight, self.bias),
            is_leaf=lambda v: v is None,
        )

    def __call__(
        self,
        x: Float[Array, "*batch in"] | Float[Array, "*batch"],
        *,
        key: PRNGKeyArray | None = None,
    ) -> Array:
        """The forward pass `x @ W.T + b`, with fprop, dgrad and wgrad quantised per `recipe`.

        **Arguments:**

        - `x`: `(in_features,)` or a batch `(..., in_features)` (for `in_features="scalar"`:
          `()` or `(...)`).
        - `key`: optional PRNG key for the stochastic rounding of the backward pass. Without
          one, rounding is still fresh every optimiser step (a checksum of the weight
          seeds it); pass distinct keys to decorrelate microbatches of one step.

        **Returns:** `(out_features,)` or `(..., out_features)`, in the promoted dtype of `x`
        and the weight.
        """
        if self.weight.ndim != 2:
            raise ValueError(
                f"This layer's weight is stacked {self.weight.shape}; call it inside "
                "`jax.lax.scan` or `eqx.filter_vmap` over the leading axis, as the "
                "unquantised stack would be."
            )
        seed = None if key is None else jax.random.bits(key, (2,), jnp.uint32)

        matmul = functools.partial(_matmul, recipe=self.recipe, fast=self.fast)
        operands = (self.weight, seed, self.probe)
        weight = (self.weight.shape, self.weight)
        return apply_linear(self, x, matmul, operands, weight, self.weight.dtype)


def _matmul(x, w, seed, probe, *, recipe: Recipe, fast: bool) -> Array:
    """The quantised GEMM of a `QuantizedLinear`, with its telemetry probe if it has one."""
    y = qdot(x, w, recipe=recipe, seed=seed, fast=fast)
    if probe is not None:
        from ._telemetry import probe as probe_fn

        s = jnp.zeros((2,), jnp.uint32) if seed is None else seed
        y = probe_fn(y, x, w, s, probe, recipe)
    return y


def apply_linear(layer, x: Array, matmul, operands: tuple, weight, weight_dtype) -> Array:
    """`eqx.nn.Linear`'s contract around a GEMM `matmul(x, *operands)`: input checks,
    "scalar" features, bias added in float32, output in the promoted dtype of `x` and the
    weight. `weight` is `(shape, array)`: the logical weight's shape, and an array with
    its partition spec (the weight itself, or a packed weight's codes)."""
    if layer.in_features == "scalar":
        x = x[..., None]
    k = 1 if layer.in_features == "scalar" else layer.in_features
    if x.ndim == 0 or x.shape[-1] != k:
        raise ValueError(
            f"{type(layer).__name__} expects inputs of shape (..., {layer.in_features}) "
            f"(last axis = in_features), got {x.shape}."
        )
    y = explicit_axes_as_auto(matmul, x, operands, weight)
    if layer.bias is not None:
        y = y + layer.bias.astype(jnp.float32)
    if layer.out_features == "scalar":
        y = y[..., 0]
    return y.astype(widest_float(x.dtype, weight_dtype))


def explicit_axes_as_auto(matmul: functools.partial, x: Array, operands: tuple, weight) -> Array:
    """`matmul(x, *operands)`, the GEMM `x @ W.T`. Under a mesh with explicit axes
    ("sharding in types"), it runs with those axes switched to automatic (XLA places the
    amax all-reduces and gathers, as under an automatic mesh), and its output gets the
    sharding JAX gives the plain `x @ W.T`, so that a quantised model type-checks where
    the plain one does and raises JAX's own error where it does not.

    `matmul` is a `functools.partial` of a module-level function with hashable keywords:
    the switched GEMM is jitted once per (function, keywords, output sharding), so that
    eager calls and eager `jax.grad` go through the same traced program as jitted ones."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.explicit_axes:
        return matmul(x, *operands)
    shape, like = weight
    w = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=jax.typeof(like).sharding)
    out = jax.eval_shape(lambda a, b: jnp.matmul(a, b.T, preferred_element_type=jnp.float32), x, w)
    keywords = tuple(sorted(matmul.keywords.items()))
    return _auto_gemm(matmul.func, keywords, out.sharding)(x, *operands)


@functools.cache
def _auto_gemm(func, keywords: tuple, out_sharding) -> Callable:
    fn = functools.partial(func, **dict(keywords))
    return jax.jit(jax.sharding.auto_axes(fn, out_sharding=out_sharding))
