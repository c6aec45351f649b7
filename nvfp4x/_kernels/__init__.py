"""Per-backend implementations of nvfp4x's quantisers, and the one place that picks them.

Each operation has a reference implementation, `"xla"` (plain `jax.numpy`, in
`nvfp4x._numerics`), and may have faster ones for some backends: `"pallas"`, a Pallas
Triton kernel for GPUs (`_pallas_nvfp4`), and `"mosaic"`, a Pallas Mosaic kernel for
TPUs (`_tpu_quantize`); elsewhere a kernel runs interpreted, for the tests.
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
  not 2-D, and `NVFP4Spec.quantize_saturated` (telemetry). On TPUs the GEMM operand
  in 16x1 blocks (`output="values"`) runs `_tpu_operand`'s kernel (one vector register
  per block row by strided loads; `_tpu_quantize.OPERAND_KERNEL_BLOCKS`), the rest
  `_tpu_quantize`'s. wgrad's operands with the RHT: see `"rht_operand"`.
- `"frozen_gemm"`: a frozen layer's GEMM `x @ W.T` on its packed 2-D NVFP4 weight
  (`FrozenLinear`, `FrozenWeight` in its stored layout): `"xla"` decodes the weight
  and calls `scaled_dot` (on a CPU, a few tokens run `chunked_dot` on the packed
  codes); `"pallas"` (`_pallas_gemm`, Triton, for GPUs) decodes each tile of the
  weight in registers inside the GEMM; `"mosaic"` (`_tpu_frozen_gemm`, Pallas TPU)
  decodes tiles of the packed codes and scales in VMEM and multiplies them on the MXU;
  both equal the reference up to float32 summation order. Callers ask
  `frozen_gemm(...)`. `"mosaic"` is the default on TPUs: compiled on a TPU v5e
  (2026-12-05) it passed `tests/test_tpu_frozen_kernel.py` and ran a stack of 8
  frozen 8192x8192 W4A16 layers at 1.11-1.40x the time of bf16 weights from 1 to 4096
  tokens, where the XLA path took 2.2-15x (`benchmarks/tpu_frozen_check.py`). `"pallas"`
  is opt-in (`use("frozen_gemm", "pallas")`): it matched the reference in every test
  case on an H200, but its speed against the XLA path is not established yet (the one
  benchmark run timed both rows alike), so GPUs default to `"xla"`.
  Off their devices both kernels run interpreted (tests). Frozen experts
  (`ragged_dot` on a `FrozenWeight` stored `(E, out, in)`) at a few tokens run it on
  every expert (`_frozen.FEW_EXPERT_TOKENS`), each token keeping its expert's row.

- `"rht"`: the product of the random Hadamard transform (`_numerics._hadamard`'s
  16-point fast Walsh-Hadamard butterflies, in its defined order) where no chunk column
  needs scaling (the check stays XLA's): `"xla"` (`_plain`, elementwise operations) or
  `"mosaic"` (`_tpu_rht`, Pallas TPU: row `j` of 8 chunks one vector register by
  strided loads; the same bits), whose pick also runs the scaled path (`_guarded`) by
  its kernel (`_tpu_rht.transform_scaled`, the same bits: a kernel is far less for XLA
  to compile at every call site than `_guarded`'s XLA code). Callers ask `rht(...)`
  (`nvfp4x.rht`, wgrad's operands). `"mosaic"` is the default on TPUs: on a TPU v5e
  (2026-12-06) it equalled XLA's transform bit for bit (`tests/test_tpu_rht.py`, a
  layer's gradients included; `bench_accel.py`'s quantize rows) and took 3.1 ms on an
  8192x16384 float32 array against XLA's 15.7 ms (whose reshapes use one sublane of
  eight; the floor of a read and a write is 2.3 ms); a 2-block training step went from
  79.2 to 49.0 ms. Like the quantiser kernel it has no sharding rule, so XLA's SPMD
  partitioner would not split it (not measured: one chip).
- `"rht_operand"`: wgrad's operands with the RHT, transformed and quantised
  (`quantize_rht_operand`; NVFP4 in 1x16 or 16x1 blocks, `scale_rounding="nearest"`):
  `"xla"` runs `rht(...)` then the picked quantiser; `"mosaic"` (`_tpu_operand`) reads
  the operand once for `_hadamard.rht`'s special-column check and the transform's
  tensor amax (`rht_stats`), then transforms and quantises each tile in one kernel
  (`operand(..., rht=True)`), so the transformed operand is never written; where a
  column needs the transform's scaled path, the same two kernels with that path
  (`_hadamard.rht_scaled`'s bits) instead of the plain transform (`lax.cond`: the
  rarely taken branch is two kernels, no XLA code and no float32 transform; on a TPU
  v5e, 2026-12-07, `tests/test_tpu_operand.py` and `tests/test_tpu_rht.py` passed
  compiled, and the 2-block step below took 37.7 ms = 1.73x mixed bf16 against 39.0 ms
  = 1.79x with the branch as XLA batches of the scaled transform's kernel then the
  quantiser, compiling in 28.7 s against 32.3 s, its temporaries 1,637 MiB against
  1,736; inside mixed bf16 645 MiB = 1.68x against 712 MiB = 1.85x).
  The same bits (`tests/test_tpu_operand.py`, whole on a TPU v5e, 2026-12-06: the
  kernels' reference cases and a layer's gradients with the fused operands bit for bit
  those with the transform and quantiser apart). `"mosaic"` is the default on TPUs:
  there (8192x8192 float32) the kernel with the transform took 1.43 ms (1.28x the floor
  of one read and one bfloat16 write) and `rht_stats` 1.24 ms, against 2.53 ms for the
  RHT kernel then the quantiser kernel with the amax given
  (`benchmarks/tpu_operand_check.py`), and the 2-block training step of
  `bench_accel.py --lean --only train` took 38.3 ms against 45.3 ms (1.76x against
  2.09x mixed bf16), compiling in 42.3 s against 26.6 s (the kernels' groups in a loop,
  `_tpu_operand.LOOPED`; unrolled, 51.9 s; then the `cond`'s other branch still held
  `rht(...)` with the transform's kernel, since dropped: not yet measured there).
  Callers ask `rht_operand(...)` (`NVFP4Spec.quantize_rht`).

The Mosaic quantiser (`_tpu_quantize`) is the default on TPUs: bit for bit the reference
in `tests/test_tpu_kernels.py` in the TPU interpreter (`pltpu.InterpretParams()`) on the
CPU, and compiled on a TPU v5e (2026-12-05) bit for bit the XLA path on every case of
`benchmarks/tpu_quantize_check.py`, 2.2-5x faster than it there. Its tile shapes are one
table, `_tpu_quantize.TILINGS`.

The Pallas quantiser is the default on GPUs (`DEFAULTS`): bit for bit the reference under
`interpret=True` on the CPU, it lowers for CUDA, and `tests/test_kernels.py` passed on
an H200 with it compiled there (after the fixes for tiles that overhang the array and
for the sign of `-0.0`, see `_pallas_nvfp4`). CPUs use the reference (the
CPU's XLA path is the faster there). The kernel's tile shapes and Triton parameters
are one table, `_pallas_nvfp4.TILINGS` (a GPU benchmark sweeps them). The tensor scale
comes from `_numerics._nvfp4.tensor_scales`, whose divisions are exact on every backend.

The GEMMs (`_native`; each caller falls back to the emulated GEMM, `scaled_dot` on
bfloat16 or float32 operands, wherever `None` comes back):

- `"gemm_operands"`: the operand dtype of the emulated GEMMs of a layer that allows
  the fast path (`fast=True`): `"float32"` (the reference) or `"bfloat16"` (quantised
  values are exact in both; only float32 summation order differs). Default `"bfloat16"`
  where the device multiplies it natively (GPUs, TPUs, CPUs with bf16 instructions),
  else `"float32"`; the environment variable `NVFP4X_GEMM_DTYPE` (`auto`, `bfloat16`,
  `float32`) overrides the default, `use` overrides both.
- `"fp8_gemm"`: a GEMM of two per-tensor-scaled FP8 operands (the `fp8` recipe's
  fprop, dgrad, wgrad): `"xla"` (emulated) or `"native"` (`lax.dot_general` of the
  `float8_e4m3fn`/`float8_e5m2` operands, accumulated in float32, which XLA:GPU runs
  as a cuBLASLt FP8 GEMM). Opt-in, `"xla"` by default everywhere: on an H200 the
  native GEMMs made the `fp8` recipe's training step no faster (17.08 ms against
  17.08 ms emulated) and the 8192^3 forward slower (2.03 ms against 1.94 ms), and their
  results differed from the emulated GEMM's by more than float32 summation order
  (two tests, marked there). Those dots ran at DEFAULT precision, for which XLA:GPU
  asks cuBLASLt for FP8 fast accumulation; they now ask HIGHEST (float32 accumulation),
  not yet measured on a GPU. `DEVICE_DEFAULTS` holds the rule for when it is.
- `"block_scaled_gemm"`: a GEMM of two NVFP4 or two MXFP8 operands: `"xla"`
  (emulated), `"scaled_matmul"` (`jax.nn.scaled_matmul`: cuDNN's block-scaled GEMM on
  Blackwell; CUDA and ROCm only) or `"lax_scaled_dot"` (`jax.lax.scaled_dot`, which
  XLA decomposes where it has no native form: the same operands, on any backend, for
  the tests). Default `"scaled_matmul"` on CUDA devices of compute capability 10.x and
  12.x (Blackwell). Never run on a Blackwell GPU: the defaults there are untested.

A layer with `fast=False` runs the float32 reference whatever is picked here.
"""

import contextlib
import functools
import os
import re
from collections.abc import Callable, Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._numerics import _hadamard
from .._numerics._constants import BLOCK, GOLDEN_RATIO_32, ROW_BLOCK, TILE
from .._numerics._nvfp4 import pad_to_blocks
from .._numerics._threefry import seed_words
from ._native import NativeOperand, block_scaled_dot, fp8_dot

#: The implementations of each operation, the reference (`"xla"`) first.
IMPLEMENTATIONS: dict[str, tuple[str, ...]] = {
    "nvfp4_quantize": ("xla", "pallas", "mosaic"),
    "gemm_operands": ("float32", "bfloat16"),
    "fp8_gemm": ("xla", "native"),
    "block_scaled_gemm": ("xla", "scaled_matmul", "lax_scaled_dot"),
    "frozen_gemm": ("xla", "pallas", "mosaic"),
    "rht": ("xla", "mosaic"),
    "rht_operand": ("xla", "mosaic"),
}
#: The implementation each backend uses by default (backends not listed: `"xla"`).
DEFAULTS: dict[tuple[str, str], str] = {
    ("nvfp4_quantize", "gpu"): "pallas",
    ("nvfp4_quantize", "tpu"): "mosaic",
    ("frozen_gemm", "tpu"): "mosaic",
    ("rht", "tpu"): "mosaic",
    ("rht_operand", "tpu"): "mosaic",
}
#: The NVFP4 quantiser kernels, by implementation name, and the backend each compiles for
#: (elsewhere it runs interpreted: slow, for tests): `"pallas"` (`_pallas_nvfp4`, Pallas
#: Triton) and `"mosaic"` (`_tpu_quantize`, Pallas Mosaic).
KERNELS: dict[str, str] = {"pallas": "gpu", "mosaic": "tpu"}
#: The blocks the NVFP4 kernels take: `(16, 1)` is 16 rows of one column (an
#: operand quantised along its leading axis).
KERNEL_BLOCKS = (ROW_BLOCK, TILE, (BLOCK, 1))
#: The input dtypes the Pallas NVFP4 kernel takes.
PALLAS_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

#: Whether CUDA devices with FP8 tensor cores (compute capability 8.9 or more) run the
#: `fp8` recipe's GEMMs natively by default: not until the native GEMM measures faster
#: and within tolerance on a GPU (see the module docstring); `use` opts in.
NATIVE_FP8_BY_DEFAULT = False

#: Defaults that depend on the device, asked after `DEFAULTS`: `(op, backend) -> a
#: function of the CUDA compute capability (`capability()`) giving the implementation.
DEVICE_DEFAULTS: dict[tuple[str, str], Callable[[str | None], str]] = {
    ("gemm_operands", "gpu"): lambda cc: "bfloat16",
    ("gemm_operands", "tpu"): lambda cc: "bfloat16",
    ("gemm_operands", "cpu"): lambda cc: "bfloat16" if _cpu_multiplies_bf16() else "float32",
    ("fp8_gemm", "gpu"): lambda cc: (
        "native" if NATIVE_FP8_BY_DEFAULT and _at_least(cc, (8, 9)) else "xla"
    ),
    ("block_scaled_gemm", "gpu"): lambda cc: "scaled_matmul" if _major(cc) in (10, 12) else "xla",
}
#: The environment variable that overrides the default of `"gemm_operands"`.
GEMM_DTYPE_ENV = "NVFP4X_GEMM_DTYPE"

_overrides: dict[str, str] = {}


def capability() -> str | None:
    """The CUDA compute capability of the default device, as a string such as `"9.0"`
    (an H100/H200) or `"10.0"` (a B200); `None` on other devices (CPUs, TPUs, ROCm).
    (Tests mock this function to test the choices for GPUs they do not have.)"""
    return _device_capability()


@functools.cache
def _device_capability() -> str | None:
    device = jax.devices()[0]
    cc = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or not isinstance(cc, str):
        return None
    return cc if re.fullmatch(r"\d+\.\d+", cc) else None


def _version(cc: str | None) -> tuple[int, int] | None:
    return None if cc is None else (int(cc.split(".")[0]), int(cc.split(".")[1]))


def _at_least(cc: str | None, least: tuple[int, int]) -> bool:
    version = _version(cc)
    return version is not None and version >= least


def _major(cc: str | None) -> int | None:
    version = _version(cc)
    return None if version is None else version[0]


@functools.cache
def _cpu_multiplies_bf16() -> bool:
    """Whether this CPU has bfloat16 dot-product instructions (x86 AVX512-BF16 or AMX,
    Arm BF16). Without them XLA:CPU converts bfloat16 operands in software, which is
    slower than multiplying in float32."""
    try:
        with open("/proc/cpuinfo") as f:
            words = set(f.read().split())
    except OSError:
        return False
    return bool(words & {"avx512_bf16", "amx_bf16", "bf16"})


def _from_environment(op: str) -> str | None:
    """`NVFP4X_GEMM_DTYPE`'s choice for `"gemm_operands"` (None: `auto` or unset)."""
    if op != "gemm_operands":
        return None
    choice = os.environ.get(GEMM_DTYPE_ENV, "auto")
    if choice == "auto":
        return None
    if choice not in IMPLEMENTATIONS[op]:
        raise ValueError(
            f"{GEMM_DTYPE_ENV}={choice!r} is not a GEMM operand dtype; use 'auto' (the "
            "default), 'bfloat16' or 'float32'."
        )
    return choice


def backend() -> str:
    """The backend code is traced for: `"cpu"`, `"gpu"` (CUDA or ROCm) or `"tpu"`."""
    name = jax.default_backend()
    return "gpu" if name in ("gpu", "cuda", "rocm") else name


def materialized(a: Array) -> Array:
    """`a`, bit for bit, computed once for readers that would each compute it again.
    XLA:CPU fuses an elementwise producer (the XLA quantiser's element loop) into every
    gather that reads it, so a gather that reads each value several times (a
    convolution's wgrad operand) runs the quantiser as often; it does not fuse a
    `reduce_window`, through which `a` goes there (a max of each value's bits with the
    lowest integer). Elsewhere `a` as it is: there the NVFP4 quantisers are kernels,
    which XLA does not fuse (other formats' there: not measured)."""
    if backend() != "cpu":
        return a
    itype = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[a.dtype.itemsize]
    lowest = jnp.iinfo(itype).min
    b = jax.lax.bitcast_convert_type(a, itype)
    pair = jnp.stack([b, jnp.full_like(b, lowest)], axis=-1)
    window = (1,) * b.ndim + (2,)
    m = jax.lax.reduce_window(pair, jnp.array(lowest, itype), jax.lax.max, window, window, "VALID")
    return jax.lax.bitcast_convert_type(m[..., 0], a.dtype)


def pick(op: str, on: str | None = None) -> str:
    """The implementation of `op` for backend `on` (default: `backend()`): an override
    from `use`, else (`"gemm_operands"`) the environment's, else `DEFAULTS`, else
    `DEVICE_DEFAULTS` (asked with `capability()`), else the reference (the first of
    `IMPLEMENTATIONS[op]`)."""
    if op not in IMPLEMENTATIONS:
        raise ValueError(
            f"`{op}` is not an operation with implementations: {list(IMPLEMENTATIONS)}."
        )
    if op in _overrides:
        return _overrides[op]
    if (chosen := _from_environment(op)) is not None:
        return chosen
    on = on or backend()
    if (op, on) in DEFAULTS:
        return DEFAULTS[(op, on)]
    if (op, on) in DEVICE_DEFAULTS:
        return DEVICE_DEFAULTS[(op, on)](capability())
    return IMPLEMENTATIONS[op][0]


def picks() -> tuple[tuple[str, str], ...]:
    """Every operation's pick now, `((op, implementation), ...)`, and the backend traced
    for (`("backend", ...)`: whether a kernel runs compiled or interpreted): what an
    nvfp4x primitive records when it is bound (`_prims._Primitive`), and a cache key for
    code that asks `pick` when it is traced (`_prims.compiled`)."""
    return (*((op, pick(op)) for op in IMPLEMENTATIONS), ("backend", backend()))


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


@contextlib.contextmanager
def picked(chosen: tuple[tuple[str, str], ...]) -> Iterator[None]:
    """The implementations `chosen` (a `picks()` value, its `"backend"` entry ignored)
    picked in the `with` block: a primitive's impl, lowering and derivative rules run
    under the picks of its binding (`_prims`)."""
    with contextlib.ExitStack() as stack:
        for op, implementation in chosen:
            if op in IMPLEMENTATIONS:
                stack.enter_context(use(op, implementation))
        yield


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


def nvfp4_quantizer(
    xp: Array, block, rounding: str, scale_rounding: str, amax, key, offset: Array | int = 0
):
    """A function `run(output) -> Quantized` quantising the padded array `xp` (blocked
    axes multiples of 16) in blocks `block` (`(1, 16)`, `(16, 16)`, or `(16, 1)`: 16 rows
    of a column) with the picked implementation and writing only `output` (`"codes"`,
    `"values"` or `"dequantized"`), or `None` where the reference is picked or the case
    is one the kernel does not cover (the caller runs the reference). `offset`: the
    flat index of `xp`'s first element in a larger array whose stochastic rounding
    samples it draws (`_e2m1.uniform`'s `offset`)."""
    if (implementation := pick("nvfp4_quantize")) not in KERNELS:
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
    kernel = _kernel_module(implementation)

    def run(output: str) -> Quantized:
        rows, cols = xp.shape[:-1], xp.shape[-1]
        grid = (*rows, cols // BLOCK) if block == ROW_BLOCK else (*rows[:-1], rows[-1] // 16)
        if block != ROW_BLOCK:
            grid = (*grid, cols // block[1])
        # (`jax.random.bits(key, (2,))`, moved along by `offset`)
        seed = None if key is None else offset_seed(seed_words(key), offset)
        out, scale_bits, s_dec = kernel.quantize_2d(
            xp.reshape(-1, cols),
            None if amax is None else jnp.asarray(amax, jnp.float32),
            seed,
            block=block,
            rounding="stochastic" if rounding == "stochastic" else "nearest",
            output=output,
            interpret=backend() != KERNELS[implementation],
        )
        if scale_bits is None:
            return Quantized(None, None, s_dec, out.reshape(xp.shape))
        scales = jax.lax.bitcast_convert_type(scale_bits, jnp.float8_e4m3fn).reshape(grid)
        return Quantized(out.reshape(*rows, cols // 2), scales, s_dec, None)

    return run


def offset_seed(seed: Array, offset: Array | int) -> Array:
    """Seed words (two uint32) whose stochastic-rounding samples at flat index `i` are
    those of `seed` at `i + offset` (modulo 2^32): `_e2m1.uniform` hashes
    `i * GOLDEN_RATIO_32 + seed[0]`, so the offset moves into the first word. A kernel
    that numbers a piece's elements from 0 draws the larger array's samples with it."""
    step = jnp.asarray(offset).astype(jnp.uint32) * jnp.uint32(GOLDEN_RATIO_32)
    return seed.at[0].add(step)


def _kernel_module(implementation: str):
    """The module of an NVFP4 quantiser kernel (Pallas is imported only where a kernel
    is picked)."""
    if implementation == "mosaic":
        from . import _tpu_quantize

        return _tpu_quantize
    from . import _pallas_nvfp4

    return _pallas_nvfp4


def nvfp4_operand(a: Array, block, rounding: str, scale_rounding: str, axis: int, key):
    """`NVFP4Spec.quantize(a, ...)` (`(bfloat16 block values, s_dec)`) by the picked
    kernel, in the block layouts of `NVFP4Spec._blocks` (16x16 tiles of a 2-D weight;
    16x1 blocks along the second-to-last axis; else 1x16 along `axis`), or `None` where
    the reference runs (it also raises the errors for bad arguments)."""
    block = tuple(block)
    if pick("nvfp4_quantize") not in KERNELS or a.ndim == 0 or (block == TILE and a.ndim != 2):
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


def rht(x: Array, axis: int = 0) -> Array:
    """`_hadamard.rht(x, axis)` (the random Hadamard transform along `axis`, unchecked),
    its product by the picked implementation of `"rht"`: `"mosaic"` (`_tpu_rht`) where
    no chunk column needs scaling and the array is one the kernel takes, else XLA's
    `_plain`; the same bits either way."""
    if pick("rht") == "mosaic":
        compiled = backend() == "tpu"
        branches = dict(unguarded=_MOSAIC_RHT_BRANCHES[compiled], guarded=_MOSAIC_GUARDED[compiled])
        return _hadamard.rht(x, axis, **branches)
    return _hadamard.rht(x, axis)


def _in_primitive_interpret() -> bool | str:
    """`interpret` for a Mosaic kernel that runs inside nvfp4x's primitives: `False`
    (compiled) on a TPU; elsewhere `"plain"`, Pallas's generic interpreter, which (unlike
    the TPU interpreter, whose effects a primitive cannot lower) runs there, also under
    `lax.scan` (tests; they run the TPU interpreter on the kernels directly)."""
    return False if backend() == "tpu" else "plain"


def rht_operand(
    a: Array,
    block,
    rounding: str,
    scale_rounding: str,
    key,
) -> tuple[Array, Array] | None:
    """`NVFP4Spec.quantize(_hadamard.rht(a, axis=0), ..., axis=0, key)` of a 2-D operand
    (`(bfloat16 block values, s_dec)`, rows padded to a multiple of 16) by the fused
    TPU kernels where `"rht_operand"` picks `"mosaic"` (`_tpu_operand`: one read for
    the special-column check and the transform's amax, then the transform and the
    quantiser in one pass; where a column needs the transform's scaled path
    (`_hadamard.rht_scaled`), the same two kernels with that path instead:
    its amax, then it and the quantiser in one pass), or `None` where the caller runs
    the transform and its quantiser itself (the reference, 16x16 tiles,
    `scale_rounding="up"`, a shape the kernels do not take)."""
    out = rht_operands([(a, block, rounding, scale_rounding, key)])
    return None if out is None else out[0]


#: How `rht_operands` orders its operands' work (the same bits either way): `True`,
#: every operand's statistics first, then their parameters in one prologue call, then
#: the kernels; `False`, each operand's statistics, parameters and kernel in turn. XLA
#: schedules them differently: on a TPU v5e (2026-12-07, `benchmarks/bench_accel.py
#: --lean --only train`, which times both) the 2-block step took 37.1 ms and 1,412 MiB
#: of temporaries together against 39.0 ms and 1,667 MiB in turn (inside mixed bf16
#: 37.4 against 37.9 ms, 645 MiB both).
RHT_OPERANDS_TOGETHER = True


def rht_operands(requests) -> list[tuple[Array, Array]] | None:
    """`[rht_operand(*request) for request in requests]`, the same bits, or `None`
    where any of them would be `None` (the caller then quantises each its own way:
    wgrad's two operands), decided before any work."""
    if not all(_rht_applies(*request) for request in requests):
        return None  # (decided before any work: an eager call runs what it traces)
    if not RHT_OPERANDS_TOGETHER:  # (each operand's work in turn: one request at a time)
        return [out for request in requests for out in _rht_together([request])]
    return _rht_together(requests)


def _rht_together(requests) -> list[tuple[Array, Array]]:
    """`rht_operands` of requests the kernels take: every operand's statistics, their
    kernels' parameters in one prologue call, then each operand's kernel (the plain or
    the scaled transform's, by a `cond` on its statistics)."""
    from . import _tpu_quantize

    interpret = _in_primitive_interpret()
    prepared = [_rht_prepared(a, rounding, key, interpret) for a, _, rounding, _, key in requests]
    parameters = _tpu_quantize.kernel_parameters_many(
        [p.x for p in prepared],
        [p.amax for p in prepared],
        [p.seed for p in prepared],
        (BLOCK, 1),
        "values",
        interpret,
    )
    out = []
    for p, params in zip(prepared, parameters, strict=True):
        kernel = functools.partial(
            _rht_operand_branch, seed=p.seed, rounding=p.rounding, interpret=interpret
        )
        plain, scaled = (functools.partial(kernel, rht=r) for r in (True, "scaled"))
        out.append(jax.lax.cond(p.special, scaled, plain, p.operand, *params))
    return out


class _RhtPrepared(NamedTuple):
    x: Array  # the operand, rows padded to whole chunks, float32
    operand: Array  # what the `cond` takes: `x`, or with input fusion the operand as given
    special: Array  # whether a column needs the scaled transform
    amax: Array  # the tensor amax of the transform that runs
    seed: Array | None
    rounding: str


def _rht_applies(a: Array, block, rounding: str, scale_rounding: str, key) -> bool:
    """Whether the fused kernels take `rht_operand`'s request (the picks, the layout, the
    operand's shape once its rows are padded to whole chunks and it is widened to
    float32, `_hadamard.padded_rows`)."""
    if pick("rht_operand") != "mosaic" or a.ndim != 2 or a.size == 0:
        return False
    if tuple(block) == TILE or scale_rounding != "nearest" or a.dtype not in PALLAS_DTYPES:
        return False
    if rounding == "stochastic" and key is None:
        return False  # (the reference raises)
    from . import _tpu_operand

    return _tpu_operand.applies((-(-a.shape[0] // BLOCK) * BLOCK, a.shape[1]), jnp.float32)


def _rht_prepared(a: Array, rounding: str, key, interpret: bool | str) -> _RhtPrepared:
    """`rht_operand`'s first pass (`rht_stats`) for a request the kernels take
    (`_rht_applies`): what its kernel call needs but its parameters."""
    from . import _batching, _tpu_operand

    x = _hadamard.padded_rows(a)
    seed = None if key is None else seed_words(key)
    special, amax = _tpu_operand.rht_stats(x, interpret=interpret)
    # The rarely taken way (a column needs the scaled transform) is kernels, not XLA's
    # scaled transform: it is compiled at every call site, and a `cond`'s branch buffers
    # are allocated whether or not it runs (here only the kernels' output). The scaled
    # transform's amax is chosen first, so that the kernel's parameters are made once,
    # not once in each branch.
    # With input fusion (`_batching.INPUT_FUSION`) the `cond`s (this one and the kernel's,
    # `_rht_together`) take the operand as it is, their branches widening and padding it
    # themselves, where XLA can fuse that into the kernels' reads (no float32 copy of a
    # bfloat16 operand kept for a `cond`); else the one float32 copy made here.
    operand = a if _batching.INPUT_FUSION else x
    scaled_amax = functools.partial(_rht_scaled_amax, interpret=interpret)
    amax = jax.lax.cond(special, scaled_amax, _kept_amax, operand, amax)
    return _RhtPrepared(x, operand, special, amax, seed, rounding)


def _rht_scaled_amax(x: Array, amax: Array, *, interpret) -> Array:
    """The tensor amax of `_hadamard.rht_scaled(x)` (`rht_operand`'s rarely taken way;
    `amax`, the plain transform's, is the other branch's), `x` widened and padded
    (`_hadamard.padded_rows`: nothing to do where the caller did it)."""
    del amax
    from . import _tpu_operand

    x = _hadamard.padded_rows(x)
    return _tpu_operand.rht_stats(x, interpret=interpret, scaled=True)[1]


def _kept_amax(x: Array, amax: Array) -> Array:
    return amax


def _rht_operand_branch(x: Array, *parameters: Array, seed, rounding, interpret, rht):
    """`_tpu_operand.operand` with the transform `rht` and its parameters made, of `x`
    widened and padded (`_hadamard.padded_rows`: nothing to do where the caller did it)."""
    from . import _tpu_operand

    x = _hadamard.padded_rows(x)
    return _tpu_operand.operand(
        x, None, seed, rounding=rounding, interpret=interpret, rht=rht, parameters=parameters
    )


def _mosaic_rht_branch(chunks: Array, amax_bits: Array, interpret: bool | str) -> Array:
    """`_hadamard._unguarded(chunks, amax_bits)` (`_plain(chunks)`) by the TPU kernel,
    where it takes the `(chunks * 16, columns)` array."""
    from . import _tpu_rht

    c, rows, m = chunks.shape
    if not _tpu_rht.applies((c * rows, m)):
        return _hadamard._unguarded(chunks, amax_bits)
    flat = _tpu_rht.transform(chunks.reshape(c * rows, m), interpret=interpret)
    return flat.reshape(chunks.shape)


def _mosaic_guarded_branch(chunks: Array, amax_bits: Array, interpret: bool | str) -> Array:
    """`_hadamard._guarded(chunks, amax_bits)` by the TPU kernel
    (`_tpu_rht.transform_scaled`), where it takes the `(chunks * 16, columns)` array."""
    from . import _tpu_rht

    c, rows, m = chunks.shape
    if not _tpu_rht.applies((c * rows, m)):
        return _hadamard._guarded(chunks, amax_bits)
    flat = _tpu_rht.transform_scaled(chunks.reshape(c * rows, m), interpret=interpret)
    return flat.reshape(chunks.shape)


#: `_mosaic_guarded_branch` compiled (on a TPU: `True`) or interpreted, as
#: `_MOSAIC_RHT_BRANCHES` holds the other branch.
_MOSAIC_GUARDED = {
    True: functools.partial(_mosaic_guarded_branch, interpret=False),
    False: functools.partial(_mosaic_guarded_branch, interpret="plain"),
}

#: `_mosaic_rht_branch` compiled (on a TPU: `True`) or, off a TPU, in Pallas's generic
#: interpreter, which runs inside the layers' primitives (the tests run the TPU
#: interpreter directly). One function each: `lax.cond` keeps a branch's trace by the
#: function, so the two must not share one.
_MOSAIC_RHT_BRANCHES = {
    True: functools.partial(_mosaic_rht_branch, interpret=False),
    False: functools.partial(_mosaic_rht_branch, interpret="plain"),
}


def native_gemm(
    a: Array,
    a_native: NativeOperand | None,
    b: Array,
    b_native: NativeOperand | None,
    dims: tuple[tuple[int, ...], tuple[int, ...]],
) -> Array | None:
    """`dot_general(a, b, dims)` in float32 by the picked native low-precision GEMM
    (`_native`), or `None` where the emulated GEMM runs: the pick is `"xla"`, or the
    operands are not a pair it takes. `a` and `b` are quantised operands' exact values
    (without tensor scales), `a_native`/`b_native` their formats' `FormatSpec.native`
    (None: no native GEMM). Two per-tensor FP8 operands, at least one of them E4M3
    (cuBLASLt has no E5M2 x E5M2 GEMM), run by `"fp8_gemm"`; two NVFP4 or two MXFP8
    operands (the same block format) by `"block_scaled_gemm"`. One contraction axis."""
    if a_native is None or b_native is None or len(dims[0]) != 1:
        return None
    if a_native.block == b_native.block == 0:
        e4m3 = jnp.dtype(jnp.float8_e4m3fn)
        if e4m3 not in (a_native.element, b_native.element) or pick("fp8_gemm") == "xla":
            return None
        return fp8_dot(a, a_native, b, b_native, dims)
    if a_native != b_native or (implementation := pick("block_scaled_gemm")) == "xla":
        return None
    if implementation == "scaled_matmul" and backend() != "gpu":
        raise ValueError(
            f"`block_scaled_gemm` is `scaled_matmul` (`jax.nn.scaled_matmul`), which runs "
            f"on CUDA and ROCm GPUs only, but this GEMM is traced for `{backend()}`; use "
            "`nvfp4x._kernels.use('block_scaled_gemm', 'lax_scaled_dot')` there."
        )
    return block_scaled_dot(a, b, a_native, dims, implementation=implementation)


def frozen_gemm(
    x: Array,
    codes: Array,
    scale_bits: Array,
    block,
    shape: tuple[int, ...],
    implementation: str | None = None,
    layer: Array | None = None,
) -> Array | None:
    """`x @ W.T` in float32 before the tensor scales, for the 2-D NVFP4 weight `W` of
    `shape` held as `codes` and `scale_bits` (an `NVFP4Array`'s fields), by
    `implementation` (default: the picked one, `pick("frozen_gemm")`); or `None` where
    the reference is picked or the case is one the kernel does not cover (float64 or
    non-float activations, an empty product): the caller runs the reference. With
    `layer` (an int32 scalar), `codes` and `scale_bits` are a stack of layers' (a
    leading axis) and `W` is layer `layer` of it, read from the stack by the TPU kernel
    (`_tpu_frozen_gemm.frozen_matmul`'s `layer`); other implementations return `None`
    for it (the caller slices the stack).

    The kernel's products are exact for any GEMM dtype (`gemm_dtype`): bfloat16
    activations multiply as they are, wider ones as three exact bfloat16 parts; only
    the float32 summation order differs from `scaled_dot`'s."""
    implementation = implementation or pick("frozen_gemm")
    if implementation not in ("pallas", "mosaic"):
        return None
    block = tuple(block)
    n, k = shape
    wide = jnp.dtype(x.dtype).itemsize > 4 or not jnp.issubdtype(x.dtype, jnp.floating)
    if layer is not None and implementation != "mosaic":
        return None
    matrix = 2 if layer is None else 3
    if block not in (ROW_BLOCK, TILE) or codes.ndim != matrix or wide or x.size == 0 or n == 0:
        return None
    operand = "bfloat16" if x.dtype == jnp.bfloat16 else "float32"
    if implementation == "mosaic":
        from . import _tpu_frozen_gemm  # Pallas is imported only where a kernel is picked

        matmul = functools.partial(_tpu_frozen_gemm.frozen_matmul, layer=layer)
        interpret = _in_primitive_interpret()
    else:
        from . import _pallas_gemm

        matmul, interpret = _pallas_gemm.frozen_matmul, backend() != "gpu"
    out = matmul(
        x.reshape(-1, k),
        codes,
        scale_bits,
        block=block,
        n=n,
        operand=operand,
        interpret=interpret,
    )
    return out.reshape(*x.shape[:-1], n)
