"""A model in one file: `save` / `load`.

A header (format version, every layer's recipe, every array's shape and dtype, a sha256
of the payload), then the leaves (`eqx.tree_serialise_leaves`); a file corrupted,
truncated or written from another model is refused by name. The file is written
atomically (`_files.atomic_write`). A training run's whole state: `_training_state.py`.
"""

import hashlib
import io
import json
import os
import warnings
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.core import Tracer

from ._files import atomic_write, load_json, read_regular, remove_stale_temporaries, shown
from ._sites import layers as site_layers, path_str

FORMAT_VERSION = 2
_MAGIC = b"NVFP4X-CHECKPOINT\n"


def _layer_recipes(model: Any) -> dict[str, list[str]]:
    """`{path: [layer class, recipe]}` of every linear-like layer of `model`."""
    return {
        path: [type(leaf).__name__, str(getattr(leaf, "recipe", None))]
        for path, leaf in site_layers(model)
    }


def _describe(model: Any) -> dict:
    layers = _layer_recipes(model)
    arrays = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(model)[0]:
        if eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct):
            arrays.append([path_str(path), list(leaf.shape), str(np.dtype(leaf.dtype))])
    return {"format_version": FORMAT_VERSION, "layers": layers, "arrays": arrays}


def save(path: str | os.PathLike, model: Any) -> None:
    """Write `model` (frozen or not) to `path`: a header naming the format version, every
    layer's recipe, every array's shape and dtype and a sha256 of the payload, then the
    leaves (`eqx.tree_serialise_leaves`).

    The file is written to a temporary file and renamed into place: a save that is
    interrupted (an exception, a kill, a full disk) leaves the previous file at `path`
    as it was.

    **Arguments:**

    - `path`: the file to write (replaced if it exists).
    - `model`: any PyTree of arrays and Equinox modules, typically
      `nvfp4x.freeze(qmodel)`.

    **Returns:** nothing. Read the file back with [`nvfp4x.load`][].

    ```python
    qmodel = nvfp4x.quantize(eqx.nn.Linear(32, 16, key=jax.random.key(0)), "nvfp4_inference")
    nvfp4x.save("model.nvfp4x", nvfp4x.freeze(qmodel))
    ```
    """
    _refuse_traced(model, "nvfp4x.save")
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, model)
    payload = buffer.getvalue()
    header = _describe(model)
    header["payload_bytes"] = len(payload)
    header["payload_sha256"] = hashlib.sha256(payload).hexdigest()
    raw = json.dumps(header).encode()
    with atomic_write(path) as f:
        f.write(_MAGIC)
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        f.write(payload)


def load(path: str | os.PathLike, like: Any) -> Any:
    """Read a checkpoint written by [`nvfp4x.save`][] into the structure of `like` (a model
    built the same way, e.g. `nvfp4x.freeze(nvfp4x.quantize(skeleton, policy))`, or its
    `eqx.filter_eval_shape`).

    Before anything is deserialised the payload's sha256 is checked against the one in
    the header: a corrupted file raises `ValueError` naming it. Also raises `ValueError`
    if the file is truncated, from an unknown format version, or holds different layers,
    recipes, shapes or dtypes. Files of format version 1 (nvfp4x 0.1, no checksum) load
    with a `UserWarning`: save them again to add one.

    **Arguments:**

    - `path`: a file written by [`nvfp4x.save`][].
    - `like`: a model of the same structure, layer types, recipes, shapes and dtypes;
      its array values are not used.

    **Returns:** `like` with the arrays read from the file.

    ```python
    def build():
        linear = eqx.nn.Linear(32, 16, key=jax.random.key(1))
        return nvfp4x.freeze(nvfp4x.quantize(linear, "nvfp4_inference"))

    frozen = nvfp4x.load("model.nvfp4x", eqx.filter_eval_shape(build))
    ```
    """
    path = os.fspath(path)
    remove_stale_temporaries(path)
    data = read_regular(path)
    if not data.startswith(_MAGIC) or len(data) < len(_MAGIC) + 8:
        raise ValueError(f"`{path}` is not an nvfp4x checkpoint (written by `nvfp4x.save`).")
    n = int.from_bytes(data[len(_MAGIC) : len(_MAGIC) + 8], "little")
    start = len(_MAGIC) + 8
    if start + n > len(data):
        raise ValueError(
            f"`{path}`: the checkpoint header is truncated or corrupt: it claims {n:,} bytes "
            f"of a file of {len(data):,}."
        )
    try:
        header = load_json(data[start : start + n], f"`{path}`: the checkpoint header")
    except ValueError as e:
        raise ValueError(f"`{path}`: the checkpoint header is truncated or corrupt: {e}") from e
    if not isinstance(header, dict) or not isinstance(header.get("layers"), dict):
        raise ValueError(f"`{path}`: the checkpoint header is corrupt.")
    version = header.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise ValueError(
            f"`{path}`: the checkpoint header's `format_version` is {shown(version)}, not an "
            f"integer (nvfp4x writes one, 1 to {FORMAT_VERSION}): the header is corrupt or was "
            "not written by nvfp4x."
        )
    if version not in (1, FORMAT_VERSION):
        raise ValueError(
            f"`{path}` has checkpoint format version {version}; this nvfp4x reads versions "
            f"1 to {FORMAT_VERSION}."
        )
    payload = data[start + n :]
    if version == 1:
        warnings.warn(
            f"`{path}` is an nvfp4x checkpoint of format version 1, which carries no "
            "checksum: a corrupted payload cannot be detected. Save it again with "
            "`nvfp4x.save` to add one.",
            UserWarning,
            stacklevel=2,
        )
    else:
        _verify_payload(path, header, payload)
    expected = json.loads(json.dumps(_describe(like)))
    for part, what in (("layers", "layer recipes"), ("arrays", "array shapes/dtypes")):
        if header.get(part) != expected[part]:
            diff = _first_difference(header.get(part) or [], expected[part])
            raise ValueError(
                f"`{path}` does not match `like`: different {what} ({diff}). Build `like` "
                "with the same model, policy and freeze state that wrote the checkpoint."
            )
    try:
        return eqx.tree_deserialise_leaves(io.BytesIO(payload), like)
    except Exception as e:  # eqx/numpy raise several types for a cut-off stream
        raise ValueError(f"`{path}` is truncated or corrupt: {e}") from e


def _verify_payload(path: str, header: dict, payload: bytes) -> None:
    size, digest = header.get("payload_bytes"), header.get("payload_sha256")
    if not isinstance(size, int) or not isinstance(digest, str):
        raise ValueError(f"`{path}`: the checkpoint header is corrupt (no payload checksum).")
    if len(payload) != size:
        what = "truncated" if len(payload) < size else "corrupted (trailing bytes)"
        raise ValueError(
            f"`{path}` is {what}: its payload has {len(payload):,} bytes, the header "
            f"records {size:,}."
        )
    found = hashlib.sha256(payload).hexdigest()
    if found != digest:
        raise ValueError(
            f"`{path}` is corrupted: the sha256 of its payload is {found}, the header "
            f"records {digest}. Restore the file from a good copy."
        )


def _first_difference(got, want) -> str:
    if isinstance(got, dict) and isinstance(want, dict):
        for k in sorted(set(got) | set(want)):
            if got.get(k) != want.get(k):
                return f"`{k}`: file {got.get(k)}, like {want.get(k)}"
    for a, b in zip(got, want, strict=False):
        if a != b:
            return f"file {a}, like {b}"
    return f"file has {len(got)} entries, like has {len(want)}"


_TRACED = (
    "{what} is traced: a checkpoint is written from concrete arrays, and this call runs "
    "under a JAX transformation (`jax.jit`, `jax.vmap`, `jax.grad`, `lax.scan`...). Call it "
    "outside the transformed function, on the arrays it returns."
)


def _refuse_traced(tree: Any, who: str) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, Tracer):
            raise TypeError(f"{who}: " + _TRACED.format(what=f"the leaf `{path_str(path)}`"))
