"""Where the NVFP4 training step's compile time goes on a TPU (issue 37: <= 1.5x float32;
the fifteenth session measured 44.4 s against float32's 2.8 s, the apart RHT operand
27.8 s, no RHT and no SR 7.3 s).

```
python benchmarks/tpu_compile_check.py --out PATH [--size N] [--sites 1 4 8] [--d D ...]
python benchmarks/tpu_compile_check.py --smoke     # small, on a CPU: lowering only for the kernels
```

Two sections, each compile from a fresh function (no cache hides work), lowering
(`jit(f).lower`: tracing and StableHLO) and XLA's compile (`.compile()`, which on a TPU
compiles each Mosaic kernel call) timed apart:

1. **Kernel call sites.** A function that applies one Mosaic kernel to `k` different
   `N x N` arrays (`--sites`), for the fused RHT operand (`_tpu_operand.operand`, 16x1,
   RHT, SR), the quantiser's 1x16 values (`_tpu_quantize.quantize_2d`, SR) and the RHT
   statistics (`_tpu_operand.rht_stats`): seconds per call site from the slope between
   the fewest and the most sites; whether the compile of `k` identical kernels grows
   with `k` says whether Mosaic compiles each call site anew.
2. **The training step by recipe and pick.** The adam step of `bench_accel`'s MLP stack
   (`--d`, `--hidden`, `--tokens`, `--blocks`): float32, the default NVFP4 recipe (RHT, SR,
   16x16 weights), the same with the RHT operand apart (`rht_operand` xla), with every
   quantiser XLA's, with RHT alone, with SR alone, with neither; each with the number of
   Mosaic calls, the StableHLO's lines, the operations of the optimised entry
   computation (about the kernel launches a step) and the temporaries. Two
   diagnostic variants (never results: wrong for columns the RHT must scale) compile the
   default with the transform's guarded branch as the plain one, and without its
   near-maximum recomputation, to weigh that rarely taken XLA code in the compile and
   the temporaries (a `cond`'s branch buffers are allocated whether or not it runs).
   `--steps NAME ...` keeps the variants whose names end with one of those (and
   float32). (A third diagnostic, the exact scalar prologue in XLA replaced by plain
   divisions, weighed it at ~7 of 16.5 s on a TPU v5e, 2026-12-07: it has been a kernel,
   `_tpu_quantize.prologue`, since.)

3. **Where the step's lowering goes** (`--only lowering`): the default NVFP4 step traced,
   then lowered for a TPU under `cProfile` (on a CPU too: Pallas lowers a TPU kernel
   without the chip, the picks made as a TPU's), the lowering's seconds, the Mosaic
   kernel calls in its StableHLO (all and distinct) and the functions with the most
   cumulative time among nvfp4x's and Pallas's.

4. **The quantiser's tilings** (`--only tilings`): the 1x16 and 16x16 quantiser kernel
   (`_tpu_quantize.tiled`: the GEMM operand's values, float32 and bfloat16, SR and to
   nearest; `to_nvfp4`'s codes) in each of `TILING_CANDIDATES` (the table's, its chunks
   looped, tiles one chunk wide): lower and compile seconds of a fresh function, the
   time (median of `--repeats`), and the bits against the table's tiling. The kernel's
   compile dominated a step's (5 s for the 1x16 SR values kernel, 2026-12-07), its
   chunks along a row unrolled.

On a CPU (`--smoke`) sections 1 and 4 lower the kernels for a TPU (no compile: Mosaic's
runs on the chip only) and section 2 runs the XLA variants.
"""

import argparse
import collections
import contextlib
import cProfile
import functools
import pstats
import re
import sys
import time
import traceback
import unittest.mock

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import nvfp4x
from nvfp4x import _kernels
from nvfp4x._kernels import _tpu_operand, _tpu_quantize
from nvfp4x._numerics import _hadamard

try:
    from benchmarks import bench_compile
    from benchmarks.bench_compile import MOSAIC, compile_seconds, make_step, mse
    from benchmarks.bench_training import Stack
    from benchmarks.tpu_quantize_check import Report, same_bits, test_array, timed
except ImportError:  # run as a script from inside benchmarks/
    import bench_compile
    from bench_compile import MOSAIC, compile_seconds, make_step, mse
    from bench_training import Stack
    from tpu_quantize_check import Report, same_bits, test_array, timed

SEED = jnp.asarray([0x1234, 0xABCD], jnp.uint32)
#: The kernels of section 1: name -> a call on one `N x N` float32 array.
KERNELS = {
    "fused RHT operand (16x1, SR)": lambda x: _tpu_operand.operand(
        x, jnp.float32(64.0), SEED, rounding="stochastic", rht=True
    )[0],
    "quantiser values (1x16, SR)": lambda x: _tpu_quantize.quantize_2d(
        x, None, SEED, block=(1, 16), rounding="stochastic", output="values"
    )[0],
    "quantiser values (1x16)": lambda x: _tpu_quantize.quantize_2d(
        x, None, block=(1, 16), output="values"
    )[0],
    "quantiser values (16x16, weights)": lambda x: _tpu_quantize.quantize_2d(
        x, None, block=(16, 16), output="values"
    )[0],
    # (the 1x16 operands by `_tpu_operand`'s kernel: `OPERAND_KERNEL_BLOCKS`' other choice)
    "operand kernel values (1x16, SR)": lambda x: _tpu_operand.operand(
        x, None, SEED, block=(1, 16), rounding="stochastic"
    )[0],
    "RHT statistics": lambda x: _tpu_operand.rht_stats(x)[1],
    "prologue": lambda x: _tpu_quantize.prologue(jnp.max(jnp.abs(x), axis=0)[:8]),
}


def sites_fn(kernel, k: int):
    """`k` calls of `kernel` on `k` different arrays derived from `x`, summed (a fresh
    function each time: no trace is reused)."""

    def f(x):
        return sum(jnp.sum(kernel(x * jnp.float32(i + 1)).astype(jnp.float32)) for i in range(k))

    return f


def lower_compile(f, *args, on_tpu: bool) -> tuple[float, float | None, int, int | None]:
    """`(lower s, compile s, kernel functions in the StableHLO, Mosaic calls in the
    optimised HLO)` of a fresh `jax.jit(f)`; off a TPU lowered for one, the last two
    `None` (Mosaic's compile runs on the chip only)."""
    t0 = time.perf_counter()
    jitted = jax.jit(f)
    if on_tpu:
        lowered = jitted.lower(*args)
    else:
        lowered = jitted.trace(*args).lower(lowering_platforms=("tpu",))
    t1 = time.perf_counter()
    functions = lowered.as_text().count("tpu_custom_call")
    if not on_tpu:
        return t1 - t0, None, functions, None
    compiled = lowered.compile()
    return t1 - t0, time.perf_counter() - t1, functions, compiled.as_text().count(MOSAIC)


def call_sites(report: Report, n: int, sites: list[int], on_tpu: bool) -> None:
    report.line(f"## Kernel call sites ({n}x{n} float32, a fresh function each)")
    report.line("")
    report.line("| kernel | call sites | kernel functions / Mosaic calls | lower s | compile s |")
    report.line("|---|---|---|---|---|")
    x = jax.ShapeDtypeStruct((n, n), jnp.float32)
    for name, kernel in KERNELS.items():
        seen = {}
        for k in sites:
            try:
                low, comp, functions, calls = lower_compile(sites_fn(kernel, k), x, on_tpu=on_tpu)
            except Exception as e:  # noqa: BLE001
                report.line(f"| {name} | {k} | error: {type(e).__name__} | | |")
                traceback.print_exc()
                continue
            seen[k] = comp
            comp_s = "n/a (no TPU)" if comp is None else f"{comp:.2f}"
            report.line(f"| {name} | {k} | {functions} / {calls} | {low:.2f} | {comp_s} |")
        lo, hi = min(sites), max(sites)
        if seen.get(lo) is not None and seen.get(hi) is not None and hi > lo:
            slope = (seen[hi] - seen[lo]) / (hi - lo)
            report.line(f"| {name}: compile per call site | | | | {slope:.3f} |")
    report.line("")


def replaced(module, name: str, by: str):
    """`module.name` as `module.by` inside the block (`set_to`)."""
    return bench_compile.set_to(module, name, getattr(module, by))


@contextlib.contextmanager
def looped_tilings():
    """Every `_tpu_quantize.TILINGS` entry with its chunks looped inside the block (JAX's
    caches cleared on the way in and out)."""
    before = dict(_tpu_quantize.TILINGS)
    _tpu_quantize.TILINGS.update({k: t._replace(looped=True) for k, t in before.items()})
    jax.clear_caches()
    try:
        yield
    finally:
        _tpu_quantize.TILINGS.clear()
        _tpu_quantize.TILINGS.update(before)
        jax.clear_caches()


def steps(report: Report, a, on_tpu: bool) -> None:
    shape = f"{a.blocks} blocks d={a.d} hidden={a.hidden}, {a.tokens} tokens, adam"
    report.line(f"## The training step's compile ({shape})")
    report.line("")
    report.line(
        "| step | lower s | compile s | total / float32 | kernel functions / Mosaic calls "
        "| StableHLO lines | entry ops | temporaries MiB |"
    )
    report.line("|---|---|---|---|---|---|---|---|")
    kx, ky, km = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (a.tokens, a.d), jnp.float32)
    y = jax.random.normal(ky, (a.tokens, a.d), jnp.float32)
    model = Stack(a.d, a.hidden, a.blocks, km)
    nv = nvfp4x.recipes.nvfp4_training
    variants = {
        "float32": (model, {}),
        "nvfp4 default": (nvfp4x.quantize(model, nv()), {}),
        "nvfp4, rht_operand xla (apart)": (nvfp4x.quantize(model, nv()), {"rht_operand": "xla"}),
        "nvfp4, every quantiser xla": (
            nvfp4x.quantize(model, nv()),
            {"rht_operand": "xla", "nvfp4_quantize": "xla", "rht": "xla"},
        ),
        "nvfp4, RHT without SR": (nvfp4x.quantize(model, nv(stochastic_rounding=False)), {}),
        "nvfp4, SR without RHT": (nvfp4x.quantize(model, nv(rht=False)), {}),
        "nvfp4, neither": (nvfp4x.quantize(model, nv(rht=False, stochastic_rounding=False)), {}),
    }
    # Diagnostics (wrong bits for columns that need the RHT's scaling, never a result):
    # the default step with the guarded transform's branches as the plain transform, and
    # with only its near-maximum recomputation (`_accurate`) left out.
    default = variants["nvfp4 default"]
    diagnostics = {
        "diagnostic: nvfp4 default, guarded RHT branch plain": ("_guarded", "_unguarded"),
        "diagnostic: nvfp4 default, no near-max recomputation": ("_accurate", "_as_is"),
    }
    variants |= {name: default for name in diagnostics}
    looped = "nvfp4 default, the quantiser's chunks looped"
    variants[looped] = default
    across = "nvfp4 default, 1x16 operands by the operand kernel"
    variants[across] = default
    fused_inputs = "nvfp4 default, input fusion"
    variants[fused_inputs] = default
    base = None
    for name, (m, picks) in variants.items():
        if a.steps and name != "float32" and not any(name.endswith(k) for k in a.steps):
            continue
        try:
            with contextlib.ExitStack() as stack:
                for op, impl in picks.items():
                    stack.enter_context(_kernels.use(op, impl))
                if name in diagnostics:
                    stack.enter_context(replaced(_hadamard, *diagnostics[name]))
                if name == looped:
                    stack.enter_context(looped_tilings())
                if name == fused_inputs:
                    stack.enter_context(bench_compile.input_fusion())
                if name == across:
                    stack.enter_context(bench_compile.operand_kernel_across())
                r = compile_seconds(m, x, y, text=True)
        except Exception as e:  # noqa: BLE001
            report.line(f"| {name} | error: {type(e).__name__}: {str(e)[:80]} | | | | | | |")
            traceback.print_exc()
            continue
        base = r["total"] if name == "float32" else base
        ratio = f"{r['total'] / base:.2f}x" if base else ""
        lines = r["lowered"].count("\n")
        calls = f"{r['lowered'].count('tpu_custom_call')} / {r['mosaic_calls']}"
        temp = "" if r["temp_bytes"] is None else f"{r['temp_bytes'] / 2**20:.0f}"
        report.line(
            f"| {name} | {r['lower']:.2f} | {r['compile']:.2f} | {ratio} | {calls} | {lines} "
            f"| {r['entry_ops']} | {temp} |"
        )
    report.line("")


#: The quantiser cases of section 3: `(label, block, dtype, rounding, output)`.
TILING_CASES = (
    ("1x16 values SR (fprop x, dgrad dy)", (1, 16), jnp.float32, "stochastic", "values"),
    ("1x16 values SR", (1, 16), jnp.bfloat16, "stochastic", "values"),
    ("1x16 values", (1, 16), jnp.float32, "nearest", "values"),
    ("16x16 values (weights)", (16, 16), jnp.float32, "nearest", "values"),
    ("1x16 codes (to_nvfp4)", (1, 16), jnp.float32, "nearest", "codes"),
)
#: Section 3's tilings besides each case's `TILINGS` entry (and it looped).
TILING_CANDIDATES = (
    _tpu_quantize.Tiling(2048, 512, 512),
    _tpu_quantize.Tiling(4096, 512, 512),
    _tpu_quantize.Tiling(1024, 512, 512),
    _tpu_quantize.Tiling(2048, 1024, 512, looped=True),
    _tpu_quantize.Tiling(512, 1024, 256, looped=True),
)


def lowering(report: Report, a, on_tpu: bool, rows: int = 30) -> None:
    """Section 3: the default step's lowering for a TPU, profiled."""
    report.line(
        f"## Where the default step's lowering goes ({a.blocks} blocks d={a.d} "
        f"hidden={a.hidden}, {a.tokens} tokens, adam)"
    )
    report.line("")
    model = nvfp4x.quantize(
        Stack(a.d, a.hidden, a.blocks, jax.random.key(0)), nvfp4x.recipes.nvfp4_training()
    )
    arrays, static = eqx.partition(model, eqx.is_array)
    optimizer = optax.adam(1e-4)
    step = make_step(optimizer, static, mse)
    x = jax.ShapeDtypeStruct((a.tokens, a.d), jnp.float32)
    with contextlib.ExitStack() as stack:
        if not on_tpu:  # the picks a TPU makes (Pallas lowers the kernels without one)
            stack.enter_context(unittest.mock.patch.object(_kernels, "backend", lambda: "tpu"))
        t0 = time.perf_counter()
        traced = jax.jit(step).trace(arrays, optimizer.init(arrays), x, x)
        t1 = time.perf_counter()
        profiler = cProfile.Profile()
        profiler.enable()
        text = traced.lower(lowering_platforms=("tpu",)).as_text()
        profiler.disable()
        t2 = time.perf_counter()
    configs = re.findall(r'tpu_custom_call.*?backend_config = "([^"]*)"', text)
    names = collections.Counter(re.findall(r'kernel_name = "([^"]*)"', text))
    report.line(
        f"trace {t1 - t0:.2f} s, lower {t2 - t1:.2f} s; Mosaic calls {len(configs)} "
        f"({len(set(configs))} distinct): {dict(names)}"
    )
    by_function, _ = inlined(text)
    total = sum(by_function.values())
    top = ", ".join(f"{name} {n:,}" for name, n in by_function.most_common(6))
    report.line("")
    report.line(
        f"StableHLO operations once XLA inlines the program's functions (constants aside): "
        f"{total:,}; by function: {top}"
    )
    report.line("")
    report.line("| cumulative s | own s | calls | function |")
    report.line("|---|---|---|---|")
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    keep = [
        (ct, tt, nc, _where(key))
        for key, (_, nc, tt, ct, _) in stats.items()
        if "nvfp4x" in key[0] or "pallas" in key[0]
    ]
    for ct, tt, nc, where in sorted(keep, reverse=True)[:rows]:
        report.line(f"| {ct:.2f} | {tt:.2f} | {nc} | `{where}` |")
    report.line("")
    report.line("The functions with the most time of their own (any module):")
    report.line("")
    report.line("| own s | cumulative s | calls | function |")
    report.line("|---|---|---|---|")
    own = sorted(
        ((tt, ct, nc, _where(key)) for key, (_, nc, tt, ct, _) in stats.items()), reverse=True
    )
    for tt, ct, nc, where in own[: rows // 2]:
        report.line(f"| {tt:.2f} | {ct:.2f} | {nc} | `{where}` |")
    report.line("")


def inlined(text: str) -> tuple[collections.Counter, collections.Counter]:
    """A StableHLO module's `main` with every `func.call` inlined (as XLA inlines them
    before it compiles), by function (its name less JAX's `_<n>` suffix): `(operations,
    runs)`, the operations written in each function (constants, returns and calls not
    counted) times the times it runs, and those times (what a function jitted once and
    called at many sites still costs XLA). Also the tests' count of a function's copies
    (`tests/test_tpu_rht.py`, `tests/test_tpu_operand.py`)."""
    bodies = {}
    for chunk in re.split(r"\n\s*func\.func ", text)[1:]:
        name = re.match(r"(?:\w+\s+)?@([\w.$-]+)", chunk)
        if name:
            bodies[name.group(1)] = chunk
    operations: collections.Counter = collections.Counter()
    runs: collections.Counter = collections.Counter()

    def walk(name: str) -> None:
        body = bodies[name]
        own = sum(
            1
            for line in body.splitlines()
            if re.search(r"= \"?[a-z_]+\.", line)
            and not re.search(r"stablehlo\.constant|func\.call|\bcall @", line)
        )
        short = re.sub(r"_\d+$", "", name)
        operations[short] += own
        runs[short] += 1
        for callee in re.findall(r"call @([\w.$-]+)", body):
            if callee in bodies:
                walk(callee)

    walk("main")
    return operations, runs


def _where(key: tuple) -> str:
    file, line, name = key
    return f"{file.split('site-packages/')[-1].split('/work/main/')[-1]}:{line} {name}"


def _tiled_call(x, *, seed, kw):
    """`quantize_2d(x, None, seed, **kw)`'s output and scale bits."""
    return _tpu_quantize.quantize_2d(x, None, seed, **kw)[:2]


def tilings(report: Report, n: int, repeats: int, on_tpu: bool) -> None:
    report.line(f"## The quantiser's tilings ({n}x{2 * n}, a fresh function each)")
    report.line("")
    report.line("| case | tiling | lower s | compile s | ms | same bits as the table's |")
    report.line("|---|---|---|---|---|---|")
    for label, block, dtype, rounding, output in TILING_CASES:
        x = test_array((n, 2 * n), dtype)
        seed = SEED if rounding == "stochastic" else None
        table = _tpu_quantize.tiling_for(block, dtype)
        want = None
        for t in (table, table._replace(looped=True), *TILING_CANDIDATES):
            if t == table._replace(looped=True) and t.cols == t.chunk:
                continue  # (one chunk a row: nothing to loop)

            kw = dict(block=block, rounding=rounding, output=output, tiling=t)
            f = functools.partial(_tiled_call, seed=seed, kw=kw)

            name = f"{tuple(t)}" + (" (table)" if t == table else "")
            try:
                low, comp, _, _ = lower_compile(f, x, on_tpu=on_tpu)
                if not on_tpu:
                    report.line(f"| {label} {jnp.dtype(dtype).name} | {name} | {low:.2f} | | | |")
                    continue
                g = jax.jit(f)
                got = g(x)
                want = got if want is None else want
                ms = timed({"k": functools.partial(g, x)}, repeats)["k"] * 1e3
                same = same_bits(got, want)
                report.line(
                    f"| {label} {jnp.dtype(dtype).name} | {name} | {low:.2f} | {comp:.2f} "
                    f"| {ms:.3f} | {same} |"
                )
            except Exception as e:  # noqa: BLE001
                report.line(f"| {label} | {name} | error: {type(e).__name__} | | | |")
                traceback.print_exc()
    report.line("")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--sites", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--d", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument(
        "--only",
        choices=("sites", "steps", "lowering", "tilings"),
        nargs="+",
        default=["sites", "steps", "lowering", "tilings"],
    )
    p.add_argument(
        "--steps",
        nargs="+",
        default=[],
        help="section 2: only the variants whose names end with one of these (and float32)",
    )
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args(argv)
    if a.smoke:
        a.size, a.sites, a.d, a.hidden, a.tokens = 256, [1, 2], 32, 64, 64
    on_tpu = jax.default_backend() == "tpu"
    report = Report(a.out)
    report.line(f"# tpu_compile_check on {jax.devices()[0].device_kind}, jax {jax.__version__}")
    report.line("")
    if "sites" in a.only:
        call_sites(report, a.size, a.sites, on_tpu)
    if "steps" in a.only:
        steps(report, a, on_tpu)
    if "lowering" in a.only:
        lowering(report, a, on_tpu)
    if "tilings" in a.only:
        tilings(report, a.size, a.repeats, on_tpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
