"""GPU benchmark (issues 26 and 27): every figure as a ratio measured in this one process.

```
python benchmarks/bench_gpu.py [--quick | --lean] [--only SECTION ...] [--out PATH] [--repeats N]
python benchmarks/bench_gpu.py --cpu-smoke     # every section at toy sizes, on the CPU
```

Without a GPU it prints a message and exits 0 (unless `--cpu-smoke`). Sections:

- `bandwidth`: plain read (`jnp.max` of an array) and copy (`x + 1`) bandwidth.
- `quantize`: `nvfp4x.to_nvfp4` on an 8192x16384 array, float32 and bfloat16 input, 1x16
  and 16x16 blocks, round to nearest (and 1x16 stochastic), with the reference XLA path
  and the Pallas kernel (`nvfp4x._kernels`; the GPU's default); the GEMM operand path (bfloat16
  block values, what `qdot` feeds its GEMMs) and `fake_quantize`; against the memory
  floor (input bytes read + output bytes written, at the measured copy bandwidth: 4.5
  bits per element for `to_nvfp4`, 2 bytes for the operand path, the input's dtype for
  `fake_quantize`) and against JAX's own nvfp4 quantiser
  (`jax._src.cudnn.scaled_matmul_stablehlo.quantize`) and qwix's where installed.
- `kernel_sweep`: `to_nvfp4` through the Pallas kernel (float32 and bfloat16, 1x16 and
  16x16, 8192x16384) with each tiling of `_pallas_nvfp4.CANDIDATES` (tile shape,
  `num_warps`, `num_stages`), against the floor; the best per case, whether every tiling
  gave the default's bits, and the `TILINGS` table to paste into `_pallas_nvfp4`.
- `gemm`: the 8192^3 GEMM, bfloat16 operands: `jnp.dot` in bfloat16, `nvfp4x.qdot`
  forward (nvfp4_training recipe, default and XLA quantisers),
  `jax.nn.scaled_dot_general` with nvfp4 configs.
- `train`: one jitted adam step of 4 MLP blocks (d=2048, hidden 8192, 8192 tokens,
  layers vmapped over tokens): float32; mixed bf16 (weights and activations cast to
  bfloat16 in the step, float32 master weights); nvfp4x's `bf16`, `fp8`, `mxfp8` and
  `nvfp4_training` recipes (with and without SR and RHT, unrolled and scanned, and with
  the XLA quantisers instead of the default, the Pallas kernel on a GPU), and NVFP4 inside
  the mixed-bf16 step (bfloat16 weights and activations quantised), ratios against
  mixed bf16.
- `compile`: the compile times of those steps (lowering + XLA), NVFP4 against float32.
- `native`: the native low-precision GEMMs (`nvfp4x._kernels`: `fp8_gemm`,
  `block_scaled_gemm`): the `train` section's model stepped with the `fp8` recipe, its
  GEMMs native (FP8 operands: cuBLASLt FP8 GEMMs) and emulated (bfloat16 operands),
  against mixed bf16; the 8192^3 GEMM forward: `jax.nn.scaled_dot_general` nvfp4 next
  to `nvfp4x.qdot` nvfp4 (block-scaled GEMM emulated, and through
  `jax.nn.scaled_matmul`: cuDNN on Blackwell, decomposed by XLA elsewhere; on a CPU
  `jax.lax.scaled_dot`) and `qdot` fp8 (native and emulated).
- `frozen`: a frozen model of 16 layers 8192x8192 (1.07 B weights), W4A16
  (`nvfp4_weight_only`, float32 and bfloat16 activations) and W4A4 (`nvfp4_inference`),
  forward at 1, 16 and 4096 tokens with each implementation of the frozen GEMM
  (`nvfp4x._kernels`' `frozen_gemm`: `xla` decodes the weight then calls a dot,
  `pallas` decodes it inside the GEMM), against bfloat16 and float32, with the weight
  bytes and the GB/s they are read at.
- `profile`: where a training step's time goes. The `train` section's model stepped
  in mixed bf16, with the `nvfp4_training` recipe (float32 and inside mixed bf16) and
  with the `fp8` recipe (emulated and native GEMMs), each traced with
  `jax.profiler` over a few steps: the device time per step summed per HLO operation
  of the compiled program, grouped by kind (GEMMs: cuBLAS/cuDNN calls, Triton GEMM
  fusions, dots and convolutions; the other fusions; copies and the rest), the top
  operations with their kind and output shape; likewise the `frozen` section's bf16 and
  W4A16 forwards at one token (bfloat16 activations, each frozen GEMM implementation).
  With `--out`, each program's optimised HLO is written next to it
  (`<out>.<label>.hlo.txt.gz`) to read what a costly fusion does.
- `frozen_sweep`: the Pallas frozen GEMM kernel alone (`_pallas_gemm.frozen_matmul`,
  bfloat16 activations, 1x16 blocks) with each of its `SWEEP_TILES`, at 16 tokens on a
  32768x8192 weight (packed 151 MB, more than the L2 cache) and at 4096 tokens on an
  8192x8192 one, against a bfloat16 `x @ w.T` of the same shape: the rows to pick
  `DEFAULT_TILES` from (the best is marked).

Each timed function is compiled and run once first (warm-up); the variants of a section
are then called in turn, `--repeats` rounds (interleaved), each call followed by
`block_until_ready`, and the median is reported. A failing row or section prints its
error and the rest go on. The table is printed as Markdown and written to `--out`.
"""

import argparse
import concurrent.futures
import contextlib
import dataclasses
import functools
import glob
import gzip
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
import numpy as np
import optax
from jax.profiler import ProfileData

import nvfp4x
from nvfp4x import _kernels
from nvfp4x._formats import Format, quantize_operand

try:
    from benchmarks.bench_compile import Scanned
    from benchmarks.bench_format import jax_nvfp4_quantizer
    from benchmarks.bench_inference import to_bf16, weight_bytes
    from benchmarks.bench_training import Stack
except ImportError:  # run as a script from inside benchmarks/
    from bench_compile import Scanned
    from bench_format import jax_nvfp4_quantizer
    from bench_inference import to_bf16, weight_bytes
    from bench_training import Stack

SECTIONS = (
    "bandwidth",
    "quantize",
    "kernel_sweep",
    "gemm",
    "train",
    "compile",
    "frozen",
    "frozen_sweep",
    "native",
    "profile",
)
#: Arguments `benchmarks/run_all.py --quick` would pass (it skips without a GPU).
QUICK_ARGV = ["--quick"]


@dataclasses.dataclass(frozen=True)
class Sizes:
    rows: int = 8192  # quantised array: rows x cols
    cols: int = 16384
    gemm: int = 8192  # m = n = k
    d: int = 2048  # training model
    hidden: int = 8192
    tokens: int = 8192
    blocks: int = 4
    frozen_d: int = 8192
    frozen_layers: int = 16
    frozen_tokens: tuple[int, ...] = (1, 16, 4096)
    repeats: int = 5
    full_train: bool = True  # every NVFP4 training variant (else the recipe alone)
    sweep_rows: int = 32768  # frozen_sweep: the weight's rows at few tokens


FULL = Sizes()
QUICK = Sizes(4096, 8192, 4096, 1024, 4096, 4096, 2, 4096, 4, (1, 16, 1024), 3, False, 16384)
SMOKE = Sizes(64, 256, 128, 32, 64, 64, 2, 64, 2, (1, 16, 64), 1, True, 128)


class Table:
    """Rows `(section, what, value, note)`, printed as they come."""

    def __init__(self):
        self.rows: list[tuple[str, str, str, str]] = []

    def add(self, section: str, what: str, value: str, note: str = "") -> None:
        self.rows.append((section, what, value, note))
        print(f"  {what}: {value}  {note}", flush=True)

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
            table.add(section, name, "**error**", f"{type(e).__name__}: {str(e)[:300]}")
    times: dict[str, list[float]] = {name: [] for name in live}
    for _ in range(repeats):
        for name, fn in live.items():
            t0 = time.perf_counter()
            ready(fn())
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def ms(t: float) -> str:
    return f"{t * 1e3:.3f} ms"


def traced_with(fn: Callable, **picks: str) -> Callable:
    """`fn` with the implementations `picks` (`op=implementation`, see
    `nvfp4x._kernels`) picked while it is traced."""

    def wrapped(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            for op, implementation in picks.items():
                stack.enter_context(_kernels.use(op, implementation))
            return fn(*args, **kwargs)

    return wrapped


def pallas_traced(fn: Callable) -> Callable:
    """`fn` with the Pallas quantiser picked while it is traced."""
    return traced_with(fn, nvfp4_quantize="pallas")


def xla_traced(fn: Callable) -> Callable:
    """`fn` with the XLA (reference) quantiser picked while it is traced."""
    return traced_with(fn, nvfp4_quantize="xla")


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
    table.add("bandwidth", "copy (x + 1, float32)", f"{state['copy_bw'] / 1e9:.0f} GB/s")


def _copy_bw(s: Sizes, state: dict) -> float:
    if "copy_bw" not in state:
        bandwidth(s, Table(), state)
    return state["copy_bw"]


def quantize(s: Sizes, table: Table, state: dict) -> None:
    bw = _copy_bw(s, state)
    key = jax.random.key(0)
    fmt = Format("nvfp4", block=(1, 16))
    sr = Format("nvfp4", block=(1, 16), rounding="stochastic")
    jax_q = None
    try:
        jax_q = jax_nvfp4_quantizer()
    except Exception as e:  # noqa: BLE001
        table.add("quantize", "JAX nvfp4 quantiser", "n/a", f"{type(e).__name__}: {e}")
    qwix_q = _qwix_quantizer(table)
    for dtype in (jnp.float32, jnp.bfloat16):
        name = jnp.dtype(dtype).name
        x = jax.random.normal(key, (s.rows, s.cols), jnp.float32).astype(dtype)
        n = x.size
        floor_codes = (x.nbytes + n * 4.5 / 8) / bw
        floor_operand = (x.nbytes + 2 * n) / bw

        def to_nvfp4(block=(1, 16), rounding="nearest"):
            k = key if rounding == "stochastic" else None
            return lambda a: nvfp4x.to_nvfp4(a, block=block, rounding=rounding, key=k)

        operand = lambda x: quantize_operand(x, fmt, -1, None)
        operand_sr = lambda x: quantize_operand(x, sr, 0, key)  # wgrad's dy: tokens, SR
        kinds: dict[str, tuple[Callable, float]] = {
            "to_nvfp4 1x16": (to_nvfp4(), floor_codes),
            "to_nvfp4 1x16 SR": (to_nvfp4(rounding="stochastic"), floor_codes),
            "to_nvfp4 16x16": (to_nvfp4((16, 16)), floor_codes),
            "operand 1x16": (operand, floor_operand),
            "fake_quantize 1x16": (nvfp4x.fake_quantize, 2 * x.nbytes / bw),
            "operand 16x1 SR": (operand_sr, floor_operand),
        }
        cases: dict[str, tuple[Callable, float]] = {}
        for what, (fn, floor) in kinds.items():
            cases[f"{what} xla"] = (xla_traced(fn), floor)
            cases[f"{what} pallas"] = (pallas_traced(fn), floor)
        if jax_q is not None:
            cases["JAX nvfp4 quantiser 1x16"] = (jax_q, None)
        if qwix_q is not None:
            cases["qwix nvfp4 quantiser 1x16"] = (qwix_q, None)
        jitted = {k: jax.jit(fn) for k, (fn, _) in cases.items()}
        same_bits(table, jitted, x, name)
        fns = {k: functools.partial(f, x) for k, f in jitted.items()}
        t = interleaved(fns, s.repeats, table, "quantize")
        base = t.get("JAX nvfp4 quantiser 1x16")
        for k, secs in t.items():
            floor = cases[k][1]
            note = [f"{floor and secs / floor:.2f}x floor" if floor else ""]
            if base and not k.startswith("JAX"):
                note.append(f"{secs / base:.2f}x JAX's")
            table.add("quantize", f"{k}, {name} {s.rows}x{s.cols}", ms(secs), ", ".join(note))


def _bits(a: jax.Array) -> bytes:
    """An array's bytes: equal for the same bits (-0 is not +0; NaNs by payload)."""
    a = np.ascontiguousarray(np.asarray(a))
    return str(a.dtype).encode() + str(a.shape).encode() + a.tobytes()


def same_bits(table: Table, jitted: dict[str, Callable], x: jax.Array, name: str) -> None:
    """Rows saying whether the Pallas kernel gave the reference's bits on this array."""
    for what in (
        "to_nvfp4 1x16",
        "to_nvfp4 1x16 SR",
        "to_nvfp4 16x16",
        "fake_quantize 1x16",
        "operand 1x16",
        "operand 16x1 SR",
    ):
        try:
            a, b = jitted[f"{what} xla"](x), jitted[f"{what} pallas"](x)
            table.add("quantize", f"{what} pallas == xla bit for bit, {name}", str(_same(a, b)))
        except Exception as e:  # noqa: BLE001
            table.add("quantize", f"{what} pallas == xla", "**error**", f"{type(e).__name__}: {e}")


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
                    note += f", the default's bits: {_same(compiled[tiling](x), want)}"
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


def _same(a: Any, b: Any) -> bool:
    leaves = zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    return all(_bits(u) == _bits(v) for u, v in leaves)


def _qwix_quantizer(table: Table) -> Callable | None:
    try:
        import qwix  # noqa: F401  # pyright: ignore[reportMissingImports]
    except ImportError:
        table.add("quantize", "qwix nvfp4 quantiser", "skipped", "qwix is not installed")
        return None
    try:
        from qwix._src.core import qarray  # pyright: ignore[reportMissingImports]

        how = qarray.HowToQuantize(qtype="nvfp4", channelwise_axes=[], tiled_axes={1: 16})
        return lambda x: qarray.quantize(x, how)
    except Exception as e:  # noqa: BLE001 - its private API moves
        table.add("quantize", "qwix nvfp4 quantiser", "skipped", f"{type(e).__name__}: {e}")
        return None


def square_gemms(s: Sizes, table: Table, section: str, fns: dict, label: str) -> None:
    """Time `x @ w.T` on two bf16 `(m, m)` matrices (`m = s.gemm`) by each of `fns`
    (name -> jitted function of `(x, w)`) next to its baselines, bf16 `jnp.dot` and
    `jax.nn.scaled_dot_general` in NVFP4, in TFLOP/s and as a ratio to the bf16 dot;
    rows `label.format(name=..., m=...)` of `section`."""
    m = s.gemm
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (m, m), jnp.bfloat16)
    w = jax.random.normal(kw, (m, m), jnp.bfloat16)
    configs = [jax.nn.get_scaled_dot_general_config("nvfp4")] * 3
    dims = (((1,), (1,)), ((), ()))
    fns = {
        "bf16 dot": jax.jit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32)),
        "jax.nn.scaled_dot_general nvfp4": jax.jit(
            lambda x, w: jax.nn.scaled_dot_general(x, w, dims, configs=configs)
        ),
        **fns,
    }
    t = interleaved(
        {k: functools.partial(f, x, w) for k, f in fns.items()}, s.repeats, table, section
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

    fns = {
        "nvfp4x qdot forward (default quantisers)": jax.jit(qdot),
        "nvfp4x qdot forward (xla quantisers)": jax.jit(xla_traced(qdot)),
    }
    square_gemms(s, table, "gemm", fns, "{name}, {m}^3 bf16 inputs")


class Step:
    """A model's jitted adam step, compiled ahead (the compile time kept), then timed."""

    def __init__(
        self, model, x, y, *, cast: bool = False, impl: str | None = None, picks: dict | None = None
    ):
        arrays, static = eqx.partition(model, eqx.is_array)
        arrays = jax.tree_util.tree_map(jnp.copy, arrays)  # donated: not shared with others
        optimizer = optax.adam(1e-4)

        def loss_fn(model, x, y):
            if cast:  # mixed bf16: bf16 copies of weights and activations in the step
                model, x = to_bf16(model), x.astype(jnp.bfloat16)
            return jnp.mean((jax.vmap(model)(x).astype(jnp.float32) - y) ** 2)

        def step(arrays, opt_state, x, y):
            model = eqx.combine(arrays, static)
            loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
            updates, opt_state = optimizer.update(grads, opt_state, arrays)
            return eqx.filter(eqx.apply_updates(model, updates), eqx.is_array), opt_state, loss

        self.state = (arrays, optimizer.init(arrays))
        self.x, self.y = x, y
        t0 = time.perf_counter()
        picks = ({"nvfp4_quantize": impl} if impl else {}) | (picks or {})
        fn = jax.jit(traced_with(step, **picks), donate_argnums=(0, 1))
        lowered = fn.lower(*self.state, x, y)
        self.compiled = lowered.compile()
        self.compile_s = time.perf_counter() - t0

    def __call__(self):
        arrays, opt_state, loss = self.compiled(*self.state, self.x, self.y)
        self.state = (arrays, opt_state)
        return loss, arrays


def train(s: Sizes, table: Table, state: dict) -> None:
    kx, ky, km = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(kx, (s.tokens, s.d), jnp.float32)
    y = jax.random.normal(ky, (s.tokens, s.d), jnp.float32)
    model = Stack(s.d, s.hidden, s.blocks, km)
    scanned = Scanned(s.d, s.hidden, s.blocks, km)
    R = nvfp4x.recipes
    variants: dict[str, Callable[[], Step]] = {
        "float32": lambda: Step(model, x, y),
        "mixed bf16": lambda: Step(model, x, y, cast=True),
        "bf16 recipe": lambda: Step(nvfp4x.quantize(model, R.bf16()), x, y),
        "fp8 recipe": lambda: Step(nvfp4x.quantize(model, R.fp8()), x, y),
        "mxfp8 recipe": lambda: Step(nvfp4x.quantize(model, R.mxfp8()), x, y),
        "nvfp4": lambda: Step(nvfp4x.quantize(model, R.nvfp4_training()), x, y),
        "nvfp4 (xla quantisers)": lambda: Step(
            nvfp4x.quantize(model, R.nvfp4_training()), x, y, impl="xla"
        ),
        # NVFP4 GEMMs inside a mixed-bf16 step (bf16 weights and activations, float32
        # master), as Transformer Engine and qwix run them: the GEMM outputs, the
        # activations and the quantisers' inputs are bfloat16.
        "nvfp4 in mixed bf16": lambda: Step(
            nvfp4x.quantize(model, R.nvfp4_training()), x, y, cast=True
        ),
    }
    if s.full_train:
        nv = R.nvfp4_training
        variants |= {
            "nvfp4 no SR": lambda: Step(
                nvfp4x.quantize(model, nv(stochastic_rounding=False)), x, y
            ),
            "nvfp4 no RHT": lambda: Step(nvfp4x.quantize(model, nv(rht=False)), x, y),
            "nvfp4 no SR, no RHT": lambda: Step(
                nvfp4x.quantize(model, nv(rht=False, stochastic_rounding=False)), x, y
            ),
            "float32 scanned": lambda: Step(scanned, x, y),
            "nvfp4 scanned": lambda: Step(nvfp4x.quantize(scanned, nv()), x, y),
        }
    steps: dict[str, Step] = {}
    for name, make in variants.items():
        try:
            steps[name] = make()
            print(f"  compiled {name} in {steps[name].compile_s:.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001
            table.add("train", name, "**error**", f"{type(e).__name__}: {str(e)[:300]}")
    state["compile_s"] = {name: st.compile_s for name, st in steps.items()}
    t = interleaved(dict(steps), s.repeats, table, "train")
    base = t.get("mixed bf16")
    shape = f"{s.blocks} blocks d={s.d} hidden={s.hidden}, {s.tokens} tokens, adam"
    for name, secs in t.items():
        note = f"{secs / base:.2f}x mixed bf16" if base else ""
        table.add("train", f"{name} step ({shape})", ms(secs), note)


def compile_times(s: Sizes, table: Table, state: dict) -> None:
    if "compile_s" not in state:
        train(s, Table(), state)
    c = state["compile_s"]
    for name, secs in c.items():
        ref = "float32 scanned" if "scanned" in name else "float32"
        note = f"{secs / c[ref]:.2f}x {ref}" if ref in c else ""
        table.add("compile", f"{name} step: lower + compile", f"{secs:.2f} s", note)


class Chain(eqx.Module):
    layers: list

    def __init__(self, d: int, n: int, key):
        self.layers = [eqx.nn.Linear(d, d, use_bias=False, key=k) for k in jax.random.split(key, n)]

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x).astype(x.dtype)
        return x


def frozen_thunk(impl: str | None, fn: Callable, *args) -> Callable[[], Any]:
    """`fn(*args)` as a thunk, `fn` jitted afresh and traced (run once) with the frozen
    GEMM implementation `impl` (None: the default): later calls reuse that program."""
    # A fresh function per variant: jit caches programs by function, and the pick is not
    # an argument, so two variants sharing `fn` would share the first one's program.
    jitted = eqx.filter_jit(lambda *a: fn(*a))
    if impl is not None:
        with _kernels.use("frozen_gemm", impl):
            ready(jitted(*args))
    return functools.partial(jitted, *args)


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
    # (row name, model, activation dtype, frozen GEMM implementation)
    variants = [("float32", "float32", f32, None), ("bf16", "bf16", bf16, None)]
    for impl in _kernels.IMPLEMENTATIONS["frozen_gemm"]:
        variants += [
            (f"W4A16 ({impl})", "W4A16", f32, impl),
            (f"W4A16 bf16 activations ({impl})", "W4A16", bf16, impl),
            (f"W4A4 ({impl})", "W4A4", f32, impl),
        ]
    forward = lambda m, x: jax.vmap(m)(x)
    what = f"{s.frozen_layers} layers {s.frozen_d}x{s.frozen_d}"
    for tokens in s.frozen_tokens:
        x = jax.random.normal(jax.random.key(4), (tokens, s.frozen_d), jnp.float32)
        fns = {}
        for name, key, dtype, impl in variants:
            try:
                fns[name] = frozen_thunk(impl, forward, models[key], x.astype(dtype))
            except Exception as e:  # noqa: BLE001 - one failing variant must not stop the rest
                table.add("frozen", name, "**error**", f"{type(e).__name__}: {str(e)[:300]}")
        t = interleaved(fns, s.repeats, table, "frozen")
        base = t.get("bf16")
        for name, key, _, _ in variants:
            if name not in t:
                continue
            secs = t[name]
            note = f"{nbytes[key] / 1e9:.3f} GB weights read at {nbytes[key] / secs / 1e9:.0f} GB/s"
            if base:
                note += f", {secs / base:.2f}x bf16"
            table.add("frozen", f"{name} forward, {tokens} tokens, {what}", ms(secs), note)


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
        "mixed bf16": lambda: Step(model, x, y, cast=True),
        "fp8 recipe, native FP8 GEMMs": lambda: Step(fp8_model, x, y, picks={"fp8_gemm": "native"}),
        "fp8 recipe, emulated GEMMs": lambda: Step(fp8_model, x, y, picks={"fp8_gemm": "xla"}),
    }
    steps: dict[str, Step] = {}
    for name, make in variants.items():
        try:
            steps[name] = make()
        except Exception as e:  # noqa: BLE001
            table.add("native", name, "**error**", f"{type(e).__name__}: {str(e)[:300]}")
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
        return jax.jit(traced_with(lambda a, b: nvfp4x.qdot(a, b, recipe=recipe), **picks))

    fns = {
        "nvfp4x qdot nvfp4, emulated GEMM": qdot(nvfp4, block_scaled_gemm="xla"),
        f"nvfp4x qdot nvfp4, {scaled}": qdot(nvfp4, block_scaled_gemm=scaled),
        "nvfp4x qdot fp8, native FP8 GEMM": qdot(nvfp4x.recipes.fp8(), fp8_gemm="native"),
        "nvfp4x qdot fp8, emulated GEMM": qdot(nvfp4x.recipes.fp8(), fp8_gemm="xla"),
    }
    square_gemms(s, table, "native", fns, "{name} forward, {m}^3 bf16 inputs")


# --------------------------------------------------------------------------- profile

#: The steps the `profile` section traces: (label, recipe or None, cast to bf16, picks).
PROFILED = (
    ("mixed bf16", None, True, {}),
    ("nvfp4", "nvfp4_training", False, {}),
    ("nvfp4 in mixed bf16", "nvfp4_training", True, {}),
    ("fp8", "fp8", False, {}),
    ("fp8 native", "fp8", False, {"fp8_gemm": "native"}),
)
PROFILE_TOP = 15


def hlo_ops(hlo_text: str) -> dict[str, tuple[str, str]]:
    """`{instruction name: (kind, output shape)}` for the instructions of an optimised
    HLO module's text. Kinds: `gemm` (cuBLAS/cuDNN custom calls, Triton GEMM fusions,
    `dot`, `convolution`), `fusion`, `copy` (copies, transposes, bitcasts), `other`."""
    ops = {}
    pattern = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([\w\-]+)\(")
    for line in hlo_text.splitlines():
        m = pattern.match(line)
        if not m:
            continue
        name, shape, opcode = m.groups()
        gemm_markers = ("__cublas", "__cudnn", "triton_gemm", "cublas", "gemm_fusion")
        if opcode in ("dot", "convolution") or any(g in line for g in gemm_markers):
            kind = "gemm"
        elif opcode == "fusion":
            kind = "fusion"
        elif opcode in ("copy", "transpose", "bitcast", "copy-start", "copy-done"):
            kind = "copy"
        else:
            kind = "other"
        ops[name] = (kind, shape[:60])
    return ops


def op_times(trace_dir: str, platform: str) -> dict[str, float]:
    """`{HLO op name: nanoseconds}` summed over the device events of a `jax.profiler`
    trace in `trace_dir` (on a CPU: the host's XLA thunk events). Events are matched to
    ops by their `hlo_op` statistic (or their name); a derived "XLA Ops" line, where the
    trace has one, is used alone (it would count each op twice otherwise)."""
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


def profile(s: Sizes, table: Table, state: dict) -> None:
    kx, ky, km = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(kx, (s.tokens, s.d), jnp.float32)
    y = jax.random.normal(ky, (s.tokens, s.d), jnp.float32)
    model = Stack(s.d, s.hidden, s.blocks, km)
    for label, recipe, cast, picks in PROFILED:

        def make(recipe=recipe, cast=cast, picks=picks):
            r = nvfp4x.recipes
            m = model if recipe is None else nvfp4x.quantize(model, getattr(r, recipe)())
            step = Step(m, x, y, cast=cast, picks=picks)
            return step, step.compiled.as_text()

        profile_one(f"{label} step", make, s, table, state)
    # The frozen forward at one token, bfloat16 activations (see the `frozen` section).
    chain = Chain(s.frozen_d, s.frozen_layers, jax.random.key(3))
    x1 = jax.random.normal(jax.random.key(4), (1, s.frozen_d), jnp.bfloat16)
    w4a16 = nvfp4x.freeze(nvfp4x.quantize(chain, nvfp4x.recipes.nvfp4_weight_only()))
    frozen_cases = [("bf16 forward, 1 token", to_bf16(chain), "xla")]
    frozen_cases += [
        (f"W4A16 ({impl}) forward, 1 token, bf16 activations", w4a16, impl)
        for impl in _kernels.IMPLEMENTATIONS["frozen_gemm"]
    ]
    for label, m, impl in frozen_cases:

        def make_frozen(m=m, impl=impl):
            arrays, static = eqx.partition(m, eqx.is_array)
            fn = jax.jit(lambda a, x: jax.vmap(eqx.combine(a, static))(x))
            with _kernels.use("frozen_gemm", impl):
                compiled = fn.lower(arrays, x1).compile()
            return functools.partial(compiled, arrays, x1), compiled.as_text()

        profile_one(label, make_frozen, s, table, state)


def profile_one(label: str, make: Callable, s: Sizes, table: Table, state: dict) -> None:
    """Rows for one profiled program: `make()` gives `(thunk, optimised HLO text)`."""
    n = max(2, min(s.repeats, 5))
    try:
        thunk, hlo = make()
        ready(thunk())
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d):
                for _ in range(n):
                    ready(thunk())
            times = op_times(d, jax.default_backend())
    except Exception as e:  # noqa: BLE001 - one failing program must not stop the rest
        table.add("profile", label, "**error**", f"{type(e).__name__}: {str(e)[:300]}")
        return
    if state.get("out"):
        name = re.sub(r"[^\w]+", "_", label).strip("_")
        with gzip.open(f"{state['out']}.{name}.hlo.txt.gz", "wt") as f:
            f.write(hlo)
    ops = hlo_ops(hlo)
    if not times:
        table.add("profile", label, "**no device events**", "the trace had no HLO ops")
        return
    total = sum(times.values()) / n
    by_kind: dict[str, float] = {}
    for op, ns in times.items():
        kind = ops.get(op, ("unmatched", ""))[0]
        by_kind[kind] = by_kind.get(kind, 0.0) + ns / n
    note = ", ".join(
        f"{k} {v / 1e6:.2f} ms ({v / total:.0%})"
        for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])
    )
    what = f"{label}: device time per call, {len(times)} ops"
    table.add("profile", what, f"{total / 1e6:.3f} ms", note)
    for op, ns in sorted(times.items(), key=lambda kv: -kv[1])[:PROFILE_TOP]:
        kind, shape = ops.get(op, ("unmatched", ""))
        table.add(
            "profile",
            f"{label}: {op} ({kind}) {shape}",
            f"{ns / n / 1e6:.3f} ms",
            f"{ns / n / total:.1%} of the call",
        )


RUN = {
    "bandwidth": bandwidth,
    "quantize": quantize,
    "kernel_sweep": kernel_sweep,
    "gemm": gemm,
    "train": train,
    "compile": compile_times,
    "frozen": frozen,
    "native": native,
    "frozen_sweep": frozen_sweep,
    "profile": profile,
}


def device_line() -> str:
    d = jax.devices()[0]
    return (
        f"{d.device_kind} ({jax.default_backend()}, {jax.device_count()} device(s)), "
        f"jax {jax.__version__}, Python {platform.python_version()}"
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer variants")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="every section at toy sizes, on any device"
    )
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--out", default=None, help="also write the Markdown table here")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (median)")
    parser.add_argument(
        "--lean",
        action="store_true",
        help="full sizes, but the train section without the SR/RHT/scanned variants",
    )
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu" and not args.cpu_smoke:
        print(f"bench_gpu: no GPU at hand (backend {jax.default_backend()}): skipped.")
        return {"skipped": "no GPU"}
    sizes = SMOKE if args.cpu_smoke else QUICK if args.quick else FULL
    if args.repeats:
        sizes = dataclasses.replace(sizes, repeats=args.repeats)
    if args.lean:
        sizes = dataclasses.replace(sizes, full_train=False)
    print(f"bench_gpu on {device_line()}, sizes {sizes}", flush=True)
    table, state = Table(), {"out": args.out}
    table.add("device", "device", device_line())
    start = time.perf_counter()
    for section in args.only:
        print(f"== {section}", flush=True)
        t0 = time.perf_counter()
        try:
            RUN[section](sizes, table, state)
        except Exception as e:  # noqa: BLE001 - one failing section must not stop the rest
            traceback.print_exc()
            table.add(section, "**section failed**", type(e).__name__, str(e)[:300])
        table.add(section, "section wall time", f"{time.perf_counter() - t0:.1f} s")
    mode = "cpu smoke" if args.cpu_smoke else "quick" if args.quick else "full"
    header = f"## bench_gpu ({mode}) on {device_line()}; total {time.perf_counter() - start:.0f} s"
    text = table.markdown(header)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return {"rows": table.rows}


if __name__ == "__main__":
    main()
    sys.exit(0)
