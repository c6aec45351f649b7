"""The inference form of quantised weights: `FrozenWeight` and `FrozenLinear` hold a
weight packed in its GEMM format (NVFP4: 4.5 bits per parameter), without the master
copy, and run its GEMM from the packed form. (`freeze`, which makes them: `_freeze.py`;
checkpoints of frozen models: `_checkpoint.py`.)"""

import dataclasses
import functools
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import quax
from jax import lax
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray, Shaped

from ._axes import explicit_axes_as_auto
from ._conv import check_conv_kernel, conv_qdot, kernel_from_matrix, runs_fast
from ._dispatch import (
    Layout,
    as_qweight,
    default_rule,
    dot_operand,
    gemm_out_dtype,
    kernel_conv,
    ragged_rule,
    weight_gemm,
)
from ._formats import gemm_dtype, quantize_operand
from ._formats._dot import (
    runs_chunked,
)
from ._gemm import batched_problem, fprop, quantised_dot
from ._kernels import pick
from ._linear import apply_linear, product_seen_by_interpreter
from ._packed import PackedArray
from ._policy import Recipe
from ._prims import (
    PLACEMENT,
    PLACEMENT_MANY,
    def_jvp,
    is_zero,
    primitive,
    ragged_dot_general_p,
    shaped,
    vmapped,
    zero_tangent,
)
from ._qweight import QWeight, WeightValue
from ._ragged import every_expert_fprop, grouped_fprop

PackedWeight = PackedArray | Array


class FrozenWeight(WeightValue):
    """A quantised weight of a layer other than a `QuantizedLinear` (a user's linear
    class, a subclass of `eqx.nn.Linear`, a tied weight), packed by [`nvfp4x.freeze`][]:
    the [`nvfp4x.QWeight`][] of inference. Every GEMM that consumes it decodes the packed
    weight (the same values as the unfrozen forward quantised, bit for bit, when it is
    used in its stored layout `x @ w.T` / `w @ x`).

    Other uses (an embedding lookup, a norm) read what training read there, the master
    values, when the weight keeps them: a weight tied to an embedding (see `freeze`'s
    `tied`) holds `master` besides `packed`, as much memory as an untied model's
    embedding table plus its packed head; so does a weight that a wrapper transforms
    before its GEMM (`eqx.nn.WeightNorm`, `eqx.nn.SpectralNorm`). Without `master`,
    other uses see the decoded values, and an embedding lookup (a row gather of a 2-D
    weight) or a transform of its values before a GEMM (`w * g`, `w / σ`, a mask)
    raises: training read the master values there, which were dropped.

    **Fields:** `packed` (an [`nvfp4x.NVFP4Array`][], [`nvfp4x.MXFP8Array`][],
    [`nvfp4x.FP8Array`][] or array), `recipe`, `path`, `fast` (static); for a
    convolution kernel, packed as its GEMM matrix `(out, in x window)` (per feature
    group: `(groups, out / groups, in / groups x window)`), also `kernel_shape` (the
    kernel's shape, per layer), `kernel_axes` and `groups` (as the `QWeight`'s); `master`: the
    master weight of a tied or wrapped weight, or None.
    """

    packed: Any
    recipe: Recipe = eqx.field(static=True)
    path: str = eqx.field(static=True)
    fast: bool = eqx.field(static=True, default=True)
    transposed: bool = eqx.field(static=True, default=False)
    master: Array | None = None
    kernel_shape: tuple[int, ...] | None = eqx.field(static=True, default=None)
    kernel_axes: tuple[int, ...] | None = eqx.field(static=True, default=None)
    groups: int = eqx.field(static=True, default=1)

    reads_as_array = False  # outside the model's call: only under `nvfp4x.quantized`

    def _stack(self) -> tuple[int, ...]:
        """The packed array's stack axes (before the matrix, or a conv's groups)."""
        shape = tuple(self.packed.shape)
        return shape[: len(shape) - 2 - (1 if self.groups > 1 else 0)]

    @property
    def stack_shape(self) -> tuple[int, ...]:
        """The leading axes of a stack of layers (`eqx.filter_vmap`-made), as
        `QWeight.stack_shape`: the packed array's axes before its matrix (and before a
        grouped convolution's feature groups)."""
        return self._stack()

    @property
    def probe(self) -> None:
        return None

    @property
    def enabled(self) -> None:
        return None

    def aval(self):
        shape = tuple(self.packed.shape)
        if self.kernel_shape is not None:
            shape = self._stack() + self.kernel_shape
        dtype = self.packed.dtype if self.master is None else self.master.dtype
        return shaped(_swap_last(shape) if self.transposed else shape, dtype)

    def materialise(self) -> Array:
        """What reads other than GEMMs see: the master weight if it is kept, else the
        decoded weight, `(value x block scale) x tensor scale` (spec §2)."""
        if self.master is not None:
            return jnp.swapaxes(self.master, -1, -2) if self.transposed else self.master
        wv, ws = weight_operand(self.packed, self.recipe)
        out = wv.astype(jnp.float32)
        if ws is not None:  # one tensor scale per slice of a stack (or feature group)
            out = out * jnp.reshape(ws, jnp.shape(ws) + (1,) * (out.ndim - jnp.ndim(ws)))
        out = out.astype(self.packed.dtype)
        if self.kernel_shape is not None and self.kernel_axes is not None:
            out = kernel_from_matrix(out, self.kernel_shape, self.kernel_axes, self.groups)
        return jnp.swapaxes(out, -1, -2) if self.transposed else out

    @staticmethod
    def default(primitive, values, params):
        # Placed anew (a sharding constraint, a reshard): still the packed weight, whose
        # leaves are placed with their arrays (`packed_sharding`).
        if primitive in PLACEMENT:
            return values[0]
        if primitive in PLACEMENT_MANY:
            out: Any = default_rule(primitive, values, params)  # (a list: several results)
            return [
                v if isinstance(v, FrozenWeight) else o for v, o in zip(values, out, strict=True)
            ]
        for v in values:
            if isinstance(v, FrozenWeight) and v.master is None:
                _refuse_lookup(v, primitive)
                _refuse_transform(v, primitive)
        return default_rule(primitive, values, params)

    def __getattr__(self, name: str) -> Any:
        # The packed array's own fields and methods (`codes`, `scales`, `block`,
        # `operand()`...) read through. Dunder names do not: a plain packed array (a
        # bf16/float32 weight format) under `jax.jit` is a tracer, whose
        # `__jax_array__` would make the weight look like an array to quax.
        if name == "packed" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.packed, name)


def _refuse_lookup(w: FrozenWeight, primitive) -> None:
    """Raise for an embedding lookup (rows gathered from a 2-D weight) of a frozen weight
    without its master values: training's lookup read them (a tie `freeze` did not see,
    such as an `eqx.nn.Embedding` built from the head's weight in a property)."""
    lookup = primitive in (lax.gather_p, lax.dynamic_slice_p)
    if not lookup or len(w.aval().shape) != 2:  # a stack's slice is not a lookup
        return
    raise ValueError(
        f"nvfp4x: the frozen weight `{w.path}` is read by `{primitive.name}`, as an "
        "embedding lookup tied to it does; the trained model's lookup read its master "
        "values, which `nvfp4x.freeze` dropped. Freeze with "
        f'`nvfp4x.freeze(qmodel, tied=["{w.path}"])` to keep them for such reads (the '
        "memory of an untied embedding table), or untie the embedding."
    )


#: Elementwise primitives that give a weight new values (a wrapper's scaling,
#: normalisation or mask), which a GEMM then quantises: training quantised them computed
#: from the master values. (Layout primitives, and `neg`, which quantisation commutes
#: with, are not among them.)
_TRANSFORMS = frozenset({lax.mul_p, lax.div_p, lax.add_p, lax.sub_p, lax.select_n_p})


def _refuse_transform(w: FrozenWeight, primitive) -> None:
    """Raise for a frozen weight without its master values whose values a wrapper
    transforms (`w * g / norm`, `w / σ`, `w * mask`) before a GEMM: training quantised
    the transformed master values, the decoded ones would give other numbers."""
    if primitive not in _TRANSFORMS:
        return
    raise ValueError(
        f"nvfp4x: the frozen weight `{w.path}` is transformed by `{primitive.name}` before "
        "its GEMM (a wrapper that scales, normalises or masks its layer's weight, as "
        "`eqx.nn.WeightNorm` does): training quantised the result computed from its master "
        "values, which `nvfp4x.freeze` dropped, and the decoded weight would give other "
        "numbers. Freeze with "
        f'`nvfp4x.freeze(qmodel, tied=["{w.path}"])` to keep them (the frozen forward then '
        "computes what training did, bit for bit, holding the master weight besides the "
        "packed one), or apply the transform to the weight before quantising."
    )


class FrozenLinear(eqx.nn.Linear):
    """A [`nvfp4x.QuantizedLinear`][] for inference: the weight is held only in its GEMM
    format (an [`nvfp4x.NVFP4Array`][] for NVFP4: codes, block scales, tensor scale) and
    dequantised inside the forward, one layer at a time. Made by [`nvfp4x.freeze`][].
    Like the unfrozen layer it *is* an `eqx.nn.Linear` (`isinstance(layer,
    eqx.nn.Linear)` holds), so filters written for Linears keep selecting it.

    Its forward equals the unfrozen layer's forward bit for bit (on a GPU, up to float32
    summation order: XLA:GPU picks each program's GEMM algorithm). It cannot be
    differentiated: the master weights are gone.

    **Fields:** `weight` (a [`nvfp4x.FrozenWeight`][] whose `packed` is the packed weight:
    an [`nvfp4x.NVFP4Array`][], [`nvfp4x.MXFP8Array`][] or [`nvfp4x.FP8Array`][], or a
    plain array for an unquantised or bf16/float32 weight format; its fields read
    through, `frozen.weight.codes`), `bias` or None, `in_features`, `out_features`,
    `use_bias`, `recipe` and `fast` (static), as in the unfrozen layer. Like the unfrozen
    layer's `QWeight`, the weight can be read directly (`x @ layer.weight.T`).

    ```python
    layer = nvfp4x.quantize(eqx.nn.Linear(32, 16, key=jax.random.key(0)), "nvfp4_inference")
    frozen = nvfp4x.freeze(layer)
    frozen.weight.packed               # NVFP4Array(shape=(16, 32), dtype=float32, block=(1, 16))
    x = jnp.ones((8, 32))
    jnp.array_equal(frozen(x), layer(x))   # True
    ```
    """

    weight: Any
    bias: Float[Array, "*stack out"] | None
    recipe: Recipe = eqx.field(static=True)
    fast: bool = eqx.field(static=True)

    def __init__(
        self,
        weight: Any,
        bias: Float[Array, "*stack out"] | None,
        in_features: int | Literal["scalar"],
        out_features: int | Literal["scalar"],
        use_bias: bool,
        recipe: Recipe,
        fast: bool = True,
    ):
        self.weight = weight
        self.bias = bias
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.recipe = recipe
        self.fast = fast

    @property
    def weight_shape(self) -> tuple[int, ...]:
        """The logical shape of the weight, `(out, in)` (or stacked `(L, out, in)`)."""
        return tuple(self.weight.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weight (and bias)."""
        leaves = jax.tree_util.tree_leaves((self.weight, self.bias))
        return int(sum(leaf.nbytes for leaf in leaves))

    def __call__(
        self,
        x: Shaped[ArrayLike, "*batch in"] | Shaped[ArrayLike, "*batch"],
        *,
        key: PRNGKeyArray | None = None,
    ) -> Array:
        """The forward pass, like [`nvfp4x.QuantizedLinear`][]'s.

        **Arguments:**

        - `x`: `(in_features,)` or a batch `(..., in_features)` (for `in_features="scalar"`:
          `()` or `(...)`); integer and boolean inputs are cast as by `QuantizedLinear`,
          and the same inputs are refused.
        - `key`: unused (there is no backward pass); accepted for Equinox's layer contract.

        **Returns:** `(out_features,)` or `(..., out_features)`, in the promoted dtype of `x`
        and `weight.dtype` (for a packed weight, the dtype it was quantised from).
        """
        del key
        w = as_qweight(self.weight)
        if not isinstance(w, FrozenWeight):
            fix = "as `nvfp4x.freeze` makes it."
            return product_seen_by_interpreter(self, x, "nvfp4x.FrozenWeight", fix)
        if len(self.weight_shape) != 2:
            raise ValueError(
                f"This layer's weight is stacked {self.weight_shape}; call it inside "
                "`jax.lax.scan` or `eqx.filter_vmap` over the leading axis."
            )
        return self._packed_forward(x, w)

    def _packed_forward(self, x: Any, w: "FrozenWeight", index: Array | None = None) -> Array:
        """The GEMM on `w`'s packed leaves (with `index`: `w` is a stack of layers' and
        the GEMM's is layer `index` of it), through `apply_linear`."""
        leaves, wdef = jax.tree_util.tree_flatten(w.packed)
        indexed = index is not None
        matmul = functools.partial(
            _matmul, wdef=wdef, recipe=self.recipe, fast=self.fast, indexed=indexed
        )
        # The codes take the logical weight's partition spec (`packed_sharding`): this
        # layer's own codes (a layer of a stack: its slice's; only its type is read).
        codes = jax.tree_util.tree_leaves(as_qweight(self.weight).packed)[0]
        weight = (self.weight_shape, codes)
        operands = (*leaves, index) if indexed else tuple(leaves)
        return apply_linear(self, x, matmul, operands, weight, self.weight.dtype)


class FrozenLayerOfStack(FrozenLinear):
    """A [`nvfp4x.FrozenLinear`][] that is one layer of a stack, as
    [`nvfp4x.scan_layers`][] hands it to its body: `weight` is the layer's slice (what
    anything that reads the weight sees, as under `lax.scan`), `stack` the whole stack's
    [`nvfp4x.FrozenWeight`][] and `index` the layer's position in it. Its forward reads
    the layer from the stack inside the GEMM (on a TPU, the kernel's `layer`: no copy of
    the slice before the call; elsewhere the slice, as `lax.scan` gives it): the same
    numbers as the sliced layer's forward."""

    stack: Any
    index: Array

    def __init__(self, layer: FrozenLinear, stack: Any, index: Array):
        super().__init__(
            layer.weight,
            layer.bias,
            layer.in_features,
            layer.out_features,
            layer.use_bias,
            layer.recipe,
            layer.fast,
        )
        self.stack = stack
        self.index = index

    def __call__(
        self,
        x: Shaped[ArrayLike, "*batch in"] | Shaped[ArrayLike, "*batch"],
        *,
        key: PRNGKeyArray | None = None,
    ) -> Array:
        """The forward pass, as [`nvfp4x.FrozenLinear`][]'s on the layer's slice."""
        w = as_qweight(self.stack)
        if not isinstance(w, FrozenWeight) or len(self.weight_shape) != 2:
            return super().__call__(x, key=key)
        return self._packed_forward(x, w, jnp.asarray(self.index, jnp.int32))


def _matmul(
    x: Array, *leaves: Array, wdef, recipe: Recipe, fast: bool, indexed: bool = False
) -> Array:
    """The GEMM of a `FrozenLinear`, on its packed weight's leaves (`indexed`: the leaves
    of a stack of layers' packed weights, then the layer's index)."""
    dtype = gemm_dtype(fast)
    # The implementation is a parameter, so that a program traced under another choice
    # (`_kernels.use`) is not reused for this one.
    gemm = pick("frozen_gemm")
    return frozen_p.bind(
        x, *leaves, wdef=wdef, recipe=recipe, dtype=dtype, gemm=gemm, indexed=indexed, nbatch=0
    )


def weight_operand(w: PackedWeight, recipe: Recipe):
    if isinstance(w, PackedArray):
        return w.operand()
    return quantize_operand(w, recipe.weight, axis=-1)


def _frozen_fprop(x, *leaves, wdef, recipe, dtype, gemm, indexed=False):
    xv, xs = quantize_operand(x, recipe.input, axis=-1)
    dims = ((x.ndim - 1,), (1,))
    spec = None if recipe.weight is None else recipe.weight.spec
    if indexed:  # a stack of layers' packed weights and the layer's index
        *leaves, index = leaves
        if spec is not None:  # a kernel that reads the layer from the stack
            stack = jax.tree_util.tree_unflatten(wdef, leaves)
            out = spec.packed_gemm(xv, xs, stack, gemm, layer=index)
            if out is not None:
                return out
        leaves = [lax.dynamic_index_in_dim(leaf, index, keepdims=False) for leaf in leaves]
    w = jax.tree_util.tree_unflatten(wdef, leaves)
    if spec is not None:  # a kernel decoding inside the GEMM, where the format has one
        out = spec.packed_gemm(xv, xs, w, gemm)
        if out is not None:
            return out
    # A few tokens on a CPU: `scaled_dot` would run `chunked_dot` on the decoded weight;
    # run it here on the packed one (the same values, so the same bits), decoding each
    # chunk inside its loop (the format's few-token decoder): only the packed bytes are
    # read, no decoded weight is made.
    decoded = jax.ShapeDtypeStruct(tuple(w.shape), jnp.bfloat16)  # what `operand()` gives
    # Tie the packed weight to this layer's input, so that XLA cannot decode every layer's
    # weight up front: only one dequantised weight is alive at a time. (An optimisation
    # barrier does not survive XLA's CPU pipeline.) `clz(u32) >> 6` is always 0, but no
    # simplifier can know that, so adding it makes the decode wait for `x`. (The
    # few-token decoder decodes as it goes and depends on `x` already; it ties only what
    # it decodes before its loop.)
    first = lax.bitcast_convert_type(x.reshape(-1)[:1].astype(jnp.float32), jnp.uint32)
    zero = lax.clz(first) >> 6
    tie = lambda leaf: leaf + zero.astype(leaf.dtype) if leaf.dtype == jnp.uint8 else leaf
    if spec is not None and runs_chunked(xv, decoded, dims, dtype):
        out = spec.chunked_gemm(xv, xs, w, tie)
        if out is not None:
            return out
    w = jax.tree_util.tree_map(tie, w)
    wv, ws = weight_operand(w, recipe)
    # (as the unfrozen fprop: the native GEMM `_kernels` picks for the two formats)
    return quantised_dot(xv, xs, recipe.input, wv, ws, recipe.weight, dims, dtype=dtype)


def _frozen_abstract(x, *leaves, wdef, recipe, dtype, gemm, nbatch, indexed=False):
    leaves = leaves[:-1] if indexed else leaves  # (the layer's index last)
    n = jax.tree_util.tree_unflatten(wdef, leaves).shape[-2]  # avals stand in for arrays
    return x.shape[:-1] + (n,), jnp.float32


def _frozen_jvp(primals, tangents, *, prim, **params):
    if any(not is_zero(t) for t in tangents):
        raise TypeError(
            "nvfp4x: a frozen model (`FrozenLinear`, made by `nvfp4x.freeze`) holds packed "
            "weights without master copies and cannot be differentiated. Differentiate the "
            "`QuantizedLinear` model before freezing it."
        )
    y = prim.bind(*primals, **params)
    return y, zero_tangent(y)


#: `frozen_p(x, *leaves)`: the activation, then the packed weight's leaves (weights in
#: batching: a vmapped packed weight makes independent problems).
frozen_p = primitive(
    "nvfp4x_frozen_qdot", _frozen_fprop, _frozen_abstract, act=1, problem=batched_problem
)
def_jvp(frozen_p, functools.partial(_frozen_jvp, prim=frozen_p))


def _frozen_weight_gemm(w: FrozenWeight, x: Array, layout: Layout, nb: int) -> Array:
    leaves, wdef = jax.tree_util.tree_flatten(w.packed)
    if layout.stored:  # the stored layout: decode inside the primitive
        matmul = functools.partial(_matmul, wdef=wdef, recipe=w.recipe, fast=w.fast)
        # a stack (experts): each slice its own problem, with its own packed scales
        return explicit_axes_as_auto(vmapped(matmul, nb), x, tuple(leaves), (w.shape, leaves[0]))
    if layout.stack is None and len(w.shape) > 2:
        raise ValueError(
            f"nvfp4x: the frozen weight `{w.path}` {tuple(w.shape)} is a stack of "
            "matrices packed slice by slice, but this product contracts or mixes its "
            "leading (stack) axes; a frozen stack runs each slice as its own GEMM. Read the "
            "weight per slice (`jax.vmap` over its leading axes, or an einsum that keeps "
            "them as batch or output axes), or keep the layer out of the policy."
        )

    def relaid(x, *leaves):
        wv, ws = weight_operand(jax.tree_util.tree_unflatten(wdef, leaves), w.recipe)
        scale = jnp.float32(1.0) if ws is None else layout.per_slice(ws)
        assert scale is not None  # (for the type checker: `per_slice` keeps an array)
        fn = functools.partial(fprop, recipe=w.recipe, dtype=gemm_dtype(w.fast))
        for _ in range(nb):
            fn = jax.vmap(fn, in_axes=(0, 0, 0 if scale.ndim else None))
        # exact values, rearranged exactly
        return fn(x, layout(wv), scale)

    return explicit_axes_as_auto(relaid, x, tuple(leaves), None)


def _frozen_dot(lhs, rhs, *, dimension_numbers, preferred_element_type=None, **_):
    w_is_lhs = isinstance(lhs, FrozenWeight)
    w, a = (lhs, rhs) if w_is_lhs else (rhs, lhs)
    if isinstance(a, quax.ArrayValue):
        a = type(a).materialise(a)
    a = dot_operand(a, w)
    dtype = gemm_out_dtype(a, w, preferred_element_type)
    if w.transposed:  # `w.T` (`swapaxes(w, -1, -2)`), read lazily: the same product on
        # the stored weight
        (lc, rc), (lb, rb) = dimension_numbers
        n = len(w.packed.shape)
        flip = lambda axes: tuple({n - 2: n - 1, n - 1: n - 2}.get(i, i) for i in axes)
        if w_is_lhs:
            dimension_numbers = ((flip(lc), rc), (flip(lb), rb))
        else:
            dimension_numbers = ((lc, flip(rc)), (lb, flip(rb)))
        w = dataclasses.replace(w, transposed=False)
    gemm = functools.partial(_frozen_weight_gemm, w)
    return weight_gemm(tuple(w.packed.shape), a, w_is_lhs, dimension_numbers, dtype, gemm)


def _swap_last(shape: tuple) -> tuple:
    return (*shape[:-2], shape[-1], shape[-2])


@quax.register(lax.transpose_p)
def _(operand: FrozenWeight, *, permutation):
    # `w.T` of a matrix, `swapaxes(w, -1, -2)` of a stack (experts stored `(E, out, in)`
    # read as `(E, in, out)`): read lazily, the packed weight as it is
    n = len(permutation)
    if (
        n >= 2
        and tuple(permutation) == _swap_last(tuple(range(n)))
        and operand.kernel_shape is None
    ):
        return dataclasses.replace(operand, transposed=not operand.transposed)
    return default_rule(lax.transpose_p, (operand,), dict(permutation=permutation))


@quax.register(lax.dot_general_p)
def _(lhs: FrozenWeight, rhs: ArrayLike | quax.ArrayValue, **params):
    return _frozen_dot(lhs, rhs, **params)


@quax.register(lax.dot_general_p)
def _(lhs: ArrayLike | QWeight, rhs: FrozenWeight, **params):
    return _frozen_dot(lhs, rhs, **params)


@quax.register(lax.conv_general_dilated_p)
def _(lhs: ArrayLike, rhs: FrozenWeight, **params):
    """A convolution on a frozen kernel: the unfrozen convolution's GEMM (see `_conv`)
    on the packed kernel matrix: the reference decodes it inside the GEMM, the fast
    path (`runs_fast`) runs the unfrozen fast path's primitive on the decoded values;
    bit for bit the unfrozen forward either way. A weight packed as a linear layer's is
    decoded and run as a plain kernel."""
    if rhs.kernel_axes is None:
        return default_rule(lax.conv_general_dilated_p, (lhs, rhs), params)
    axes = check_conv_kernel(rhs, params["dimension_numbers"][1], params["feature_group_count"])
    leaves, wdef = jax.tree_util.tree_flatten(rhs.packed)
    matmul = functools.partial(_matmul, wdef=wdef, recipe=rhs.recipe, fast=rhs.fast)

    def gemm(x, nb):
        return (jax.vmap(matmul) if nb else matmul)(x, *leaves)

    def fast(x, geom, nb):
        wv, ws = weight_operand(rhs.packed, rhs.recipe)
        ws = jnp.ones(wv.shape[:-2], jnp.float32) if ws is None else ws
        wv = lax.stop_gradient(wv.astype(jnp.float32))  # exact values; no derivative

        def one(x, wv, ws):
            conv = functools.partial(conv_qdot, recipe=rhs.recipe, fast=rhs.fast, geom=geom)
            return conv(x, wv, name=rhs.path, weight=(wv, ws))

        return (jax.vmap(one) if nb else one)(x, wv, ws)

    fast_ok = functools.partial(runs_fast, rhs.recipe)
    kernel = (tuple(rhs.shape), rhs.packed.dtype, rhs.path, axes)
    return kernel_conv(lhs, kernel, gemm, fast, fast_ok, params)


#: The most tokens (of one grouped GEMM, all experts together) for which frozen experts
#: stored `(G, n, k)` run the frozen GEMM kernel (`_kernels.frozen_gemm`, where it is
#: picked) on every expert over every token, each token keeping its own expert's row:
#: a few tokens' GEMMs take the time of reading the packed weights, which the grouped
#: GEMM reads whole anyway, and no decoded copy of the experts is made. More tokens
#: decode the experts and run `lax.ragged_dot_general` (each token multiplied once).
#: Not yet timed on a TPU.
FEW_EXPERT_TOKENS = 64


def _frozen_grouped_fprop(x, sizes, *leaves, wdef, recipe, dtype, gemm, experts_kn):
    """fprop of frozen experts on their packed leaves: at a few tokens, experts stored
    `(G, n, k)` and a kernel picked (`gemm`), every expert's GEMM by the kernel
    (`every_expert_fprop`); else (and where the kernel does not apply) `grouped_fprop`
    on the decoded experts, the values of the unfrozen experts' quantised weights."""
    spec = None if recipe.weight is None else recipe.weight.spec
    if spec is not None and gemm != "xla" and not experts_kn and x.shape[0] <= FEW_EXPERT_TOKENS:

        def products(xv):
            def one(*expert):
                return spec.packed_product(xv, jax.tree_util.tree_unflatten(wdef, expert), gemm)

            return jax.vmap(one)(*leaves)  # (the kernel runs one expert at a time)

        out = every_expert_fprop(x, sizes, products, recipe=recipe)
        if out is not None:
            return out
    wv, ws = weight_operand(jax.tree_util.tree_unflatten(wdef, leaves), recipe)
    if experts_kn:
        wv = jnp.swapaxes(wv, 1, 2)
    ws = jnp.ones(wv.shape[:1], jnp.float32) if ws is None else ws
    return grouped_fprop(x, wv, ws, sizes, recipe=recipe, dtype=dtype)


def _frozen_grouped_abstract(x, sizes, *leaves, wdef, experts_kn, **_):
    shape = jax.tree_util.tree_unflatten(wdef, leaves).shape  # avals stand in for arrays
    return x.shape[:-1] + (shape[-1] if experts_kn else shape[-2],), jnp.float32


#: `frozen_grouped_p(x, sizes, *leaves)`: tokens sorted by expert, the group sizes, the
#: packed experts' leaves `(G, n, k)` (`experts_kn`: `(G, k, n)`); every vmapped axis
#: makes independent problems, as for `grouped_qdot_p`. Its `gemm` parameter is the
#: picked `"frozen_gemm"`, so that a program traced under another choice is not reused.
frozen_grouped_p = primitive(
    "nvfp4x_frozen_grouped_qdot", _frozen_grouped_fprop, _frozen_grouped_abstract, act=1,
    stack=True, labels=("name",), problem=batched_problem,
)  # fmt: skip
def_jvp(frozen_grouped_p, functools.partial(_frozen_jvp, prim=frozen_grouped_p))


def _frozen_grouped(w: FrozenWeight, x: Array, experts_kn: bool, sizes: Array) -> Array:
    """The grouped GEMM (`lax.ragged_dot`) of frozen experts: fprop on each expert's
    packed weight (`frozen_grouped_p`), the values of the unfrozen experts' quantised
    weights."""
    fmt = w.recipe.weight
    experts_kn = experts_kn != w.transposed  # (the layout of the stored experts)
    if fmt is not None and not fmt.spec.layouts_agree(fmt):
        raise ValueError(
            f"nvfp4x: the frozen experts `{w.path}` are packed in blocks along one axis "
            f"({w.recipe.weight}); a frozen `ragged_dot` needs 16x16 tiles (or a format "
            "without blocks), read the same in either layout. Use such a recipe for them."
        )
    leaves, wdef = jax.tree_util.tree_flatten(w.packed)
    return frozen_grouped_p.bind(
        x, sizes, *leaves, wdef=wdef, recipe=w.recipe, dtype=gemm_dtype(w.fast),
        gemm=pick("frozen_gemm"), experts_kn=experts_kn, nbatch=0, name=w.path,
    )  # fmt: skip


@quax.register(ragged_dot_general_p)
def _(lhs: ArrayLike, rhs: FrozenWeight, group_sizes: ArrayLike, **params):
    return ragged_rule(lhs, rhs, group_sizes, _frozen_grouped, **params)
