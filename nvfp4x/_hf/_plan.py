"""The plan: the model's array leaves and frozen weights, each with its checkpoint
name (from the names map), checked before anything is read or written."""

import dataclasses
from typing import Any

import jax
import numpy as np

from .._frozen import FrozenWeight
from .._packed import PackedArray
from .._qweight import QWeight
from .._sites import is_weight, path_str
from ._names import namer


@dataclasses.dataclass
class Entry:
    """One array leaf (or quantised weight) of the model and its checkpoint name."""

    index: int  # position among the flattened leaves
    module: str  # nvfp4x module path, e.g. `blocks[3].attn.wq`
    attr: str  # `weight`, `bias`, ...
    template: str  # checkpoint module name, `{i}` for stacked ones
    leaf: Any  # a FrozenWeight, an array or a ShapeDtypeStruct
    stack: int | None  # slices of a stacked leaf (None: written whole)

    def module_names(self) -> list[str]:
        if self.stack is None:
            return [self.template]
        return [self.template.replace("{i}", str(i)) for i in range(self.stack)]

    def tensor_names(self, suffix: str = "") -> list[str]:
        attr = self.attr + suffix
        return [f"{m}.{attr}" if m else attr for m in self.module_names()]


def _is_weight_leaf(x: Any) -> bool:
    return is_weight(x) or isinstance(x, PackedArray)


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | jax.ShapeDtypeStruct)


def _key_name(key: Any) -> str:
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    return str(getattr(key, "key", key))


def plan(model: Any, names: Any, who: str) -> tuple[list[Entry], Any, list]:
    """The model's entries, its treedef and flat leaves (weights as `FrozenWeight`s)."""
    name_of = namer(names)
    flat, treedef = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_weight_leaf)
    entries, seen = [], {}
    for index, (keys, leaf) in enumerate(flat):
        path = path_str(keys)
        if isinstance(leaf, QWeight):
            raise ValueError(
                f"{who}: `{path}` is a quantised training weight (`nvfp4x.QWeight`); pass "
                "the frozen model, `nvfp4x.freeze(qmodel)`."
            )
        if isinstance(leaf, PackedArray):
            raise ValueError(
                f"{who}: `{path}` is a bare {type(leaf).__name__} outside a frozen layer; "
                "the checkpoint format stores quantised weights of linear layers only. Hold "
                "it as a layer's weight (`nvfp4x.freeze` of a quantised model makes them)."
            )
        if isinstance(leaf, FrozenWeight):
            if not keys or _key_name(keys[-1]) != "weight":
                raise ValueError(
                    f"{who}: the quantised weight at `{path}` is not a module's `weight`; "
                    "the checkpoint format names quantised tensors `<module>.weight`, "
                    "`<module>.weight_scale`, ... Leave it out of the NVFP4 policy."
                )
            if leaf.transposed:
                raise ValueError(f"{who}: `{path}` is a transposed view of a frozen weight.")
            if leaf.master is not None and isinstance(leaf.packed, PackedArray):
                raise ValueError(
                    f"{who}: `{path}` is tied to an embedding (it keeps its master values "
                    "for the lookup, `FrozenWeight.master`) and quantised "
                    f"({leaf.recipe.weight}); the checkpoint format holds one tensor per "
                    "weight, and serving stacks keep a tied LM head unquantised. Keep "
                    f"`{leaf.path}` unquantised (a rule `({leaf.path!r}, None)` or "
                    "`nvfp4x.recipes.bf16()`: its master values are then written once, as "
                    "the tied table), or write the model with `nvfp4x.save`, which keeps both."
                )
        elif not _is_array(leaf):
            continue  # not a tensor (a Python scalar, a string...): not checkpoint data
        module = path_str(keys[:-1]) if keys else ""
        attr = _key_name(keys[-1]) if keys else "weight"
        template = name_of(module)
        if template is None:
            raise ValueError(
                f"{who}: the names map gives no checkpoint name for module `{module}` (it "
                f"holds `{path}`). Add it to the map (a dict entry, or a rule of "
                "`nvfp4x.hf_names.rules`); every tensor must be named, none is dropped."
            )
        if not isinstance(template, str):
            raise TypeError(
                f"{who}: the names map returned {type(template).__name__} `{template!r}` for "
                f"module `{module}`; it must return a string."
            )
        stacked = "{i}" in template
        if isinstance(leaf, FrozenWeight):
            if leaf.groups > 1:
                raise ValueError(
                    f"{who}: `{path}` is a grouped convolution kernel ({leaf.groups} feature "
                    "groups, each its own GEMM); the checkpoint format holds one matrix per "
                    "weight. Leave it out of the quantisation policy."
                )
            nstack = len(leaf.stack_shape)
            if nstack > 1:
                raise ValueError(
                    f"{who}: `{path}` is stacked over {nstack} leading axes; the checkpoint "
                    "holds one tensor per layer, and `{i}` indexes one axis only."
                )
            if nstack != int(stacked):
                want = "contains" if nstack else "does not contain"
                raise ValueError(
                    f"{who}: `{path}` is {'stacked' if nstack else 'not stacked'} but its "
                    f"checkpoint name `{template}` {'lacks' if nstack else 'has'} the `{{i}}` "
                    f"placeholder; give it a name that {want} `{{i}}` (the layer index)."
                )
            stack = leaf.stack_shape[0] if nstack else None
        elif stacked:
            if len(leaf.shape) == 0:
                raise ValueError(
                    f"{who}: `{path}` is a scalar but its checkpoint name `{template}` has the "
                    "`{i}` placeholder of a stacked tensor."
                )
            stack = leaf.shape[0]
        else:
            stack = None
        entry = Entry(index, module, attr, template, leaf, stack)
        for name in entry.tensor_names():
            if name in seen:
                raise ValueError(
                    f"{who}: `{path}` and `{seen[name]}` both map to the checkpoint tensor "
                    f"`{name}`; the names map must give every module its own name."
                )
            seen[name] = path
        entries.append(entry)
    return entries, treedef, [leaf for _, leaf in flat]
