"""Operand formats: what a recipe names for each GEMM operand, and how one is quantised.

A `Format` is a small immutable value. `quantize_operand` turns an operand into
`(values, scale)` with `values` the block-scaled element values (exact in bfloat16 for
every quantised format) and `scale` the float32 tensor decode scale, so that the operand
is `values * scale` and a GEMM can apply `scale_a * scale_b` to its float32 accumulator,
as Blackwell's block-scaled GEMMs do.
"""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from ._format._constants import BLOCK, MX_BLOCK
from ._format._fp8 import mx_pad, quantize_fp8, quantize_mxfp8
from ._format._nvfp4 import (
    SCALE_ROUNDINGS,
    from_blocks,
    pad_to_blocks,
    quantize_blocks,
    tensor_amax,
)

#: Format names a recipe may use, with what each is.
FORMATS = {
    "nvfp4": "FP4 E2M1 elements, E4M3 scale per 16 elements, float32 tensor scale",
    "mxfp8": "FP8 E4M3 elements, E8M0 power-of-two scale per 32 elements",
    "fp8_e4m3": "FP8 E4M3 with one current (amax) scale per tensor",
    "fp8_e5m2": "FP8 E5M2 with one current (amax) scale per tensor",
    "bf16": "bfloat16, no scaling",
    "float32": "float32, no quantisation",
}
"""The format names a [`nvfp4x.Format`][] accepts, each with a one-line description.

```python
sorted(nvfp4x.FORMATS)   # ['bf16', 'float32', 'fp8_e4m3', 'fp8_e5m2', 'mxfp8', 'nvfp4']
```
"""
QUANTISED = ("nvfp4", "mxfp8", "fp8_e4m3", "fp8_e5m2")


@dataclasses.dataclass(frozen=True)
class Format:
    """How one GEMM operand is stored: a format name, its block layout and rounding.

    **Arguments:**

    - `name`: one of `"nvfp4"`, `"mxfp8"`, `"fp8_e4m3"`, `"fp8_e5m2"`, `"bf16"`, `"float32"`.
    - `block`: for NVFP4, `(1, 16)` (16 elements along the GEMM's contraction axis) or
      `(16, 16)` (16x16 tiles of a weight: the same numbers in every GEMM). MXFP8 uses
      `(1, 32)`; the other formats have no blocks (`None`).
    - `rounding`: `"nearest"` or `"stochastic"` (NVFP4 only).
    - `scale_rounding`: how NVFP4's E4M3 block scales are rounded. `"nearest"` (default)
      is the spec's rule, bit for bit Blackwell's cast: a scale that rounds down lets the
      block's largest elements scale past 6, and they are clamped to 6, which biases
      stochastic rounding towards zero. `"up"` takes the smallest E4M3 scale with which
      no element of the block exceeds 6, so nothing is clamped and stochastic rounding
      is unbiased (`E[dequantised] == x`, up to float32 rounding); it is not what
      Blackwell's cast computes. It is allowed with either rounding (with
      `"nearest"` it trades clamping for a coarser grid) and for NVFP4 only.

    Raises `ValueError` for an unknown name, rounding or scale rounding, a block the
    format does not allow, or stochastic rounding or `scale_rounding="up"` of a format
    other than NVFP4.

    ```python
    fmt = nvfp4x.Format("nvfp4", block=(1, 16), rounding="stochastic")
    str(fmt), fmt.bits_per_element   # 'nvfp4 1x16, SR', 4.5
    nvfp4x.Format("mxfp8").block     # (1, 32)
    str(nvfp4x.Format("nvfp4", rounding="stochastic", scale_rounding="up"))
    # 'nvfp4 1x16, SR, scale up'
    ```
    """

    name: str
    block: tuple[int, int] | None = None
    rounding: str = "nearest"
    scale_rounding: str = "nearest"

    def __post_init__(self):
        if self.name not in FORMATS:
            raise ValueError(f"Unknown format `{self.name!r}`; use one of {sorted(FORMATS)}.")
        default = {"nvfp4": (1, BLOCK), "mxfp8": (1, MX_BLOCK)}.get(self.name)
        block = default if self.block is None else self.block
        ints = isinstance(block, tuple | list) and all(
            isinstance(b, int) and not isinstance(b, bool) for b in block
        )
        if block is not None and not ints:
            raise ValueError(f"`block={self.block!r}` must be a tuple of two ints, e.g. `(1, 16)`.")
        block = None if block is None else tuple(block)
        allowed = {"nvfp4": ((1, BLOCK), (BLOCK, BLOCK)), "mxfp8": ((1, MX_BLOCK),)}.get(
            self.name, (None,)
        )
        if block not in allowed:
            raise ValueError(
                f"`block={self.block!r}` is not valid for format `{self.name}`; allowed: {allowed}."
            )
        object.__setattr__(self, "block", block)
        if self.rounding not in ("nearest", "stochastic"):
            raise ValueError(
                f"`rounding={self.rounding!r}` is unknown; use 'nearest' or 'stochastic'."
            )
        if self.rounding == "stochastic" and self.name != "nvfp4":
            raise ValueError(
                f"Stochastic rounding is implemented for `nvfp4` only, not `{self.name}`."
            )
        if self.scale_rounding not in SCALE_ROUNDINGS:
            raise ValueError(
                f"`scale_rounding={self.scale_rounding!r}` is unknown; use one of "
                f"{SCALE_ROUNDINGS}."
            )
        if self.scale_rounding != "nearest" and self.name != "nvfp4":
            raise ValueError(
                f"`scale_rounding={self.scale_rounding!r}` applies to `nvfp4`'s E4M3 block "
                f"scales only, not `{self.name}`; leave it at 'nearest'."
            )

    @property
    def quantised(self) -> bool:
        """True for the scaled low-precision formats (`nvfp4`, `mxfp8`, `fp8_e4m3`,
        `fp8_e5m2`); False for `bf16` and `float32`."""
        return self.name in QUANTISED

    def __str__(self) -> str:
        if self.name == "nvfp4":
            sr = ", SR" if self.rounding == "stochastic" else ""
            up = ", scale up" if self.scale_rounding == "up" else ""
            return f"nvfp4 {self.block[0]}x{self.block[1]}{sr}{up}"
        return self.name

    @property
    def bits_per_element(self) -> float:
        """Storage cost per element, scales included (tensor scales not counted)."""
        return {
            "nvfp4": 4 + 8 / 16,
            "mxfp8": 8 + 8 / 32,
            "fp8_e4m3": 8.0,
            "fp8_e5m2": 8.0,
            "bf16": 16.0,
            "float32": 32.0,
        }[self.name]


def quantize_operand(
    a: Float[Array, "..."],
    fmt: Format | None,
    axis: int,
    key: jax.Array | None = None,
) -> tuple[Array, Float[Array, ""] | None]:
    """Quantise a GEMM operand whose contraction axis is `axis`, with the format's
    rounding and (NVFP4) scale rounding.

    **Returns:** `(values, scale)`: the operand is `values * scale`. `values` has `a`'s
    shape; it is bfloat16 for quantised formats (their values are exact there), `a` cast to the
    format's dtype otherwise (`a` itself for `fmt=None`); `scale` is `None` when the
    format has no tensor scale.
    """
    if fmt is None:
        return a, None
    if fmt.name == "bf16":
        return a.astype(jnp.bfloat16), None
    if fmt.name == "float32":
        return a.astype(jnp.float32), None
    if fmt.name in ("fp8_e4m3", "fp8_e5m2"):
        q, scale = quantize_fp8(a, fmt.name[4:], tensor_amax(a))
        return q.astype(jnp.bfloat16), scale
    if fmt.block == (BLOCK, BLOCK):
        if a.ndim != 2:
            raise ValueError(f"16x16 blocks need a 2-D operand (a weight), got shape {a.shape}.")
        xp = pad_to_blocks(a, fmt.block)
        q, sb, s_dec = quantize_blocks(xp, fmt.block, fmt.rounding, key, None, fmt.scale_rounding)
        vals = from_blocks(q * sb[..., :, None, :, None], fmt.block)
        return vals[: a.shape[0], : a.shape[1]].astype(jnp.bfloat16), s_dec
    moved = jnp.moveaxis(a, axis, -1)
    n = moved.shape[-1]
    if fmt.name == "mxfp8":
        q, scale = quantize_mxfp8(mx_pad(moved))
        vals = (q.reshape(*scale.shape, MX_BLOCK) * scale[..., None]).reshape(q.shape)
        return jnp.moveaxis(vals[..., :n], -1, axis).astype(jnp.bfloat16), None
    if a.ndim >= 2 and axis % a.ndim == a.ndim - 2:
        # Blocks down the columns (e.g. wgrad's token axis): no transpose needed.
        blk = (BLOCK, 1)
        xp = pad_to_blocks(a, blk)
        q, sb, s_dec = quantize_blocks(xp, blk, fmt.rounding, key, None, fmt.scale_rounding)
        vals = from_blocks(q * sb[..., :, None, :], blk)[..., : a.shape[-2], :]
        return vals.astype(jnp.bfloat16), s_dec
    xp = pad_to_blocks(moved, fmt.block)
    q, sb, s_dec = quantize_blocks(xp, fmt.block, fmt.rounding, key, None, fmt.scale_rounding)
    vals = from_blocks(q * sb[..., None], fmt.block)
    return jnp.moveaxis(vals[..., :n], -1, axis).astype(jnp.bfloat16), s_dec


def widest_float(*dtypes) -> jnp.dtype:
    """The widest of some float dtypes (no implicit promotion: works under strict mode)."""
    return max((jnp.dtype(d) for d in dtypes), key=lambda d: (d.itemsize, d == jnp.float16))


# --- the GEMM operand dtype: decided here, once per traced GEMM ---
#
# A layer's `fast` flag asks for the fast path or the float32 reference; `gemm_dtype`
# turns it into the operand dtype, once, when the GEMM is traced (`qdot` and the frozen
# layer's GEMM call it and pass the result to their primitives as the static parameter
# `dtype`); every function below the primitive receives that dtype and decides nothing.
# Quantised values are exact in bfloat16 and float32, so the choice changes only speed
# and float32 summation order.

GEMM_DTYPE_ENV = "NVFP4X_GEMM_DTYPE"


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


def fast_gemm_dtype() -> jnp.dtype:
    """The operand dtype of `fast=True` GEMMs: bfloat16 where the device multiplies it
    natively (GPUs, TPUs, CPUs with bf16 instructions), float32 on other CPUs.

    Override with the environment variable `NVFP4X_GEMM_DTYPE` (`auto`, `bfloat16` or
    `float32`), read when a GEMM is traced (by `gemm_dtype`).
    """
    choice = os.environ.get(GEMM_DTYPE_ENV, "auto")
    if choice == "bfloat16":
        return jnp.dtype(jnp.bfloat16)
    if choice == "float32":
        return jnp.dtype(jnp.float32)
    if choice != "auto":
        raise ValueError(
            f"{GEMM_DTYPE_ENV}={choice!r} is not a GEMM operand dtype; use 'auto' (the "
            "default), 'bfloat16' or 'float32'."
        )
    if jax.default_backend() != "cpu" or _cpu_multiplies_bf16():
        return jnp.dtype(jnp.bfloat16)
    return jnp.dtype(jnp.float32)


def gemm_dtype(fast: bool) -> jnp.dtype | None:
    """The operand dtype of a GEMM whose layer has this `fast` flag: `fast_gemm_dtype()`
    for `fast=True`, `None` (the float32 reference: operands promoted to float32 or
    wider) for `fast=False`. The one place the choice is made."""
    return fast_gemm_dtype() if fast else None


def batched_gemm_dtype(dtype: jnp.dtype | None) -> jnp.dtype | None:
    """The operand dtype of a GEMM that runs vmapped over independent problems (it then
    has batch dimensions): XLA:CPU multiplies bfloat16 with batch dimensions only in
    some layouts (elsewhere: "Unsupported element type for DotThunk: BF16 x BF16 =
    F32"), so on a CPU such GEMMs take float32 operands (exact for quantised values)."""
    if dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
        return jnp.dtype(jnp.float32)
    return dtype


def scaled_dot(
    a: Array,
    a_scale: ArrayLike | None,
    b: Array,
    b_scale: ArrayLike | None,
    dims: tuple[tuple[int, ...], tuple[int, ...]],
    *,
    dtype: jnp.dtype | None,
) -> Float[Array, "..."]:
    """`dot_general(a, b)` accumulated in float32, then times `a_scale * b_scale`.

    With a `dtype` (see `gemm_dtype`) and both operands in bfloat16 (quantised values
    always are: they are exact there), the product runs on `dtype` operands; otherwise
    (the reference, `dtype=None`) both are promoted to float32 or wider first. The two
    differ only in float32 summation order.
    """
    bf16 = jnp.dtype(jnp.bfloat16)
    if not (dtype is not None and a.dtype == bf16 and b.dtype == bf16):
        dtype = widest_float(a.dtype, b.dtype, jnp.float32)
    a, b = a.astype(dtype), b.astype(dtype)
    out = jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)
    scales = [s for s in (a_scale, b_scale) if s is not None]
    if len(scales) == 2:
        return out * (scales[0] * scales[1])
    return out * scales[0] if scales else out
