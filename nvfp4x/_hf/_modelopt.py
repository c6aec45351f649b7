"""NVIDIA Model Optimizer's quantisation config: `hf_quant_config.json` and the
`quantization_config` of `config.json`, read (checked against the `quant_algo`s the
codecs know) and written. The algorithms themselves (`Algo`) belong to the codecs."""

import dataclasses
import fnmatch
import importlib.metadata
from collections.abc import Mapping
from typing import Any

from .._files import shown
from ._folder import CONFIG, HF_QUANT_CONFIG, Folder

#: The `quant_algo` of a checkpoint whose layers have different algorithms.
MIXED = "MIXED_PRECISION"


@dataclasses.dataclass(frozen=True)
class Algo:
    """A `quant_algo` of Model Optimizer's config, as a codec writes and reads it."""

    name: str  # as the config spells it, e.g. "NVFP4"
    label: str  # what it is, for messages: "W4A4"
    group_size: int | None  # elements per block scale (None: no blocks)
    weights: Mapping[str, Any]  # its `config_groups` entries in `config.json`...
    input_activations: Mapping[str, Any] | None  # ... (None: activations not quantised)
    recipes: str  # the recipes that hold it, for messages: "e.g. `nvfp4_inference`"

    def group_config(self) -> dict:
        """Its entry of `config.json`'s `config_groups` (without `targets`)."""
        weights = dict(self.weights)
        if self.input_activations is None:
            return {"weights": weights}
        return {"input_activations": dict(self.input_activations), "weights": weights}


@dataclasses.dataclass
class QuantConfig:
    """A checkpoint's quantisation config, as read."""

    file: str
    algo: str  # a codec's `quant_algo`, or MIXED
    exclude: list[str]
    layers: dict[str, str] | None  # MIXED: checkpoint module name -> algo
    producer: str | None  # `producer.name` ("nvfp4x" for `export_hf`'s files)

    def algo_of(self, name: str) -> str | None:
        """The layer's `quant_algo`, None for a layer kept unquantised."""
        if self.layers is not None:
            return self.layers.get(name)
        return None if _excluded(name, self.exclude) else self.algo


def _excluded(name: str, patterns: list[str]) -> bool:
    """Whether a layer is excluded, as vLLM's `ModelOptQuantConfigBase.is_layer_excluded`
    decides it: an exact name, a substring (older Model Optimizer lists) or a wildcard."""
    return any(p == name or p in name or fnmatch.fnmatchcase(name, p) for p in patterns)


_UNSUPPORTED_HINTS = (
    (
        "AWQ",
        "AWQ checkpoints scale activations by a per-channel `pre_quant_scale` that "
        "nvfp4x layers do not apply",
    ),
    ("SVD", "SVDQuant checkpoints add a low-rank branch and a `pre_quant_scale`"),
    ("MXFP4", "MXFP4 has power-of-two E8M0 scales per 32 elements, not NVFP4's E4M3 scales per 16"),
    ("W4A8", "W4A8 checkpoints scale weights for FP8 activations (`weight_scale_2` = amax/448)"),
    ("FP8", "FP8 checkpoints hold E4M3 weights, not NVFP4"),
    ("INT", "integer quantisation is not NVFP4"),
    ("W8", "integer quantisation is not NVFP4"),
)


def _check_algo(algo: Any, file: str, known: Mapping[str, Algo], where: str = "") -> Algo:
    text = str(algo).upper() if algo is not None else "None"
    if text in known:
        return known[text]
    hint = next((h for key, h in _UNSUPPORTED_HINTS if key in text), "it is not NVFP4")
    reads = " and ".join(
        f"`{a.name}` ({a.label}" + (f", group size {a.group_size})" if a.group_size else ")")
        for a in known.values()
    )
    raise ValueError(
        f"`{file}`{where}: unsupported quantisation `quant_algo: {text}` ({hint}). nvfp4x "
        f"reads {reads} checkpoints, and `{MIXED}` ones made of them."
    )


def _check_group_size(
    size: Any, file: str, algos: Mapping[str, Algo] | Algo, where: str = ""
) -> None:
    """`size` must be the group size of `algos` (one algorithm, or any of several)."""
    allowed = {a.group_size for a in ([algos] if isinstance(algos, Algo) else algos.values())}
    if size is not None and (isinstance(size, bool) or not isinstance(size, int)):
        raise ValueError(
            f"`{file}`{where}: `group_size` is {shown(size)}, not an integer; write it as a "
            "number (NVFP4: `group_size: 16`)."
        )
    if size is not None and size not in allowed:
        sizes = " or ".join(str(g) for g in sorted(g for g in allowed if g is not None))
        raise ValueError(
            f"`{file}`{where}: unsupported `group_size: {size}`; nvfp4x reads group size "
            f"{sizes} only (NVFP4: one block scale per 16 elements)."
        )


def _producer(raw: Any) -> str | None:
    producer = raw.get("producer") if isinstance(raw, dict) else None
    return producer.get("name") if isinstance(producer, dict) else None


def read_quant_config(folder: Folder, known: Mapping[str, Algo]) -> QuantConfig:
    """The config of the checkpoint in `folder`, its algorithms among `known`."""
    directory = folder.directory
    hq = folder.path(HF_QUANT_CONFIG)
    cj = folder.path(CONFIG)
    if folder.exists(HF_QUANT_CONFIG):
        file, raw = hq, folder.json(HF_QUANT_CONFIG)
        q = raw.get("quantization") if isinstance(raw, dict) else None
        if not isinstance(q, dict):
            raise ValueError(f"`{hq}` has no `quantization` object (not a Model Optimizer config).")
        algo, kv, group_size = (
            q.get("quant_algo"),
            q.get("kv_cache_quant_algo"),
            q.get("group_size"),
        )
        exclude, per_layer = q.get("exclude_modules") or [], q.get("quantized_layers")
        producer = _producer(raw)
    else:
        raw = folder.json(CONFIG) if folder.exists(CONFIG) else {}
        q = raw.get("quantization_config") if isinstance(raw, dict) else None
        if not isinstance(q, dict):
            raise ValueError(
                f"`{directory}` holds neither `{HF_QUANT_CONFIG}` nor a `{CONFIG}` with a "
                "`quantization_config`: not a quantised Hugging Face checkpoint."
            )
        file = cj
        producer = _producer(q)
        method = str(q.get("quant_method", ""))
        if not method.lower().startswith("modelopt"):
            raise ValueError(
                f"`{cj}`: unsupported quantisation method `quant_method: {method}`; nvfp4x "
                "reads NVIDIA Model Optimizer's NVFP4 checkpoints (`quant_method: modelopt`)."
            )
        algo, kv = q.get("quant_algo"), q.get("kv_cache_scheme")
        exclude, per_layer = q.get("ignore") or [], q.get("quantized_layers")
        sizes = {
            (g.get("weights") or {}).get("group_size")
            for g in (q.get("config_groups") or {}).values()
            if isinstance(g, dict)
        }
        group_size = q.get("group_size")
        if str(algo).upper() != MIXED:
            _check_algo(algo, file, known)
        for size in sizes:
            _check_group_size(size, file, known)
    if kv is not None:
        raise ValueError(
            f"`{file}`: unsupported KV cache quantisation `{kv}`; nvfp4x models do not "
            "quantise attention's KV cache."
        )
    if not isinstance(exclude, list) or not all(isinstance(p, str) for p in exclude):
        raise ValueError(f"`{file}`: the excluded modules must be a list of names.")
    text = str(algo).upper() if algo is not None else "None"
    if text == MIXED:
        if not isinstance(per_layer, dict):
            raise ValueError(f"`{file}`: `{MIXED}` without a `quantized_layers` map.")
        layers = {}
        for name, cfg in per_layer.items():
            if not isinstance(cfg, dict):
                raise ValueError(f"`{file}`: `quantized_layers.{name}` is not an object.")
            where = f" (layer `{name}`)"
            one = _check_algo(cfg.get("quant_algo"), file, known, where)
            _check_group_size(cfg.get("group_size"), file, one, where)
            if cfg.get("pre_quant_scale"):
                _check_algo(f"{cfg.get('quant_algo')}_AWQ", file, known, where)
            layers[name] = one.name
        return QuantConfig(file, MIXED, exclude, layers, producer)
    one = _check_algo(algo, file, known)
    _check_group_size(group_size, file, one)
    return QuantConfig(file, one.name, exclude, None, producer)


def check_config_json_agrees(
    folder: Folder, config: QuantConfig, known: Mapping[str, Algo]
) -> None:
    """A serving stack reads `config.json`'s `quantization_config` and nvfp4x reads
    `hf_quant_config.json`: where both files are present, `config.json` must hold that
    block and it must say what `hf_quant_config.json` says, field by field (as Model
    Optimizer's `convert_hf_quant_config_format` derives it): `quant_method`,
    `quant_algo`, `kv_cache_scheme`, `ignore` (its `exclude_modules`), the MIXED
    per-layer map and every group size. A disagreement raises `ValueError` naming both
    files and the field."""
    if not (config.file.endswith(HF_QUANT_CONFIG) and folder.exists(CONFIG)):
        return
    cj = folder.path(CONFIG)
    raw = folder.json(CONFIG)
    block = raw.get("quantization_config") if isinstance(raw, dict) else None
    q = folder.json(HF_QUANT_CONFIG)["quantization"]  # (read_quant_config checked it)

    def disagree(field: str, theirs: Any, ours: Any, our_field: str = "", why: str = ""):
        if str(theirs) == str(ours) or isinstance(theirs, str) != isinstance(ours, str):
            theirs, ours = shown(theirs), shown(ours)  # `"16"` and 16: say which is which
        return ValueError(
            f"`{cj}` says `{field}: {theirs}` but `{config.file}` says "
            f"`{our_field or field}: {ours}`{why}: "
            "the two configs of one checkpoint disagree (a serving stack reading "
            f"`{CONFIG}` would run another quantisation than nvfp4x loads). Export it again."
        )

    if not isinstance(block, dict):
        raise ValueError(
            f"`{cj}` has no `quantization_config` object but `{config.file}` says "
            f"`quant_algo: {config.algo}`: the two configs of one checkpoint disagree (a "
            f"serving stack reading `{CONFIG}` would run the model unquantised). Export it "
            "again."
        )
    method = block.get("quant_method")
    if not str(method).lower().startswith("modelopt"):
        raise disagree("quant_method", method, "modelopt (a Model Optimizer config)")
    theirs = block.get("quant_algo")
    if str(theirs).upper() != config.algo:
        raise disagree("quant_algo", theirs, config.algo)
    if block.get("kv_cache_scheme") is not None:
        raise disagree("kv_cache_scheme", block.get("kv_cache_scheme"), None)
    ignore = block.get("ignore") or []
    if not isinstance(ignore, list) or set(map(str, ignore)) != set(config.exclude):
        listed = set(map(str, ignore)) if isinstance(ignore, list) else {str(ignore)}
        why = f" (they differ in {sorted(listed ^ set(config.exclude))[:3]})"
        raise disagree("ignore", ignore, config.exclude, "exclude_modules", why)
    if config.layers is not None and block.get("quantized_layers") != q.get("quantized_layers"):
        theirs_map = block.get("quantized_layers")
        theirs_map = theirs_map if isinstance(theirs_map, dict) else {}
        ours_map = q.get("quantized_layers") or {}
        name = next(
            (
                n
                for n in sorted(set(theirs_map) | set(ours_map))
                if theirs_map.get(n) != ours_map.get(n)
            ),
            "?",
        )
        raise disagree(f"quantized_layers.{name}", theirs_map.get(name), ours_map.get(name))
    for group_name, group in (block.get("config_groups") or {}).items():
        if not isinstance(group, dict):
            continue
        size = (group.get("weights") or {}).get("group_size")
        if config.layers is None:
            want = {known[config.algo].group_size}
        else:
            targets = group.get("targets") or []
            want = {known[config.layers[t]].group_size for t in targets if t in config.layers}
        if size is not None and want and size not in want:
            field = f"config_groups.{group_name}.weights.group_size"
            sizes = sorted(str(g) for g in want)
            ours = next(iter(want)) if len(want) == 1 else " or ".join(sizes)
            raise disagree(field, size, ours)
    size = block.get("group_size")
    if size is not None and config.layers is None and size != known[config.algo].group_size:
        raise disagree("group_size", size, known[config.algo].group_size)


def hf_quant_config(layers: Mapping[str, Algo], exclude: set[str]) -> dict:
    """`hf_quant_config.json` as Model Optimizer's `get_quant_config` writes it, for the
    quantised `layers` (checkpoint module name -> its algorithm) and the linear layers
    kept unquantised (`exclude`)."""
    try:
        version = importlib.metadata.version("nvfp4x")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - source tree
        version = "0.0.0"
    kinds = {a.name: a for a in layers.values()}
    quantization: dict[str, Any] = {"quant_algo": None, "kv_cache_quant_algo": None}
    if len(kinds) == 1:
        (one,) = kinds.values()
        quantization["quant_algo"] = one.name
        if one.group_size is not None:
            quantization["group_size"] = one.group_size
        quantization["exclude_modules"] = sorted(exclude)
    else:
        quantization["quant_algo"] = MIXED
        quantization["quantized_layers"] = {
            name: _layer_entry(algo) for name, algo in sorted(layers.items())
        }
    return {"producer": {"name": "nvfp4x", "version": version}, "quantization": quantization}


def _layer_entry(algo: Algo) -> dict:
    entry: dict[str, Any] = {"quant_algo": algo.name}
    if algo.group_size is not None:
        entry["group_size"] = algo.group_size
    return entry


def config_json_block(hf_quant: dict, known: Mapping[str, Algo]) -> dict:
    """The `quantization_config` of `config.json`, as Model Optimizer's
    `convert_hf_quant_config_format` derives it from `hf_quant_config.json`."""
    q = hf_quant["quantization"]
    out: dict[str, Any] = {}
    if q["quant_algo"] == MIXED:
        by_algo: dict[str, list[str]] = {}
        for name, cfg in q["quantized_layers"].items():
            by_algo.setdefault(cfg["quant_algo"], []).append(name)
        out["config_groups"] = {
            f"group_{i}": {**known[algo].group_config(), "targets": sorted(layers)}
            for i, (algo, layers) in enumerate(sorted(by_algo.items()))
        }
        out["quantized_layers"] = q["quantized_layers"]
    else:
        out["config_groups"] = {
            "group_0": {**known[q["quant_algo"]].group_config(), "targets": ["Linear"]}
        }
    out["ignore"] = q.get("exclude_modules") or []
    out["quant_algo"] = q["quant_algo"]
    out["producer"] = hf_quant["producer"]
    out["quant_method"] = "modelopt"
    return out
