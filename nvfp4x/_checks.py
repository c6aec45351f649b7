"""Input checks shared by the public functions: clear errors naming the problem and the fix."""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ._format._constants import BLOCK
from ._format._nvfp4 import BLOCKS, ROUNDINGS


def check_float(x, name: str = "x") -> jax.Array:
    """Return `x` as a JAX array, or raise `TypeError` if it is not a floating-point array."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        x = jnp.asarray(x)
        dtype = x.dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"`{name}` has dtype `{np.dtype(dtype).name}`; nvfp4x quantises floating-point "
            "arrays only (float32, bfloat16, float16). Cast it first, e.g. "
            f"`{name}.astype(jnp.float32)`."
        )
    return jnp.asarray(x)


def check_block(block: Sequence[int], ndim: int) -> tuple[int, int]:
    try:
        block = tuple(int(b) for b in block)
    except TypeError:
        block = None
    if block not in BLOCKS:
        raise ValueError(
            f"`block={block!r}` is not supported; use `(1, {BLOCK})` (blocks of 16 along the "
            f"last axis) or `({BLOCK}, {BLOCK})` (16x16 tiles over the last two axes)."
        )
    if ndim < 1 or (block[0] == BLOCK and ndim < 2):
        raise ValueError(
            f"`block={block}` needs an array with at least {1 + (block[0] == BLOCK)} "
            f"dimension(s), got {ndim}; use `block=(1, {BLOCK})` for 1-D arrays."
        )
    return block


def check_rounding(rounding: str, key) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(f"`rounding={rounding!r}` is unknown; use one of {ROUNDINGS}.")
    if rounding == "stochastic" and key is None:
        raise ValueError(
            "`rounding='stochastic'` needs a PRNG key: pass `key=jax.random.key(seed)` "
            "(a fresh one per step, e.g. from `jax.random.split`)."
        )


def check_amax(amax):
    if amax is None:
        return None
    if not isinstance(amax, jax.core.Tracer):
        value = np.asarray(amax)
        if value.size != 1:
            raise ValueError(f"`amax` must be a scalar, got shape {value.shape}.")
        if value.reshape(()) < 0:
            raise ValueError(
                f"`amax={float(value)}` is negative; it must be `max(|x|)` (>= 0), e.g. "
                "`jnp.max(jnp.abs(x))` or its `jax.lax.pmax` across devices."
            )
    return jnp.asarray(amax, jnp.float32).reshape(())
