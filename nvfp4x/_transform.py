"""`quantize` / `dequantize` over any Equinox model, and `summary`."""

import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np

from ._linear import QuantizedLinear
from ._policy import Policy, PolicyLike, Recipe, as_recipe


def path_str(path: tuple) -> str:
    """`blocks[3].mlp.fc1`: attributes joined by dots, indices and dict keys in brackets."""
    out = ""
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey):
            out += ("." if out else "") + k.name
        elif isinstance(k, jax.tree_util.SequenceKey):
            out += f"[{k.idx}]"
        elif isinstance(k, jax.tree_util.DictKey | jax.tree_util.FlattenedIndexKey):
            out += f"[{k.key}]"
        else:
            out += str(k)
    return out


def _is_layer(x: Any) -> bool:
    return isinstance(x, eqx.nn.Linear | QuantizedLinear)


def _resolver(policy: PolicyLike) -> tuple[Callable[[str, Any], Recipe | None], Policy | None]:
    if isinstance(policy, Policy):
        return (lambda path, _: policy.lookup(path)[1]), policy
    if isinstance(policy, Recipe | str):
        recipe = as_recipe(policy, "`policy`")
        return (lambda path, _: recipe), None
    if callable(policy):
        return (
            lambda path, layer: as_recipe(policy(path, layer), f"The policy callable for `{path}`")
        ), None
    raise TypeError(
        f"`policy` must be an `nvfp4x.Policy`, a recipe, a recipe name or a callable "
        f"`(path, linear) -> recipe | None`; got {type(policy).__name__}."
    )


def quantize(model: Any, policy: PolicyLike, *, fast: bool = True) -> Any:
    """Replace every `eqx.nn.Linear` that `policy` maps to a recipe by a
    [`nvfp4x.QuantizedLinear`][]; change nothing else.

    **Arguments:**

    - `model`: any PyTree (Equinox modules, lists, tuples, dicts) holding `eqx.nn.Linear`
      layers anywhere, stacked ones (`eqx.filter_vmap`-made) included.
    - `policy`: an [`nvfp4x.Policy`][] (regex rules on paths such as `blocks[3].mlp.fc1`),
      one recipe (or recipe name) for every layer, or a callable
      `(path, linear) -> recipe | None`. `None` keeps a layer as it is.
    - `fast`: run the GEMMs on bfloat16 operands where the device multiplies them natively
      (float32 on other CPUs; exact for quantised values either way) rather than the
      float32 reference.

    **Returns:** the model with quantised layers. [`nvfp4x.dequantize`][] undoes it exactly.

    ```python
    qmodel = nvfp4x.quantize(model, nvfp4x.recipes.nvfp4_training())
    ```
    """
    resolve, rules = _resolver(policy)
    matched: set[int] = set()
    found = 0

    def replace(path, leaf):
        nonlocal found
        if not isinstance(leaf, eqx.nn.Linear):
            return leaf
        found += 1
        p = path_str(path)
        if rules is not None:
            index, recipe = rules.lookup(p)
            if index is not None:
                matched.add(index)
        else:
            recipe = resolve(p, leaf)
        if recipe is None:
            return leaf
        return QuantizedLinear.from_linear(leaf, recipe, fast=fast)

    out = jax.tree_util.tree_map_with_path(replace, model, is_leaf=_is_layer)
    if found == 0:
        warnings.warn(
            "nvfp4x.quantize: the model holds no `eqx.nn.Linear`; it is returned unchanged.",
            UserWarning,
            stacklevel=2,
        )
    elif rules is not None and rules.strict:
        unused = [i for i in range(len(rules.rules)) if i not in matched]
        if unused:
            names = ", ".join(f"rule {i} `{rules.rules[i][0].pattern}`" for i in unused)
            raise ValueError(
                f"nvfp4x.quantize: {names} matched no `eqx.nn.Linear` (or every layer it "
                "matches was taken by an earlier rule). Paths look like "
                "`blocks[3].mlp.layers[0]`; see `nvfp4x.summary(model)`. Pass "
                "`Policy(..., strict=False)` to allow unused rules."
            )
    return out


def dequantize(model: Any) -> Any:
    """Turn every [`nvfp4x.QuantizedLinear`][] back into `eqx.nn.Linear` with its master
    weights: `eqx.tree_equal(dequantize(quantize(m, p)), m)` holds.

    **Arguments:**

    - `model`: any PyTree; every `QuantizedLinear` in it (stacked ones included) is
      replaced, everything else (frozen layers included) is returned as it is.

    **Returns:** the model with plain `eqx.nn.Linear` layers. Telemetry probes (see
    `nvfp4x.telemetry`) are dropped with the rest of the quantisation.

    ```python
    model = eqx.nn.Linear(32, 16, key=jax.random.key(0))
    qmodel = nvfp4x.quantize(model, nvfp4x.recipes.nvfp4_inference())
    eqx.tree_equal(nvfp4x.dequantize(qmodel), model)   # True
    ```
    """

    def back(leaf):
        return leaf.to_linear() if isinstance(leaf, QuantizedLinear) else leaf

    return jax.tree_util.tree_map(back, model, is_leaf=_is_layer)


def _layers(model: Any):
    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_layer)[0]
    return [(path_str(p), leaf) for p, leaf in leaves if _is_layer(leaf)]


def _nbytes(x) -> int:
    return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize


def summary(model: Any) -> str:
    """A table of every linear layer: path, weight shape, the formats of weight, input
    and output gradient, bytes held (master weights; packed weights once frozen) and the
    weight's bytes in its GEMM format, with totals.

    **Arguments:**

    - `model`: any PyTree holding `eqx.nn.Linear`, [`nvfp4x.QuantizedLinear`][] or
      [`nvfp4x.FrozenLinear`][] layers. Paths are shown as [`nvfp4x.Policy`][] matches
      them (`blocks[3].mlp.fc1`); a model that is itself one layer has the empty path.

    **Returns:** the table as a string (print it).

    ```python
    model = [eqx.nn.Linear(32, 16, key=jax.random.key(0))]
    print(nvfp4x.summary(nvfp4x.quantize(model, nvfp4x.recipes.nvfp4_inference())))
    # path   shape     weight      input       grad  bytes held  weight bytes
    # -----  --------  ----------  ----------  ----  ----------  ------------
    # [0]    (16, 32)  nvfp4 1x16  nvfp4 1x16  -     2,048       288
    # -----  --------  ----------  ----------  ----  ----------  ------------
    # total                                          2,048       288
    ```
    """
    from ._frozen import layer_summary_row  # frozen layers add their own rows

    rows = [("path", "shape", "weight", "input", "grad", "bytes held", "weight bytes")]
    total_master = total_q = 0
    for path, layer in _layers_all(model):
        row = layer_summary_row(path, layer)
        rows.append(row[:-2] + (f"{row[-2]:,}", f"{row[-1]:,}"))
        total_master += row[-2]
        total_q += row[-1]
    rows.append(("total", "", "", "", "", f"{total_master:,}", f"{total_q:,}"))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(len(lines) - 1, lines[1])
    return "\n".join(lines)


def _layers_all(model: Any):
    from ._frozen import is_layer_any

    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_layer_any)[0]
    return [(path_str(p), leaf) for p, leaf in leaves if is_layer_any(leaf)]
