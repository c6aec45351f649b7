"""Operand formats: what a recipe names for each GEMM operand, and how one is quantised.

A `Format` is a small immutable value (a name, a block layout, roundings). What a name
means is one `FormatSpec` object, in a module of its own here, registered by the name:
its operand quantisation, its packing for inference (into its packed array type), its
storage cost and its saturation statistic. Adding a format is adding such a module (and
registering its spec below).

`quantize_operand` turns an operand into `(values, scale)` with `values` the
block-scaled element values (exact in bfloat16 for every quantised format) and `scale`
the float32 tensor decode scale, so that the operand is `values * scale` and a GEMM
(`scaled_dot`) can apply `scale_a * scale_b` to its float32 accumulator, as Blackwell's
block-scaled GEMMs do.
"""

from ._dot import (
    GEMM_DTYPE_ENV as GEMM_DTYPE_ENV,
    batched_gemm_dtype as batched_gemm_dtype,
    fast_gemm_dtype as fast_gemm_dtype,
    gemm_dtype as gemm_dtype,
    scaled_dot as scaled_dot,
    widest_float as widest_float,
)
from ._fp8 import FP8_E4M3, FP8_E5M2
from ._mxfp8 import MXFP8
from ._nvfp4 import NVFP4
from ._plain import BF16, FLOAT32
from ._spec import (
    FORMATS as FORMATS,
    Format as Format,
    FormatSpec as FormatSpec,
    quantize_operand as quantize_operand,
    quantize_rht_operand as quantize_rht_operand,
    quantize_rht_operands as quantize_rht_operands,
    register as register,
)

# The formats nvfp4x knows, in the order `nvfp4x.FORMATS` lists them.
for _spec in (NVFP4, MXFP8, FP8_E4M3, FP8_E5M2, BF16, FLOAT32):
    register(_spec)
