"""The two uint32 words that seed stochastic rounding, drawn from a key as `jax.random`
draws them, in straight-line operations that compile small.

`jax.random.fold_in` and `jax.random.bits(key, (2,), uint32)` of a Threefry-2x32 key
lower on the CPU to a `while` loop over the hash's five round groups, which XLA compiles
as computations of their own (about 0.07 s each; a training step derives two keys per
quantised layer). The hash here is the same Threefry-2x32 (20 rounds, the same key
schedule and rotations), written out: a few dozen scalar integer operations that fuse
into their neighbours. The words are `jax.random`'s, bit for bit, in both of its
counter layouts (`jax_threefry_partitionable` on or off; tested); keys of other
implementations go through `jax.random` itself.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, UInt32

#: Threefry-2x32's rotations, the two groups of four used alternately.
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
#: The key schedule's parity constant.
_PARITY = 0x1BD11BDA


def _rotl(x: Array, d: int) -> Array:
    return (x << np.uint32(d)) | (x >> np.uint32(32 - d))


def threefry2x32(k1: Array, k2: Array, x1: Array, x2: Array) -> tuple[Array, Array]:
    """The Threefry-2x32 hash of the counters `(x1, x2)` under the key `(k1, k2)` (uint32
    arrays that broadcast), as `jax.random`'s `threefry2x32_p`, unrolled."""
    ks = (k1, k2, k1 ^ k2 ^ np.uint32(_PARITY))
    x = [x1 + ks[0], x2 + ks[1]]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x[0] = x[0] + x[1]
            x[1] = x[0] ^ _rotl(x[1], r)
        x[0] = x[0] + ks[(i + 1) % 3]
        x[1] = x[1] + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x[0], x[1]


def _materialize(words: UInt32[Array, "*s"]) -> UInt32[Array, "*s"]:
    """`words`, as the result of a max-reduction over pairs `(w, 0)`: XLA does not fuse a
    reduction into the loops that read its result, so an element loop reads the hashed
    words rather than hashing them again for every element (as it would, the hash
    being cheap scalar operations that XLA duplicates into each consumer)."""
    pairs = jnp.stack([words, jnp.zeros_like(words)], axis=-1)
    return jax.lax.reduce(pairs, np.uint32(0), jax.lax.max, (words.ndim,))


def fold_in_tags(words: UInt32[Array, "2"], tags: tuple[int, ...]) -> UInt32[Array, "t 2"]:
    """The key data of `jax.random.fold_in(key, tag)` for a Threefry key holding `words`,
    for each of `tags` (`0 <= tag < 2^32`), row by row, in one vectorised hash: the same
    program wherever it is asked with the same `tags`, which XLA's common subexpression
    elimination merges (dgrad and wgrad fold their tags into one seed)."""
    u = jnp.uint32
    y1, y2 = threefry2x32(words[0], words[1], jnp.zeros(len(tags), u), jnp.asarray(tags, u))
    return _materialize(jnp.stack([y1, y2], axis=-1))


def bits2(words: UInt32[Array, "2"]) -> UInt32[Array, "2"]:
    """`jax.random.bits(key, (2,), jnp.uint32)` for a Threefry key holding `words`."""
    if jax.config.jax_threefry_partitionable:  # type: ignore[attr-defined]
        # Counters `(hi, lo)` of the flat indices 0 and 1; the words are `y1 ^ y2`.
        y1, y2 = threefry2x32(
            words[0], words[1], jnp.zeros(2, jnp.uint32), jnp.arange(2, dtype=jnp.uint32)
        )
        return _materialize(y1 ^ y2)
    # The original layout: counters 0 and 1 hashed as one pair.
    y1, y2 = threefry2x32(words[0], words[1], jnp.uint32(0), jnp.uint32(1))
    return _materialize(jnp.stack([y1, y2]))


def is_threefry(key: jax.Array) -> bool:
    """Whether `key` is a typed Threefry-2x32 key (raw uint32 keys and other
    implementations go through `jax.random`)."""
    dtype = getattr(key, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return False
    return str(jax.random.key_impl(key)) == "threefry2x32"


def seed_words(key: jax.Array) -> UInt32[Array, "2"]:
    """`jax.random.bits(key, (2,), jnp.uint32)`, bit for bit: by the unrolled hash for a
    Threefry key, else by `jax.random`."""
    if is_threefry(key) and key.shape == ():
        return bits2(jax.random.key_data(key))
    return jax.random.bits(key, (2,), jnp.uint32)
