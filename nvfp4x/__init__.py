"""nvfp4x: NVIDIA's NVFP4 format and training recipe for any Equinox model."""

import importlib.metadata

from ._array import NVFP4Array as NVFP4Array, fake_quantize as fake_quantize, to_nvfp4 as to_nvfp4
from ._format._hadamard import hadamard_matrix as hadamard_matrix, rht as rht

try:
    __version__ = importlib.metadata.version("nvfp4x")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - source tree without install
    __version__ = "0.0.0"
