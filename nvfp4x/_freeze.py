"""`freeze`: pack every quantised weight of a model for inference (NVFP4: 4.5 bits per
parameter) and drop the master copy, making the layers of `_frozen.py`."""

import functools
from collections.abc import Iterable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ._conv import gemm_matrix
from ._frozen import FrozenLinear, FrozenWeight, PackedWeight
from ._linear import QuantizedLinear
from ._numerics._nvfp4 import tensor_amax
from ._policy import Recipe
from ._prims import is_traced, vmapped
from ._qweight import QWeight
from ._sites import at_path, is_conv, is_layer, is_qweight, qweights


def weight_matrix(w: QWeight) -> Array:
    """The weight as its GEMMs consume it: the master array, or a convolution kernel as
    its GEMM matrix `(stack..., [groups,] out, in x window)` (`gemm_matrix`)."""
    if w.kernel_axes is None:
        return w.array
    return gemm_matrix(w.array, w.kernel_axes, w.groups)


def pack_weight(w: Array, recipe: Recipe, amax: Array | None = None) -> PackedWeight:
    """The weight in its GEMM format, per stacked slice (each slice its own tensor scale).
    `amax` (NVFP4 only; shape: the stack's leading axes) replaces each slice's own amax:
    a tensor scale shared by a group of layers."""
    if amax is None:
        return _pack_weight(w, recipe)
    return _pack_weight_amax(w, recipe, amax)


# Jitted: eager `freeze` is one compiled packing per weight shape and recipe.
@functools.partial(jax.jit, static_argnums=1)
def _pack_weight(w: Array, recipe: Recipe) -> PackedWeight:
    fmt = recipe.weight
    if fmt is None:
        return w
    return vmapped(functools.partial(fmt.spec.pack, fmt=fmt), w.ndim - 2)(w)


@functools.partial(jax.jit, static_argnums=1)
def _pack_weight_amax(w: Array, recipe: Recipe, amax: Array) -> PackedWeight:
    fmt = recipe.weight
    if fmt is None:  # (tensor scale groups hold quantised weights only)
        return w
    fn = lambda wi, ai: fmt.spec.pack(wi, fmt, amax=ai)
    return vmapped(fn, w.ndim - 2)(w, amax)


@jax.jit
def _weight_amax(w: Array) -> Array:
    """`max|w|` per stacked slice (the amax `to_nvfp4` takes for each slice)."""
    return vmapped(tensor_amax, w.ndim - 2)(w)


def _group_amaxes(model: Any) -> dict[str, Array]:
    """The shared amax of every tensor scale group (the policy's `tensor_scale_groups`):
    the largest amax of its NVFP4 weights, per stacked slice. Weights of other formats
    have no tensor scale to share and take no part."""
    members: dict[str, list[QWeight]] = {}
    for _, w in qweights(model):
        fmt = w.recipe.weight
        if w.scale_group is not None and fmt is not None and fmt.spec.shared_tensor_scale:
            members.setdefault(w.scale_group, []).append(w)
    amaxes = {}
    for key, ws in members.items():
        stacks = {tuple(w.problem_shape) for w in ws}
        if len(stacks) > 1:
            listed = ", ".join(f"`{w.path}` {tuple(w.array.shape)}" for w in ws)
            raise ValueError(
                f"nvfp4x.freeze: the tensor scale group {key!r} holds weights stacked "
                f"differently ({listed}); one scale per slice needs the same stack. Change "
                "the policy's `tensor_scale_groups`."
            )
        amaxes[key] = functools.reduce(jnp.maximum, [_weight_amax(weight_matrix(w)) for w in ws])
    return amaxes


def freeze(model: Any, *, tied: Iterable[str] = ()) -> Any:
    """Pack every quantised weight for inference: a [`nvfp4x.QuantizedLinear`][] becomes
    a [`nvfp4x.FrozenLinear`][], any other quantised weight (user linear classes,
    subclasses, tied weights) a [`nvfp4x.FrozenWeight`][]; the weight is held in its
    recipe's weight format (NVFP4: 4.5 bits per parameter), master copy gone.

    The frozen forward equals the unfrozen one bit for bit wherever the weight is used
    in its stored layout (on a GPU, up to float32 summation order: XLA:GPU picks each
    program's GEMM algorithm). A weight that a wrapper transforms before its GEMM
    (`eqx.nn.WeightNorm`'s `v * g / ||v||`, `eqx.nn.SpectralNorm`'s `W / σ`) keeps its
    master array besides the packed one (`FrozenWeight.master`), as a tied weight does:
    the wrapper reads it and the GEMM quantises the transformed master values as
    training did, bit for bit (the memory of the float weight plus the packed one).
    Equinox's wrappers are found; a user's wrapper that scales, normalises or masks
    `self.layer.weight` is named in `tied` (without it, its frozen forward raises at the
    transform, naming the weight and this fix). A weight read in another layout (a
    reshape, a slice) is decoded and quantised again at use: close to the unfrozen
    numbers, not bit-equal. Stacked layers get one tensor scale per slice. NVFP4
    weights in one tensor scale group (the policy's `tensor_scale_groups`, see
    [`nvfp4x.Policy`][]) share one tensor scale, from the group's largest amax: the
    layer that holds it freezes as without the group, the others to a coarser grid than
    their training forward used (not bit-equal to it).
    A convolution kernel is packed as trained, as its GEMM matrix `(out, in x window)`
    (one per feature group of a grouped convolution, each with its own tensor scale),
    and its frozen forward equals the unfrozen one bit for bit.
    A stack whose `QWeight.enabled` mask keeps slices unquantised is refused (a frozen
    stack holds every slice in one format); the mask is read when it is concrete, so
    freeze such a model outside `jax.jit`.
    Serialise with [`nvfp4x.save`][]; export for serving stacks with
    [`nvfp4x.export_hf`][]. Eager calls are jitted (one compiled packing per weight shape
    and recipe).

    A weight tied to an embedding (the LM head's weight is also the input embedding
    table) is read two ways: its GEMM ran quantised, its lookup read the master values.
    Such a weight keeps its master array besides the packed one (`FrozenWeight.master`:
    the memory of an untied model, embedding table plus packed head), so the frozen
    lookup reads what training's did and the forward stays bit for bit. Ties that place
    the weight in a module other than a linear layer (an `eqx.nn.Embedding`) through
    `eqx.nn.Shared`, or as one master array in two places (`eqx.tree_at`), are found
    (eagerly: under `jax.jit` the two places are two tracers); name other ties in
    `tied` (a property building an `eqx.nn.Embedding` from the head's weight, as
    esm2quinox does). A frozen weight
    without its master values raises if a lookup reads it, naming it and `tied`.

    **Arguments:**

    - `model`: a model returned by [`nvfp4x.quantize`][] (trained or not).
    - `tied`: paths of quantised weights (as [`nvfp4x.summary`][] lists them) that the
      model also reads outside GEMMs or transforms before them, e.g.
      `["logit_head.linear2"]`: they keep their master values for those reads.

    **Returns:** the frozen model.

    ```python
    frozen = nvfp4x.freeze(nvfp4x.quantize(model, nvfp4x.recipes.nvfp4_weight_only()))
    ```
    """

    amaxes = _group_amaxes(model)
    tied = _tied_paths(model, tied)

    def packed(w: QWeight) -> PackedWeight:
        _refuse_unquantised_slices(w)
        amax = None if w.scale_group is None else amaxes.get(w.scale_group)
        return pack_weight(weight_matrix(w), w.recipe, amax)

    def frozen(w: QWeight) -> FrozenWeight:
        master = w.array if w.path in tied else None
        conv = w.kernel_axes is not None  # packed as its GEMM matrix: keep the kernel's shape
        return FrozenWeight(
            packed(w),
            w.recipe,
            w.path,
            w.fast,
            master=master,
            kernel_shape=tuple(w.array.shape[len(w.stack_shape) :]) if conv else None,
            kernel_axes=w.kernel_axes,
            groups=w.groups,
        )

    def one(leaf):
        if isinstance(leaf, QuantizedLinear):
            w = leaf.weight
            return FrozenLinear(
                weight=frozen(w),
                bias=leaf.bias,
                in_features=leaf.in_features,
                out_features=leaf.out_features,
                use_bias=leaf.use_bias,
                recipe=w.recipe,
                fast=w.fast,
            )
        if isinstance(leaf, QWeight):
            return frozen(leaf)
        return leaf

    is_leaf = lambda x: isinstance(x, QuantizedLinear | QWeight)
    return jax.tree_util.tree_map(one, model, is_leaf=is_leaf)


def _refuse_unquantised_slices(w: QWeight) -> None:
    """Raise if `w.enabled` keeps some slices of a stack out of its weight format:
    packing them would run them quantised, silently."""
    if w.enabled is None or w.recipe.weight is None or is_traced(w.enabled):
        return
    on = np.asarray(w.enabled).reshape(-1)
    if on.all():
        return
    off = [int(i) for i in np.flatnonzero(~on)]
    raise ValueError(
        f"nvfp4x.freeze: `{w.path}` keeps slices {off} of its stack unquantised "
        f"(`QWeight.enabled`), but a frozen stack holds every slice in its weight format "
        f"({w.recipe.weight}); freezing would run those slices quantised. Set the mask to "
        "all true to freeze them quantised, or hold those layers outside the stack and "
        "leave them out of the policy."
    )


#: Equinox's wrappers that transform their layer's weight before its GEMM, from the
#: master values (`eqx.nn.WeightNorm`: `v * g / ||v||`; `eqx.nn.SpectralNorm`: `W / σ`,
#: σ by power iteration on `W`).
WEIGHT_WRAPPERS = (eqx.nn.WeightNorm, eqx.nn.SpectralNorm)


def _wrapped_paths(model: Any) -> set[str]:
    """The paths of the quantised weights that a `WEIGHT_WRAPPERS` module transforms
    before its layer's GEMM (its `layer`'s `weight_name` field)."""
    wrapper = lambda x: isinstance(x, WEIGHT_WRAPPERS)
    found = set()
    for node in jax.tree_util.tree_leaves(model, is_leaf=wrapper):
        if wrapper(node):
            w = getattr(node.layer, node.weight_name, None)
            if isinstance(w, QWeight):
                found.add(w.path)
    return found


def _tied_paths(model: Any, named: Iterable[str]) -> frozenset[str]:
    """The paths of the quantised weights that keep their master values: those in
    `named`, those that an `eqx.nn.Shared` places (or that sit, as one object, in two
    places of the model) in a module other than a linear layer or convolution (an
    embedding: a read that is not a GEMM), and those that a wrapper of Equinox's
    transforms before their GEMM (`WEIGHT_WRAPPERS`)."""
    if isinstance(named, str):
        raise TypeError(f"`tied` must be a list of weight paths, e.g. `[{named!r}]`.")
    named = frozenset(named)
    paths = {w.path for _, w in qweights(model)}
    unknown = sorted(named - paths)
    if unknown:
        raise ValueError(
            f"nvfp4x.freeze: `tied` names {unknown}, which are not quantised weights of the "
            f"model; its quantised weights are {sorted(paths)}."
        )
    found = set(named) | _wrapped_paths(model)
    # One weight (the same master array object) in two places (`eqx.tree_at` tying an
    # embedding table to a quantised head): a place that is not a linear layer or
    # convolution reads it otherwise.
    places: dict[int, list[tuple]] = {}
    for keys, w in jax.tree_util.tree_flatten_with_path(model, is_leaf=is_qweight)[0]:
        if is_qweight(w):
            places.setdefault(id(w.array), []).append(keys)
    for spots in places.values():
        holders = [at_path(model, keys[:-1]) for keys in spots]
        if len(spots) > 1 and not all(is_layer(h) or is_conv(h) for h in holders):
            found.add(at_path(model, spots[0]).path)
    shared = lambda x: isinstance(x, eqx.nn.Shared)
    for node in jax.tree_util.tree_leaves(model, is_leaf=shared):
        if not shared(node):
            continue
        expanded = node()  # the sources placed in the slots: every spot of a tied weight
        for keys, w in jax.tree_util.tree_flatten_with_path(expanded, is_leaf=is_qweight)[0]:
            holder = at_path(expanded, keys[:-1])
            if is_qweight(w) and not (is_layer(holder) or is_conv(holder)):
                found.add(w.path)
    return frozenset(found)
