"""The grouped GEMM of mixture-of-experts layers: `lax.ragged_dot` on quantised experts.

A mixture-of-experts layer holds its experts as one weight `W: (G, n, k)` (Equinox
layout; `(G, k, n)` is read the same way) and runs them on tokens sorted by expert,
`x: (T, k)`, the first `group_sizes[0]` tokens going to expert 0 and so on
(`jax.lax.ragged_dot`, as Levanter's MoE and haliax's `MoELinear` call it). Its three
GEMMs are those of a dense layer, run per expert on the expert's own tokens:

| GEMM  | math (tokens `t` of group `g`)        | operands quantised (layout)                 |
| ----- | ------------------------------------- | ------------------------------------------- |
| fprop | `y[t,n] = Σ_k x[t,k] W[g,n,k]`        | x along k; W[g] (recipe.weight, 16x16)      |
| dgrad | `dx[t,k] = Σ_n dy[t,n] W[g,n,k]`      | dy along n (stochastic per recipe); W[g]    |
| wgrad | `dW[g,n,k] = Σ_t dy[t,n] x[t,k]`      | dy and x along the group's tokens, after    |
|       |                                       | the RHT if recipe.rht                       |

Each group is its own problem, exactly as if expert `g` were a dense layer called on its
tokens (`nvfp4x.qdot(x_g, W[g])`): each expert's weight has its own tensor scale and
16x16 tiles; each group's token-side operands have their own tensor scales; wgrad's
16-token blocks and RHT chunks start at the group's first token (a block never holds two
groups' tokens: groups whose size is not a multiple of 16 are zero-padded to one); the
stochastic-rounding key of group `g` is the dense layer's (the seed mixed with a
checksum of `W[g]`), and its thresholds are drawn at the token's position in the group.
Tokens past `sum(group_sizes)` belong to no group and get zeros, as in `ragged_dot`.

Two implementations of each GEMM, equal bit for bit (tests/test_moe.py):

- the reference (`reference_fprop`, `reference_dgrad`, `reference_wgrad`): a loop over
  the groups calling the dense GEMMs of `_gemm` (`fprop`, `dgrad`, `wgrad`) on each
  group's tokens, gathered into a zero-padded buffer;
- the fast path (`grouped_fprop`, ...), for NVFP4 and unquantised operands: each
  token-side operand is quantised once, row by row with its group's tensor scale (fprop,
  dgrad) or in 16-token chunks of a layout where every group starts at a multiple of 16
  (wgrad), and each GEMM is one `lax.ragged_dot_general` (the platform's grouped GEMM)
  on the quantised values, times the two tensor scales of each row or group. Recipes
  with other formats (MXFP8, FP8) run the reference.

Frozen experts (`_frozen.py`, their own primitive on the packed weight) run
`grouped_fprop` on the decoded experts, or, at a few tokens with a kernel that decodes
a packed weight inside its GEMM, `every_expert_fprop`: each expert's GEMM on every
token, each token keeping its own group's row (the same values up to float32
summation order).

As for the dense GEMM (`_gemm.py`), each GEMM is a primitive (`grouped_qdot_p` fprop,
`grouped_dgrad_p`, `grouped_wgrad_p`, and the JVP's two linear parts) so that traced
programs, `nvfp4x.coverage` included, show them. Under `jax.vmap` every vmapped axis
makes independent problems (the group sizes are per problem): one batched `ragged_dot`,
or, on a TPU, whose XLA cannot compile a batched one, the problems one at a time
(`grouped_dot`).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int, UInt32

from . import _kernels
from ._formats import Format, batched_gemm_dtype, gemm_dtype, widest_float
from ._formats._dot import dot_precision
from ._gemm import (
    batched_problem,
    dgrad,
    fprop,
    grad_key,
    mix_weight,
    needs_key,
    quantize_weight,
    shares_weight,
    wgrad,
)
from ._numerics._constants import BLOCK, ROW_BLOCK
from ._numerics._ieee import INF_BITS, abs_bits, from_bits
from ._policy import Recipe
from ._prims import (
    Primitive,
    def_jvp,
    def_transpose,
    is_undefined,
    is_zero,
    primitive,
    vmapped,
    zero,
    zero_tangent,
)

#: Token-blocked axis: 16 tokens down the columns (wgrad's operands).
_TOKEN_BLOCK = (BLOCK, 1)


# --- where each token goes ---


class Groups(NamedTuple):
    """Each token's group and position, for `T` tokens and `G` groups.

    - `gid`: `(T,)` the token's group, `G` for a token past every group;
    - `row`: `(T,)` its position in its group;
    - `pos`: `(T,)` its row in the padded layout (every group starting at a multiple
      of 16), `padded` (out of range) for a token of no group;
    - `padded_sizes`: `(G,)` each group's size rounded up to a multiple of 16;
    - `chunk_gid`, `chunk_index`: `(padded // 16,)` each 16-row chunk's group (`G`:
      none) and its index within the group;
    - `padded`: the padded layout's (static) length, a multiple of 16.
    """

    gid: Int[Array, " T"]
    row: Int[Array, " T"]
    pos: Int[Array, " T"]
    padded_sizes: Int[Array, " G"]
    chunk_gid: Int[Array, " C"]
    chunk_index: Int[Array, " C"]
    padded: int


def groups(group_sizes: Int[Array, " G"], tokens: int) -> Groups:
    """Where each of `tokens` tokens goes, for these group sizes (see `Groups`)."""
    ng = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    t = jnp.arange(tokens, dtype=jnp.int32)
    gid = jnp.searchsorted(ends, t, side="right").astype(jnp.int32)
    inside = jnp.minimum(gid, ng - 1)
    row = t - (ends - sizes)[inside]
    padded_sizes = -(-sizes // BLOCK) * BLOCK
    pends = jnp.cumsum(padded_sizes)
    pstarts = pends - padded_sizes
    # Every group padded to a multiple of 16: at most 15 rows more per group.
    padded = -(-tokens // BLOCK) * BLOCK + BLOCK * ng
    pos = jnp.where(gid < ng, pstarts[inside] + row, padded)
    first = jnp.arange(padded // BLOCK, dtype=jnp.int32) * BLOCK
    chunk_gid = jnp.searchsorted(pends, first, side="right").astype(jnp.int32)
    chunk_index = (first - pstarts[jnp.minimum(chunk_gid, ng - 1)]) // BLOCK
    return Groups(gid, row, pos, padded_sizes, chunk_gid, chunk_index, padded)


def _to_padded(a: Array, g: Groups) -> Array:
    """Token rows `(T, w)` into the padded layout `(padded, w)` (zeros elsewhere)."""
    return jnp.zeros((g.padded, a.shape[-1]), a.dtype).at[g.pos].set(a, mode="drop")


def _group_amax(a: Array, gid: Array, ng: int) -> Float[Array, " G"]:
    """Each group's tensor amax (`max|a|` over its rows, NaN ignored, an infinity
    counted, as the dense quantiser takes it), as an exact integer max of the bits."""
    bits = abs_bits(a)
    rows = jnp.max(jnp.where(bits > INF_BITS, 0, bits), axis=-1)
    amax = jax.ops.segment_max(rows, gid, num_segments=ng + 1)[:ng]
    return from_bits(jnp.maximum(amax, 0))


# --- the token-side quantiser: each group its own tensor scale and keys ---


def _piece(a: Float[Array, "r w"], amax, key, offset, *, fmt: Format, block) -> tuple[Array, Array]:
    """A piece of a group's operand (a row, `block` 1x16, or a 16-token chunk, `block`
    16x1) quantised with the group's `amax`, its stochastic-rounding thresholds drawn at
    `offset`, the piece's first flat index in the group's padded operand: what the dense
    quantiser gives those elements of the whole group (`FormatSpec.quantize_piece`)."""
    return fmt.spec.quantize_piece(a, fmt, amax, key, offset, block)


def _keys(seeds: UInt32[Array, "G 2"] | None, tag: int):
    return None if seeds is None else jax.vmap(lambda s: grad_key(s, tag))(seeds)


def quantize_rows(
    a: Float[Array, "T w"], fmt: Format | None, g: Groups, keys
) -> tuple[Array, Float[Array, " T"] | None]:
    """Token rows quantised along their last axis (fprop's x, dgrad's dy), each group
    with its own tensor scale and (`keys`, one per group) stochastic-rounding key.

    **Returns:** `(values, scale)`, `scale` each row's tensor scale (None unquantised)."""
    if fmt is None:
        return a, None
    ng = g.padded_sizes.shape[0]
    amax = _group_amax(a, g.gid, ng)
    inside = jnp.minimum(g.gid, ng - 1)
    width = -(-a.shape[-1] // BLOCK) * BLOCK
    offset = g.row.astype(jnp.uint32) * jnp.uint32(width)
    piece = functools.partial(_piece, fmt=fmt, block=ROW_BLOCK)
    key = None if keys is None else keys[inside]
    fn = jax.vmap(
        lambda r, m, k, o: piece(r[None], m, k, o), in_axes=(0, 0, None if key is None else 0, 0)
    )
    values, scale = fn(a.astype(jnp.float32), amax[inside], key, offset)
    return values[:, 0], scale


def quantize_tokens(
    a: Float[Array, "P w"], fmt: Format | None, g: Groups, keys
) -> tuple[Array, Float[Array, " G"] | None]:
    """An operand in the padded layout quantised along its tokens (wgrad's), each
    group its own tensor scale and key, its 16-token blocks within the group.

    **Returns:** `(values, scale)`, `scale` each group's tensor scale (None unquantised)."""
    if fmt is None:
        return a, None
    ng = g.padded_sizes.shape[0]
    chunks = a.astype(jnp.float32).reshape(-1, BLOCK, a.shape[-1])
    amax = _group_amax(chunks.reshape(chunks.shape[0], -1), g.chunk_gid, ng)
    inside = jnp.minimum(g.chunk_gid, ng - 1)
    offset = g.chunk_index.astype(jnp.uint32) * jnp.uint32(BLOCK * a.shape[-1])
    piece = functools.partial(_piece, fmt=fmt, block=_TOKEN_BLOCK)
    key = None if keys is None else keys[inside]
    in_axes = (0, 0, None if key is None else 0, 0)
    values, _ = jax.vmap(piece, in_axes=in_axes)(chunks, amax[inside], key, offset)
    return values.reshape(a.shape), fmt.spec.tensor_decode_scale(amax)  # each group's own


def _fast(recipe: Recipe) -> bool:
    """Whether the fast path implements the recipe's token-side formats: formats that
    quantise pieces of an operand (NVFP4), or none."""
    return all(f is None or f.spec.quantizes_pieces for f in (recipe.input, recipe.grad))


# --- the GEMMs ---


def _ragged(a: Array, b: Array, sizes: Array, contract: int, dtype) -> Array:
    """`a[t] @ b[g(t)]` contracting `a`'s last axis with `b`'s axis `contract` (1 or 2
    of `(G, ., .)`), accumulated in float32 on `dtype` operands (float32: the reference
    dtype, or wider), at the dense GEMM's precision (`dot_precision`: float32 operands
    multiplied in float32 on every backend, not in one bfloat16 pass as a TPU's
    DEFAULT does). Rows past every group are zero on every backend (XLA:TPU's
    `ragged_dot` leaves them unspecified)."""
    dtype = _operand_dtype(a, b, dtype)
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (contract,)), ((), ())),
        lhs_ragged_dimensions=(0,),
        rhs_group_dimensions=(0,),
    )
    out = grouped_dot(a.astype(dtype), b.astype(dtype), sizes, dims)
    inside = jnp.arange(a.shape[0]) < jnp.sum(sizes)
    return jnp.where(inside[:, None], out, jnp.zeros((), out.dtype))


#: The platforms whose XLA has no batched `ragged_dot` (a vmapped one fails to compile
#: there: "Failed to create RaggedConvSpec" on a TPU v5e, jax 0.10.2): `grouped_dot`
#: runs a vmapped call one problem at a time there.
UNBATCHED_RAGGED_PLATFORMS: tuple[str, ...] = ("tpu",)


def grouped_dot(a: Array, b: Array, sizes: Array, dims) -> Float[Array, "..."]:
    """`lax.ragged_dot_general(a, b, sizes, dims)` in float32 at `dot_precision`, that
    `jax.vmap` batches on every platform: on `UNBATCHED_RAGGED_PLATFORMS` a vmapped call
    runs its problems one at a time (`lax.map`), elsewhere as XLA's batched
    `ragged_dot`."""
    return _grouped_dot(dims, dot_precision(a.dtype), UNBATCHED_RAGGED_PLATFORMS)(a, b, sizes)


@functools.cache
def _grouped_dot(dims, precision, unbatched: tuple[str, ...]):
    def plain(a, b, sizes):
        return lax.ragged_dot_general(
            a, b, sizes, dims, precision=precision, preferred_element_type=jnp.float32
        )

    @jax.custom_batching.custom_vmap
    def one(a, b, sizes):
        return plain(a, b, sizes)

    @one.def_vmap
    def _(axis_size, in_batched, a, b, sizes):
        ops = (a, b, sizes)
        mapped = tuple(o for o, m in zip(ops, in_batched, strict=True) if m)

        def operands(mapped):  # the mapped operands (or their slices) among the others
            it = iter(mapped)
            return tuple(next(it) if m else o for o, m in zip(ops, in_batched, strict=True))

        def batched(*mapped):
            axes = tuple(0 if m else None for m in in_batched)
            return jax.vmap(plain, in_axes=axes)(*operands(mapped))

        def one_at_a_time(*mapped):
            return lax.map(lambda xs: one(*operands(xs)), mapped)

        per = {p: one_at_a_time for p in unbatched}
        return lax.platform_dependent(*mapped, default=batched, **per), True

    return one


def _operand_dtype(a: Array, b: Array, dtype):
    bf16 = jnp.dtype(jnp.bfloat16)
    dtype = batched_gemm_dtype(dtype)
    if dtype is not None and a.dtype == bf16 and b.dtype == bf16:
        return dtype
    return widest_float(a.dtype, b.dtype, jnp.float32)


def _row_scales(a_scale, b_scale, inside: Array) -> Array | None:
    """Each row's product of the two tensor scales (`a_scale` per row, `b_scale` per
    group), in the dense GEMM's order `out * (sa * sb)`."""
    scales = [s for s in (a_scale, None if b_scale is None else b_scale[inside]) if s is not None]
    if not scales:
        return None
    return scales[0] * scales[1] if len(scales) == 2 else scales[0]


def _scaled_rows(out: Array, scale: Array | None) -> Array:
    return out if scale is None else out * scale[:, None]


def grouped_fprop(x, wv, ws, sizes, *, recipe: Recipe, dtype) -> Float[Array, "T n"]:
    """fprop: `Q(x[t]) @ Q(W[g]).T` per group; `(wv, ws)` the experts' quantised
    weights `(G, n, k)` and tensor scales `(G,)`."""
    if not _fast(recipe):
        return reference_fprop(x, wv, ws, sizes, recipe=recipe, dtype=dtype)
    out = _rows_fprop(x, sizes, recipe, lambda xv, g: (_ragged(xv, wv, sizes, 2, dtype), ws))
    assert out is not None  # (the product above always gives one)
    return out


def every_expert_fprop(x, sizes, products, *, recipe: Recipe) -> Float[Array, "T n"] | None:
    """`grouped_fprop` by every expert's GEMM on every token, each token keeping its own
    group's row (zeros for a token of no group, as `ragged_dot` gives): for frozen
    experts at a few tokens, where `products(xv) -> (ys, ws)` is a kernel that decodes
    each expert's packed weight inside its GEMM (`ys`: `(G, T, n)` float32 products
    before the tensor scales, `ws`: `(G,)` the experts' tensor scales or None). x is
    quantised, and each row scaled, as `grouped_fprop` does: the same values up to
    float32 summation order (the products are exact). None where `products` gives None
    or the recipe's formats run the reference (the caller runs `grouped_fprop`)."""
    if not _fast(recipe):
        return None

    def own_rows(xv, g):
        got = products(xv)
        if got is None:
            return None
        ys, ws = got
        ng = sizes.shape[0]
        rows = ys[jnp.minimum(g.gid, ng - 1), jnp.arange(x.shape[0])]
        return jnp.where((g.gid < ng)[:, None], rows, jnp.zeros((), rows.dtype)), ws

    return _rows_fprop(x, sizes, recipe, own_rows)


def _rows_fprop(x, sizes, recipe: Recipe, product) -> Float[Array, "T n"] | None:
    """fprop's fast path around its GEMM: `x` quantised row by row with its group's
    tensor scale (`quantize_rows`), `product(xv, g) -> (out, ws)` (`out` `(T, n)` float32
    before the tensor scales, `ws` the experts' `(G,)` or None; None: no product), each
    row scaled by its own group's scales."""
    g = groups(sizes, x.shape[0])
    inside = jnp.minimum(g.gid, sizes.shape[0] - 1)
    xv, xs = quantize_rows(x, recipe.input, g, None)
    got = product(xv, g)
    if got is None:
        return None
    out, ws = got
    return _scaled_rows(out, _row_scales(xs, ws, inside))


def grouped_dgrad(dy, wv, ws, sizes, seeds, *, recipe: Recipe, dtype) -> Float[Array, "T k"]:
    """dgrad: `Q(dy[t]) @ Q(W[g])` per group, dy along n (its group's key)."""
    if not _fast(recipe):
        return reference_dgrad(dy, wv, ws, sizes, seeds, recipe=recipe, dtype=dtype)
    g = groups(sizes, dy.shape[0])
    inside = jnp.minimum(g.gid, sizes.shape[0] - 1)
    keys = _keys(seeds, 1) if needs_key(recipe) else None
    gv, gs = quantize_rows(dy.astype(jnp.float32), recipe.grad, g, keys)
    out = _ragged(gv, wv, sizes, 1, dtype)
    return _scaled_rows(out, _row_scales(gs, ws, inside))


def grouped_wgrad(dy, x, sizes, seeds, *, recipe: Recipe, dtype) -> Float[Array, "G n k"]:
    """wgrad: `Q(H dy_g).T @ Q(H x_g)` per group, both along the group's tokens (16-token
    blocks and RHT chunks from its first token), each group its own scales and key."""
    if not _fast(recipe):
        return reference_wgrad(dy, x, sizes, seeds, recipe=recipe, dtype=dtype)
    g = groups(sizes, dy.shape[0])
    dp = _to_padded(dy.astype(jnp.float32), g)
    xp = _to_padded(x.astype(jnp.float32), g)
    if recipe.rht:  # 16-row chunks: each within a group
        dp, xp = _kernels.rht(dp, axis=0), _kernels.rht(xp, axis=0)
    keys = _keys(seeds, 2) if needs_key(recipe) else None
    gv, gs = quantize_tokens(dp, recipe.grad, g, keys)
    xv, xs = quantize_tokens(xp, recipe.input, g, None)
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())),
        lhs_ragged_dimensions=(0,),
        rhs_group_dimensions=(),
    )
    dtype = _operand_dtype(gv, xv, dtype)
    out = grouped_dot(gv.astype(dtype), xv.astype(dtype), g.padded_sizes, dims)
    scales = [s for s in (gs, xs) if s is not None]
    if len(scales) == 2:
        return out * (scales[0] * scales[1])[:, None, None]
    return out * scales[0][:, None, None] if scales else out


def tangent_x(tx, wv, ws, sizes, seeds, *, recipe: Recipe, dtype) -> Array:
    """Forward-mode tangent along x: `x'[t] @ Q(W[g]).T` (straight-through)."""
    inside = jnp.minimum(groups(sizes, tx.shape[0]).gid, sizes.shape[0] - 1)
    return _scaled_rows(_ragged(tx, wv, sizes, 2, dtype), ws[inside])


def tangent_w(x, tw, sizes, seeds, *, recipe: Recipe, dtype) -> Array:
    """Forward-mode tangent along W: `Q(x[t]) @ W'[g].T` (straight-through)."""
    if not _fast(recipe):
        ones = jnp.ones(tw.shape[:1], jnp.float32)
        return reference_fprop(x, tw, ones, sizes, recipe=recipe, dtype=dtype, weight=False)
    xv, xs = quantize_rows(x, recipe.input, groups(sizes, x.shape[0]), None)
    return _scaled_rows(_ragged(xv, tw, sizes, 2, dtype), xs)


# --- the reference: a loop over the groups, each a dense GEMM on its tokens ---


def _capacity(tokens: int) -> int:
    """Rows of a group's buffer: every token fits, and at least 16 rows (the dense
    GEMM of at most 4 tokens on a CPU sums in another order, `runs_chunked`)."""
    return max(BLOCK, -(-tokens // BLOCK) * BLOCK)


def _gather(a: Array, g: Groups, sizes: Array, group: int, rows: int) -> Array:
    """Group `group`'s tokens of `a`, from row 0 of a zero-padded `(rows, w)` buffer."""
    start = (jnp.cumsum(sizes) - sizes)[group]
    size = jnp.sum(g.gid == group)  # (a group cut short by the end of the tokens)
    r = jnp.arange(rows)
    buf = a[jnp.clip(start + r, 0, a.shape[0] - 1)]
    return jnp.where((r < size)[:, None], buf, jnp.zeros((), buf.dtype))


def _scatter(out: Array, part: Array, g: Groups, group: int) -> Array:
    rows = part[jnp.clip(g.row, 0, part.shape[0] - 1)]
    return jnp.where((g.gid == group)[:, None], rows, out)


def reference_fprop(x, wv, ws, sizes, *, recipe: Recipe, dtype, weight: bool = True):
    """`grouped_fprop` as a loop over the groups: the dense `fprop` of each group's
    tokens (`weight=False`: the weight operand taken as given, for the JVP)."""
    g = groups(sizes, x.shape[0])
    rows = _capacity(x.shape[0])
    out = jnp.zeros(x.shape[:1] + wv.shape[1:2], jnp.float32)
    for e in range(wv.shape[0]):
        part = fprop(_gather(x, g, sizes, e, rows), wv[e], ws[e], recipe=recipe, dtype=dtype)
        out = _scatter(out, part, g, e)
    return out


def reference_dgrad(dy, wv, ws, sizes, seeds, *, recipe: Recipe, dtype):
    """`grouped_dgrad` as a loop over the groups: the dense `dgrad` of each group."""
    g = groups(sizes, dy.shape[0])
    rows = _capacity(dy.shape[0])
    out = jnp.zeros(dy.shape[:1] + wv.shape[2:], jnp.float32)
    for e in range(wv.shape[0]):
        buf = _gather(dy, g, sizes, e, rows)
        part = dgrad(buf, wv[e], ws[e], seeds[e], recipe=recipe, dtype=dtype)
        out = _scatter(out, part, g, e)
    return out


def reference_wgrad(dy, x, sizes, seeds, *, recipe: Recipe, dtype):
    """`grouped_wgrad` as a loop over the groups: the dense `wgrad` of each group."""
    g = groups(sizes, dy.shape[0])
    rows = _capacity(dy.shape[0])
    parts = []
    for e in range(sizes.shape[0]):
        dy_e, x_e = _gather(dy, g, sizes, e, rows), _gather(x, g, sizes, e, rows)
        parts.append(wgrad(dy_e, x_e, seeds[e], recipe=recipe, dtype=dtype))
    return jnp.stack(parts)


# --- primitives ---
#
# Operands as for the dense GEMM: the activation-side operand first, the weight-side
# operands, the group sizes, the seed last. `grouped_qdot_p(x, w, wv, ws, sizes, seed)`.
# Every vmapped axis makes independent problems (`stack`): a group's tokens are a
# problem's, never folded with another's.


def _make(name: str, fn, abstract) -> Primitive:
    return primitive(
        name, fn, abstract, act=1, seed=-1, stack=True, labels=("name",), problem=batched_problem
    )


def _fprop_operands(x, w, wv, ws, sizes, seed, *, recipe, dtype):
    del w, seed  # the master weight and seed matter to the derivatives only
    return grouped_fprop(x, wv, ws, sizes, recipe=recipe, dtype=dtype)


def _rows_abstract(a, w, *_, **__):
    return a.shape[:-1] + (w.shape[-2],), jnp.float32


def _dgrad_abstract(ct, wv, *_, **__):
    return ct.shape[:-1] + (wv.shape[-1],), jnp.float32


def _wgrad_abstract(ct, a, sizes, seeds, **_):
    return sizes.shape + (ct.shape[-1], a.shape[-1]), jnp.float32


grouped_qdot_p = _make("nvfp4x_grouped_qdot", _fprop_operands, _rows_abstract)
grouped_tx_p = _make("nvfp4x_grouped_tangent_x", tangent_x, _rows_abstract)
grouped_tw_p = _make("nvfp4x_grouped_tangent_w", tangent_w, _rows_abstract)
grouped_dgrad_p = _make("nvfp4x_grouped_dgrad", grouped_dgrad, _dgrad_abstract)
grouped_wgrad_p = _make("nvfp4x_grouped_wgrad", grouped_wgrad, _wgrad_abstract)


def _seeds(seed: Array, w: Array, recipe: Recipe) -> Array:
    """One seed per expert `(..., G, 2)`: the dense layer's, the seed mixed with a
    checksum of the expert's weight when the recipe rounds stochastically."""
    if needs_key(recipe):  # (each expert's checksum, as the dense layer's)
        return jax.vmap(mix_weight, in_axes=(None, -3), out_axes=-2)(seed, w)
    return jnp.broadcast_to(seed[..., None, :], w.shape[:-2] + (2,))


def _jvp(primals, tangents, **params):
    x, w, wv, ws, sizes, seed = primals
    tx, tw = tangents[:2]
    recipe, dtype, nbatch = params["recipe"], params["dtype"], params["nbatch"]
    y = grouped_qdot_p.bind(*primals, **params)
    seeds = _seeds(seed, w, recipe)
    parts = []
    if not is_zero(tx):
        if not shares_weight(recipe):
            quant = functools.partial(quantize_weight, recipe=recipe, axis=0, dtype=dtype)
            wv, ws = vmapped(quant, nbatch + 1)(w)
        parts.append(grouped_tx_p.bind(tx, wv, ws, sizes, seeds, **params))
    if not is_zero(tw):
        parts.append(grouped_tw_p.bind(x, tw, sizes, seeds, **params))
    if not parts:
        return y, zero_tangent(y)
    return y, parts[0] if len(parts) == 1 else parts[0] + parts[1]


def _second_order(*_, **__):
    raise NotImplementedError(
        "nvfp4x: second-order derivatives of a quantised grouped GEMM (`ragged_dot`) are "
        "not supported: the quantiser has no second derivative. Take them on "
        "`nvfp4x.dequantize(model)` instead."
    )


def _tx_transpose(ct, a, wv, ws, sizes, seeds, **params):
    if is_undefined(wv) or is_undefined(ws):
        _second_order()
    if is_zero(ct):
        return [zero(a.aval), None, None, None, None]
    dx = grouped_dgrad_p.bind(ct, wv, ws, sizes, seeds, **params)
    return [dx.astype(a.aval.dtype), None, None, None, None]


def _tw_transpose(ct, a, b, sizes, seeds, **params):
    if is_undefined(a):
        _second_order()
    if is_zero(ct):
        return [None, zero(b.aval), None, None]
    return [None, grouped_wgrad_p.bind(ct, a, sizes, seeds, **params).astype(b.aval.dtype),
            None, None]  # fmt: skip


def_jvp(grouped_qdot_p, _jvp)
def_transpose(grouped_tx_p, _tx_transpose)
def_transpose(grouped_tw_p, _tw_transpose)
for _p in (grouped_tx_p, grouped_tw_p, grouped_dgrad_p, grouped_wgrad_p):
    def_jvp(_p, _second_order)


def grouped_qdot(
    x: Float[Array, "T k"],
    w: Float[Array, "G n k"],
    group_sizes: Int[Array, " G"],
    *,
    recipe: Recipe,
    seed: UInt32[Array, "2"] | None = None,
    fast: bool = True,
    name: str = "",
) -> Float[Array, "T n"]:
    """The quantised grouped GEMM: token `t` of group `g` times expert `g`,
    `y[t] = x[t] @ w[g].T`, under `recipe` (the module docstring: fprop, dgrad and wgrad
    per group, each expert and each group its own scales).

    **Arguments:**

    - `x`: `(tokens, k)`, sorted by group; `w`: `(groups, n, k)`, each expert in
      Equinox's `(out, in)` layout; `group_sizes`: `(groups,)` integers.
    - `recipe`, `seed`, `fast`, `name`: as for [`nvfp4x.qdot`][].

    **Returns:** float32 `(tokens, n)`; rows past `sum(group_sizes)` are zero.
    """
    if seed is None:
        seed = jnp.zeros((2,), jnp.uint32)
    dtype = gemm_dtype(fast)
    quant = functools.partial(quantize_weight, recipe=recipe, axis=-1, dtype=dtype)
    wv, ws = jax.vmap(quant)(lax.stop_gradient(w))
    sizes = jnp.asarray(group_sizes).astype(jnp.int32)
    return grouped_qdot_p.bind(
        x, w, wv, ws, sizes, seed, recipe=recipe, dtype=dtype, nbatch=0, name=name
    )
