"""What is quantisable, and where: the one place that answers "is this a layer?" and
"what is this node's path?". `quantize`, `dequantize`, `summary`, `freeze`, `telemetry`
and `sensitivity` all ask here.

A *linear-like layer* is
- an `eqx.nn.Linear`, or any subclass of it (its own fields and `__call__` are kept), or
- any other `eqx.Module` with a floating-point array field `weight` of at least two
  dimensions (a user's `LlamaLinear`, a LoRA layer...), except Equinox's layers whose
  `weight` is not a linear map's (`Embedding`, convolutions, normalisations), and
  except modules whose call holds no GEMM at all: such a module is traced once (per
  class, structure and shapes) on an abstract input of the weight's last dimension
  (float, then an integer index); if that trace succeeds and contains no
  `dot_general` or convolution, its weight is not a linear map's (a norm's scale
  stacked by `eqx.filter_vmap` to `(layers, d)`, a positional table added to the
  input, a user's embedding), and it is left alone. A module whose call runs its weight
  only in convolutions (`lax.conv_general_dilated`, no `dot_general`; tried also on the
  inputs a convolution takes, for a weight of three or more dimensions) is a
  *convolution*, like Equinox's (`is_conv`): quantised only under
  `Policy(..., convolutions=True)`, however its class is written. A call that cannot be
  traced on any of these inputs (extra arguments) keeps the module a layer.

Its weight is what a policy selects (by the layer's path, or `path.weight`): the GEMMs
that consume it run quantised wherever they happen (see `_qweight`).
"""

import functools
import warnings
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax

from ._prims import gemm_eqns
from ._qweight import QWeight, WeightValue

#: Equinox layers with a `weight` that is not a linear layer's: never linear-like.
_NOT_LINEAR = (
    eqx.nn.Embedding,
    eqx.nn.Conv,
    eqx.nn.ConvTranspose,
    eqx.nn.LayerNorm,
    eqx.nn.GroupNorm,
    eqx.nn.RMSNorm,
    eqx.nn.BatchNorm,
    eqx.nn.PReLU,
)


def weight_path(layer: str) -> str:
    """The path of the `weight` of the layer at path `layer`: `blocks[0].fc.weight`
    (`weight` for a layer at the root)."""
    return f"{layer}.weight" if layer else "weight"


def layer_path(weight: str) -> str:
    """The path of the layer holding the weight at path `weight` (the inverse of
    `weight_path`); a path that does not end in `weight` is returned as it is."""
    return "" if weight == "weight" else weight.removesuffix(".weight")


def path_str(path: tuple) -> str:
    """`blocks[3].mlp.fc1`: attributes joined by dots, indices and dict keys in brackets."""
    out = ""
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey):
            out += ("." if out else "") + k.name
        elif isinstance(k, jax.tree_util.SequenceKey):
            out += f"[{k.idx}]"
        elif isinstance(k, jax.tree_util.DictKey | jax.tree_util.FlattenedIndexKey):
            out += f"[{k.key}]"
        else:
            out += str(k)
    return out


def at_path(tree: Any, keys: tuple) -> Any:
    """The node of `tree` at `keys` (a path of `jax.tree_util.tree_flatten_with_path`)."""
    for k in keys:
        if isinstance(k, jax.tree_util.GetAttrKey):
            tree = getattr(tree, k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            tree = tree[k.idx]
        else:
            tree = tree[k.key]
    return tree


def _is_weight_array(w: Any) -> bool:
    if isinstance(w, WeightValue):
        return True
    shape, dtype = getattr(w, "shape", None), getattr(w, "dtype", None)
    if shape is None or dtype is None or len(shape) < 2:
        return False
    try:
        return bool(jnp.issubdtype(dtype, jnp.inexact))
    except TypeError:
        return False


def _candidate_weight(x: Any) -> Any:
    """The floating-point `weight` of `x` when `x` is a callable module that may run it
    as a layer (not one of `_NOT_LINEAR`, not a weight itself), else None."""
    if not isinstance(x, eqx.Module) or isinstance(x, (*_NOT_LINEAR, WeightValue)):
        return None
    weight = getattr(x, "weight", None)
    if weight is None or not _is_weight_array(weight) or not callable(x):
        return None
    return weight


def is_layer(x: Any) -> bool:
    """Whether `x` is a linear-like layer (see the module docstring)."""
    if isinstance(x, eqx.nn.Linear):
        return True
    weight = _candidate_weight(x)
    if weight is None:
        return False
    if isinstance(weight, WeightValue):  # already chosen by `quantize`
        return getattr(weight, "kernel_axes", None) is None
    found = _call_gemms(x)
    return found is None or found.dot


def is_conv(x: Any) -> bool:
    """Whether `x` is a convolution (selected only by a `Policy(..., convolutions=True)`):
    one of Equinox's, or any module with a floating-point `weight` of three or more
    dimensions whose call runs it as a convolution kernel (its GEMMs are
    `lax.conv_general_dilated`, no `dot_general`: a user's depthwise short convolution)."""
    if isinstance(x, eqx.nn.Conv | eqx.nn.ConvTranspose):
        return True
    weight = _candidate_weight(x)
    if weight is None:
        return False
    if isinstance(weight, WeightValue):
        return getattr(weight, "kernel_axes", None) is not None
    found = _call_gemms(x)
    return found is not None and found.conv is not None and not found.dot


def conv_kernel(x: Any) -> tuple[tuple[int, ...], int]:
    """`(kernel_axes, groups)` of the convolution `x` (`is_conv(x)`): the roles of its
    kernel's axes as `lax.conv_general_dilated`'s kernel spec (out channels, in channels,
    window...) and its feature group count."""
    if isinstance(x, eqx.nn.Conv | eqx.nn.ConvTranspose):
        # (a stack of them, `eqx.filter_vmap`-made, has leading axes before the kernel)
        return tuple(range(x.num_spatial_dims + 2)), x.groups
    found = _call_gemms(x)
    if found is None or found.conv is None:
        raise ValueError(f"{type(x).__name__} is not a convolution")  # callers check
    return found.conv


class _Gemms(NamedTuple):
    """What a module's traced call holds: a `dot_general` (`dot`), and the kernel spec
    and feature group count of its first convolution (`conv`, or None)."""

    dot: bool
    conv: tuple[tuple[int, ...], int] | None


def _call_gemms(module: Any) -> "_Gemms | None":
    """The GEMMs of `module`'s call, traced on abstract inputs (None if no input tried
    traces): first one of the weight's last dimension (float, then an integer index),
    then, for a weight of three or more dimensions, the inputs a convolution takes
    (`_conv_inputs`). Cached by class, static fields and shapes. (Arrays and their
    `ShapeDtypeStruct`s alike: a model made by `eqx.filter_eval_shape` answers as the
    model does.) A stack of such modules (`eqx.filter_vmap`-made: every array with the
    same leading axis) that traces on no input is traced as one of its slices."""
    weight = module.weight
    arrays, rest = eqx.partition(module, _is_array_like)
    leaves, treedef = jax.tree_util.tree_flatten(arrays)
    shape = tuple(weight.shape)
    avals = tuple(jax.ShapeDtypeStruct(v.shape, v.dtype) for v in leaves)
    while True:
        inputs = (
            jax.ShapeDtypeStruct((shape[-1],), weight.dtype),
            jax.ShapeDtypeStruct((), jnp.int32),
            *_conv_inputs(shape, weight.dtype),
        )
        try:
            found = _cached_traced_gemm(rest, treedef, avals, inputs)
        except TypeError:  # an unhashable static field: trace without the cache
            found = _traced_gemm(rest, treedef, avals, inputs)
        lead = {v.shape[0] if v.shape else None for v in avals}
        if found is not None or len(shape) <= 2 or len(lead) != 1 or None in lead:
            return found
        shape = shape[1:]  # one slice of the stack
        avals = tuple(jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for v in avals)


def _is_array_like(v: Any) -> bool:
    return eqx.is_array(v) or isinstance(v, jax.ShapeDtypeStruct)


def _traced_gemm(rest, treedef, avals, inputs) -> "_Gemms | None":
    def call(leaves, x):
        return eqx.combine(jax.tree_util.tree_unflatten(treedef, leaves), rest)(x)

    for arg in inputs:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                jaxpr = jax.make_jaxpr(call)(list(avals), arg)
        except Exception:  # noqa: BLE001 - any failure: this input is not the call's
            continue
        eqns = gemm_eqns(jaxpr.jaxpr)
        convs = [e for e in eqns if e.primitive is lax.conv_general_dilated_p]
        dot = len(convs) < len(eqns)  # a `dot_general` or a `ragged_dot`
        conv = None
        if convs:
            params = convs[0].params
            conv = (tuple(params["dimension_numbers"].rhs_spec), params["feature_group_count"])
        return _Gemms(dot, conv)
    return None


#: `_traced_gemm`, cached by class, static fields and shapes.
_cached_traced_gemm = functools.lru_cache(maxsize=4096)(_traced_gemm)


def _conv_inputs(shape: tuple[int, ...], dtype) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Abstract inputs a convolution with a kernel of shape `shape` (out, in, window...)
    might take: channels first or last, unbatched or a batch of one."""
    if len(shape) < 3:
        return ()
    spatial = (16 + 2 * max(shape),) * (len(shape) - 2)
    out = []
    for c in dict.fromkeys((shape[0], shape[1])):  # a depthwise kernel: (C, 1, ...)
        for s in ((c, *spatial), (*spatial, c), (1, c, *spatial), (1, *spatial, c)):
            out.append(jax.ShapeDtypeStruct(s, dtype))
    return tuple(out)


def layers(model: Any) -> list[tuple[str, Any]]:
    """`(path, layer)` of every linear-like layer of `model`, in tree order. Layers
    nested inside a layer (a LoRA layer holding a Linear) are not listed separately."""
    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_layer)[0]
    return [(path_str(p), leaf) for p, leaf in leaves if is_layer(leaf)]


def is_qweight(x: Any) -> bool:
    """Whether `x` is a quantised (training) weight, a `QWeight`."""
    return isinstance(x, QWeight)


def is_weight(x: Any) -> bool:
    """Whether `x` is a quantised weight, training (`QWeight`) or frozen."""
    return isinstance(x, WeightValue)


def qweights(model: Any, *, frozen: bool = False) -> list[tuple[str, Any]]:
    """`(tree path, weight)` of every `QWeight` of `model` (and frozen weight, if
    `frozen`), in tree order."""
    test = is_weight if frozen else is_qweight
    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=test)
    return [(path_str(p), w) for p, w in leaves[0] if test(w)]


def children(node: Any) -> tuple[list, Any]:
    """The immediate children of a pytree node with their keys, and how to rebuild it."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    return flat, treedef
