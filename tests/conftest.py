"""Test-wide JAX configuration.

Strict dtype promotion (the Equinox habit): any implicit promotion between two different
non-weak dtypes raises, so a stray float64/bfloat16 mix in the library or the tests shows
up as an error instead of a silent upcast.

This file imports only `jax` (after setting XLA's flags, see below): the jaxtyping
pytest plugin instruments `nvfp4x` at import time, so `nvfp4x` must not be imported
before the test modules are collected.
"""

import os

# The suite's time is XLA:CPU compiling thousands of small programs. LLVM's code
# optimisation (not XLA's HLO passes: fusion and layout are unchanged) is most of each
# compile and pays off only for long-running programs, so the tests ask for little of it.
# Bit-for-bit comparisons of two paths hold under either setting (the suite passes under
# both), though float32 summation order inside a reduction may differ between them.
# Set before JAX starts its backend (this process, xdist's workers and every subprocess
# the tests start inherit it); NVFP4X_TEST_FULL_OPT=1 keeps XLA's defaults
# (benchmarks/gpu_check.sh sets it: GPU tests should run what users run).
if os.environ.get("NVFP4X_TEST_FULL_OPT") != "1":
    _fast_compile = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    if _fast_compile not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_fast_compile}".strip()

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# A compilation cache for the example and benchmark scripts the tests run: private to
# this test run (created here by the only process, or by the xdist controller, and found
# by xdist workers in NVFP4X_TEST_JAX_CACHE), empty at its start, deleted at its end.
# `benchmarks/convergence.py --smoke` trains the very models `examples/train_lm.py
# --smoke` compiles, and loads them from it. (The scripts share `subprocesses/`: jax
# writes cache entries non-atomically, and there a half-written entry read by another
# script is only a warning and a recompilation.)
RUN_CACHE = os.environ.get("NVFP4X_TEST_JAX_CACHE")
if not RUN_CACHE:
    RUN_CACHE = tempfile.mkdtemp(prefix="nvfp4x-test-jax-cache-")
    os.environ["NVFP4X_TEST_JAX_CACHE"] = RUN_CACHE
    atexit.register(shutil.rmtree, RUN_CACHE, ignore_errors=True)

# The tests' own processes use it too: `jax.clear_caches()` after each module (below) and
# the many jitted functions the tests create anew (lambdas, `eqx.filter_jit` per test)
# compile programs this process or another worker has compiled before, which are then
# loaded instead (same executables, same numbers). One folder for all of them: jax's
# cache key includes the folder's path (the GPU autotuning cache it names in the compile
# options), so per-process folders never shared an entry. jax writes an entry in place,
# and a worker could read one half-written, so here each entry is written to a file of
# its own and renamed into place (`_atomic_put`); where jax's cache class is not as
# expected, each process keeps a folder of its own as before. (On this 2-core CPU the
# whole suite gains little: 16:51 against 16:54, the workers' files share few programs;
# test_telemetry.py alone 54 s, after test_freeze.py's entries 49 s. What it is for:
# `benchmarks/tpu_check.sh` keeps the folder between a device's commands, so a later
# chunk or shard loads an earlier one's programs: test_fp8_tables.py 13.2 s -> 4.9 s
# run twice here.)
from jax._src import lru_cache as _lru_cache  # noqa: E402


def _atomic_put(self, key, value):
    if self.eviction_enabled:  # (the tests' cache has no size limit)
        return _plain_put(self, key, value)
    path = self.path / f"{key}{_lru_cache._CACHE_SUFFIX}"
    if not path.exists():
        part = self.path / f".{key}.{os.getpid()}.part"
        part.write_bytes(value)
        os.replace(part, path)


_plain_put = getattr(getattr(_lru_cache, "LRUCache", None), "put", None)
_shared = _plain_put is not None and hasattr(_lru_cache, "_CACHE_SUFFIX")
if _shared:
    _lru_cache.LRUCache.put = _atomic_put
_folder = "tests" if _shared else f"tests-{os.getpid()}"
jax.config.update("jax_compilation_cache_dir", os.path.join(RUN_CACHE, _folder))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

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


def pytest_addoption(parser):
    parser.addoption(
        "--shard",
        default=None,
        metavar="I/N",
        help="run every N-th collected test from the I-th (0 <= I < N): one part of a "
        "run split over several commands, as on a device with a per-command time limit "
        "(benchmarks/tpu_check.sh's SHARD)",
    )


def pytest_collection_modifyitems(config, items):
    """`tests/test_sharding.py` first: its one test runs the multi-device suite in a
    subprocess for minutes. Under xdist (`--dist loadfile --no-loadscope-reorder` in
    pyproject.toml) one worker starts it at once while the other runs the other files,
    instead of running it alone at the end. With `--shard I/N`, only that part."""
    items.sort(key=lambda item: not item.nodeid.startswith("tests/test_sharding.py::"))
    shard = config.getoption("--shard")
    if shard is None:
        return
    keep, dropped = shard_split(items, shard)
    config.hook.pytest_deselected(items=dropped)
    items[:] = keep


def shard_split(items: list, shard: str) -> tuple[list, list]:
    """`--shard I/N`: `(kept, deselected)`, every N-th item from the I-th kept; a bad
    value is pytest's usage error."""
    try:
        i, n = (int(v) for v in shard.split("/"))
    except ValueError:
        i, n = -1, 0
    if not 0 <= i < n:
        raise pytest.UsageError(f"--shard {shard!r}: give I/N with 0 <= I < N, e.g. 0/3")
    return items[i::n], [item for j, item in enumerate(items) if j % n != i]


@pytest.fixture(scope="session")
def subprocess_env() -> dict[str, str]:
    """The environment for running an example or benchmark script: this process's, plus
    the run's compilation cache shared by those scripts (see `RUN_CACHE`)."""
    return {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": os.path.join(RUN_CACHE, "subprocesses"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
