"""Per-format codecs: how a weight of one format is written to the checkpoint and read
back. `CODECS` is keyed by the weight's format name (`Recipe.weight.name`; a weight kept
in its dtype, `Recipe.weight=None`, and every array that is not a frozen weight use
`PLAIN`). A weight whose format has no codec is refused, naming the layer. Adding a
format to the checkpoint (FP8, MXFP8) is adding a codec here: the `quant_algo`s it
writes (`Algo`), its tensors, and the format module's functions that give its bytes.

Nothing here reads a format's internals: the NVFP4 codec asks `_formats/_nvfp4.py` for
a frozen weight's rows (`to_rows`), the weight rebuilt from rows (`from_rows`), and the
tensor scale <-> amax arithmetic.
"""

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .._formats._nvfp4 import (
    GROUP_SIZE,
    from_rows,
    requantize_rows,
    rows_fit,
    tensor_decode_scale,
    to_rows,
)
from .._freeze import pack_weight
from .._frozen import FrozenWeight
from .._sites import layers as site_layers, weight_path
from ._modelopt import Algo, QuantConfig
from ._plan import Entry
from ._safetensors import CODES, Tensor


@runtime_checkable
class TensorSource(Protocol):
    """The checkpoint's tensors as a codec reads them (`_import.Reader`)."""

    def get(
        self, name: str, dtype: str, shapes: Sequence[tuple[int, ...]], holder: str
    ) -> Tensor: ...


@dataclasses.dataclass
class Layer:
    """A quantised layer (one slice of a stacked one) as it will be written."""

    module: str  # nvfp4x module path
    name: str  # checkpoint module name
    algo: Algo
    codec: "Codec"
    elements: np.ndarray  # the packed elements, as stored
    block_scales: np.ndarray | None  # the block scales' bits, as stored
    tensor_scale: Any  # float32 scalar: the tensor decode scale
    input_amax: Any  # float32 scalar (activations quantised) or None


class Codec:
    """How the weights of one format are written and read. A codec without `algos`
    writes its weights as they are, and their layers are listed as unquantised."""

    #: The Model Optimizer `quant_algo`s it writes and reads.
    algos: ClassVar[tuple[Algo, ...]] = ()

    @property
    def quantised(self) -> bool:
        return bool(self.algos)

    def export(
        self, entry: Entry, weight_only: bool, input_amax: Mapping[str, Any], who: str
    ) -> tuple[dict[str, np.ndarray], list[Layer]]:
        """The entry's tensors written as they are, and its quantised layers (whose
        tensors `tensors` gives once fused layers are reconciled)."""
        raise NotImplementedError

    def tensors(self, layer: Layer) -> dict[str, np.ndarray]:
        """A quantised layer's checkpoint tensors, by name."""
        raise NotImplementedError

    def requantize(self, layer: Layer, tensor_scale: np.ndarray) -> Layer:
        """The layer quantised again with another tensor scale (one a fused group shares)."""
        raise NotImplementedError

    def read(self, entry: Entry, source: TensorSource, config: QuantConfig) -> Any:
        """The entry's leaf of `like` with its arrays read from the checkpoint."""
        raise NotImplementedError


def _plain_array(leaf: Any) -> Any:
    """The array a plain tensor holds: a frozen weight's master values if it keeps them
    (a tie kept unquantised: the table its lookup reads, which its GEMM casts), else its
    packed array; any other leaf itself."""
    if not isinstance(leaf, FrozenWeight):
        return leaf
    return leaf.packed if leaf.master is None else leaf.master


class Plain(Codec):
    """Arrays and weights kept in their dtype: one tensor each (per stacked slice)."""

    def export(self, entry, weight_only, input_amax, who):
        leaf = entry.leaf
        array = np.asarray(_plain_array(leaf))
        slices = [array] if entry.stack is None else list(array)
        tensors = {}
        for name, a in zip(entry.tensor_names(), slices, strict=True):
            if a.dtype not in CODES:
                raise ValueError(f"{who}: `{name}` has dtype {a.dtype}, which safetensors lacks.")
            tensors[name] = np.ascontiguousarray(a)
        return tensors, []

    def read(self, entry, source, config):
        leaf = entry.leaf
        array = _plain_array(leaf)
        dtype = np.dtype(array.dtype)
        if dtype not in CODES:
            raise ValueError(
                f"`like` holds `{entry.module}.{entry.attr}` in {dtype}, which safetensors lacks."
            )
        shape = tuple(array.shape) if entry.stack is None else tuple(array.shape[1:])
        holder = f"{entry.module}.{entry.attr}"
        names = entry.tensor_names()
        parts = [source.get(n, CODES[dtype], [shape], holder).array() for n in names]
        value = jnp.asarray(parts[0] if entry.stack is None else np.stack(parts))
        if not isinstance(leaf, FrozenWeight):
            return value
        if leaf.master is not None:  # the tie's table; its GEMM's weight, packed as `freeze` does
            return dataclasses.replace(leaf, packed=pack_weight(value, leaf.recipe), master=value)
        return dataclasses.replace(leaf, packed=value)


_NVFP4_WEIGHTS = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": GROUP_SIZE}
#: NVFP4 weights and activations (a static activation `input_scale` per layer).
W4A4 = Algo(
    "NVFP4",
    "W4A4",
    GROUP_SIZE,
    _NVFP4_WEIGHTS,
    _NVFP4_WEIGHTS,
    "W4A4: activations in NVFP4, e.g. `nvfp4_inference`",
)
#: NVFP4 weights, activations unquantised.
W4A16 = Algo(
    "W4A16_NVFP4", "W4A16", GROUP_SIZE, _NVFP4_WEIGHTS, None, "W4A16_NVFP4: `nvfp4_weight_only`"
)


class NVFP4(Codec):
    """NVFP4 weights, per layer `<name>`: `<name>.weight` (uint8 `[out, in/2]`, element
    `2i` in the low nibble), `<name>.weight_scale` (float8_e4m3fn `[out, in/16]`, a 16x16
    tile's scale repeated over its 16 rows), `<name>.weight_scale_2` (float32 `[]`, the
    tensor decode scale) and, for W4A4, `<name>.input_scale` (float32 `[]`)."""

    format = "nvfp4"
    algos = (W4A4, W4A16)

    def _algo(self, entry: Entry, weight_only: bool, input_amax: Mapping[str, Any], who: str):
        recipe = entry.leaf.recipe
        fmt = recipe.input
        if fmt is None or not fmt.quantised or weight_only:
            if entry.module in input_amax and not weight_only:
                raise ValueError(
                    f"{who}: `input_amax` names `{entry.module}`, whose recipe "
                    f"`{recipe.name}` does not quantise its activations; remove it."
                )
            return W4A16
        if fmt.name != self.format:
            raise ValueError(
                f"{who}: `{entry.module}` quantises its activations to {fmt.name} (recipe "
                f"`{recipe.name}`); the checkpoint format has NVFP4 weights with NVFP4 or "
                "unquantised activations. Use `weight_only=True` or another recipe."
            )
        if entry.module not in input_amax:
            raise ValueError(
                f"{who}: `{entry.module}` quantises its activations to NVFP4 (recipe "
                f"`{recipe.name}`), with a tensor scale nvfp4x computes per call; a W4A4 "
                "checkpoint holds a static, calibrated `input_scale` instead. Pass "
                "`input_amax={path: amax}` for every such layer (e.g. the largest "
                "`nvfp4x.telemetry` `fprop_x` amax over calibration batches), or "
                "`weight_only=True` to export weights-only (W4A16_NVFP4)."
            )
        return W4A4

    def _check_features(self, entry: Entry, who: str) -> None:
        inn = entry.leaf.packed.shape[-1]
        if inn % GROUP_SIZE:
            raise ValueError(
                f"{who}: `{entry.module}` has {inn} input features, not a multiple of "
                f"{GROUP_SIZE}; serving stacks' NVFP4 loaders refuse such layers (vLLM: "
                "'input feature size is not a multiple of 16'). Keep it out of the NVFP4 policy."
            )

    def export(self, entry, weight_only, input_amax, who):
        algo = self._algo(entry, weight_only, input_amax, who)
        self._check_features(entry, who)
        codes, bits, ts = to_rows(entry.leaf.packed)
        if entry.stack is None:
            codes, bits, ts = codes[None], bits[None], ts[None]
        amax = input_amax.get(entry.module) if algo.input_activations is not None else None
        if amax is not None:
            amax = np.broadcast_to(np.asarray(amax, np.float32), ts.shape)
        layers = [
            Layer(
                entry.module,
                name,
                algo,
                self,
                np.ascontiguousarray(codes[i]),
                np.ascontiguousarray(bits[i]),
                ts[i],
                None if amax is None else amax[i],
            )
            for i, name in enumerate(entry.module_names())
        ]
        return {}, layers

    def tensors(self, layer):
        scales = _block_scales(layer)
        out = {
            f"{layer.name}.weight": layer.elements,
            f"{layer.name}.weight_scale": scales.view(ml_dtypes.float8_e4m3fn),
            f"{layer.name}.weight_scale_2": np.asarray(layer.tensor_scale, np.float32).reshape(()),
        }
        if layer.input_amax is not None:
            out[f"{layer.name}.input_scale"] = tensor_decode_scale(layer.input_amax).reshape(())
        return out

    def requantize(self, layer, tensor_scale):
        scales = _block_scales(layer)
        rows = (layer.elements, scales, layer.tensor_scale)
        codes, bits, ts = requantize_rows(rows, tensor_scale)
        return dataclasses.replace(layer, elements=codes, block_scales=bits, tensor_scale=ts)

    def read(self, entry, source, config):
        fw = entry.leaf
        packed = fw.packed
        out, inn = packed.shape[-2:]
        fmt = fw.recipe.input
        want = W4A4 if fmt is not None and fmt.name == self.format else W4A16
        holder = weight_path(entry.module)
        if inn % GROUP_SIZE:
            raise ValueError(
                f"`like` holds `{entry.module}` in NVFP4 with {inn} input features, not a "
                f"multiple of {GROUP_SIZE}: no NVFP4 checkpoint stores such a layer."
            )
        codes, bits, scales = [], [], []
        for name in entry.module_names():
            algo = config.algo_of(name)
            if algo != want.name:
                have = "unquantised (excluded)" if algo is None else f"`{algo}`"
                raise ValueError(
                    f"`{config.file}` stores `{name}` {have}, but `like` has `{entry.module}` "
                    f"in `{want.name}` (recipe `{fw.recipe.name}`): quantisation mismatch. "
                    "Build `like` with the recipes that wrote the checkpoint "
                    f"({'; '.join(a.recipes for a in self.algos)})."
                )
            codes.append(source.get(f"{name}.weight", "U8", [(out, inn // 2)], holder).bits())
            shape = [(out, inn // GROUP_SIZE)]
            row_bits = source.get(f"{name}.weight_scale", "F8_E4M3", shape, holder).bits()
            scale = source.get(f"{name}.weight_scale_2", "F32", [(), (1,)], holder).array()
            if want is W4A4:
                s = source.get(f"{name}.input_scale", "F32", [(), (1,)], holder).array()
                if not (np.all(np.isfinite(s)) and np.all(s > 0)):
                    raise ValueError(f"`{name}.input_scale` is {s.reshape(-1)[0]}, not positive.")
            if not rows_fit(row_bits, packed.block):
                raise ValueError(
                    f"`{name}.weight_scale` varies within 16-row tiles, but `like` holds "
                    f"`{entry.module}` in 16x16 blocks: build `like` with "
                    "`weight_block=(1, 16)` to read this checkpoint."
                )
            bits.append(row_bits)
            scales.append(scale.reshape(()))
        if entry.stack is None:
            rows = (codes[0], bits[0], scales[0])
        else:
            rows = (np.stack(codes), np.stack(bits), np.stack(scales))
        return dataclasses.replace(fw, packed=from_rows(rows, packed))


PLAIN = Plain()
#: The codecs, by the format name of the weights they write (`None`: a weight kept in
#: its dtype). Formats missing here (`mxfp8`, `fp8_e4m3`, `fp8_e5m2`) are refused.
CODECS: dict[str | None, Codec] = {
    NVFP4.format: NVFP4(),
    "bf16": PLAIN,
    "float32": PLAIN,
    None: PLAIN,
}
#: The `quant_algo`s the codecs write and read, by name.
ALGOS: dict[str, Algo] = {a.name: a for c in CODECS.values() for a in c.algos}


def codec_of(leaf: Any) -> Codec | None:
    """The codec of a leaf of the model (None: its weight format has none)."""
    if not isinstance(leaf, FrozenWeight):
        return PLAIN
    fmt = leaf.recipe.weight
    return CODECS.get(None if fmt is None else fmt.name)


def codec_for(entry: Entry, who: str) -> Codec:
    """The codec of a planned entry; a weight whose format has none is refused."""
    codec = codec_of(entry.leaf)
    if codec is not None:
        return codec
    raise ValueError(
        f"{who}: `{entry.module}` is frozen in {entry.leaf.recipe.weight}; this format "
        "holds NVFP4 or unquantised weights. Quantise it with an NVFP4 recipe, or "
        "`nvfp4x.recipes.bf16()`, or leave it out of the policy."
    )


def unquantised_layers(model: Any, entries: list[Entry]) -> set[str]:
    """Checkpoint names of the linear layers whose weight no quantising codec writes
    (listed as excluded)."""
    by_module = {e.module: e for e in entries if e.attr == "weight"}
    out = set()
    for path, layer in site_layers(model):
        codec = codec_of(layer.weight)
        if codec is not None and codec.quantised:
            continue
        entry = by_module.get(path)
        if entry is not None:
            out.update(entry.module_names())
    return out


def _block_scales(layer):
    """An NVFP4 layer's block scales, which `export` always makes; a layer without them
    was built by hand and cannot be written."""
    if layer.block_scales is None:
        raise ValueError(
            f"Layer `{layer.name}` has no NVFP4 block scales: build its row form with "
            "`export` (the NVFP4 codec's plan), not by hand."
        )
    return layer.block_scales
