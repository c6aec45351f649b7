"""A quantised convolution's training step (forward and backward) against the float one.

For each layer, `jax.value_and_grad` of a mean-square loss over a batch of images, with
respect to the layer and the input (fprop, dgrad and wgrad), jitted; the NVFP4 layer
(`nvfp4_training()` under `Policy(..., convolutions=True)`) against the same float32
layer, timed interleaved in one process (median of `--repeats` rounds). Target: a
ratio of at most 2 (a quantised convolution is a GEMM plus its quantisers, as a linear
layer is).

    python -m benchmarks.bench_conv [--quick] [--repeats 15] [--only "medium: Conv2d"]
        [--gathered-wgrad]

`--gathered-wgrad`: also each layer's step with the wgrad that pairs shifted copies of
`dy` with the input quantised once per last-axis tap off (`_conv.shifts_rows`: stride 1
along the leading axes, output rows of whole 16-token chunks; the patch operand gathered
from its distinct chunks instead), against the same step with it on, both compiled
ahead of time with JAX's caches cleared before each (else the second compilation reuses
the first's traces: the same program twice) and timed interleaved with the others,
without `filter_jit`'s dispatch (where that path does not apply, the same program).

Issue 34 item 7 (small, medium and large layers; same loaded 2-core CPU, `--repeats
9`): small `Conv2d` 3->16 3x3 on 28x28 1.96x, small `ConvTranspose2d` 16->3 k4 s4 on
8x8 4.09x, medium `Conv2d` 32->32 3x3 on 16x16 2.39x, then the large cases below at
1.18x, 1.77x, 0.39x. The small and medium layers are over the target. Where their time
goes (ratios to the float32 layer, same process): the tiny `ConvTranspose2d` is 4.3x
with the training recipe, 3.0x without the wgrad's Hadamard transform, 3.1x without it
and without stochastic rounding, 1.3x with the `bf16` or `float32` recipe (the GEMM
lowering alone); the medium `Conv2d` 2.2x, 1.9x, 1.9x, 1.8x (bf16), 1.55x (float32):
fixed costs of the quantisers and the Hadamard transform on few tokens, and the
patch-GEMM lowering where the input channels (32) do not take the fast path.
After the wgrad's Hadamard transform skipped its range scalings in the common case
(`--repeats 7`, one process, noisy machine): small `Conv2d` 1.56x (2.05x before, same
day), small `ConvTranspose2d` 3.64x (4.10x), medium 1.71x (1.63x), large 1.14x, 1.13x,
0.58x.

Taps that read the same chunks sharing one wgrad operand (`WgradPlan.taps`: a
transposed convolution whose kernel is its stride), with the other small layers real
models use added (same command, same busy machine, `5cf6816` then this, one process
each, load average 4-6 from other jobs, so +-30% between runs of one case): small
`ConvTranspose2d` k4 s4 2.68x -> 1.92x (a second run after: 2.29x; the layer alone, 60
interleaved rounds: 2.3-2.6x -> 1.67x), k2 s2 2.20x -> 2.00x (2.06x) (the two that
group; every other row runs the code it ran before, the large `Conv2d` at 2.65x and
2.94x in these runs against 1.14x on a quieter day). Over the target in this run: the small `Conv2d`
3->16 (2.4x; 1.6-4.3x across runs: 3 input channels take the patch GEMM), the
`Conv1d` and `ConvTranspose1d` on 256-512 tokens (2.1-2.4x: 171 XLA kernels a step
against the float layer's 35, ~550 us against ~115 us in a trace; fixed costs of five
quantisers, two Hadamard transforms and their reductions), and the medium `Conv2d`
(2.7-4.1x: wgrad's dense operand is a gather of the quantised distinct chunks, and
XLA:CPU fuses the quantiser into the gather, computing it once for each of the three
taps that read a chunk: about 1.4 of 3 ms in a trace; `lax.optimization_barrier` does
not stop it, XLA:CPU expands the barrier before fusing).

Issue 34 item 7, the quantiser's fixed costs (main `64ea818` then this branch, same
session, one process each, `--repeats 7`, 2-core CPU at load 0.5-1.5): small `Conv2d`
2.63x -> 1.80x, `ConvTranspose2d` k4 s4 2.42x -> 2.13x, k2 s2 1.62x -> 1.76x, k4 s2 p1
1.42x -> 1.18x, `Conv1d` 2.39x -> 2.02x, depthwise `Conv1d` 0.96x -> 1.06x,
`ConvTranspose1d` s2 2.00x -> 1.84x, s4 2.48x -> 2.01x, medium grouped 0.44x -> 0.33x,
medium `Conv2d` 2.91x -> 2.23x, large 2.00x -> 1.61x, 0.64x -> 0.59x, 0.41x -> 0.39x
(the float32 times moved by up to 50% between the two runs). Both programs compiled
in one process and timed interleaved (40 rounds, medians, executables without
`filter_jit`'s dispatch, so harsher ratios): small `Conv2d` 2.21x -> 1.91x, medium
2.92x -> 2.35x, large 1.94x -> 1.73x, `Conv1d` 2.60x -> 2.49x; the small transposed
and 1-D layers unchanged within the noise (+-10%). What changed: block scales of
grids with 1-2 blocks per token computed with that axis first (XLA:CPU vectorised them
2 wide: 351 us of the small `Conv2d`'s step), one int32 tensor-amax reduction instead
of two float ones (4 kernels fewer per quantisation), and wgrad's quantised chunks
materialised before the gather that reads each 3 times (medium `Conv2d`: 1.45 ms ->
0.35 ms in a single-threaded trace). Still over 2x: the small fast-path layers, whose
step is the quantisers' element loops (dy's transposed reads in dgrad, SR's hash) and
the two RHTs (a `cond` each), about 250 us against the float layer's 120 us.

The RHT as the fast Walsh-Hadamard transform's butterflies (2026-12-06; two full runs
at `--repeats 21` in `docs/benchmarks.md`): every layer 0.25-2.00x but the medium
`Conv2d` at 2.13-2.14x in full runs, 1.74-1.95x alone (`--only "medium: Conv2d"
--repeats 61`). Where that layer's remaining ~1.1 ms goes (same machine): 69 XLA
operations a step against the float layer's 15, whose device times add up to ~1.3x the
float layer's in a profile (the patch operand's gather 0.47 ms, the wgrad GEMM 0.31 ms
against the float wgrad convolution's 0.87 ms, each quantiser's reductions and element
loops 0.03-0.16 ms); and the step under `eqx.filter_jit` takes 0.41 ms longer than
`jax.jit` of the same function on the split arrays, against 0.16 ms for the float layer
(a call's dispatch alone is 30-110 us for both: the difference is in what runs; not
explained). A
chunk-granular gather of the patch operand (blocks of 16 rows instead of rows) timed
the same and was left out.

Wgrad on shifted copies of `dy` (2026-12-06, ninth session): the wgrad alone is faster
(medium 0.88 against 1.09 ms gathered, large 15.1 against 19.9 ms). The ninth session's
whole-step A/B (the same within noise) compiled one program twice (JAX's caches reused
the first trace); `--gathered-wgrad` clears them since (tenth session, `--repeats 41` /
`9`): the whole step with the gathered wgrad 1.12x the shifted one's time (medium,
2.66 against 2.37 ms) and 1.16x (large, 37.2 against 32.2 ms). Which program runs right
after the float32 one moves its time by up to ~15% between processes, so a single
run's ratios carry that much noise. Three full runs after it: medium
1.96x / 1.59x / 1.90x, small `ConvTranspose2d` k4 s4 1.91x / 1.68x / 2.20x,
`ConvTranspose1d` k4 s4 1.81x / 1.52x / 2.09x, every other layer 0.24-1.86x.

A transposed convolution's wgrad patch operand from canonical chunks (2026-12-07,
fifteenth session; `WgradPlan.canon`): a chunk of a `ConvTranspose` k4 s4 output row
holds four input pixels at one residue modulo 4, and the four residues' chunks are one
set of pixels, so it is transformed and quantised once (at residue 0) and put back
with Sylvester signs: the k4 s4 layer's wgrad transforms 2,064 rows instead of 8,208.
`--only "small: ConvTranspose" --repeats 41`, this tree then the one before, twice
(2-core CPU, load ~1): k4 s4 1.57x / 1.56x against 1.74x / 1.87x, k2 s2 1.73x / 1.65x
against 1.83x / 2.16x, `ConvTranspose1d` k4 s4 1.59x / 1.47x against 1.76x / 1.82x, the
padded ones (k4 s2 p1) 1.22-1.65x against 0.89-1.41x (within the noise).

A patch embedding (`Conv2d` 3->32 k4 s4: windows that tile the input; 3 input channels
take the patch GEMM): its patches were one strided slice per window offset, whose
transpose in dgrad pads and adds 16 copies of the image (~260 us of an ~840 us step in
a trace); they are the cropped input's blocks by one reshape and transpose now
(`conv_patches`): 2.04x -> 1.42x float32 (same session, `--repeats 21`).

Expected on a (loaded) 2-core CPU, issue 23 item 13 (wgrad from the distinct patch
chunks, transposed convolutions only where a tap reads input): 3x3 `Conv2d` about
1.6x, `ConvTranspose2d` k4 s4 about 0.9x, k4 s2 p1 about 0.3x (before: 2.05-2.45x,
4.9-5.7x, 1.3-1.4x).
"""

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import nvfp4x
from nvfp4x import _conv

# (label, layer, input shape of one batch): small (an MNIST/CIFAR stem, a Mixer's
# patch (de-)embedding), medium and large layers, as public models use them.
CASES: tuple[tuple[str, Callable, tuple[int, ...]], ...] = (
    (
        "small: Conv2d 3->16 3x3 pad 1, 8x3x28x28",
        lambda k: eqx.nn.Conv2d(3, 16, 3, padding=1, key=k),
        (8, 3, 28, 28),
    ),
    (
        "small: Conv2d 3->32 k4 s4 (a patch embedding), 8x3x32x32",  # a ViT's, a Mixer's stem
        lambda k: eqx.nn.Conv2d(3, 32, 4, stride=4, key=k),
        (8, 3, 32, 32),
    ),
    (
        "small: ConvTranspose2d 16->3 k4 s4, 8x16x8x8",
        lambda k: eqx.nn.ConvTranspose2d(16, 3, 4, stride=4, key=k),
        (8, 16, 8, 8),
    ),
    (
        "small: ConvTranspose2d 16->3 k2 s2, 8x16x16x16",  # a U-Net's up-sampling
        lambda k: eqx.nn.ConvTranspose2d(16, 3, 2, stride=2, key=k),
        (8, 16, 16, 16),
    ),
    (
        "small: ConvTranspose2d 16->8 k4 s2 pad 1, 8x16x8x8",  # DCGAN's, small
        lambda k: eqx.nn.ConvTranspose2d(16, 8, 4, stride=2, padding=1, key=k),
        (8, 16, 8, 8),
    ),
    (
        "small: Conv1d 16->32 k3 pad 1, 8x16x64",
        lambda k: eqx.nn.Conv1d(16, 32, 3, padding=1, key=k),
        (8, 16, 64),
    ),
    (
        "small: depthwise Conv1d 32 k4 pad 3, 8x32x64",  # Mamba's
        lambda k: eqx.nn.Conv1d(32, 32, 4, padding=3, groups=32, key=k),
        (8, 32, 64),
    ),
    (
        "small: ConvTranspose1d 16->8 k4 s2 pad 1, 8x16x32",
        lambda k: eqx.nn.ConvTranspose1d(16, 8, 4, stride=2, padding=1, key=k),
        (8, 16, 32),
    ),
    (
        "small: ConvTranspose1d 16->8 k4 s4, 8x16x16",
        lambda k: eqx.nn.ConvTranspose1d(16, 8, 4, stride=4, key=k),
        (8, 16, 16),
    ),
    (
        "medium: grouped Conv2d 32->32 3x3 groups 2 pad 1, 8x32x16x16",
        lambda k: eqx.nn.Conv2d(32, 32, 3, padding=1, groups=2, key=k),
        (8, 32, 16, 16),
    ),
    (
        "medium: Conv2d 32->32 3x3 pad 1, 8x32x16x16",
        lambda k: eqx.nn.Conv2d(32, 32, 3, padding=1, key=k),
        (8, 32, 16, 16),
    ),
    (
        "large: Conv2d 64->64 3x3 pad 1, 8x64x32x32",
        lambda k: eqx.nn.Conv2d(64, 64, 3, padding=1, key=k),
        (8, 64, 32, 32),
    ),
    (
        "large: ConvTranspose2d 64->32 k4 s4, 8x64x8x8",
        lambda k: eqx.nn.ConvTranspose2d(64, 32, 4, stride=4, key=k),
        (8, 64, 8, 8),
    ),
    (
        "large: ConvTranspose2d 64->32 k4 s2 pad 1, 8x64x16x16",
        lambda k: eqx.nn.ConvTranspose2d(64, 32, 4, stride=2, padding=1, key=k),
        (8, 64, 16, 16),
    ),
)
QUICK_SHRINK = 4  # --quick: a quarter of the images


def _loss(args):
    layer, x = args
    return jnp.mean(jax.vmap(layer)(x) ** 2)


#: `((layer, x)) -> (loss, (d layer, d x))`: fprop, wgrad and dgrad.
_value_and_grad = eqx.filter_value_and_grad(_loss)


def step_fn() -> Callable:
    """`(layer, x) -> (loss, (d layer, d x))`, jitted (a fresh cache per call)."""
    grad = eqx.filter_jit(_value_and_grad)
    return lambda layer, x: grad((layer, x))


@contextlib.contextmanager
def _no_shifted_wgrad():
    """Within: convolutions traced take the gathered wgrad (`shifts_rows` off)."""
    shifts = _conv.shifts_rows
    _conv.shifts_rows = lambda geom, unit: False
    try:
        yield
    finally:
        _conv.shifts_rows = shifts


def compiled_pair(qlayer, x) -> tuple[list[Callable], Any]:
    """The quantised layer's step compiled ahead of time twice, with wgrad on shifted
    copies of `dy` and with it off (`_no_shifted_wgrad`), JAX's caches cleared before
    each: nvfp4x's primitives trace jitted functions, which JAX would otherwise reuse
    from the first trace (two compilations of one program). `([shifted, gathered],
    arrays)`: each executable takes the step's arrays."""
    dynamic, static = eqx.partition((qlayer, x), eqx.is_array)
    fn = jax.jit(lambda d: _value_and_grad(eqx.combine(d, static)))
    exes = []
    for context in (contextlib.nullcontext, _no_shifted_wgrad):
        jax.clear_caches()
        with context():
            exes.append(fn.lower(dynamic).compile())
    jax.clear_caches()
    return exes, dynamic


def timed(fn: Callable, *args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer images and rounds")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--only", default="", help="only the cases whose label holds this")
    parser.add_argument(
        "--gathered-wgrad",
        action="store_true",
        help="also time each layer with the wgrad that pairs shifted copies of dy "
        "(`shifts_rows`) off (the patch operand gathered from distinct chunks), same process",
    )
    args = parser.parse_args(argv)
    repeats = 5 if args.quick else args.repeats
    policy = nvfp4x.Policy([(".*", nvfp4x.recipes.nvfp4_training())], convolutions=True)
    result = {}
    for label, make, shape in CASES:
        if args.only not in label:
            continue
        if args.quick:
            shape = (max(1, shape[0] // QUICK_SHRINK), *shape[1:])
        layer = make(jax.random.key(0))
        qlayer = nvfp4x.quantize(layer, policy)
        x = jax.random.normal(jax.random.key(1), shape)
        gathered = None
        if args.gathered_wgrad:  # (the same program where the shifted path does not apply)
            gathered = compiled_pair(qlayer, x)  # (first: it clears JAX's caches)
        step = step_fn()
        for m in (layer, qlayer):  # compile both first
            timed(step, m, x)
        f32, q, qs, qg = [], [], [], []
        for _ in range(repeats):  # interleaved: all see the same machine load
            f32.append(timed(step, layer, x))
            q.append(timed(step, qlayer, x))
            if gathered is not None:
                exes, arrays = gathered
                for exe, times in zip(exes, (qs, qg), strict=True):
                    times.append(timed(exe, arrays))
        t32, tq = statistics.median(f32), statistics.median(q)
        result[label] = {"float32 ms": 1e3 * t32, "nvfp4 ms": 1e3 * tq, "ratio": tq / t32}
        line = f"{label}: float32 {1e3 * t32:.2f} ms, nvfp4 {1e3 * tq:.2f} ms, x{tq / t32:.2f}"
        if qg:
            ts, tg = statistics.median(qs), statistics.median(qg)
            result[label]["shifted wgrad executable ms"] = 1e3 * ts
            result[label]["gathered wgrad executable ms"] = 1e3 * tg
            line += (
                f" (the executables alone: wgrad on shifted dy {1e3 * ts:.2f} ms, "
                f"gathered {1e3 * tg:.2f} ms, x{tg / ts:.2f})"
            )
        print(line)
    return result


if __name__ == "__main__":
    main()
