"""`QuantizedLinear`: `eqx.nn.Linear` whose three GEMMs follow a recipe."""

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, PRNGKeyArray, Shaped

from ._axes import explicit_axes_as_auto
from ._checks import layer_operand
from ._dispatch import as_qweight, interpreting, with_class
from ._formats import widest_float
from ._numerics._threefry import seed_words
from ._policy import Recipe
from ._probe import gemm_with_probe
from ._qweight import QWeight


class QuantizedLinear(eqx.nn.Linear):
    """An `eqx.nn.Linear` whose fprop, dgrad and wgrad GEMMs follow a recipe (spec §5):
    fprop `Q(x) @ Q(W).T` (x along k), dgrad `Q(dy) @ Q(W)` (dy along n), wgrad
    `Q(dy).T @ Q(x)` (both along the tokens).

    Made by [`nvfp4x.quantize`][] from an `eqx.nn.Linear` (it *is* one:
    `isinstance(layer, eqx.nn.Linear)` holds, so masks and filters written for Linears
    keep selecting it); turned back by [`nvfp4x.dequantize`][]. Its `weight` is an
    [`nvfp4x.QWeight`][]: the master array (what an optimiser steps, `weight.array`)
    with the recipe, so `x @ layer.weight.T` outside the layer is quantised too.

    **Fields:** `weight` (a `QWeight` of shape `(out_features, in_features)`, or stacked
    `(L, out, in)`), `bias` or None, `in_features`, `out_features`, `use_bias`.
    **Properties:** `recipe`, `fast` (run the GEMMs on bfloat16 operands where the device
    multiplies them natively, exact for quantised values; `False` runs the float32
    reference) and `probe` (None unless telemetry is on), all read from the weight.

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

    weight: QWeight

    def __init__(self, weight: QWeight, bias, in_features, out_features, use_bias: bool):
        self.weight = weight
        self.bias = bias
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias

    def __check_init__(self):
        if not isinstance(self.weight, QWeight):
            raise TypeError(
                "`QuantizedLinear.weight` must be an `nvfp4x.QWeight` (build the layer with "
                f"`QuantizedLinear.from_linear`), got {type(self.weight).__name__}."
            )

    @property
    def recipe(self) -> Recipe:
        return self.weight.recipe

    @property
    def fast(self) -> bool:
        return self.weight.fast

    @property
    def probe(self) -> Array | None:
        return self.weight.probe

    @classmethod
    def from_linear(
        cls,
        linear: eqx.nn.Linear,
        recipe: Recipe,
        *,
        fast: bool = True,
        path: str = "",
        scale_group: str | None = None,
    ) -> "QuantizedLinear":
        """Wrap an `eqx.nn.Linear` (its arrays are shared, not copied).

        **Arguments:**

        - `linear`: the layer to wrap (possibly stacked).
        - `recipe`: an [`nvfp4x.Recipe`][] (a recipe name is not accepted here).
        - `fast`: run the GEMMs on the device's fast operand dtype (bfloat16 where it is
          native) rather than the float32 reference.
        - `path`: the layer's path in its model, shown by reports.
        - `scale_group`: the tensor scale group of its weight (see
          [`nvfp4x.Policy`][]'s `tensor_scale_groups`), or None.

        **Returns:** a `QuantizedLinear` with `linear`'s weight, bias and features.
        """
        if not isinstance(recipe, Recipe):
            raise TypeError(f"`recipe` must be an `nvfp4x.Recipe`, got {type(recipe).__name__}.")
        if not isinstance(linear, eqx.nn.Linear):
            raise TypeError(
                f"`linear` must be an `eqx.nn.Linear` (its weight, bias and features are "
                f"wrapped), got {type(linear).__name__}. To quantise a whole model, use "
                "`nvfp4x.quantize(model, recipe)`."
            )
        return cls(
            weight=QWeight(linear.weight, recipe, path, fast, scale_group=scale_group),
            bias=linear.bias,
            in_features=linear.in_features,
            out_features=linear.out_features,
            use_bias=linear.use_bias,
        )

    def to_linear(self) -> eqx.nn.Linear:
        """The plain `eqx.nn.Linear` with these master weights.

        **Returns:** an `eqx.nn.Linear` holding this layer's `weight.array` and `bias`
        (the recipe and any telemetry probe are dropped).
        """
        return with_class(eqx.tree_at(lambda m: m.weight, self, self.weight.array), eqx.nn.Linear)

    def __call__(
        self,
        x: Shaped[ArrayLike, "*batch in"] | Shaped[ArrayLike, "*batch"],
        *,
        key: PRNGKeyArray | None = None,
    ) -> Array:
        """The forward pass `x @ W.T + b`, with fprop, dgrad and wgrad quantised per `recipe`.

        **Arguments:**

        - `x`: `(in_features,)` or a batch `(..., in_features)` (for `in_features="scalar"`:
          `()` or `(...)`); integer and boolean inputs are cast to the weight's dtype, as
          `eqx.nn.Linear` promotes them. A batch of no tokens, or `in_features=0`, gives
          the empty or zero product (plus the bias) without quantising anything.
        - `key`: optional PRNG key for the stochastic rounding of the backward pass. Without
          one, rounding is still fresh every optimiser step (a checksum of the weight
          seeds it); pass distinct keys to decorrelate microbatches of one step.

        **Returns:** `(out_features,)` or `(..., out_features)`, in the promoted dtype of `x`
        and the weight.

        **Raises:** `TypeError` for an `x` that is not an array (a string, None) or is
        complex; `ValueError` for a last axis other than `in_features`.
        """
        qw = as_qweight(self.weight)
        if not isinstance(qw, QWeight):
            fix = (
                "so its recipe is lost. To put new values into a quantised layer, replace "
                "the master array: `eqx.tree_at(lambda m: m.weight.array, layer, new)`."
            )
            return product_seen_by_interpreter(self, x, "nvfp4x.QWeight", fix)
        w = qw.array
        if w.ndim != 2:
            raise ValueError(
                f"This layer's weight is stacked {w.shape}; call it inside "
                "`jax.lax.scan` or `eqx.filter_vmap` over the leading axis, as the "
                "unquantised stack would be."
            )
        seed = None if key is None else seed_words(key)  # `jax.random.bits(key, (2,))`
        matmul = functools.partial(gemm_with_probe, recipe=qw.recipe, fast=qw.fast, name=qw.path)
        operands = (w, seed, qw.probe, qw.enabled)
        return apply_linear(self, x, matmul, operands, (w.shape, w), w.dtype)


def product_seen_by_interpreter(layer, x: Any, expected: str, fix: str) -> Array:
    """A quantised or frozen layer whose weight is not its quantised value. Inside an
    interpreted call that is the body of a `lax.scan`, `jit` or `cond` (traced with plain
    arrays, its jaxpr interpreted afterwards) or a weight a wrapper derived
    (`eqx.nn.WeightNorm`): the product is written out as one `dot_general` on the
    weight, which the interpretation runs quantised. Anywhere else it is an error."""
    if not interpreting():
        raise TypeError(
            f"This {type(layer).__name__}'s `weight` is a {type(layer.weight).__name__}, "
            f"not an `{expected}`, {fix}"
        )
    w = layer.weight
    return apply_linear(layer, x, functools.partial(plain_matmul), (w,), (w.shape, w), w.dtype)


def plain_matmul(x: Array, w: Array) -> Array:
    """`x @ w.T` as one `dot_general` on `w` in its stored layout."""
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    return jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)


def apply_linear(layer, x: Any, matmul, operands: tuple, weight, weight_dtype) -> Array:
    """`eqx.nn.Linear`'s contract around a GEMM `matmul(x, *operands)`: input checks,
    "scalar" features, bias added in float32, output in the promoted dtype of `x` and the
    weight. `weight` is `(shape, array)`: the logical weight's shape, and an array with
    its partition spec (the weight itself, or a packed weight's codes)."""
    x = layer_input(layer, x, weight_dtype)
    if layer.in_features == "scalar":
        x = x[..., None]
    k = 1 if layer.in_features == "scalar" else layer.in_features
    if x.ndim == 0 or x.shape[-1] != k:
        raise ValueError(
            f"{type(layer).__name__} expects inputs of shape (..., {layer.in_features}) "
            f"(last axis = in_features), got {x.shape}."
        )
    if x.size == 0:  # no tokens, or no input features: nothing to quantise
        n = 1 if layer.out_features == "scalar" else layer.out_features
        y = jnp.zeros(x.shape[:-1] + (n,), jnp.float32)
    else:
        y = explicit_axes_as_auto(matmul, x, operands, weight)
    if layer.bias is not None:
        y = y + layer.bias.astype(jnp.float32)
    if layer.out_features == "scalar":
        y = y[..., 0]
    return y.astype(widest_float(x.dtype, weight_dtype))


def layer_input(layer, x: Any, weight_dtype) -> Array:
    """A layer's input as a real floating-point array, as `eqx.nn.Linear` takes it:
    integer and boolean inputs are cast to the weight's dtype (where `eqx.nn.Linear`'s
    `weight @ x` promotes them to it); strings, None and complex inputs are refused
    (a complex product's imaginary part would be dropped without a word)."""
    name = type(layer).__name__
    if isinstance(x, str | bytes) or x is None:
        raise TypeError(
            f"{name} takes an array `x` of shape (..., {layer.in_features}), got "
            f"{type(x).__name__} `{x!r:.40}`."
        )
    try:
        x = jnp.asarray(x)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{name} takes an array `x` of shape (..., {layer.in_features}), got "
            f"{type(x).__name__}: {e}"
        ) from None
    return layer_operand(x, name, weight_dtype)
