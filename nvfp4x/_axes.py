"""Meshes with explicit axes ("sharding in types", `jax.make_mesh`'s default since jax 0.9).

Under explicit axes every JAX operation must know the sharding of its result, and the
block reshapes of the quantisers (`(256@fsdp, 128) -> (16, 16, 8, 16)`) have none that
JAX can infer. nvfp4x therefore runs each of its computations on such arrays with the
mesh's axes switched to automatic (XLA places the gathers and the global amax
all-reduces, as under an automatic mesh) and gives the results explicit shardings:

- a GEMM's output gets the sharding JAX gives the plain `x @ W.T` (`explicit_axes_as_auto`),
  so a quantised model type-checks where the plain one does, and raises JAX's own error
  where it does not;
- a quantised array's leaves (codes, block scales, tensor scales) and a dequantised array
  follow the input's partition spec, axis by axis, where the leaf's size along that axis
  divides evenly (`follows_input_sharding`): each device keeps its share of the bytes.

The mesh is the context mesh (`jax.set_mesh`) or, without one, the mesh in the arrays'
types (`jax.device_put(x, NamedSharding(mesh, spec))` outside any mesh context).
"""

import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, overload

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array


def explicit_mesh(*trees: Any) -> Any:
    """The mesh with explicit axes that arrays in `trees` are typed on, or `None`.

    The context mesh decides when there is one (inside `auto_axes` its axes are
    automatic, so nested calls run as they are); otherwise the first array whose type
    carries a mesh with explicit axes."""
    context = jax.sharding.get_abstract_mesh()
    if not context.empty:
        return context if context.explicit_axes else None
    for leaf in jax.tree.leaves(trees):
        if not isinstance(leaf, jax.Array):
            continue
        mesh = getattr(jax.typeof(leaf).sharding, "mesh", None)
        if mesh is not None and not mesh.empty and mesh.explicit_axes:
            return mesh
    return None


def axis_size(mesh: Any, entry: Any) -> int:
    """How many devices a `PartitionSpec` entry (a mesh axis name, a tuple of them, or
    None) splits an array axis over."""
    if entry is None:
        return 1
    size = 1
    for name in entry if isinstance(entry, tuple) else (entry,):
        size *= mesh.shape[name]
    return size


def following_spec(mesh: Any, spec: PartitionSpec, shape: tuple, out_shape: tuple) -> PartitionSpec:
    """The partition spec of a result of shape `out_shape` computed from an input of
    shape `shape` sharded as `spec`: a result of the input's rank keeps each axis's entry
    where its size there divides evenly over the axis's devices; a result of lower rank
    (a tensor scale per leading slice) takes the leading axes' entries the same way."""
    entries = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
    out = []
    for i, n in enumerate(out_shape):
        entry = entries[i] if i < len(entries) else None
        out.append(entry if entry is not None and n % axis_size(mesh, entry) == 0 else None)
    return PartitionSpec(*out)


_P = ParamSpec("_P")
_R = TypeVar("_R")


@overload
def follows_input_sharding(
    fn: Callable[_P, _R], *, like: Callable | None = None
) -> Callable[_P, _R]: ...
@overload
def follows_input_sharding(
    fn: None = None, *, like: Callable | None = None
) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]: ...
def follows_input_sharding(
    fn: Callable[..., Any] | None = None, *, like: Callable[..., Any] | None = None
) -> Any:
    """Decorate a function whose results (an array, or a PyTree of arrays such as a
    quantised array) are computed block by block from one array argument, `like(*args)`
    (by default the first argument). When that array is typed with explicit mesh axes
    the function runs with those axes automatic, and every result follows its partition
    spec (`following_spec`). Elsewhere the function runs unchanged.

    Every array argument (a PRNG key, an amax, a packed array's leaves) travels through
    the switch; everything else (block shapes, format names) is passed as it is."""
    if fn is None:
        return functools.partial(follows_input_sharding, like=like)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        ref = like(*args) if like is not None else args[0]
        mesh = explicit_mesh(ref) if isinstance(ref, jax.Array) else None
        if mesh is None:
            return fn(*args, **kwargs)
        dynamic, static = eqx.partition((args, kwargs), eqx.is_array)

        def call(dynamic):
            a, kw = eqx.combine(dynamic, static)
            return fn(*a, **kw)

        # The results' shapes, from replicated stand-ins (their reshapes always type-check).
        stand_ins = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), dynamic)
        shapes = jax.eval_shape(call, stand_ins)
        spec = jax.typeof(ref).sharding.spec
        outs = jax.tree.map(
            lambda s: NamedSharding(mesh, following_spec(mesh, spec, ref.shape, s.shape)), shapes
        )
        return jax.sharding.auto_axes(call, out_sharding=outs)(dynamic)

    return wrapper


def explicit_axes_as_auto(matmul: Callable, x: Array, operands: tuple, weight) -> Array:
    """`matmul(x, *operands)`, the GEMM `x @ W.T`. Under a mesh with explicit axes it
    runs with those axes switched to automatic, and its output gets the sharding JAX
    gives the plain `x @ W.T`, so that a quantised model type-checks where the plain one
    does and raises JAX's own error where it does not.

    `weight` is `(shape, like)`: the logical weight's shape and an array with its
    partition spec (the weight itself, or a packed weight's codes); or `None` for a
    weight rearranged inside `matmul` (the output then keeps `x`'s sharding on its
    leading axes, its features replicated). A `matmul` that is a `functools.partial` of a
    module-level function with hashable keywords is jitted once per (function, keywords,
    output sharding), so that eager calls and eager `jax.grad` go through the same
    traced program as jitted ones."""
    mesh = explicit_mesh(x, operands)
    if mesh is None:
        return matmul(x, *operands)
    if weight is None:
        spec = tuple(jax.typeof(x).sharding.spec)
        spec = spec + (None,) * (x.ndim - len(spec))
        out_sharding = NamedSharding(mesh, PartitionSpec(*spec[:-1], None))
        return jax.jit(jax.sharding.auto_axes(matmul, out_sharding=out_sharding))(x, *operands)
    shape, like = weight
    w = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=jax.typeof(like).sharding)
    out = jax.eval_shape(lambda a, b: jnp.matmul(a, b.T, preferred_element_type=jnp.float32), x, w)
    keywords = tuple(sorted(matmul.keywords.items()))
    return _auto_gemm(matmul.func, keywords, out.sharding)(x, *operands)


@functools.cache
def _auto_gemm(func, keywords: tuple, out_sharding) -> Callable:
    fn = functools.partial(func, **dict(keywords))
    return jax.jit(jax.sharding.auto_axes(fn, out_sharding=out_sharding))
