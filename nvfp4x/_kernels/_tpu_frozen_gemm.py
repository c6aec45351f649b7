"""The GEMM of a frozen NVFP4 weight, `x @ W.T`, as one Pallas kernel for TPUs (Mosaic).

The TPU counterpart of `_pallas_gemm` (read it first: the same operands, results and
tolerance). A frozen layer's forward multiplies its activations by a weight held packed:
E2M1 codes two per byte along the contraction (element `2i` in the low nibble), E4M3
block scales and a float32 tensor scale (applied by the caller). Each program DMAs a
tile of the packed codes and of the scale bits into VMEM, decodes it there to the block
values `e2m1 * scale_b` (exact in bfloat16: at most 6 significant bits) and feeds them
to the MXU with float32 accumulation; no decoded weight is written to HBM.

Layout of the work, chosen so that every step maps onto the TPU's (8, 128) vregs
without lane shuffles:

- A `(features, depth / 2)` tile of codes is read as 32-bit words (`pltpu.bitcast`: a
  word holds the bytes of 4 consecutive rows, row `4r + q` in byte `q`) and transposed
  (`(depth / 2, features / 4)`: the contraction along the sublanes). Its scale bits are
  read and transposed the same way, so that a block scale (16 codes: 8 bytes of a row)
  is one row broadcast over 8 sublanes, never repeated along the lanes.
- Each of the 8 nibbles of a word (byte `q`, low or high half) is one plane of
  `(depth / 2, features / 4)` block values: rows `4r + q` of the weight, its even
  (low) or odd (high) columns. An E2M1 code's magnitude is looked up in a 32-bit
  constant holding the 8 magnitudes (times 2) as nibbles (a variable shift), converted
  to float32, signed by its sign bit and multiplied by half the block scale: exact.
- The activations' even and odd columns are separated once, outside (`x[:, 0::2]`,
  `x[:, 1::2]`), so each plane is one MXU dot `x_half @ plane` (`(tokens, features/4)`),
  accumulated in float32 into an output laid out `(4, tokens, features / 4)` that the
  caller interleaves back (`out[q, t, r]` is column `4r + q`).

Operands, by the activations' dtype: `"bfloat16"` multiplies them as they are (a W4A4
layer's quantised values, or a W4A16 layer's bfloat16 input); `"float32"` (float32 or
float16 activations) splits them exactly into three bfloat16 parts (`_pallas_gemm`'s
`_split3`), stacked along the tokens of one dot (the MXU streams the tokens past the
weight tile it holds: at a few tokens three parts cost no more than one), then summed.
The products are exact either way; only the float32 summation order differs from the
reference (`scaled_dot` on `NVFP4Array.operand()` at `HIGHEST`). NaN and infinities
land where the reference's do; the signs of zero sums may differ.

Tiles (`Tiles`): a program computes `tokens x features` outputs and steps through the
contraction `depth` elements at a time (the grid's last axis, accumulating in the
output block). The TPU's layouts ask `features` to be a multiple of 512 (a transposed
tile of words 128 lanes wide) and `depth` of 2048 (128 lanes of block scales); tokens
are padded to a multiple of 16 (bfloat16 sublanes). One table, `DEFAULT_TILES`, picks
the tiles by token count, fitted to the weight (`fit_tiles`: no larger than it, and at
least `MIN_WEIGHT_STEPS` grid steps where it allows); `benchmarks/tpu_frozen_check.py
--sweep` times `SWEEP_TILES` on a TPU to fill it.

Other layouts of the same work (`frozen_matmul`'s `layout`): "chunks" decodes and
multiplies a `CHUNK` of a plane at a time, so that its values can stay in vector
registers; "pairs" (the default at a few tokens) also packs a byte's two planes into one
bfloat16 chunk in contraction order by bit operations (`bf16_pairs`), so that the
activations enter as they are and a chunk takes 4 dots; "wide" (many tokens) interleaves
the planes and the output in VMEM. A stacked weight can be read a layer at a time by
index (`layer=`): the layer's tiles come from the stack itself, with no copy of its slice.

Edges: the last tile of features may overhang the weight (its garbage rows make
outputs that are dropped); a last step that overhangs the contraction masks the
garbage it decodes (`jnp.where`), and the activations are padded with zeros. A weight
smaller than one tile is padded to it (a copy of a small array). 16x16 tiles' scale
bits are expanded to their weight rows tile by tile in VMEM (`_half_scale_rows`), or
with `tile_scales="caller"` to one row per weight row before the call (one scale per
1x16 block: an eighth of the codes' bytes, written once per call).

Runs on the CPU in TPU interpret mode (`interpret=True`, the tests) and lowers for TPUs
on the CPU; Mosaic's own compile runs only on a TPU.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, UInt8

from .._numerics._constants import BLOCK, E2M1_VALUES, TILE
from ._batching import ONE_PASS as _ONE_PASS, one_problem_at_a_time
from ._pallas_gemm import _split3, check_packed

#: `features` and `depth` of a tile must be multiples of these (see the module docstring).
FEATURES_STEP = 512
DEPTH_STEP = 2048
#: Tokens are padded to a multiple of this (a bfloat16 vreg's sublanes).
TOKENS_STEP = 16
#: The most VMEM (`_vmem_bytes`' bound) a call's tiles may take: a tile's tokens are
#: halved until it fits. The default many-token tile with bfloat16 activations,
#: (1024, 2048, 2048) "wide", bounds 55.5 MiB and ran on a TPU v5e (128 MiB of VMEM; the
#: sweep's (2048, 2048, 2048), 94 MiB, compiled too); float32 activations (three parts)
#: at 1024 tokens would bound 83.5 MiB and have not run there: they take 512.
VMEM_BUDGET = 64 << 20


class Tiles(NamedTuple):
    """A program's tile: `tokens x features` outputs, `depth` contraction elements per
    step (`tokens` a multiple of 16, `features` of 512, `depth` of 2048)."""

    tokens: int
    features: int
    depth: int


#: Tiles by token count: `(most tokens, tiles)`, the first that fits; `None`: any.
#: From `benchmarks/tpu_frozen_check.py --sweep` on a TPU v5e (2026-12-05, 8 layers
#: 8192x8192, bfloat16 activations, each layer's output the next one's input): at 16
#: tokens the seven tiles were within 2.28-2.67 ms over two runs, (16, 2048, 4096) among
#: the fastest in both; at 256 tokens (256, 2048, 2048) "wide" was fastest (3.27 ms;
#: "planes" 5.07 ms); at 4096 tokens (1024, 2048, 2048) "wide" (29.4 ms; "planes" 62.0
#: ms, bf16 weights 25.2 ms).
DEFAULT_TILES: tuple[tuple[int | None, Tiles], ...] = (
    (16, Tiles(16, 2048, 4096)),
    (256, Tiles(256, 2048, 2048)),
    (None, Tiles(1024, 2048, 2048)),
)

#: The tiles the sweep times, by token bucket (the bucket's largest token count).
SWEEP_TILES: dict[int, tuple[Tiles, ...]] = {
    16: (
        Tiles(16, 512, 2048),
        Tiles(16, 1024, 2048),
        Tiles(16, 2048, 2048),
        Tiles(16, 512, 4096),
        Tiles(16, 1024, 4096),
        Tiles(16, 2048, 4096),
        Tiles(16, 4096, 2048),
    ),
    256: (
        Tiles(128, 1024, 2048),
        Tiles(256, 1024, 2048),
        Tiles(256, 2048, 2048),
        Tiles(256, 1024, 4096),
    ),
    4096: (
        Tiles(256, 1024, 2048),
        Tiles(512, 1024, 2048),
        Tiles(512, 2048, 2048),
        Tiles(1024, 1024, 2048),
        Tiles(1024, 2048, 2048),
        Tiles(2048, 1024, 2048),
        Tiles(2048, 2048, 2048),
    ),
}

#: 2 x the E2M1 magnitudes of codes 0..7 (0, 1, 2, 3, 4, 6, 8, 12), nibble `c` holding
#: code `c`'s, as an int32 constant: `(TABLE >> 4c) & 15` looks one up.
_TABLE = sum(int(2 * v) << (4 * c) for c, v in enumerate(E2M1_VALUES))
_TABLE_I32 = _TABLE - (1 << 32) if _TABLE >= 1 << 31 else _TABLE
_SIGN = -(1 << 31)  # int32 with only bit 31 set
_LANES = 128

#: `frozen_matmul`'s `interpret` values: what `pallas_call` is given for each.
_INTERPRETERS = {
    False: False,
    True: pltpu.InterpretParams(out_of_bounds_reads="uninitialized"),
    "plain": True,
}


def default_tiles(tokens: int) -> Tiles:
    """The default tiles for `tokens` rows of activations."""
    for most, tiles in DEFAULT_TILES:
        if most is None or tokens <= most:
            return tiles
    raise AssertionError("the last entry of DEFAULT_TILES takes any token count")


#: The default tiles are narrowed (features halved, down to `FEATURES_STEP`) until a call
#: has at least this many grid steps, so that the pipeline overlaps one tile's DMA with
#: another's decode and dots (a call of one step does them in turn). From first
#: principles; not yet timed on a TPU (the sweep's weights were 8192x8192).
MIN_WEIGHT_STEPS = 4


def fit_tiles(tiles: Tiles, rows: int, depth: int, tokens: int = 1) -> Tiles:
    """`tiles` fitted to a weight of `rows` x `depth` (padded) elements and `tokens`
    rows of activations: no wider or deeper than the weight rounded up to the layouts'
    steps (a tile past the weight costs a padded copy of it each call and work on the
    padding), then narrowed until the call has `MIN_WEIGHT_STEPS` grid steps where the
    weight allows (steps along the tokens count: narrower tiles read the activations
    more often)."""
    bn = min(tiles.features, -(-rows // FEATURES_STEP) * FEATURES_STEP)
    bk = min(tiles.depth, -(-depth // DEPTH_STEP) * DEPTH_STEP)
    steps = lambda bn: -(-tokens // tiles.tokens) * -(-rows // bn) * -(-depth // bk)  # noqa: E731
    while bn > FEATURES_STEP and steps(bn) < MIN_WEIGHT_STEPS:
        bn = max(FEATURES_STEP, bn // 2 // FEATURES_STEP * FEATURES_STEP)
    return Tiles(tiles.tokens, bn, bk)


def check_tiles(tiles: Tiles) -> None:
    """Raise for tiles the kernel's layouts cannot take (see `Tiles`)."""
    bm, bn, bk = tiles
    if bm <= 0 or bm % TOKENS_STEP or bn <= 0 or bn % FEATURES_STEP or bk <= 0 or bk % DEPTH_STEP:
        raise ValueError(
            f"`tiles` {tiles}: `tokens` must be a positive multiple of {TOKENS_STEP}, "
            f"`features` of {FEATURES_STEP} and `depth` of {DEPTH_STEP}; pick such tiles."
        )


def half_scales(bits: Array) -> Float[Array, "*s"]:
    """Half the float32 value of E4M3 bit patterns held in int32 (0..255): `_pack.
    decode_e4m3(bits) / 2` (NaN for `0x7F`/`0xFF`), in int32 arithmetic (Mosaic-friendly;
    the halving is exact: the smallest subnormal E4M3, `2^-9`, halves to a normal
    float32)."""
    mag = bits & 0x7F
    normal = (mag << 20) + ((120 - 1) << 23)  # exponent field e + 120, less 1: halved
    sub = lax.bitcast_convert_type((mag & 7).astype(jnp.float32) * (2.0**-10), jnp.int32)
    out = jnp.where(mag < 8, sub, normal)
    out = jnp.where(mag == 0x7F, jnp.int32(0x7FC00000), out)
    return lax.bitcast_convert_type(out | ((bits & 0x80) << 24), jnp.float32)


def double_e2m1(words: Array, shift: int) -> Float[Array, "*s"]:
    """Twice the E2M1 value of the 4-bit code at bits `shift..shift+3` of each int32 word,
    as float32 (exact, signed zero included): the magnitude looked up in `_TABLE`, the
    sign bit moved to bit 31."""
    index = (words << 2) if shift == 0 else (words >> (shift - 2))  # 4 x code, bits 2-4
    index = index & 0x1C
    magnitude = (jnp.full(words.shape, _TABLE_I32, jnp.int32) >> index) & 0xF
    sign = (words << (28 - shift)) & jnp.int32(_SIGN)
    bits = lax.bitcast_convert_type(magnitude.astype(jnp.float32), jnp.int32) | sign
    return lax.bitcast_convert_type(bits, jnp.float32)


def _half_scale_rows(scales_ref, rows: int) -> list[Array]:
    """The step's half block scales by byte `q` (`half_scales`), arrays `(depth/16,
    features/4)`: lane `r` of the `q`-th those of weight row `4r + q` (`rows` weight rows
    a tile), byte `q`'s at index `q % len(result)`. `scales_ref` holds one scale row per
    weight row (1x16 blocks, or 16x16 tiles' expanded by the caller), read as transposed
    words (byte `q` of a word: row `4r + q`): 4 arrays; or, for 16x16 tiles, one per 16
    weight rows (`rows / 16`): then the 4 rows of a word share their scale, so one array
    is decoded for all 4 (the result's only one), each scale row copied down the 4 word
    rows of its 16 weight rows (on 1/128 of the codes' bytes, instead of a copy in HBM
    before the call)."""
    if scales_ref.shape[0] == rows:
        swords = pltpu.bitcast(scales_ref[...], jnp.int32).T  # (depth/16, features/4)
        return [half_scales((swords >> (8 * q)) & 0xFF) for q in range(4)]
    words = pltpu.bitcast(scales_ref[...], jnp.int32)  # (rows/64, depth/16): 4 tile rows
    n4, width = words.shape
    bands = []
    for q in range(4):  # tile row 4w + q: weight rows 64w + 16q .. + 15, word rows 4 of them
        byte = lax.shift_right_logical(words, 8 * q) & 0xFF
        bands.append(jnp.broadcast_to(byte[:, None, :], (n4, 4, width)))
    return [half_scales(jnp.stack(bands, axis=1).reshape(16 * n4, width).T)]


def _planes(codes_ref, scales_ref, tail):
    """This step's 8 planes of exact block values, `(q, h, plane)`: `plane` `(depth/2,
    features/4)` float32 holds the nibble `h` (0: low, the even columns; 1: high, the
    odd ones) of byte `q` of each word (weight rows `4r + q`). `tail`: the codes' bytes
    per row when the last step overhangs them (bytes past it are garbage: zeroed)."""
    words = pltpu.bitcast(codes_ref[...], jnp.int32).T  # (depth/2, features/4)
    half, quarter = words.shape
    expanded = [  # each scale down its 8 code bytes: (depth/2, features/4), 1 or 4 of them
        jnp.broadcast_to(hs[:, None, :], (half // 8, 8, quarter)).reshape(half, quarter)
        for hs in _half_scale_rows(scales_ref, codes_ref.shape[0])
    ]
    valid = None
    if tail is not None:
        byte = pl.program_id(2) * half + lax.broadcasted_iota(jnp.int32, (half, 1), 0)
        valid = byte < tail
    for q in range(4):
        s = expanded[q % len(expanded)]
        for h in range(2):
            w = double_e2m1(words, 8 * q + 4 * h) * s  # exact block values
            yield q, h, w if valid is None else jnp.where(valid, w, 0.0)


def _sum_parts(d: Array, bm: int, parts: int) -> Array:
    """The `parts` stacked row blocks of `d` (the bfloat16 parts of the activations)
    added up."""
    part = d[:bm]
    for p in range(1, parts):
        part = part + d[p * bm : (p + 1) * bm]
    return part


def _kernel(xe_ref, xo_ref, codes_ref, scales_ref, out_ref, *, parts, tail):
    """One step: the `(depth/2, features/4)` planes of this tile's codes times the
    activations' even and odd columns, added into the `(4, tokens, features/4)` output
    block."""

    @pl.when(pl.program_id(2) == 0)
    def _():
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

    _, bm, half = xe_ref.shape
    xs = (xe_ref[...].reshape(parts * bm, half), xo_ref[...].reshape(parts * bm, half))
    d = {}  # this byte's products, by nibble
    for q, h, w in _planes(codes_ref, scales_ref, tail):
        d[h] = jnp.dot(
            xs[h], w.astype(jnp.bfloat16), preferred_element_type=jnp.float32, precision=_ONE_PASS
        )
        if h == 1:
            out_ref[q] += _sum_parts(d[0] + d[1], bm, parts)


#: `frozen_matmul`'s layouts (see its docstring).
LAYOUTS = ("planes", "chunks", "pairs", "wide")
#: Up to this many tokens the default layout is "pairs": on a TPU v5e (2026-12-06, 4
#: layers 8192x8192 as separate arrays, bfloat16 activations, 1 and 16 tokens) 0.93x
#: the time of "planes" ("chunks" 0.96-0.97x), at any of 128-512 code bytes a chunk.
PAIRS_TOKENS = 16

#: The "chunks" and "pairs" layouts' `(depth / 2, features / 4)` chunk of a plane: what
#: one step of their loop decodes and multiplies (`_kernel_chunked`; `chunk_rows` sets
#: the first).
CHUNK = (256, 128)


def _half_scales_to(sc_ref, scales_ref, lanes: int, rows: int) -> None:
    """This step's half block scales, decoded once into `sc_ref` `(1 or 4,
    features/4/lanes, depth/16, lanes)`: `sc_ref[q % len(sc_ref), g]` the scales of
    weight rows `4r + q` for the lane group `g` of `r` (the "chunks" and "pairs" layouts;
    `rows`: the tile's weight rows; one for all 4 bytes where they share their scales,
    `_half_scale_rows`)."""
    for q, sq in enumerate(_half_scale_rows(scales_ref, rows)):
        for g in range(sc_ref.shape[1]):
            sc_ref[q, g] = sq[:, g * lanes : (g + 1) * lanes]


def bf16_pairs(even: Array, odd: Array) -> Array:
    """Two float32 arrays `(r, c)` of values exact in bfloat16 as one bfloat16 array
    `(2r, c)` holding `even`'s row `i` at row `2i` and `odd`'s at `2i + 1`: their upper
    halves packed into 32-bit words (low half the even row, as `pltpu.bitcast` reads a
    word's halves along the sublanes), with no rounding: the lower halves are zero."""
    lo = lax.shift_right_logical(lax.bitcast_convert_type(even, jnp.int32), 16)
    hi = lax.bitcast_convert_type(odd, jnp.int32) & jnp.int32(-(1 << 16))
    return pltpu.bitcast(lo | hi, jnp.bfloat16)


def _kernel_chunked(*refs, parts, tail, rc, pairs: bool, unroll: int | bool = 1):
    """One step of the "chunks" and "pairs" layouts: `_kernel`'s planes, decoded and
    multiplied a `CHUNK` at a time (a loop over the features, the contraction
    unrolled), so that a chunk's codes, values and products can stay in vector
    registers instead of whole `(depth/2, features/4)` planes passing through VMEM
    between operations. The half scales are decoded once per step into `sc_ref` `(1 or 4,
    features/4/L, depth/16, L)` (`_half_scales_to`), and expanded down their code bytes
    once per chunk for the bytes that share them; each feature chunk's four products (by
    byte `q`) go to `acc_ref` `(4, features/4/L, parts*tokens, L)`, added into the
    output block at the end of the step.

    "chunks" (`refs`: the activations' even and odd columns apart) multiplies each
    nibble's chunk by its columns, 8 dots a chunk. "pairs" (`refs`: the activations as
    they are) packs a byte's two nibbles, columns `2i` and `2i + 1` of the weight, into
    one bfloat16 chunk `(2 x depth chunk, lanes)` in contraction order (`bf16_pairs`:
    bit operations, no float32 to bfloat16 conversion) and multiplies it by the
    activations' chunk as it is: 4 dots a chunk. `unroll`: the feature chunks' loop
    unrolled by this many (`True`: wholly), so that one chunk's decode can be scheduled
    beside another's dots."""
    x_refs = refs[:1] if pairs else refs[:2]
    codes_ref, scales_ref, out_ref, sc_ref, acc_ref = refs[len(x_refs) :]
    lc = CHUNK[1]
    kk = pl.program_id(2)

    @pl.when(kk == 0)
    def _():
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

    _, bm, width = x_refs[0].shape
    half = width // 2 if pairs else width  # the codes' bytes per row in a step
    cw = 2 * rc if pairs else rc  # an activations' chunk's columns
    groups = out_ref.shape[2] // lc
    _half_scales_to(sc_ref, scales_ref, lc, codes_ref.shape[0])
    xs = [
        [ref[:, :, c * cw : (c + 1) * cw].reshape(parts * bm, cw) for c in range(half // rc)]
        for ref in x_refs
    ]

    def feature_chunk(g, carry):
        rows = pl.ds(pl.multiple_of(g * 4 * lc, 4 * lc), 4 * lc)
        accs = [jnp.zeros((parts * bm, lc), jnp.float32) for _ in range(4)]
        for c, c0 in enumerate(range(0, half, rc)):
            words = pltpu.bitcast(codes_ref[rows, c0 : c0 + rc], jnp.int32).T  # (rc, lc)
            valid = None
            if tail is not None:
                byte = kk * half + c0 + lax.broadcasted_iota(jnp.int32, (rc, 1), 0)
                valid = byte < tail
            scales = [  # each (rc/8, lc) scale down its 8 code bytes: (rc, lc)
                jnp.broadcast_to(
                    sc_ref[i, g, c0 // 8 : (c0 + rc) // 8][:, None, :], (rc // 8, 8, lc)
                ).reshape(rc, lc)
                for i in range(sc_ref.shape[0])
            ]
            for q in range(4):
                s = scales[q % len(scales)]
                w = [double_e2m1(words, 8 * q + 4 * h) * s for h in range(2)]  # exact
                if valid is not None:
                    w = [jnp.where(valid, v, 0.0) for v in w]
                if pairs:  # (2 rc, lc): contraction rows 2 (c0 + i) + h
                    products = [(xs[0][c], bf16_pairs(*w))]
                else:
                    products = [(xs[h][c], w[h].astype(jnp.bfloat16)) for h in range(2)]
                for xc, wc in products:
                    accs[q] += jnp.dot(
                        xc, wc, preferred_element_type=jnp.float32, precision=_ONE_PASS
                    )
        for q in range(4):
            acc_ref[q, g] = accs[q]
        return carry

    lax.fori_loop(0, groups, feature_chunk, 0, unroll=unroll)
    for q in range(4):
        for g in range(groups):
            out_ref[q, :, g * lc : (g + 1) * lc] += _sum_parts(acc_ref[q, g], bm, parts)


def _kernel_wide(x_ref, codes_ref, scales_ref, out_ref, wt_ref, acc_ref, ot_ref, *, parts, tail):
    """One step of the many-token layout: each plane pair (byte `q`, low and high
    nibble) interleaved back along the contraction in VMEM (strided sublane stores into
    `wt_ref`, `(features/512, depth, 128)`), so that the activations' tile enters one
    dot as it is; the planes' products added into `acc_ref` `(4, tokens, features/4)`,
    interleaved back along the features at the last step (a transpose per 128 tokens and
    plane, strided sublane stores into `ot_ref` `(features, 128)`, a transpose back)."""
    kk = pl.program_id(2)

    @pl.when(kk == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)

    _, bm, bk = x_ref.shape
    half, quarter = bk // 2, acc_ref.shape[2]
    x = x_ref[...].reshape(parts * bm, bk)
    for q, h, w in _planes(codes_ref, scales_ref, tail):
        groups = quarter // _LANES
        for g in range(groups):
            wt_ref[g, pl.ds(h, half, stride=2), :] = w[:, g * _LANES : (g + 1) * _LANES]
        if h == 0:
            continue
        for g in range(groups):
            wq = wt_ref[g].astype(jnp.bfloat16)  # (depth, 128): rows in contraction order
            d = jnp.dot(x, wq, preferred_element_type=jnp.float32, precision=_ONE_PASS)
            acc_ref[q, :, g * _LANES : (g + 1) * _LANES] += _sum_parts(d, bm, parts)

    @pl.when(kk == pl.num_programs(2) - 1)
    def _():
        for c in range(bm // _LANES):
            rows = slice(c * _LANES, (c + 1) * _LANES)
            for q in range(4):
                ot_ref[pl.ds(q, quarter, stride=4), :] = acc_ref[q, rows, :].T
            out_ref[rows, :] = ot_ref[...].T


def _vmem_bytes(parts: int, tiles: Tiles, wide: bool = False, chunks: bool = False) -> int:
    """A bound on the kernel's VMEM: double-buffered blocks, scratch (the many-token
    layout's, the "chunks" layout's) and the step's temporaries."""
    bm, bn, bk = tiles
    blocks = 2 * (2 * parts * bm * (bk // 2) * 2 + bn * bk // 2 + bn * bk // 16 + bm * bn * 4)
    temps = 4 * (bk // 2) * (bn // 4) * 4 + 3 * parts * bm * (bn // 4) * 4
    scratch = (bm * bn + bk * bn // 4 + bn * _LANES) * 4 if wide else 0
    if chunks:  # the half scales, the products
        scratch = bk * bn // 4 + parts * bm * bn * 4
    return blocks + temps + scratch


@functools.partial(
    jax.jit,
    static_argnames=(
        "block",
        "n",
        "operand",
        "tiles",
        "interpret",
        "layout",
        "chunk_rows",
        "tile_scales",
        "unroll",
    ),
)
def frozen_matmul(
    x: Float[Array, "m k"],
    codes: UInt8[Array, "*layers rows k2"],
    scale_bits: UInt8[Array, "*layers srows k16"],
    *,
    block: tuple[int, int],
    n: int,
    operand: str,
    tiles: Tiles | None = None,
    interpret: bool | str = False,
    layout: str | None = None,
    chunk_rows: int | None = None,
    layer: Array | int | None = None,
    tile_scales: str = "kernel",
    unroll: int | bool | None = None,
) -> Float[Array, "m n"]:
    """`x @ W.T` in float32 for the NVFP4 weight `W` `(n, k)` held as `codes` and
    `scale_bits` (an `NVFP4Array`'s fields, padded layout), without its tensor scale.

    **Arguments:**

    - `x`: the activations `(m, k)`, bfloat16, float16 or float32.
    - `codes`, `scale_bits`: the packed codes `(n or n padded to 16, k_pad / 2)` and the
      E4M3 scales' bits (`(n, k_pad / 16)` for 1x16 blocks, `(n_pad / 16, k_pad / 16)`
      for 16x16 tiles).
    - `block`: `(1, 16)` or `(16, 16)`; `n`: the weight's rows.
    - `operand`: `"bfloat16"` or `"float32"` (see the module docstring).
    - `tiles`: a `Tiles`, by default `default_tiles(m)` fitted to the weight
      (`fit_tiles`); its tokens are halved while the call's VMEM bound passes
      `VMEM_BUDGET`.
    - `layer`: with stacked `codes` `(layers, rows, k_pad / 2)` and `scale_bits`
      `(layers, srows, k_pad / 16)`, the layer to multiply by (an int32 scalar, traced or
      not; clipped into range, as `lax.dynamic_index_in_dim` does): the call reads that
      layer's tiles from the stack itself (the index prefetched into SMEM, in the blocks'
      index maps), with no copy of the layer's slice, which `lax.scan` over a stack makes
      before a custom call.
    - `tile_scales`: for 16x16 tiles, where their scale bits become one row per weight
      row: `"kernel"` (the default: each step's tile of them expanded in VMEM,
      `_half_scale_rows`; on a TPU v5e, 4 layers 8192x8192 at 1 and 16 tokens, 0.87x the
      time of `"caller"`, bit for bit the same) or `"caller"` (a `jnp.repeat` before the
      call: an eighth of the codes' bytes written and read again each call).
    - `unroll`: the `"chunks"` and `"pairs"` layouts' loop over feature chunks unrolled
      this many times (`True`: wholly, the default: on a TPU v5e, 4 layers 8192x8192 of
      16x16 tiles at 1 token, "pairs" took 0.93x the time of the loop not unrolled;
      unrolled by 2, 1.00x; `_kernel_chunked`).
    - `chunk_rows`: the code bytes along the contraction of the `"chunks"` and `"pairs"`
      layouts' chunk (default `CHUNK[0]`; a multiple of 128 dividing the tile's).
    - `interpret`: `True`: run in Pallas's TPU interpreter (a CPU; reads past an
      array's end give NaN there, as garbage would on a TPU); `"plain"`: in Pallas's
      generic interpreter, which runs inside nvfp4x's primitives under `lax.scan` (their
      lowering has no token for the TPU interpreter's ordered callbacks).
    - `layout`: `"planes"` (the activations' even and odd columns apart, the output
      interleaved after the call: cheap at a few tokens), `"chunks"` (as `"planes"`,
      decoded and multiplied a `CHUNK` at a time), `"pairs"` (as `"chunks"`, a byte's
      two nibbles packed into one bfloat16 chunk in contraction order: the activations
      as they are, half as many dots) or `"wide"` (both interleaves in VMEM: at many
      tokens XLA's strided copies of the activations and the output cost more than the
      kernel); by default `"pairs"` up to `PAIRS_TOKENS` tokens, `"wide"` where the
      tile's tokens are a multiple of 128 and there are at least 128 tokens, else
      `"planes"`.

    **Returns:** `(m, n)` float32, `scaled_dot`'s product before its scales, up to
    float32 summation order.
    """
    m, k = x.shape
    block = (block[0], block[1])
    stacked_w = layer is not None
    at = None  # the layer's index, prefetched (with `layer`)
    if stacked_w:
        if codes.ndim != 3 or scale_bits.ndim != 3 or codes.shape[0] != scale_bits.shape[0]:
            raise ValueError(
                f"`layer` takes stacked `codes` and `scale_bits` (a leading axis of layers), "
                f"got {codes.shape} and {scale_bits.shape}."
            )
        layers = codes.shape[0]
        at = jnp.clip(jnp.asarray(layer, jnp.int32), 0, layers - 1).reshape(1)
        one = lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype)  # noqa: E731
        check_packed(one(codes), one(scale_bits), block=block, n=n, k=k, operand=operand)
    else:
        check_packed(codes, scale_bits, block=block, n=n, k=k, operand=operand)
    tiles = (
        fit_tiles(default_tiles(m), codes.shape[-2], 2 * codes.shape[-1], m)
        if tiles is None
        else tiles
    )
    check_tiles(tiles)
    if layout is None:
        layout = "wide" if tiles.tokens % _LANES == 0 and m >= _LANES else "planes"
        layout = "pairs" if m <= PAIRS_TOKENS else layout
    if layout not in LAYOUTS or (layout == "wide" and tiles.tokens % _LANES):
        raise ValueError(
            f"`layout={layout!r}` with tiles {tiles}: `layout` is one of {LAYOUTS} ('wide': "
            f"tiles' tokens a multiple of {_LANES})."
        )
    for name, value in (("chunk_rows", chunk_rows), ("unroll", unroll)):
        if value is not None and layout not in ("chunks", "pairs"):
            raise ValueError(
                f"`{name}={value}` with `layout={layout!r}`: only the 'chunks' and 'pairs' "
                "layouts work in chunks."
            )
    step = _LANES if layout == "wide" else TOKENS_STEP
    bm = min(tiles.tokens, -(-m // step) * step)
    bn, bk = tiles.features, tiles.depth
    parts = 3 if operand == "float32" else 1
    wide, chunks = layout == "wide", layout in ("chunks", "pairs")
    while bm > step and _vmem_bytes(parts, Tiles(bm, bn, bk), wide, chunks) > VMEM_BUDGET:
        bm = max(step, bm // 2 // step * step)  # (float32 activations: three parts)
    if tile_scales not in ("caller", "kernel"):
        raise ValueError(f"`tile_scales={tile_scales!r}`: 'caller' or 'kernel'.")
    per_row = 1  # weight rows per scale row, as the kernel reads them
    if block == TILE and tile_scales == "kernel":
        per_row = BLOCK  # (expanded in VMEM: `_half_scale_rows`)
    elif block == TILE:  # one scale row per weight row (see the module docstring)
        if at is not None:  # (a stack: the layer's 16x16 scales: 1/128 of its codes' bytes)
            scale_bits = lax.dynamic_index_in_dim(scale_bits, at[0], 0, keepdims=False)
        scale_bits = jnp.repeat(scale_bits, BLOCK, axis=-2)
    stacked_s = scale_bits.ndim == 3
    rows, width = codes.shape[-2:]
    lead = ((0, 0),) if stacked_w else ()
    # A weight smaller than one tile is padded to it; a larger one may overhang.
    if rows < bn:
        codes = jnp.pad(codes, (*lead, (0, bn - rows), (0, 0)))
        pad_r = (0, (bn - rows) // per_row)
        scale_bits = jnp.pad(scale_bits, (*lead[:stacked_s], pad_r, (0, 0)))
    if width < bk // 2:
        codes = jnp.pad(codes, (*lead, (0, 0), (0, bk // 2 - width)))
        pad_s = (0, bk // 16 - scale_bits.shape[-1])
        scale_bits = jnp.pad(scale_bits, (*lead[:stacked_s], (0, 0), pad_s))
    n_tiles, k_tiles = pl.cdiv(codes.shape[-2], bn), pl.cdiv(width, bk // 2)
    m_tiles = pl.cdiv(m, bm)
    tail = width if width % (bk // 2) and width > bk // 2 else None

    # The activations: zero-padded to whole tiles, float32 ones as three exact bfloat16
    # parts (a leading axis of parts); for "planes", even and odd columns apart.
    xp = jnp.pad(x, ((0, m_tiles * bm - m), (0, k_tiles * bk - k)))
    if operand == "float32":
        stacked = jnp.stack(_split3(xp.astype(jnp.float32)))
    else:
        stacked = xp.astype(jnp.bfloat16)[None]
    # With `layer`, every index map also takes the prefetched layer index (`at[0]`).
    tile = lambda f: (lambda i, j, kk, _layer: f(i, j, kk)) if stacked_w else f  # noqa: E731

    def weight_spec(shape: tuple[int, int], stacked: bool) -> pl.BlockSpec:
        """A weight operand's tile `shape` at grid step `(j, kk)`, in the prefetched
        layer of a stack where it is `stacked`."""
        if stacked:
            return pl.BlockSpec((None, *shape), lambda i, j, kk, at: (at[0], j, kk))
        return pl.BlockSpec(shape, tile(lambda i, j, kk: (j, kk)))

    codes_spec = weight_spec((bn, bk // 2), stacked_w)
    scales_spec = weight_spec((bn // per_row, bk // BLOCK), stacked_s)
    prefetch = (at,) if stacked_w else ()

    def call_with(kernel, **kwargs):
        """`pl.pallas_call` of `kernel` over the grid, its `in_specs`, `out_specs` and
        `scratch_shapes` in `kwargs`; with `layer`, the index prefetched (the kernel
        ignores it: only the index maps read it)."""
        grid = (m_tiles, n_tiles, k_tiles)
        if stacked_w:
            kwargs["grid_spec"] = pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1,
                grid=grid,
                in_specs=kwargs.pop("in_specs"),
                out_specs=kwargs.pop("out_specs"),
                scratch_shapes=kwargs.pop("scratch_shapes"),
            )
            body = lambda _l, *refs: kernel(*refs)  # noqa: E731
        else:
            kwargs["grid"], body = grid, kernel
        return pl.pallas_call(
            body, compiler_params=params, interpret=_INTERPRETERS[interpret], **kwargs
        )

    limit = min(max(32 << 20, 2 * _vmem_bytes(parts, Tiles(bm, bn, bk), wide, chunks)), 100 << 20)
    params = pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "arbitrary"), vmem_limit_bytes=limit
    )
    if wide:
        call = call_with(
            functools.partial(_kernel_wide, parts=parts, tail=tail),
            out_shape=jax.ShapeDtypeStruct((m_tiles * bm, n_tiles * bn), jnp.float32),
            in_specs=[
                pl.BlockSpec((parts, bm, bk), tile(lambda i, j, kk: (0, i, kk))),
                codes_spec,
                scales_spec,
            ],
            out_specs=pl.BlockSpec((bm, bn), tile(lambda i, j, kk: (i, j))),
            scratch_shapes=[
                pltpu.VMEM((bn // 4 // _LANES, bk, _LANES), jnp.float32),
                pltpu.VMEM((4, bm, bn // 4), jnp.float32),
                pltpu.VMEM((bn, _LANES), jnp.float32),
            ],
            name="nvfp4_frozen_matmul_tpu_wide",
        )
        return one_problem_at_a_time(call)(*prefetch, stacked, codes, scale_bits)[:m, :n]

    if layout == "pairs":  # the activations as they are
        xs = (stacked,)
        x_specs = [pl.BlockSpec((parts, bm, bk), tile(lambda i, j, kk: (0, i, kk)))]
    else:  # even and odd columns apart
        xs = (stacked[:, :, 0::2], stacked[:, :, 1::2])
        x_specs = [pl.BlockSpec((parts, bm, bk // 2), tile(lambda i, j, kk: (0, i, kk)))] * 2
    kernel = functools.partial(
        {
            "planes": _kernel,
            "chunks": functools.partial(_kernel_chunked, pairs=False),
            "pairs": functools.partial(_kernel_chunked, pairs=True),
        }[layout],
        parts=parts,
        tail=tail,
    )
    scratch = []
    if chunks:
        rc = CHUNK[0] if chunk_rows is None else chunk_rows
        if rc <= 0 or rc % _LANES or (bk // 2) % rc:
            raise ValueError(
                f"`chunk_rows={chunk_rows}`: a multiple of {_LANES} dividing the tile's "
                f"{bk // 2} code bytes per row."
            )
        kernel = functools.partial(kernel, rc=rc, unroll=True if unroll is None else unroll)
        groups = bn // 4 // CHUNK[1]
        scale_sets = 4 if per_row == 1 else 1  # (a word's 4 bytes share 16x16 scales)
        scratch = [
            pltpu.VMEM((scale_sets, groups, bk // BLOCK, CHUNK[1]), jnp.float32),
            pltpu.VMEM((4, groups, parts * bm, CHUNK[1]), jnp.float32),
        ]
    call = call_with(
        kernel,
        out_shape=jax.ShapeDtypeStruct((4, m_tiles * bm, n_tiles * bn // 4), jnp.float32),
        in_specs=[*x_specs, codes_spec, scales_spec],
        out_specs=pl.BlockSpec((4, bm, bn // 4), tile(lambda i, j, kk: (0, i, j))),
        scratch_shapes=scratch,
        name="nvfp4_frozen_matmul_tpu" + ("" if layout == "planes" else f"_{layout}"),
    )
    out = one_problem_at_a_time(call)(*prefetch, *xs, codes, scale_bits)
    # out[q, t, r] is column 4r + q of the tile's rows.
    out = jnp.transpose(out, (1, 2, 0)).reshape(m_tiles * bm, n_tiles * bn)
    return out[:m, :n]
