"""`sensitivity`: how much each linear layer suffers when it alone is quantised."""

import dataclasses
import math
import re
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import quax
from jaxtyping import Array, Float

from ._coverage import coverage
from ._policy import Policy, Recipe, recipes
from ._qweight import QWeight
from ._sites import is_qweight, layers, path_str, qweights
from ._table import text_table
from ._transform import quantize


class SensitivityRow(NamedTuple):
    """One layer's figures in a [`nvfp4x.SensitivityReport`][].

    - `path`: the layer's path, as [`nvfp4x.quantize`][] matches it (`blocks[3].mlp.fc1`).
    - `loss_delta`: `loss(only this layer quantised) - loss(unquantised)`.
    - `grad_error`: `||g_q - g_ref|| / ||g_ref||` over every float array of the model
      (one global L2 norm).
    - `weight_grad_error`: the same ratio for this layer's own weight gradient.
    """

    path: str
    loss_delta: float
    grad_error: float
    weight_grad_error: float


def _nan_last(x: float) -> float:
    # NaN is the worst possible outcome: rank it as most sensitive.
    return math.inf if math.isnan(x) else x


def _sort_key(row: SensitivityRow) -> tuple[float, float]:
    return (-_nan_last(abs(row.loss_delta)), -_nan_last(row.grad_error))


@dataclasses.dataclass(frozen=True)
class SensitivityReport:
    """The result of [`nvfp4x.sensitivity`][]: one row per linear layer, most sensitive
    first.

    **Fields:**

    - `rows`: a tuple of `SensitivityRow(path, loss_delta, grad_error, weight_grad_error)`,
      sorted by `abs(loss_delta)` descending, ties broken by `grad_error` descending
      (a NaN counts as the largest value).
    - `base_loss`: the loss of the unquantised model.
    - `recipe`: the recipe each layer was quantised with.

    `str(report)` is a readable table.

    ```python
    k1, k2 = jax.random.split(jax.random.key(1))
    model = [eqx.nn.Linear(32, 32, key=k1), eqx.nn.Linear(32, 8, key=k2)]

    def loss_fn(model, x):
        return jnp.mean(jax.vmap(lambda v: model[1](jax.nn.relu(model[0](v))))(x) ** 2)

    report = nvfp4x.sensitivity(model, loss_fn, jax.random.normal(jax.random.key(0), (64, 32)))
    print(report)                  # rank, path, loss delta, grad error, weight grad error
    [r.path for r in report.rows]  # ['[1]', '[0]']: most sensitive first
    policy = report.suggest_policy(keep_fraction=0.5)   # '[1]' in bf16, '[0]' in NVFP4
    ```
    """

    rows: tuple[SensitivityRow, ...]
    base_loss: float
    recipe: Recipe

    def __post_init__(self):
        object.__setattr__(self, "rows", tuple(sorted(self.rows, key=_sort_key)))

    def __str__(self) -> str:
        header = ("rank", "path", "loss delta", "grad error", "weight grad error")
        body = [
            (
                str(i + 1),
                r.path or "<model>",
                f"{r.loss_delta:+.4e}",
                f"{r.grad_error:.4e}",
                f"{r.weight_grad_error:.4e}",
            )
            for i, r in enumerate(self.rows)
        ]
        title = (
            f"Layer sensitivity to {self.recipe.name} (base loss {self.base_loss:.6g}), "
            "most sensitive first:"
        )
        return title + "\n" + text_table(header, body)

    def suggest_policy(self, keep_fraction: float = 0.15, recipe: Recipe | None = None) -> Policy:
        """A policy keeping the most sensitive layers in bfloat16 and quantising the rest.

        **Arguments:**

        - `keep_fraction`: in `[0, 1]`; the `ceil(keep_fraction * n_layers)` most
          sensitive layers (the first rows) are kept in [`nvfp4x.recipes.bf16`][].
        - `recipe`: the recipe of every other layer; defaults to the one the report was
          measured with.

        **Returns:** an [`nvfp4x.Policy`][]: one exact-path rule (`re.escape`d) per kept
        layer with `recipes.bf16()`, then `(r".*", recipe)`. When every layer is kept the
        last rule matches nothing, so the policy is made with `strict=False`.

        ```python
        policy = report.suggest_policy(keep_fraction=0.15)
        qmodel = nvfp4x.quantize(model, policy)
        ```
        """
        if isinstance(keep_fraction, bool) or not isinstance(keep_fraction, int | float):
            raise TypeError(
                f"`keep_fraction` must be a number in [0, 1], got {type(keep_fraction).__name__}."
            )
        if not 0.0 <= keep_fraction <= 1.0:
            raise ValueError(
                f"`keep_fraction` must lie in [0, 1] (a fraction of the layers), got "
                f"{keep_fraction!r}."
            )
        recipe = self.recipe if recipe is None else recipe
        n = len(self.rows)
        # `round` first: 0.15 * 20 is 3.0000000000000004 in floating point.
        n_keep = min(n, math.ceil(round(keep_fraction * n, 9)))
        bf16 = recipes.bf16()
        rules: list[tuple[str, Recipe | None]] = [
            (re.escape(r.path), bf16) for r in self.rows[:n_keep]
        ]
        rules.append((r".*", recipe))
        return Policy(rules, strict=n_keep < n)


def _linear_paths(model: Any) -> list[str]:
    """The paths of the linear-like layers not yet quantised (those are measured)."""
    return [p for p, layer in layers(model) if not isinstance(layer.weight, quax.ArrayValue)]


@eqx.filter_jit
def _value_and_grad(params, static, batch, loss_fn, target, recipe):
    # `target` (a string) and `recipe` are static: one compilation per quantised layer.
    def f(p):
        model = eqx.combine(p, static)
        if target is not None:
            model = quantize(model, lambda path, _: recipe if path == target else None)
        return loss_fn(model, batch)

    return eqx.filter_value_and_grad(f)(params)


def _switched(model: Any, paths: list[str], onehot: Array, recipe: Recipe) -> Any:
    """`model` with every layer of `paths` quantised with `recipe`, each `enabled` where
    its entry of `onehot` is true: under `jax.vmap` over the rows of the identity, each
    variant quantises exactly one layer (and, since the weight is routed through the
    flag, as its own problem with its own tensor scales)."""
    index = {p: i for i, p in enumerate(paths)}
    qmodel = quantize(model, lambda path, _: recipe if path in index else None)

    def flag(w):
        if not isinstance(w, QWeight):
            return w
        on = jnp.broadcast_to(onehot[index[w.path]], w.stack_shape)
        return eqx.tree_at(lambda v: v.enabled, w, on, is_leaf=lambda v: v is None)

    return jax.tree_util.tree_map(flag, qmodel, is_leaf=is_qweight)


def _leaf_sq(tree: Any) -> Array:
    """`sum(leaf**2)` of every leaf, in float32, stacked in tree order."""
    leaves = jax.tree_util.tree_leaves(tree)
    return jnp.stack([jnp.sum(jnp.square(leaf.astype(jnp.float32))) for leaf in leaves])


@eqx.filter_jit
def _sweep(params, static, batch, loss_fn, paths, recipe, g_ref, layers_per_pass):
    """Every single-layer variant in one compiled program: `lax.map` over the rows of the
    identity, `layers_per_pass` variants vmapped at a time.

    **Returns:** `(losses, err, ref)`: per variant its loss and, per gradient leaf,
    `||g - g_ref||^2` (`(n_layers, n_leaves)`), and per leaf `||g_ref||^2`; the whole-model
    and per-weight errors are sums and entries of these."""

    def one(onehot):
        def f(p):
            model = _switched(eqx.combine(p, static), list(paths), onehot, recipe)
            return loss_fn(model, batch)

        loss, g = eqx.filter_value_and_grad(f)(params)
        diff = jax.tree_util.tree_map(lambda a, b: a.astype(jnp.float32) - b, g, g_ref)
        return loss, _leaf_sq(diff)

    eye = jnp.eye(len(paths), dtype=bool)
    losses, err = jax.lax.map(one, eye, batch_size=layers_per_pass)
    return losses, err, _leaf_sq(g_ref)


def _leaf_index(tree: Any, path: str) -> int | None:
    """The position of the leaf at `path` in `tree`'s leaves, or None."""
    paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    return paths.index(path) if path in paths else None


def _weight_leaves(qmodel: Any) -> dict[str, str]:
    """`{layer path: path of its weight's leaf in the unquantised model}`: where the
    quantised weight sits (`layer.weight`; for a weight tied with `eqx.nn.Shared`, the
    source it was quantised at, e.g. the embedding's)."""
    return {w.path: p for p, w in qweights(qmodel)}


def _ratio(num: float, den: float) -> float:
    """`sqrt(num / den)`, with `0/0 = 0` and `x/0 = inf`; NaN stays NaN."""
    if math.isnan(num) or math.isnan(den):
        return math.nan
    if den > 0:
        return math.sqrt(num / den)
    return 0.0 if num == 0 else math.inf


def _rel_error(g: Any, g_ref: Any) -> float:
    """`||g - g_ref|| / ||g_ref||` over all leaves, on the host (no compilation per tree)."""
    num = den = 0.0
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_ref), strict=True):
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        num += float(np.sum(np.square(a64 - b64)))
        den += float(np.sum(np.square(b64)))
    return _ratio(num, den)


def _loop_row(
    params, static, batch, loss_fn, target, recipe, base, g_ref, where: str
) -> SensitivityRow:
    """The reference: quantise `target` (its weight's leaf at `where`) alone, one
    compiled pass."""
    loss, g = _value_and_grad(params, static, batch, loss_fn, target, recipe)
    w, w_ref = _leaf_by_path(g, where), _leaf_by_path(g_ref, where)
    return SensitivityRow(
        path=target,
        loss_delta=float(loss) - base,
        grad_error=_rel_error(g, g_ref),
        weight_grad_error=math.nan if w is None or w_ref is None else _rel_error(w, w_ref),
    )


def _leaf_by_path(tree: Any, path: str) -> Any:
    for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if path_str(p) == path:
            return leaf
    return None


def sensitivity(
    model: Any,
    loss_fn: Callable[[Any, Any], Float[Array, ""]],
    batch: Any,
    *,
    recipe: Recipe | None = None,
    layers_per_pass: int | None = 8,
) -> SensitivityReport:
    """Measure, for each `eqx.nn.Linear` of `model`, the harm done by quantising that
    layer alone (every other layer stays as it is).

    For each layer the model is quantised with `recipe` on that layer only, and the loss
    `loss_fn(qmodel, batch)` and its gradient with respect to every float array of the
    model are compared with those of the unquantised model.

    **Arguments:**

    - `model`: any model [`nvfp4x.quantize`][] accepts, holding at least one linear-like
      layer (`eqx.nn.Linear`, a subclass, a user linear class; layers already quantised
      are left as they are and not measured). A layer whose quantisation changes
      nothing (its GEMM never ran in `loss_fn`) is reported with a `UserWarning`.
    - `loss_fn`: `(model, batch) -> scalar loss`, differentiable in the model's float
      arrays. If it draws random numbers, put a fixed key inside `batch`.
    - `batch`: the data passed to every run, unchanged. Stochastic rounding of gradients
      is seeded from the layer's weight (and any key `loss_fn` passes to the layers), so
      every run sees the same rounding noise and the figures are comparable; they are
      still one draw of that noise, so use a batch large enough to average it.
    - `recipe`: the recipe to measure; defaults to [`nvfp4x.recipes.nvfp4_training`][].

    **Returns:** a [`nvfp4x.SensitivityReport`][], rows sorted most sensitive first (by
    `abs(loss_delta)`, then `grad_error`); `report.suggest_policy(keep_fraction=0.15)`
    turns it into a policy.

    - `layers_per_pass`: how many single-layer variants run together, vmapped, in each
      step of one compiled `jax.lax.map` (memory grows with it: each variant holds its
      own activations and gradient). `None` runs the reference instead: one separately
      compiled pass per layer. Both give the same figures up to float32 rounding.

    **Cost:** one compilation in all (plus one for the unquantised reference pass), and
    the work of one forward and backward pass per layer: every variant differs from the
    unquantised model from its layer on, so the passes cannot be shared in general, but
    they run batched. Measured: `python benchmarks/bench_sensitivity.py`.

    ```python
    def loss_fn(model, batch):
        x, y = batch
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    report = nvfp4x.sensitivity(model, loss_fn, (x, y))
    print(report)
    qmodel = nvfp4x.quantize(model, report.suggest_policy(keep_fraction=0.15))
    ```
    """
    if recipe is None:
        recipe = recipes.nvfp4_training()
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"`recipe` must be an `nvfp4x.Recipe` (e.g. `nvfp4x.recipes.nvfp4_training()`), "
            f"got {type(recipe).__name__}."
        )
    if layers_per_pass is not None:
        if isinstance(layers_per_pass, bool) or not isinstance(layers_per_pass, int):
            raise TypeError(
                "`layers_per_pass` must be a positive int (how many single-layer variants "
                "run vmapped together) or None (one compiled pass per layer), got "
                f"{type(layers_per_pass).__name__}."
            )
        if layers_per_pass < 1:
            raise ValueError(
                f"`layers_per_pass` must be at least 1 (or None), got {layers_per_pass}."
            )
    if not callable(loss_fn):
        raise TypeError(f"`loss_fn` must be callable `(model, batch) -> loss`, got {loss_fn!r}.")
    paths = _linear_paths(model)
    if not paths:
        raise ValueError(
            "nvfp4x.sensitivity: `model` holds no `eqx.nn.Linear`, so there is nothing to "
            "measure. Pass a model with linear layers (see `nvfp4x.summary(model)`)."
        )

    params, static = eqx.partition(model, eqx.is_inexact_array)
    base_loss, g_ref = _value_and_grad(params, static, batch, loss_fn, None, recipe)
    if jnp.ndim(base_loss) != 0:
        raise ValueError(
            f"`loss_fn` must return a scalar loss, got an array of shape {jnp.shape(base_loss)}."
        )
    base = float(base_loss)

    every = quantize(model, lambda path, _: recipe if path in paths else None)
    where = _weight_leaves(every)
    if layers_per_pass is None:
        rows = [
            _loop_row(params, static, batch, loss_fn, t, recipe, base, g_ref, where[t])
            for t in paths
        ]
    else:
        losses, err, ref = _sweep(
            params, static, batch, loss_fn, tuple(paths), recipe, g_ref, layers_per_pass
        )
        losses, err, ref = (np.asarray(a, np.float64) for a in (losses, err, ref))
        rows = []
        for i, target in enumerate(paths):
            w = _leaf_index(g_ref, where[target])
            rows.append(
                SensitivityRow(
                    path=target,
                    loss_delta=float(losses[i]) - base,
                    grad_error=_ratio(err[i].sum(), ref.sum()),
                    weight_grad_error=math.nan if w is None else _ratio(err[i, w], ref[w]),
                )
            )
    # Which layers' GEMMs run in `loss_fn` at all (traced, not run).
    reached = {r.path for r in coverage(loss_fn, every, batch).rows if r.quantised}
    for r in rows:
        if r.path not in reached:
            warnings.warn(
                f"nvfp4x.sensitivity: the GEMM of `{r.path}` never runs in `loss_fn`, so "
                "quantising it changes nothing; its row is not evidence that the layer is "
                "safe to quantise.",
                UserWarning,
                stacklevel=2,
            )
    return SensitivityReport(rows=tuple(rows), base_loss=base, recipe=recipe)
