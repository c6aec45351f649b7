"""`NVFP4Array`, the packed quantised tensor, and `to_nvfp4` / `fake_quantize`."""

import functools
from typing import Any, ClassVar, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array, Float, PRNGKeyArray, Shaped, UInt8

from . import _kernels
from ._axes import follows_input_sharding
from ._checks import (
    check_amax,
    check_block,
    check_float,
    check_ndim,
    check_rounding,
    check_scale_rounding,
)
from ._numerics import _e2m1
from ._numerics._bits import fp8_bits
from ._numerics._constants import BLOCK, is_tile
from ._numerics._ieee import is_tiny_scale, mul_exact
from ._numerics._nvfp4 import (
    Rounding,
    ScaleRounding,
    fake_quantize_blocks,
    pad_to_blocks,
    scale_blocks,
    to_blocks,
)
from ._numerics._pack import decode_e4m3, pack, unpack
from ._numerics._subnormal import float64_to_float32, from_float32
from ._packed import PackedArray, as_bits
from ._prims import compiled


class NVFP4Array(PackedArray):
    """An array in NVFP4: packed E2M1 codes, E4M3 block scales and a float32 tensor scale.

    Create one with [`nvfp4x.to_nvfp4`][]. It is an `eqx.Module`, so it passes through
    `jax.jit`, `jax.vmap`, tree maps and `eqx.tree_serialise_leaves`.

    **Fields:**

    - `codes`: `uint8`, two E2M1 codes per byte, element `2i` in the low nibble. Its shape
      is the logical shape with the blocked axes padded to multiples of 16, last axis halved.
    - `scales`: `float8_e4m3fn` decode scales, one per block: shape `(..., K_pad/16)` for
      `block=(1, 16)` and `(..., R_pad/16, C_pad/16)` for `block=(16, 16)`. (Held as
      their uint8 bit patterns in `scale_bits`, so that `eqx.tree_serialise_leaves`,
      which cannot read float8 arrays back, round-trips them bit for bit.)
    - `tensor_scale`: float32 decode scale `s_dec = 1 / S_enc` (a scalar; one per slice
      when the array was made under `jax.vmap`).
    - `block`, `logical_tail`, `dtype` (static): the layout, the unpadded sizes of the
      blocked axes, and the dtype of the array that was quantised.

    ```python
    w = jax.random.normal(jax.random.key(0), (16, 32))
    q = nvfp4x.to_nvfp4(w, block=(16, 16))
    q                                   # NVFP4Array(shape=(16, 32), dtype=float32, block=(16, 16))
    q.codes.shape, q.scales.shape       # (16, 16), (1, 2)
    q.nbytes                            # 262: 256 bytes of codes, 2 of scales, 4 of tensor scale
    q.dequantize().shape                # (16, 32)
    ```
    """

    codes: UInt8[Array, "..."]
    scale_bits: UInt8[Array, "..."]
    tensor_scale: Float[Array, "*batch"]
    block: tuple[int, int] = eqx.field(static=True)
    logical_tail: tuple[int, ...] = eqx.field(static=True)
    dtype: np.dtype = eqx.field(static=True)

    per_block: ClassVar[tuple[str, ...]] = ("codes", "scale_bits")
    per_tensor: ClassVar[tuple[str, ...]] = ("tensor_scale",)

    def __init__(
        self,
        codes: UInt8[Array, "..."],
        scales: Shaped[Array, "..."],
        tensor_scale: Float[Array, "*batch"],
        block: tuple[int, int],
        logical_tail: tuple[int, ...],
        dtype,
    ):
        self.codes = codes
        self.scale_bits = as_bits(scales, jnp.float8_e4m3fn)
        self.tensor_scale = tensor_scale
        self.block = (block[0], block[1])
        self.logical_tail = tuple(logical_tail)
        self.dtype = np.dtype(dtype)

    @property
    def scales(self) -> Shaped[Array, "..."]:
        """The block scales as `float8_e4m3fn`."""
        return jax.lax.bitcast_convert_type(self.scale_bits, jnp.float8_e4m3fn)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape (without padding)."""
        return tuple(self.codes.shape[: -len(self.logical_tail)]) + self.logical_tail

    @property
    def ndim(self) -> int:
        """The number of logical axes, `len(self.shape)`."""
        return len(self.shape)

    @property
    def shard_blocks(self) -> tuple[int, ...]:
        return self.block

    @follows_input_sharding(like=lambda self, *_, **__: self.codes)
    def dequantize(self, dtype=None) -> Shaped[Array, "..."]:
        """The array's values `(e2m1 × block_scale) × tensor_scale`, in the logical shape.

        **Arguments:**

        - `dtype`: the output dtype; by default the dtype that was quantised.

        **Returns:** an array of shape `self.shape`.
        """
        return _dequantize(self, np.dtype(self.dtype if dtype is None else dtype))

    @follows_input_sharding(like=lambda self: self.codes)
    def operand(self) -> tuple[Shaped[Array, "..."], Float[Array, "*batch"]]:
        """The GEMM operand form: block-scaled values and the tensor decode scale.

        **Returns:** `(block_values, tensor_scale)`: the E2M1 values times their block
        scales in the logical shape, in bfloat16 (exact there), and the float32 tensor
        decode scale. `block_values * tensor_scale` equals `self.dequantize()` in float32.

        ```python
        q = nvfp4x.to_nvfp4(jnp.linspace(-1, 1, 64))
        values, scale = q.operand()    # bfloat16 (64,), float32 ()
        ```
        """
        q = to_blocks(_e2m1.decode(unpack(self.codes)), self.block)
        scale = decode_e4m3(self.scale_bits)  # on the bits: E4M3 subnormals kept
        expanded = scale[..., :, None, :, None] if is_tile(self.block) else scale[..., None]
        vals = (q * expanded).reshape(self.codes.shape[:-1] + (2 * self.codes.shape[-1],))
        index = (...,) + tuple(slice(0, n) for n in self.logical_tail)
        return vals[index].astype(jnp.bfloat16), self.tensor_scale

    def __repr__(self) -> str:
        if not hasattr(self.codes, "shape"):
            # leaves replaced by something else (shardings, specs, None): show the fields
            return eqx.tree_pformat(self)
        return f"NVFP4Array(shape={self.shape}, dtype={self.dtype.name}, block={self.block})"


# Jitted: called eagerly, it is one dispatch (one compilation per shape and dtype) rather
# than every operation dispatched and compiled on its own.
@functools.partial(jax.jit, static_argnums=1)
def _dequantize(q: NVFP4Array, dtype: np.dtype) -> Shaped[Array, "..."]:
    """`q.dequantize(dtype)`."""
    values, ts = q.operand()
    ts = ts.reshape(ts.shape + (1,) * (values.ndim - ts.ndim))
    # (value * block scale) is exact (in bfloat16 too); its product with the tensor
    # scale is the IEEE float32 one, even where that is subnormal (tiny tensors) on a
    # device that flushes subnormals: `mul_exact`, run for tiny tensor scales only.
    tiny = jnp.any(is_tiny_scale(ts))
    x = jax.lax.cond(tiny, mul_exact, _mul, values.astype(jnp.float32), ts)
    return from_float32(x, dtype)


def _mul(a: Array, b: Array) -> Array:
    """`a * b` (the branch of `NVFP4Array.dequantize` for tensor scales that are not tiny;
    a module-level function, so that `lax.cond` reuses its traced branch)."""
    return a * b


def _prepare(x, block, rounding, key, amax, scale_rounding):
    x = check_float(x)
    check_ndim(x, 1, "NVFP4 (blocks of 16 elements)")
    block = check_block(block, x.ndim)
    rounding = check_rounding(rounding, key)
    scale_rounding = check_scale_rounding(scale_rounding)
    return x, block, rounding, scale_rounding, check_amax(amax)


@follows_input_sharding
def to_nvfp4(
    x: ArrayLike,
    *,
    block: Any = (1, BLOCK),
    rounding: str = "nearest",
    key: PRNGKeyArray | None = None,
    amax: Any = None,
    scale_rounding: str = "nearest",
) -> NVFP4Array:
    """Quantise an array to NVFP4, bit for bit as Blackwell's cast does (spec §2).

    **Arguments:**

    - `x`: a floating-point array (float32, bfloat16, float16). Any leading axes are batch
      axes; blocked axes that are not multiples of 16 are zero-padded internally.
    - `block`: `(1, 16)`, blocks of 16 along the last axis (activations, gradients), or
      `(16, 16)`, 16x16 tiles over the last two axes (weights).
    - `rounding`: `"nearest"` (round half to even) or `"stochastic"` (unbiased; needs `key`).
    - `key`: a PRNG key for stochastic rounding.
    - `amax`: a precomputed tensor amax (from calibration, or reduced across devices with
      `jax.lax.pmax`): a real number or scalar array, `>= 0`; by default `max(|x|)`.
    - `scale_rounding`: `"nearest"` (default: the spec's E4M3 block scale, bit for bit
      Blackwell's) or `"up"` (the smallest E4M3 scale with which no element of the block
      exceeds 6: nothing is clamped, so stochastic rounding is unbiased; see
      [`nvfp4x.Format`][]). With `"up"`, elements can still be clamped where the given
      `amax` is below `max(|x|)` (block scales stop at 448), and by a few float32 ulps in
      the block holding the tensor's amax.

    **Returns:** an [`nvfp4x.NVFP4Array`][].

    **Raises:** `TypeError` for a non-float `x` (integer, boolean, complex), a non-real
    `amax` (e.g. a string) or a `key` that is not a PRNG key; `ValueError` for a 0-d `x`,
    a `block` other than the tuple or list `(1, 16)` or `(16, 16)` (`(1.5, 16)` and
    `"16x16"` included), an unknown rounding or scale rounding, stochastic rounding
    without `key`, or a non-scalar or negative `amax`.

    ```python
    q = nvfp4x.to_nvfp4(jnp.linspace(-1, 1, 64))
    q.codes.shape, q.scales.dtype, q.dequantize().shape   # (32,), float8_e4m3fn, (64,)
    ```
    """
    x, block, rounding, scale_rounding, amax = _prepare(
        x, block, rounding, key, amax, scale_rounding
    )
    # Jitted (per parameters and per the implementations `_kernels` picks now): called
    # eagerly, one dispatch and one compilation per shape rather than one per operation.
    params = {"block": block, "rounding": rounding, "scale_rounding": scale_rounding}
    packed, scales, s_dec = compiled(_codes_and_scales, 0, **params)(x, key, amax)
    tail = x.shape[-2:] if is_tile(block) else x.shape[-1:]
    return NVFP4Array(
        codes=packed,
        scales=scales,
        tensor_scale=s_dec,
        block=block,
        logical_tail=tuple(tail),
        dtype=x.dtype,
    )


def _codes_and_scales(x, key, amax, *, block, rounding, scale_rounding):
    """`to_nvfp4` of checked arguments: packed codes, E4M3 block scales, tensor scale."""
    xp = pad_to_blocks(float64_to_float32(x), block)  # (float64: subnormals kept)
    kernel = _kernels.nvfp4_quantizer(xp, block, rounding, scale_rounding, amax, key)
    if kernel is not None:  # the backend's kernel, where `_kernels` picks one
        packed, scales, s_dec, _ = kernel("codes")
        assert packed is not None and scales is not None  # `kernel("codes")` returns them
    else:
        v, scale_b, s_dec = scale_blocks(xp, block, amax, scale_rounding)
        if rounding == "stochastic" and key is not None:  # `_prepare`: SR always has a key
            codes = _e2m1.encode(_e2m1.round_stochastic(v, _e2m1.uniform(key, v.shape)))
        else:
            codes = _e2m1.encode_nearest(v)
        packed = pack(codes.reshape(xp.shape))
        scales = fp8_bits(scale_b, jnp.float8_e4m3fn)  # on the bits: subnormals kept
    return packed, scales, s_dec


@follows_input_sharding
def fake_quantize(
    x: ArrayLike,
    *,
    block: Any = (1, BLOCK),
    rounding: str = "nearest",
    key: PRNGKeyArray | None = None,
    amax: Any = None,
    scale_rounding: str = "nearest",
) -> Shaped[Array, "..."]:
    """Quantise to NVFP4 and dequantise again in one fused step, without packing.

    Takes the same arguments as [`nvfp4x.to_nvfp4`][] and returns
    `to_nvfp4(x, ...).dequantize()` (the same bits), in `x`'s dtype and shape. The
    training path uses it.

    **Arguments:**

    - `x`: a floating-point array (float32, bfloat16, float16); leading axes are batch axes.
    - `block`: `(1, 16)` (blocks along the last axis) or `(16, 16)` (tiles over the last
      two axes).
    - `rounding`: `"nearest"` (round half to even) or `"stochastic"` (needs `key`).
    - `key`: a PRNG key for stochastic rounding.
    - `amax`: a precomputed tensor amax (a real number or scalar array, `>= 0`); by
      default `max(|x|)`.
    - `scale_rounding`: `"nearest"` (default, the spec's block scales) or `"up"` (block
      scales rounded up so that nothing is clamped: unbiased stochastic rounding).

    **Returns:** an array of `x`'s shape and dtype holding the NVFP4-representable values.

    **Derivative:** straight-through (spec §5, the convention of quantisation-aware
    training): the quantiser's Jacobian is taken as the identity, so `jax.grad` passes
    the incoming gradient through unchanged, for every element, saturated (clamped at
    its block's largest value) or not, NaN or not; nothing flows to `amax` or `key`.
    `jax.grad(lambda x: fake_quantize(x).sum())(x)` is all ones. The derivative of that
    (a Hessian) is zero.

    **Raises:** the errors of [`nvfp4x.to_nvfp4`][], for the same arguments.

    ```python
    x = jnp.linspace(-1, 1, 64)
    y = nvfp4x.fake_quantize(x)
    jnp.array_equal(y, nvfp4x.to_nvfp4(x).dequantize())   # True
    jax.grad(lambda x: nvfp4x.fake_quantize(x).sum())(x)   # ones: straight-through
    ```
    """
    x, block, rounding, scale_rounding, amax = _prepare(
        x, block, rounding, key, amax, scale_rounding
    )
    return _straight_through(block, rounding, scale_rounding, x, key, amax)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def _straight_through(
    block: tuple[int, int],
    rounding: Rounding,
    scale_rounding: ScaleRounding,
    x: Array,
    key: Array | None,
    amax: Array | None,
) -> Array:
    """`fake_quantize` of checked arguments, with the straight-through derivative."""
    xp = pad_to_blocks(float64_to_float32(x), block)  # (float64: subnormals kept)
    kernel = _kernels.nvfp4_quantizer(xp, block, rounding, scale_rounding, amax, key)
    if kernel is not None:  # the backend's kernel, where `_kernels` picks one
        q = kernel("dequantized")
        y = cast(Array, q.values)  # asked for: not None
        if _kernels.pick("nvfp4_quantize") == "mosaic":
            # On a TPU v5e (2026-12-05) the Mosaic kernel gave 0 for every dequantised
            # value of a tensor whose decode scale is subnormal (amax below about
            # 3e-35; codes and scales right, a tiny but normal scale right), where
            # the XLA path gave IEEE's subnormals: such tensors take the XLA path.
            subnormal = q.tensor_scale < np.float32(2.0**-126)
            y = jax.lax.cond(
                subnormal,
                lambda: fake_quantize_blocks(xp, block, rounding, key, amax, scale_rounding),
                lambda: y.astype(jnp.float32),  # (the kernel's are in x's dtype: exact)
            )
    else:
        y = fake_quantize_blocks(xp, block, rounding, key, amax, scale_rounding)
    index = (...,) + tuple(slice(0, n) for n in (x.shape[-2:] if is_tile(block) else x.shape[-1:]))
    return from_float32(y[index], x.dtype)


@_straight_through.defjvp
def _straight_through_jvp(block, rounding, scale_rounding, primals, tangents):
    x, key, amax = primals
    y = _straight_through(block, rounding, scale_rounding, x, key, amax)
    return y, tangents[0].astype(y.dtype)
