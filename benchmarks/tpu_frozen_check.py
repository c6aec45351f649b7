"""Check and time the TPU frozen GEMM kernel (`nvfp4x._kernels._tpu_frozen_gemm`) on a TPU.

A stack of frozen layers `d x d` (default 16 x 8192x8192, as in issue 38), run by
`jax.lax.scan` over the stacked layers, for W4A16 (`nvfp4_weight_only`) and W4A4
(`nvfp4_inference`), float32 and bfloat16 activations, 1, 16 and 4096 tokens:

- check: the first layer's GEMM by the kernel (`frozen_gemm` `"mosaic"`) against the
  reference path (`"xla"`: the decoded weight, `scaled_dot`), within the tolerance of
  `tests/test_frozen_kernel.py` (exact products, float32 summation order), on up to 16
  tokens;
- time: the stack's forward with the kernel, with the reference path and with bf16
  weights (bfloat16 activations), medians of interleaved runs in this process; the
  ratio to bf16 and the GB/s at which the packed weights are read;
- `--unrolled`: also the bf16 stack and the kernel path with the layers as separate
  arrays run one after another (at 1-16 tokens): under `lax.scan` a layer's slice of a
  stacked weight feeding the kernel's custom call is copied first (every run also
  times the kernel path under `nvfp4x.scan_layers`, which reads each layer from the
  whole stack by index: no copy);
- memory: argument, output and temporary bytes of each compiled forward
  (`memory_analysis`);
- `--sweep`: the kernel alone over the stack, each tile of `SWEEP_TILES` per token
  bucket, printing the best (to fill `DEFAULT_TILES`).
- `--attribute`: where the kernel's time goes (issue 38): the kernel alone over the
  stack (by `lax.scan`, or with `--unrolled` the layers as separate arrays) against
  variants of it that do part of its work, with the same tiles, blocks and pipeline
  (`ATTRIBUTION`): only the DMAs, the decode without the MXU dots, the dots without the
  decode, the decode without the block scales; every layout ("planes", and "chunks" and
  "pairs" at 128-512 code bytes a chunk; for 16x16 weights, `--recipes W4A4-16x16`, the
  tile scales expanded by XLA before the call, the default since in VMEM; the
  feature chunks' loop unrolled); the stack read by layer index under a scan; and XLA's
  dot of bf16 weights of the same shape. Diagnostic kernels, here only: not part of
  nvfp4x. (On a TPU v5e, 2026-12-06, the layers separate: DMAs alone 0.34 ms, decode
  alone 0.35 ms, dots alone 0.43 ms, the kernel 0.69-0.74 ms, bf16 0.79 ms.)
- `--dma`: only the reads: a Pallas call that reads random packed codes and scales of
  `--layers` layers tile by tile and does nothing else, per tile shape (`DMA_TILES`),
  codes as uint8 or uint32, each tile one DMA or four, layers unrolled or by `lax.scan`;
  a whole layer into VMEM by explicit DMAs; against XLA reading the same bytes and XLA's
  dot of bf16 weights. (On the v5e every pattern read at the HBM rate with the layers
  separate; under `lax.scan` the slice copies took 0.41 of 0.69 ms.)

Timing: every timed program runs its work `--inner` times (default 10) in one
`lax.fori_loop`, each run on the last one's result (so nothing that reads the weights is
hoisted out of the loop), and its time is divided by `--inner`. With `--inner 1` (one
run per call, as in the fifth session) the TPU machine's rows fit a fixed ~0.8 ms per
call plus reading at ~840 GB/s (bf16 dot of 512 MiB 1.456 ms, DMA-only of 144 MiB
~1.0 ms): the call's dispatch and wait, not the reads; the row "one jitted call of
nothing" measures that overhead. (The "xla" path's decode of a weight is tied to the
layer's input in nvfp4x, so it is not hoisted out of the loop either.)

Every configuration runs in its own `try` (a Mosaic compile failure is printed in full
and the rest goes on). `--out PATH` writes the markdown table. `--smoke` runs tiny
shapes on the CPU in Pallas's interpreter (the test suite runs it).

    python benchmarks/tpu_frozen_check.py --sweep --out benchmarks/results/tpu_frozen.md
"""

import argparse
import functools
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nvfp4x  # noqa: E402
from nvfp4x import _kernels  # noqa: E402
from nvfp4x._formats import quantize_operand  # noqa: E402
from nvfp4x._kernels import _tpu_frozen_gemm  # noqa: E402
from nvfp4x._numerics._constants import BLOCK, TILE  # noqa: E402

RECIPES = {
    "W4A16": nvfp4x.recipes.nvfp4_weight_only,
    "W4A4": nvfp4x.recipes.nvfp4_inference,
    # (the paper's training recipe frozen: 16x16 weight tiles; not run by default)
    "W4A4-16x16": lambda: nvfp4x.recipes.nvfp4_inference(weight_block=(16, 16)),
}
DEFAULT_RECIPES = ("W4A16", "W4A4")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
#: Of `k * 2^-24 * (|x| @ |W|.T)` (as `tests/test_frozen_kernel.py`).
TOLERANCE = 4


class Rows:
    """The markdown table's rows, printed as they come."""

    def __init__(self):
        self.rows: list[tuple[str, str, str]] = []

    def add(self, what: str, value: str, note: str = "") -> None:
        self.rows.append((what, value, note))
        print(f"{what:<72} {value:>12}  {note}", flush=True)

    def markdown(self, title: str) -> str:
        lines = [f"# {title}", "", "| case | value | notes |", "|---|---|---|"]
        lines += [f"| {a} | {b} | {c} |" for a, b, c in self.rows]
        return "\n".join(lines) + "\n"


def error(rows: Rows, what: str, e: BaseException) -> None:
    traceback.print_exc()
    rows.add(what, "**error**", f"{type(e).__name__}: {str(e)[:300]}".replace("|", "/"))


def stack_of(layers: int, d: int, key) -> eqx.nn.Linear:
    """`layers` stacked `eqx.nn.Linear(d, d)` without bias, bfloat16 weights (the bf16
    baseline, and what the recipes quantise)."""
    keys = jax.random.split(key, layers)
    make = lambda k: eqx.nn.Linear(d, d, use_bias=False, key=k, dtype=jnp.bfloat16)
    return eqx.filter_vmap(make)(keys)


def forwards(stack, unrolled: bool = False, by_index: bool = False) -> tuple[Callable, Any]:
    """`(forward, weights)`: `forward(x, weights)` runs the stack's layers on `x`
    (`(tokens, d)`) one after another, by `jax.lax.scan` over the stacked arrays
    (`by_index`: by `nvfp4x.scan_layers`, each frozen layer read from the whole stack by
    index), or, `unrolled`, from separate arrays (each layer's slice taken once here, as
    a model of separate layers holds them: no slice of a stacked weight inside the
    program)."""
    params, static = eqx.partition(stack, eqx.is_array)

    def layer(h, p):
        return jax.vmap(eqx.combine(p, static))(h).astype(h.dtype)

    if by_index:
        step = lambda h, m: (jax.vmap(m)(h).astype(h.dtype), None)  # noqa: E731
        return lambda x, ps: nvfp4x.scan_layers(step, x, eqx.combine(ps, static))[0], params

    def in_turn(x, layers):
        for p in layers:
            x = layer(x, p)
        return x

    if not unrolled:
        return lambda x, ps: jax.lax.scan(lambda h, p: (layer(h, p), None), x, ps)[0], params
    n = jax.tree.leaves(params)[0].shape[0]
    return in_turn, [jax.tree.map(lambda a, i=i: a[i], params) for i in range(n)]


def thunk(impl: str | None, fn: Callable, *args) -> tuple[Callable[[], Any], Any]:
    """`fn(*args)` jitted afresh (traced with the frozen GEMM `impl`, None: untouched),
    run once; the thunk and the compiled program's memory analysis."""
    jitted = jax.jit(lambda *a: fn(*a))  # (the models' static fields are in their treedefs)
    with _kernels.use("frozen_gemm", impl) if impl else _nullcontext():
        memory = jitted.lower(*args).compile().memory_analysis()
        jax.block_until_ready(jitted(*args))
    return functools.partial(jitted, *args), memory


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def looped(fn: Callable, inner: int) -> Callable:
    """`fn(h, *rest) -> h` run `inner` times in one program (`lax.fori_loop`, each run on
    the last one's result: nothing depending on `h` is hoisted out, no host round trip
    between runs)."""
    if inner <= 1:
        return fn
    return lambda h, *rest: jax.lax.fori_loop(0, inner, lambda _, g: fn(g, *rest), h)


def call_overhead(rows: Rows, repeats: int) -> None:
    """The row "one jitted call of nothing": what every timed call includes besides its
    work (dispatch, the wait for the result), median of `repeats` x 10."""
    f = jax.jit(lambda x: x + 1)
    x = jnp.zeros((8, 128), jnp.float32)
    jax.block_until_ready(f(x))
    secs = interleaved({"nothing": functools.partial(f, x)}, max(10, 10 * repeats))["nothing"]
    rows.add("one jitted call of nothing", f"{secs * 1e3:.3f} ms", "per-call overhead")


def interleaved(
    fns: dict[str, Callable[[], Any]], repeats: int, inner: int = 1
) -> dict[str, float]:
    """Median seconds of each thunk, the thunks run in turn `repeats` times, divided by
    `inner` (the runs of its work each thunk makes: `looped`)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) / inner for name, ts in times.items()}


def mb(n) -> str:
    return "?" if n is None else f"{n / 2**20:,.0f} MiB"


def memory_note(memory) -> str:
    if memory is None:
        return "memory: n/a"
    get = lambda name: getattr(memory, name, None)
    return (
        f"args {mb(get('argument_size_in_bytes'))}, out {mb(get('output_size_in_bytes'))}, "
        f"temp {mb(get('temp_size_in_bytes'))}"
    )


def packed_bytes(frozen) -> int:
    w = frozen.weight.packed
    return int(w.codes.nbytes + w.scale_bits.nbytes + w.tensor_scale.nbytes)


def check(rows: Rows, name: str, frozen, x) -> None:
    """The first layer's GEMM, kernel against reference, within the tolerance."""
    layer = jax.tree.map(lambda a: a[0], frozen)  # (the packed array's static fields stay)
    xs = x[:16]
    run = lambda impl: thunk(impl, lambda m, v: m(v), layer, xs)[0]()
    got, want = np.asarray(run("mosaic"), np.float64), np.asarray(run("xla"), np.float64)
    w = layer.weight.packed
    xv, s = quantize_operand(xs, layer.recipe.input, axis=-1)
    scale = np.abs(np.float64(w.tensor_scale) * (1.0 if s is None else np.float64(s)))
    xa = np.abs(np.nan_to_num(np.asarray(xv, np.float64)))
    wa = np.abs(np.asarray(w.operand()[0], np.float64))
    k = xs.shape[-1]
    bound = TOLERANCE * k * 2.0**-24 * (xa @ wa.T) * scale
    same_nan = np.array_equal(np.isnan(got), np.isnan(want))
    excess = float(np.max(np.abs(got - want) / np.maximum(bound, 1e-300)))
    ok = same_nan and excess <= 1.0
    rows.add(f"check {name}", "ok" if ok else "**FAIL**", f"max abs diff / bound = {excess:.3g}")


def run(args) -> Rows:
    rows = Rows()
    d, nl = args.d, args.layers
    print(f"device: {jax.devices()[0].device_kind}; {nl} layers {d}x{d}", flush=True)
    bf16 = stack_of(nl, d, jax.random.key(0))
    frozen = {}
    for name in args.recipes:
        recipe = RECIPES[name]
        try:
            frozen[name] = eqx.filter_jit(
                lambda m, r=recipe: nvfp4x.freeze(nvfp4x.quantize(m, r()))
            )(bf16)
        except Exception as e:  # noqa: BLE001
            error(rows, f"freeze {name}", e)

    def time_row(
        timed: dict, label: str, impl: str | None, model, x, unrolled=False, by_index=False
    ) -> None:
        """`timed[label]`: the thunk of the model's forward (`forwards`, `looped`, the
        frozen GEMM `impl`; None: bf16 weights), its memory note and weight bytes."""
        try:
            fwd, weights = forwards(model, unrolled, by_index)
            fn, mem = thunk(impl, looped(fwd, args.inner), x, weights)
            nbytes = bf16.weight.nbytes if impl is None else packed_bytes(model)
            timed[label] = fn, memory_note(mem), nbytes
        except Exception as e:  # noqa: BLE001
            error(rows, f"{label}, {x.shape[0]} tokens", e)

    for tokens in args.tokens:
        x32 = jax.random.normal(jax.random.key(1), (tokens, d), jnp.float32)
        timed: dict[str, tuple[Callable[[], Any], str, int]] = {}
        unrolled = args.unrolled and tokens <= 16
        xb = x32.astype(jnp.bfloat16)
        time_row(timed, "bf16 weights", None, bf16, xb)
        if unrolled:
            time_row(timed, "bf16 weights, layers unrolled", None, bf16, xb, unrolled=True)
        for name, fz in frozen.items():
            for dname in args.dtypes:
                x = x32.astype(DTYPES[dname])
                if tokens in (1, 16):
                    try:
                        check(rows, f"{name} {dname} activations, {tokens} tokens", fz, x)
                    except Exception as e:  # noqa: BLE001
                        error(rows, f"check {name} {dname}, {tokens} tokens", e)
                for impl in ("mosaic", "xla"):
                    time_row(timed, f"{name} {dname} activations ({impl})", impl, fz, x)
                label = f"{name} {dname} activations (mosaic), nvfp4x.scan_layers"
                time_row(timed, label, "mosaic", fz, x, by_index=True)
                if unrolled:
                    label = f"{name} {dname} activations (mosaic), layers unrolled"
                    time_row(timed, label, "mosaic", fz, x, unrolled=True)
        times = interleaved({k: fn for k, (fn, _, _) in timed.items()}, args.repeats, args.inner)
        base = times.get("bf16 weights")
        for label, secs in times.items():
            _, memory, nbytes = timed[label]
            note = f"{nbytes / secs / 1e9:,.0f} GB/s of weights"
            if base:
                note += f", **{secs / base:.2f}x bf16**"
            rows.add(f"{label}, {tokens} tokens", f"{secs * 1e3:.3f} ms", f"{note}; {memory}")
    if args.sweep and frozen:
        sweep(rows, next(iter(frozen.values())), args)
    if args.attribute and frozen:
        attribute(rows, next(iter(frozen.values())), bf16, args)
    return rows


def bf16_kernel(w, x, tiles, **options) -> Callable:
    """The kernel `frozen_matmul` for the stacked packed weight `w` (a layer of it, or the
    stack with `layer=`) and bfloat16 activations like `x`, at `tiles` and `options`
    (`layout`, `chunk_rows`); interpreted off a TPU."""
    return functools.partial(
        _tpu_frozen_gemm.frozen_matmul,
        block=tuple(w.block),
        n=x.shape[-1],
        operand="bfloat16",
        tiles=tiles,
        interpret=jax.default_backend() != "tpu",
        **options,
    )


def kernel_over_stack(
    w, x, tiles, layout: str = "planes", inner: int = 1, unrolled: bool = False, **options
) -> Callable[[], Any]:
    """A thunk running the kernel (bfloat16 activations, `tiles`, `layout`, `options`:
    `chunk_rows`, `tile_scales`) alone over the stacked packed weight `w`, each layer's
    output the next one's input; compiled and run once (`unrolled`: see `over_stack`)."""
    mm = bf16_kernel(w, x, tiles, layout=layout, **options)
    return over_stack(mm, x, w.codes, w.scale_bits, inner, unrolled)


def kernel_by_index(w, x, tiles, inner: int = 1) -> Callable[[], Any]:
    """A thunk running the kernel (default layout) over the stacked packed weight `w` by
    `lax.scan` over the layers' indices, the stack whole (`frozen_matmul(layer=i)`: no
    slice of the stack copied before each call); compiled and run once."""
    mm = bf16_kernel(w, x, tiles)

    def layers(h, c, s):
        step = lambda h, i: (mm(h, c, s, layer=i).astype(h.dtype), None)  # noqa: E731
        return jax.lax.scan(step, h, jnp.arange(c.shape[0]))[0]

    f = jax.jit(looped(layers, inner))
    jax.block_until_ready(f(x, w.codes, w.scale_bits))
    return functools.partial(f, x, w.codes, w.scale_bits)


def over_layers(
    step: Callable, h, *stacks, inner: int = 1, unrolled: bool = False
) -> Callable[[], Any]:
    """A thunk running `h = step(h, *layer's arrays)` over the layers of `stacks` (arrays
    with a leading axis of layers), from `h`, the whole stack `inner` times in one
    program (`looped`): by `lax.scan` over the stacked arrays, or, `unrolled`, from
    separate arrays (each layer's slice taken once here: no slice of a stacked array
    inside the program); compiled and run once."""
    if unrolled:
        n = stacks[0].shape[0]
        args = [[a[i] for i in range(n)] for a in stacks]

        def layers(h, *lists):
            for arrays in zip(*lists, strict=True):
                h = step(h, *arrays)
            return h

    else:
        args = list(stacks)

        def layers(h, *stacked):
            return jax.lax.scan(lambda h, xs: (step(h, *xs), None), h, stacked)[0]

    f = jax.jit(looped(layers, inner))
    jax.block_until_ready(f(h, *args))
    return functools.partial(f, h, *args)


def over_stack(
    mm, x, codes, scale_bits, inner: int = 1, unrolled: bool = False
) -> Callable[[], Any]:
    """A thunk running `mm(h, codes_l, scale_bits_l)` layer after layer from `x`
    (`over_layers`)."""
    step = lambda h, c, s: mm(h, c, s).astype(h.dtype)  # noqa: E731
    return over_layers(step, x, codes, scale_bits, inner=inner, unrolled=unrolled)


def sweep(rows: Rows, fz, args) -> None:
    """The kernel alone over the stacked layers (bfloat16 activations, each layer's
    output the next one's input), per tile and, where the tile allows both, per layout
    (`frozen_matmul`'s `layout`: the "planes" layout's strided copies of the activations
    and the output are part of its cost)."""
    w = fz.weight.packed
    d = args.d
    for bucket, candidates in _tpu_frozen_gemm.SWEEP_TILES.items():
        tokens = min(bucket, max(args.tokens))
        x = jax.random.normal(jax.random.key(2), (tokens, d), jnp.bfloat16)
        times = {}
        for tiles in candidates:
            wide = tiles.tokens % 128 == 0 and tokens >= 128
            for layout in ("planes", "wide") if wide else ("planes",):
                try:
                    thunk_ = kernel_over_stack(w, x, tiles, layout, args.inner)
                    times[tiles, layout] = interleaved({"k": thunk_}, args.repeats, args.inner)["k"]
                except Exception as e:  # noqa: BLE001
                    error(rows, f"sweep {tuple(tiles)} {layout}, {tokens} tokens", e)
        best = min(times, key=times.__getitem__) if times else None
        nbytes = packed_bytes(fz)
        for (tiles, layout), secs in times.items():
            mark = " **best**" if (tiles, layout) == best else ""
            rows.add(
                f"sweep tiles {tuple(tiles)} (tokens, features, depth) {layout}, {tokens} tokens",
                f"{secs * 1e3:.3f} ms",
                f"{nbytes / secs / 1e9:,.0f} GB/s packed{mark}",
            )


#: The `ATTRIBUTION` variant that holds each decoded plane transposed (`(features,
#: depth/2)`: its scratch too).
STREAMED = "dots, weight streamed"
#: `--attribute`'s variants of the "planes" kernel (bfloat16 activations), by what each
#: step does with its tile of codes and scales (DMA'd into VMEM by the pipeline in all).
ATTRIBUTION = {
    "dma": "nothing but touch one vreg of the codes: the pipeline's DMAs",
    "decode": "decode the 8 planes and store them, bfloat16, to VMEM: no MXU",
    "decode, no scales": "as `decode`, without the block scales' decode and multiply",
    "dots": "the 8 MXU dots on planes decoded once, in the first step of the call",
    STREAMED: "as `dots`, each plane stored transposed (features, depth/2)"
    " and multiplied as the dot's left operand, the activations' columns its right one"
    " (`(features, depth) x (tokens, depth)^T`): the MXU holds the activations and streams"
    " the weight",
}


def _attribution_kernel(
    xe_ref, xo_ref, codes_ref, scales_ref, out_ref, dec_ref, acc_ref, *, variant
):
    """One step of an `ATTRIBUTION` variant (see `_tpu_frozen_gemm._kernel`)."""
    streamed = variant == STREAMED

    @pl.when(pl.program_id(2) == 0)
    def _():
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)
        acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)

    def decode(scaled: bool):
        if scaled:
            for q, h, w in _tpu_frozen_gemm._planes(codes_ref, scales_ref, None):
                w = w.astype(jnp.bfloat16)
                dec_ref[2 * q + h] = w.T if streamed else w
            return
        words = pltpu.bitcast(codes_ref[...], jnp.int32).T
        for q in range(4):
            for h in range(2):
                w = _tpu_frozen_gemm.double_e2m1(words, 8 * q + 4 * h)
                dec_ref[2 * q + h] = w.astype(jnp.bfloat16)

    if variant == "dma":
        word = pltpu.bitcast(codes_ref[0:32, 0:128], jnp.int32)  # (8, 128)
        out_ref[0, 0:8, 0:128] += word.astype(jnp.float32)
    elif variant in ("decode", "decode, no scales"):
        decode(variant == "decode")
        out_ref[0, 0:16, 0:128] += dec_ref[0, 0:16, 0:128].astype(jnp.float32)
    else:  # "dots"
        first = (pl.program_id(0) == 0) & (pl.program_id(1) == 0) & (pl.program_id(2) == 0)

        @pl.when(first)
        def _():
            decode(True)

        xs = (xe_ref[0], xo_ref[0])
        nt = (((1,), (1,)), ((), ()))  # (features, depth/2) x (tokens, depth/2)^T
        for q in range(4):
            if streamed:
                d = [
                    lax.dot_general(
                        dec_ref[2 * q + h], xs[h], nt, preferred_element_type=jnp.float32
                    )
                    for h in range(2)
                ]
                acc_ref[q] += d[0] + d[1]
                continue
            d = [
                jnp.dot(xs[h], dec_ref[2 * q + h], preferred_element_type=jnp.float32)
                for h in range(2)
            ]
            out_ref[q] += d[0] + d[1]
        if streamed:  # (the products, transposed once at the call's last step)

            @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
            def _():
                for q in range(4):
                    out_ref[q] += acc_ref[q].T


def attribution_matmul(x, codes, scale_bits, *, block, variant: str, tiles, interpret=False):
    """`frozen_matmul`'s "planes" call (bfloat16 activations, shapes whole tiles) with
    the `ATTRIBUTION` `variant`'s kernel; its result is not the product."""
    bm, bn, bk = tiles
    m, k = x.shape
    bm = min(bm, -(-m // 16) * 16)
    if tuple(block) == TILE:
        scale_bits = jnp.repeat(scale_bits, BLOCK, axis=0)
    rows, width = codes.shape
    if rows % bn or width % (bk // 2):
        raise ValueError(f"--attribute takes weights of whole tiles {tiles}: {codes.shape}")
    m_tiles = -(-m // bm)
    xp = jnp.pad(x.astype(jnp.bfloat16), ((0, m_tiles * bm - m), (0, 0)))[None]
    xe, xo = xp[:, :, 0::2], xp[:, :, 1::2]
    x_spec = pl.BlockSpec((1, bm, bk // 2), lambda i, j, kk: (0, i, kk))
    call = pl.pallas_call(
        functools.partial(_attribution_kernel, variant=variant),
        out_shape=jax.ShapeDtypeStruct((4, m_tiles * bm, rows // 4), jnp.float32),
        grid=(m_tiles, rows // bn, width // (bk // 2)),
        in_specs=[
            x_spec,
            x_spec,
            pl.BlockSpec((bn, bk // 2), lambda i, j, kk: (j, kk)),
            pl.BlockSpec((bn, bk // BLOCK), lambda i, j, kk: (j, kk)),
        ],
        out_specs=pl.BlockSpec((4, bm, bn // 4), lambda i, j, kk: (0, i, j)),
        scratch_shapes=[
            pltpu.VMEM(
                (8, bn // 4, bk // 2) if variant == STREAMED else (8, bk // 2, bn // 4),
                jnp.bfloat16,
            ),
            pltpu.VMEM((4, bn // 4, bm), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary", "arbitrary", "arbitrary"),
            vmem_limit_bytes=100 << 20,
        ),
        interpret=interpret,
        name=f"frozen_attribution_{variant.replace(',', '').replace(' ', '_')}",
    )
    out = call(xe, xo, codes, scale_bits)
    return jnp.transpose(out, (1, 2, 0)).reshape(m_tiles * bm, rows)[:m]


def _bf16_layer(h, wt):
    """One layer of bf16 weights `wt` `(out, in)` on `h`, XLA's dot (a `lax.scan` body)."""
    return jnp.dot(h, wt.T).astype(h.dtype), None


def attribute(rows: Rows, fz, bf16, args) -> None:
    """`--attribute`: the kernel alone over the stacked layers against its
    `ATTRIBUTION` variants and XLA's dot of the bf16 weights, per token count (at most
    16: the "planes" layout), interleaved in this process."""
    w = fz.weight.packed
    d = args.d
    for tokens in [t for t in args.tokens if t <= 16]:
        x = jax.random.normal(jax.random.key(2), (tokens, d), jnp.bfloat16)
        tiles = _tpu_frozen_gemm.default_tiles(tokens)
        fns = {}
        layouts = [("planes", {}, "kernel")]
        layouts += [
            (lay, {"chunk_rows": rc}, f"kernel, {lay} layout, chunk rows {rc}")
            for lay in ("chunks", "pairs")
            for rc in (128, 256, 512)
        ]
        layouts += [
            ("pairs", {"unroll": u}, f"kernel, pairs layout, feature chunks unrolled {u}")
            for u in (1, 2)
        ]
        if tuple(w.block) == (16, 16):  # the tiles' scales expanded in VMEM, not by XLA
            layouts += [
                (lay, {"tile_scales": "caller"}, f"kernel, {lay} layout, tile scales by XLA")
                for lay in ("planes", "pairs")
            ]
        try:  # (a scan over indices, whatever --unrolled says)
            fns["kernel, pairs, the stack by index"] = kernel_by_index(w, x, tiles, args.inner)
        except Exception as e:  # noqa: BLE001
            error(rows, f"attribute kernel by index, {tokens} tokens", e)
        for layout, options, name in layouts:
            try:
                fns[name] = kernel_over_stack(
                    w, x, tiles, layout, args.inner, args.unrolled, **options
                )
            except Exception as e:  # noqa: BLE001
                error(rows, f"attribute {name}, {tokens} tokens", e)
        for variant in ATTRIBUTION:
            mm = functools.partial(
                attribution_matmul,
                block=tuple(w.block),
                variant=variant,
                tiles=tiles,
                interpret=jax.default_backend() != "tpu",
            )
            try:
                fns[variant] = over_stack(mm, x, w.codes, w.scale_bits, args.inner, args.unrolled)
            except Exception as e:  # noqa: BLE001
                error(rows, f"attribute {variant}, {tokens} tokens", e)
        try:
            fns["bf16 weights (XLA dot)"] = over_layers(
                lambda h, w: _bf16_layer(h, w)[0],
                x,
                bf16.weight,
                inner=args.inner,
                unrolled=args.unrolled,
            )
        except Exception as e:  # noqa: BLE001
            error(rows, f"attribute bf16 weights, {tokens} tokens", e)
        times = interleaved(fns, args.repeats, args.inner)
        base = times.get("kernel")
        nbytes = packed_bytes(fz)
        for name, secs in times.items():
            note = ATTRIBUTION.get(name, "")
            ratio = f", {secs / base:.2f}x the kernel" if base else ""
            rows.add(
                f"attribute {name}, {tokens} tokens, tiles {tuple(tiles)}, "
                + ("unrolled" if args.unrolled else "scan"),
                f"{secs * 1e3:.3f} ms",
                f"{nbytes / secs / 1e9:,.0f} GB/s packed{ratio}; {note}".rstrip("; "),
            )


#: `--dma`'s weight tiles `(features, depth)` (depth in weights: half as many code bytes).
DMA_TILES = ((2048, 4096), (1024, 8192), (4096, 2048), (512, 8192), (8192, 2048), (256, 8192))


def _dma_kernel(*refs):
    """Touch one vreg of each of the step's code tiles and its scales: what is left is
    the pipeline's DMAs of its tiles into VMEM. The output starts from `carry` (the last
    call's: `looped` cannot hoist the call)."""
    *codes_refs, scales_ref, carry_ref, out_ref = refs

    @pl.when(pl.program_id(1) == 0)
    def _():
        out_ref[...] = carry_ref[...]

    acc = jnp.sum(scales_ref[0:32, 0 : min(128, scales_ref.shape[1])].astype(jnp.float32))
    for codes_ref in codes_refs:
        rows = 32 // codes_ref.dtype.itemsize  # (one (8, 128) word vreg)
        cols = min(128, codes_ref.shape[1])
        acc += jnp.sum(pltpu.bitcast(codes_ref[0:rows, 0:cols], jnp.int32).astype(jnp.float32))
    out_ref[...] += acc


def dma_read(
    codes,
    scale_bits,
    carry=None,
    *,
    features: int,
    depth: int,
    split: int = 1,
    interpret=False,
):
    """A Pallas call reading `codes` `(n, w)` (uint8: `w = k / 2`; uint32: `k / 8`) and
    `scale_bits` `(n, k / 16)` tile by tile (`features` rows, `depth` weights), doing
    nothing else: the frozen GEMM kernel's DMAs alone; `split`: each tile of codes read
    as that many operands of `features / split` rows (concurrent DMAs). `carry`
    `(8, 128)` float32 (default zeros) is added to each output block."""
    n, w = codes.shape
    per_word = 2 * codes.dtype.itemsize  # weights per code element
    bw, bs, part = depth // per_word, depth // BLOCK, features // split
    if n % features or w % bw or features % split:
        raise ValueError(f"--dma takes weights of whole tiles ({features}, {depth}): {codes.shape}")
    code_specs = [
        pl.BlockSpec((part, bw), lambda j, kk, p=p: (j * split + p, kk)) for p in range(split)
    ]
    call = pl.pallas_call(
        _dma_kernel,
        out_shape=jax.ShapeDtypeStruct((n // features * 8, 128), jnp.float32),
        grid=(n // features, w // bw),
        in_specs=[
            *code_specs,
            pl.BlockSpec((features, bs), lambda j, kk: (j, kk)),
            pl.BlockSpec((8, 128), lambda j, kk: (0, 0)),
        ],
        out_specs=pl.BlockSpec((8, 128), lambda j, kk: (j, 0)),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=100 << 20
        ),
        interpret=interpret,
        name="frozen_dma_probe",
    )
    carry = jnp.zeros((8, 128), jnp.float32) if carry is None else carry
    return call(*[codes] * split, scale_bits, carry)


def _bulk_kernel(codes_hbm, scales_hbm, carry_ref, out_ref, cbuf, sbuf, sems, *, pieces):
    """Copy a whole layer's codes (in `pieces` row bands, all in flight at once) and its
    scales from HBM into VMEM with explicit DMAs, then touch one vreg of each: the raw
    DMA rate, no pipeline."""
    n = codes_hbm.shape[0]
    band = n // pieces
    copies = [
        pltpu.make_async_copy(
            codes_hbm.at[pl.ds(p * band, band)], cbuf.at[pl.ds(p * band, band)], sems.at[p]
        )
        for p in range(pieces)
    ]
    copies.append(pltpu.make_async_copy(scales_hbm, sbuf, sems.at[pieces]))
    for c in copies:
        c.start()
    for c in copies:
        c.wait()
    rows = 32 // cbuf.dtype.itemsize
    acc = jnp.sum(pltpu.bitcast(cbuf[0:rows, 0:128], jnp.int32).astype(jnp.float32))
    acc += jnp.sum(sbuf[0:32, 0:128].astype(jnp.float32))
    out_ref[...] = carry_ref[...] + acc


def bulk_read(codes, scale_bits, carry=None, *, pieces: int = 1, interpret=False):
    """`_bulk_kernel` over one layer: its codes and scales whole into VMEM (the layer must
    fit: 8192x8192 is 36 MiB)."""
    carry = jnp.zeros((8, 128), jnp.float32) if carry is None else carry
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_bulk_kernel, pieces=pieces),
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[any_, any_, pl.BlockSpec(memory_space=pltpu.VMEM)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=[
            pltpu.VMEM(codes.shape, codes.dtype),
            pltpu.VMEM(scale_bits.shape, scale_bits.dtype),
            pltpu.SemaphoreType.DMA((pieces + 1,)),
        ],
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=100 << 20),
        interpret=interpret,
        name="frozen_bulk_dma_probe",
    )(codes, scale_bits, carry)


def dma(rows: Rows, args) -> None:
    """`--dma`: how fast a Pallas call's pipeline reads packed weights (issue 38: the
    frozen GEMM kernel reads them at ~100 GB/s while XLA's dot reads bf16 weights at
    ~400), over `--layers` layers of `--d` x `--d` random codes: per tile shape, with
    the codes as uint8 (as stored) or viewed as uint32, each tile one DMA or 4; the layers
    as separate arrays (unrolled) or one stacked array under `lax.scan` (a slice of the
    stack feeding a custom call is copied first); against XLA reading the same bytes
    (a max over the codes) and XLA's dot of bf16 weights. 1 token's worth of work. Each
    read takes the last one's result (a carry: layers in order, the stack `--inner`
    times), as a model's layers do."""
    nl, d = args.layers, args.d
    interpret = jax.default_backend() != "tpu"
    key = jax.random.key(3)
    codes = jax.random.randint(key, (nl, d, d // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    words = jax.vmap(lambda c: jax.lax.bitcast_convert_type(c.reshape(d, d // 8, 4), jnp.uint32))(
        codes
    )
    scales = jnp.full((nl, d, d // BLOCK), 0x38, jnp.uint8)
    nbytes = codes.nbytes + scales.nbytes
    carry0 = jnp.zeros((8, 128), jnp.float32)
    unrolled = functools.partial(over_layers, inner=args.inner, unrolled=True)
    scanned = functools.partial(over_layers, inner=args.inner)

    def max_read(c, codes, scales):  # XLA reads the bytes (the xor keeps it in the loop)
        flag = (c[0, 0] > 3e38).astype(jnp.uint8)
        return c + (jnp.max(codes ^ flag) + jnp.max(scales ^ flag)).astype(jnp.float32)

    fns: dict[str, Callable[[], Any]] = {}
    tiles = [(f, t) for f, t in DMA_TILES if f <= d and t <= d] or [(min(d, 512), min(d, 2048))]
    cases = [(f, t, "uint8", 1, "unrolled") for f, t in tiles]
    cases += [(f, t, "uint32", 1, "unrolled") for f, t in tiles[:3]]
    cases += [(f, t, "uint8", 4, "unrolled") for f, t in tiles[:3]]
    cases += [(*tiles[0], "uint8", 1, "scan")]
    for f, t, dtype, split, how in cases:
        name = f"dma tiles ({f}, {t}) {dtype} codes, {split} DMA per tile, {how}"
        read = functools.partial(dma_read, features=f, depth=t, split=split, interpret=interpret)
        step = lambda c, cs, s, read=read: read(cs, s, c)[:8]  # noqa: E731
        try:
            fns[name] = (unrolled if how == "unrolled" else scanned)(
                step, carry0, words if dtype == "uint32" else codes, scales
            )
        except Exception as e:  # noqa: BLE001
            error(rows, name, e)
    for pieces in (1, 8, 32):
        name = f"one layer whole into VMEM, {pieces} concurrent DMAs, unrolled"
        read = functools.partial(bulk_read, pieces=pieces, interpret=interpret)
        try:
            fns[name] = unrolled(lambda c, cs, s, read=read: read(cs, s, c), carry0, codes, scales)
        except Exception as e:  # noqa: BLE001
            error(rows, name, e)
    fns["XLA max over the codes and scales, unrolled"] = unrolled(max_read, carry0, codes, scales)
    x = jax.random.normal(key, (1, d), jnp.bfloat16)
    wbf = jax.random.normal(key, (nl, d, d), jnp.bfloat16)
    bf16_dot = lambda h, w: _bf16_layer(h, w)[0]  # noqa: E731
    fns["XLA dot, bf16 weights, 1 token, unrolled"] = unrolled(bf16_dot, x, wbf)
    fns["XLA dot, bf16 weights, 1 token, scan"] = scanned(bf16_dot, x, wbf)
    times = interleaved(fns, args.repeats, args.inner)
    for name, secs in times.items():
        b = wbf.nbytes if "bf16" in name else nbytes
        rows.add(name, f"{secs * 1e3:.3f} ms", f"{b / secs / 1e9:,.0f} GB/s")


def main(argv: list[str] | None = None) -> Rows:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--d", type=int, default=8192)
    p.add_argument(
        "--tokens", type=lambda s: tuple(int(t) for t in s.split(",")), default=(1, 16, 4096)
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--inner", type=int, default=10, help="runs of each timed work in one program (looped)"
    )
    p.add_argument(
        "--recipes",
        type=lambda s: tuple(s.split(",")),
        default=DEFAULT_RECIPES,
        help=f"of {tuple(RECIPES)} (--attribute takes the first)",
    )
    p.add_argument("--dtypes", type=lambda s: tuple(s.split(",")), default=tuple(DTYPES))
    p.add_argument("--sweep", action="store_true", help="time SWEEP_TILES per token bucket")
    p.add_argument(
        "--attribute", action="store_true", help="the kernel against variants doing part of it"
    )
    p.add_argument(
        "--dma", action="store_true", help="only a Pallas call's reads of packed weights"
    )
    p.add_argument(
        "--unrolled",
        action="store_true",
        help="also time the layers as separate arrays (no slice of the stack: 1-16 tokens); "
        "--attribute's rows run so instead of by lax.scan",
    )
    p.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpreter")
    p.add_argument("--out", type=Path, default=None, help="write the markdown table there")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.d, args.tokens, args.repeats, args.inner = 2, 512, (1,), 1, 2
        args.dtypes = ("float32",)
        args.recipes = ("W4A4",) if args.recipes == DEFAULT_RECIPES else args.recipes
    if jax.default_backend() != "tpu" and not args.smoke:
        print("note: not a TPU; the kernel runs interpreted (slow): use --smoke", flush=True)
    if args.dma:
        rows = Rows()
        dma(rows, args)
    else:
        rows = run(args)
    call_overhead(rows, args.repeats)
    if args.out:
        title = (
            f"TPU frozen GEMM check ({jax.devices()[0].device_kind}, {time.strftime('%Y-%m-%d')})"
        )
        args.out.write_text(rows.markdown(title))
    return rows


if __name__ == "__main__":
    main()
