"""Compile time of a jitted adam training step, NVFP4 vs float32, against depth, and of
the main example's training step.

```
python benchmarks/bench_compile.py [--depths 2 4 8 16] [--scan 16] [--example default] [--separate]
```

The model is a residual MLP stack (`benchmarks/bench_training.py`'s `Block`, `d=128`,
hidden `512`, `256` tokens, layers called per token through `jax.vmap`), at each depth
unrolled and, for `--scan` blocks, as one block `eqx.filter_vmap`-stacked and run under
`jax.lax.scan`. Each step (adam, `eqx.filter_value_and_grad`) is compiled for the float32
model and for `nvfp4x.quantize(model, nvfp4x.recipes.nvfp4_training())`, each time from
a fresh function, so that no cache hides work: `jax.jit(step).lower(*args)` (tracing and
lowering to StableHLO) and `.compile()` (XLA's passes and code generation) are timed
separately. Reported per depth: both times, their sum, the NVFP4 / float32 ratio of the
sum (issue 37's target on the CPU: <= 3x at 8 unrolled blocks and for the main example;
<= 1.5x on a TPU), the same ratio in process CPU seconds (steadier when other work shares
the machine) and the optimised HLO's line count per block
(`compiled.as_text()`), which is what XLA's passes work through, with the NVFP4 step's
instructions per block split by where they come from (`hlo_regions`: the fprop, dgrad
and wgrad primitives, each with its operand quantisers, and the rest).

`--separate` (a diagnostic, not a way to run nvfp4x) lowers every nvfp4x GEMM primitive
on the CPU as a host callback into a program of its own, compiled once per distinct
problem (its shapes and parameters, the layer's name aside) when the step is lowered, and
counted in the step's lowering time: how much of the compile is the same quantisers
compiled again for every layer, and how much is their programs' size. It reaches into
JAX's internals (`jax._src.callback.emit_python_callback`, the CPU lowering table), as a
measurement may; the library does not.

`--example default` (or `smoke`) also compiles the main example's training step
(`examples/nvfp4_lm`: its transformer, loss and AdamW, the `default` or `smoke` config),
float32 against the NVFP4 model under the example's precision policy (`paper_policy`).
"""

import argparse
import collections
import contextlib
import pathlib
import re
import sys
import time
from collections.abc import Iterator

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import nvfp4x

try:
    from benchmarks.bench_training import Block, Stack as Unrolled
except ImportError:  # run as a script from inside benchmarks/
    from bench_training import Block, Stack as Unrolled

#: Arguments `benchmarks/run_all.py --quick` passes: small, to check that it runs.
QUICK_ARGV = ["--depths", "2", "4", "--scan", "4", "--example", "smoke"]


class Scanned(eqx.Module):
    blocks: Block  # every array field stacked along a leading depth axis

    def __init__(self, d: int, hidden: int, depth: int, key):
        make = eqx.filter_vmap(lambda k: Block(d, hidden, k))
        self.blocks = make(jax.random.split(key, depth))

    def __call__(self, x):
        arrays, static = eqx.partition(self.blocks, eqx.is_array)

        def body(x, layer):
            return eqx.combine(layer, static)(x), None

        return jax.lax.scan(body, x, arrays)[0]


def mse(model, x, y):
    """The loss of the residual MLP stacks: mean squared error, the model vmapped."""
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def make_step(optimizer, static, loss_fn=mse):
    """A fresh step function (a new identity each call: no jit cache is shared) over the
    model's arrays, its static part closed over."""

    def step(arrays, state, x, y):
        model = eqx.combine(arrays, static)
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, state = optimizer.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.filter(eqx.apply_updates(model, updates), eqx.is_array), state, loss

    return step


#: The regions of a step's program, by the jitted function its instructions came from
#: (the quantised GEMMs' primitives run `fprop`, `dgrad` and `wgrad`, each quantising
#: its operands); the rest (the weight's quantisation, the plain ops, adam) is `other`.
REGIONS = {"jit(_fprop_operands)": "fprop", "jit(dgrad)": "dgrad", "jit(wgrad)": "wgrad"}


def hlo_regions(text: str) -> dict[str, int]:
    """Instructions (not parameters or constants) of an optimised HLO text per region
    (`REGIONS`, by each instruction's `op_name`): where the program's size comes from."""
    counts = collections.Counter({name: 0 for name in (*REGIONS.values(), "other")})
    for line in text.splitlines():
        m = re.search(r'op_name="([^"]*)"', line)
        if m is None or " parameter(" in line or " constant(" in line:
            continue
        parts = m.group(1).split("/")
        counts[next((REGIONS[p] for p in parts if p in REGIONS), "other")] += 1
    return dict(counts)


def entry_ops(hlo: str) -> int:
    """The operations an optimised HLO text's entry computation runs (each fusion, custom
    call, dot, `conditional`, `while`...; not its parameters, constants, tuples,
    `get-tuple-element`s and bitcasts): on an accelerator, about its kernel launches."""
    entry = hlo[hlo.index("ENTRY") :] if "ENTRY" in hlo else ""
    skip = ("parameter", "constant", "tuple", "get-tuple-element", "bitcast")
    ops = re.findall(r"^\s*(?:ROOT )?%?\S+ = \S+ ([\w-]+)\(", entry, re.M)
    return sum(op not in skip for op in ops)


def memory(compiled) -> dict[str, int] | None:
    """`{"temp", "peak"}` bytes of a compiled program (`memory_analysis()`): its
    temporaries, and arguments + temporaries + outputs less what outputs alias; None
    where the backend does not report them."""
    try:
        m = compiled.memory_analysis()
        temp = int(m.temp_size_in_bytes)
        args, out = int(m.argument_size_in_bytes), int(m.output_size_in_bytes)
        return {"temp": temp, "peak": args + temp + out - int(m.alias_size_in_bytes)}
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None


#: How a Mosaic kernel's call reads in an optimised HLO text (on a TPU).
MOSAIC = 'custom_call_target="tpu_custom_call"'


@contextlib.contextmanager
def set_to(module, name: str, value) -> Iterator[None]:
    """`module.name` set to `value` inside the block (JAX's caches cleared on the way in
    and out, so that no trace crosses the change): the benchmarks' step variants."""
    original = getattr(module, name)
    setattr(module, name, value)
    jax.clear_caches()
    try:
        yield
    finally:
        setattr(module, name, original)
        jax.clear_caches()


def input_fusion() -> contextlib.AbstractContextManager:
    """The TPU kernels with `_batching.INPUT_FUSION` on inside the block (the same values)."""
    from nvfp4x._kernels import _batching

    return set_to(_batching, "INPUT_FUSION", True)


def operand_kernel_for(block: tuple[int, int]) -> contextlib.AbstractContextManager:
    """The GEMM operands of `block`s by `_tpu_operand`'s kernel too inside the block
    (`_tpu_quantize.OPERAND_KERNEL_BLOCKS`; the same bits)."""
    from nvfp4x._kernels import _tpu_quantize

    blocks = tuple(dict.fromkeys((*_tpu_quantize.OPERAND_KERNEL_BLOCKS, block)))
    return set_to(_tpu_quantize, "OPERAND_KERNEL_BLOCKS", blocks)


def operand_kernel_across() -> contextlib.AbstractContextManager:
    """The 1x16 GEMM operands (fprop's x, dgrad's dy) by the operand kernel
    (`operand_kernel_for`): a smaller kernel for Mosaic to compile at each call site than
    the tiled quantiser's."""
    return operand_kernel_for((1, 16))


def operand_kernel_tiles() -> contextlib.AbstractContextManager:
    """The 16x16 GEMM operands (the weights') by the operand kernel (`operand_kernel_for`)."""
    return operand_kernel_for((16, 16))


@contextlib.contextmanager
def tilings_with(blocks=None, **changes) -> Iterator[None]:
    """The TPU quantiser's `TILINGS` with `changes` to each entry of `blocks` (all by
    default) inside the block, made from the table as it is on entry (so that these
    nest): `Tiling.branch_once`, `Tiling.unroll` (the same bits)."""
    from nvfp4x._kernels import _tpu_quantize

    tilings = {
        k: t._replace(**changes) if blocks is None or k[0] in blocks else t
        for k, t in _tpu_quantize.TILINGS.items()
    }
    with set_to(_tpu_quantize, "TILINGS", tilings):
        yield


@contextlib.contextmanager
def branched_once(unroll_1x16: int = 1) -> Iterator[None]:
    """The tensor's tininess branched on once a tile by both TPU quantisers
    (`_tpu_quantize.BRANCH_ONCE`), and the 1x16 tilings' chunk loops unrolled by
    `unroll_1x16` (on a TPU v5e, 2026-12-08, unrolling slowed 16x16 blocks)."""
    from nvfp4x._kernels import _tpu_quantize

    with (
        set_to(_tpu_quantize, "BRANCH_ONCE", True),
        tilings_with(blocks=((1, 16),), unroll=unroll_1x16),
    ):
        yield


def compile_seconds(model, x, y, *, optimizer=None, loss_fn=mse, text: bool = False) -> dict:
    """`{"lower": s, "compile": s, "total": s, "cpu": s, "hlo_lines": n, "regions": {...}}`
    for one fresh step (`optimizer`: adam by default): wall seconds, the process's CPU
    seconds for the whole (steadier than wall time on a shared machine), the optimised
    HLO's lines and its instructions per region (`hlo_regions`); with `text`, also
    `"lowered"`, the step's StableHLO text, `"mosaic_calls"`, the Mosaic kernel calls
    in the optimised HLO (on a TPU), `"temp_bytes"`, its temporaries
    (`memory_analysis()`; None where the backend does not report them), and
    `"entry_ops"`, the operations its entry computation runs (`entry_ops`)."""
    optimizer = optax.adam(1e-4) if optimizer is None else optimizer
    arrays, static = eqx.partition(model, eqx.is_array)
    state = optimizer.init(arrays)
    step = make_step(optimizer, static, loss_fn)
    c0, t0 = time.process_time(), time.perf_counter()
    lowered = jax.jit(step).lower(arrays, state, x, y)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2, c2 = time.perf_counter(), time.process_time()
    hlo = compiled.as_text()
    return {
        **(
            {
                "lowered": lowered.as_text(),
                "mosaic_calls": hlo.count(MOSAIC),
                "temp_bytes": None if (m := memory(compiled)) is None else m["temp"],
                "entry_ops": entry_ops(hlo),
            }
            if text
            else {}
        ),
        "lower": t1 - t0,
        "compile": t2 - t1,
        "total": t2 - t0,
        "cpu": c2 - c0,
        "hlo_lines": hlo.count("\n"),
        "regions": hlo_regions(hlo),
    }


def example_seconds(config: str) -> dict:
    """The main example's training step (`examples/nvfp4_lm`, config `"default"` or
    `"smoke"`) compiled for the float32 model and for the NVFP4 one under the example's
    policy: `{"float32": compile_seconds, "nvfp4": compile_seconds}`."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
    import nvfp4_lm as lm

    cfg = lm.SMOKE if config == "smoke" else lm.Config()
    model = lm.build_model(cfg, jax.random.key(cfg.seed))
    tokens = jnp.zeros((cfg.batch, cfg.seq), jnp.int32)
    out = {}
    for label, m in (("float32", model), ("nvfp4", nvfp4x.quantize(model, lm.paper_policy(cfg)))):
        optimizer = lm.make_optimizer(cfg)
        out[label] = compile_seconds(m, tokens, tokens, optimizer=optimizer, loss_fn=lm.loss_fn)
    return out


@contextlib.contextmanager
def separate_programs() -> Iterator[dict]:
    """Inside the block, every nvfp4x primitive lowers on the CPU as a host callback into a
    program of its own, compiled (`jax.jit(impl).lower(...).compile()`) the first time its
    problem is lowered and shared by every later call site of the same problem
    (`--separate`). Yields the programs compiled so far, by problem (the caller clears
    it before each measured step, so that no step loads another's); the primitives'
    own lowerings are back after the block."""
    import numpy as np
    from jax._src import callback
    from jax._src.interpreters import mlir

    from nvfp4x import _prims

    programs = {}

    def lowering(prim):
        def lower(ctx, *args, **params):
            shared = {k: v for k, v in params.items() if k != "name"}
            key = (prim, tuple(sorted(shared.items())), tuple(ctx.avals_in))
            if key not in programs:
                avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in ctx.avals_in]
                fn = jax.jit(lambda *a: prim.impl(*a, **params))
                programs[key] = fn.lower(*avals).compile()
            program = programs[key]
            out, _, _ = callback.emit_python_callback(
                ctx,
                lambda *a: (np.asarray(program(*a)),),
                None,
                list(args),
                ctx.avals_in,
                ctx.avals_out,
                has_side_effect=False,
                returns_token=False,
            )
            return out

        return lower

    cpu = mlir._platform_specific_lowerings["cpu"]
    # nvfp4x's primitives, as JAX's lowering table holds them (`_prims.primitive`
    # registers each one's lowering there)
    prims = [p for p in mlir._lowerings if isinstance(p, _prims._Primitive)]
    before = {prim: cpu.get(prim) for prim in prims}
    for prim in prims:
        mlir.register_lowering(prim, lowering(prim), platform="cpu")
    try:
        yield programs
    finally:
        for prim, entry in before.items():
            if entry is None:
                cpu.pop(prim, None)
            else:
                cpu[prim] = entry


def main(argv: list[str] | None = None) -> dict:
    with contextlib.ExitStack() as stack:
        return _main(stack, argv)


def _main(stack: contextlib.ExitStack, argv: list[str] | None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--scan", type=int, default=16, help="depth of the scanned stack")
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument(
        "--example",
        choices=["default", "smoke", "none"],
        default="default",
        help="also the main example's training step, in this config",
    )
    parser.add_argument(
        "--separate",
        action="store_true",
        help="diagnostic (CPU): each distinct nvfp4x GEMM problem compiled once, as a "
        "program of its own called back from the step (see the module docstring)",
    )
    args = parser.parse_args(argv)
    programs = {}
    if args.separate:
        if jax.devices()[0].platform != "cpu":
            parser.error("--separate is a CPU diagnostic (host callbacks into CPU programs)")
        programs = stack.enter_context(separate_programs())

    kx, ky, km = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (args.tokens, args.d), jnp.float32)
    y = jax.random.normal(ky, (args.tokens, args.d), jnp.float32)
    recipe = nvfp4x.recipes.nvfp4_training()
    cases = [(f"unrolled {n}", Unrolled, n) for n in args.depths]
    if args.scan:
        cases.append((f"scan {args.scan}", Scanned, args.scan))
    print(
        f"d={args.d}, hidden={args.hidden}, tokens={args.tokens}, adam step, "
        f"{jax.devices()[0].platform}; seconds to lower / compile (XLA) / total"
        + (
            "; --separate: each distinct GEMM problem one program of its own, its compile "
            "in the lowering"
            if args.separate
            else ""
        )
    )
    # One-time costs of the first NVFP4 trace in a process (imports, registrations), on
    # other shapes than those measured, so that they do not land on the first row.
    small = Unrolled(32, 64, 1, km)
    xs, ys = x[:32, :32], y[:32, :32]
    compile_seconds(small, xs, ys)
    compile_seconds(nvfp4x.quantize(small, recipe), xs, ys)
    result = {}
    for label, cls, depth in cases:
        model = cls(args.d, args.hidden, depth, km)
        f32 = compile_seconds(model, x, y)
        programs.clear()
        q = compile_seconds(nvfp4x.quantize(model, recipe), x, y)
        ratio = q["total"] / f32["total"]
        result[label] = {
            **_ratios(f32, q),
            "hlo lines per block float32": f32["hlo_lines"] / depth,
            "hlo lines per block nvfp4": q["hlo_lines"] / depth,
            "nvfp4 hlo instructions per block": {k: v / depth for k, v in q["regions"].items()},
        }
        print(
            f"{label:12s} float32 {f32['lower']:5.2f} / {f32['compile']:5.2f} / "
            f"{f32['total']:5.2f}   nvfp4 {q['lower']:5.2f} / {q['compile']:5.2f} / "
            f"{q['total']:5.2f}   {ratio:4.2f}x (CPU {q['cpu'] / f32['cpu']:4.2f}x)   "
            "HLO lines/block "
            f"{f32['hlo_lines'] / depth:.0f} vs {q['hlo_lines'] / depth:.0f}"
        )
        regions = ", ".join(f"{k} {v / depth:.0f}" for k, v in q["regions"].items())
        print(f"{'':12s} nvfp4 HLO instructions per block: {regions}")
    if args.example != "none":
        programs.clear()
        ex = example_seconds(args.example)
        f32, q = ex["float32"], ex["nvfp4"]
        label = f"main example ({args.example})"
        result[label] = {
            **_ratios(f32, q),
            "hlo lines float32": f32["hlo_lines"],
            "hlo lines nvfp4": q["hlo_lines"],
        }
        print(
            f"{label}: float32 {f32['lower']:5.2f} / {f32['compile']:5.2f} / {f32['total']:5.2f}"
            f"   nvfp4 {q['lower']:5.2f} / {q['compile']:5.2f} / {q['total']:5.2f}   "
            f"{q['total'] / f32['total']:4.2f}x (CPU {q['cpu'] / f32['cpu']:4.2f}x)   "
            f"HLO lines {f32['hlo_lines']} vs {q['hlo_lines']}"
        )
    worst = max(r["ratio"] for r in result.values())
    result["worst ratio"] = worst
    print(f"target <= 3x on the CPU: {'met' if worst <= 3 else 'NOT met'} (worst {worst:.2f}x)")
    return result


def _ratios(f32: dict, q: dict) -> dict:
    """A result row's times and ratios, NVFP4 (`q`) against float32 (`f32`)."""
    return {
        "float32 s": f32["total"],
        "nvfp4 s": q["total"],
        "ratio cpu": q["cpu"] / f32["cpu"],
        "nvfp4 lower s": q["lower"],
        "nvfp4 xla s": q["compile"],
        "ratio": q["total"] / f32["total"],
    }


if __name__ == "__main__":
    main()
