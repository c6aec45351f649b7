"""Quantised convolutions: a convolution is a GEMM whose contraction runs over the kernel
window and the input channels.

The contraction order is **window major, input channels minor**: the kernel's GEMM
matrix is `(out, window x in)` (`gemm_matrix`), a patch of the input is its window's
pixels one after another, each pixel's channels together (`conv_patches`). Training,
`freeze`, telemetry, coverage and the checkpoint and HF paths all read a kernel through
`gemm_matrix` / `kernel_from_matrix`, so they agree on which elements share a block.

Two ways to run the same GEMMs (fprop `Q(patches) @ Q(W).T`, dgrad `Q(dy) @ Q(W)` then
back to the input, wgrad `Q(dy).T @ Q(patches)`):

- the **reference**, `conv_gemm` with `qdot` on the patches: the input's patches are
  strided slices of the input (exact; their transpose carries dgrad back to the input),
  one `(tokens, window x in)` GEMM operand.
- the **fast path**, when each 16-element block of a patch row (NVFP4 1x16; 32 for
  MXFP8; any format without blocks) holds channels of one input pixel, i.e. when the
  input channels (per feature group) are a multiple of the block: then quantising the
  patches along their contraction is quantising the input once, per pixel along its
  channels, with the tensor amax of the pixels some patch reads (`covered`). fprop and
  its tangents run as a real `lax.conv_general_dilated` on the quantised operands
  (exact products, float32 accumulation), dgrad (dy blocked along out channels per
  output pixel, as in the reference) as the convolution's transpose; wgrad contracts
  over tokens (blocks of 16 output pixels) on the reference's quantised operands,
  `Q(H dy)` and `Q(H patches)` value for value, without building the patch matrix:
  its distinct 16-token chunks are gathered from the input and transformed and
  quantised once each, and for a transposed convolution (dilated input, mostly zero
  patches) each tap multiplies only the chunks where it reads input (`WgradPlan`);
  where the output rows are whole chunks and the leading axes have stride 1 (a 3x3
  convolution of 16- or 32-pixel-wide images), the input is quantised once per tap of
  the last axis and `Q(H dy)` placed at each leading tap's rows: one GEMM, no gather
  (`shifts_rows`).
  Only float32 summation order differs from the reference (the tests bound it, and
  compare the quantised operands directly). The primitives (`conv_qdot_p`,
  `conv_dgrad_p`, `conv_wgrad_p`, the JVP's `conv_tx_p` / `conv_tw_p`) batch as
  `qdot`'s do: a vmapped axis of the input folds into its images (one tensor scale
  over the whole batch).

A layer with telemetry (`probe`) or an `enabled` mask runs the reference.
"""

import contextlib
import dataclasses
import functools
import itertools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, ArrayLike

from . import _kernels
from ._checks import layer_name, layer_operand
from ._formats import batched_gemm_dtype, gemm_dtype, quantize_operand, scaled_dot, widest_float
from ._formats._dot import apply_scales, dot_precision
from ._gemm import (
    _make_primitive,
    def_gemm_rules,
    grad_key,
    needs_key,
    quantised_dot,
    quantize_weight,
    wgrad_quantised,
)
from ._numerics._constants import BLOCK
from ._policy import Recipe

# --- the kernel as a GEMM matrix ---


def gemm_matrix(kernel: Array, kernel_axes: tuple[int, ...], groups: int) -> Array:
    """A convolution kernel (possibly stacked) as its GEMM's weight: `(stack..., out,
    window x in)`, or `(stack..., groups, out / groups, window x in / groups)` for a
    grouped convolution (each group its own GEMM). `kernel_axes` gives the roles of the
    kernel's trailing axes (out channels, in channels, window...), as
    `lax.conv_general_dilated`'s kernel spec; the contraction is window major (row-major
    over the window), input channels minor: a 16-element block holds 16 channels of one
    kernel tap when the channels are a multiple of 16."""
    lead = kernel.ndim - len(kernel_axes)
    o, i, *window = (lead + a for a in kernel_axes)
    k = jnp.transpose(kernel, (*range(lead), o, *window, i))
    out = k.shape[lead]
    shape = k.shape[:lead] + ((groups,) if groups > 1 else ()) + (out // groups, -1)
    return k.reshape(shape)


def kernel_from_matrix(
    m: Array, kernel_shape: tuple[int, ...], kernel_axes: tuple[int, ...], groups: int
) -> Array:
    """`gemm_matrix`'s inverse: the kernel of shape `kernel_shape` (per layer, in its
    stored layout) from its GEMM matrix `m` (possibly stacked)."""
    lead = m.ndim - 2 - (1 if groups > 1 else 0)
    o, i, *window = kernel_axes
    order = (o, *window, i)  # the matrix's axes, as stored-kernel axes
    k = m.reshape(m.shape[:lead] + tuple(kernel_shape[a] for a in order))
    inverse = np.argsort(order)
    return jnp.transpose(k, (*range(lead), *(lead + int(j) for j in inverse)))


def check_conv_kernel(w: Any, rhs_spec: tuple, groups: int) -> tuple[int, ...]:
    """`w.kernel_axes`; raises unless the convolution reads the quantised kernel `w` as
    it was quantised (its kernel layout and feature groups): `freeze` packs the kernel's
    GEMM matrix by them."""
    if w.kernel_axes is None:
        raise ValueError(
            f"nvfp4x: `{w.path}` was selected as a linear layer's weight, but its module "
            "runs it as a convolution kernel (nvfp4x could not trace the module's call on "
            "a guessed input to tell). Leave it out of the policy, or call the convolution "
            "from a module whose call takes one input array of shape `(channels, "
            "spatial...)`, and quantise it with `nvfp4x.Policy(rules, convolutions=True)`."
        )
    if tuple(rhs_spec) != tuple(w.kernel_axes) or groups != w.groups:
        raise ValueError(
            f"nvfp4x: the convolution kernel `{w.path}` was quantised with kernel layout "
            f"{w.kernel_axes} and {w.groups} feature group(s), but is used with layout "
            f"{tuple(rhs_spec)} and {groups}; `freeze` would pack it wrongly. Quantise the "
            "model again (`nvfp4x.quantize(nvfp4x.dequantize(model), policy)`)."
        )
    return w.kernel_axes


# --- geometry ---


@dataclasses.dataclass(frozen=True)
class Geometry:
    """A convolution's geometry, per spatial axis (a static primitive parameter):
    kernel `window`, `strides`, `padding` (low, high), `lhs_dilation`, `rhs_dilation`,
    and the input's spatial shape `in_spatial` (undilated, unpadded)."""

    window: tuple[int, ...]
    strides: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]
    lhs_dilation: tuple[int, ...]
    rhs_dilation: tuple[int, ...]
    in_spatial: tuple[int, ...]

    @property
    def out_spatial(self) -> tuple[int, ...]:
        out = []
        for s, (lo, hi), ld, w, rd, st in zip(
            self.in_spatial,
            self.padding,
            self.lhs_dilation,
            self.window,
            self.rhs_dilation,
            self.strides,
            strict=True,
        ):
            size = max(0, (s - 1) * ld + 1) + lo + hi
            out.append(max(0, (size - (w - 1) * rd - 1) // st + 1))
        return tuple(out)

    def covered(self) -> list[np.ndarray]:
        """Per spatial axis, which input positions some patch reads (a static mask)."""
        masks = []
        for s, (lo, _), ld, w, rd, st, n in zip(
            self.in_spatial,
            self.padding,
            self.lhs_dilation,
            self.window,
            self.rhs_dilation,
            self.strides,
            self.out_spatial,
            strict=True,
        ):
            read = {o * st + j * rd for o in range(n) for j in range(w)}
            masks.append(np.array([i * ld + lo in read for i in range(s)]))
        return masks

    @property
    def pixel_shuffle(self) -> bool:
        """Whether this is a transposed convolution whose kernel is its stride, without
        padding (`ConvTranspose(k, stride=k)`: a Mixer's patch de-embedding, a U-Net's
        up-sampling): each output pixel reads one input pixel through one tap."""
        return all(
            ld == w and st == 1 and rd == 1 and pad == (w - 1, w - 1)
            for ld, w, st, rd, pad in zip(
                self.lhs_dilation,
                self.window,
                self.strides,
                self.rhs_dilation,
                self.padding,
                strict=True,
            )
        )

    def conv(self, a: Array, kernel: Array, precision, preferred) -> Array:
        """The convolution of channels-last `a: (N, spatial..., C)` with `kernel: (O,
        window..., C)`, channels last. Where `pixel_shuffle`, one GEMM over the channels
        and its outputs put in place (output pixel `i x w + r` is input pixel `i`
        through tap `w - 1 - r`): the same products without the dilated input's zeros,
        equal up to float32 summation order."""
        nsp = len(self.window)
        if self.pixel_shuffle:
            flipped = lax.rev(kernel, tuple(range(1, nsp + 1)))
            dims = (((a.ndim - 1,), (kernel.ndim - 1,)), ((), ()))
            y = lax.dot_general(
                a, flipped, dims, precision=precision, preferred_element_type=preferred
            )  # (N, spatial..., O, window...)
            order = [0, *itertools.chain(*((1 + d, 2 + nsp + d) for d in range(nsp))), 1 + nsp]
            y = jnp.transpose(y, order)  # (N, s1, w1, s2, w2, ..., O)
            return y.reshape(a.shape[0], *self.out_spatial, kernel.shape[0])
        spec = (0, nsp + 1, *range(1, nsp + 1))
        return lax.conv_general_dilated(
            a,
            kernel,
            self.strides,
            self.padding,
            self.lhs_dilation,
            self.rhs_dilation,
            lax.ConvDimensionNumbers(spec, spec, spec),
            precision=precision,
            preferred_element_type=preferred,
        )


def covered(x: Array, geom: Geometry) -> Array:
    """`x: (..., spatial..., C)` with the pixels no patch reads set to zero: the tensor
    amax of the result is the patches' (padding adds zeros only)."""
    nsp = len(geom.window)
    mask = None
    for d, m in enumerate(geom.covered()):
        if m.all():
            continue
        shape = [1] * x.ndim
        shape[x.ndim - 1 - nsp + d] = m.size
        part = jnp.asarray(m).reshape(shape)
        mask = part if mask is None else mask & part
    return x if mask is None else jnp.where(mask, x, jnp.zeros((), x.dtype))


def conv_patches(x: Array, geom: Geometry) -> Array:
    """The patches of channels-last `x: (N..., spatial..., C)`: `(N..., out spatial...,
    window x C)`, the window row-major and each pixel's channels together (the GEMM's
    contraction order), by slicing (exact; no GEMM): one strided slice of the padded,
    dilated input per window offset."""
    lead = x.ndim - 1 - len(geom.window)
    config = [(0, 0, 0)] * lead
    config += [(lo, hi, d - 1) for (lo, hi), d in zip(geom.padding, geom.lhs_dilation, strict=True)]
    x = lax.pad(x, jnp.zeros((), x.dtype), [*config, (0, 0, 0)])
    out = geom.out_spatial
    nsp = len(geom.window)
    if geom.strides == geom.window and all(d == 1 for d in geom.rhs_dilation) and all(out):
        # Windows that tile the input (a patch embedding: stride = kernel): the patches
        # are the cropped input's blocks, moved by one reshape and transpose (whose
        # transpose, dgrad's, is as cheap; slices would be added back one by one).
        pairs = list(zip(out, geom.window, strict=True))
        x = x[(slice(None),) * lead + tuple(slice(0, n * w) for n, w in pairs)]
        split = x.shape[:lead] + tuple(itertools.chain(*pairs)) + x.shape[-1:]
        order = [*range(lead), *(lead + 2 * d for d in range(nsp))]
        order += [*(lead + 2 * d + 1 for d in range(nsp)), lead + 2 * nsp]
        p = jnp.transpose(x.reshape(split), order)  # (N..., out..., window..., C)
        return p.reshape(p.shape[: lead + nsp] + (-1,))
    slices = []
    for offset in itertools.product(*(range(w) for w in geom.window)):
        start = tuple(o * d for o, d in zip(offset, geom.rhs_dilation, strict=True))
        limit = tuple(
            b + (n - 1) * st + 1 if n else b
            for b, n, st in zip(start, out, geom.strides, strict=True)
        )
        slices.append(
            lax.slice(
                x,
                (0,) * lead + start + (0,),
                x.shape[:lead] + limit + (x.shape[-1],),
                (1,) * lead + geom.strides + (1,),
            )
        )
    p = jnp.stack(slices, axis=-2)  # (N..., out spatial..., window, C)
    return p.reshape(p.shape[:-2] + (-1,))


# --- the fast path: one problem ---


def _images(a: Array, nsp: int) -> tuple[Array, tuple[int, ...]]:
    """`a: (lead..., spatial..., C)` as `(N, spatial..., C)`, and its leading shape."""
    lead = a.shape[: a.ndim - 1 - nsp]
    return a.reshape((math.prod(lead),) + a.shape[len(lead) :]), lead


def _kernel(wm: Array, geom: Geometry) -> Array:
    """The GEMM matrix `(O, window x C)` as a channels-last kernel `(O, window..., C)`."""
    return wm.reshape((wm.shape[0], *geom.window, -1))


def scaled_conv(a: Array, a_scale, wm: Array, w_scale, *, geom: Geometry, dtype) -> Array:
    """The convolution of `a: (lead..., spatial..., C)` with the GEMM matrix `wm`,
    accumulated in float32, then times `a_scale * w_scale`; operands as `scaled_dot`'s
    (`dtype` for two bfloat16 operands, else float32 or wider)."""
    bf16 = jnp.dtype(jnp.bfloat16)
    if not (dtype is not None and a.dtype == bf16 and wm.dtype == bf16):
        dtype = widest_float(a.dtype, wm.dtype, jnp.float32)
    images, lead = _images(a.astype(dtype), len(geom.window))
    kernel = _kernel(wm.astype(dtype), geom)
    out = geom.conv(images, kernel, dot_precision(dtype), jnp.float32)
    return apply_scales(out.reshape(lead + out.shape[1:]), a_scale, w_scale)


def conv_fprop(x, w, wv, ws, seed, *, recipe: Recipe, dtype, geom: Geometry) -> Array:
    """fprop: `conv(Q(x), Q(W))`, x quantised once, per pixel along its channels, with
    the tensor amax of the pixels the patches read."""
    del w, seed  # the master weight and seed matter to the derivatives only
    xv, xs = quantize_operand(covered(x, geom), recipe.input, axis=-1)
    return scaled_conv(xv, xs, wv, ws, geom=geom, dtype=dtype)


def conv_tangent_x(xt, wv, ws, seed, *, recipe: Recipe, dtype, geom: Geometry) -> Array:
    """Forward-mode tangent along x: `conv(x', Q(W))` (straight-through)."""
    return scaled_conv(xt, None, wv, ws, geom=geom, dtype=dtype)


def conv_tangent_w(x, wt, seed, *, recipe: Recipe, dtype, geom: Geometry) -> Array:
    """Forward-mode tangent along W: `conv(Q(x), W')` (straight-through)."""
    xv, xs = quantize_operand(covered(x, geom), recipe.input, axis=-1)
    return scaled_conv(xv, xs, wt, None, geom=geom, dtype=dtype)


def conv_dgrad(dy, wv, ws, seed, *, recipe: Recipe, dtype, geom: Geometry) -> Array:
    """dgrad: `Q(dy)` (along out channels, per output pixel, as the reference's) through
    the transpose of the convolution with `Q(W)`, in float32 (exact operands)."""
    key = grad_key(seed, 1) if needs_key(recipe) else None
    gv, gs = quantize_operand(dy, recipe.grad, axis=-1, key=key)
    nsp = len(geom.window)
    g, lead = _images(gv.astype(jnp.float32), nsp)
    kernel = _kernel(wv.astype(jnp.float32), geom)
    shape = (g.shape[0], *geom.in_spatial, kernel.shape[-1])
    precision = dot_precision(jnp.dtype(jnp.float32))
    forward = lambda a: geom.conv(a, kernel, precision, jnp.float32)
    (dx,) = jax.linear_transpose(forward, jax.ShapeDtypeStruct(shape, jnp.float32))(g)
    return apply_scales(dx.reshape(lead + dx.shape[1:]), gs, ws)


# --- the fast path's wgrad: the patch matrix without its structural zeros ---


def token_unit(recipe: Recipe) -> int:
    """How many consecutive tokens (rows of the patch matrix) wgrad's patch operand
    treats together: the RHT's 16-token chunks and the input format's blocks along the
    tokens (their least common multiple; 1 for neither)."""
    unit = BLOCK if recipe.rht else 1
    fmt = recipe.input
    if fmt is not None and fmt.block is not None:
        unit = math.lcm(unit, fmt.block[1])
    return unit


def pixel_table(geom: Geometry, images: int) -> np.ndarray:
    """`(tokens, window)` int32: for each token (an image's output pixel, the tokens in
    `conv_patches`' order) and kernel tap (row-major), the row of the input as `(images
    x pixels, C)` that the patch reads there, or `images x pixels` (a row of zeros to
    append) where it reads padding or a hole of the input's dilation."""
    nsp = len(geom.window)
    flat = np.zeros((1,) * 2 * nsp, np.int64)
    valid = np.ones((1,) * 2 * nsp, bool)
    for d, (s, (lo, _), ld, w, rd, st, n) in enumerate(
        zip(
            geom.in_spatial,
            geom.padding,
            geom.lhs_dilation,
            geom.window,
            geom.rhs_dilation,
            geom.strides,
            geom.out_spatial,
            strict=True,
        )
    ):
        pos = np.arange(n)[:, None] * st + np.arange(w)[None, :] * rd - lo  # (out, window)
        i = pos // ld
        shape = [1] * 2 * nsp
        shape[d], shape[nsp + d] = n, w
        flat = flat * s + np.maximum(i, 0).reshape(shape)
        valid = valid & ((pos % ld == 0) & (i >= 0) & (i < s)).reshape(shape)
    pixels = math.prod(geom.in_spatial)
    zero = images * pixels
    per_image = np.where(valid, flat, -1).reshape(math.prod(geom.out_spatial), -1)
    offsets = np.arange(images)[:, None, None] * pixels
    table = np.where(per_image >= 0, per_image + offsets, zero)
    return table.reshape(-1, per_image.shape[-1]).astype(np.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class WgradPlan:
    """How wgrad builds its patch operand without the patch matrix's repeats and
    structural zeros (static, NumPy).

    Cut into `unit`-token chunks, a column of the patch matrix (one kernel tap, one
    channel) holds in each chunk the input pixels some `unit` tokens read through that
    tap: many (chunk, tap) pairs read the same pixels (neighbouring taps of a
    stride-1 convolution, one output row apart; the taps of a transposed convolution's
    output phases), and those of a transposed convolution mostly read nothing (padding,
    dilation holes). Equal chunks have equal RHTs and equal quantised blocks (the
    tensor amax is over the same values), so each distinct chunk is built, transformed
    and quantised once:

    - `pixels` `(distinct x unit,)`: the distinct chunks, as rows of the input `(images x
      pixels + 1, C)` (the last row zeros; a chunk of zeros is always among them).
    - `rows`: the GEMM operand as rows of the quantised distinct chunks: dense
      (`chunks` None) `(chunks x unit, window)`, the patch matrix's layout (tokens
      padded to whole chunks); compact `(groups, slots x unit)`: per tap, only the
      chunks where it reads some pixel, `slots` per tap (the most any tap has; the rest
      zero chunks), with `chunks` `(window, slots)` the token chunk of each (`nchunks`: a
      zero chunk of `dy`) and `dead` `(window, nchunks)` the chunks each tap skips.
      Taps whose slots hold the same distinct chunks (a transposed convolution whose
      kernel is its stride, output rows whole chunks: the taps of one column phase) share one
      operand: `taps` `(groups, per group)` lists them (one tap a group where the sizes
      would differ), and a group's GEMM multiplies its taps' `dy` chunks side by side.
    - `unit`, `nchunks`: the chunks' tokens and how many chunks the tokens fill.
    - `canon`, `source`, `flips` (`_canonical_chunks`; None where it does not apply):
      where every distinct chunk holds pixels only at the positions of one residue `b`
      modulo some `k` (a transposed convolution's output phases: `k` its stride), its
      RHT is that of its pixels placed at the positions of residue 0 (the chunk's
      *canonical* form), each position `p` times the Sylvester sign `(-1)^popcount((p mod
      k) & b)`, and its quantised values (a 16-token block each, rounded to nearest:
      symmetric in sign) are the canonical form's with those signs. `canon` `(canonical
      x unit,)`: the canonical chunks as rows of the input (each set of pixels once, so
      the transform and quantiser run on fewer rows); `source` `(distinct x unit,)`: for
      each row of the distinct chunks, its row of the quantised canonical chunks;
      `flips` where its sign flips.
    """

    pixels: np.ndarray
    rows: np.ndarray
    unit: int
    nchunks: int
    chunks: np.ndarray | None = None
    dead: np.ndarray | None = None
    taps: np.ndarray | None = None
    canon: np.ndarray | None = None
    source: np.ndarray | None = None
    flips: np.ndarray | None = None

    @property
    def contiguous(self) -> bool:
        """Whether `rows` reads the quantised distinct chunks in storage order, each
        once (`rows.reshape(-1)` is `0, 1, ...`): the operand is their leading rows."""
        flat = self.rows.reshape(-1)
        return bool(np.array_equal(flat, np.arange(flat.size)))


@functools.lru_cache(maxsize=16)
def wgrad_plan(geom: Geometry, images: int, unit: int) -> WgradPlan:
    """The `WgradPlan` of a convolution over `images` images, `unit` as `token_unit`:
    compact where that at least halves the GEMM's patch operand, else dense."""
    table = pixel_table(geom, images)
    tokens, window = table.shape
    zero = images * math.prod(geom.in_spatial)
    nchunks = -(-tokens // unit)
    padded = np.full((nchunks * unit, window), zero, np.int32)
    padded[:tokens] = table
    chunked = padded.reshape(nchunks, unit, window)
    keys = np.concatenate([chunked.transpose(2, 0, 1).reshape(-1, unit), np.full((1, unit), zero)])
    keys = np.ascontiguousarray(keys, np.int32)
    # Rows as opaque bytes: `np.unique` on them is ~20x faster than with `axis=0`.
    as_bytes = keys.view(np.dtype((np.void, keys.itemsize * unit))).reshape(-1)
    _, first, ids = np.unique(as_bytes, return_index=True, return_inverse=True)
    distinct, ids = keys[first], ids.reshape(-1)
    zero_id, ids = int(ids[-1]), ids[:-1].reshape(window, nchunks)
    within = np.arange(unit)
    live = (chunked != zero).any(axis=1).T  # (window, nchunks)
    slots = int(live.sum(axis=1).max(initial=0))
    if slots == 0 or 2 * slots > nchunks:
        read = ids.T  # (nchunks, window): the distinct chunk of each token chunk and tap
        layout: dict[str, np.ndarray] = {}
    else:
        chunks = np.full((window, slots), nchunks, np.int32)
        slot_ids = np.full((window, slots), zero_id)
        for j in range(window):
            (live_j,) = np.nonzero(live[j])
            chunks[j, : live_j.size] = live_j
            slot_ids[j, : live_j.size] = ids[j, live_j]
        taps = tap_groups(slot_ids)
        read = slot_ids[taps[:, 0]]  # (groups, slots): the distinct chunk each slot reads
        layout = {"chunks": chunks, "dead": ~live, "taps": taps}
    # The distinct chunks stored in the order the operand reads them.
    order = _first_seen(read.reshape(-1), len(distinct))
    distinct = distinct[np.argsort(order)]
    if layout:
        rows = (order[read][..., None] * unit + within).reshape(len(read), -1)
    else:
        rows = (order[read][:, None, :] * unit + within[None, :, None]).reshape(-1, window)
    pixels = distinct.reshape(-1).astype(np.int32)
    canonical = _canonical_chunks(distinct, zero)
    return WgradPlan(pixels, rows.astype(np.int32), unit, nchunks, **layout, **canonical)


def _canonical_chunks(distinct: np.ndarray, zero: int) -> dict[str, np.ndarray | None]:
    """`WgradPlan`'s `canon`, `source` and `flips` for the distinct chunks `(distinct,
    unit)` (input rows; `zero` the row of zeros), for the largest `k` (16, 8, 4 or 2)
    with which each chunk's pixels lie at one residue modulo `k`; all None for none, or
    where the canonical chunks would be as many as the distinct ones and `k` 2 (too
    little saved for the gather that puts them back).

    Why the signs: with `H16 = H_(16/k) (x) H_k` (Sylvester's order, position `p = h k +
    l`), the transform's butterflies over the bits of `l` meet one value and zeros (each
    sum exact: `+-v`), giving `H_k[l, b] v_h` at `h k + l`; those over the bits of `h`
    then run on values that all carry the sign `H_k[l, b]`, and a sum's rounding is
    symmetric in sign. So every result is the canonical chunk's (`b = 0`) times `H_k[l,
    b]`, bit for bit but for the sign of a zero; the same holds in `_hadamard`'s guarded
    path (its scalings by powers of two, and its exact sums, are symmetric too)."""
    none: dict[str, np.ndarray | None] = {"canon": None, "source": None, "flips": None}
    count, unit = distinct.shape
    if unit != BLOCK or count == 0:
        return none
    live = distinct != zero
    positions = np.arange(unit)
    for k in (16, 8, 4, 2):
        residue = positions % k
        lo = np.where(live, residue, k).min(axis=1)
        hi = np.where(live, residue, -1).max(axis=1)
        if np.all(~live.any(axis=1) | (lo == hi)):
            break
    else:
        return none
    phase = np.where(live.any(axis=1), hi, 0)  # (distinct,): each chunk's `b`
    m = unit // k
    pixels = distinct[np.arange(count)[:, None], phase[:, None] + k * np.arange(m)]  # (d, m)
    segments, which = np.unique(pixels, axis=0, return_inverse=True)
    which = which.reshape(-1)
    if k == 2 and len(segments) >= count:
        return none
    canon = np.full((len(segments), unit), zero, np.int32)
    canon[:, ::k] = segments
    source = which[:, None] * unit + positions  # (distinct, unit)
    both = (positions[None, :] % k) & phase[:, None]  # (distinct, unit): bits below 16
    flips = (both ^ (both >> 1) ^ (both >> 2) ^ (both >> 3)) & 1 == 1  # their parity
    return {
        "canon": canon.reshape(-1),
        "source": source.reshape(-1).astype(np.int32),
        "flips": flips.reshape(-1),
    }


def _first_seen(ids: np.ndarray, n: int) -> np.ndarray:
    """`(n,)`: a renumbering of `n` ids in the order `ids` first reads them (the ids it
    never reads last), so that an operand gathered by `ids` from chunks stored in the
    new order reads them in storage order: where each chunk is read once, the gather
    is a slice (`WgradPlan.contiguous`)."""
    _, first = np.unique(ids, return_index=True)
    seen = ids[np.sort(first)]
    rest = np.setdiff1d(np.arange(n), seen)
    order = np.empty(n, np.int64)
    order[np.concatenate([seen, rest])] = np.arange(n)
    return order


def tap_groups(slot_ids: np.ndarray) -> np.ndarray:
    """`(groups, per group)`: the taps (rows of `slot_ids`) grouped by equal rows, in
    order of their first tap; one tap a group unless every group has the same size."""
    groups: dict[bytes, list[int]] = {}
    for j, row in enumerate(slot_ids):
        groups.setdefault(row.tobytes(), []).append(j)
    if len({len(taps) for taps in groups.values()}) == 1:
        return np.array(list(groups.values()), np.int32)
    return np.arange(len(slot_ids), dtype=np.int32)[:, None]


def shifts_rows(geom: Geometry, unit: int) -> bool:
    """Whether wgrad can multiply shifted copies of `Q(H dy)` with the quantised input
    (`shifted_wgrad_operands`): a convolution (input not dilated) of two or more spatial
    axes, stride 1 along every axis but the last, more than one tap along the leading
    axes, and output rows (the last axis) of whole `unit`-token chunks. Then every chunk
    of the patch matrix is a chunk of the input read at one offset along the last axis
    (one of that axis's taps), and the leading axes' taps read the same chunks shifted
    by whole rows."""
    out = geom.out_spatial
    return (
        len(geom.window) >= 2
        and all(d == 1 for d in geom.lhs_dilation)
        and all(s == 1 for s in geom.strides[:-1])
        and math.prod(geom.window[:-1]) > 1
        and min(out) > 0
        and out[-1] % unit == 0
    )


def shifted_wgrad_operands(
    dy, x, seed, *, recipe: Recipe, geom: Geometry
) -> tuple[Array, Array | None, Array, Array | None]:
    """wgrad's quantised operands where `shifts_rows(geom, ...)`: `(g, gs, q, xs)` over
    `R` rows, the images' output rows each at every padded input row the leading taps
    put them (`images x padded leading extents x out width`):

    - `q` `(R, last taps x C)`: the input read at each of the last axis's taps (after
      `covered`, padded as the convolution pads), transformed and quantised along the
      rows: `Q(H x)` of the reference's patch matrix, each chunk once (a chunk of tap
      `(i, j)` at output row `h` is the chunk of `q`'s tap `j` at row `h + i x dilation`);
      `xs` its tensor scale (over the pixels some patch reads, as the reference's).
    - `g` `(R, leading taps x O)`: the reference's `Q(H dy)` (the same call, SR key
      included), its output rows placed, for each leading tap `i`, at the rows that tap
      reads, zeros elsewhere; `gs` its tensor scale.

    `g.T @ q` is wgrad for all taps at once, `(leading taps x O, last taps x C)`: each
    product of the reference's patch GEMM once, plus products of zeros."""
    nsp = len(geom.window)
    x, _ = _images(covered(x, geom), nsp)
    c, out = x.shape[-1], geom.out_spatial
    config = [(0, 0, 0)] + [(lo, hi, 0) for lo, hi in geom.padding] + [(0, 0, 0)]
    xp = lax.pad(x, jnp.zeros((), x.dtype), config)  # (N, padded spatial..., C)
    kw, dw, sw = geom.window[-1], geom.rhs_dilation[-1], geom.strides[-1]
    taps = [
        lax.slice_in_dim(xp, j * dw, j * dw + (out[-1] - 1) * sw + 1, sw, axis=nsp)
        for j in range(kw)
    ]
    q = jnp.stack(taps, axis=-2)  # (N, padded leading..., out width, last taps, C)
    gv, gs, qv, xs = wgrad_quantised(dy, q.reshape(-1, kw * c), seed, recipe)
    g = _kernels.materialized(gv)  # read once per leading tap (XLA:CPU would requantise)
    g = g.reshape((x.shape[0], *out, gv.shape[-1]))
    placed = []
    for offset in itertools.product(*(range(k) for k in geom.window[:-1])):
        pads = [
            (i * d, (k - 1 - i) * d)
            for i, d, k in zip(offset, geom.rhs_dilation[:-1], geom.window[:-1], strict=True)
        ]
        placed.append(jnp.pad(g, [(0, 0), *pads, (0, 0), (0, 0)]))
    g = jnp.stack(placed, axis=-2)  # (N, padded leading..., out width, leading taps, O)
    return g.reshape(qv.shape[0], -1), gs, qv, xs  # (row for row with `q`)


def shifted_wgrad(dy, x, seed, *, recipe: Recipe, dtype, geom: Geometry) -> Array:
    """wgrad where `shifts_rows`: one GEMM of `shifted_wgrad_operands`, its blocks put in
    the patch matrix's column order `(O, window x C)`."""
    g, gs, q, xs = shifted_wgrad_operands(dy, x, seed, recipe=recipe, geom=geom)
    out = quantised_dot(g, gs, recipe.grad, q, xs, recipe.input, ((0,), (0,)), dtype=dtype)
    lead, kw = math.prod(geom.window[:-1]), geom.window[-1]
    n, c = out.shape[0] // lead, out.shape[1] // kw
    return out.reshape(lead, n, kw, c).transpose(1, 0, 2, 3).reshape(n, -1)


def conv_wgrad_operands(
    dy, x, seed, *, recipe: Recipe, geom: Geometry
) -> tuple[WgradPlan, Array, Array | None, Array, Array | None]:
    """wgrad's quantised operands as the fast path multiplies them: `(plan, g, gs,
    operand, xs)`, `g` the reference's `Q(H dy)` values padded with zero rows to whole
    chunks `(nchunks x unit, n)`, `operand` the patch matrix's quantised values in the
    `plan`'s layout (dense: `(nchunks x unit, window x C)`, the reference's `Q(H
    patches)` with the same padding; compact: `(window, slots x unit, C)`), `gs`, `xs`
    the tensor scales. The distinct chunks of the patches are gathered from `x`,
    transformed and quantised once each (`WgradPlan`), then gathered into `operand`;
    where that gather reads chunks several times (the neighbouring taps of a stride-1
    convolution), the quantised chunks are materialised before it
    (`_kernels.materialized`: XLA:CPU would run the quantiser in each read)."""
    nsp = len(geom.window)
    images = math.prod(x.shape[: x.ndim - 1 - nsp])
    plan = wgrad_plan(geom, images, token_unit(recipe))
    c = x.shape[-1]
    x_rows = jnp.concatenate([x.reshape(-1, c), jnp.zeros((1, c), x.dtype)])
    canon, source, flips = plan.canon, plan.source, plan.flips
    if canon is not None and source is not None and flips is not None and _signs_carry(recipe):
        # The canonical chunks transformed and quantised, each distinct chunk's rows
        # gathered from them with their signs (`WgradPlan`): one gather for both steps.
        gv, gs, cv, xs = wgrad_quantised(dy, x_rows[jnp.asarray(canon)], seed, recipe)
        cv = _kernels.materialized(cv)  # (each row read by several distinct chunks)
        read = plan.rows.reshape(-1)
        flip = jnp.asarray(flips[read])[:, None]
        picked = cv[jnp.asarray(source[read])]
        operand = jnp.where(flip, -picked, picked)
    else:
        distinct = x_rows[jnp.asarray(plan.pixels)]  # (distinct x unit, C)
        gv, gs, xv, xs = wgrad_quantised(dy, distinct, seed, recipe)
        if plan.contiguous:  # each distinct chunk read once, in storage order
            operand = xv[: plan.rows.size]
        else:
            if plan.rows.size > 1.5 * plan.pixels.size:  # the gather reads chunks several times
                xv = _kernels.materialized(xv)
            operand = xv[jnp.asarray(plan.rows.reshape(-1))]
    if plan.chunks is None:
        operand = operand.reshape(plan.rows.shape[0], -1)  # (tokens, window x C)
    else:
        operand = operand.reshape(plan.rows.shape[0], -1, c)  # (groups, slots x unit, C)
    g = jnp.pad(gv, [(0, plan.nchunks * plan.unit - gv.shape[0]), (0, 0)])
    return plan, g, gs, operand, xs


def _signs_carry(recipe: Recipe) -> bool:
    """Whether wgrad's patch operand may be quantised from `WgradPlan`'s canonical
    chunks: transformed by the RHT, in 16-token blocks (or none) rounded to nearest by a
    format whose quantised values change sign with their inputs (`sign_symmetric`)."""
    fmt = recipe.input
    symmetric = fmt is None or (fmt.rounding == "nearest" and fmt.spec.sign_symmetric)
    return recipe.rht and token_unit(recipe) == BLOCK and symmetric


def conv_wgrad(dy, x, seed, *, recipe: Recipe, dtype, geom: Geometry) -> Array:
    """wgrad: the reference's `Q(H dy).T @ Q(H patches)` (blocks along tokens), on the
    same quantised operands (`conv_wgrad_operands`). Where a tap's patch column is
    structurally zero in most token chunks (a transposed convolution: its input is
    dilated), the GEMM runs tap by tap over the chunks where the tap reads something,
    against the chunks of `Q(H dy)` they meet; taps that read the same chunks (`taps`)
    as one GEMM, their chunks of `Q(H dy)` side by side, so that the operand is read,
    and its quantisation (which XLA fuses into its readers) computed, once. A skipped
    chunk contributes `Q(H dy) x 0`: nothing, unless that chunk of `Q(H dy)` is not
    finite, where the reference's sum is NaN; so is this one."""
    if shifts_rows(geom, token_unit(recipe)):
        return shifted_wgrad(dy, x, seed, recipe=recipe, dtype=dtype, geom=geom)
    plan, g, gs, operand, xs = conv_wgrad_operands(dy, x, seed, recipe=recipe, geom=geom)
    if plan.chunks is None or plan.dead is None or plan.taps is None:
        dims = ((0,), (0,))
        return quantised_dot(g, gs, recipe.grad, operand, xs, recipe.input, dims, dtype=dtype)
    window, slots = plan.chunks.shape
    nchunks, unit, n = plan.nchunks, plan.unit, g.shape[-1]
    groups, per = plan.taps.shape
    # `dy` as chunks, and a zero chunk last: `(nchunks + 1, unit, n)`.
    g = jnp.concatenate([g, jnp.zeros((unit, n), g.dtype)]).reshape(nchunks + 1, unit, n)
    met_chunks = plan.chunks[plan.taps].transpose(0, 2, 1)  # (groups, slots, per)
    if groups > 1 and (met_chunks == met_chunks[:1]).all():
        # Every group meets the same chunks of `dy` (a transposed convolution whose
        # kernel is its stride: a group is a column phase, its taps the row phases):
        # one GEMM, `dy`'s chunks gathered once, the groups' operands side by side.
        met = g[jnp.asarray(met_chunks[0])]  # (slots, per, unit, n)
        met = met.transpose(0, 2, 1, 3).reshape(slots * unit, per * n)
        side = operand.transpose(1, 0, 2).reshape(slots * unit, -1)  # (.., groups x C)
        out = scaled_dot(met, gs, side, xs, ((0,), (0,)), dtype=dtype)  # (per x n, groups x C)
        out = out.reshape(per, n, groups, -1).transpose(2, 0, 1, 3).reshape(window, n, -1)
    else:
        # Each group's taps' chunks of `dy` side by side: `(groups, slots x unit, per x n)`.
        met = g[jnp.asarray(met_chunks)]  # (groups, slots, per, unit, n)
        met = met.transpose(0, 1, 3, 2, 4).reshape(groups, slots * unit, per * n)
        # One GEMM per group: `scaled_dot` vmapped over them (a batched GEMM: its dtype).
        tap_gemm = lambda m, o: scaled_dot(
            m, gs, o, xs, ((0,), (0,)), dtype=batched_gemm_dtype(dtype)
        )
        out = jax.vmap(tap_gemm)(met, operand).reshape(window, n, -1)  # taps in group order
    if per > 1:
        out = out[jnp.asarray(np.argsort(plan.taps.reshape(-1)))]  # (window, n, C)
    bad = jnp.any(~jnp.isfinite(g[:nchunks]), axis=1)  # (nchunks, n)
    skipped_bad = jnp.any(jnp.asarray(plan.dead)[:, :, None] & bad[None], axis=1)
    out = jnp.where(skipped_bad[:, :, None], jnp.float32(jnp.nan), out)
    return jnp.transpose(out, (1, 0, 2)).reshape(n, -1)


def _out_abstract(a, w, *_, geom: Geometry, **__):
    nsp = len(geom.window)
    return a.shape[: a.ndim - 1 - nsp] + geom.out_spatial + (w.shape[-2],), jnp.float32


def _dgrad_abstract(ct, wv, *_, geom: Geometry, **__):
    nsp = len(geom.window)
    c = wv.shape[-1] // math.prod(geom.window)
    return ct.shape[: ct.ndim - 1 - nsp] + geom.in_spatial + (c,), jnp.float32


def _wgrad_abstract(ct, a, seed, *, nbatch, geom: Geometry, **_):
    k = a.shape[-1] * math.prod(geom.window)
    return ct.shape[:nbatch] + (ct.shape[-1], k), jnp.float32


#: The fast path's GEMMs (operands as `qdot_p`'s; `geom` a static `Geometry`).
conv_qdot_p = _make_primitive("nvfp4x_conv_qdot", conv_fprop, _out_abstract)
conv_tx_p = _make_primitive("nvfp4x_conv_qdot_tangent_x", conv_tangent_x, _out_abstract)
conv_tw_p = _make_primitive("nvfp4x_conv_qdot_tangent_w", conv_tangent_w, _out_abstract)
conv_dgrad_p = _make_primitive("nvfp4x_conv_dgrad", conv_dgrad, _dgrad_abstract, stack=True)
conv_wgrad_p = _make_primitive("nvfp4x_conv_wgrad", conv_wgrad, _wgrad_abstract, stack=True)


def_gemm_rules(conv_qdot_p, conv_tx_p, conv_tw_p, conv_dgrad_p, conv_wgrad_p)

#: The fast path's primitives and their passes (for `coverage`).
CONV_PASS = {conv_qdot_p: "fprop", conv_tx_p: "fprop (jvp)", conv_tw_p: "fprop (jvp)",
             conv_dgrad_p: "dgrad", conv_wgrad_p: "wgrad"}  # fmt: skip


def conv_qdot(
    x: Array,
    wm: Array,
    *,
    recipe: Recipe,
    fast: bool,
    name: str,
    geom: Geometry,
    weight: tuple[Array, Array] | None = None,
) -> Array:
    """The fast path's convolution of channels-last `x: (N..., spatial..., C)` with the
    GEMM matrix `wm: (O, window x C)`: fprop, dgrad and wgrad as the module docstring
    says. `weight`: the quantised weight `(values, tensor scale)` when it is given (a
    frozen kernel's decoded values), else quantised from `wm` here."""
    dtype = gemm_dtype(fast)
    if weight is None:
        wv, ws = quantize_weight(lax.stop_gradient(wm), recipe=recipe, axis=-1, dtype=dtype)
    else:
        wv, ws = weight
    seed = jnp.zeros((2,), jnp.uint32)
    return conv_qdot_p.bind(
        x, wm, wv, ws, seed, recipe=recipe, dtype=dtype, nbatch=0, name=name, geom=geom
    )


#: Whether eligible convolutions take the fast path (`reference_only` turns it off).
_FAST = [True]


@contextlib.contextmanager
def reference_only():
    """Within this context, every quantised convolution traced runs the reference (the
    patch GEMM): for tests and benchmarks that compare the two. (JAX's trace caches are
    cleared on entry and exit: the choice is made when a convolution is traced.)"""
    jax.clear_caches()
    _FAST.append(False)
    try:
        yield
    finally:
        _FAST.pop()
        jax.clear_caches()


def runs_fast(recipe: Recipe, channels: int, probe: Any = None, enabled: Any = None) -> bool:
    """Whether a convolution with `channels` input channels per feature group runs the
    fast path: every input block along the contraction lies in one pixel's channels, and
    the layer has no telemetry probe or `enabled` mask."""
    if not _FAST[-1] or probe is not None or enabled is not None or channels == 0:
        return False
    fmt = recipe.input
    if fmt is None or fmt.block is None:
        return True
    return fmt.block[0] == 1 and channels % fmt.block[1] == 0


# --- the rule: a convolution as its GEMM ---


def _grouped(x: Array, g: int, geom: Geometry, gemm: Callable, fast: Callable | None) -> Array:
    """`conv_gemm`'s GEMMs on the channels-last input `x: (N, spatial..., C)` with `g`
    feature groups: `(N, out spatial..., out channels)`."""
    if fast is not None:
        xg = x.reshape(x.shape[:-1] + (g, -1))  # (N, spatial..., groups, C / groups)
        xg = jnp.moveaxis(xg, -2, 0) if g > 1 else xg[..., 0, :]
        y = fast(xg, geom, 1 if g > 1 else 0)
    else:
        p = conv_patches(x, geom)  # (N, out..., window x C)
        c = x.shape[-1]
        p = p.reshape(p.shape[:-1] + (-1, g, c // g))  # (N, out..., window, groups, C/g)
        p = jnp.moveaxis(p, -2, 0) if g > 1 else p[..., 0, :]
        p = p.reshape(p.shape[:-2] + (-1,))  # (groups..., N, out..., K)
        # The tokens as one axis (the batch major: its sharding carries over): the
        # quantisers' block grids then have a long minor axis, which XLA:CPU vectorises.
        lead = p.shape[: 1 if g > 1 else 0]
        y = gemm(p.reshape(lead + (-1, p.shape[-1])), 1 if g > 1 else 0)
        y = y.reshape(p.shape[:-1] + y.shape[-1:])  # (groups..., N, out..., out / groups)
    if g > 1:
        y = jnp.moveaxis(y, 0, -2)
        y = y.reshape(y.shape[:-2] + (-1,))
    return y


def conv_gemm(
    lhs: ArrayLike,
    kernel_shape: tuple[int, ...],
    gemm: Callable,
    *,
    path: str,
    window_strides,
    padding,
    lhs_dilation,
    rhs_dilation,
    dimension_numbers,
    feature_group_count,
    batch_group_count,
    preferred_element_type=None,
    rhs_dtype=None,
    fast: Callable | None = None,
    **_,
) -> Array:
    """`lax.conv_general_dilated` of `lhs` with a quantised kernel of shape
    `kernel_shape`, as its GEMM: `gemm(x, nbatch)` on the patches `x: (groups..., N,
    out spatial..., window x in/groups)` (the reference; see `gemm_matrix` for the
    weight's side; a grouped convolution is `groups` independent GEMMs, `nbatch=1`), or,
    given, `fast(x, geom, nbatch)` on the channels-last input `x: (groups..., N,
    spatial..., in/groups)` when `runs_fast` holds for the caller (it decides). The
    output is put back in the convolution's layout."""
    if batch_group_count != 1:
        raise NotImplementedError(
            f"nvfp4x: the convolution of `{path}` has batch groups ({batch_group_count}); "
            "only feature groups run in NVFP4. Leave the layer out of the policy."
        )
    lhs_spec, rhs_spec, out_spec = dimension_numbers
    g = feature_group_count
    x = layer_operand(jnp.asarray(lhs), f"The quantised convolution{layer_name(path)}", rhs_dtype)
    x = jnp.transpose(x, (lhs_spec[0], *lhs_spec[2:], lhs_spec[1]))
    geom = Geometry(
        window=tuple(kernel_shape[i] for i in rhs_spec[2:]),
        strides=tuple(window_strides),
        padding=tuple((int(lo), int(hi)) for lo, hi in padding),
        lhs_dilation=tuple(lhs_dilation),
        rhs_dilation=tuple(rhs_dilation),
        in_spatial=tuple(x.shape[1:-1]),
    )
    tokens = x.shape[0] * math.prod(geom.out_spatial)
    if not tokens or not x.shape[-1]:
        # No output pixel (an empty input, or a window larger than the padded input) or
        # no input channel: the float convolution's empty or zero result, nothing to
        # quantise.
        out_channels = kernel_shape[rhs_spec[0]]
        y = jnp.zeros((x.shape[0], *geom.out_spatial, out_channels), jnp.float32)
    else:
        y = _grouped(x, g, geom, gemm, fast)  # (N, out spatial..., out channels)
    y = jnp.moveaxis(y, -1, 1)  # (N, O, out spatial...)
    inverse = tuple(int(i) for i in np.argsort(out_spec))
    dtype = preferred_element_type or widest_float(x.dtype, rhs_dtype)
    return jnp.transpose(y, inverse).astype(dtype)
