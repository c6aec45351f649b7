"""What the Pallas TPU kernels share: how they are vmapped (one problem after another),
the precision of their MXU dots, and whether XLA may fuse their array inputs'
producers into them."""

import os

import jax
from jax import lax

#: The precision every MXU dot in a TPU kernel names: one pass of bfloat16 products
#: (the kernels' operands are bfloat16 values, exact products, float32 sums). Named
#: explicitly, so that a caller's `jax.default_matmul_precision("highest")` does not
#: reach inside the kernels: Mosaic refuses a float32-precision dot of bfloat16
#: operands ("Bad lhs type", seen on a TPU v5e).
ONE_PASS = lax.Precision.DEFAULT

#: Whether XLA may fuse the elementwise producer of a TPU kernel's array operand (an
#: activation's GELU, a cast, a pad) into the kernel's reads of it (Mosaic's
#: `allow_input_fusion`) instead of writing that operand to memory first (in a training
#: step, the GELU that the fprop quantiser and the RHT statistics read: 0.8 ms a block
#: written on a TPU v5e; and wgrad's bfloat16 operands, which its fused operand's `cond`
#: then takes as they are and widens inside each branch, where the widening can fuse:
#: no float32 copy kept for the `cond`. A producer outside the `cond` does not fuse into
#: its branches.) The same values either way; read when a kernel is traced (clear JAX's
#: caches after changing it). Off: on a TPU v5e (jax 0.10.2, 2026-12-07,
#: `benchmarks/bench_accel.py --lean --only train`, which times it on) XLA's compile of
#: the 2-block training step failed with it on, in float32 and inside mixed bf16
#: (`RET_CHECK failure ... llo_allocation_rematerialization.cc:134`, a VMEM buffer of
#: a fusion of an `f32[8192,8192]` operand): an XLA:TPU limit, not a wrong value. The
#: environment variable `NVFP4X_TPU_INPUT_FUSION=1` turns it on from the start (for a
#: later XLA, and the tests with it on).
INPUT_FUSION = os.environ.get("NVFP4X_TPU_INPUT_FUSION", "0") == "1"


def fusible(*arrays: bool) -> tuple[bool, ...] | None:
    """`pltpu.CompilerParams`' `allow_input_fusion` for a kernel's inputs, `True` at its
    array operands (where `INPUT_FUSION` is on; else `None`, no input fused)."""
    return tuple(arrays) if INPUT_FUSION else None


def one_problem_at_a_time(call):
    """`call` (a function of arrays) with a batching rule that runs the problems of a
    vmapped call one after another (`lax.map` over the batched arguments; the others
    are shared) instead of Pallas's rule. A vmapped kernel call here is a stack of
    layers or experts, each problem large enough to fill the chip on its own; Pallas's
    rule adds a grid axis, which Mosaic refuses for blocks in SMEM (the quantiser's
    parameters: "the last two dimensions of your block shape are divisible by 8 and
    128", seen on a TPU v5e) and the TPU interpreter does not take with the kernels'
    `dimension_semantics`."""
    fn = jax.custom_batching.custom_vmap(call)

    @fn.def_vmap
    def _(axis_size, in_batched, *args):
        del axis_size

        def one(sliced):
            it = iter(sliced)
            return fn(*(next(it) if b else a for a, b in zip(args, in_batched, strict=True)))

        out = lax.map(one, [a for a, b in zip(args, in_batched, strict=True) if b])
        return out, jax.tree.map(lambda _: True, out)

    return fn


def each_problem(fn, *args):
    """`fn(*args)`, a vmapped call running one problem after another
    (`one_problem_at_a_time`); `None` arguments (an amax or seed not given) pass through
    as they are."""
    given = [a is not None for a in args]

    def call(*present):
        it = iter(present)
        return fn(*(next(it) if g else None for g in given))

    return one_problem_at_a_time(call)(*(a for a in args if a is not None))
