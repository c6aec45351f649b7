#!/usr/bin/env bash
# One run on a GPU machine: install the wheels carried in .whl/ (quax, plum-dispatch,
# beartype, equinox: the GPU image lacks them), run the tests whose results depend on the
# backend's arithmetic (the format core, the GEMMs, freeze, the kernels), then the GPU
# benchmark, and write the logs and the benchmark's table under $OUT.
#
#   OUT=/tmp/out bash benchmarks/gpu_check.sh [TEST_SECONDS] [BENCH_SECONDS] [-- BENCH_ARGS...]
#   TESTS="tests/test_format.py ..." overrides the test files (TESTS=none: no tests).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/nvfp4x-gpu}
mkdir -p "$OUT"
test_s=${1:-300}
bench_s=${2:-240}
shift $(($# < 2 ? $# : 2))
[ "${1:-}" = "--" ] && shift
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/examples"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 NVFP4X_TEST_FULL_OPT=1
(nvidia-smi -L 2>/dev/null; python3 -c "import jax; print(jax.__version__, jax.devices())") \
    2>&1 | tee "$OUT/device.txt"
TESTS=${TESTS:-"tests/test_exactness.py tests/test_kernels.py tests/test_format.py
    tests/test_fp8_tables.py tests/test_gemm_reference.py tests/test_gemm_sr.py
    tests/test_gemm_vmap.py tests/test_gemm_jax.py tests/test_unbiased_sr.py
    tests/test_freeze.py tests/test_any_model.py tests/test_transform.py tests/test_hf.py
    tests/test_requantize.py tests/test_telemetry.py tests/test_not_a_layer.py
    tests/test_format_inputs.py tests/test_save_load.py"}
if [ "$TESTS" != none ]; then
    # -W: hypothesis imports a module that warns at import; with warnings as errors that
    # would hide a failing property test behind an INTERNALERROR.
    # shellcheck disable=SC2086
    timeout "$test_s" python3 -m pytest -v --tb=short -n "${WORKERS:-12}" --dist loadfile -rfE \
        -p no:cacheprovider -W ignore::DeprecationWarning $TESTS >"$OUT/tests.log" 2>&1
    echo "tests exit $?" >>"$OUT/tests.log"
    grep -E "(FAILED|ERROR) tests/" "$OUT/tests.log" | cut -c1-240 | head -50
    tail -3 "$OUT/tests.log"
fi
if [ "$bench_s" -gt 0 ]; then
    timeout "$bench_s" python3 benchmarks/bench_gpu.py --out "$OUT/bench.md" "$@" \
        >"$OUT/bench.log" 2>&1
    echo "bench exit $?" >>"$OUT/bench.log"
    if [ -s "$OUT/bench.md" ]; then cat "$OUT/bench.md"; else tail -30 "$OUT/bench.log"; fi
fi
