"""The Mosaic NVFP4 quantiser on a TPU (issue 37): compiles, bits, speed, tile sweep.

```
python benchmarks/tpu_quantize_check.py --out PATH [--repeats N] [--no-sweep]
python benchmarks/tpu_quantize_check.py --smoke      # tiny shapes, interpreted, on a CPU
python benchmarks/tpu_quantize_check.py --lower-only # every case and tiling lowers (CPU)
python benchmarks/tpu_quantize_check.py --values-sweep [--smoke]  # the GEMM operand's tilings
```

For each case (`to_nvfp4` 1x16 and 16x16, round to nearest and SR, float32 and
bfloat16 input, realistic and odd shapes; the GEMM operand path, bfloat16 block values,
1x16, 16x1 and 16x16; `fake_quantize`), in this one process: the kernel (`"mosaic"`)
and the reference (`"xla"`) compiled, their outputs compared bit by bit (NaN where
NaN), each timed (median of `--repeats`, interleaved), against the memory floor: the
input read once plus the output written (4.5 bits per element for `to_nvfp4`, 2 bytes
for the operand path, the input's dtype for `fake_quantize`) at the copy bandwidth
measured first (`x + 1`, float32). A standalone `to_nvfp4` also reads its input for the
tensor amax (an XLA reduction before the kernel), so its floor ratio cannot go below
about 1.9x (float32) unless `amax` is given: the `amax given` rows. Then a sweep over
`_tpu_quantize.CANDIDATES` for a few cases, the best per case, and the `TILINGS` table
to paste into `nvfp4x/_kernels/_tpu_quantize.py`.

Each case runs in its own `try`: a Mosaic failure prints its full error and the next
case runs. The table goes to stdout and, row by row, to `--out`.
"""

import argparse
import contextlib
import functools
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import nvfp4x
from nvfp4x import _kernels
from nvfp4x._formats import Format, quantize_operand
from nvfp4x._kernels import _tpu_quantize


class Report:
    """Rows printed and appended to `--out` as they come (a timed-out run keeps them)."""

    def __init__(self, out: str | None):
        self.out = out
        self.lines: list[str] = []
        if out:
            open(out, "w").close()

    def line(self, text: str) -> None:
        print(text, flush=True)
        self.lines.append(text)
        if self.out:
            with open(self.out, "a") as f:
                f.write(text + "\n")


def test_array(shape, dtype, seed: int = 0) -> jax.Array:
    """Normal values over a range of magnitudes, with a NaN, an inf, a zero row and a
    block of subnormals (the kernel's edge cases, at scale)."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, shape, jnp.float32)
    x = x * jnp.exp2(jax.random.randint(k2, (shape[0], 1), -8, 8).astype(jnp.float32))
    x = x.at[1, 3].set(jnp.nan).at[2, 20].set(jnp.inf).at[4].set(0.0)
    x = x.at[5, :16].set(jnp.float32(3e-39) * jnp.arange(16, dtype=jnp.float32))
    return x.astype(dtype)


def same_bits(a, b) -> bool:
    """The same leaves bit for bit (floats: NaN where NaN, any payload)."""
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if np.issubdtype(x.dtype, np.floating) or x.dtype == jnp.bfloat16:
            x, y = x.astype(np.float32), y.astype(np.float32)
            if not np.array_equal(np.isnan(x), np.isnan(y)):
                return False
            x, y = np.nan_to_num(x).view(np.uint32), np.nan_to_num(y).view(np.uint32)
        elif x.dtype.kind == "V" or str(x.dtype).startswith("float8"):
            x, y = x.view(np.uint8), y.view(np.uint8)
        if not np.array_equal(x, y):
            return False
    return True


def compiled(impl: str, fn: Callable, *args) -> Callable:
    """`jax.jit(fn)` traced with implementation `impl`, compiled (through a new function
    each time: `jax.jit` would reuse a trace of `fn` made with the other one)."""
    with _kernels.use("nvfp4_quantize", impl):
        traced = jax.jit(lambda *a: fn(*a)).trace(*args)
    if impl == "mosaic" and "pallas_call" not in str(traced.jaxpr):
        raise RuntimeError("the kernel was not picked for this case")
    return traced.lower().compile()


def timed(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each thunk, the rounds interleaved."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(f())
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def copy_bandwidth(shape, repeats: int) -> float:
    x = jnp.ones(shape, jnp.float32)
    f = jax.jit(lambda x: x + 1)
    jax.block_until_ready(f(x))
    t = timed({"copy": lambda: f(x)}, repeats)["copy"]
    return 2 * x.nbytes / t


def cases(smoke: bool) -> list[tuple[str, tuple, object, Callable, str]]:
    """`(name, shape, dtype, fn(x, key, amax), output kind)`."""
    big, mid = ((48, 112), (40, 96)) if smoke else ((8192, 16384), (4096, 4096))
    odd = (37, 100) if smoke else (4100, 2008)

    def to(block=(1, 16), rounding="nearest", amax=False):
        def fn(x, key, a):
            return nvfp4x.to_nvfp4(
                x, block=block, rounding=rounding, key=key, amax=a if amax else None
            )

        return fn

    def operand(block, rounding, axis):
        fmt = Format("nvfp4", block=block, rounding=rounding)
        return lambda x, key, a: quantize_operand(x, fmt, axis, key)

    def fake(rounding):
        return lambda x, key, a: nvfp4x.fake_quantize(x, rounding=rounding, key=key)

    f32, bf16 = jnp.float32, jnp.bfloat16
    out = [
        ("to_nvfp4 1x16", big, f32, to(), "codes"),
        ("to_nvfp4 1x16, amax given", big, f32, to(amax=True), "codes"),
        ("to_nvfp4 1x16 SR", big, f32, to(rounding="stochastic"), "codes"),
        ("to_nvfp4 16x16", big, f32, to((16, 16)), "codes"),
        ("to_nvfp4 16x16 SR", big, f32, to((16, 16), "stochastic"), "codes"),
        ("to_nvfp4 1x16", big, bf16, to(), "codes"),
        ("to_nvfp4 16x16 SR", big, bf16, to((16, 16), "stochastic"), "codes"),
        ("to_nvfp4 1x16", mid, bf16, to(), "codes"),
        ("to_nvfp4 1x16 (odd shape)", odd, f32, to(), "codes"),
        ("to_nvfp4 16x16 SR (odd shape)", odd, bf16, to((16, 16), "stochastic"), "codes"),
        ("operand 1x16", big, bf16, operand((1, 16), "nearest", 1), "values"),
        ("operand 16x1 SR (axis 0)", big, bf16, operand((1, 16), "stochastic", 0), "values"),
        ("operand 16x16 (weight)", mid, bf16, operand((16, 16), "nearest", 1), "values"),
        ("operand 1x16 SR", big, f32, operand((1, 16), "stochastic", 1), "values"),
        ("fake_quantize 1x16 SR", big, f32, fake("stochastic"), "dequantized"),
        ("fake_quantize 1x16", big, bf16, fake("nearest"), "dequantized"),
    ]
    return out[:1] if smoke else out


def floor_bytes(x: jax.Array, kind: str) -> float:
    n = x.size
    written = {"codes": n * 4.5 / 8, "values": 2 * n, "dequantized": x.nbytes}[kind]
    return x.nbytes + written


def run_case(report: Report, name, shape, dtype, fn, kind, bw, repeats) -> dict | None:
    label = f"{name} {jnp.dtype(dtype).name} {shape[0]}x{shape[1]}"
    try:
        x, key = test_array(shape, dtype), jax.random.key(1)
        amax = jnp.max(jnp.abs(jnp.where(jnp.isnan(x), 0, x))).astype(jnp.float32)
        amax = jnp.where(jnp.isinf(amax), jnp.float32(1e4), amax)
        t0 = time.perf_counter()
        mosaic = compiled("mosaic", fn, x, key, amax)
        t_compile = time.perf_counter() - t0
        xla = compiled("xla", fn, x, key, amax)
        same = same_bits(mosaic(x, key, amax), xla(x, key, amax))
        t = timed({"m": lambda: mosaic(x, key, amax), "x": lambda: xla(x, key, amax)}, repeats)
        floor = floor_bytes(x, kind) / bw
        report.line(
            f"| {label} | {'yes' if same else '**NO**'} | {t['m'] * 1e3:.3f} | "
            f"{t['m'] / floor:.2f}x | {t['x'] * 1e3:.3f} | {t['x'] / floor:.2f}x | "
            f"{t['x'] / t['m']:.2f}x | {t_compile:.1f} s |"
        )
        return {"x": x, "key": key, "amax": amax, "fn": fn, "floor": floor, "same": same}
    except Exception:  # (one case's failure must not hide the others)
        report.line(f"| {label} | **FAILED** (below) | | | | | | |")
        report.line("```\n" + traceback.format_exc() + "```")
        return None


@contextlib.contextmanager
def tiling(block, dtype, t: _tpu_quantize.Tiling) -> Iterator[None]:
    """`_tpu_quantize.TILINGS[(block, dtype)]` set to `t` inside the block (a function
    traced inside uses it)."""
    k = (block, jnp.dtype(dtype).name)
    before = _tpu_quantize.TILINGS.get(k)
    _tpu_quantize.TILINGS[k] = t
    try:
        yield
    finally:
        if before is None:
            del _tpu_quantize.TILINGS[k]
        else:
            _tpu_quantize.TILINGS[k] = before


def sweep(report: Report, smoke: bool, bw: float, repeats: int) -> None:
    """Each candidate tiling on a few cases: the time, the floor ratio, the bits."""
    report.line("\n## Tile sweep (`_tpu_quantize.CANDIDATES`)\n")
    report.line("| case | tiling | same bits | ms | x floor |")
    report.line("|---|---|---|---|---|")
    shape = (48, 112) if smoke else (8192, 16384)
    todo = [((1, 16), jnp.float32), ((1, 16), jnp.bfloat16), ((16, 16), jnp.bfloat16)]
    todo += [((16, 1), jnp.bfloat16)]
    candidates = _tpu_quantize.CANDIDATES[:1] if smoke else _tpu_quantize.CANDIDATES
    best = {}
    for block, dtype in todo[:1] if smoke else todo:
        x, key = test_array(shape, dtype), jax.random.key(1)
        fn, kind = sweep_case(block)
        floor = floor_bytes(x, kind) / bw
        want = compiled("xla", fn, x, key)(x, key)
        for cand in candidates:
            label = f"{block[0]}x{block[1]} {jnp.dtype(dtype).name}"
            try:
                with tiling(block, dtype, cand):
                    f = compiled("mosaic", fn, x, key)
                same = same_bits(f(x, key), want)
                t = timed({"m": lambda f=f, x=x, key=key: f(x, key)}, repeats)["m"]
                report.line(
                    f"| {label} | {tuple(cand)} | {same} | {t * 1e3:.3f} | {t / floor:.2f}x |"
                )
                if same and ((block, dtype) not in best or t < best[(block, dtype)][1]):
                    best[(block, dtype)] = (cand, t)
            except Exception:
                report.line(f"| {label} | {tuple(cand)} | **FAILED** | | |")
                report.line("```\n" + traceback.format_exc() + "```")
    report.line("\nBest tilings (paste into `_tpu_quantize.TILINGS`):\n```")
    for (block, dtype), (cand, t) in best.items():
        report.line(f"    ({block}, {jnp.dtype(dtype).name!r}): {cand!r},  # {t * 1e3:.3f} ms")
    report.line("```")


def sweep_case(block) -> tuple[Callable, str]:
    """The swept function of `block`: `to_nvfp4`, or for 16x1 the operand path along
    the leading axis (SR), and its output kind."""
    if block == (16, 1):
        fmt = Format("nvfp4", block=(1, 16), rounding="stochastic")
        return (lambda x, key: quantize_operand(x, fmt, 0, key)), "values"
    return (lambda x, key: nvfp4x.to_nvfp4(x, block=block)), "codes"


#: The tilings `values_sweep` tries for the GEMM operand path (bfloat16 block values):
#: the default's shape with the rounding by comparisons then decoded
#: (`arithmetic=False`) and by float arithmetic (the default), and other shapes.
VALUES_CANDIDATES: tuple[_tpu_quantize.Tiling, ...] = (
    _tpu_quantize.Tiling(2048, 512, 512, arithmetic=False),  # (the comparisons: first)
    _tpu_quantize.Tiling(2048, 512, 512),
    _tpu_quantize.Tiling(2048, 512, 512, branch_once=True),
    _tpu_quantize.Tiling(2048, 512, 512, unroll=2),
    _tpu_quantize.Tiling(2048, 512, 512, branch_once=True, unroll=2),
    _tpu_quantize.Tiling(2048, 1024, 512),
)


def values_sweep(report: Report, smoke: bool, bw: float, repeats: int) -> bool:
    """The GEMM operand path (`_tpu_quantize.tiled(..., output="values")`, the tensor
    amax given, as the GEMMs give it) in each of `VALUES_CANDIDATES`, and, for 1x16
    and 16x16 blocks, `_tpu_operand`'s kernel: time, floor ratio (the input read
    once, the bfloat16 values written once), bits against the first candidate's (the
    comparisons, which the tests hold to the reference). Whether every case compiled
    with those bits."""
    from nvfp4x._kernels import _tpu_operand

    report.line("\n## GEMM operand sweep (`VALUES_CANDIDATES`, amax given)\n")
    report.line("| case | tiling | same bits | ms | x floor | compile s |")
    report.line("|---|---|---|---|---|---|")
    n = 256 if smoke else 8192
    todo = [
        ((1, 16), jnp.float32, "nearest", (n, n)),
        ((1, 16), jnp.float32, "stochastic", (n, n)),
        ((1, 16), jnp.bfloat16, "nearest", (n, n)),
        ((16, 16), jnp.float32, "nearest", (n // 4, n)),
        ((16, 16), jnp.bfloat16, "nearest", (n // 4, n)),
    ]
    seed = jnp.asarray([0x1234, 0xABCD], jnp.uint32)
    candidates = VALUES_CANDIDATES[:2] if smoke else VALUES_CANDIDATES
    for block, dtype, rounding, shape in todo[:1] if smoke else todo:
        x = test_array(shape, dtype)
        amax = jnp.max(jnp.abs(jnp.where(jnp.isfinite(x), x, 0))).astype(jnp.float32)
        sd = seed if rounding == "stochastic" else None
        label = f"{block[0]}x{block[1]} {jnp.dtype(dtype).name} {rounding} {shape}"
        floor = floor_bytes(x, "values") / bw
        fns, want, ok = {}, None, True
        kw = dict(block=block, rounding=rounding, output="values", interpret=smoke)
        for cand in candidates:
            fns[tuple(cand)] = functools.partial(_tpu_quantize.tiled, tiling=cand, **kw)
        if block in ((1, 16), (16, 16)):
            okw = dict(block=block, rounding=rounding, interpret=smoke)
            fns["operand kernel"] = functools.partial(_tpu_operand.operand, **okw)
        ready = {}
        for name, f in fns.items():
            try:
                t = time.perf_counter()
                c = jax.jit(f).lower(x, amax, sd).compile()
                took = time.perf_counter() - t
                got = c(x, amax, sd)[0]
                want = got if want is None else want
                ready[name] = (functools.partial(c, x, amax, sd), same_bits(got, want), took)
            except Exception:
                ok = False
                report.line(f"| {label} | {name} | **FAILED** | | | |")
                report.line("```\n" + traceback.format_exc() + "```")
        times = timed({k: v[0] for k, v in ready.items()}, repeats)
        for name, t in times.items():
            _, same, took = ready[name]
            ok &= same
            report.line(
                f"| {label} | {name} | {same} | {t * 1e3:.3f} | {t / floor:.2f}x | {took:.2f} |"
            )
    return ok


def lower_all(report: Report) -> bool:
    """Every block, output, rounding and dtype, and every candidate tiling, lowered for a
    TPU (runs on a CPU: Mosaic's compile itself needs the device)."""
    ok = True
    for block in _tpu_quantize.BLOCKS_2D:
        for output in _tpu_quantize.OUTPUTS:
            for rounding in ("nearest", "stochastic"):
                for dtype in (jnp.float32, jnp.bfloat16):
                    for cand in (
                        (None, *_tpu_quantize.CANDIDATES[1:]) if output == "codes" else (None,)
                    ):
                        what = f"{block} {output} {rounding} {jnp.dtype(dtype).name} {cand}"
                        try:
                            assert lowers_for_tpu(
                                (8208, 16400), dtype, block, rounding, output, cand
                            )
                            report.line(f"lowers: {what}")
                        except Exception:
                            ok = False
                            report.line(f"FAILED: {what}\n{traceback.format_exc()}")
    return ok


def lowers_for_tpu(shape, dtype, block, rounding, output, tiling=None) -> bool:
    """Whether the kernel's case lowers for a TPU (traced and lowered, on any backend)."""
    x = jax.ShapeDtypeStruct(shape, dtype)

    def fn(x, seed):
        seed = seed if rounding == "stochastic" else None
        return _tpu_quantize.quantize_2d(
            x, None, seed, block=block, rounding=rounding, output=output, tiling=tiling
        )

    lowered = jax.jit(fn).trace(x, jnp.zeros((2,), jnp.uint32)).lower(lowering_platforms=("tpu",))
    text = lowered.as_text()  # (16x1 values: `_tpu_operand`'s kernel, `OPERAND_KERNEL_BLOCKS`)
    return "nvfp4_quantize_tpu" in text or "nvfp4x_operand_tpu" in text


class SquareCheck(NamedTuple):
    """A square-array check's setup (`square_check`)."""

    args: argparse.Namespace
    n: int
    interpret: bool
    report: Report
    bandwidth: float


def square_check(doc: str, argv: list[str] | None, smoke_n: int) -> SquareCheck:
    """The arguments (`--out`, `--repeats`, `--size`, `--smoke`) and setup of a check on
    one `N x N` array (`tpu_operand_check`, `tpu_read_check`): `N` (`smoke_n` with
    `--smoke`), whether the kernels run interpreted (off a TPU), the report with its
    first line, and the copy bandwidth measured on that array's shape."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--size", type=int, default=8192)
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args(argv)
    n = smoke_n if a.smoke else a.size
    report = Report(a.out)
    report.line(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), {n}x{n}")
    bw = copy_bandwidth((n, n), a.repeats)
    return SquareCheck(a, n, jax.default_backend() != "tpu", report, bw)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpreted on a CPU")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--lower-only", action="store_true")
    p.add_argument(
        "--values-sweep", action="store_true", help="only the GEMM operand path's tilings"
    )
    args = p.parse_args(argv)
    report = Report(args.out)
    if args.lower_only:
        return 0 if lower_all(report) else 1
    on_tpu = jax.default_backend() == "tpu"
    if not on_tpu and not args.smoke:
        report.line("no TPU at hand: run with --smoke (interpreted) or --lower-only")
        return 0
    repeats = 1 if args.smoke else args.repeats
    device = jax.devices()[0].device_kind
    report.line(f"## tpu_quantize_check on {device}, jax {jax.__version__}, {time.ctime()}\n")
    bw = copy_bandwidth((64, 128) if args.smoke else (8192, 16384), repeats)
    report.line(f"copy bandwidth (x + 1, float32): {bw / 1e9:.0f} GB/s\n")
    if args.values_sweep:
        return 0 if values_sweep(report, args.smoke, bw, repeats) else 1
    report.line(
        "| case | same bits | mosaic ms | x floor | xla ms | x floor | xla / mosaic | "
        "mosaic compile |"
    )
    report.line("|---|---|---|---|---|---|---|---|")
    results = [run_case(report, *c, bw, repeats) for c in cases(args.smoke)]
    if not args.no_sweep:
        sweep(report, args.smoke, bw, repeats)
    ok = all(r is not None and r["same"] for r in results)
    report.line(f"\nall cases compiled and bit for bit: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
