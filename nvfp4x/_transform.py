"""`quantize` / `dequantize` / `requantize` over any Equinox model."""

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from ._dispatch import base_class, interpreted_class, with_class
from ._linear import QuantizedLinear
from ._policy import Policy, PolicyLike, Recipe, as_recipe
from ._qweight import QWeight
from ._sites import (
    at_path,
    children,
    conv_kernel,
    is_conv,
    is_layer,
    is_qweight,
    layers as site_layers,
    path_str,
    qweights,
    weight_path,
)

_Choice = tuple[int | None, Recipe | None]


def _resolver(policy: PolicyLike) -> tuple[Callable[[str, Any], _Choice], Policy | None]:
    """`(choose, rules)`: `choose(path, layer)` is `(index of the matching rule, recipe)`
    (the index None unless `policy` is a `Policy`; its rules match the layer's path, then
    `path.weight`); `rules` is the `Policy`, if `policy` is one."""
    if isinstance(policy, Policy):

        def lookup(path: str, layer: Any) -> _Choice:
            index, recipe = policy.lookup(path)
            if index is None:
                index, recipe = policy.lookup(weight_path(path))
            return index, recipe

        return lookup, policy
    if isinstance(policy, Recipe | str):
        recipe = as_recipe(policy, "`policy`")
        return (lambda path, _: (None, recipe)), None
    if callable(policy):
        where = "The policy callable for `{}`"
        return (
            lambda path, layer: (None, as_recipe(policy(path, layer), where.format(path)))
        ), None
    raise TypeError(
        f"`policy` must be an `nvfp4x.Policy`, a recipe, a recipe name or a callable "
        f"`(path, linear) -> recipe | None`; got {type(policy).__name__}."
    )


def quantize(model: Any, policy: PolicyLike, *, fast: bool = True) -> Any:
    """Quantise the weight of every linear-like layer that `policy` maps to a recipe: every
    GEMM that consumes it (fprop, dgrad, wgrad) then runs under that recipe, however the
    model reads it; nothing else changes.

    Linear-like layers are `eqx.nn.Linear` and its subclasses, and any module with a
    floating-point `weight` of two or more dimensions (a user's linear class) whose
    call holds a GEMM (see `nvfp4x/_sites.py`: a stacked norm's `(layers, d)` scale is
    not a linear layer's weight);
    convolutions (`eqx.nn.Conv*`, `ConvTranspose*`, and any module whose call runs its
    `weight` as a `lax.conv_general_dilated` kernel) only under a
    `Policy(..., convolutions=True)`, and then run as their GEMM (input patches times
    the kernel, blocks along input channels x kernel window; a grouped convolution as
    one GEMM per group). A plain
    `eqx.nn.Linear` becomes an [`nvfp4x.QuantizedLinear`][] (still an `eqx.nn.Linear`),
    every other layer keeps its class, fields and `__call__`, with its `weight` an
    [`nvfp4x.QWeight`][]. Modules that hold a quantised weight run their `__call__` so
    that `x @ self.w.weight.T`, `jnp.einsum(..., self.lm_head.weight)`, `jnp.dot`,
    `lax.dot_general` and wrappers such as `eqx.nn.WeightNorm` are quantised as a called
    layer is. Weights tied with `eqx.nn.Shared` are quantised at their source.

    **Arguments:**

    - `model`: any PyTree (Equinox modules, lists, tuples, dicts) holding linear-like
      layers anywhere, stacked ones (`eqx.filter_vmap`-made) included.
    - `policy`: an [`nvfp4x.Policy`][] (regex rules on layer paths such as
      `blocks[3].mlp.fc1`, or on weight paths `blocks[3].mlp.fc1.weight`), one recipe (or
      recipe name) for every layer, or a callable `(path, layer) -> recipe | None`.
      `None` keeps a layer as it is.
    - `fast`: run the GEMMs on bfloat16 operands where the device multiplies them natively
      (float32 on other CPUs; exact for quantised values either way) rather than the
      float32 reference.

    **Returns:** the model with quantised weights. [`nvfp4x.dequantize`][] undoes it exactly.

    Raises `ValueError` if the model is already quantised, or if a rule of a strict
    `Policy` matches no layer.

    ```python
    qmodel = nvfp4x.quantize(model, nvfp4x.recipes.nvfp4_training())
    ```
    """
    resolve, rules = _resolver(policy)
    already = qweights(model)
    if already:
        raise ValueError(
            f"nvfp4x.quantize: the model is already quantised (e.g. `{already[0][1].path}` "
            f"runs {already[0][1].recipe.name}). To change its policy, quantise "
            "`nvfp4x.dequantize(model)` instead; the master weights are kept exactly."
        )
    matched: set[int] = set()
    grouped: set[int] = set()  # tensor_scale_groups patterns that matched a quantised layer
    found = 0
    convs: list[str] = []  # convolutions the policy did not opt into
    tied: dict[int, tuple[str, Recipe]] = {}  # id(SharedNode) -> (path, recipe)

    def group(path: str) -> str | None:
        if rules is None:
            return None
        index, key = rules.scale_group(path)
        if index is not None:
            grouped.add(index)
        return key

    def choose(path: str, layer: Any) -> Recipe | None:
        nonlocal found
        found += 1
        index, recipe = resolve(path, layer)
        if index is not None:
            matched.add(index)
        return recipe

    def visit(node: Any, path: tuple) -> Any:
        if is_layer(node):
            p = path_str(path)
            recipe = choose(p, node)
            if recipe is None:
                return node
            if not eqx.is_array(node.weight):  # tied: quantised at its source below
                tied[id(node.weight)] = (p, recipe)
                return node
            if type(node) is eqx.nn.Linear:
                return QuantizedLinear.from_linear(
                    node, recipe, fast=fast, path=p, scale_group=group(p)
                )
            weight = QWeight(node.weight, recipe, p, fast, scale_group=group(p))
            return _interpreted(eqx.tree_at(lambda m: m.weight, node, weight))
        if is_conv(node):
            p = path_str(path)
            if rules is None or not rules.convolutions:
                convs.append(p)
                return node
            recipe = choose(p, node)
            if recipe is None:
                return node
            axes, groups = conv_kernel(node)
            weight = QWeight(node.weight, recipe, p, fast, kernel_axes=axes, groups=groups)
            return _interpreted(eqx.tree_at(lambda m: m.weight, node, weight))
        if isinstance(node, eqx.nn.Shared):
            return _visit_shared(node, path)
        if eqx.is_array(node) or node is None:
            return node
        flat, treedef = children(node)
        if len(flat) == 1 and flat[0][1] is node:  # a leaf that is not an array
            return node
        new = jax.tree_util.tree_unflatten(treedef, [visit(c, path + k) for k, c in flat])
        return _interpreted(new) if isinstance(new, eqx.Module) else new

    def _visit_shared(shared: Any, path: tuple) -> Any:
        inner = visit(shared.pytree, path + (jax.tree_util.GetAttrKey("pytree"),))
        slots = shared.where(inner)
        sources = shared.get(inner)
        many = isinstance(slots, list | tuple)
        slots, sources = (slots, sources) if many else ([slots], [sources])
        for slot, source in zip(slots, sources, strict=True):
            if id(slot) not in tied:
                continue
            p, recipe = tied.pop(id(slot))
            spots = [
                k for k, leaf in jax.tree_util.tree_flatten_with_path(inner)[0] if leaf is source
            ]
            if len(spots) != 1:
                raise ValueError(
                    f"nvfp4x.quantize: the policy selects `{p}`, whose weight is tied with "
                    "`eqx.nn.Shared` to a value its `get` computes (not a weight array of "
                    "the shared tree). Tie the weight directly (`get=lambda t: t.embed.weight`)"
                    " or leave the layer out of the policy."
                )
            weight = QWeight(source, recipe, p, fast, scale_group=group(p))
            inner = eqx.tree_at(lambda t, k=spots[0]: at_path(t, k), inner, weight)
        return eqx.tree_at(lambda s: s.pytree, shared, inner)

    out = visit(model, ())
    if found == 0:
        hint = (
            f" It holds convolutions (`{convs[0]}`...): `nvfp4x.Policy(rules, "
            "convolutions=True)` quantises them."
            if convs
            else ""
        )
        warnings.warn(
            "nvfp4x.quantize: the model holds no `eqx.nn.Linear` (nor a subclass of it, nor a "
            "module with a 2-D floating-point `weight` that its call reads in a GEMM); it is "
            "returned unchanged. For weights held as raw arrays, call `nvfp4x.qdot(x, w, "
            "recipe=...)` where the model multiplies by them." + hint,
            UserWarning,
            stacklevel=2,
        )
    elif rules is not None and rules.strict:
        rules.check_used(
            matched,
            "nvfp4x.quantize",
            "matched no linear layer (or every layer it matches was taken by an earlier "
            "rule). Paths look like `blocks[3].mlp.layers[0]`; see `nvfp4x.summary(model)`.",
        )
        idle = [i for i in range(len(rules.tensor_scale_groups)) if i not in grouped]
        if idle:
            names = ", ".join(f"`{rules.tensor_scale_groups[i].pattern}`" for i in idle)
            raise ValueError(
                f"nvfp4x.quantize: `tensor_scale_groups` pattern(s) {names} matched no "
                "quantised layer. Paths look like `blocks[3].attn.wq`; see "
                "`nvfp4x.summary(model)`. Pass `Policy(..., strict=False)` to allow it."
            )
    return out


def _interpreted(module: Any) -> Any:
    """`module` with its `__call__` interpreted if it holds a quantised weight anywhere
    (and is callable), as an instance of `interpreted_class(type(module))`: a subclass
    with the same name, so `isinstance`, attribute reads and `eqx.tree_at` behave as
    before. A `QuantizedLinear` calls its own GEMM."""
    if not isinstance(module, eqx.Module) or isinstance(module, QuantizedLinear | QWeight):
        return module
    cls = base_class(type(module))
    if not callable(module) or not qweights(module) or _calls_layers_only(cls):
        return module
    return with_class(module, interpreted_class(cls))


def _calls_layers_only(cls: type) -> bool:
    """Equinox's own containers (`MLP`, `Sequential`, `MultiheadAttention`, ...) only call
    their layers, so they keep their class; its weight wrappers read the weight."""
    own = cls.__module__.split(".")[0] == "equinox"
    reads_weight = eqx.nn.WeightNorm | eqx.nn.SpectralNorm | eqx.nn.Conv | eqx.nn.ConvTranspose
    return own and not issubclass(cls, reads_weight)


def dequantize(model: Any) -> Any:
    """Undo [`nvfp4x.quantize`][]: every quantised weight back to its master array, every
    [`nvfp4x.QuantizedLinear`][] back to `eqx.nn.Linear`, every module to its own class:
    `eqx.tree_equal(dequantize(quantize(m, p)), m)` holds.

    **Arguments:**

    - `model`: any PyTree; frozen layers are returned as they are.

    **Returns:** the model with plain layers. Telemetry probes (see `nvfp4x.telemetry`)
    are dropped with the rest of the quantisation.

    ```python
    model = eqx.nn.Linear(32, 16, key=jax.random.key(0))
    qmodel = nvfp4x.quantize(model, nvfp4x.recipes.nvfp4_inference())
    eqx.tree_equal(nvfp4x.dequantize(qmodel), model)   # True
    ```
    """

    def back(node: Any) -> Any:
        if isinstance(node, QuantizedLinear):
            return node.to_linear()
        if isinstance(node, QWeight):
            return node.array
        if eqx.is_array(node) or node is None:
            return node
        flat, treedef = children(node)
        if len(flat) == 1 and flat[0][1] is node:
            return node
        new = jax.tree_util.tree_unflatten(treedef, [back(c) for _, c in flat])
        if isinstance(new, eqx.Module):
            new = with_class(new, base_class(type(new)))
        return new

    return back(model)


def requantize(model: Any, policy: PolicyLike, *, state: Any = None) -> Any:
    """Switch a quantised model to new recipes mid-run: every quantised weight gets the
    recipe `policy` gives its path; master weights, telemetry probes and every other
    array stay as they are (the same arrays, not copies).

    This is the paper's precision schedule (NVFP4 for most of the run, then the last
    steps in bf16) in one call: no `quantize(dequantize(model), policy)`, and the
    optimiser state carries on. An optimiser state built from the model (`optax`'s
    moments mirror the model, quantised weights included, and their recipes are part of
    the tree structure) must be switched with it: pass it as `state`.

    **Arguments:**

    - `model`: a model returned by [`nvfp4x.quantize`][] (not a frozen one).
    - `policy`: like `quantize`'s: an [`nvfp4x.Policy`][], a recipe or recipe name, or a
      callable `(path, layer) -> recipe | None`. A weight it maps to `None` (or no rule
      matches) keeps its recipe.
    - `state`: any PyTree holding the model's quantised weights too (an optimiser state,
      gradients); they get the same recipes, found by their paths.

    **Returns:** the switched model, or `(model, state)` when `state` is given.

    Raises `ValueError` if `model` holds no quantised weight, if the policy selects a
    layer that `quantize` left unquantised (its weight is a plain array, and giving it a
    recipe would change the structure of the optimiser state: quantise it from the start,
    with `nvfp4x.recipes.float32()` if it should begin unquantised), if a rule of a strict
    `Policy` matches no quantised weight, or for a frozen model.

    ```python
    qmodel = nvfp4x.quantize(model, nvfp4x.recipes.nvfp4_training())
    opt_state = optim.init(eqx.filter(qmodel, eqx.is_array))
    ...  # train; then, for the last 10% of the steps:
    qmodel, opt_state = nvfp4x.requantize(qmodel, nvfp4x.recipes.bf16(), state=opt_state)
    ```
    """
    resolve, rules = _resolver(policy)
    if qweights(model, frozen=True) and not qweights(model):
        raise ValueError(
            "nvfp4x.requantize: the model is frozen (packed weights); switch the training "
            "model and `freeze` it again."
        )
    weights = qweights(model)
    if not weights:
        raise ValueError(
            "nvfp4x.requantize: the model holds no quantised weight; use `nvfp4x.quantize`."
        )
    matched: set[int] = set()

    def lookup(path: str, layer: Any) -> Recipe | None:
        index, recipe = resolve(path, layer)
        if index is not None:
            matched.add(index)
        return recipe

    # the layer that holds each quantised weight (for a policy callable's `layer`)
    owners = {
        layer.weight.path: layer
        for _, layer in site_layers(model)
        if isinstance(layer.weight, QWeight)
    }
    recipes = {}
    for _, w in weights:
        recipe = lookup(w.path, owners.get(w.path, w))
        recipes[w.path] = w.recipe if recipe is None else recipe
    for path, layer in site_layers(model):
        if isinstance(layer.weight, QWeight) or not eqx.is_array(layer.weight):
            continue
        if lookup(path, layer) is not None:
            raise ValueError(
                f"nvfp4x.requantize: the policy selects `{path}`, which `quantize` left "
                "unquantised; its weight is a plain array, and giving it a recipe would "
                "change the structure of the optimiser state. Quantise it from the start "
                "(`nvfp4x.recipes.float32()` runs it unquantised until you switch it), or "
                "leave it out of the policy."
            )
    if rules is not None:
        rules.check_used(
            matched,
            "nvfp4x.requantize",
            f"matched no quantised weight. Its paths: {sorted(recipes)}.",
        )

    def switch(tree: Any) -> Any:
        def one(node: Any) -> Any:
            if not isinstance(node, QWeight):
                return node
            if node.path not in recipes:
                raise ValueError(
                    f"nvfp4x.requantize: `state` holds a quantised weight `{node.path}` "
                    "that the model does not; pass the state built from this model."
                )
            return dataclasses.replace(node, recipe=recipes[node.path])

        return jax.tree.map(one, tree, is_leaf=is_qweight)

    if state is None:
        return switch(model)
    return switch(model), switch(state)
