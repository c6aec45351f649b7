"""`scan_layers`: `lax.scan` over a stack of layers that keeps frozen weights whole."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array

from ._frozen import FrozenLayerOfStack, FrozenLinear, FrozenWeight


def scan_layers(
    f: Callable[[Any, Any], tuple[Any, Any]],
    init: Any,
    layers: Any,
    *,
    reverse: bool = False,
    unroll: int | bool = 1,
) -> tuple[Any, Any]:
    """`jax.lax.scan(f, init, layers)` over a stack of layers (every array of `layers`
    stacked on a leading axis of the same length, as `eqx.filter_vmap` builds a stack
    of modules), with each frozen layer's packed weight kept whole.

    `lax.scan` hands its body each layer's slice of the stacked arrays; before a kernel
    call (the TPU's frozen GEMM) XLA copies that slice, every step: the packed weights
    are read twice and written once more than the GEMM needs. Here the body gets each
    [`nvfp4x.FrozenLinear`][] as a [`nvfp4x.FrozenLayerOfStack`][], whose forward reads
    its layer from the whole stack by index inside the GEMM (on a TPU; elsewhere the
    slice, as `lax.scan` does); every other array is sliced as `lax.scan` slices it.
    The numbers are those of `lax.scan(f, init, layers)`, bit for bit.

    **Arguments:**

    - `f`: `f(carry, layer) -> (carry, y)`, as `lax.scan`'s body; `layer` has the
      structure of `layers`, each array one layer's slice.
    - `init`: the initial carry.
    - `layers`: a pytree of stacked layers (modules, arrays).
    - `reverse`, `unroll`: as `lax.scan`'s.

    **Returns:** `(carry, ys)`, as `lax.scan`.

    ```python
    blocks = eqx.filter_vmap(lambda k: Block(k))(jax.random.split(key, 24))
    frozen = nvfp4x.freeze(nvfp4x.quantize(blocks, "nvfp4_inference"))
    h, _ = nvfp4x.scan_layers(lambda h, block: (block(h), None), h, frozen)
    ```
    """
    arrays, static = eqx.partition(layers, eqx.is_array)
    lengths = {a.shape[0] if a.ndim else None for a in jax.tree_util.tree_leaves(arrays)}
    if len(lengths) != 1 or None in lengths:
        raise ValueError(
            "nvfp4x.scan_layers: every array of `layers` must be stacked on a leading axis "
            f"of one length (a stack of layers), got leading lengths {sorted(map(str, lengths))}; "
            "build the stack with `eqx.filter_vmap`, or call `jax.lax.scan` for other pytrees."
        )
    (length,) = lengths
    is_frozen = lambda node: isinstance(node, FrozenLinear)  # noqa: E731

    def by_index(layer: Any, whole: Any, index: Array) -> Any:
        if (
            isinstance(layer, FrozenLinear)
            and isinstance(whole.weight, FrozenWeight)
            and len(layer.weight_shape) == 2
        ):
            return FrozenLayerOfStack(layer, whole.weight, index)
        return layer

    def body(carry: Any, index: Array) -> tuple[Any, Any]:
        sliced = jax.tree_util.tree_map(
            lambda a: lax.dynamic_index_in_dim(a, index, keepdims=False), arrays
        )
        layer, whole = eqx.combine(sliced, static), eqx.combine(arrays, static)
        layer = jax.tree_util.tree_map(
            lambda a, b: by_index(a, b, index), layer, whole, is_leaf=is_frozen
        )
        return f(carry, layer)

    indices = jnp.arange(length, dtype=jnp.int32)
    return lax.scan(body, init, indices, reverse=reverse, unroll=unroll)
