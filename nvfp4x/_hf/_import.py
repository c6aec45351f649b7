"""`import_hf`: a unified Hugging Face checkpoint (written by `export_hf` or by Model
Optimizer) read into a frozen model shaped like `like`, each entry by its codec."""

import os
from collections.abc import Sequence
from typing import Any

import jax

from .._files import MAX_JSON_BYTES
from ._codecs import ALGOS, codec_for, unquantised_layers
from ._folder import HF_QUANT_CONFIG, INDEX, WEIGHTS, Folder, shard_name
from ._modelopt import QuantConfig, check_config_json_agrees, read_quant_config
from ._names import NamesLike
from ._plan import plan
from ._safetensors import CONFIG_CHECKSUM_KEY, Tensor, check_checksums_present, digest, read


class Reader:
    """The checkpoint's tensors (one file, or the shards an index lists) and what was
    taken from them."""

    def __init__(self, folder: Folder, config: QuantConfig):
        directory = folder.directory
        index = folder.path(INDEX)
        if folder.exists(INDEX):
            raw = folder.json(INDEX)
            weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
            if not isinstance(weight_map, dict):
                raise ValueError(f"`{index}` has no `weight_map` (corrupted).")
            files = sorted({shard_name(f, index) for f in weight_map.values()})
        else:
            files = [WEIGHTS]
        self.tensors: dict[str, Tensor] = {}
        self.config_digests: set[str] = set()
        for file in files:
            path = folder.path(file)
            if not folder.exists(file):
                raise ValueError(f"`{directory}` has no `{file}`: the checkpoint is incomplete.")
            tensors, metadata = read(path, folder.read(file))
            check_checksums_present(path, metadata, config.producer, config.file)
            for name, tensor in tensors.items():
                if name in self.tensors:
                    raise ValueError(
                        f"Tensor `{name}` is in both `{self.tensors[name].file}` and `{path}`."
                    )
                self.tensors[name] = tensor
            if CONFIG_CHECKSUM_KEY in metadata:
                self.config_digests.add(metadata[CONFIG_CHECKSUM_KEY])
        self.taken: set[str] = set()

    def get(self, name: str, dtype: str, shapes: Sequence[tuple[int, ...]], holder: str) -> Tensor:
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


def _read_checkpoint(directory: str) -> tuple[QuantConfig, Reader]:
    """The config and tensors of the checkpoint in `directory`, all from one export: read
    through one handle of the folder. A folder `export_hf` swaps out is only ever
    emptied, never mixed, so a read that succeeds is of one export; one that fails
    because the folder was swapped meanwhile is read again."""
    error: Exception | None = None
    for _ in range(_READ_ATTEMPTS):
        folder = Folder(directory)
        try:
            config = read_quant_config(folder, ALGOS)
            reader = Reader(folder, config)
            if config.file.endswith(HF_QUANT_CONFIG) and reader.config_digests:
                ours = digest(folder.read(HF_QUANT_CONFIG, MAX_JSON_BYTES))
                if reader.config_digests != {ours}:
                    raise ValueError(
                        f"`{config.file}` fails the sha256 checksum recorded in the weights at "
                        "export: it was changed or corrupted. Export the checkpoint again."
                    )
            check_config_json_agrees(folder, config, ALGOS)
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
    entries, treedef, leaves = plan(like, names, who)
    leaves = list(leaves)
    for e in entries:
        leaves[e.index] = codec_for(e, who).read(e, reader, config)
    for name in unquantised_layers(like, entries):
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
