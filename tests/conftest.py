"""Test-wide JAX configuration.

Strict dtype promotion (the Equinox habit): any implicit promotion between two different
non-weak dtypes raises, so a stray float64/bfloat16 mix in the library or the tests shows
up as an error instead of a silent upcast.

This file imports only `jax`: the jaxtyping pytest plugin instruments `nvfp4x` at import
time, so `nvfp4x` must not be imported before the test modules are collected.
"""

import jax

jax.config.update("jax_numpy_dtype_promotion", "strict")

import os  # noqa: E402

# The multi-device tests need 8 host devices, fixed when JAX starts: `test_sharding.py`
# runs them in their own process with NVFP4X_MULTIDEVICE=1.
collect_ignore = [] if os.environ.get("NVFP4X_MULTIDEVICE") else ["multidevice"]

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module: the suite compiles thousands
    of small programs in one process, and their code mappings otherwise accumulate for
    the whole run (a late XLA:CPU compile segfaulted once in a full run)."""
    yield
    jax.clear_caches()
