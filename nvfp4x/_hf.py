"""Checkpoints that serving stacks read: `export_hf` / `import_hf` write and read the
"unified Hugging Face checkpoint" of NVIDIA's Model Optimizer (safetensors files, tensor
names aligned with the original model's, `hf_quant_config.json`), which vLLM, SGLang and
TensorRT-LLM load for NVFP4.

Per NVFP4 linear layer `<name>` (docs page "Deploying NVFP4 models" has the sources):

- `<name>.weight`: uint8 `[out, in/2]`, two E2M1 codes per byte, element `2i` in the low
  nibble (nvfp4x's packing, unchanged);
- `<name>.weight_scale`: float8_e4m3fn `[out, in/16]`, one decode scale per 16 inputs,
  row-major and unswizzled (a 16x16 tile's scale is repeated over its 16 rows);
- `<name>.weight_scale_2`: float32 `[]`, the tensor decode scale (nvfp4x's
  `tensor_scale`, bit for bit);
- `<name>.input_scale`: float32 `[]`, the activations' static tensor decode scale
  (W4A4, `quant_algo: NVFP4`); absent for weights-only layers (`W4A16_NVFP4`).

Everything else (embeddings, norms, layers kept out of NVFP4) is written in its dtype.
"""

import dataclasses
import fnmatch
import hashlib
import importlib.metadata
import itertools
import json
import math
import os
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ._array import NVFP4Array, to_nvfp4
from ._files import MAX_JSON_BYTES, load_json, read_regular, recover_folder, write_folder
from ._frozen import FrozenWeight
from ._numerics._constants import BLOCK, NVFP4_RANGE
from ._numerics._nvfp4 import tensor_scales
from ._packed import PackedArray
from ._qweight import QWeight
from ._sites import is_weight, layers as site_layers, path_str

#: NVFP4's group size: elements per block scale along the input features.
GROUP_SIZE = BLOCK
HF_QUANT_CONFIG = "hf_quant_config.json"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: Safetensors metadata keys nvfp4x writes (string -> string, as the format requires).
CHECKSUMS_KEY = "nvfp4x.sha256"
CONFIG_CHECKSUM_KEY = "nvfp4x.hf_quant_config.sha256"
#: Quantisation algorithms (`quant_algo`) nvfp4x reads and writes.
W4A4 = "NVFP4"
W4A16 = "W4A16_NVFP4"
MIXED = "MIXED_PRECISION"
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

#: Safetensors dtype codes and their numpy dtypes.
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_CODES = {dtype: code for code, dtype in DTYPES.items()}


# --- names: nvfp4x module paths -> checkpoint module names ---


class NameRules:
    """A names map made of `(regex, template)` rules: the first regex that matches a
    module path (`re.fullmatch`) gives its checkpoint name, `match.expand(template)`
    (so `\\1` is the first capture group). A template holding `{i}` names a stacked
    module (built with `eqx.filter_vmap`, a leading layer axis): one tensor per slice,
    `{i}` replaced by the slice's index. Calling it on a path no rule matches returns None.

    Make one with [`nvfp4x.hf_names.rules`][]; `nvfp4x.hf_names.llama` is one.
    """

    def __init__(self, rules: Sequence[tuple[str, str]]):
        compiled = []
        for i, rule in enumerate(rules):
            if not (isinstance(rule, tuple | list) and len(rule) == 2):
                raise TypeError(f"Names rule {i} must be a `(regex, template)` pair, got {rule!r}.")
            pattern, template = rule
            if not isinstance(template, str):
                raise TypeError(
                    f"Names rule {i} (`{pattern}`): the template must be a string, got "
                    f"{type(template).__name__}."
                )
            try:
                compiled.append((re.compile(pattern), template))
            except (re.error, TypeError) as e:
                raise ValueError(
                    f"Names rule {i}: regex `{pattern!r}` does not compile: {e}."
                ) from e
        self.rules = tuple(compiled)

    def __call__(self, path: str) -> str | None:
        for regex, template in self.rules:
            m = regex.fullmatch(path)
            if m:
                return m.expand(template)
        return None

    def __repr__(self) -> str:
        return f"NameRules({[(r.pattern, t) for r, t in self.rules]})"


def _llama_rules() -> list[tuple[str, str]]:
    top = [
        (r"embed", "model.embed_tokens"),
        (r"norm", "model.norm"),
        (r"lm_head", "lm_head"),
    ]
    per_block = [
        (r"attn_norm", "input_layernorm"),
        (r"mlp_norm", "post_attention_layernorm"),
        (r"attn\.wq", "self_attn.q_proj"),
        (r"attn\.wk", "self_attn.k_proj"),
        (r"attn\.wv", "self_attn.v_proj"),
        (r"attn\.wo", "self_attn.o_proj"),
        (r"mlp\.w_gate", "mlp.gate_proj"),
        (r"mlp\.w_up", "mlp.up_proj"),
        (r"mlp\.w_down", "mlp.down_proj"),
    ]
    rules = list(top)
    for field, hf in per_block:
        rules.append((rf"blocks\[(\d+)\]\.{field}", rf"model.layers.\1.{hf}"))
        rules.append((rf"blocks\.{field}", "model.layers.{i}." + hf))
    return rules


class hf_names:  # noqa: N801 - a namespace, used as `nvfp4x.hf_names.llama`
    """Ready names maps for [`nvfp4x.export_hf`][] / [`nvfp4x.import_hf`][], and a
    builder for others.

    - `hf_names.llama`: the Llama-style model of `examples/train_lm.py` (fields `embed`,
      `blocks[i].attn_norm`, `blocks[i].attn.wq/wk/wv/wo`, `blocks[i].mlp_norm`,
      `blocks[i].mlp.w_gate/w_up/w_down`, `norm`, `lm_head`) named as Hugging Face's
      `LlamaForCausalLM` names its modules (`model.embed_tokens`,
      `model.layers.i.input_layernorm`, `model.layers.i.self_attn.q_proj`,
      `model.layers.i.post_attention_layernorm`, `model.layers.i.mlp.gate_proj`,
      `model.norm`, `lm_head`). Blocks stacked with `eqx.filter_vmap` (paths
      `blocks.attn.wq`, one leading layer axis) map to `model.layers.{i}.…`: one tensor
      per layer.

    ```python
    nvfp4x.hf_names.llama("blocks[3].attn.wq")   # 'model.layers.3.self_attn.q_proj'
    nvfp4x.hf_names.llama("blocks.mlp.w_up")     # 'model.layers.{i}.mlp.up_proj'
    ```
    """

    llama = NameRules(_llama_rules())

    @staticmethod
    def rules(rules: Sequence[tuple[str, str]]) -> NameRules:
        """A names map from `(regex, template)` rules on module paths.

        **Arguments:**

        - `rules`: pairs; the first regex that matches a module path (`re.fullmatch`)
          gives its checkpoint name, `match.expand(template)` (`\\1` is the first
          capture group). `{i}` in a template marks a stacked module: one tensor per
          slice of its leading axis, `{i}` replaced by the index.

        **Returns:** a callable `path -> name | None` (None where no rule matches, which
        `export_hf` / `import_hf` report as an error naming the path).

        ```python
        names = nvfp4x.hf_names.rules([
            (r"layers\\[(\\d+)\\]\\.fc1", r"model.layers.\\1.mlp.up_proj"),
            (r"head", "lm_head"),
        ])
        ```
        """
        return NameRules(rules)


NamesLike = Mapping[str, str] | Callable[[str], Any]


def _namer(names: Any) -> Callable[[str], Any]:
    if isinstance(names, Mapping):
        return names.get
    if callable(names):
        return names
    raise TypeError(
        f"`names` must be a dict (module path -> checkpoint name), a callable, or a ready "
        f"map such as `nvfp4x.hf_names.llama`; got {type(names).__name__}."
    )


# --- the model's tensors, in checkpoint terms ---


@dataclasses.dataclass
class _Entry:
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


def _stack_of(leaf: Any) -> int:
    """Leading stacked axes of a quantised weight (0 for a plain 2-D weight)."""
    packed = leaf.packed
    if isinstance(packed, NVFP4Array):
        return packed.tensor_scale.ndim
    return len(packed.shape) - 2


def _plan(model: Any, names: Any, who: str) -> tuple[list[_Entry], Any, list]:
    """The model's entries, its treedef and flat leaves (weights as `FrozenWeight`s)."""
    name_of = _namer(names)
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
            if leaf.master is not None:
                raise ValueError(
                    f"{who}: `{path}` is tied to an embedding (it keeps its master values "
                    "for the lookup, `FrozenWeight.master`); the checkpoint format holds one "
                    "tensor per weight, and serving stacks keep a tied LM head unquantised. "
                    f"Leave `{leaf.path}` out of the NVFP4 policy, or write the model with "
                    "`nvfp4x.save`, which keeps both."
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
            nstack = _stack_of(leaf)
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
            stack = leaf.packed.shape[0] if nstack else None
        elif stacked:
            if len(leaf.shape) == 0:
                raise ValueError(
                    f"{who}: `{path}` is a scalar but its checkpoint name `{template}` has the "
                    "`{i}` placeholder of a stacked tensor."
                )
            stack = leaf.shape[0]
        else:
            stack = None
        entry = _Entry(index, module, attr, template, leaf, stack)
        for name in entry.tensor_names():
            if name in seen:
                raise ValueError(
                    f"{who}: `{path}` and `{seen[name]}` both map to the checkpoint tensor "
                    f"`{name}`; the names map must give every module its own name."
                )
            seen[name] = path
        entries.append(entry)
    return entries, treedef, [leaf for _, leaf in flat]


def _unquantised_layers(model: Any, entries: list[_Entry]) -> set[str]:
    """Checkpoint names of the linear layers whose weight is not NVFP4 (excluded)."""
    by_module = {e.module: e for e in entries if e.attr == "weight"}
    out = set()
    for path, layer in site_layers(model):
        weight = layer.weight
        if isinstance(weight, FrozenWeight) and isinstance(weight.packed, NVFP4Array):
            continue
        entry = by_module.get(path)
        if entry is not None:
            out.update(entry.module_names())
    return out


# --- safetensors, read and written ---


@dataclasses.dataclass
class _Tensor:
    """A tensor of a safetensors file: dtype code, shape and its raw bytes."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    data: memoryview

    def array(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=DTYPES[self.dtype]).reshape(self.shape)

    def bits(self) -> np.ndarray:
        """The raw bytes as uint8 of the tensor's shape (for 8-bit types)."""
        return np.frombuffer(self.data, dtype=np.uint8).reshape(self.shape)


def _read_safetensors(path: str, raw: bytes) -> tuple[dict[str, _Tensor], dict[str, str]]:
    """Parse the safetensors file `raw` (read from `path`) by hand (8-byte little-endian
    header length, JSON header, raw little-endian bytes): the `safetensors` numpy loader
    cannot read F8_E4M3. The header is checked as strictly as the safetensors library
    checks it: a plausible length, tensors that tile the payload from its first byte to
    its last in offset order (no overlap, no gap, no trailing bytes), each spanning the
    bytes of its dtype and shape."""
    data = memoryview(raw)
    size = len(data)
    if size < 8:
        raise ValueError(f"`{path}` is truncated: {size} bytes, shorter than a safetensors header.")
    n = int.from_bytes(data[:8], "little")
    if n > MAX_JSON_BYTES:
        raise ValueError(
            f"`{path}`: the safetensors header claims {n:,} bytes, more than the "
            f"{MAX_JSON_BYTES:,} allowed (corrupted, or not a safetensors file)."
        )
    if 8 + n > size:
        raise ValueError(
            f"`{path}` is truncated: its header claims {n} bytes but the file has {size} in "
            "all. Copy or export the checkpoint again."
        )
    header = load_json(bytes(data[8 : 8 + n]), f"`{path}`: the safetensors header")
    if not isinstance(header, dict):
        raise ValueError(f"`{path}`: the safetensors header is not a JSON object (corrupted).")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise ValueError(f"`{path}`: `__metadata__` must map strings to strings (corrupted).")
    body = data[8 + n :]
    spans = []
    for name, info in header.items():
        malformed = f"`{path}`: the header entry of tensor `{name}` is malformed (corrupted)."
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(malformed)
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not (isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2):
            raise ValueError(malformed)
        if not all(type(d) is int and d >= 0 for d in (*shape, *offsets)):
            raise ValueError(malformed)
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise ValueError(
                f"`{path}`: tensor `{name}` has dtype `{dtype}`, which nvfp4x does not read "
                f"(it reads {sorted(DTYPES)})."
            )
        spans.append((offsets[0], offsets[1], name, dtype, tuple(shape)))
    spans.sort()
    for begin, end, name, _, _ in spans:
        if end > len(body) or end < begin:
            raise ValueError(
                f"`{path}` is truncated: tensor `{name}` lies at bytes {begin}..{end} of a "
                f"payload of {len(body)}. Copy or export the checkpoint again."
            )
    for (_, before_end, before, _, _), (begin, end, name, _, _) in itertools.pairwise(spans):
        if begin < before_end:
            raise ValueError(
                f"`{path}`: tensor `{name}` at bytes {begin}..{end} overlaps tensor `{before}` "
                f"(which ends at {before_end}): corrupted or crafted header."
            )
    tensors = {}
    end_of_last = 0
    for begin, end, name, dtype, shape in spans:
        if begin != end_of_last:
            raise ValueError(
                f"`{path}`: tensor `{name}` at bytes {begin}..{end} leaves a gap of "
                f"{begin - end_of_last} bytes before it (the tensors must tile the payload, as "
                "the safetensors format requires): corrupted or crafted header."
            )
        if end - begin != math.prod(shape) * DTYPES[dtype].itemsize:
            raise ValueError(
                f"`{path}`: tensor `{name}` ({dtype} {list(shape)}) spans {end - begin} bytes, "
                "not the size of its shape (corrupted header)."
            )
        tensors[name] = _Tensor(path, dtype, shape, body[begin:end])
        end_of_last = end
    if end_of_last != len(body):
        raise ValueError(
            f"`{path}`: {len(body) - end_of_last} bytes after the last tensor belong to none "
            "(the safetensors format allows no trailing bytes): corrupted or crafted file."
        )
    _verify_checksums(path, tensors, metadata)
    return tensors, metadata


def _digest(data: Any) -> str:
    return hashlib.sha256(data).hexdigest()


def _verify_checksums(path: str, tensors: dict[str, _Tensor], metadata: dict[str, str]) -> None:
    """Check every tensor against the sha256 that `export_hf` recorded; files from other
    writers (Model Optimizer's) carry none and are read unverified."""
    recorded = metadata.get(CHECKSUMS_KEY)
    if recorded is None:
        return
    try:
        digests = json.loads(recorded)
    except ValueError as e:
        raise ValueError(f"`{path}`: the recorded checksums are not valid JSON (corrupted).") from e
    if not isinstance(digests, dict) or set(digests) != set(tensors):
        raise ValueError(
            f"`{path}`: the recorded checksums do not list the file's tensors (corrupted)."
        )
    for name, tensor in tensors.items():
        if _digest(tensor.data) != digests[name]:
            raise ValueError(
                f"`{path}`: tensor `{name}` fails its sha256 checksum (recorded at export): "
                "the file is corrupted. Export the checkpoint again."
            )


def _check_checksums_present(path: str, metadata: dict[str, str], config: "_QuantConfig") -> None:
    """Fail closed: a file nvfp4x wrote carries both of its checksum entries, so one
    without the other, or none where the config names nvfp4x as the producer, is a file
    whose metadata was damaged (a flipped byte in a key would otherwise switch the
    verification off), not a file from another writer."""
    has = [key in metadata for key in (CHECKSUMS_KEY, CONFIG_CHECKSUM_KEY)]
    if all(has):
        return
    if any(has):
        lost = CONFIG_CHECKSUM_KEY if has[0] else CHECKSUMS_KEY
        why = f"it has one of nvfp4x's two checksum entries but not `{lost}`"
    elif config.producer == "nvfp4x":
        why = f"`{config.file}` names nvfp4x as its producer, and nvfp4x records them"
    else:
        return  # another writer's file (Model Optimizer's): no checksums to verify
    raise ValueError(
        f"`{path}` carries no complete nvfp4x checksums, but {why}: its metadata is damaged "
        "and it cannot be verified. Export the checkpoint again, or restore it from a good "
        "copy."
    )


def _serialise(tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> bytes:
    try:  # an optional dependency: only writing needs it
        import safetensors.numpy
    except ImportError as e:  # pragma: no cover - the test extra installs it
        raise ImportError(
            "nvfp4x.export_hf writes with the `safetensors` package: `pip install "
            "'nvfp4x[hf]'` (or `pip install safetensors`)."
        ) from e

    digests = {name: _digest(np.ascontiguousarray(a).tobytes()) for name, a in tensors.items()}
    metadata = {**metadata, CHECKSUMS_KEY: json.dumps(digests, sort_keys=True)}
    return safetensors.numpy.save(tensors, metadata=metadata)


# --- the quantisation config ---


@dataclasses.dataclass
class _QuantConfig:
    file: str
    algo: str  # W4A4, W4A16 or MIXED
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


def _check_algo(algo: Any, file: str, where: str = "") -> str:
    text = str(algo).upper() if algo is not None else "None"
    if text in (W4A4, W4A16):
        return text
    hint = next((h for key, h in _UNSUPPORTED_HINTS if key in text), "it is not NVFP4")
    raise ValueError(
        f"`{file}`{where}: unsupported quantisation `quant_algo: {text}` ({hint}). nvfp4x "
        f"reads `{W4A4}` (W4A4) and `{W4A16}` checkpoints with group size {GROUP_SIZE}, "
        f"and `{MIXED}` ones made of them."
    )


def _check_group_size(size: Any, file: str, where: str = "") -> None:
    if size is not None and size != GROUP_SIZE:
        raise ValueError(
            f"`{file}`{where}: unsupported `group_size: {size}`; NVFP4 has one scale per "
            f"{GROUP_SIZE} elements, and nvfp4x reads group size {GROUP_SIZE} only."
        )


def _producer(raw: Any) -> str | None:
    producer = raw.get("producer") if isinstance(raw, dict) else None
    return producer.get("name") if isinstance(producer, dict) else None


def _read_quant_config(folder: "_Folder") -> _QuantConfig:
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
            _check_algo(algo, file)
        for size in sizes:
            _check_group_size(size, file)
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
            layers[name] = _check_algo(cfg.get("quant_algo"), file, f" (layer `{name}`)")
            _check_group_size(cfg.get("group_size"), file, f" (layer `{name}`)")
            if cfg.get("pre_quant_scale"):
                _check_algo(f"{cfg.get('quant_algo')}_AWQ", file, f" (layer `{name}`)")
        return _QuantConfig(file, MIXED, exclude, layers, producer)
    algo = _check_algo(algo, file)
    _check_group_size(group_size, file)
    return _QuantConfig(file, algo, exclude, None, producer)


def _check_config_json_agrees(folder: "_Folder", config: _QuantConfig) -> None:
    """A serving stack may read `config.json`'s `quantization_config` and nvfp4x reads
    `hf_quant_config.json`: where both are present they must name one algorithm."""
    if not (config.file.endswith(HF_QUANT_CONFIG) and folder.exists(CONFIG)):
        return
    raw = folder.json(CONFIG)
    block = raw.get("quantization_config") if isinstance(raw, dict) else None
    if block is None:
        return
    theirs = block.get("quant_algo") if isinstance(block, dict) else block
    if str(theirs).upper() != config.algo:
        raise ValueError(
            f"`{folder.path(CONFIG)}` says `quant_algo: {theirs}` but `{config.file}` says "
            f"`quant_algo: {config.algo}`: the two configs of one checkpoint disagree (a "
            "serving stack reading one would run the wrong algorithm). Export it again."
        )


def _hf_quant_config(algos: dict[str, str], exclude: set[str]) -> dict:
    """`hf_quant_config.json` as Model Optimizer's `get_quant_config` writes it."""
    try:
        version = importlib.metadata.version("nvfp4x")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - source tree
        version = "0.0.0"
    kinds = sorted(set(algos.values()))
    quantization: dict[str, Any] = {"quant_algo": None, "kv_cache_quant_algo": None}
    if len(kinds) == 1:
        quantization.update(
            quant_algo=kinds[0], group_size=GROUP_SIZE, exclude_modules=sorted(exclude)
        )
    else:
        quantization["quant_algo"] = MIXED
        quantization["quantized_layers"] = {
            name: {"quant_algo": algo, "group_size": GROUP_SIZE}
            for name, algo in sorted(algos.items())
        }
    return {"producer": {"name": "nvfp4x", "version": version}, "quantization": quantization}


def _group_config(algo: str) -> dict:
    weights = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": GROUP_SIZE}
    if algo == W4A16:
        return {"weights": weights}
    return {"input_activations": dict(weights), "weights": weights}


def _config_json_block(hf_quant: dict) -> dict:
    """The `quantization_config` of `config.json`, as Model Optimizer's
    `convert_hf_quant_config_format` derives it from `hf_quant_config.json`."""
    q = hf_quant["quantization"]
    out: dict[str, Any] = {}
    if q["quant_algo"] == MIXED:
        by_algo: dict[str, list[str]] = {}
        for name, cfg in q["quantized_layers"].items():
            by_algo.setdefault(cfg["quant_algo"], []).append(name)
        out["config_groups"] = {
            f"group_{i}": {**_group_config(algo), "targets": sorted(layers)}
            for i, (algo, layers) in enumerate(sorted(by_algo.items()))
        }
        out["quantized_layers"] = q["quantized_layers"]
    else:
        out["config_groups"] = {
            "group_0": {**_group_config(q["quant_algo"]), "targets": ["Linear"]}
        }
    out["ignore"] = q.get("exclude_modules") or []
    out["quant_algo"] = q["quant_algo"]
    out["producer"] = hf_quant["producer"]
    out["quant_method"] = "modelopt"
    return out


# --- export ---


@dataclasses.dataclass
class _Layer:
    """An NVFP4 layer (one slice of a stacked one) as written: its tensors in 1x16 rows."""

    module: str  # nvfp4x module path
    name: str  # checkpoint module name
    algo: str
    codes: Any  # uint8 [out, in/2]
    scale_bits: Any  # uint8 [out, in/16]
    tensor_scale: Any  # float32 scalar
    input_amax: Any  # float32 scalar (W4A4) or None


def _export_layers(entry: _Entry, algo: str, amax: Any, who: str) -> list[_Layer]:
    packed = entry.leaf.packed
    out, inn = packed.shape[-2:]
    if inn % GROUP_SIZE:
        raise ValueError(
            f"{who}: `{entry.module}` has {inn} input features, not a multiple of "
            f"{GROUP_SIZE}; serving stacks' NVFP4 loaders refuse such layers (vLLM: "
            "'input feature size is not a multiple of 16'). Keep it out of the NVFP4 policy."
        )
    codes = np.asarray(packed.codes)
    bits = np.asarray(packed.scale_bits)
    ts = np.asarray(packed.tensor_scale, np.float32)
    if entry.stack is None:
        codes, bits, ts = codes[None], bits[None], ts[None]
    if amax is not None:
        amax = np.broadcast_to(np.asarray(amax, np.float32), ts.shape)
    layers = []
    for i, name in enumerate(entry.module_names()):
        scale = bits[i]
        if packed.block[0] == BLOCK:  # a 16x16 tile's scale, repeated over its 16 rows
            scale = np.repeat(scale, BLOCK, axis=0)
        layers.append(
            _Layer(
                entry.module,
                name,
                algo,
                np.ascontiguousarray(codes[i][:out, : inn // 2]),
                np.ascontiguousarray(scale[:out]),
                ts[i],
                None if amax is None else amax[i],
            )
        )
    return layers


def _layer_algo(entry: _Entry, weight_only: bool, input_amax: dict, who: str) -> str:
    recipe = entry.leaf.recipe
    fmt = recipe.input
    if fmt is None or fmt.name in ("bf16", "float32") or weight_only:
        if entry.module in input_amax and not weight_only:
            raise ValueError(
                f"{who}: `input_amax` names `{entry.module}`, whose recipe "
                f"`{recipe.name}` does not quantise its activations; remove it."
            )
        return W4A16
    if fmt.name != "nvfp4":
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


def _amax_for_scale(scale: Any) -> jax.Array:
    """An amax whose NVFP4 tensor decode scale is exactly `scale` (monotone search)."""
    target = np.float32(scale)
    amax = np.float32(target * np.float32(NVFP4_RANGE))
    for _ in range(64):
        got = np.float32(tensor_scales(jnp.float32(amax))[1])
        if got == target:
            return jnp.float32(amax)
        amax = np.nextafter(amax, np.float32(np.inf if got < target else 0), dtype=np.float32)
    raise RuntimeError(f"nvfp4x: no amax gives the tensor scale {target!r}.")  # pragma: no cover


def _requantise(layer: _Layer, scale: Any) -> _Layer:
    """The layer's decoded weight quantised again (1x16 blocks) with tensor scale `scale`."""
    out, half = layer.codes.shape
    packed = NVFP4Array(
        codes=jnp.asarray(layer.codes),
        scales=jnp.asarray(layer.scale_bits),
        tensor_scale=jnp.asarray(layer.tensor_scale),
        block=(1, BLOCK),
        logical_tail=(2 * half,),
        dtype=np.float32,
    )
    q = to_nvfp4(packed.dequantize(), amax=_amax_for_scale(scale))
    ts = np.asarray(q.tensor_scale, np.float32)
    if ts.tobytes() != np.float32(scale).tobytes():  # pragma: no cover - guarded above
        raise RuntimeError(f"nvfp4x: requantising `{layer.name}` missed its tensor scale.")
    return dataclasses.replace(
        layer, codes=np.asarray(q.codes), scale_bits=np.asarray(q.scale_bits), tensor_scale=ts
    )


def _fused_groups(names: Sequence[str]) -> dict[tuple[str, str], list[str]]:
    groups: dict[tuple[str, str], list[str]] = {}
    for name in names:
        parent, _, last = name.rpartition(".")
        if last in FUSED:
            groups.setdefault((parent, FUSED[last]), []).append(name)
    return {k: v for k, v in groups.items() if len(v) > 1}


def _check_fused(
    layers: dict[str, _Layer], unquantised: set[str], requantize_fused: bool, who: str
) -> None:
    """Serving stacks fuse q/k/v and gate/up into one GEMM: one precision, one tensor
    scale (vLLM takes the largest `weight_scale_2` without rescaling the block scales)."""
    changed = []
    for (parent, fused), members in sorted(_fused_groups([*layers, *unquantised]).items()):
        algos = {name: layers[name].algo if name in layers else "unquantised" for name in members}
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
        if group[0].algo == W4A4:  # one static activation scale: the largest amax
            amax = np.float32(max(g.input_amax for g in group))
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
                layers[g.name] = _requantise(g, top)
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


def _input_scale(amax: Any) -> np.ndarray:
    return np.asarray(tensor_scales(jnp.float32(amax))[1], np.float32)


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
    entries, _, _ = _plan(frozen_model, names, who)
    tensors: dict[str, np.ndarray] = {}
    layers: dict[str, _Layer] = {}
    quantised_modules = set()
    for e in entries:
        leaf = e.leaf
        packed = leaf.packed if isinstance(leaf, FrozenWeight) else None
        if isinstance(packed, PackedArray) and not isinstance(packed, NVFP4Array):
            raise ValueError(
                f"{who}: `{e.module}` is frozen in {leaf.recipe.weight}; this format "
                "holds NVFP4 or unquantised weights. Quantise it with an NVFP4 recipe, or "
                "`nvfp4x.recipes.bf16()`, or leave it out of the policy."
            )
        if isinstance(leaf, FrozenWeight) and isinstance(leaf.packed, NVFP4Array):
            algo = _layer_algo(e, weight_only, amaxes, who)
            quantised_modules.add(e.module)
            for layer in _export_layers(e, algo, amaxes.get(e.module), who):
                layers[layer.name] = layer
            continue
        array = np.asarray(leaf.packed if isinstance(leaf, FrozenWeight) else leaf)
        slices = [array] if e.stack is None else list(array)
        for name, a in zip(e.tensor_names(), slices, strict=True):
            if a.dtype not in _CODES:
                raise ValueError(f"{who}: `{name}` has dtype {a.dtype}, which safetensors lacks.")
            tensors[name] = np.ascontiguousarray(a)
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
    unquantised = _unquantised_layers(frozen_model, entries)
    _check_fused(layers, unquantised, requantize_fused, who)
    for name, layer in layers.items():
        tensors[f"{name}.weight"] = layer.codes
        tensors[f"{name}.weight_scale"] = layer.scale_bits.view(ml_dtypes.float8_e4m3fn)
        tensors[f"{name}.weight_scale_2"] = np.asarray(layer.tensor_scale, np.float32).reshape(())
        if layer.algo == W4A4:
            tensors[f"{name}.input_scale"] = _input_scale(layer.input_amax).reshape(())

    hf_quant = _hf_quant_config({n: g.algo for n, g in layers.items()}, unquantised)
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
        WEIGHTS: _serialise(
            tensors, {"format": "pt", CONFIG_CHECKSUM_KEY: _digest(hf_quant_bytes)}
        ),
        HF_QUANT_CONFIG: hf_quant_bytes,
    }
    if hf_config is not None:
        config = {**dict(hf_config), "quantization_config": _config_json_block(hf_quant)}
        files[CONFIG] = (json.dumps(config, indent=2) + "\n").encode()
    # Written into a new folder swapped in whole: a reader (a serving stack, import_hf)
    # sees the previous export or this one, never weights of one with configs of another.
    write_folder(directory, files)


# --- import ---


class _Folder:
    """A checkpoint folder, its files read through one open handle of it (where the OS
    allows): while `export_hf` swaps a new export in, a reader keeps reading the folder
    it opened, and `changed()` says that it should read again."""

    def __init__(self, directory: str):
        self.directory = directory
        self.fd: int | None = None
        if os.open in os.supports_dir_fd and hasattr(os, "O_DIRECTORY"):
            self.fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def exists(self, name: str) -> bool:
        try:
            if self.fd is None:
                os.stat(self.path(name))
            else:
                os.stat(name, dir_fd=self.fd)
        except FileNotFoundError:
            return False
        return True

    def read(self, name: str, max_bytes: int | None = None) -> bytes:
        if self.fd is None:
            return read_regular(self.path(name), max_bytes=max_bytes)
        return read_regular(name, dir_fd=self.fd, max_bytes=max_bytes, display=self.path(name))

    def json(self, name: str) -> Any:
        return load_json(self.read(name, MAX_JSON_BYTES), f"`{self.path(name)}`")

    def changed(self) -> bool:
        """Whether the folder at the path is no longer the one opened (swapped)."""
        if self.fd is None:
            return False
        try:
            now = os.stat(self.directory)
        except FileNotFoundError:
            return True
        then = os.fstat(self.fd)
        return (now.st_dev, now.st_ino) != (then.st_dev, then.st_ino)


def _shard_name(name: Any, index: str) -> str:
    """A `weight_map` file name, refused if it is not a relative path inside the folder
    (an absolute path, `..`, a drive): an index must not make nvfp4x read other files."""
    if not isinstance(name, str):
        raise ValueError(f"`{index}`: the `weight_map` entry {name!r} is not a file name.")
    parts = name.replace("\\", "/").split("/")
    if (
        not name
        or "\0" in name
        or os.path.isabs(name)
        or name.startswith(("/", "\\"))
        or os.path.splitdrive(name)[0]
        or any(p in ("", "..") for p in parts)
    ):
        raise ValueError(
            f"`{index}`: the `weight_map` names the file `{name}`, which is not inside the "
            "checkpoint folder: refused (an index may only name files in its own folder)."
        )
    return name


class _Reader:
    """The checkpoint's tensors (one file, or the shards an index lists) and what was
    taken from them."""

    def __init__(self, folder: _Folder, config: _QuantConfig):
        directory = folder.directory
        index = folder.path(INDEX)
        if folder.exists(INDEX):
            raw = folder.json(INDEX)
            weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
            if not isinstance(weight_map, dict):
                raise ValueError(f"`{index}` has no `weight_map` (corrupted).")
            files = sorted({_shard_name(f, index) for f in weight_map.values()})
        else:
            files = [WEIGHTS]
        self.tensors: dict[str, _Tensor] = {}
        self.config_digests: set[str] = set()
        for file in files:
            path = folder.path(file)
            if not folder.exists(file):
                raise ValueError(f"`{directory}` has no `{file}`: the checkpoint is incomplete.")
            tensors, metadata = _read_safetensors(path, folder.read(file))
            _check_checksums_present(path, metadata, config)
            for name, tensor in tensors.items():
                if name in self.tensors:
                    raise ValueError(
                        f"Tensor `{name}` is in both `{self.tensors[name].file}` and `{path}`."
                    )
                self.tensors[name] = tensor
            if CONFIG_CHECKSUM_KEY in metadata:
                self.config_digests.add(metadata[CONFIG_CHECKSUM_KEY])
        self.taken: set[str] = set()

    def get(self, name: str, dtype: str, shapes: Sequence[tuple[int, ...]], holder: str) -> _Tensor:
        tensor = self.tensors.get(name)
        if tensor is None:
            raise ValueError(
                f"The checkpoint has no tensor `{name}` (for `{holder}` of `like`): missing. "
                "Check the names map, and that the checkpoint was written from this model."
            )
        if tensor.dtype != dtype:
            raise ValueError(
                f"`{tensor.file}`: tensor `{name}` is {tensor.dtype}, but `{holder}` of "
                f"`like` needs {dtype}: dtype mismatch. Build `like` with the policy and "
                "dtypes that wrote the checkpoint."
            )
        if tensor.shape not in [tuple(s) for s in shapes]:
            raise ValueError(
                f"`{tensor.file}`: tensor `{name}` has shape {list(tensor.shape)}, but "
                f"`{holder}` of `like` needs {list(shapes[0])}: shape mismatch. Build `like` "
                "with the configuration that wrote the checkpoint."
            )
        self.taken.add(name)
        return tensor


def _import_nvfp4(entry: _Entry, reader: _Reader, config: _QuantConfig) -> Any:
    fw = entry.leaf
    packed = fw.packed
    out, inn = packed.shape[-2:]
    want = W4A4 if fw.recipe.input is not None and fw.recipe.input.name == "nvfp4" else W4A16
    codes_like = np.zeros(packed.codes.shape, np.uint8)
    bits_like = np.zeros(packed.scale_bits.shape, np.uint8)
    ts_like = np.zeros(packed.tensor_scale.shape, np.float32)
    if entry.stack is None:
        codes_like, bits_like, ts_like = codes_like[None], bits_like[None], ts_like[None]
    holder = f"{entry.module}.weight"
    if inn % GROUP_SIZE:
        raise ValueError(
            f"`like` holds `{entry.module}` in NVFP4 with {inn} input features, not a multiple "
            f"of {GROUP_SIZE}: no NVFP4 checkpoint stores such a layer."
        )
    for i, name in enumerate(entry.module_names()):
        algo = config.algo_of(name)
        if algo != want:
            have = "unquantised (excluded)" if algo is None else f"`{algo}`"
            raise ValueError(
                f"`{config.file}` stores `{name}` {have}, but `like` has `{entry.module}` in "
                f"`{want}` (recipe `{fw.recipe.name}`): quantisation mismatch. Build `like` "
                "with the recipes that wrote the checkpoint (W4A4: activations in NVFP4, e.g. "
                "`nvfp4_inference`; W4A16_NVFP4: `nvfp4_weight_only`)."
            )
        codes = reader.get(f"{name}.weight", "U8", [(out, inn // 2)], holder).bits()
        bits = reader.get(f"{name}.weight_scale", "F8_E4M3", [(out, inn // GROUP_SIZE)], holder)
        bits = bits.bits()
        ts = reader.get(f"{name}.weight_scale_2", "F32", [(), (1,)], holder).array()
        if want == W4A4:
            scale = reader.get(f"{name}.input_scale", "F32", [(), (1,)], holder).array()
            if not (np.all(np.isfinite(scale)) and np.all(scale > 0)):
                raise ValueError(f"`{name}.input_scale` is {scale.reshape(-1)[0]}, not positive.")
        codes_like[i][:out, : inn // 2] = codes
        if packed.block[0] == BLOCK:
            pad = -out % BLOCK
            rows = np.concatenate([bits, np.repeat(bits[-1:], pad, axis=0)]) if pad else bits
            tiles = rows.reshape(-1, BLOCK, rows.shape[-1])
            if np.any(tiles != tiles[:, :1]):
                raise ValueError(
                    f"`{name}.weight_scale` varies within 16-row tiles, but `like` holds "
                    f"`{entry.module}` in 16x16 blocks: build `like` with "
                    "`weight_block=(1, 16)` to read this checkpoint."
                )
            bits_like[i] = tiles[:, 0]
        else:
            bits_like[i] = bits
        ts_like[i] = ts.reshape(())
    if entry.stack is None:
        codes_like, bits_like, ts_like = codes_like[0], bits_like[0], ts_like[0]
    new = NVFP4Array(
        codes=jnp.asarray(codes_like),
        scales=jnp.asarray(bits_like),
        tensor_scale=jnp.asarray(ts_like),
        block=packed.block,
        logical_tail=packed.logical_tail,
        dtype=packed.dtype,
    )
    return dataclasses.replace(fw, packed=new)


def _import_plain(entry: _Entry, reader: _Reader) -> Any:
    leaf = entry.leaf
    array = leaf.packed if isinstance(leaf, FrozenWeight) else leaf
    dtype = np.dtype(array.dtype)
    if dtype not in _CODES:
        raise ValueError(
            f"`like` holds `{entry.module}.{entry.attr}` in {dtype}, which safetensors lacks."
        )
    shape = tuple(array.shape) if entry.stack is None else tuple(array.shape[1:])
    holder = f"{entry.module}.{entry.attr}"
    parts = [reader.get(n, _CODES[dtype], [shape], holder).array() for n in entry.tensor_names()]
    value = jnp.asarray(parts[0] if entry.stack is None else np.stack(parts))
    return dataclasses.replace(leaf, packed=value) if isinstance(leaf, FrozenWeight) else value


def _read_checkpoint(directory: str) -> tuple[_QuantConfig, _Reader]:
    """The config and tensors of the checkpoint in `directory`, all from one export: read
    through one handle of the folder. A folder `export_hf` swaps out is only ever
    emptied, never mixed, so a read that succeeds is of one export; one that fails
    because the folder was swapped meanwhile is read again."""
    error: Exception | None = None
    for _ in range(_READ_ATTEMPTS):
        folder = _Folder(directory)
        try:
            config = _read_quant_config(folder)
            _check_config_json_agrees(folder, config)
            reader = _Reader(folder, config)
            if config.file.endswith(HF_QUANT_CONFIG) and reader.config_digests:
                digest = _digest(folder.read(HF_QUANT_CONFIG, MAX_JSON_BYTES))
                if reader.config_digests != {digest}:
                    raise ValueError(
                        f"`{config.file}` fails the sha256 checksum recorded in the weights at "
                        "export: it was changed or corrupted. Export the checkpoint again."
                    )
            return config, reader
        except (OSError, ValueError) as e:
            if not folder.changed():
                raise
            error = e
        finally:
            folder.close()
    raise ValueError(
        f"`{directory}` was replaced {_READ_ATTEMPTS} times while it was being read (exports "
        "written into it one after another): read it when they are done."
    ) from error


#: How many times `import_hf` reads a folder that exports keep replacing.
_READ_ATTEMPTS = 10


def import_hf(
    directory: str | os.PathLike,
    like: Any,
    *,
    names: NamesLike,
    ignore_unexpected: bool = False,
) -> Any:
    """Read an NVFP4 unified Hugging Face checkpoint (written by [`nvfp4x.export_hf`][] or
    by NVIDIA Model Optimizer) into a frozen model shaped like `like`, bit for bit.

    Each NVFP4 layer's codes, E4M3 block scales and tensor scale are taken as stored
    (a 16x16-block layer of `like` needs the scales constant over each 16-row tile, as
    `export_hf` writes them). The activations' `input_scale` of a W4A4 layer is checked
    (present, positive) but not used: nvfp4x computes activation scales per call. The
    safetensors header is parsed directly (its numpy loader cannot read F8_E4M3), and
    checked as strictly as the safetensors library checks it (tensors that tile the
    payload: no overlap, gap or trailing bytes). Files written by `export_hf` carry a
    sha256 of every tensor (and of `hf_quant_config.json`), verified here; files from
    other writers have none and are read unverified. A file that has lost part of
    nvfp4x's checksums, or all of them while the config names nvfp4x as its producer, is
    refused: verification fails closed. Only regular files inside `directory` are read
    (an index naming `../x` or `/x` is refused; a symlink, as in Hugging Face's cache, is
    followed), through one handle of the folder: an export swapped in meanwhile is read
    again, whole.

    **Arguments:**

    - `directory`: the checkpoint folder: `model.safetensors` (or the shards listed in
      `model.safetensors.index.json`) and `hf_quant_config.json` (or a `config.json` with a
      Model Optimizer `quantization_config`).
    - `like`: a frozen model of the same structure, recipes, shapes and dtypes, e.g.
      `eqx.filter_eval_shape(lambda: nvfp4x.freeze(nvfp4x.quantize(build(), policy)))`;
      its array values are not used.
    - `names`: the names map used at export (see [`nvfp4x.export_hf`][]).
    - `ignore_unexpected`: accept checkpoint tensors that `like` has no place for.

    **Returns:** `like` with every array read from the checkpoint.

    Raises `ValueError`, naming the file and tensor: a missing tensor, an unexpected one,
    a shape or dtype that does not match `like`, a layer quantised differently from
    `like`'s recipe, an unsupported quantisation config (MXFP4, AWQ variants, FP8, KV
    cache quantisation, a group size other than 16), `config.json` and
    `hf_quant_config.json` naming different algorithms, a truncated or malformed file, a
    path outside the folder, something not a regular file (a FIFO, a device), or a
    tensor whose checksum fails.

    ```python
    like = eqx.filter_eval_shape(lambda: nvfp4x.freeze(nvfp4x.quantize(build(), policy)))
    frozen = nvfp4x.import_hf("out/my-model-nvfp4", like, names=nvfp4x.hf_names.llama)
    ```
    """
    who = "nvfp4x.import_hf"
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise ValueError(f"{who}: `{directory}` is not a folder.")
    config, reader = _read_checkpoint(directory)
    entries, treedef, leaves = _plan(like, names, who)
    leaves = list(leaves)
    for e in entries:
        if isinstance(e.leaf, FrozenWeight) and isinstance(e.leaf.packed, NVFP4Array):
            leaves[e.index] = _import_nvfp4(e, reader, config)
        else:
            leaves[e.index] = _import_plain(e, reader)
    for name in _unquantised_layers(like, entries):
        algo = config.algo_of(name)
        if algo is not None:
            raise ValueError(
                f"`{config.file}` stores `{name}` in `{algo}`, but `like` keeps that layer "
                "unquantised: quantisation mismatch. Build `like` with the policy that wrote "
                "the checkpoint."
            )
    unexpected = sorted(set(reader.tensors) - reader.taken)
    if unexpected and not ignore_unexpected:
        shown = ", ".join(f"`{n}`" for n in unexpected[:8])
        more = f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""
        raise ValueError(
            f"{who}: the checkpoint in `{directory}` holds tensors that `like` has no place "
            f"for: {shown}{more} (unexpected). Build `like` from the model that wrote it, or "
            "pass `ignore_unexpected=True`."
        )
    return jax.tree_util.tree_unflatten(treedef, leaves)
