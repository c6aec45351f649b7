"""The benchmark scripts' own logic: the results page and the convergence table.

The benchmarks themselves are timed runs, not tests; `--smoke` of the convergence study
runs here (slow) so that the script the docs' fidelity page relies on keeps working.
"""

import jax
import numpy as np
import pytest
from helpers import ROOT, run_script

from benchmarks import run_all


def test_render_lists_every_benchmark_and_its_status():
    machine = {"platform": "test", "cpu count": "2"}
    results = [
        ("bench_format", "ok", {"speedup": {"x": 4.25}, "sqnr_db": 20.5}, 3.0),
        ("bench_training", "error", "ValueError: boom | bad", 1.0),
        ("bench_inference", "missing", "benchmarks/bench_inference.py does not exist", 0.0),
    ]
    page = run_all.render(machine, results, quick=True)
    lines = page.splitlines()
    assert lines[0].startswith("## ")  # included by docs/benchmarks.md under its own title
    assert "| format | speedup.x | 4.25 |" in lines
    assert "| format | sqnr_db | 20.5 |" in lines
    assert "| format | wall time (s) | 3.0 |" in lines
    assert "| training | **error** | ValueError: boom \\| bad |" in lines
    assert "| inference | **missing** | benchmarks/bench_inference.py does not exist |" in lines
    assert "| cpu count | 2 |" in lines
    assert "Quick mode" in page


def test_every_listed_benchmark_exists():
    for name in run_all.BENCHMARKS:
        assert (ROOT / "benchmarks" / f"{name}.py").exists(), name


def test_steps_to_reach():
    from benchmarks.convergence import steps_to_reach

    losses = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 1.0])
    assert steps_to_reach(losses, 3.0, window=1) == 3  # losses[2] <= 3: three steps in
    assert steps_to_reach(losses, 2.0, window=2) == 5  # mean(losses[3:5]) = 1.5
    assert steps_to_reach(losses, 0.5, window=1) is None
    assert steps_to_reach(losses[:1], 5.0, window=2) is None


@pytest.mark.slow
def test_convergence_smoke(tmp_path, subprocess_env):
    out = tmp_path / "conv"
    args = [str(ROOT / "benchmarks" / "convergence.py"), "--smoke", "--only", "float32,nvfp4"]
    run_script([*args, "--no-progress", "--out", str(out)], env=subprocess_env, timeout=600)
    assert {p.name for p in out.iterdir()} == {"losses.csv", "results.md", "convergence.png"}
    header = (out / "losses.csv").read_text().splitlines()[0]
    assert header == "step,float32,nvfp4"
    assert "| nvfp4 |" in (out / "results.md").read_text()


def test_bench_accel_skips_without_an_accelerator_and_writes_its_table(tmp_path):
    from benchmarks import bench_accel, bench_gpu

    if jax.default_backend() != "cpu":
        pytest.skip("an accelerator is at hand: the benchmark would run in full")
    assert bench_accel.main([]) == {"skipped": "no accelerator"}
    assert bench_gpu.main([]) == {"skipped": "no accelerator"}  # the former name
    out = tmp_path / "accel.md"
    bench_gpu.main(["--cpu-smoke", "--only", "bandwidth", "--out", str(out)])
    lines = out.read_text().splitlines()
    assert lines[0].startswith("## bench_gpu (smoke) on cpu ")
    assert any(line.startswith("| bandwidth | copy (x + 1, float32) | ") for line in lines)
    assert any(line.startswith("| bandwidth | section wall time | ") for line in lines)


def test_bench_accel_times_only_implementations_compiled_on_the_backend(monkeypatch):
    from benchmarks import bench_accel
    from nvfp4x import _kernels

    impls = {"nvfp4_quantize": ("xla", "pallas", "mosaic"), "frozen_gemm": ("xla", "pallas")}
    monkeypatch.setattr(_kernels, "IMPLEMENTATIONS", impls)
    for backend, want in (
        ("tpu", ("xla", "mosaic")),
        ("gpu", ("xla", "pallas")),
        ("cpu", ("xla", "pallas", "mosaic")),  # --smoke: the kernels interpreted
    ):
        monkeypatch.setattr(_kernels, "backend", lambda b=backend: b)
        assert bench_accel.implementations("nvfp4_quantize") == want, backend
    monkeypatch.setattr(_kernels, "backend", lambda: "tpu")
    assert bench_accel.implementations("frozen_gemm") == ("xla",)
    assert bench_accel.fastest("nvfp4_quantize") == "mosaic"
    assert bench_accel.fastest("frozen_gemm") == "xla"


def test_bench_accel_same_bits_tells_zero_signs_and_nan_payloads_apart():
    import jax.numpy as jnp

    from benchmarks.bench_accel import same_bits

    a = jnp.array([0.0, 1.0, jnp.nan], jnp.float32)
    assert same_bits((a, jnp.arange(3, dtype=jnp.uint8)), (a, jnp.arange(3, dtype=jnp.uint8)))
    assert not same_bits(a, a.at[0].set(-0.0))
    other_nan = jax.lax.bitcast_convert_type(jnp.uint32(0x7FC00001), jnp.float32)
    assert not same_bits(a, a.at[2].set(other_nan))
    assert not same_bits(a, a.astype(jnp.bfloat16))
    assert not same_bits(a, a[:2])


def test_bench_gpu_profile_sums_each_compiled_op_and_names_its_kind(tmp_path):
    import jax.numpy as jnp

    from benchmarks import bench_gpu

    f = jax.jit(lambda a, b: jnp.tanh(a @ b) + 1.0)
    a = jnp.ones((64, 64), jnp.float32)
    compiled = f.lower(a, a).compile()
    jax.block_until_ready(compiled(a, a))
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(2):
            jax.block_until_ready(compiled(a, a))
    times = bench_gpu.op_times(str(tmp_path), jax.default_backend())
    ops = bench_gpu.hlo_ops(compiled.as_text())
    assert times and all(ns > 0 for ns in times.values())
    assert set(times) <= set(ops)  # every timed event is an op of the compiled program
    tuple_op = "  %f.1 = (f32[16]{0}, s32[16]{0}) fusion(f32[16,16]{1,0} %p), kind=kLoop"
    cublas = "  ROOT %cc = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(), "
    cublas += 'custom_call_target="__cublas$gemm"'
    assert bench_gpu.hlo_ops(tuple_op + "\n" + cublas) == {
        "f.1": ("fusion", "(f32[16]{0}, s32[16]{0})"),
        "cc": ("gemm", "(bf16[8,8]{1,0}, s8[0]{0})"),
    }


def test_bench_accel_profile_names_tpu_kinds_and_reads_a_perfetto_trace(tmp_path):
    import gzip
    import json

    from benchmarks.bench_accel import hlo_ops, op_name, perfetto_op_times

    # XLA:TPU's GEMMs are fusions whose computation holds a convolution; Pallas TPU
    # kernels are `tpu_custom_call`s.
    text = """HloModule jit_f, entry_computation_layout={(bf16[8,8]{1,0})->f32[8,8]{1,0}}

%fused_computation.1 (param_0: bf16[8,8]) -> f32[8,8] {
  %param_0 = bf16[8,8]{1,0} parameter(0)
  ROOT %convolution.1 = f32[8,8]{1,0} convolution(%param_0, %param_0), dim_labels=bf_io->bf
}

%fused_computation.2 (param_0.1: f32[8,8]) -> f32[8,8] {
  %param_0.1 = f32[8,8]{1,0} parameter(0)
  ROOT %tanh.1 = f32[8,8]{1,0} tanh(%param_0.1)
}

ENTRY %main.9 (Arg_0.1: bf16[8,8]) -> f32[8,8] {
  %Arg_0.1 = bf16[8,8]{1,0} parameter(0)
  %fusion.1 = f32[8,8]{1,0} fusion(%Arg_0.1), kind=kOutput, calls=%fused_computation.1
  %fusion.2 = f32[8,8]{1,0} fusion(%fusion.1), kind=kLoop, calls=%fused_computation.2
  %cc.3 = u8[8,4]{1,0} custom-call(%fusion.2), custom_call_target="tpu_custom_call"
  ROOT %copy.4 = f32[8,8]{0,1} copy(%fusion.2)
}
"""
    kinds = {name: kind for name, (kind, _) in hlo_ops(text).items()}
    assert kinds["fusion.1"] == "gemm"
    assert kinds["fusion.2"] == "fusion"
    assert kinds["cc.3"] == "kernel"
    assert kinds["copy.4"] == "copy"
    # A TPU trace names an operation by its instruction's text (seen on a TPU v5e).
    assert op_name("%fusion.1 = f32[8,8]{1,0:T(8,128)} fusion(bf16[8,8] %Arg_0.1)") == "fusion.1"
    assert op_name("fusion.2") == "fusion.2"
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:TPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 1, "name": "fusion.1", "dur": 2.5},
        {"ph": "X", "pid": 1, "name": "fusion.1", "dur": 1.5},
        {"ph": "X", "pid": 1, "name": "not-an-op", "dur": 9.0},
        {"ph": "X", "pid": 2, "name": "fusion.2", "dur": 7.0},  # a host event
    ]
    with gzip.open(tmp_path / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert perfetto_op_times(str(tmp_path), hlo_ops(text)) == {"fusion.1": 4000.0}


def test_bench_compile_counts_instructions_per_region():
    from benchmarks.bench_compile import hlo_regions

    text = "\n".join(
        [
            '  %p = f32[] parameter(0), metadata={op_name="jit(step)/jit(wgrad)/x"}',
            '  %c = f32[] constant(1), metadata={op_name="jit(step)/jit(wgrad)/x"}',
            '  %a = f32[] add(%p, %c), metadata={op_name="jit(step)/nvfp4x_wgrad/jit(wgrad)/add"}',
            '  %b = f32[] add(%a, %c), metadata={op_name="jit(step)/jit(dgrad)/jit(_where)/x"}',
            '  %d = f32[] add(%b, %c), metadata={op_name="jit(step)/jit(_fprop_operands)/mul"}',
            '  %e = f32[] add(%d, %c), metadata={op_name="jit(step)/adam/add"}',
            "  %f = f32[] add(%e, %c)",
        ]
    )
    assert hlo_regions(text) == {"fprop": 1, "dgrad": 1, "wgrad": 1, "other": 1}


def test_bench_compile_counts_the_entry_computations_operations():
    from benchmarks.bench_compile import entry_ops

    text = "\n".join(
        [
            "%fused_computation (p: f32[4]) -> f32[4] {",
            "  %p = f32[4] parameter(0)",
            "  ROOT %n = f32[4] negate(%p)",
            "}",
            "ENTRY %main (a: f32[4]) -> (f32[4], f32[]) {",
            "  %a = f32[4]{0} parameter(0)",
            "  %c = f32[] constant(1)",
            "  %f = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_computation",
            '  %k = f32[4]{0} custom-call(%f), custom_call_target="tpu_custom_call"',
            "  %b = f32[4]{0} bitcast(%k)",
            "  %r = f32[] reduce(%b, %c), dimensions={0}, to_apply=%add",
            "  ROOT %t = (f32[4]{0}, f32[]) tuple(%b, %r)",
            "}",
        ]
    )
    assert entry_ops(text) == 3  # the fusion, the custom call, the reduce


def test_tpu_compile_check_lowers_each_kernel_for_a_tpu(tmp_path):
    """The compile script's kernel section (`--smoke`: lowered for a TPU here, no compile)
    lowers each kernel at each number of call sites into one kernel function (and the
    quantisers' prologue kernel into one more)."""
    from benchmarks.tpu_compile_check import KERNELS, main

    out = tmp_path / "compile.md"
    assert main(["--smoke", "--only", "sites", "--out", str(out)]) == 0
    text = out.read_text()
    assert "error" not in text
    for name in KERNELS:
        functions = 1 if name in ("RHT statistics", "prologue") else 2
        for k in (1, 2):
            assert f"| {name} | {k} | {functions} / None |" in text, (name, k)


def test_tpu_chunks_hold_every_numerics_file_once():
    """`benchmarks/tpu_check.sh`'s chunks name existing test files, each once, and hold
    every numerics file issue 36 names (a renamed or new file would otherwise never run
    on a TPU)."""
    import subprocess

    out = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "tpu_check.sh")],
        env={"CHUNK": "list", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    files = [f for line in out.splitlines() for f in line.split(":", 1)[1].split()]
    assert len(files) == len(set(files)), files
    assert all((ROOT / f).is_file() for f in files), files
    numerics = {
        "exactness", "format", "fp8_tables", "gemm_reference", "gemm_sr", "gemm_vmap",
        "gemm_jax", "unbiased_sr", "freeze", "tied", "moe", "conv", "any_model",
        "transform", "hf", "requantize", "telemetry", "save_load", "native_gemm",
        "kernels", "tpu_kernels", "frozen_kernel", "tpu_frozen_kernel", "tpu_rht",
        "tpu_operand",
    }  # fmt: skip
    assert {f"tests/test_{name}.py" for name in numerics} <= set(files)


def test_shards_split_the_collected_tests():
    """`--shard I/N` (tests/conftest.py; `tpu_check.sh`'s SHARD): the N parts of a run
    are disjoint and together every collected test; a bad value is a usage error; the
    option reaches pytest's collection (one subprocess)."""
    import subprocess
    import sys

    import pytest
    from conftest import shard_split

    items = list(range(11))
    parts = [shard_split(items, f"{i}/3") for i in range(3)]
    assert sorted(sum((kept for kept, _ in parts), [])) == items
    assert all(sorted(kept + dropped) == items for kept, dropped in parts)
    assert parts[1][0] == [1, 4, 7, 10]
    for bad in ("3/3", "-1/2", "1", "a/b"):
        with pytest.raises(pytest.UsageError):
            shard_split(items, bad)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider"]
        + ["--collect-only", "tests/test_tied.py", "--shard", "1/3"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0 and "deselected" in out.stdout, out.stdout[-500:]


def test_bench_compile_separate_programs_compiles_each_problem_once_and_restores():
    """`bench_compile.py --separate`: the two blocks' layers (the same problems) share one
    program per primitive, the step they are called back from computes what the inline
    step computes (up to float32 summation order), and after the block the primitives
    lower inline again."""
    import equinox as eqx
    import optax

    import nvfp4x
    from benchmarks.bench_compile import Unrolled, make_step, mse, separate_programs

    recipe = nvfp4x.recipes.nvfp4_training(rht=False, stochastic_rounding=False)
    model = nvfp4x.quantize(Unrolled(16, 16, 2, jax.random.key(0)), recipe)
    arrays, static = eqx.partition(model, eqx.is_array)
    x = jax.random.normal(jax.random.key(1), (32, 16))
    optimizer = optax.sgd(1e-2)
    state = optimizer.init(arrays)

    def run():
        step = jax.jit(make_step(optimizer, static, mse))
        return step.lower(arrays, state, x, x), step(arrays, state, x, x)

    with separate_programs() as programs:
        lowered, loss = run()
    names = sorted(key[0].name for key in programs)
    assert names == ["nvfp4x_dgrad", "nvfp4x_qdot", "nvfp4x_wgrad"], names
    assert "callback" in lowered.as_text()
    inline, inline_loss = run()
    assert "callback" not in inline.as_text()
    # The same numbers up to the float32 GEMMs' summation order (not defined across two
    # programs: the callback's program is compiled on its own).
    for a, b in zip(jax.tree.leaves(loss), jax.tree.leaves(inline_loss), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_hlo_memory_finds_the_buffers_live_at_the_peak(capsys, tmp_path):
    """`hlo_memory` walks a compiled program's entry computation: two intermediates of
    1 MiB each live together at the peak, the arguments and the result never counted."""
    from benchmarks import hlo_memory

    def f(x):
        a = jax.numpy.sin(x) @ x  # (dots: buffers XLA:CPU does not fuse away)
        b = jax.numpy.cos(x) @ x
        return (a @ b).sum()

    x = jax.numpy.ones((512, 512), "float32")
    text = jax.jit(f).lower(x).compile().as_text()
    bufs = hlo_memory.buffers(text)
    total, _, live = hlo_memory.peak(bufs)
    big = [b for b in live if b.nbytes == 512 * 512 * 4]
    assert len(big) >= 2 and total >= 2 * 2**20
    assert all(b.opcode not in ("parameter", "constant") for b in bufs)
    assert hlo_memory.array_bytes("(f32[4,4]{1,0}, bf16[8]{0:T(8)S(1)}, u8[3])") == 64 + 3
    path = tmp_path / "program.hlo.txt"
    path.write_text(text)
    assert hlo_memory.main([str(path), "--top", "3"]) == 0
    assert "the largest sum live" in capsys.readouterr().out
