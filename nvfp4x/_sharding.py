"""Shardings for packed weights: codes and scales follow the weight, tensor scales are
replicated over the matrix axes."""

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from ._axes import axis_size
from ._frozen import FrozenWeight
from ._packed import PackedArray


def packed_sharding(packed: Any, sharding: NamedSharding) -> Any:
    """The shardings of a packed weight's leaves, given the sharding its master weight
    `(..., out, in)` had: codes and block scales take the weight's `PartitionSpec` (so
    each device holds its 1/N of the packed bytes), tensor scales the spec of the leading
    (stacked) axes only.

    Raises `ValueError` naming the axis if a shard would cut a block in two.

    **Arguments:**

    - `packed`: an `NVFP4Array`, `MXFP8Array`, `FP8Array` or plain array, or a frozen
      layer's `FrozenWeight` holding one.
    - `sharding`: a `NamedSharding` for the logical weight.

    **Returns:** a PyTree of `NamedSharding` with `packed`'s structure, for
    `jax.device_put(packed, shardings)` or `eqx.filter_shard`.

    ```python
    mesh = jax.make_mesh((1,), ("model",))
    w = nvfp4x.to_nvfp4(jax.random.normal(jax.random.key(0), (16, 32)), block=(16, 16))
    shardings = nvfp4x.packed_sharding(w, NamedSharding(mesh, PartitionSpec("model", None)))
    shardings.codes.spec, shardings.tensor_scale.spec   # P('model', None), P()
    ```
    """
    mesh, spec = sharding.mesh, tuple(sharding.spec)
    shape = tuple(packed.shape)
    # A frozen layer's weight: its packed array.
    packed_array = packed.packed if isinstance(packed, FrozenWeight) else packed
    spec = spec + (None,) * (len(shape) - len(spec))
    # What the packed array's class declares: the blocks a shard must not cut, and which
    # fields hold one value per tensor.
    is_packed = isinstance(packed_array, PackedArray)
    blocks = packed_array.shard_blocks if is_packed else ()
    per_tensor = type(packed_array).per_tensor if is_packed else ()
    for i, b in enumerate(blocks):
        axis = len(shape) - 2 + i
        n = axis_size(mesh, spec[axis])
        if n > 1 and (shape[axis] % n or (shape[axis] // n) % b):
            raise ValueError(
                f"Sharding axis {axis} (size {shape[axis]}) of a packed weight over "
                f"`{spec[axis]}` ({n} devices) gives shards of {shape[axis] / n:g}, not a "
                f"multiple of the block size {b}: a block would straddle two devices. Shard "
                "another axis, use fewer devices on this one, or pad the layer."
            )
    full = NamedSharding(mesh, PartitionSpec(*spec))
    lead = NamedSharding(mesh, PartitionSpec(*spec[:-2]))

    def leaf_sharding(path, leaf):
        name = getattr(path[-1], "name", None) if path else None
        return lead if name in per_tensor else full

    return jax.tree_util.tree_map_with_path(leaf_sharding, packed)


def shard_packed(packed: Any, sharding: NamedSharding) -> Any:
    """Place a packed weight on devices as its master weight was sharded:
    `jax.device_put(packed, packed_sharding(packed, sharding))`.

    **Arguments:**

    - `packed`: an `NVFP4Array`, `MXFP8Array`, `FP8Array` or plain array, or a frozen
      layer's `FrozenWeight` holding one.
    - `sharding`: a `NamedSharding` for the logical weight `(..., out, in)`.

    **Returns:** `packed` with every leaf placed per [`nvfp4x.packed_sharding`][], which
    also raises the `ValueError` if a shard would cut a block in two.

    ```python
    mesh = jax.make_mesh((1,), ("model",))
    w = nvfp4x.to_nvfp4(jax.random.normal(jax.random.key(0), (16, 32)), block=(16, 16))
    w = nvfp4x.shard_packed(w, NamedSharding(mesh, PartitionSpec("model", None)))
    ```
    """
    return jax.device_put(packed, packed_sharding(packed, sharding))
