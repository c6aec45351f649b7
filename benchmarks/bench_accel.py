"""Accelerator benchmark (issues 26, 27, 37 and 38): TPU or GPU, every figure a ratio
measured in this one process.

```
python benchmarks/bench_accel.py [--lean | --quick] [--only SECTION ...] [--out PATH]
                                 [--repeats N] [--jobs N]
python benchmarks/bench_accel.py --smoke     # every section at toy sizes, on the CPU
```

`benchmarks/bench_gpu.py` is the same benchmark under its former name. Without a TPU or
a GPU it prints a message and exits 0 (unless `--smoke`). On a TPU the device command
is limited in time: run the sections in groups (`--only`), see `docs/benchmarks.md`.
Sections (the default set: every one that runs on the backend; `kernel_sweep`,
`frozen_sweep` and `native` are for GPUs):

- `bandwidth`: plain read (`jnp.max` of an array) and copy (`x + 1`, read + write)
  bandwidth; the copy bandwidth is the memory floor's denominator.
- `quantize`: 8192x16384 float32 and bfloat16 arrays through `nvfp4x.to_nvfp4` (1x16 and
  16x16 blocks, round to nearest and stochastic), `nvfp4x.fake_quantize` and the GEMM
  operand quantiser (`NVFP4Spec.quantize` with the `nvfp4_training` recipe's formats:
  fprop's x along its rows, the weight's 16x16 tiles, wgrad's dy after the RHT in 16x1
  blocks with SR), each by every implementation of `nvfp4x._kernels`' `nvfp4_quantize`
  that runs compiled on the backend (`implementations`), whether each gives the
  reference's (`"xla"`) bits, and each time as a ratio to the memory floor: the input
  read once plus 4.5 bits per element written (E2M1 codes and E4M3 block scales), at
  the measured copy bandwidth (for the operand path also against its own output,
  bfloat16 values); against JAX's nvfp4 quantiser
  (`jax._src.cudnn.scaled_matmul_stablehlo.quantize`, what `jax.nn.scaled_dot_general`
  quantises with) and qwix's (`qwix.quantize(x, "nvfp4", tiled_axes={1: 16})`) where
  they run.
- `gemm`: the 8192^3 GEMM, bfloat16 operands: `jnp.dot`, `nvfp4x.qdot` forward
  (`nvfp4_training`: both operands quantised, then the GEMM) with each quantiser,
  `jax.nn.scaled_dot_general` with nvfp4 configs.
- `train`: one jitted adam step of 2 MLP blocks (d=2048, hidden 8192, 8192 tokens,
  float32 master weights, layers vmapped over tokens): float32; mixed bf16 (weights and
  activations cast to bfloat16 in the step); the `bf16`, `fp8`, `mxfp8` and
  `nvfp4_training` recipes (the last with each quantiser, with the RHT by the
  implementation the backend does not pick, without RHT and SR, and inside mixed
  bf16); qwix's NVFP4 quantised training (`QtProvider`, the same MLP in Flax linen)
  where qwix is installed; float32, mixed bf16 and NVFP4 with the blocks stacked
  under `lax.scan`. Per step: the median time of interleaved rounds, against mixed bf16
  (and TFLOP/s at `6 tokens weights`), the compile time (lower + XLA, one program at a
  time) and the temporary memory of the compiled program (`memory_analysis()`) against
  mixed bf16's. The steps are not donated and share their weights, and their adam
  state is zeros shared by shape, so that a dozen of them fit on the chip at once.
- `compile`: the `train` steps' compile times against float32 (compiling the float32
  and NVFP4 steps alone where `train` did not run), and the compile of 8 unrolled small
  blocks (d=128, hidden 512, 256 tokens: `benchmarks/bench_compile.py`'s) and 8 scanned
  ones, NVFP4 (each quantiser) against float32, with the optimised HLO's lines per block.
- `frozen`: a frozen stack of 16 layers 8192x8192 (1.07 B weights), W4A16
  (`nvfp4_weight_only`) and W4A4 (`nvfp4_inference`), float32 and bfloat16 activations,
  forward at 1, 16 and 4096 tokens with each implementation of `frozen_gemm` that runs on
  the backend, against bfloat16 weights (and float32): time, ratio to bf16, the GB/s at
  which the weights are read, and the program's peak memory (arguments + temporaries +
  output, `memory_analysis()`).
- `profile`: where a step's time goes. The `train` section's mixed bf16 and NVFP4 steps
  (full recipe, the fastest quantiser, float32 and inside mixed bf16; reused from
  `train` when it ran) and the frozen bf16 and W4A16 forwards at one token, each
  traced with `jax.profiler` over a few calls: device time per call summed per HLO
  operation of the compiled program (the
  trace's XLA-op events, read with `jax.profiler.ProfileData`; on a TPU the
  `/device:TPU:0` plane's "XLA Ops" line), grouped by kind (`hlo_ops`: GEMMs, custom
  kernels, other fusions, copies, the rest) and the top operations with their kind and
  output shape. Where the trace has no device events it says so (a row), after trying
  the Perfetto trace (`create_perfetto_trace=True`). With `--out`, each program's
  optimised HLO is written next to it (`<out>.<label>.hlo.txt.gz`: its peak's buffers
  by `benchmarks/hlo_memory.py`), and every operation's time
  (`<out>.<label>.ops.tsv.gz`).
- `kernel_sweep` (GPU): `to_nvfp4` through the Pallas Triton kernel with each tiling of
  `_pallas_nvfp4.CANDIDATES`, the best per case printed as a `TILINGS` table.
- `frozen_sweep` (GPU): the Pallas Triton frozen GEMM with each of its `SWEEP_TILES`.
- `native` (GPU): the native FP8 and block-scaled GEMMs against their emulation.

Sizes: the default is the issues' (above); `--lean` keeps them but runs fewer variants
(the fastest quantiser only, no fp8/mxfp8 recipes, no scanned steps, no second qwix
step) and a frozen stack of 8 layers; `--quick` halves the sizes; `--smoke` is toy sizes
for the CPU, where the Pallas kernels run interpreted. Each timed function is compiled
and run once first (warm-up); the variants of a group are then called in turn,
`--repeats` rounds (interleaved), each call followed by `block_until_ready`, and the
median is reported. Where compile times are not reported, programs compile `--jobs` at
a time. A section's arrays are dropped before the next begins; each section reports its
wall time (compiles included) and the device memory in use after it. A failing row or
section prints its error and the rest go on. The table is printed as Markdown, headed
with the device and the date, and written to `--out`.
"""

import argparse
import concurrent.futures
import contextlib
import dataclasses
import functools
import gc
import glob
import gzip
import json
import platform
import re
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.profiler import ProfileData

import nvfp4x
from nvfp4x import _kernels
from nvfp4x._formats import quantize_operand

try:
    from benchmarks import bench_compile
    from benchmarks.bench_compile import Scanned, compile_seconds, memory
    from benchmarks.bench_format import jax_nvfp4_quantizer
    from benchmarks.bench_inference import to_bf16, weight_bytes
    from benchmarks.bench_training import Stack
except ImportError:  # run as a script from inside benchmarks/
    import bench_compile
    from bench_compile import Scanned, compile_seconds, memory
    from bench_format import jax_nvfp4_quantizer
    from bench_inference import to_bf16, weight_bytes
    from bench_training import Stack

SECTIONS = (
    "bandwidth",
    "quantize",
    "gemm",
    "train",
    "compile",
    "frozen",
    "profile",
    "kernel_sweep",
    "frozen_sweep",
    "native",
)
#: Sections that time GPU-only code (Triton kernels, cuBLASLt FP8): skipped elsewhere
#: unless asked for by `--only` (on the CPU, `--smoke` runs them interpreted).
GPU_SECTIONS = ("kernel_sweep", "frozen_sweep", "native")
#: The backends on which an implementation of `nvfp4x._kernels` runs compiled; others
#: (the XLA reference) run everywhere. Elsewhere a Pallas kernel would run interpreted,
#: which is for the tests, not for timing: the benchmark skips it there (on the CPU,
#: `--smoke` runs every implementation).
COMPILED_ON = {"pallas": ("gpu",), "mosaic": ("tpu",)}
#: Arguments `benchmarks/run_all.py --quick` would pass (it skips without a GPU or TPU).
QUICK_ARGV = ["--quick"]


@dataclasses.dataclass(frozen=True)
class Sizes:
    rows: int = 8192  # quantised array: rows x cols
    cols: int = 16384
    gemm: int = 8192  # m = n = k
    d: int = 2048  # training model
    hidden: int = 8192
    tokens: int = 8192
    blocks: int = 2
    frozen_d: int = 8192
    frozen_layers: int = 16
    frozen_tokens: tuple[int, ...] = (1, 16, 4096)
    repeats: int = 5
    full: bool = True  # every variant (else the headline ones: `--lean`)
    sweep_rows: int = 32768  # frozen_sweep: the weight's rows at few tokens
    compile_blocks: int = 8  # compile: the small blocks' model (bench_compile's)
    compile_d: int = 128
    compile_hidden: int = 512
    compile_tokens: int = 256


FULL = Sizes()
LEAN = dataclasses.replace(FULL, frozen_layers=8, repeats=4, full=False)
QUICK = Sizes(4096, 8192, 4096, 1024, 4096, 4096, 2, 4096, 4, (1, 16, 1024), 3, False, 16384)
SMOKE = Sizes(64, 256, 128, 32, 64, 64, 2, 64, 2, (1, 16, 64), 1, True, 128, 2, 32, 64, 32)


class Table:
    """Rows `(section, what, value, note)`, printed as they come."""

    def __init__(self):
        self.rows: list[tuple[str, str, str, str]] = []

    def add(self, section: str, what: str, value: str, note: str = "") -> None:
        self.rows.append((section, what, value, note))
        print(f"  {what}: {value}  {note}", flush=True)

    def error(self, section: str, what: str, e: BaseException) -> None:
        self.add(section, what, "**error**", f"{type(e).__name__}: {str(e)[:300]}")

    def markdown(self, header: str) -> str:
        esc = lambda s: str(s).replace("|", "\\|").replace("\n", " ")
        lines = [header, "", "| section | what | value | note |", "|---|---|---|---|"]
        lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in self.rows]
        return "\n".join(lines) + "\n"


def ready(out: Any) -> Any:
    return jax.block_until_ready(out)


def interleaved(
    fns: dict[str, Callable[[], Any]], repeats: int, table: Table, section: str
) -> dict[str, float]:
    """Median seconds of each `fn()` (run to completion), warm-up call first, the
    functions called in turn `repeats` times. A function that fails is dropped, its
    error a row of `table`."""
    live = {}
    for name, fn in fns.items():
        try:
            ready(fn())
            live[name] = fn
        except Exception as e:  # noqa: BLE001 - one failing variant must not stop the rest
            table.error(section, name, e)
    times: dict[str, list[float]] = {name: [] for name in live}
    for _ in range(repeats):
        for name, fn in live.items():
            t0 = time.perf_counter()
            ready(fn())
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def ms(t: float) -> str:
    return f"{t * 1e3:.3f} ms"


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB" if n >= 2**24 else f"{n / 2**10:,.0f} KiB"


def traced_with(fn: Callable, **picks: str) -> Callable:
    """`fn` with the implementations `picks` (`op=implementation`, see
    `nvfp4x._kernels`) picked while it is traced (a new function: `jax.jit` caches
    traces by function, and the picks are not an argument)."""

    def wrapped(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            for op, implementation in picks.items():
                stack.enter_context(_kernels.use(op, implementation))
            return fn(*args, **kwargs)

    return wrapped


def pallas_traced(fn: Callable) -> Callable:
    """`fn` with the Pallas (Triton) quantiser picked while it is traced."""
    return traced_with(fn, nvfp4_quantize="pallas")


def xla_traced(fn: Callable) -> Callable:
    """`fn` with the XLA (reference) quantiser picked while it is traced."""
    return traced_with(fn, nvfp4_quantize="xla")


def implementations(op: str) -> tuple[str, ...]:
    """The implementations of `op` (`nvfp4x._kernels.IMPLEMENTATIONS`) that run compiled
    on this backend (`COMPILED_ON`), the reference first; on the CPU every one (the
    Pallas kernels interpreted: `--smoke`)."""
    backend = _kernels.backend()
    impls = _kernels.IMPLEMENTATIONS[op]
    if backend == "cpu":
        return impls
    return tuple(i for i in impls if backend in COMPILED_ON.get(i, (backend,)))


def fastest(op: str) -> str:
    """The implementation of `op` a variant that is timed once uses: the last of
    `implementations(op)` (a kernel for this backend where there is one, else the
    reference); on the CPU the default pick (the interpreted kernels are for tests)."""
    if _kernels.backend() == "cpu":
        return _kernels.pick(op)
    return implementations(op)[-1]


def skipped_implementations(op: str, table: Table, section: str) -> None:
    """A row naming the implementations of `op` that do not run on this backend."""
    skipped = [i for i in _kernels.IMPLEMENTATIONS[op] if i not in implementations(op)]
    if skipped:
        where = {i: "/".join(COMPILED_ON.get(i, ())) for i in skipped}
        note = ", ".join(f"{i} (runs on {w})" for i, w in where.items())
        table.add(section, f"{op} implementations skipped on {_kernels.backend()}", note)


def compile_many(
    lowerings: dict[str, Callable[[], Any]], table: Table, section: str, jobs: int
) -> dict[str, Any]:
    """`{name: compiled}`: each `lowerings[name]()` (a `jax.stages.Lowered`, traced here
    in turn, with its picks) compiled `jobs` at a time in threads (XLA compiles outside
    the GIL). Failures are rows of `table`."""
    lowered = {}
    for name, lower in lowerings.items():
        try:
            lowered[name] = lower()
        except Exception as e:  # noqa: BLE001
            table.error(section, name, e)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {k: pool.submit(low.compile) for k, low in lowered.items()}
    compiled = {}
    for name, future in futures.items():
        try:
            compiled[name] = future.result()
        except Exception as e:  # noqa: BLE001
            table.error(section, name, e)
    return compiled


def lowering(fn: Callable, *args, **picks: str) -> Callable[[], Any]:
    """A function lowering `fn(*args)` with `picks` (see `traced_with`)."""
    return lambda: jax.jit(traced_with(fn, **picks)).lower(*args)


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


@jax.jit
def _equal_bits(a: list, b: list) -> jax.Array:
    def bits(u):
        if u.dtype == jnp.bool_ or jnp.issubdtype(u.dtype, jnp.unsignedinteger):
            return u
        return jax.lax.bitcast_convert_type(u, _UINT[u.dtype.itemsize])

    equal = [jnp.array_equal(bits(u), bits(v)) for u, v in zip(a, b, strict=True)]
    return jnp.all(jnp.stack(equal))


def same_bits(a: Any, b: Any) -> bool:
    """Whether two results have the same leaves, shapes, dtypes and bits (-0 is not +0;
    NaNs by payload), compared on the device."""
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    if len(la) != len(lb) or any(
        (u.shape, u.dtype) != (v.shape, v.dtype) for u, v in zip(la, lb, strict=True)
    ):
        return False
    return bool(_equal_bits(la, lb)) if la else True


# ---------------------------------------------------------------------------- sections


def bandwidth(s: Sizes, table: Table, state: dict) -> None:
    x = jnp.ones((s.rows, s.cols), jnp.float32)
    read = jax.jit(jnp.max)
    copy = jax.jit(lambda x: x + 1.0)
    fns = {"read": lambda: read(x), "copy": lambda: copy(x)}
    t = interleaved(fns, s.repeats, table, "bandwidth")
    n = x.size * 4
    state["read_bw"] = n / t["read"]
    state["copy_bw"] = 2 * n / t["copy"]
    table.add("bandwidth", "read (jnp.max, float32)", f"{state['read_bw'] / 1e9:.0f} GB/s")
    table.add(
        "bandwidth",
        "copy (x + 1, float32)",
        f"{state['copy_bw'] / 1e9:.0f} GB/s",
        "read + write: the memory floor's denominator",
    )


def _copy_bw(s: Sizes, state: dict) -> float:
    if "copy_bw" not in state:
        bandwidth(s, Table(), state)
    return state["copy_bw"]


def _qwix_quantizer(table: Table) -> Callable | None:
    try:
        import qwix  # pyright: ignore[reportMissingImports]
    except ImportError:
        table.add("quantize", "qwix nvfp4 quantiser", "skipped", "qwix is not installed")
        return None
    return lambda x: qwix.quantize(x, "nvfp4", tiled_axes={1: 16})


def quantize(s: Sizes, table: Table, state: dict) -> None:
    bw = _copy_bw(s, state)
    key = jax.random.key(0)
    recipe = nvfp4x.recipes.nvfp4_training()
    impls = implementations("nvfp4_quantize")
    skipped_implementations("nvfp4_quantize", table, "quantize")
    others: dict[str, Callable] = {}
    try:
        others["JAX's nvfp4 quantiser 1x16"] = jax_nvfp4_quantizer()
    except Exception as e:  # noqa: BLE001
        table.error("quantize", "JAX's nvfp4 quantiser", e)
    if (qwix_q := _qwix_quantizer(table)) is not None:
        others["qwix's nvfp4 quantiser 1x16"] = qwix_q

    def to_nvfp4(block=(1, 16), rounding="nearest"):
        k = key if rounding == "stochastic" else None
        return lambda a: nvfp4x.to_nvfp4(a, block=block, rounding=rounding, key=k)

    def wgrad_dy(a):  # wgrad's dy: RHT along the tokens, 16x1 blocks, SR
        return quantize_operand(nvfp4x.rht(a, axis=0), recipe.grad, 0, key)

    # (function, bytes per element it must write: 4.5 bits, bfloat16, the input's)
    kinds: dict[str, tuple[Callable, float | None]] = {
        "to_nvfp4 1x16": (to_nvfp4(), None),
        "to_nvfp4 1x16 SR": (to_nvfp4(rounding="stochastic"), None),
        "to_nvfp4 16x16": (to_nvfp4((16, 16)), None),
        "to_nvfp4 16x16 SR": (to_nvfp4((16, 16), "stochastic"), None),
        "fake_quantize 1x16": (nvfp4x.fake_quantize, 0.0),
        "operand x, fprop 1x16": (lambda a: quantize_operand(a, recipe.input, -1), 2.0),
        "operand W, 16x16": (lambda a: quantize_operand(a, recipe.weight, -1), 2.0),
        "operand dy, wgrad RHT + 16x1 SR": (wgrad_dy, 2.0),
    }
    for dtype in (jnp.float32, jnp.bfloat16):
        name = jnp.dtype(dtype).name
        x = jax.random.normal(key, (s.rows, s.cols), jnp.float32).astype(dtype)
        floor = (x.nbytes + x.size * 4.5 / 8) / bw
        lowerings, floors = {}, {}
        for what, (fn, written) in kinds.items():
            own = None
            if written is not None:  # what it writes: bfloat16, or the input's dtype
                own = (x.nbytes + x.size * (written or x.dtype.itemsize)) / bw
            for impl in impls:
                lowerings[f"{what} ({impl})"] = lowering(fn, x, nvfp4_quantize=impl)
                floors[f"{what} ({impl})"] = own
        for what, fn in others.items():
            lowerings[what] = lowering(fn, x)
        compiled = compile_many(lowerings, table, "quantize", state["jobs"])
        for what in kinds:
            for impl in impls[1:]:
                a, b = compiled.get(f"{what} (xla)"), compiled.get(f"{what} ({impl})")
                if a is None or b is None:
                    continue
                try:
                    same = same_bits(a(x), b(x))
                    table.add("quantize", f"{what} ({impl}) == xla bit for bit, {name}", str(same))
                except Exception as e:  # noqa: BLE001
                    table.error("quantize", f"{what} ({impl}) == xla, {name}", e)
        fns = {k: functools.partial(f, x) for k, f in compiled.items()}
        t = interleaved(fns, s.repeats, table, "quantize")
        jax_t = t.get("JAX's nvfp4 quantiser 1x16")
        qwix_t = t.get("qwix's nvfp4 quantiser 1x16")
        for k, secs in t.items():
            note = [f"{secs / floor:.2f}x floor"]
            if k in others:  # (their own output layouts, no tensor scale)
                note.append("no tensor scale")
            if floors.get(k):
                note.append(f"{secs / floors[k]:.2f}x its own output's floor")
            for other, ot in (("JAX's", jax_t), ("qwix's", qwix_t)):
                if ot and not k.startswith(other):
                    note.append(f"{secs / ot:.2f}x {other}")
            table.add("quantize", f"{k}, {name} {s.rows}x{s.cols}", ms(secs), ", ".join(note))
        del x, compiled, fns
    rht_rows(s, table, bw)


#: The RHT kernel's tile rows the quantize section times on a TPU (`_tpu_rht.ROWS` the
#: default).
RHT_ROWS = (1024, 2048, 4096)


def rht_rows(s: Sizes, table: Table, bw: float) -> None:
    """`nvfp4x.rht` along the rows of a float32 array by each implementation of `"rht"`
    that runs here (the Mosaic kernel on TPUs), against the floor of one read and one
    write of it, and checked bit for bit against XLA's."""
    x = jax.random.normal(jax.random.key(5), (s.rows, s.cols), jnp.float32)
    floor = 2 * x.nbytes / bw

    def transform(a):
        return nvfp4x.rht(a, axis=0)

    impls = implementations("rht")
    lowerings = {f"rht ({impl})": lowering(transform, x, rht=impl) for impl in impls}
    compiled = compile_many(lowerings, table, "quantize", 1)
    want = compiled["rht (xla)"](x) if "rht (xla)" in compiled else None  # (once)
    for impl in impls[1:]:
        got = compiled.get(f"rht ({impl})")
        if want is not None and got is not None:
            same = same_bits(want, got(x))
            table.add("quantize", f"rht ({impl}) == xla bit for bit, float32", str(same))
    fns = {k: functools.partial(f, x) for k, f in compiled.items()}
    if "mosaic" in impls and _kernels.backend() == "tpu":  # the kernel's tile rows, swept
        from nvfp4x._kernels import _tpu_rht

        for rows in RHT_ROWS:
            kernel = jax.jit(functools.partial(_tpu_rht.transform, rows=rows))
            try:
                same = same_bits(want, kernel(x)) if want is not None else None
                table.add("quantize", f"rht kernel, {rows}-row tiles == xla bit for bit", str(same))
                fns[f"rht kernel, {rows}-row tiles"] = functools.partial(kernel, x)
            except Exception as e:  # noqa: BLE001
                table.error("quantize", f"rht kernel, {rows}-row tiles", e)
    t = interleaved(fns, s.repeats, table, "quantize")
    base = t.get("rht (xla)")
    for k, secs in t.items():
        note = f"{secs / floor:.2f}x floor (one read, one write)"
        if base and k != "rht (xla)":
            note += f", {secs / base:.2f}x xla"
        table.add("quantize", f"{k}, float32 {s.rows}x{s.cols} along the rows", ms(secs), note)


def square_gemms(s: Sizes, table: Table, section: str, fns: dict, label: str) -> None:
    """Time `x @ w.T` on two bf16 `(m, m)` matrices (`m = s.gemm`) by each of `fns`
    (name -> function of `(x, w)`, lowered with its picks by `lowering`: name -> a
    function `(x, w) -> Lowered`) next to its baselines, bf16 `jnp.dot` and
    `jax.nn.scaled_dot_general` in NVFP4, in TFLOP/s and as a ratio to the bf16 dot;
    rows `label.format(name=..., m=...)` of `section`."""
    m = s.gemm
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (m, m), jnp.bfloat16)
    w = jax.random.normal(kw, (m, m), jnp.bfloat16)
    configs = [jax.nn.get_scaled_dot_general_config("nvfp4")] * 3
    dims = (((1,), (1,)), ((), ()))
    lowerings = {
        "bf16 dot": lowering(
            lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32), x, w
        ),
        "jax.nn.scaled_dot_general nvfp4": lowering(
            lambda x, w: jax.nn.scaled_dot_general(x, w, dims, configs=configs), x, w
        ),
        **{k: functools.partial(make, x, w) for k, make in fns.items()},
    }
    compiled = compile_many(lowerings, table, section, 4)
    t = interleaved(
        {k: functools.partial(f, x, w) for k, f in compiled.items()}, s.repeats, table, section
    )
    base = t.get("bf16 dot")
    for k, secs in t.items():
        tflops = 2 * m**3 / secs / 1e12
        note = f"{tflops:.0f} TFLOP/s" + (f", {secs / base:.2f}x bf16" if base else "")
        table.add(section, label.format(name=k, m=m), ms(secs), note)


def gemm(s: Sizes, table: Table, state: dict) -> None:
    recipe = nvfp4x.recipes.nvfp4_training()

    def qdot(x, w):
        return nvfp4x.qdot(x, w, recipe=recipe)

    skipped_implementations("nvfp4_quantize", table, "gemm")
    fns = {
        f"nvfp4x qdot forward ({impl} quantiser)": (
            lambda x, w, impl=impl: lowering(qdot, x, w, nvfp4_quantize=impl)()
        )
        for impl in implementations("nvfp4_quantize")
    }
    square_gemms(s, table, "gemm", fns, "{name}, {m}^3 bf16 inputs")


class Step:
    """A jitted adam step `step(params, opt_state, x, y) -> (params, opt_state, loss)`,
    lowered and compiled ahead (the times kept), then called on the same arguments each
    time (not donated: the weights are shared with other steps; the adam state is zeros
    shared by shape)."""

    def __init__(self, params: Any, step: Callable, x, y, optimizer, picks: dict | None = None):
        opt_state = _shared_zeros(optimizer.init(params))
        self.args = (params, opt_state, x, y)
        t0 = time.perf_counter()
        lowered = jax.jit(traced_with(step, **(picks or {}))).lower(*self.args)
        t1 = time.perf_counter()
        self.compiled = lowered.compile()
        self.compile_s = time.perf_counter() - t0
        self.lower_s = t1 - t0
        self.memory = memory(self.compiled)

    def __call__(self):
        return self.compiled(*self.args)[2]


_zeros: dict[tuple, jax.Array] = {}


def _shared_zeros(tree: Any) -> Any:
    """`tree` with each array leaf that is all zeros replaced by one zeros array per
    shape and dtype (adam's initial moments)."""

    def share(a):
        if not isinstance(a, jax.Array) or a.ndim == 0:
            return a
        k = (a.shape, a.dtype)
        if k not in _zeros:
            _zeros[k] = jnp.zeros(a.shape, a.dtype)
        return _zeros[k]

    return jax.tree_util.tree_map(share, tree)


def model_step(model, x, y, *, cast: bool = False, picks: dict | None = None) -> Step:
    """The adam step of an Equinox model on the mean squared error, layers vmapped over
    tokens; `cast`: mixed bf16 (bfloat16 copies of the weights and activations in the
    step, float32 master weights)."""
    arrays, static = eqx.partition(model, eqx.is_array)
    optimizer = optax.adam(1e-4)

    def loss_fn(model, x, y):
        if cast:
            model, x = to_bf16(model), x.astype(jnp.bfloat16)
        return jnp.mean((jax.vmap(model)(x).astype(jnp.float32) - y) ** 2)

    def step(arrays, opt_state, x, y):
        model = eqx.combine(arrays, static)
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, arrays)
        return eqx.filter(eqx.apply_updates(model, updates), eqx.is_array), opt_state, loss

    return Step(arrays, step, x, y, optimizer, picks)


def qwix_step(s: Sizes, x, y, *, cast: bool = False) -> Step:
    """qwix's NVFP4 quantised training of the same MLP in Flax linen (`QtProvider`:
    weights, activations and gradients in NVFP4, 1x16 tiles along each GEMM's
    contraction, round to nearest), its adam step as `model_step`'s."""
    import flax.linen as nn  # pyright: ignore[reportMissingImports]
    import qwix  # pyright: ignore[reportMissingImports]

    class Block(nn.Module):
        d: int
        hidden: int

        @nn.compact
        def __call__(self, x):
            return x + nn.Dense(self.d)(jax.nn.gelu(nn.Dense(self.hidden)(x)))

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(s.blocks):
                x = Block(s.d, s.hidden)(x)
            return x

    rule = qwix.QtRule(
        module_path=".*",
        weight_qtype="nvfp4",
        act_qtype="nvfp4",
        bwd_qtype="nvfp4",
        tile_size=16,
        bwd_weight_grad_tile_size=16,
        # nvfp4 needs tiles on every operand; qwix tiles only the weight's gradient's.
        additional_qt_config={"dlhs_tile_size": 16, "drhs_tile_size": 16},
    )
    model = qwix.quantize_model(MLP(), qwix.QtProvider([rule]))
    params = jax.jit(model.init)(jax.random.key(7), x)
    optimizer = optax.adam(1e-4)

    def loss_fn(params, x, y):
        if cast:
            params, x = to_bf16(params), x.astype(jnp.bfloat16)
        return jnp.mean((model.apply(params, x).astype(jnp.float32) - y) ** 2)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return Step(params, step, x, y, optimizer)


def _train_data(s: Sizes):
    kx, ky, km = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(kx, (s.tokens, s.d), jnp.float32)
    y = jax.random.normal(ky, (s.tokens, s.d), jnp.float32)
    return x, y, km


def _within(make: Callable[[], Step], context: contextlib.AbstractContextManager) -> Step:
    """`make()` (a step traced and compiled) inside `context` (a `set_to` variant)."""
    with context:
        return make()


def _ordered_the_other_way(make: Callable[[], Step]) -> Step:
    """`make()` with `_kernels.RHT_OPERANDS_TOGETHER` the other way round."""
    other = not _kernels.RHT_OPERANDS_TOGETHER
    return _within(make, bench_compile.set_to(_kernels, "RHT_OPERANDS_TOGETHER", other))


def train(s: Sizes, table: Table, state: dict) -> None:
    x, y, km = _train_data(s)
    model = Stack(s.d, s.hidden, s.blocks, km)
    R = nvfp4x.recipes
    nv = R.nvfp4_training
    best = fastest("nvfp4_quantize")
    quick = {"nvfp4_quantize": best}
    impls = implementations("nvfp4_quantize") if s.full else (best,)
    skipped_implementations("nvfp4_quantize", table, "train")
    q = nvfp4x.quantize
    variants: dict[str, Callable[[], Step]] = {
        "float32": lambda: model_step(model, x, y),
        "mixed bf16": lambda: model_step(model, x, y, cast=True),
        "bf16 recipe": lambda: model_step(q(model, R.bf16()), x, y),
    }
    if s.full:
        variants["fp8 recipe"] = lambda: model_step(q(model, R.fp8()), x, y)
        variants["mxfp8 recipe"] = lambda: model_step(q(model, R.mxfp8()), x, y)
    for impl in impls:
        if impl == "mosaic" and _kernels.backend() != "tpu":
            # (its TPU interpreter has effects, which a layer's primitive cannot lower)
            table.add("train", f"nvfp4 ({impl})", "skipped", "runs in layers on a TPU only")
            continue
        picks = {"nvfp4_quantize": impl}
        variants[f"nvfp4 ({impl})"] = lambda p=picks: model_step(q(model, nv()), x, y, picks=p)
    # wgrad's transformed operands by the implementation this backend does not pick (on
    # a TPU: the RHT kernel, then the quantiser, against the fused kernels; on the CPU
    # the fused kernels, interpreted: `--smoke`), and (`--full`) the RHT's product too
    # (on a TPU: XLA's transform).
    others = [("rht_operand", i) for i in implementations("rht_operand")]
    others += [("rht", i) for i in implementations("rht")] if s.full else []
    for op, other in others:
        if other == _kernels.pick(op):
            continue
        picks = {"nvfp4_quantize": best, op: other}
        if op == "rht":
            picks["rht_operand"] = "xla"  # (the fused kernels hold their own transform)
        variants[f"nvfp4 ({best}, {op} {other})"] = lambda p=picks: model_step(
            q(model, nv()), x, y, picks=p
        )
    if _kernels.pick("rht_operand") == "mosaic":
        # wgrad's two transformed operands' work ordered the other way (the same bits;
        # XLA schedules it differently: `_kernels.RHT_OPERANDS_TOGETHER`)
        other_order = "together" if not _kernels.RHT_OPERANDS_TOGETHER else "in turn"
        for cast in (False, True):
            name = f"nvfp4{' in mixed bf16' if cast else ''} ({best}, wgrad operands {other_order})"
            variants[name] = lambda c=cast: _ordered_the_other_way(
                lambda: model_step(q(model, nv()), x, y, cast=c, picks=quick)
            )
    if best == "mosaic":
        # the weights' 16x16 GEMM operands by the operand kernel (`OPERAND_KERNEL_BLOCKS`)
        variants[f"nvfp4 ({best}, 16x16 operands by the operand kernel)"] = lambda: _within(
            lambda: model_step(q(model, nv()), x, y, picks=quick),
            bench_compile.operand_kernel_tiles(),
        )
        # the tensor's tininess branched on once a tile, not in each chunk, and with it the
        # 1x16 chunk loops unrolled by 2 (`Tiling.branch_once`, `Tiling.unroll`: 0.89x and
        # 0.91x the quantiser's time alone on a TPU v5e, 2026-12-08)
        variants[f"nvfp4 ({best}, tininess branched once a tile)"] = lambda: _within(
            lambda: model_step(q(model, nv()), x, y, picks=quick),
            bench_compile.branched_once(),
        )
        variants[f"nvfp4 ({best}, branched once, 1x16 loops unrolled by 2)"] = lambda: _within(
            lambda: model_step(q(model, nv()), x, y, picks=quick),
            bench_compile.branched_once(unroll_1x16=2),
        )
    if best == "mosaic" and s.full:
        # the 1x16 ones (the same time as the tiled quantiser's on a TPU v5e, 2026-12-07)
        variants[f"nvfp4 ({best}, 1x16 operands by the operand kernel)"] = lambda: _within(
            lambda: model_step(q(model, nv()), x, y, picks=quick),
            bench_compile.operand_kernel_across(),
        )
        # XLA fusing the kernels' operands' producers into their reads
        # (`_batching.INPUT_FUSION`: XLA's compile failed with it on a TPU v5e, 2026-12-07)
        for cast in (False, True):
            name = f"nvfp4{' in mixed bf16' if cast else ''} ({best}, input fusion)"
            variants[name] = lambda c=cast: _within(
                lambda: model_step(q(model, nv()), x, y, cast=c, picks=quick),
                bench_compile.input_fusion(),
            )
    no_rht_sr = nv(rht=False, stochastic_rounding=False)
    variants |= {
        f"nvfp4 no RHT, no SR ({best})": lambda: model_step(q(model, no_rht_sr), x, y, picks=quick),
        # NVFP4 GEMMs inside a mixed-bf16 step (bf16 weights and activations, float32
        # master), as Transformer Engine and qwix run them.
        f"nvfp4 in mixed bf16 ({best})": lambda: model_step(
            q(model, nv()), x, y, cast=True, picks=quick
        ),
        "qwix nvfp4": lambda: qwix_step(s, x, y),
    }
    if s.full:
        scanned = Scanned(s.d, s.hidden, s.blocks, km)
        variants |= {
            "qwix nvfp4 in mixed bf16": lambda: qwix_step(s, x, y, cast=True),
            "float32 scanned": lambda: model_step(scanned, x, y),
            "mixed bf16 scanned": lambda: model_step(scanned, x, y, cast=True),
            f"nvfp4 scanned ({best})": lambda: model_step(q(scanned, nv()), x, y, picks=quick),
        }
    steps: dict[str, Step] = {}
    for name, make in variants.items():
        try:
            steps[name] = make()
            print(f"  compiled {name} in {steps[name].compile_s:.1f} s", flush=True)
        except ImportError as e:
            table.add("train", name, "skipped", f"{type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001
            table.error("train", name, e)
    state["compile_s"] = {name: st.compile_s for name, st in steps.items()}
    # The profile section traces these again (without compiling them anew).
    state["profile_steps"] = state.get("profile") and {
        "mixed bf16 step": steps.get("mixed bf16"),
        f"nvfp4 ({best}) step": steps.get(f"nvfp4 ({best})"),
        f"nvfp4 in mixed bf16 ({best}) step": steps.get(f"nvfp4 in mixed bf16 ({best})"),
    }
    t = interleaved(dict(steps), s.repeats, table, "train")
    _zeros.clear()  # (the steps hold theirs until they go)
    base = t.get("mixed bf16")
    base_mem = steps["mixed bf16"].memory if "mixed bf16" in steps else None
    weights = 2 * s.blocks * s.d * s.hidden
    flops = 6 * s.tokens * weights
    shape = f"{s.blocks} blocks d={s.d} hidden={s.hidden}, {s.tokens} tokens, adam"
    for name, secs in t.items():
        st = steps[name]
        note = [
            f"{secs / base:.2f}x mixed bf16" if base else "",
            f"{flops / secs / 1e12:.0f} TFLOP/s",
        ]
        note.append(f"compile {st.compile_s:.1f} s")
        if st.memory:
            temp = st.memory["temp"]
            vs = f" = {temp / base_mem['temp']:.2f}x mixed bf16" if base_mem else ""
            note.append(f"temporaries {mib(temp)}{vs}")
        table.add("train", f"{name} step ({shape})", ms(secs), ", ".join(n for n in note if n))


def compile_times(s: Sizes, table: Table, state: dict) -> None:
    c = state.get("compile_s")
    if c is None:  # `train` did not run: the float32 and NVFP4 steps of its model alone
        x, y, km = _train_data(s)
        model = Stack(s.d, s.hidden, s.blocks, km)
        best = fastest("nvfp4_quantize")
        nv = nvfp4x.quantize(model, nvfp4x.recipes.nvfp4_training())
        makes = {
            "float32": lambda: model_step(model, x, y),
            f"nvfp4 ({best})": lambda: model_step(nv, x, y, picks={"nvfp4_quantize": best}),
        }
        c = {}
        for name, make in makes.items():
            try:
                c[name] = make().compile_s
            except Exception as e:  # noqa: BLE001
                table.error("compile", name, e)
    shape = f"{s.blocks} blocks d={s.d} hidden={s.hidden}, {s.tokens} tokens"
    for name, secs in c.items():
        ref = "float32 scanned" if "scanned" in name else "float32"
        note = f"{secs / c[ref]:.2f}x {ref}" if ref in c else ""
        table.add("compile", f"{name} step ({shape}): lower + compile", f"{secs:.2f} s", note)
    # The small model: 8 blocks, compiled unrolled (and scanned).
    n, d, hidden = s.compile_blocks, s.compile_d, s.compile_hidden
    kx, ky, km = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (s.compile_tokens, d), jnp.float32)
    y = jax.random.normal(ky, (s.compile_tokens, d), jnp.float32)
    impls = implementations("nvfp4_quantize") if s.full else (fastest("nvfp4_quantize"),)
    cases = [("unrolled", Stack)] + ([("scanned", Scanned)] if s.full else [])
    what = f"d={d} hidden={hidden}, {s.compile_tokens} tokens"
    for label, cls in cases:
        model = cls(d, hidden, n, km)
        try:
            f32 = compile_seconds(model, x, y)
        except Exception as e:  # noqa: BLE001
            table.error("compile", f"float32, {n} {label} blocks", e)
            continue
        lines = f"{f32['hlo_lines'] / n:.0f} optimised HLO lines per block"
        table.add(
            "compile", f"float32, {n} {label} blocks ({what})", f"{f32['total']:.2f} s", lines
        )
        for impl in impls:
            try:
                with _kernels.use("nvfp4_quantize", impl):
                    qm = nvfp4x.quantize(model, nvfp4x.recipes.nvfp4_training())
                    r = compile_seconds(qm, x, y)
            except Exception as e:  # noqa: BLE001
                table.error("compile", f"nvfp4 ({impl}), {n} {label} blocks", e)
                continue
            note = f"{r['total'] / f32['total']:.2f}x float32, "
            note += f"{r['hlo_lines'] / n:.0f} optimised HLO lines per block"
            table.add(
                "compile",
                f"nvfp4 ({impl}), {n} {label} blocks ({what})",
                f"{r['total']:.2f} s",
                note,
            )


class Chain(eqx.Module):
    layers: list

    def __init__(self, d: int, n: int, key):
        self.layers = [eqx.nn.Linear(d, d, use_bias=False, key=k) for k in jax.random.split(key, n)]

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x).astype(x.dtype)
        return x


def forward_lowering(model, x, impl: str | None) -> Callable[[], Any]:
    """A function lowering the vmapped forward of `model` on `x` with the frozen GEMM
    implementation `impl` (None: the default)."""
    arrays, static = eqx.partition(model, eqx.is_array)
    fn = lambda a, x: jax.vmap(eqx.combine(a, static))(x)
    return lowering(fn, arrays, x, **({"frozen_gemm": impl} if impl else {}))


def frozen(s: Sizes, table: Table, state: dict) -> None:
    model = Chain(s.frozen_d, s.frozen_layers, jax.random.key(3))
    models = {
        "float32": model,
        "bf16": to_bf16(model),
        "W4A16": nvfp4x.freeze(nvfp4x.quantize(model, nvfp4x.recipes.nvfp4_weight_only())),
        "W4A4": nvfp4x.freeze(nvfp4x.quantize(model, nvfp4x.recipes.nvfp4_inference())),
    }
    nbytes = {k: weight_bytes(m) for k, m in models.items()}
    f32, bf16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
    skipped_implementations("frozen_gemm", table, "frozen")
    # (row name, model, activation dtype, frozen GEMM implementation)
    variants = [("float32", "float32", f32, None), ("bf16", "bf16", bf16, None)]
    for impl in implementations("frozen_gemm"):
        for key in ("W4A16", "W4A4"):
            variants += [
                (f"{key} ({impl})", key, f32, impl),
                (f"{key} bf16 activations ({impl})", key, bf16, impl),
            ]
    what = f"{s.frozen_layers} layers {s.frozen_d}x{s.frozen_d}"
    for tokens in s.frozen_tokens:
        x = jax.random.normal(jax.random.key(4), (tokens, s.frozen_d), jnp.float32)
        xs = {f32: x, bf16: x.astype(bf16)}
        lowerings = {
            name: forward_lowering(models[key], xs[dtype], impl)
            for name, key, dtype, impl in variants
        }
        compiled = compile_many(lowerings, table, "frozen", state["jobs"])
        fns = {}
        for name, key, dtype, _ in variants:
            if name in compiled:
                arrays = eqx.filter(models[key], eqx.is_array)
                fns[name] = functools.partial(compiled[name], arrays, xs[dtype])
        t = interleaved(fns, s.repeats, table, "frozen")
        base = t.get("bf16")
        for name, key, _, _ in variants:
            if name not in t:
                continue
            secs = t[name]
            note = f"{nbytes[key] / 1e9:.3f} GB weights read at {nbytes[key] / secs / 1e9:.0f} GB/s"
            if base:
                note = f"{secs / base:.2f}x bf16, " + note
            if (m := memory(compiled[name])) is not None:
                note += f", peak {mib(m['peak'])} (temporaries {mib(m['temp'])})"
            table.add("frozen", f"{name} forward, {tokens} tokens, {what}", ms(secs), note)
        del compiled, fns


@contextlib.contextmanager
def tiled(block: tuple[int, int], dtype, tiling) -> Iterator[None]:
    """`tiling` as the `_pallas_nvfp4.TILINGS` entry of `(block, dtype)` while code is
    traced inside the block."""
    from nvfp4x._kernels import _pallas_nvfp4

    entry = (block, jnp.dtype(dtype).name)
    before = _pallas_nvfp4.TILINGS.get(entry)
    _pallas_nvfp4.TILINGS[entry] = tiling
    try:
        yield
    finally:
        if before is None:
            del _pallas_nvfp4.TILINGS[entry]
        else:
            _pallas_nvfp4.TILINGS[entry] = before


def kernel_sweep(s: Sizes, table: Table, state: dict) -> None:
    """`to_nvfp4` through the Pallas kernel with each candidate tiling: float32 and
    bfloat16, 1x16 and 16x16. Lowered in turn, compiled in parallel threads (XLA and
    Triton compile outside the GIL), timed interleaved per case."""
    from nvfp4x._kernels import _pallas_nvfp4

    bw = _copy_bw(s, state)
    candidates = _pallas_nvfp4.CANDIDATES
    best: dict[tuple[tuple[int, int], str], Any] = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        name = jnp.dtype(dtype).name
        x = jax.random.normal(jax.random.key(5), (s.rows, s.cols), jnp.float32).astype(dtype)
        floor = (x.nbytes + x.size * 4.5 / 8) / bw
        for block in ((1, 16), (16, 16)):
            case = f"to_nvfp4 {block[0]}x{block[1]} {name} {s.rows}x{s.cols}"
            lowered = {}
            for tiling in candidates:
                # A new function per tiling: `jax.jit` reuses the trace of one it has seen.
                fn = pallas_traced(lambda a, block=block: nvfp4x.to_nvfp4(a, block=block))
                try:
                    with tiled(block, dtype, tiling):
                        lowered[tiling] = jax.jit(fn).lower(x)
                except Exception as e:  # noqa: BLE001
                    table.add("kernel_sweep", f"{case}, {tiling}", "**error**", repr(e)[:300])
            compiled = _compile_all(lowered, table, case)
            t = interleaved(
                {k: functools.partial(f, x) for k, f in compiled.items()},
                s.repeats,
                table,
                "kernel_sweep",
            )
            if not t:
                continue
            want = compiled[candidates[0]](x) if candidates[0] in compiled else None
            for tiling, secs in t.items():
                note = f"{secs / floor:.2f}x floor"
                if want is not None:
                    note += f", the default's bits: {same_bits(compiled[tiling](x), want)}"
                table.add("kernel_sweep", f"{case}, {tiling}", ms(secs), note)
            top = min(t, key=t.__getitem__)
            base = t.get(candidates[0])
            vs = f", {t[top] / base:.2f}x the default's time" if base else ""
            table.add(
                "kernel_sweep",
                f"best for {case}",
                str(top),
                f"{ms(t[top])}, {t[top] / floor:.2f}x floor{vs}",
            )
            best[(block, name)] = top
    if best:
        lines = [f"    ({b!r}, {n!r}): {t!r}," for (b, n), t in best.items()]
        text = "TILINGS = {\n" + "\n".join(lines) + "\n}"
        print("kernel_sweep: the best tilings, for `_pallas_nvfp4.TILINGS`:\n" + text)
        table.add("kernel_sweep", "best TILINGS", text.replace("\n", " "))


def _compile_all(lowered: dict, table: Table, case: str) -> dict:
    """`{key: lowered.compile()}` compiled in parallel threads; failures are rows."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        futures = {k: pool.submit(low.compile) for k, low in lowered.items()}
    compiled = {}
    for k, future in futures.items():
        try:
            compiled[k] = future.result()
        except Exception as e:  # noqa: BLE001
            table.add("kernel_sweep", f"{case}, {k}", "**error**", repr(e)[:300])
    return compiled


def frozen_sweep(s: Sizes, table: Table, state: dict) -> None:
    from nvfp4x._kernels import _pallas_gemm

    interpret = jax.default_backend() != "gpu"
    k = s.frozen_d
    few = [t for t in _pallas_gemm.SWEEP_TILES if t.tokens <= 16]
    many = [t for t in _pallas_gemm.SWEEP_TILES if t.tokens > 16]
    for tokens, rows, tiles in ((16, s.sweep_rows, few), (s.frozen_tokens[-1], k, many)):
        w = nvfp4x.to_nvfp4(
            jax.random.normal(jax.random.key(5), (rows, k), jnp.bfloat16), block=(1, 16)
        )
        wb = w.dequantize(jnp.bfloat16)
        x = jax.random.normal(jax.random.key(6), (tokens, k), jnp.bfloat16)
        packed = w.codes.nbytes + w.scale_bits.nbytes
        dot = jax.jit(lambda x, wb: jnp.dot(x, wb.T, preferred_element_type=jnp.float32))
        fns: dict[str, Callable[[], Any]] = {"bf16 x @ w.T": functools.partial(dot, x, wb)}
        for t in tiles:
            kernel = jax.jit(
                functools.partial(
                    _pallas_gemm.frozen_matmul,
                    block=(1, 16),
                    n=rows,
                    operand="bfloat16",
                    tiles=t,
                    interpret=interpret,
                )
            )
            fns[f"tiles {tuple(t)}"] = functools.partial(kernel, x, w.codes, w.scale_bits)
        times = interleaved(fns, s.repeats, table, "frozen_sweep")
        base = times.pop("bf16 x @ w.T", None)
        what = f"{tokens} tokens, weight {rows}x{k}"
        if base:
            note = f"{wb.nbytes / 1e9:.3f} GB"
            table.add("frozen_sweep", f"bf16 x @ w.T, {what}", ms(base), note)
        best = min(times, key=times.__getitem__) if times else None
        for name, secs in times.items():
            note = f"packed {packed / secs / 1e9:.0f} GB/s"
            if base:
                note += f", {secs / base:.2f}x bf16"
            note += " **best**" if name == best else ""
            table.add(
                "frozen_sweep",
                f"{name} (tokens, features, depth, warps, stages), {what}",
                ms(secs),
                note,
            )


def native(s: Sizes, table: Table, state: dict) -> None:
    """The native low-precision GEMMs against their emulation and against bf16."""
    kx, ky, km = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(kx, (s.tokens, s.d), jnp.float32)
    y = jax.random.normal(ky, (s.tokens, s.d), jnp.float32)
    model = Stack(s.d, s.hidden, s.blocks, km)
    fp8_model = nvfp4x.quantize(model, nvfp4x.recipes.fp8())
    cc = _kernels.capability()
    table.add(
        "native",
        "device picks",
        f"capability {cc}",
        ", ".join(f"{op}: {_kernels.pick(op)}" for op in _kernels.IMPLEMENTATIONS),
    )
    variants = {
        "mixed bf16": lambda: model_step(model, x, y, cast=True),
        "fp8 recipe, native FP8 GEMMs": lambda: model_step(
            fp8_model, x, y, picks={"fp8_gemm": "native"}
        ),
        "fp8 recipe, emulated GEMMs": lambda: model_step(
            fp8_model, x, y, picks={"fp8_gemm": "xla"}
        ),
    }
    steps: dict[str, Step] = {}
    for name, make in variants.items():
        try:
            steps[name] = make()
        except Exception as e:  # noqa: BLE001
            table.error("native", name, e)
    t = interleaved(dict(steps), s.repeats, table, "native")
    base, emulated = t.get("mixed bf16"), t.get("fp8 recipe, emulated GEMMs")
    shape = f"{s.blocks} blocks d={s.d} hidden={s.hidden}, {s.tokens} tokens, adam"
    for name, secs in t.items():
        note = f"{secs / base:.2f}x mixed bf16" if base else ""
        if emulated and name != "mixed bf16":
            note += f", {secs / emulated:.2f}x emulated"
        table.add("native", f"{name} step ({shape})", ms(secs), note)

    nvfp4 = nvfp4x.recipes.nvfp4_training()
    scaled = "scaled_matmul" if jax.default_backend() == "gpu" else "lax_scaled_dot"

    def qdot(recipe, **picks):
        return lambda a, b: lowering(lambda a, b: nvfp4x.qdot(a, b, recipe=recipe), a, b, **picks)()

    fns = {
        "nvfp4x qdot nvfp4, emulated GEMM": qdot(nvfp4, block_scaled_gemm="xla"),
        f"nvfp4x qdot nvfp4, {scaled}": qdot(nvfp4, block_scaled_gemm=scaled),
        "nvfp4x qdot fp8, native FP8 GEMM": qdot(nvfp4x.recipes.fp8(), fp8_gemm="native"),
        "nvfp4x qdot fp8, emulated GEMM": qdot(nvfp4x.recipes.fp8(), fp8_gemm="xla"),
    }
    square_gemms(s, table, "native", fns, "{name} forward, {m}^3 bf16 inputs")


# --------------------------------------------------------------------------- profile

PROFILE_TOP = 15
#: Markers of a GEMM in an HLO instruction's line: cuBLAS/cuDNN custom calls and Triton
#: GEMM fusions (GPU).
GEMM_MARKERS = ("__cublas", "__cudnn", "triton_gemm", "cublas", "gemm_fusion")
#: Custom calls that run a hand-written kernel (Pallas: Mosaic on a TPU, Triton on a GPU).
KERNEL_MARKERS = ("tpu_custom_call", "__gpu$xla.gpu.triton", "mosaic", "triton_kernel_call")
DOTS = ("dot", "convolution")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([\w\-]+)\(")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY )?%?([\w.\-]+)\s.*\{\s*$")


def hlo_ops(hlo_text: str) -> dict[str, tuple[str, str]]:
    """`{instruction name: (kind, output shape)}` for the instructions of an optimised
    HLO module's text. Kinds: `gemm` (cuBLAS/cuDNN custom calls, Triton GEMM fusions,
    `dot`, `convolution`, and fusions whose computation holds one: XLA:TPU's convolution
    fusions), `kernel` (Pallas kernels: Mosaic or Triton custom calls), `fusion`, `copy`
    (copies, transposes, bitcasts), `other`."""
    holds_dot: dict[str, bool] = {}  # computation name -> holds a dot or convolution
    computation = None
    for line in hlo_text.splitlines():
        if (m := _COMPUTATION.match(line)) and " = " not in line:
            computation = m.group(1)
            holds_dot.setdefault(computation, False)
        elif (m := _INSTRUCTION.match(line)) and computation and m.group(3) in DOTS:
            holds_dot[computation] = True
    ops = {}
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, shape, opcode = m.groups()
        calls = re.search(r"calls=%?([\w.\-]+)", line)
        if opcode in ("dot", "convolution") or any(g in line for g in GEMM_MARKERS):
            kind = "gemm"
        elif opcode == "custom-call" and any(k in line for k in KERNEL_MARKERS):
            kind = "kernel"
        elif opcode == "fusion":
            kind = "gemm" if calls and holds_dot.get(calls.group(1)) else "fusion"
        elif opcode in ("copy", "transpose", "bitcast", "copy-start", "copy-done"):
            kind = "copy"
        else:
            kind = "other"
        ops[name] = (kind, shape[:60])
    return ops


def op_name(event: str) -> str:
    """The HLO instruction name of a trace event's name: the name itself (GPU traces),
    or the instruction's text, `%fusion.37 = (f32[...]) fusion(...)` (TPU traces)."""
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", event)
    return m.group(1) if m else event


def op_times(trace_dir: str, platform: str) -> dict[str, float]:
    """`{HLO op name: nanoseconds}` summed over the device events of a `jax.profiler`
    trace in `trace_dir` (on a CPU: the host's XLA thunk events). Events are matched to
    ops by their `hlo_op` statistic (or their name); a derived "XLA Ops" line, where the
    trace has one (a TPU's or a GPU's device plane), is used alone (it would count each
    op twice otherwise)."""
    times: dict[str, float] = {}
    for pb in glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True):
        data = ProfileData.from_file(pb)
        for plane in data.planes:
            on_device = plane.name.startswith("/device:")
            if not (on_device or (platform == "cpu" and plane.name == "/host:CPU")):
                continue
            lines = list(plane.lines)
            derived = [ln for ln in lines if ln.name == "XLA Ops"]
            skip = {"XLA Modules", "Steps", "XLA TraceMe", "Launch Stats", "python"}
            for line in derived or [ln for ln in lines if ln.name not in skip]:
                for event in line.events:
                    stats = dict(event.stats)
                    op = stats.get("hlo_op") or (event.name if derived else None)
                    if op:
                        times[str(op)] = times.get(str(op), 0.0) + event.duration_ns
    return times


def perfetto_op_times(trace_dir: str, ops: dict[str, Any]) -> dict[str, float]:
    """`{HLO op name: nanoseconds}` from the Perfetto trace `jax.profiler.trace(...,
    create_perfetto_trace=True)` writes (`perfetto_trace.json.gz`): complete events
    (`"ph": "X"`, microseconds) whose name is an instruction of the program (`ops`), in
    a process named for a device (`/device:...`)."""
    times: dict[str, float] = {}
    for path in glob.glob(f"{trace_dir}/**/*.json.gz", recursive=True):
        with gzip.open(path, "rt") as f:
            data = json.load(f)
        events = data.get("traceEvents", data) if isinstance(data, dict) else data
        devices = {
            e.get("pid")
            for e in events
            if e.get("ph") == "M"
            and e.get("name") == "process_name"
            and str(e.get("args", {}).get("name", "")).startswith("/device:")
        }
        for e in events:
            if e.get("ph") != "X" or (devices and e.get("pid") not in devices):
                continue
            name = str(e.get("args", {}).get("hlo_op") or e.get("name", ""))
            if name in ops:
                times[name] = times.get(name, 0.0) + float(e.get("dur", 0.0)) * 1e3
    return times


def profile(s: Sizes, table: Table, state: dict) -> None:
    steps = {k: v for k, v in (state.get("profile_steps") or {}).items() if v is not None}
    best = fastest("nvfp4_quantize")
    if not steps:  # `train` did not run: compile the two steps here
        x, y, km = _train_data(s)
        model = Stack(s.d, s.hidden, s.blocks, km)
        nv = nvfp4x.quantize(model, nvfp4x.recipes.nvfp4_training())
        picks = {"nvfp4_quantize": best}
        makes = {
            "mixed bf16 step": lambda: model_step(model, x, y, cast=True),
            f"nvfp4 ({best}) step": lambda: model_step(nv, x, y, picks=picks),
            f"nvfp4 in mixed bf16 ({best}) step": lambda: model_step(
                nv, x, y, cast=True, picks=picks
            ),
        }
        for label, make in makes.items():
            try:
                steps[label] = make()
            except Exception as e:  # noqa: BLE001
                table.error("profile", label, e)
    for label, step in steps.items():
        profile_one(label, lambda step=step: (step, step.compiled.as_text()), s, table, state)
    state.pop("profile_steps", None)
    del steps
    # The frozen forward at one token, bfloat16 activations (see the `frozen` section).
    chain = Chain(s.frozen_d, s.frozen_layers, jax.random.key(3))
    x1 = jax.random.normal(jax.random.key(4), (1, s.frozen_d), jnp.bfloat16)
    w4a16 = nvfp4x.freeze(nvfp4x.quantize(chain, nvfp4x.recipes.nvfp4_weight_only()))
    frozen_cases = [("bf16 forward, 1 token", to_bf16(chain), None)]
    frozen_cases += [
        (f"W4A16 ({impl}) forward, 1 token, bf16 activations", w4a16, impl)
        for impl in implementations("frozen_gemm")
    ]
    del chain
    for label, m, impl in frozen_cases:

        def make_frozen(m=m, impl=impl):
            compiled = forward_lowering(m, x1, impl)().compile()
            arrays = eqx.filter(m, eqx.is_array)
            return functools.partial(compiled, arrays, x1), compiled.as_text()

        profile_one(label, make_frozen, s, table, state)


def profile_one(label: str, make: Callable, s: Sizes, table: Table, state: dict) -> None:
    """Rows for one profiled program: `make()` gives `(thunk, optimised HLO text)`."""
    n = max(2, min(s.repeats, 5))
    try:
        thunk, hlo = make()
        ops = hlo_ops(hlo)
        ready(thunk())
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d):
                for _ in range(n):
                    ready(thunk())
            times = op_times(d, jax.default_backend())
        if not times:  # the Perfetto trace instead
            with tempfile.TemporaryDirectory() as d:
                with jax.profiler.trace(d, create_perfetto_trace=True):
                    for _ in range(n):
                        ready(thunk())
                times = perfetto_op_times(d, ops)
    except Exception as e:  # noqa: BLE001 - one failing program must not stop the rest
        table.error("profile", label, e)
        return
    name = re.sub(r"[^\w]+", "_", label).strip("_")
    if state.get("out"):
        with gzip.open(f"{state['out']}.{name}.hlo.txt.gz", "wt") as f:
            f.write(hlo)
    if not times:
        table.add(
            "profile",
            label,
            "**no device events**",
            "neither the xplane nor the Perfetto trace had events of the program's HLO ops",
        )
        return
    total = sum(times.values()) / n
    found = {op: ops.get(op_name(op), ("unmatched", "")) for op in times}  # (kind, shape)
    by_kind: dict[str, float] = {}
    for op, ns in times.items():
        by_kind[found[op][0]] = by_kind.get(found[op][0], 0.0) + ns / n
    ranked = sorted(times.items(), key=lambda kv: -kv[1])
    if state.get("out"):  # every operation's time, for a closer look than the top rows
        with gzip.open(f"{state['out']}.{name}.ops.tsv.gz", "wt") as f:
            for op, ns in ranked:
                f.write(f"{ns / n / 1e6:.4f}\t{found[op][0]}\t{found[op][1]}\t{op}\n")
    note = ", ".join(
        f"{k} {v / 1e6:.2f} ms ({v / total:.0%})"
        for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])
    )
    what = f"{label}: device time per call, {len(times)} ops"
    table.add("profile", what, f"{total / 1e6:.3f} ms", note)
    for op, ns in ranked[:PROFILE_TOP]:
        kind, shape = found[op]
        table.add(
            "profile",
            f"{label}: {op} ({kind}) {shape}",
            f"{ns / n / 1e6:.3f} ms",
            f"{ns / n / total:.1%} of the call",
        )


RUN = {
    "bandwidth": bandwidth,
    "quantize": quantize,
    "gemm": gemm,
    "train": train,
    "compile": compile_times,
    "frozen": frozen,
    "profile": profile,
    "kernel_sweep": kernel_sweep,
    "frozen_sweep": frozen_sweep,
    "native": native,
}


def device_line() -> str:
    d = jax.devices()[0]
    return (
        f"{d.device_kind} ({jax.default_backend()}, {jax.device_count()} device(s)), "
        f"jax {jax.__version__}, Python {platform.python_version()}"
    )


def memory_line() -> str:
    """The device memory in use now and at its peak (where the backend reports it)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_in_use" not in stats:
        return "not reported"
    line = f"{mib(stats['bytes_in_use'])} in use"
    if "peak_bytes_in_use" in stats:
        line += f", peak so far {mib(stats['peak_bytes_in_use'])}"
    if "bytes_limit" in stats:
        line += f" of {mib(stats['bytes_limit'])}"
    return line


def main(argv: list[str] | None = None, prog: str = "bench_accel") -> dict:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--lean",
        action="store_true",
        help="the full sizes, fewer variants, a frozen stack of 8 layers",
    )
    size.add_argument("--quick", action="store_true", help="smaller sizes, fewer variants")
    size.add_argument(
        "--smoke",
        "--cpu-smoke",
        dest="smoke",
        action="store_true",
        help="every section at toy sizes, on any device (the CPU)",
    )
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=None)
    parser.add_argument("--out", default=None, help="also write the Markdown table here")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (median)")
    parser.add_argument(
        "--jobs", type=int, default=4, help="programs compiled at a time where not timed"
    )
    args = parser.parse_args(argv)
    backend = _kernels.backend()
    if backend not in ("gpu", "tpu") and not args.smoke:
        print(f"{prog}: no GPU or TPU at hand (backend {backend}): skipped.")
        return {"skipped": "no accelerator"}
    sizes = SMOKE if args.smoke else QUICK if args.quick else LEAN if args.lean else FULL
    if args.repeats:
        sizes = dataclasses.replace(sizes, repeats=args.repeats)
    sections = args.only
    if sections is None:
        on_gpu = backend == "gpu" or args.smoke
        sections = [k for k in SECTIONS if on_gpu or k not in GPU_SECTIONS]
    mode = "smoke" if args.smoke else "quick" if args.quick else "lean" if args.lean else "full"
    print(f"{prog} ({mode}) on {device_line()}, sizes {sizes}", flush=True)
    table = Table()
    state = {"out": args.out, "jobs": args.jobs, "profile": "profile" in sections}
    table.add("device", "device", device_line())
    start = time.perf_counter()
    for section in sections:
        print(f"== {section}", flush=True)
        t0 = time.perf_counter()
        if section in GPU_SECTIONS and backend not in ("gpu", "cpu"):
            table.add(section, "skipped", f"a GPU section (backend {backend})")
            continue
        try:
            RUN[section](sizes, table, state)
        except Exception as e:  # noqa: BLE001 - one failing section must not stop the rest
            traceback.print_exc()
            table.add(section, "**section failed**", type(e).__name__, str(e)[:300])
        gc.collect()  # the section's arrays and programs, before the next one
        wall = f"{time.perf_counter() - t0:.1f} s"
        table.add(section, "section wall time", wall, f"device memory after: {memory_line()}")
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    total = time.perf_counter() - start
    header = f"## {prog} ({mode}) on {device_line()}, {date}; total {total:.0f} s"
    text = table.markdown(header)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return {"rows": table.rows}


if __name__ == "__main__":
    main()
    sys.exit(0)
