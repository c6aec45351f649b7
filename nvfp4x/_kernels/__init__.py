"""Per-backend implementations of nvfp4x's quantisers, and the one place that picks them.

Each operation has a reference implementation, `"xla"` (plain `jax.numpy`, in
`nvfp4x._numerics`), and may have faster ones for some backends: `"pallas"`, a Pallas
Triton kernel for GPUs (`_pallas_nvfp4`; on a CPU it runs interpreted, for the tests).
Every one gives the reference's bits. Callers ask `nvfp4_quantizer(...)` (`to_nvfp4`,
`fake_quantize`)
and `nvfp4_operand(...)` (`NVFP4Spec.quantize`) when they trace; no flag is stored on
the data. `use(...)` overrides the choice for the code
traced inside it (tests, benchmarks): a function jitted before, outside it, keeps the
implementation it was traced with.

Operations:

- `"nvfp4_quantize"`: NVFP4 quantisation, 1x16 blocks, 16x16 tiles and 16x1 blocks
  (an operand along its leading axis), round to nearest or stochastic,
  `scale_rounding="nearest"`, float32 or bfloat16 input: what `nvfp4x.to_nvfp4` and the
  GEMM operand quantiser (`NVFP4Spec.quantize`) compute, without the RHT (the GEMM
  applies it before). Other cases (float16, `scale_rounding="up"`) take the reference.
- `"frozen_gemm"`: a frozen layer's GEMM `x @ W.T` on its packed 2-D NVFP4 weight
  (`FrozenLinear`, `FrozenWeight` in its stored layout): `"xla"` decodes the weight
  and calls `scaled_dot` (on a CPU, a few tokens run `chunked_dot` on the packed
  codes); `"pallas"` (`_pallas_gemm`) decodes each tile of the weight in registers
  inside the GEMM, equal up to float32 summation order. Callers ask `frozen_gemm(...)`.
  The default on GPUs (interpreted and lowered for CUDA in the tests, not yet run on a
  GPU); the CPU keeps the reference.

`nvfp4_quantize`'s defaults are `"xla"` on every backend: the Pallas kernel is bit for bit the
reference under `interpret=True` on the CPU and lowers for CUDA. Its one run on a GPU
(an H200) matched the reference on large arrays but failed on arrays that its tiles
overhang, and lost the sign of `-0.0` in block values (see `_pallas_nvfp4`); both are
fixed and guarded by tests of the kernel's body, but not yet run on a GPU, so it stays
opt-in until it has passed `tests/test_kernels.py` there (`with
nvfp4x._kernels.use("nvfp4_quantize", "pallas"): ...`). Making it the GPU default is
one entry in `DEFAULTS`, `{("nvfp4_quantize", "gpu"): "pallas"}`. The operand path's
tensor scale comes from `_numerics._nvfp4.tensor_scales`, whose divisions are exact on
every backend only once the reference's are (on an H200 XLA's float32 `/` was measured
an ULP off).
"""

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._numerics._constants import BLOCK, ROW_BLOCK, TILE
from .._numerics._nvfp4 import pad_to_blocks

#: The implementations of each operation, the reference (`"xla"`) first.
IMPLEMENTATIONS: dict[str, tuple[str, ...]] = {
    "nvfp4_quantize": ("xla", "pallas"),
    "frozen_gemm": ("xla", "pallas"),
}
#: The implementation each backend uses by default (backends not listed: `"xla"`).
DEFAULTS: dict[tuple[str, str], str] = {("frozen_gemm", "gpu"): "pallas"}
#: The blocks the Pallas NVFP4 kernel takes: `(16, 1)` is 16 rows of one column (an
#: operand quantised along its leading axis).
KERNEL_BLOCKS = (ROW_BLOCK, TILE, (BLOCK, 1))
#: The input dtypes the Pallas NVFP4 kernel takes.
PALLAS_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

_overrides: dict[str, str] = {}


def backend() -> str:
    """The backend code is traced for: `"cpu"`, `"gpu"` (CUDA or ROCm) or `"tpu"`."""
    name = jax.default_backend()
    return "gpu" if name in ("gpu", "cuda", "rocm") else name


def pick(op: str, on: str | None = None) -> str:
    """The implementation of `op` for backend `on` (default: `backend()`): an override
    from `use`, else `DEFAULTS`, else the reference `"xla"`."""
    if op not in IMPLEMENTATIONS:
        raise ValueError(
            f"`{op}` is not an operation with implementations: {list(IMPLEMENTATIONS)}."
        )
    if op in _overrides:
        return _overrides[op]
    return DEFAULTS.get((op, on or backend()), "xla")


@contextlib.contextmanager
def use(op: str, implementation: str) -> Iterator[None]:
    """Use `implementation` for `op` in code traced inside the `with` block (on a CPU the
    Pallas kernels run interpreted: slow, for tests)."""
    if implementation not in IMPLEMENTATIONS.get(op, ()):
        raise ValueError(
            f"`{implementation}` is not an implementation of `{op}`; "
            f"use one of {IMPLEMENTATIONS.get(op)}."
        )
    before = _overrides.get(op)
    _overrides[op] = implementation
    try:
        yield
    finally:
        if before is None:
            del _overrides[op]
        else:
            _overrides[op] = before


class Quantized(NamedTuple):
    """A kernel's NVFP4 result in the reference's padded layout (`to_blocks` grid):
    packed codes, E4M3 block scales, tensor decode scale, and the bfloat16 block values
    `e2m1 * scale_b` (`None` unless asked for; with `dequantize`, the dequantised values
    in the input's dtype)."""

    codes: Array
    scales: Array
    tensor_scale: Array
    values: Array | None


def nvfp4_quantizer(xp: Array, block, rounding: str, scale_rounding: str, amax, key):
    """A function `(values: bool, dequantize=False) -> Quantized` quantising the padded
    array `xp` (blocked
    axes multiples of 16) in blocks `block` (`(1, 16)`, `(16, 16)`, or `(16, 1)`: 16 rows
    of a column) with the picked implementation, or `None` where the reference is picked
    or the case is one the kernel does not cover (the caller runs the reference)."""
    if pick("nvfp4_quantize") != "pallas":
        return None
    block = tuple(block)
    if (
        block not in KERNEL_BLOCKS
        or xp.ndim < (1 if block == ROW_BLOCK else 2)
        or scale_rounding != "nearest"
        or xp.dtype not in PALLAS_DTYPES
        or xp.size == 0
        or xp.shape[-1] % 2  # (16x1 blocks: the codes pack pairs along the rows)
        or (rounding == "stochastic" and key is None)  # the reference raises
    ):
        return None
    from . import _pallas_nvfp4  # Pallas is imported only where a kernel is picked

    def run(values: bool, dequantize: bool = False) -> Quantized:
        rows, cols = xp.shape[:-1], xp.shape[-1]
        grid = (*rows, cols // BLOCK) if block == ROW_BLOCK else (*rows[:-1], rows[-1] // 16)
        if block != ROW_BLOCK:
            grid = (*grid, cols // block[1])
        seed = None if key is None else jax.random.bits(key, (2,), jnp.uint32)
        codes, scale_bits, s_dec, vals = _pallas_nvfp4.quantize_2d(
            xp.reshape(-1, cols),
            None if amax is None else jnp.asarray(amax, jnp.float32),
            seed,
            block=block,
            rounding="stochastic" if rounding == "stochastic" else "nearest",
            values=values,
            dequantize=dequantize,
            interpret=backend() != "gpu",
        )
        return Quantized(
            codes.reshape(*rows, cols // 2),
            jax.lax.bitcast_convert_type(scale_bits, jnp.float8_e4m3fn).reshape(grid),
            s_dec,
            None if vals is None else vals.reshape(xp.shape),
        )

    return run


def nvfp4_operand(a: Array, block, rounding: str, scale_rounding: str, axis: int, key):
    """`NVFP4Spec.quantize(a, ...)` (`(bfloat16 block values, s_dec)`) by the picked
    kernel, in the block layouts of `NVFP4Spec._blocks` (16x16 tiles of a 2-D weight;
    16x1 blocks along the second-to-last axis; else 1x16 along `axis`), or `None` where
    the reference runs (it also raises the errors for bad arguments)."""
    block = tuple(block)
    if pick("nvfp4_quantize") != "pallas" or a.ndim == 0 or (block == TILE and a.ndim != 2):
        return None  # (before any work: the reference path traces nothing more)
    moved, blk = a, block
    if block != TILE and a.ndim >= 2 and axis % a.ndim == a.ndim - 2:
        blk = (BLOCK, 1)
    elif block != TILE:
        moved = jnp.moveaxis(a, axis, -1)
    kernel = nvfp4_quantizer(pad_to_blocks(moved, blk), blk, rounding, scale_rounding, None, key)
    if kernel is None:
        return None
    _, _, s_dec, values = kernel(True)
    assert values is not None  # `kernel(True)` returns them
    values = values[tuple(slice(0, n) for n in moved.shape)]
    return (values if moved is a else jnp.moveaxis(values, -1, axis)), s_dec


def frozen_gemm(
    x: Array,
    codes: Array,
    scale_bits: Array,
    block,
    shape: tuple[int, ...],
    implementation: str | None = None,
) -> Array | None:
    """`x @ W.T` in float32 before the tensor scales, for the 2-D NVFP4 weight `W` of
    `shape` held as `codes` and `scale_bits` (an `NVFP4Array`'s fields), by
    `implementation` (default: the picked one, `pick("frozen_gemm")`); or `None` where
    the reference is picked or the case is one the kernel does not cover (float64 or
    non-float activations, an empty product): the caller runs the reference.

    The kernel's products are exact for any GEMM dtype (`gemm_dtype`): bfloat16
    activations multiply as they are, wider ones as three exact bfloat16 parts; only
    the float32 summation order differs from `scaled_dot`'s."""
    if (implementation or pick("frozen_gemm")) != "pallas":
        return None
    block = tuple(block)
    n, k = shape
    wide = jnp.dtype(x.dtype).itemsize > 4 or not jnp.issubdtype(x.dtype, jnp.floating)
    if block not in (ROW_BLOCK, TILE) or codes.ndim != 2 or wide or x.size == 0 or n == 0:
        return None
    from . import _pallas_gemm  # Pallas is imported only where a kernel is picked

    out = _pallas_gemm.frozen_matmul(
        x.reshape(-1, k),
        codes,
        scale_bits,
        block=block,
        n=n,
        operand="bfloat16" if x.dtype == jnp.bfloat16 else "float32",
        interpret=backend() != "gpu",
    )
    return out.reshape(*x.shape[:-1], n)
