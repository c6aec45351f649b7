"""Input checks shared by the public quantisers: clear errors naming the problem and the fix.

Every public quantiser (`to_nvfp4`, `fake_quantize`, `to_mxfp8`, `to_fp8`, `rht`) takes
its array through `check_float` (and `check_ndim` where it blocks an axis), and its other
arguments through the checks below, so the same mistake gives the same error everywhere.
The checks read only static information (dtypes, shapes, Python values), so they work
unchanged under `jax.jit`, where arrays are tracers; a traced `amax` is checked for dtype
and shape, its value when it is concrete, or else with `eqx.error_if` as it runs.
"""

import math
import numbers
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._numerics._constants import BLOCK, NVFP4_BLOCKS, is_tile
from ._numerics._fp8 import FP8_KINDS
from ._numerics._ieee import INF_BITS
from ._numerics._nvfp4 import ROUNDINGS, SCALE_ROUNDINGS, Rounding, ScaleRounding
from ._numerics._subnormal import to_float32
from ._prims import is_traced

_ALLOWED_BLOCKS = f"`(1, {BLOCK})` (blocks of 16 along the last axis) or `({BLOCK}, {BLOCK})` " + (
    "(16x16 tiles over the last two axes)"
)


def check_float(x: Any, name: str = "x") -> jax.Array:
    """Return `x` as a JAX array, or raise `TypeError` if it is not a floating-point array.

    Integer, boolean and complex arrays are refused (casting them silently would hide a
    bug: an index array, a mask, or a complex signal is not a tensor to quantise).
    """
    if isinstance(x, (str, bytes)) or x is None:
        raise TypeError(
            f"`{name}` must be a floating-point array, got {type(x).__name__} {x!r:.40}."
        )
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        try:
            x = jnp.asarray(x)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"`{name}` must be a floating-point array, got {type(x).__name__}: {e}"
            ) from None
        dtype = x.dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"`{name}` has dtype `{np.dtype(dtype).name}`; nvfp4x quantises floating-point "
            "arrays only (float32, bfloat16, float16). Cast it first, e.g. "
            f"`{name}.astype(jnp.float32)`."
        )
    return jnp.asarray(x)


def layer_name(path: str) -> str:
    """` of `path`` to follow a description of a layer in a message, or nothing for the
    model itself (its path is empty)."""
    return f" of `{path}`" if path else ""


def layer_operand(x: jax.Array, who: str, dtype) -> jax.Array:
    """A quantised layer's input `x` (an array) as the float layer would compute with it:
    integer and boolean inputs cast to `dtype` (the weight's, where `eqx.nn.Linear` and
    `lax.ragged_dot` promote them to it); complex inputs refused, naming `who` (a
    complex product's imaginary part would be dropped without a word)."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        raise TypeError(
            f"{who}'s input `x` is complex ({x.dtype}); nvfp4x layers compute real "
            "products and would drop its imaginary part. Apply the layer to `x.real` and "
            "`x.imag` separately, or leave this layer unquantised."
        )
    if not jnp.issubdtype(x.dtype, jnp.floating):  # integer or bool
        x = x.astype(dtype)
    return x


def check_group_sizes(group_sizes: Any, who: str) -> jax.Array:
    """`group_sizes` of a grouped GEMM as an int32 array; `TypeError` unless its dtype is
    an integer one (as `lax.ragged_dot_general` requires: a boolean mask is not a count)."""
    sizes = jnp.asarray(group_sizes)
    if not jnp.issubdtype(sizes.dtype, jnp.integer):
        raise TypeError(
            f"{who}: `group_sizes` has dtype `{np.dtype(sizes.dtype).name}`; it counts the "
            "tokens of each group and must be an integer array (as `lax.ragged_dot` "
            "requires), e.g. `jnp.bincount(expert_ids, length=groups)`."
        )
    return sizes.astype(jnp.int32)


def check_ndim(x: jax.Array, min_ndim: int, what: str, name: str = "x") -> None:
    """Raise `ValueError` unless `x` has at least `min_ndim` axes (`what` says why)."""
    if x.ndim < min_ndim:
        raise ValueError(
            f"`{name}` has shape {tuple(x.shape)}, but {what} needs an array with at least "
            f"{min_ndim} dimension(s); reshape it, e.g. `jnp.atleast_{min_ndim}d({name})`."
        )


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def check_bool(value: Any, name: str) -> bool:
    """Return `value` as a Python bool, or raise `TypeError` unless it is a `bool` or a
    NumPy `bool_` (a string such as `"False"` is truthy: taking it as true would be
    silently wrong)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"`{name}` must be True or False, got {type(value).__name__} {value!r:.40}."
        )
    return bool(value)


def check_str(value: Any, name: str, example: str) -> str:
    """Return `value`, or raise `TypeError` unless it is a string (`example` shows one)."""
    if not isinstance(value, str):
        raise TypeError(
            f"`{name}` must be a string such as {example}, got {type(value).__name__} "
            f"{value!r:.40}."
        )
    return value


def check_block(block: Any, ndim: int) -> tuple[int, int]:
    """Return `block` as a tuple of two Python ints, or raise `ValueError`.

    `block` must be a tuple or list of two integers, `(1, 16)` or `(16, 16)`: floats such
    as `1.5` (which `int()` would truncate), strings such as `"16x16"`, and any other
    block raise. The array must have the axes the block needs.
    """
    ok = isinstance(block, (tuple, list)) and len(block) == 2 and all(_is_int(b) for b in block)
    if not ok or tuple(int(b) for b in block) not in NVFP4_BLOCKS:
        raise ValueError(f"`block={block!r}` is not supported; use {_ALLOWED_BLOCKS}.")
    block = (int(block[0]), int(block[1]))
    if ndim < 1 or (is_tile(block) and ndim < 2):
        need = 1 + is_tile(block)
        hint = f" (or `block=(1, {BLOCK})` for 1-D arrays)" if ndim == 1 else ""
        raise ValueError(
            f"`block={block}` needs an array with at least {need} dimension(s), got {ndim}: "
            f"reshape it, e.g. `x.reshape(1, -1)`{hint}."
        )
    return block


def check_rounding(rounding: Any, key: Any) -> Rounding:
    """Return `rounding`, or raise `ValueError` for an unknown rounding or stochastic
    rounding without a key, `TypeError` for a key that is not a PRNG key."""
    if not isinstance(rounding, str) or rounding not in ROUNDINGS:
        raise ValueError(f"`rounding={rounding!r}` is unknown; use one of {ROUNDINGS}.")
    if rounding == "stochastic" and key is None:
        raise ValueError(
            "`rounding='stochastic'` needs a PRNG key: pass `key=jax.random.key(seed)` "
            "(a fresh one per step, e.g. from `jax.random.split`)."
        )
    if key is not None:
        dtype = getattr(key, "dtype", None)
        typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
        legacy = dtype == np.uint32 and getattr(key, "shape", ())[-1:] == (2,)
        if not (typed or legacy):
            raise TypeError(
                f"`key` must be a PRNG key such as `jax.random.key(seed)`, got {key!r:.60}."
            )
    return cast(Rounding, rounding)  # one of ROUNDINGS, checked above


def check_scale_rounding(scale_rounding: Any) -> ScaleRounding:
    """Return `scale_rounding`, or raise `ValueError` if it is unknown."""
    if not isinstance(scale_rounding, str) or scale_rounding not in SCALE_ROUNDINGS:
        raise ValueError(
            f"`scale_rounding={scale_rounding!r}` is unknown; use one of {SCALE_ROUNDINGS}."
        )
    return cast(ScaleRounding, scale_rounding)  # one of SCALE_ROUNDINGS, checked above


def check_amax(amax: Any) -> jax.Array | None:
    """Return `amax` as a float32 scalar (None stays None), or raise.

    `TypeError` unless `amax` is a real number or a real (float or integer) array: strings,
    booleans and complex values are refused. `ValueError` unless it has one element, and,
    when its value is known (not traced), unless it is `>= 0` (NaN is let through: it
    makes every output NaN). A concrete `-0.0` is taken as `+0.0`. A traced negative
    `amax` raises when the computation runs (`eqx.error_if`).
    """
    if amax is None:
        return None
    bad = isinstance(amax, (str, bytes, bool, np.bool_)) or not (
        hasattr(amax, "dtype") or isinstance(amax, numbers.Real)
    )
    dtype = getattr(amax, "dtype", None)
    if not bad and dtype is not None:
        bad = not (
            jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
        ) or jnp.issubdtype(dtype, jnp.bool_)
    if bad:
        what = f"dtype `{np.dtype(dtype).name}`" if dtype is not None else type(amax).__name__
        raise TypeError(
            f"`amax` must be a real number or a real scalar array (`max(|x|)`, e.g. "
            f"`jnp.max(jnp.abs(x))`), got {what}: {amax!r:.40}."
        )
    shape = tuple(getattr(amax, "shape", ()))  # an array, or a real number: ()
    if math.prod(shape) != 1:
        raise ValueError(
            f"`amax` must be a scalar, got shape {shape}; pass the amax of "
            "the whole tensor, e.g. `jnp.max(jnp.abs(x))`."
        )
    if not is_traced(amax):
        value = np.asarray(amax, np.float32).reshape(())
        if value < 0:
            raise ValueError(
                f"`amax={float(value)}` is negative; it must be `max(|x|)` (>= 0), e.g. "
                "`jnp.max(jnp.abs(x))` or its `jax.lax.pmax` across devices."
            )
        return jnp.asarray(np.abs(value))  # -0.0 -> +0.0
    traced = to_float32(jnp.asarray(amax).astype(jnp.result_type(float)).reshape(()))
    bits = jax.lax.bitcast_convert_type(traced, jnp.int32)
    # Negative from the bits (NaN aside): a float `< 0` reads a negative subnormal as 0
    # on a device that flushes subnormals.
    negative = (bits < 0) & ((bits & 0x7FFFFFFF) != 0) & ((bits & 0x7FFFFFFF) <= INF_BITS)
    return eqx.error_if(
        traced,
        negative,
        "`amax` is negative; it must be `max(|x|)` (>= 0), e.g. `jnp.max(jnp.abs(x))` or "
        "its `jax.lax.pmax` across devices.",
    )


def check_axis(axis: Any, ndim: int, name: str = "axis") -> int:
    """Return `axis` as a non-negative int below `ndim`, or raise (`TypeError` for a
    non-integer, `ValueError` out of range)."""
    if not _is_int(axis):
        raise TypeError(f"`{name}` must be an int, got {axis!r}.")
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"`{name}={axis}` is out of range for an array with {ndim} dimension(s); use "
            f"an axis in [{-ndim}, {ndim - 1}]."
        )
    return int(axis) % ndim


def check_fp8_kind(kind: Any) -> str:
    """Return `kind` (`"e4m3"` or `"e5m2"`), or raise `ValueError`."""
    if not isinstance(kind, str) or kind not in FP8_KINDS:
        kinds = " or ".join(repr(k) for k in FP8_KINDS)
        raise ValueError(f"`kind={kind!r}` is unknown; use {kinds}.")
    return kind
