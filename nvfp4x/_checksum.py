"""The sharding-invariant checksum of an array.

Two 32-bit lanes, each a sum mod 2^32 over the array's words (its bit pattern as
unsigned integers, 64-bit dtypes as two words) of a bijective mix of the word with its
flat index. A sum does not depend on the order in which it is taken, so the checksum
of a sharded array is one jitted reduction (partial sums on every device, then an
all-reduce) with no gather, and equal for any sharding and any number of processes.
Changing any one word changes both lanes. `_numpy_checksum` is the plain reference the
jitted one is tested against.
"""

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from ._numerics._constants import GOLDEN_RATIO_32
from ._numerics._e2m1 import _fmix32

_WORD = {4: ml_dtypes.uint4, 8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint32}
if hasattr(ml_dtypes, "uint2"):
    _WORD[2] = ml_dtypes.uint2


def _bits(dtype) -> int:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return 8
    for info in (ml_dtypes.finfo, ml_dtypes.iinfo):
        try:
            return int(info(dtype).bits)
        except (TypeError, ValueError):
            continue
    return 8 * dtype.itemsize


def _mix(words, index):
    a = _fmix32(words ^ (index * np.uint32(GOLDEN_RATIO_32)))
    b = _fmix32((words * np.uint32(0x27D4EB2F)) ^ _fmix32(index ^ np.uint32(0x165667B1)))
    return a, b


def _jax_words(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    return lax.bitcast_convert_type(x, _WORD[_bits(x.dtype)]).astype(jnp.uint32)


def _checksums(leaves: list[jax.Array]) -> jax.Array:
    rows = []
    for x in leaves:
        words = _jax_words(x)
        index, stride = jnp.zeros(words.shape, jnp.uint32), 1
        for axis in reversed(range(words.ndim)):
            iota = lax.broadcasted_iota(jnp.uint32, words.shape, axis)
            index = index + iota * np.uint32(stride % 2**32)
            stride *= words.shape[axis]
        a, b = _mix(words, index)
        rows.append(jnp.stack([jnp.sum(a, dtype=jnp.uint32), jnp.sum(b, dtype=jnp.uint32)]))
    return jnp.stack(rows)


_checksums_jit = jax.jit(_checksums)


def _numpy_checksum(x: np.ndarray) -> str:
    x = np.ascontiguousarray(x)
    if np.iscomplexobj(x):
        x = np.stack([np.real(x), np.imag(x)], axis=-1)
    bits = _bits(x.dtype)
    if bits == 64 or bits == 32:
        words = x.view(np.uint32).reshape(-1)
    elif bits == 16:
        words = x.view(np.uint16).reshape(-1).astype(np.uint32)
    else:  # a byte per element; 4- and 2-bit dtypes in its low bits
        words = (x.view(np.uint8).reshape(-1) & np.uint8(2**bits - 1)).astype(np.uint32)
    index = np.arange(words.size, dtype=np.uint64).astype(np.uint32)
    a, b = _mix(words, index)
    return _hex(int(np.sum(a, dtype=np.uint32)), int(np.sum(b, dtype=np.uint32)))


def _hex(a: int, b: int) -> str:
    return f"{a:08x}{b:08x}"


def checksums(leaves: list) -> list[str]:
    """The checksum of every array of `leaves` (jax or numpy), as 16 hex digits; jax
    arrays are reduced where they live, one jitted call per set of devices."""
    out: dict[int, str] = {}
    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, jax.Array):
            groups.setdefault(frozenset(x.sharding.device_set), []).append(i)
        else:
            out[i] = _numpy_checksum(np.asarray(x))
    for indices in groups.values():
        sums = _checksums_jit([leaves[i] for i in indices])
        if not sums.is_fully_addressable:  # replicated over all processes: read a copy
            sums = sums.addressable_data(0)
        for i, (a, b) in zip(indices, np.asarray(sums).tolist(), strict=True):
            out[i] = _hex(a, b)
    return [out[i] for i in range(len(leaves))]
