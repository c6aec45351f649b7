"""`Format`, the operand format a recipe names, and `FormatSpec`, what a format name
means: each format is one `FormatSpec` object, in a module of its own, registered by its
name. Nothing else in nvfp4x branches on format names or packed array types."""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .. import _kernels
from .._kernels._native import NativeOperand
from .._numerics._nvfp4 import ROUNDINGS, SCALE_ROUNDINGS
from ._dot import apply_scales

FORMATS: dict[str, str] = {}  # filled by `register`
"""The format names a [`nvfp4x.Format`][] accepts, each with a one-line description.
(Each format fills in its entry when it is registered, on `import nvfp4x`.)

```python
sorted(nvfp4x.FORMATS)   # ['bf16', 'float32', 'fp8_e4m3', 'fp8_e5m2', 'mxfp8', 'nvfp4']
nvfp4x.FORMATS["mxfp8"]  # 'FP8 E4M3 elements, E8M0 power-of-two scale per 32 elements'
```
"""

_SPECS: dict[str, "FormatSpec"] = {}


class FormatSpec:
    """What one format name means: how an operand is quantised, how a weight is packed
    (and into which packed array type), its storage cost and its saturation statistic.
    One instance per format name, registered with `register` (`_formats/__init__.py`
    registers the built-in ones); a [`nvfp4x.Format`][]
    (name, block, rounding) reads it as `fmt.spec`.

    Subclasses set the class attributes and override `quantize`, and `pack` /
    `quantize_saturated` where the format has them.
    """

    #: The format's name, as recipes and `nvfp4x.Format` spell it.
    name: str
    #: One line for `nvfp4x.FORMATS`.
    description: str
    #: Storage cost per element, block scales included (tensor scales not counted).
    bits_per_element: float
    #: The blocks a `Format` of this name may have, its default first (`None`: no blocks).
    blocks: ClassVar[tuple[tuple[int, int] | None, ...]] = (None,)
    #: The element roundings it implements.
    roundings: ClassVar[tuple[str, ...]] = ("nearest",)
    #: The block-scale roundings it implements.
    scale_roundings: ClassVar[tuple[str, ...]] = ("nearest",)
    #: Whether it is a scaled low-precision format (False: a plain dtype).
    quantised: ClassVar[bool] = True
    #: Whether `pack` takes a given tensor amax, so that a group of weights shares one
    #: tensor scale (the policy's `tensor_scale_groups`).
    shared_tensor_scale: ClassVar[bool] = False
    #: How its operands run in a native low-precision GEMM (`_kernels.native_gemm`):
    #: element dtype, block-scale dtype and block; None: no native GEMM.
    native: NativeOperand | None = None

    #: Whether it quantises pieces of an operand as the whole operand would
    #: (`quantize_piece`, `tensor_decode_scale`): the grouped GEMM's fast path
    #: (`_ragged.py`) quantises its token-side operands so, group by group; for other
    #: formats it runs the reference.
    quantizes_pieces: ClassVar[bool] = False

    #: Whether its quantised values, rounded to nearest, change sign with the operand
    #: (`quantize(-a) == -quantize(a)`, scales alike): a convolution's wgrad then
    #: quantises a transposed convolution's patch operand from canonical chunks and
    #: puts the others back with signs (`_conv.WgradPlan`); for other formats it
    #: quantises every distinct chunk.
    sign_symmetric: ClassVar[bool] = False

    def layouts_agree(self, fmt: "Format") -> bool:
        """Whether a weight quantised in `fmt` holds the same values in both GEMM layouts
        (fprop's `(n, k)` and dgrad's `(k, n)`), so that one quantised weight serves both:
        true for formats without blocks; a blocked format answers for its blocks."""
        return fmt.block is None

    def label(self, fmt: "Format") -> str:
        """How `str(fmt)` shows a format of this name."""
        return self.name

    def quantize(
        self, a: Float[Array, "..."], fmt: "Format", axis: int, key: jax.Array | None
    ) -> tuple[Array, Float[Array, ""] | None]:
        """`quantize_operand` for this format (see there)."""
        raise NotImplementedError

    def quantize_rht(
        self, a: Float[Array, "t n"], fmt: "Format", key: jax.Array | None
    ) -> tuple[Array, Float[Array, ""] | None]:
        """`quantize_rht_operand` for this format (see there): the fused kernels where
        they take it (`rht_kernel_request`), else the transform, then `quantize` along
        the rows."""
        request = self.rht_kernel_request(a, fmt, key)
        if request is not None and (fast := _kernels.rht_operand(*request)) is not None:
            return fast
        return self.quantize(_kernels.rht(a, axis=0), fmt, 0, key)

    def rht_kernel_request(
        self, a: Float[Array, "t n"], fmt: "Format", key: jax.Array | None
    ) -> tuple | None:
        """The arguments of `_kernels.rht_operand` for `quantize_rht(a, fmt, key)`
        where this format has fused kernels (`quantize_rht` and, for several operands
        at once, `quantize_rht_operands` ask them), else `None`."""
        return None

    def pack(self, w: Float[Array, "n k"], fmt: "Format", amax: Array | None = None) -> Any:
        """A 2-D weight in its storage form: a packed array, or a plain array for
        formats that are a dtype. `amax` (formats with `shared_tensor_scale`) replaces
        the weight's own amax."""
        return self.quantize(w, fmt, -1, None)[0]

    def quantize_saturated(
        self, a: Float[Array, "..."], fmt: "Format", axis: int, key: jax.Array | None
    ) -> tuple[Array, Float[Array, ""] | None, Bool[Array, "..."]]:
        """`quantize`'s `(values, scale)` and, from the same block computation, which of
        `a`'s elements it clamps (beyond the largest magnitude their block can hold):
        none for formats that never clamp a finite value below their range."""
        values, scale = self.quantize(a, fmt, axis, key)
        return values, scale, jnp.zeros(a.shape, jnp.bool_)

    def quantize_piece(
        self,
        a: Float[Array, "r w"],
        fmt: "Format",
        amax: Float[Array, ""],
        key: jax.Array | None,
        offset: Array,
        block: tuple[int, int],
    ) -> tuple[Array, Float[Array, ""]]:
        """A piece of a larger operand whose tensor amax is `amax` (a row, `block`
        `(1, b)`, or a chunk of `b` rows, `block` `(b, 1)`; `b` the format's block),
        quantised to what quantising the whole operand gives its elements; stochastic
        rounding draws its thresholds at `offset`, the piece's first flat index in the
        (block-padded) operand. Formats with `quantizes_pieces` implement it.

        **Returns:** `(values, tensor decode scale)`, `values` in bfloat16."""
        raise NotImplementedError(f"Format `{self.name}` does not quantise pieces.")

    def tensor_decode_scale(self, amax: Float[Array, "*batch"]) -> Float[Array, "*batch"]:
        """The float32 tensor decode scale this format gives a tensor of amax `amax`
        (formats with `quantizes_pieces`)."""
        raise NotImplementedError(f"Format `{self.name}` has no tensor scale from an amax.")

    def packed_gemm(
        self,
        x: Array,
        x_scale: Array | None,
        w: Any,
        implementation: str,
        layer: Array | None = None,
    ) -> Float[Array, "*m n"] | None:
        """`x @ w.T` times `x_scale` and `w`'s tensor scale, in float32, for the 2-D
        packed weight `w` (this format's packed array), by a kernel that decodes `w`
        inside the GEMM (`_kernels.frozen_gemm`'s `implementation`); None where the
        format or the case has none (the caller decodes the weight). With `layer` (an
        int32 scalar), `w` is a stack of 2-D weights `(layers, n, k)` and the product is
        with its layer `layer`, read from the stack by the kernel (no copy of the
        slice); None where the kernel cannot (the caller slices). `packed_product` with
        its scales applied."""
        got = self.packed_product(x, w, implementation, layer)
        return None if got is None else apply_scales(got[0], x_scale, got[1])

    def packed_product(
        self, x: Array, w: Any, implementation: str, layer: Array | None = None
    ) -> tuple[Float[Array, "*m n"], Array | None] | None:
        """`packed_gemm` before its scales: `(x @ w.T, w's tensor scale)` (the product in
        float32 up to float32 summation order; the scale None for a format without one),
        for the 2-D packed weight `w` (or, with `layer`, that layer of a stack) by a
        kernel decoding it inside the GEMM; None where the format or the case has none.
        (Frozen experts run it per expert, then scale each token's row by its own
        group's scales.)"""
        return None

    def chunked_gemm(
        self, x: Array, x_scale: Array | None, w: Any, tie: Callable[[Array], Array]
    ) -> Float[Array, "*m n"] | None:
        """The few-token decoder: `x @ w.T` times `x_scale` and `w`'s tensor scale as
        `chunked_dot` (a few tokens on a CPU) on the 2-D packed weight `w`, each chunk of
        it decoded inside the loop, so that only the packed bytes are read (the same
        bits as `chunked_dot` on `w.operand()`'s values); None where the format has no
        such decoder (the caller decodes the weight whole). `tie` is applied to what it
        decodes before the loop (the frozen layer ties that to its input)."""
        return None


def register(spec: FormatSpec) -> FormatSpec:
    """Make a format name known to `nvfp4x.Format` (and list it in `nvfp4x.FORMATS`)."""
    if spec.name in _SPECS:
        raise ValueError(f"A format named `{spec.name}` is registered already.")
    _SPECS[spec.name] = spec
    FORMATS[spec.name] = spec.description
    return spec


def _which(attribute: str, value: str) -> str:
    """The formats whose `attribute` holds `value`, for error messages: "`nvfp4`"."""
    names = [n for n, s in _SPECS.items() if value in getattr(s, attribute)]
    return ", ".join(f"`{n}`" for n in names)


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

    Raises `TypeError` for a `name` that is not a string, and `ValueError` for an
    unknown name, rounding or scale rounding, a block the
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
        if not isinstance(self.name, str):
            raise TypeError(
                f"`Format(name)` must be a format name (a string), got "
                f"{type(self.name).__name__} `{self.name!r:.40}`; use one of {sorted(FORMATS)}."
            )
        spec = _SPECS.get(self.name)
        if spec is None:
            raise ValueError(f"Unknown format `{self.name!r}`; use one of {sorted(FORMATS)}.")
        block = spec.blocks[0] if self.block is None else self.block
        ints = isinstance(block, tuple | list) and all(
            isinstance(b, int) and not isinstance(b, bool) for b in block
        )
        if block is not None and not ints:
            raise ValueError(f"`block={self.block!r}` must be a tuple of two ints, e.g. `(1, 16)`.")
        block = None if block is None else tuple(block)
        if block not in spec.blocks:
            raise ValueError(
                f"`block={self.block!r}` is not valid for format `{self.name}`; allowed: "
                f"{spec.blocks}."
            )
        object.__setattr__(self, "block", block)
        if not isinstance(self.rounding, str) or self.rounding not in ROUNDINGS:
            raise ValueError(f"`rounding={self.rounding!r}` is unknown; use one of {ROUNDINGS}.")
        if self.rounding not in spec.roundings:
            raise ValueError(
                f"Stochastic rounding is implemented for {_which('roundings', self.rounding)} "
                f"only, not `{self.name}`."
            )
        if not isinstance(self.scale_rounding, str) or self.scale_rounding not in SCALE_ROUNDINGS:
            raise ValueError(
                f"`scale_rounding={self.scale_rounding!r}` is unknown; use one of "
                f"{SCALE_ROUNDINGS}."
            )
        if self.scale_rounding not in spec.scale_roundings:
            owners = _which("scale_roundings", self.scale_rounding)
            raise ValueError(
                f"`scale_rounding={self.scale_rounding!r}` applies to {owners}'s E4M3 block "
                f"scales only, not `{self.name}`; leave it at 'nearest'."
            )

    @property
    def spec(self) -> FormatSpec:
        """What the format's name means (its quantiser, packing, costs)."""
        return _SPECS[self.name]

    @property
    def quantised(self) -> bool:
        """True for the scaled low-precision formats (`nvfp4`, `mxfp8`, `fp8_e4m3`,
        `fp8_e5m2`); False for `bf16` and `float32`."""
        return self.spec.quantised

    def __str__(self) -> str:
        return self.spec.label(self)

    @property
    def bits_per_element(self) -> float:
        """Storage cost per element, scales included (tensor scales not counted)."""
        return self.spec.bits_per_element


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
    return fmt.spec.quantize(a, fmt, axis, key)


def quantize_rht_operand(
    a: Float[Array, "t n"],
    fmt: Format | None,
    key: jax.Array | None = None,
) -> tuple[Array, Float[Array, ""] | None]:
    """`quantize_operand(nvfp4x.rht(a, axis=0), fmt, axis=0, key)` for a 2-D operand
    (wgrad's, tokens first), bit for bit: the rows padded to a multiple of 16 by the
    transform, so `values` has that many rows. Where `_kernels` picks a fused kernel
    for the format (`"rht_operand"`), the transformed operand is never written whole."""
    if fmt is None:
        return _kernels.rht(a, axis=0), None
    return fmt.spec.quantize_rht(a, fmt, key)


def quantize_rht_operands(
    requests: list[tuple[Array, Format | None, jax.Array | None]],
) -> Sequence[tuple[Array, Float[Array, ""] | None]]:
    """`[quantize_rht_operand(a, fmt, key) for a, fmt, key in requests]`, bit for bit;
    where the fused kernels take every operand (`FormatSpec.rht_kernel_request`), their
    parameters are made once for all (`_kernels.rht_operands`: wgrad's two operands
    then cost XLA one exact scalar prologue to compile instead of two)."""
    kernel = [None if f is None else f.spec.rht_kernel_request(a, f, k) for a, f, k in requests]
    ready = len(requests) > 1 and all(r is not None for r in kernel)
    if ready and (fast := _kernels.rht_operands(kernel)) is not None:
        return list(fast)
    return [quantize_rht_operand(a, fmt, key) for a, fmt, key in requests]
