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
  `scale_rounding="nearest"`, float32 or bfloat16 input: what `nvfp4x.to_nvfp4`,
  `nvfp4x.fake_quantize` and the GEMM operand quantiser (`NVFP4Spec.quantize`: every
  operand of `qdot`'s fprop, dgrad and wgrad, SR included) compute. The reference
  runs instead for: float16 input, `scale_rounding="up"`, stochastic rounding without
  a key (the reference raises), 16x1 blocks over an odd number of columns (the codes
  pack pairs along the rows), a 0-d or empty array, 16x16 tiles of an operand that is
  not 2-D, and `NVFP4Spec.quantize_saturated` (telemetry). wgrad's RHT runs before, in
  XLA (`nvfp4x.rht`); the kernel quantises its output.

The Pallas kernel is the default on GPUs (`DEFAULTS`): bit for bit the reference under
`interpret=True` on the CPU, it lowers for CUDA, and `tests/test_kernels.py` passed on
an H200 with it compiled there (after the fixes for tiles that overhang the array and
for the sign of `-0.0`, see `_pallas_nvfp4`). Other backends use the reference (the
CPU's XLA path is the faster there). The kernel's tile shapes and Triton parameters
are one table, `_pallas_nvfp4.TILINGS` (a GPU benchmark sweeps them). The tensor scale
comes from `_numerics._nvfp4.tensor_scales`, whose divisions are exact on every backend.
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
IMPLEMENTATIONS: dict[str, tuple[str, ...]] = {"nvfp4_quantize": ("xla", "pallas")}
#: The implementation each backend uses by default (backends not listed: `"xla"`).
DEFAULTS: dict[tuple[str, str], str] = {("nvfp4_quantize", "gpu"): "pallas"}
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
    """A kernel's NVFP4 result in the reference's padded layout (`to_blocks` grid), what
    was asked for (`run(output)`, see `_pallas_nvfp4.OUTPUTS`), the rest `None`: packed
    codes and E4M3 block scales (`"codes"`), the tensor decode scale (always), and the
    values (`"values"`: bfloat16 block values `e2m1 * scale_b`; `"dequantized"`: the
    dequantised values in the input's dtype)."""

    codes: Array | None
    scales: Array | None
    tensor_scale: Array
    values: Array | None


def nvfp4_quantizer(xp: Array, block, rounding: str, scale_rounding: str, amax, key):
    """A function `run(output) -> Quantized` quantising the padded array `xp` (blocked
    axes multiples of 16) in blocks `block` (`(1, 16)`, `(16, 16)`, or `(16, 1)`: 16 rows
    of a column) with the picked implementation and writing only `output` (`"codes"`,
    `"values"` or `"dequantized"`), or `None` where the reference is picked or the case
    is one the kernel does not cover (the caller runs the reference)."""
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

    def run(output: str) -> Quantized:
        rows, cols = xp.shape[:-1], xp.shape[-1]
        grid = (*rows, cols // BLOCK) if block == ROW_BLOCK else (*rows[:-1], rows[-1] // 16)
        if block != ROW_BLOCK:
            grid = (*grid, cols // block[1])
        seed = None if key is None else jax.random.bits(key, (2,), jnp.uint32)
        out, scale_bits, s_dec = _pallas_nvfp4.quantize_2d(
            xp.reshape(-1, cols),
            None if amax is None else jnp.asarray(amax, jnp.float32),
            seed,
            block=block,
            rounding="stochastic" if rounding == "stochastic" else "nearest",
            output=output,
            interpret=backend() != "gpu",
        )
        if scale_bits is None:
            return Quantized(None, None, s_dec, out.reshape(xp.shape))
        scales = jax.lax.bitcast_convert_type(scale_bits, jnp.float8_e4m3fn).reshape(grid)
        return Quantized(out.reshape(*rows, cols // 2), scales, s_dec, None)

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
    _, _, s_dec, values = kernel("values")
    assert values is not None  # `kernel("values")` returns them
    values = values[tuple(slice(0, n) for n in moved.shape)]
    return (values if moved is a else jnp.moveaxis(values, -1, axis)), s_dec
