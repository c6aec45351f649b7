#!/usr/bin/env bash
# One run on a TPU machine (the `device` tool's tpu-v5e): install what the TPU image lacks,
# run a chunk of the numerics tests in one process (one program at a time can hold the
# chip), then, optionally, a benchmark or check script; logs and per-test results go
# under $OUT.
#
#   Here (once, with network):  bash benchmarks/tpu_check.sh download
#       fetches the wheels the TPU image and its package index lack into .whl-tpu/
#       (ignored by git: `.gitignore`); the device call
#       then names `.whl-tpu` in `carry`.
#   There:  CHUNK=N OUT=$OUT bash benchmarks/tpu_check.sh [TEST_SECONDS] [-- SCRIPT ARGS...]
#       CHUNK=N runs chunk N (1..9, see `chunk_files` below; CHUNK=list prints them,
#       CHUNK=none runs no tests), TESTS="tests/a.py ..." runs those files (or test ids)
#       instead, SHARD=I/N only every N-th of their tests from the I-th (a chunk split over
#       N commands), PYTEST_K an expression for pytest's `-k`, and PYTEST_ARGS adds
#       pytest arguments (split at spaces: `-x`, `--maxfail=3`). After `--`, a Python script
#       and its arguments run after the tests (e.g. `-- benchmarks/bench_gpu.py --out
#       $OUT/bench.md --only quantize`), killed after BENCH_SECONDS (default 300).
#
# Times measured on a TPU v5e (pytest's own; 2026-12-05/06, fourth to sixth sessions):
# chunk 1 247 s (hypothesis' examples each compile the Mosaic quantiser), chunk 2 146 s,
# chunk 3 about 300 s (240 s reached 7 tests into `test_gemm_jax.py`), chunk 4 over 300 s
# (72 of its 76 tests in ~290 s: give it 360 s alone), chunk 5 about 425 s
# (`test_native_gemm` 94 s, `test_tied` 125 s, `test_any_model` 204 s), chunk 7 443 s
# (`test_moe` 226 s, `test_conv` 217 s). Chunk 6 is longer than one command:
# `test_freeze.py`'s first 8 tests took 168 s there (the Mosaic quantiser's compiles in
# every recipe's frozen and unfrozen model), so run it as SHARD=0/4 .. SHARD=3/4
# (guessed: 65 + 8 tests). Chunk 8 255 s, chunk 9 143 s (seventh session); chunk 2
# now holds `test_frozen_speed_paths` too (~60 s more); chunk 9 `test_tpu_operand` too
# (15 of its tests took ~120 s there: give chunk 9 ~450 s). Each test file's times are in the JUnit file. Two chunks fit one
# command where their times add up to ~540 s. The first start of a machine adds 1-2 minutes before this script, the
# installs here 20 s.
# Commands in one machine start share a compilation cache (`.jax-cache-tpu/` in the
# repo's copy there): a later chunk or shard loads what an earlier one compiled.
# Writes: $OUT/device.txt (jax, devices), $OUT/chunk<N>.log (pytest -rA), $OUT/chunk<N>.xml
# (JUnit: every test's outcome and time), $OUT/script.log, $OUT/extra.tar (any other files),
# and $OUT/install.log only if an install failed (the device tool returns 8 files).
set -u
cd "$(dirname "$0")/.."

WHEELS=(equinox==0.13.8 quax==0.4.6 plum-dispatch==2.10.1 beartype==0.23.1
    jaxtyping==0.3.11 wadler-lindig==0.1.8 chex==0.1.92 qwix==0.1.8
    rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.20.0)
# From the TPU machine's own package index (/opt/pypi/simple), with their dependencies.
INDEX=(optax orbax-checkpoint safetensors flax toolz absl-py opt_einsum tqdm matplotlib)

chunk_files() {
    case "$1" in
    1) echo tests/test_exactness.py tests/test_format.py ;;
    2) echo tests/test_fp8_tables.py tests/test_gemm_reference.py tests/test_gemm_sr.py \
        tests/test_frozen_speed_paths.py ;;
    3) echo tests/test_gemm_vmap.py tests/test_unbiased_sr.py tests/test_gemm_jax.py ;;
    4) echo tests/test_tpu_kernels.py tests/test_tpu_frozen_kernel.py tests/test_tpu_rht.py tests/test_kernels.py \
        tests/test_frozen_kernel.py ;;
    5) echo tests/test_native_gemm.py tests/test_tied.py tests/test_any_model.py ;;
    6) echo tests/test_freeze.py tests/test_telemetry.py ;;
    7) echo tests/test_moe.py tests/test_conv.py ;;
    8) echo tests/test_transform.py tests/test_hf.py ;;
    9) echo tests/test_save_load.py tests/test_requantize.py tests/test_scan_layers.py \
        tests/test_tpu_operand.py ;;
    *) return 1 ;;
    esac
}
CHUNKS=9

if [ "${1:-}" = download ]; then
    mkdir -p .whl-tpu
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl-tpu "${WHEELS[@]}"
    exit $?
fi
if [ "${CHUNK:-}" = list ]; then
    for n in $(seq 1 $CHUNKS); do echo "chunk $n: $(chunk_files "$n")"; done
    exit 0
fi

OUT=${OUT:-/tmp/nvfp4x-tpu}
mkdir -p "$OUT"
test_s=${1:-480}
shift $(($# < 1 ? $# : 1))
[ "${1:-}" = "--" ] && shift

# Installed under /tmp (commands there run as an ordinary user) and appended to
# PYTHONPATH, so that the machine's own JAX (with libtpu) stays first.
site=/tmp/nvfp4x-site
if [ ! -d "$site" ]; then
    t0=$(date +%s)
    if [ -d .whl-tpu ]; then
        PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps \
            --no-compile --no-cache-dir --upgrade --target "$site" .whl-tpu/*.whl || exit 1
    fi
    PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: \
        --no-compile --index-url file:///opt/pypi/simple --target "$site/deps" "${INDEX[@]}" \
        >/tmp/nvfp4x-install.log 2>&1 || {
        cp /tmp/nvfp4x-install.log "$OUT/install.log"
        tail -20 "$OUT/install.log"
        exit 1
    }
    echo "installed in $(($(date +%s) - t0)) s"
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/examples:$site:$site/deps"
export PYTHONUNBUFFERED=1 NVFP4X_TEST_FULL_OPT=1
# One compilation cache for every command while the machine stays warm (in the repo's
# copy there, ignored by git and kept between calls): a later chunk or shard loads the
# programs an earlier one compiled (the same models in each recipe, the quantiser's
# kernels) instead of compiling them again. Same executables, same numbers;
# NVFP4X_TEST_JAX_CACHE= (empty) gives this command a fresh cache of its own.
export NVFP4X_TEST_JAX_CACHE=${NVFP4X_TEST_JAX_CACHE-$PWD/.jax-cache-tpu}
[ -n "$NVFP4X_TEST_JAX_CACHE" ] && mkdir -p "$NVFP4X_TEST_JAX_CACHE" &&
    echo "compilation cache: $NVFP4X_TEST_JAX_CACHE ($(find "$NVFP4X_TEST_JAX_CACHE" -name '*-cache' | wc -l) entries)"
python3 -c "import jax, equinox, quax; print(jax.__version__, jax.devices())" 2>&1 |
    grep -v -i hugepage | tee "$OUT/device.txt"

if [ -n "${TESTS:-}" ]; then
    files=$TESTS
    name=tests
elif [ -n "${CHUNK:-}" ] && [ "$CHUNK" != none ]; then
    files=$(chunk_files "$CHUNK") || { echo "CHUNK=$CHUNK: not 1..$CHUNKS"; exit 2; }
    name=chunk$CHUNK
else
    files=""
fi
select=()
[ -n "${SHARD:-}" ] && [ -n "$files" ] && {
    select+=(--shard "$SHARD")
    name=$name-shard${SHARD%/*}of${SHARD#*/}
}
[ -n "${PYTEST_K:-}" ] && select+=(-k "$PYTEST_K")
if [ -n "$files" ]; then
    # One process (`-o addopts=`: no xdist workers; the jaxtyping/beartype checks that
    # pyproject's addopts switch on are asked for again). At the time limit pytest gets
    # SIGINT, so that it still reports what ran and writes the JUnit file (killed 30 s
    # later if it has not ended).
    # shellcheck disable=SC2086
    timeout -s INT -k 30 "$test_s" python3 -m pytest -o addopts= -p no:cacheprovider \
        --jaxtyping-packages=nvfp4x,beartype.beartype -q -rA --tb=short \
        --junitxml="$OUT/$name.xml" "${select[@]}" ${PYTEST_ARGS:-} $files >"$OUT/$name.log" 2>&1
    echo "pytest exit $? ($name: $files)" >>"$OUT/$name.log"
    grep -E "^(FAILED|ERROR) " "$OUT/$name.log" | cut -c1-300 | head -60
    tail -2 "$OUT/$name.log"
fi
if [ $# -gt 0 ]; then
    # At its limit the script gets SIGABRT, on which Python's faulthandler writes every
    # thread's stack to the log: a script that hangs shows where.
    PYTHONFAULTHANDLER=1 timeout -s ABRT -k 20 "${BENCH_SECONDS:-300}" python3 "$@" \
        >"$OUT/script.log" 2>&1
    echo "script exit $?" >>"$OUT/script.log"
    tail -60 "$OUT/script.log"
fi
# The `device` tool returns at most 8 files from $OUT: the logs, JUnit files and tables
# stay as they are, anything else (a profile's HLO files) goes into one archive.
extra=$(find "$OUT" -maxdepth 1 -type f ! -name '*.log' ! -name '*.xml' ! -name '*.md' \
    ! -name '*.txt' ! -name 'extra.tar' -printf '%f\n')
if [ -n "$extra" ]; then
    # shellcheck disable=SC2086
    (cd "$OUT" && tar -cf extra.tar $extra && rm -f $extra)
fi
