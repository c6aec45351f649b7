"""`clear_caches`: the one function that empties nvfp4x's module-level caches (the
pattern of `eqx.clear_caches`). Every cache in the package is listed here, in `CLEARED`
or, with the reason, in `KEPT`; a test fails on a module-level cache in neither."""

from ._axes import _auto_gemm
from ._conv import wgrad_plan
from ._dispatch import interpreted_class
from ._kernels import _cpu_multiplies_bf16, _device_capability
from ._numerics._nvfp4 import _fake_quantize_loops
from ._prims import _compiled
from ._ragged import _grouped_dot
from ._sites import _cached_traced_gemm

#: The caches `clear_caches` empties: jitted GEMMs and quantiser loops (`_compiled`,
#: `_auto_gemm`, `_fake_quantize_loops`), the grouped GEMM's vmap rule per dimension
#: numbers (`_grouped_dot`), traced layer calls (`_cached_traced_gemm`, "does this
#: module's call run a GEMM?"), the convolutions' wgrad plans (`wgrad_plan`: index tables
#: per geometry), the CPU feature probe and the device's compute capability.
CLEARED = (
    _compiled,
    wgrad_plan,
    _auto_gemm,
    _fake_quantize_loops,
    _grouped_dot,
    _cached_traced_gemm,
    _cpu_multiplies_bf16,
    _device_capability,
)
#: Caches kept: `interpreted_class` gives each module class its one interpreted subclass;
#: emptying it would give models quantised before and after different classes (and
#: tree structures) for the same layer.
KEPT = (interpreted_class,)


def clear_caches() -> None:
    """Empty nvfp4x's own caches: the compiled GEMMs and quantiser loops it keeps per
    recipe, shape and sharding, and the traced calls with which it tells whether a
    module is a layer. Like [`equinox.clear_caches`](https://docs.kidger.site/equinox/api/caches/),
    for long-running processes that build many shapes or models; nothing else changes
    (the next call compiles or traces again). JAX's own caches are `jax.clear_caches()`.

    ```python
    nvfp4x.clear_caches()
    ```
    """
    for cache in CLEARED:
        cache.cache_clear()
