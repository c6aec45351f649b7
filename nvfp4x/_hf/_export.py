"""`export_hf`: a frozen model written as Model Optimizer's unified Hugging Face
checkpoint. The plan names every tensor, each entry's codec gives its tensors (and, for
quantised layers, the records that fused layers reconcile), and the files are swapped
in whole."""

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._files import MAX_JSON_BYTES, load_json, read_regular, recover_folder, write_folder
from ._codecs import ALGOS, Layer, codec_for, unquantised_layers
from ._folder import CONFIG, HF_QUANT_CONFIG, INDEX, WEIGHTS
from ._modelopt import config_json_block, hf_quant_config
from ._names import NamesLike
from ._plan import plan
from ._safetensors import CONFIG_CHECKSUM_KEY, digest, serialise

#: Projections a serving stack fuses into one GEMM with one `weight_scale_2`, by the last
#: component of their checkpoint names (vLLM's `packed_modules_mapping` for Llama-style
#: models: `qkv_proj` and `gate_up_proj`).
FUSED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


def _fused_groups(names: Sequence[str]) -> dict[tuple[str, str], list[str]]:
    groups: dict[tuple[str, str], list[str]] = {}
    for name in names:
        parent, _, last = name.rpartition(".")
        if last in FUSED:
            groups.setdefault((parent, FUSED[last]), []).append(name)
    return {k: v for k, v in groups.items() if len(v) > 1}


def _check_fused(
    layers: dict[str, Layer], unquantised: set[str], requantize_fused: bool, who: str
) -> None:
    """Serving stacks fuse q/k/v and gate/up into one GEMM: one precision, one tensor
    scale (vLLM takes the largest `weight_scale_2` without rescaling the block scales)."""
    changed = []
    for (parent, fused), members in sorted(_fused_groups([*layers, *unquantised]).items()):
        algos = {n: layers[n].algo.name if n in layers else "unquantised" for n in members}
        if len(set(algos.values())) > 1:
            listed = ", ".join(f"`{n}` ({a})" for n, a in algos.items())
            raise ValueError(
                f"{who}: serving stacks fuse {listed} into one layer `{parent}.{fused}`, and "
                "refuse shards of different precision (vLLM: 'Detected some but not all "
                "shards ... are quantized'). Give these layers one recipe in the policy."
            )
        if algos[members[0]] == "unquantised":
            continue
        group = [layers[n] for n in members]
        scales = {g.tensor_scale.tobytes() for g in group}
        if group[0].input_amax is not None:  # one static activation scale: the largest
            amax = np.float32(max(g.input_amax for g in group if g.input_amax is not None))
            for g in group:
                g.input_amax = amax
        if len(scales) == 1:
            continue
        listed = ", ".join(f"`{g.name}` ({float(g.tensor_scale):.6g})" for g in group)
        if not requantize_fused:
            raise ValueError(
                f"{who}: serving stacks fuse {listed} into one layer `{parent}.{fused}` with "
                "one tensor scale (vLLM takes the largest `weight_scale_2` without rescaling "
                "the block scales), but their tensor scales differ, so the served weights "
                "would not be these. Freeze with shared tensor scales: quantise with "
                '`nvfp4x.Policy(..., tensor_scale_groups=[r"(.*)\\.attn\\.w[qkv]", '
                'r"(.*)\\.mlp\\.w_(gate|up)"])` (your model\'s paths), or pass '
                "`requantize_fused=True` to requantise them to the largest scale here."
            )
        top = max(g.tensor_scale for g in group)
        for g in group:
            if g.tensor_scale != top:
                layers[g.name] = g.codec.requantize(g, top)
                changed.append(f"`{g.name}` (of `{g.module}`)")
    if changed:
        warnings.warn(
            f"nvfp4x.export_hf: requantised {', '.join(changed)} to the largest tensor scale "
            "of their fused group (1x16 blocks); the checkpoint's weights of these layers "
            "differ from the frozen model's. Quantise with `Policy(..., "
            "tensor_scale_groups=...)` to export them exactly.",
            UserWarning,
            stacklevel=3,
        )


def _check_input_amax(input_amax: Any, who: str) -> dict:
    if input_amax is None:
        return {}
    if not isinstance(input_amax, Mapping):
        raise TypeError(
            f"{who}: `input_amax` must be a dict (layer path -> activation amax), got "
            f"{type(input_amax).__name__}."
        )
    out = {}
    for path, value in input_amax.items():
        try:
            amax = np.asarray(value, np.float32)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{who}: `input_amax[{path!r}]` is not a number: {value!r}.") from e
        if amax.ndim > 1 or not np.all(np.isfinite(amax)) or np.any(amax < 0):
            raise ValueError(
                f"{who}: `input_amax[{path!r}]` must be a finite amax >= 0 (one per slice of "
                f"a stacked layer), got {value!r}."
            )
        out[path] = amax
    return out


def export_hf(
    frozen_model: Any,
    directory: str | os.PathLike,
    *,
    names: NamesLike,
    input_amax: Mapping[str, Any] | None = None,
    weight_only: bool = False,
    requantize_fused: bool = False,
    hf_config: Mapping[str, Any] | None = None,
) -> None:
    """Write a frozen model as NVIDIA Model Optimizer's unified Hugging Face checkpoint,
    the NVFP4 format vLLM, SGLang and TensorRT-LLM serve: `model.safetensors` (tensors
    named as the original model's), `hf_quant_config.json`, and the `quantization_config`
    of `config.json`.

    Per NVFP4 layer `<name>`: `<name>.weight` (uint8 `[out, in/2]`, element `2i` in the
    low nibble), `<name>.weight_scale` (float8_e4m3fn `[out, in/16]`; a 16x16 tile's
    scale is repeated over its 16 rows), `<name>.weight_scale_2` (float32 `[]`: the
    frozen weight's `tensor_scale`, bit for bit; not recomputed as `amax / 2688`, which
    differs in the last bit for about a quarter of tensors) and, for W4A4,
    `<name>.input_scale` (float32 `[]`). Decoded by the spec's formula, every tensor gives
    the frozen weight's values bit for bit. Every other array (embeddings, norms, biases,
    layers kept in bf16 or float32) is written in its dtype; linear layers not in NVFP4
    are listed in `exclude_modules`. Each tensor's sha256 goes into the safetensors
    metadata, which [`nvfp4x.import_hf`][] verifies.

    The export replaces the previous one in `directory` as a whole or not at all: the
    files are written (and fsynced) into a new sibling folder holding the folder's other
    files too (hard links), which is then swapped with `directory` in one atomic rename
    (Linux, macOS). A reader (a serving stack, `import_hf`) sees the old export or the
    new one, never the weights of one with the configs of the other, also if the export
    is killed; what a killed export left is removed by the next. On a file system
    without an atomic swap it takes two renames (a reader may find no folder for a
    moment, never a mix; a kill between them is undone by the next export). Where no
    rename can do it (Windows, `directory` a mount point, its parent not writable) the
    files are written in place one at a time, with a `UserWarning`.

    Serving stacks fuse q/k/v and gate/up projections (checkpoint names ending in
    `q_proj`/`k_proj`/`v_proj`, `gate_proj`/`up_proj` under one parent) into one GEMM
    with one tensor scale, so those layers must share theirs: freeze with the policy's
    `tensor_scale_groups` (see [`nvfp4x.Policy`][]). Their precisions must agree too.

    **Arguments:**

    - `frozen_model`: a model from [`nvfp4x.freeze`][]; NVFP4 weights need a multiple of
      16 input features. Weights frozen in MXFP8 or FP8 are refused.
    - `directory`: the output folder (created if needed; may already hold the original
      model's `config.json` and tokenizer files, which are kept).
    - `names`: nvfp4x module paths (`blocks[3].attn.wq`) to checkpoint module names
      (`model.layers.3.self_attn.q_proj`): a dict, a callable returning a name, or a
      ready map such as `nvfp4x.hf_names.llama`. A name containing `{i}` marks a stacked
      module (`eqx.filter_vmap`-built): one tensor per slice of its leading axis. A
      module the map does not name is an error.
    - `input_amax`: W4A4: `{layer path: amax}`, the calibrated activation amax of every
      layer whose recipe quantises activations to NVFP4 (nvfp4x scales them per call;
      the checkpoint needs a static `input_scale`, written as the NVFP4 tensor decode
      scale of this amax). One value, or one per slice of a stacked layer. Fused layers
      get their group's largest. Such layers without an entry are an error.
    - `weight_only`: write every NVFP4 layer as weights-only (`W4A16_NVFP4`, no
      `input_scale`), whatever its recipe does with activations.
    - `requantize_fused`: where fused layers' tensor scales differ, requantise their
      decoded weights (1x16 blocks) to the group's largest scale, with a `UserWarning`
      naming them, instead of refusing.
    - `hf_config`: the original model's `config.json` contents; written with the
      `quantization_config` added. Without it, a `config.json` already in `directory`
      gets its `quantization_config` replaced, and none is written otherwise.

    **Returns:** nothing.

    Raises `ValueError` (naming the layer or tensor and the fix) for an unnamed module,
    two modules with one name, a training model, W4A4 layers without `input_amax`,
    fused layers with different scales or precisions, no NVFP4 layer, or stray weight
    files in `directory`; `TypeError` for a malformed `names` or `input_amax`.

    ```python
    policy = nvfp4x.Policy(
        [(r"lm_head", None), (r".*", nvfp4x.recipes.nvfp4_weight_only())],
        tensor_scale_groups=[r"(.*)\\.attn\\.w[qkv]", r"(.*)\\.mlp\\.w_(gate|up)"],
    )
    frozen = nvfp4x.freeze(nvfp4x.quantize(model, policy))
    nvfp4x.export_hf(frozen, "out/my-model-nvfp4", names=nvfp4x.hf_names.llama)
    ```
    """
    who = "nvfp4x.export_hf"
    directory = os.fspath(directory)
    amaxes = _check_input_amax(input_amax, who)
    if weight_only and amaxes:
        raise ValueError(
            f"{who}: `input_amax` makes W4A4 layers; it contradicts `weight_only=True`."
        )
    entries, _, _ = plan(frozen_model, names, who)
    tensors: dict[str, np.ndarray] = {}
    layers: dict[str, Layer] = {}
    quantised_modules = set()
    for e in entries:
        codec = codec_for(e, who)
        plain, quantised = codec.export(e, weight_only, amaxes, who)
        tensors.update(plain)
        if codec.quantised:
            quantised_modules.add(e.module)
        layers.update((layer.name, layer) for layer in quantised)
    unknown = sorted(set(amaxes) - quantised_modules)
    if unknown:
        raise ValueError(
            f"{who}: `input_amax` names {unknown}, which are not NVFP4 layers of the model."
        )
    if not layers:
        raise ValueError(
            f"{who}: the model holds no NVFP4 layer (frozen with an NVFP4 recipe); there "
            "is nothing to write as an NVFP4 checkpoint."
        )
    unquantised = unquantised_layers(frozen_model, entries)
    _check_fused(layers, unquantised, requantize_fused, who)
    for layer in layers.values():
        tensors.update(layer.codec.tensors(layer))

    hf_quant = hf_quant_config({n: g.algo for n, g in layers.items()}, unquantised)
    hf_quant_bytes = (json.dumps(hf_quant, indent=4) + "\n").encode()
    recover_folder(directory)  # a previous export killed half-way through its swap
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"{who}: `{directory}` is a file, not a folder; export into a folder.")
    existing = os.listdir(directory) if os.path.isdir(directory) else []
    stray = sorted(
        f for f in existing if (f.endswith(".safetensors") and f != WEIGHTS) or f == INDEX
    )
    if stray:
        raise ValueError(
            f"{who}: `{directory}` already holds {stray}, weights of another checkpoint that "
            "loaders would read with these. Export into a folder without them."
        )
    config_path = os.path.join(directory, CONFIG)
    if hf_config is None and CONFIG in existing:
        hf_config = load_json(
            read_regular(config_path, max_bytes=MAX_JSON_BYTES), f"`{config_path}`"
        )
        if not isinstance(hf_config, dict):
            raise ValueError(f"{who}: `{config_path}` is not a JSON object; pass `hf_config`.")
    files = {
        WEIGHTS: serialise(tensors, {"format": "pt", CONFIG_CHECKSUM_KEY: digest(hf_quant_bytes)}),
        HF_QUANT_CONFIG: hf_quant_bytes,
    }
    if hf_config is not None:
        config = {**dict(hf_config), "quantization_config": config_json_block(hf_quant, ALGOS)}
        files[CONFIG] = (json.dumps(config, indent=2) + "\n").encode()
    # Written into a new folder swapped in whole: a reader (a serving stack, import_hf)
    # sees the previous export or this one, never weights of one with configs of another.
    write_folder(directory, files)
