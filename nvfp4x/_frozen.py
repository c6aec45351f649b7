"""Frozen (inference) layers: packed weights, no master copy. Filled in by the inference work."""

import equinox as eqx
import numpy as np

from ._linear import QuantizedLinear


def is_layer_any(x) -> bool:
    return isinstance(x, eqx.nn.Linear | QuantizedLinear)


def _bytes(shape, bits_per_element) -> int:
    return int(np.ceil(int(np.prod(shape)) * bits_per_element / 8))


def layer_summary_row(path: str, layer) -> tuple:
    shape = tuple(layer.weight.shape)
    master = int(np.prod(shape)) * np.dtype(layer.weight.dtype).itemsize
    if isinstance(layer, QuantizedLinear):
        r = layer.recipe
        f = lambda fmt: "-" if fmt is None else str(fmt)  # noqa: E731
        qbytes = master if r.weight is None else _bytes(shape, r.weight.bits_per_element)
        return (path, str(shape), f(r.weight), f(r.input), f(r.grad), master, qbytes)
    return (path, str(shape), "(unquantised)", "-", "-", master, master)
