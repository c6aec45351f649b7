"""`summary`: what a model quantises, layer by layer."""

from typing import Any

import jax
import numpy as np

from ._frozen import FrozenLinear, FrozenWeight
from ._qweight import QWeight
from ._sites import layers, qweights
from ._table import text_table


def _bytes(shape, bits_per_element) -> int:
    return int(np.ceil(int(np.prod(shape)) * bits_per_element / 8))


def _fmt(fmt) -> str:
    return "-" if fmt is None else str(fmt)


def _row(path: str, w: Any) -> tuple:
    """`(path, shape, weight, input, grad, bytes held, weight bytes in its GEMM format)`
    of a layer's weight: a `QWeight`, a frozen layer or a plain array."""
    if isinstance(w, FrozenLinear | FrozenWeight):
        r = w.recipe
        weight = w.weight if isinstance(w, FrozenLinear) else w
        held = sum(v.nbytes for v in jax.tree_util.tree_leaves(weight))  # with a tie's master
        packed = sum(v.nbytes for v in jax.tree_util.tree_leaves(weight.packed))
        shape = tuple(w.weight_shape if isinstance(w, FrozenLinear) else w.shape)
        return (path, str(shape), _fmt(r.weight) + " (frozen)", _fmt(r.input), "-", held, packed)
    array = w.array if isinstance(w, QWeight) else w
    shape = tuple(array.shape)
    master = int(np.prod(shape)) * np.dtype(array.dtype).itemsize
    if isinstance(w, QWeight):
        r = w.recipe
        qbytes = master if r.weight is None else _bytes(shape, r.weight.bits_per_element)
        return (path, str(shape), _fmt(r.weight), _fmt(r.input), _fmt(r.grad), master, qbytes)
    return (path, str(shape), "(unquantised)", "-", "-", master, master)


def rows(model: Any) -> list[tuple]:
    """One row per linear-like layer, and per quantised weight outside one (tied)."""
    out, seen = [], set()
    for path, layer in layers(model):
        w = layer if isinstance(layer, FrozenLinear) else layer.weight
        if not isinstance(layer, FrozenLinear) and not hasattr(w, "shape"):
            continue  # tied with `eqx.nn.Shared`: listed at its source
        if isinstance(w, QWeight | FrozenWeight):
            seen.add(id(w))
            path = w.path or path
        elif isinstance(w, FrozenLinear):
            seen.add(id(w.weight))
        out.append(_row(path, w))
    for _, w in qweights(model, frozen=True):
        if id(w) not in seen:
            out.append(_row(w.path, w))
    return out


def summary(model: Any) -> str:
    """A table of every linear layer: path, weight shape, the formats of weight, input
    and output gradient, bytes held (master weights; packed weights once frozen, plus the
    master values a tied weight keeps for its embedding lookup) and the weight's bytes in
    its GEMM format, with totals.

    **Arguments:**

    - `model`: any PyTree holding linear-like layers (`eqx.nn.Linear`, its subclasses,
      user linear classes), quantised or frozen. Paths are shown as [`nvfp4x.Policy`][]
      matches them (`blocks[3].mlp.fc1`); a model that is itself one layer has the empty
      path. A weight tied with `eqx.nn.Shared` is shown once, under the layer the
      policy selected.

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
    header = ("path", "shape", "weight", "input", "grad", "bytes held", "weight bytes")
    body = []
    total_master = total_q = 0
    for row in rows(model):
        body.append(row[:-2] + (f"{row[-2]:,}", f"{row[-1]:,}"))
        total_master += row[-2]
        total_q += row[-1]
    return text_table(header, body, ("total", "", "", "", "", f"{total_master:,}", f"{total_q:,}"))
