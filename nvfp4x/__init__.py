"""nvfp4x: NVIDIA's NVFP4 format and training recipe for any Equinox model."""

import importlib.metadata

from . import _telemetry as telemetry  # noqa: F401 - the `nvfp4x.telemetry` namespace
from ._array import NVFP4Array as NVFP4Array, fake_quantize as fake_quantize, to_nvfp4 as to_nvfp4
from ._caches import clear_caches as clear_caches
from ._checkpoint import load as load, save as save
from ._coverage import (
    CoverageReport as CoverageReport,
    CoverageRow as CoverageRow,
    coverage as coverage,
)
from ._dispatch import quantized as quantized
from ._formats import FORMATS as FORMATS, Format as Format
from ._formats._fp8 import FP8Array as FP8Array, to_fp8 as to_fp8
from ._formats._mxfp8 import MXFP8Array as MXFP8Array, to_mxfp8 as to_mxfp8
from ._freeze import freeze as freeze
from ._frozen import (
    FrozenLayerOfStack as FrozenLayerOfStack,
    FrozenLinear as FrozenLinear,
    FrozenWeight as FrozenWeight,
)
from ._gemm import qdot as qdot
from ._hf import (
    export_hf as export_hf,
    hf_names as hf_names,
    import_hf as import_hf,
)
from ._linear import QuantizedLinear as QuantizedLinear
from ._numerics._hadamard import hadamard_matrix as hadamard_matrix
from ._policy import Policy as Policy, Recipe as Recipe, recipes as recipes
from ._qweight import QWeight as QWeight
from ._rht import rht as rht
from ._scan import scan_layers as scan_layers
from ._sensitivity import (
    SensitivityReport as SensitivityReport,
    SensitivityRow as SensitivityRow,
    sensitivity as sensitivity,
)
from ._sharding import packed_sharding as packed_sharding, shard_packed as shard_packed
from ._summary import summary as summary
from ._training_state import TrainingCheckpointer as TrainingCheckpointer
from ._transform import (
    dequantize as dequantize,
    quantize as quantize,
    requantize as requantize,
)

try:
    __version__ = importlib.metadata.version("nvfp4x")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - source tree without install
    __version__ = "0.0.0"
