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


def test_bench_gpu_skips_without_a_gpu_and_writes_its_table(tmp_path):
    from benchmarks import bench_gpu

    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is at hand: the benchmark would run in full")
    assert bench_gpu.main([]) == {"skipped": "no GPU"}
    out = tmp_path / "gpu.md"
    bench_gpu.main(["--cpu-smoke", "--only", "bandwidth", "--out", str(out)])
    lines = out.read_text().splitlines()
    assert lines[0].startswith("## bench_gpu (cpu smoke) on ")
    assert any(line.startswith("| bandwidth | copy (x + 1, float32) | ") for line in lines)


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
