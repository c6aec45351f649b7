"""Safetensors files, read and written: the dtype codes, a strict parser (the
`safetensors` numpy loader cannot read F8_E4M3), and the sha256 checksums `export_hf`
records in the metadata and `import_hf` verifies."""

import dataclasses
import hashlib
import itertools
import json
import math
from typing import Any

import ml_dtypes
import numpy as np

from .._files import MAX_JSON_BYTES, load_json

#: Safetensors metadata keys nvfp4x writes (string -> string, as the format requires).
CHECKSUMS_KEY = "nvfp4x.sha256"
CONFIG_CHECKSUM_KEY = "nvfp4x.hf_quant_config.sha256"

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
#: Numpy dtypes and their safetensors codes.
CODES = {dtype: code for code, dtype in DTYPES.items()}


@dataclasses.dataclass
class Tensor:
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


def read(path: str, raw: bytes) -> tuple[dict[str, Tensor], dict[str, str]]:
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
    header = load_json(bytes(data[8 : 8 + n]), f"`{path}`: the safetensors header", unsigned=True)
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
        if not all(type(d) is int and 0 <= d < 2**64 for d in (*shape, *offsets)):
            raise ValueError(malformed)  # (each an unsigned 64-bit integer, as the library's)
        elements = 1
        for d in shape:  # the library's product, checked in 64 bits from the left
            elements *= d
            if elements >= 2**64 or d >= 2**63:  # (numpy holds no axis of 2^63 or more)
                raise ValueError(
                    f"`{path}`: tensor `{name}` has shape {shape}, whose size does not fit in "
                    "64 bits or whose axes numpy cannot hold (corrupted or crafted header)."
                )
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
        tensors[name] = Tensor(path, dtype, shape, body[begin:end])
        end_of_last = end
    if end_of_last != len(body):
        raise ValueError(
            f"`{path}`: {len(body) - end_of_last} bytes after the last tensor belong to none "
            "(the safetensors format allows no trailing bytes): corrupted or crafted file."
        )
    _verify_checksums(path, tensors, metadata)
    return tensors, metadata


def digest(data: Any) -> str:
    return hashlib.sha256(data).hexdigest()


def _verify_checksums(path: str, tensors: dict[str, Tensor], metadata: dict[str, str]) -> None:
    """Check every tensor against the sha256 that `export_hf` recorded; files from other
    writers (Model Optimizer's) carry none and are read unverified."""
    recorded = metadata.get(CHECKSUMS_KEY)
    if recorded is None:
        return
    digests = load_json(recorded.encode(), f"`{path}`: the recorded checksums")
    if not isinstance(digests, dict) or set(digests) != set(tensors):
        raise ValueError(
            f"`{path}`: the recorded checksums do not list the file's tensors (corrupted)."
        )
    for name, tensor in tensors.items():
        if digest(tensor.data) != digests[name]:
            raise ValueError(
                f"`{path}`: tensor `{name}` fails its sha256 checksum (recorded at export): "
                "the file is corrupted. Export the checkpoint again."
            )


def check_checksums_present(
    path: str, metadata: dict[str, str], producer: str | None, config_file: str
) -> None:
    """Fail closed: a file nvfp4x wrote carries both of its checksum entries, so one
    without the other, or none where the config (`config_file`) names nvfp4x as the
    `producer`, is a file whose metadata was damaged (a flipped byte in a key would
    otherwise switch the verification off), not a file from another writer."""
    has = [key in metadata for key in (CHECKSUMS_KEY, CONFIG_CHECKSUM_KEY)]
    if all(has):
        return
    if any(has):
        lost = CONFIG_CHECKSUM_KEY if has[0] else CHECKSUMS_KEY
        why = f"it has one of nvfp4x's two checksum entries but not `{lost}`"
    elif producer == "nvfp4x":
        why = f"`{config_file}` names nvfp4x as its producer, and nvfp4x records them"
    else:
        return  # another writer's file (Model Optimizer's): no checksums to verify
    raise ValueError(
        f"`{path}` carries no complete nvfp4x checksums, but {why}: its metadata is damaged "
        "and it cannot be verified. Export the checkpoint again, or restore it from a good "
        "copy."
    )


def serialise(tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> bytes:
    try:  # an optional dependency: only writing needs it
        import safetensors.numpy
    except ImportError as e:  # pragma: no cover - the test extra installs it
        raise ImportError(
            "nvfp4x.export_hf writes with the `safetensors` package: `pip install "
            "'nvfp4x[hf]'` (or `pip install safetensors`)."
        ) from e

    # The library writes each array's memory from its data pointer (`ctypes.data`, as
    # safetensors 0.8 does): a strided view (a transposed or sliced array, the way some
    # backends hand arrays to numpy) would be written in the wrong order. Every array is
    # made C-contiguous first, and its digest taken from the very buffer written.
    tensors = {name: np.require(a, requirements="C") for name, a in tensors.items()}
    digests = {name: digest(a.tobytes()) for name, a in tensors.items()}
    metadata = {**metadata, CHECKSUMS_KEY: json.dumps(digests, sort_keys=True)}
    return safetensors.numpy.save(tensors, metadata=metadata)
