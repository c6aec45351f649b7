"""Quantisation telemetry, returned from the jitted step as the gradient of probe arrays.

`nvfp4x.telemetry.enable(qmodel)` gives every `QuantizedLinear` a `probe`: a float32
zero array of shape `(*stack, 5, 4)` that the forward pass ignores. Differentiating a loss
with respect to the model (as every training step does) then yields, in the probe's slot
of the gradient, one row per quantised operand and one column per statistic:

| row | operand                       | column | statistic                               |
| --- | ----------------------------- | ------ | --------------------------------------- |
| 0   | fprop x (along features)      | 0      | tensor amax                             |
| 1   | weight W (fprop layout)       | 1      | fraction of non-zeros flushed to zero   |
| 2   | dgrad dy (along out features) | 2      | fraction saturated (NVFP4: beyond 6 x   |
|     |                               |        | block scale x tensor scale)             |
| 3   | wgrad x (tokens, after RHT)   | 3      | SQNR of the quantised operand, in dB    |
| 4   | wgrad dy (tokens, after RHT)  |        |                                         |

How: a primitive `probe_p(y, x, w, seed, probe) -> y` is the identity on `y`; its JVP
adds the tangent of a primitive linear in the probe's tangent whose transpose receives
the output gradient `dy` and returns these statistics instead of a true transpose. So
the statistics are computed inside the compiled step, on exactly the operands the GEMMs
quantise (the same stochastic-rounding keys), with no host callback, and they follow
`jax.vmap` like the GEMM does (a folded batch gives whole-call statistics;
`jax.vmap(jax.grad(f))` gives per-example ones). The statistics ride on the GEMMs' own
work: the probe calls the quantiser (and the format's saturation mask) exactly as the
GEMMs do, on the same arrays with the same keys, so that XLA computes each quantised
operand, its RHT and its block scales once for both; what telemetry adds is one pass per
operand (a single reduction over it and its quantised values).

`nvfp4x.telemetry.collect(grads)` turns the gradient into a
`{path: {operand: {stat: array}}}` table; an optimiser stepping the probes is harmless
(nothing reads them) but `nvfp4x.telemetry.disable` removes them.
"""

import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ._prims import is_traced
from ._probe import OPERANDS, PROBE_SHAPE, STATS
from ._qweight import QWeight
from ._sites import is_qweight, layer_path, qweights

#: The public names of `nvfp4x.telemetry`; the rest is machinery.
__all__ = ["OPERANDS", "STATS", "collect", "disable", "enable"]


def enable(model: Any, where: Callable[[str, Any], bool] | None = None) -> Any:
    """Give every quantised weight (for which `where(path, weight)` is true, if given) a
    zero `probe` of shape `(*stack, 5, 4)`; the gradient of a loss then carries the
    quantisation statistics of every GEMM that consumes the weight, read with
    [`nvfp4x.telemetry.collect`][]. The forward pass ignores the probe, so outputs are
    unchanged.

    **Arguments:**

    - `model`: a model returned by [`nvfp4x.quantize`][].
    - `where`: optional `(path, weight) -> bool` choosing layers by path (as
      [`nvfp4x.summary`][] shows it; `weight` is the layer's [`nvfp4x.QWeight`][]); by
      default every quantised layer.

    **Returns:** the model with probes.

    ```python
    qmodel = nvfp4x.quantize([eqx.nn.Linear(32, 32, key=jax.random.key(0))], "nvfp4_training")
    qmodel = nvfp4x.telemetry.enable(qmodel)
    qmodel[0].probe.shape   # (5, 4)
    ```
    """

    def one(w):
        if not isinstance(w, QWeight) or (where is not None and not where(w.path, w)):
            return w
        shape = w.problem_shape + PROBE_SHAPE  # a grouped convolution: one per group
        return eqx.tree_at(
            lambda m: m.probe, w, jnp.zeros(shape, jnp.float32), is_leaf=lambda v: v is None
        )

    return jax.tree_util.tree_map(one, model, is_leaf=is_qweight)


def disable(model: Any) -> Any:
    """Remove the probes again (set every quantised weight's `probe` to None).

    **Arguments:**

    - `model`: a model, with or without probes.

    **Returns:** the model without probes.

    ```python
    qmodel = nvfp4x.telemetry.disable(qmodel)
    qmodel[0].probe   # None
    ```
    """

    def one(w):
        if not isinstance(w, QWeight) or w.probe is None:
            return w
        return eqx.tree_at(lambda m: m.probe, w, None, is_leaf=lambda v: v is None)

    return jax.tree_util.tree_map(one, model, is_leaf=is_qweight)


def collect(grads: Any) -> dict[str, dict[str, dict[str, Array]]]:
    """`{layer path: {operand: {statistic: array}}}` from a gradient of a model with
    probes (arrays have the stack's leading shape for stacked layers).

    **Arguments:**

    - `grads`: the gradient, with respect to the model, of a loss of a model that
      [`nvfp4x.telemetry.enable`][] gave probes (as `eqx.filter_grad` returns it).

    **Returns:** a dict keyed by layer path; for each layer, the operands `"fprop_x"`,
    `"weight"`, `"dgrad_dy"`, `"wgrad_x"`, `"wgrad_dy"`, each with the statistics
    `"amax"`, `"zero_frac"` (fraction of non-zeros flushed to zero), `"saturated_frac"`
    and `"sqnr_db"`. Layers without probes are left out. A layer whose probe received
    nothing (its GEMM never ran in the differentiated function) is reported with a
    `UserWarning` naming it: its zeros are not statistics.

    **Raises:** `ValueError` when `grads` is evidently the model rather than its
    gradient (checked on concrete arrays, not under `jit`): every probe is zero, as
    `enable` makes them, or some probe holds a negative amax or fraction (an optimiser
    stepped it).

    ```python
    qmodel = nvfp4x.quantize([eqx.nn.Linear(32, 32, key=jax.random.key(0))], "nvfp4_training")
    qmodel = nvfp4x.telemetry.enable(qmodel)
    x = jax.random.normal(jax.random.key(1), (64, 32))
    grads = eqx.filter_grad(lambda m: jnp.mean(m[0](x) ** 2))(qmodel)
    stats = nvfp4x.telemetry.collect(grads)
    stats["[0]"]["fprop_x"]["sqnr_db"]   # a float32 scalar, about 20 dB
    ```
    """
    out, unreached = {}, []
    for tree_path, w in qweights(grads):
        if w.probe is None:
            continue
        path = w.path or layer_path(tree_path)
        table = w.probe
        if not is_traced(table):
            _check_statistics(np.asarray(table), path)
            if not np.any(np.asarray(table)):
                unreached.append(path)
        out[path] = {
            op: {st: table[..., i, j] for j, st in enumerate(STATS)}
            for i, op in enumerate(OPERANDS)
        }
    if out and len(unreached) == len(out):
        raise ValueError(
            "nvfp4x.telemetry.collect: no layer's probe holds statistics (every one is "
            "zero, as `nvfp4x.telemetry.enable` makes them). Pass the gradient of a loss "
            "with respect to the model, e.g. `eqx.filter_grad(loss)(model, ...)`, not the "
            "model; or the loss did not run any quantised GEMM."
        )
    for path in unreached:
        warnings.warn(
            f"nvfp4x.telemetry.collect: layer `{path}` has telemetry on but its GEMM "
            "never ran in the differentiated function; it is reported as zeros, which "
            "are not statistics.",
            UserWarning,
            stacklevel=2,
        )
    return out


#: The columns of a probe that hold non-negative statistics (amax and two fractions).
_NON_NEGATIVE = [STATS.index(s) for s in ("amax", "zero_frac", "saturated_frac")]


def _check_statistics(table: np.ndarray, path: str) -> None:
    """Refuse a probe whose amax or fractions are negative: a model's probe, stepped by
    an optimiser, not a gradient's statistics."""
    if np.any(table[..., _NON_NEGATIVE] < 0):
        raise ValueError(
            f"nvfp4x.telemetry.collect: the probe of layer `{path}` holds negative amax or "
            "fractions, so it is not a gradient's statistics: `collect` takes the gradient "
            "of a loss with respect to the model (`eqx.filter_grad(loss)(model, ...)`), "
            "not the model (whose probes an optimiser has stepped)."
        )
