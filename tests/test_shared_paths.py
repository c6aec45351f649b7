"""Paths that compute several things in one program to give XLA less to compile (issue
37), bit for bit what computing each on its own gives, eagerly and under `jit`. (wgrad's
two Hadamard transforms side by side in one, tried too, moved data between devices under
tensor and FSDP sharding: dropped.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_grad_keys_are_jax_fold_in(mode):
    # dgrad's and wgrad's keys come from one vectorised hash of both tags
    # (`fold_in_tags`): each is `jax.random.fold_in` of the seed's key with its tag.
    from nvfp4x._gemm import GRAD_TAGS, grad_key

    words = np.random.default_rng(3).integers(0, 2**32, (5, 2), dtype=np.uint32)
    words[0] = 0
    for tag in GRAD_TAGS:
        fn = lambda s, t=tag: jax.random.key_data(grad_key(s, t))
        fn = jax.jit(fn) if mode == "jit" else fn
        for w in words:
            key = jax.random.wrap_key_data(jnp.asarray(w), impl="threefry2x32")
            want = jax.random.key_data(jax.random.fold_in(key, tag))
            np.testing.assert_array_equal(fn(jnp.asarray(w)), want, f"tag {tag}")
