"""Bits that do not lean on the backend's arithmetic.

A GPU's float32 `/` is not correctly rounded, and its float32 dots at default precision
multiply in TF32; a CPU does neither, so the rest of the suite cannot see a library that
leans on either. Three guards keep it from coming back:

- `divide`, the one exact division, against NumPy's IEEE quotients on millions of
  random and edge inputs;
- the programs XLA gets for every public quantiser, `qdot`'s three GEMMs (forward and
  gradients, every recipe, both paths) and the frozen forward hold no float division
  outside `divide` and no float32 dot below `precision=HIGHEST`;
- the format and GEMM tests below (`UNDER_INEXACT_ARITHMETIC`, `UNDER_FLUSHED_SUBNORMALS`)
  run again in a subprocess with `tests/inexact_arithmetic.py`, which gives XLA:CPU a
  GPU's inexact division, bfloat16-precision default dots (a TPU's too) and removal of
  cast pairs (`f32 -> bf16 -> f32`), and `tests/flush_subnormals.py`, which gives it a
  TPU's flushing of subnormals in casts, `reduce_precision`, `abs` and `neg` (its
  arithmetic flushes them already): their bits must not change.
"""

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import RECIPES, only_on
from reference import (
    F32,
    FLT_MAX,
    assert_bits,
    assert_bits_bf16_flush,
    bf16_arrays_flush,
    ref_nvfp4,
    unpack,
)

import nvfp4x
from nvfp4x import _kernels
from nvfp4x._formats._plain import round_to
from nvfp4x._numerics._bits import widen
from nvfp4x._numerics._ieee import EXACT_DIVISION, divide, reciprocal

TESTS = Path(__file__).parent
PLUGIN = "inexact_arithmetic"
UNDER_PLUGIN = PLUGIN in sys.modules
#: The plugin that gives XLA:CPU a TPU's flushing of subnormals (`flush_subnormals.py`).
FLUSH = "flush_subnormals"

# ---------------------------------------------------------------------------------------
# `divide` against IEEE.
# ---------------------------------------------------------------------------------------


def _floats(rng, exponents, n: int) -> np.ndarray:
    """Floats with random significands and biased exponents drawn from `exponents`,
    random signs."""
    bits = rng.integers(0, 2**23, n, dtype=np.uint32) | (exponents.astype(np.uint32) << 23)
    return (bits | (rng.integers(0, 2, n, dtype=np.uint32) << 31)).view(F32)


def _division_cases(n: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(24)
    ea = rng.integers(1, 255, n)
    near = np.clip(ea + rng.integers(-30, 31, n), 1, 254)  # normal quotients
    far = np.clip(ea + rng.integers(100, 160, n), 1, 254)  # subnormal quotients
    subnormal = rng.integers(1, 2**23, n, dtype=np.uint32).view(F32)
    specials = np.array(
        [0, -0.0, np.inf, -np.inf, np.nan, 1, -1, 3, 2.0**-149, 2.0**-126, FLT_MAX, 2688], F32
    )
    return {
        "any bits": tuple(rng.integers(0, 2**32, (2, n), dtype=np.uint32).view(F32)),
        "normal quotients": (_floats(rng, ea, n), _floats(rng, near, n)),
        "subnormal quotients": (_floats(rng, ea % 60 + 1, n), _floats(rng, far, n)),
        "subnormal dividends": (subnormal, _floats(rng, rng.integers(1, 255, n), n)),
        "subnormal divisors": (_floats(rng, rng.integers(1, 255, n), n), subnormal),
        # exact halves below 2^-126: the only ties a quotient of floats can have
        "ties": (subnormal, (2.0 ** rng.integers(1, 24, n)).astype(F32)),
        "1 / x (s_dec, inv_b)": (np.ones(n, F32), rng.integers(0, 2**31, n).astype(np.uint32)),
        "2688 / amax (S_enc)": (
            np.full(n, 2688, F32),
            rng.integers(0, 0x7F800001, n).astype(np.uint32),
        ),
        "specials": (np.repeat(specials, specials.size), np.tile(specials, specials.size)),
    }


_divide, _reciprocal = jax.jit(divide), jax.jit(reciprocal)
_cases = functools.cache(_division_cases)


@pytest.mark.parametrize("case", list(_division_cases(1)), ids=list(_division_cases(1)))
def test_divide_matches_ieee(case):
    a, b = _cases(2**19)[case]
    a, b = (v.view(F32) if v.dtype != F32 else v for v in (a, b))
    with np.errstate(all="ignore"):
        want = a / b
    assert_bits(_divide(a, b), want, f"divide, {case}")
    if case.startswith("1 /"):
        assert_bits(_reciprocal(b), want, "reciprocal")


def test_tensor_scale_divisions_match_ieee():
    """`encode_scale` (`constant_over`) and `reciprocal_of_normal`, `divide`'s and
    `reciprocal`'s bits on their domains: `S_enc = min(2688 / amax, FLT_MAX)` (1 for a
    zero, negative or infinite amax) for every class of amax, and `s_dec = 1 / S_enc`."""
    from nvfp4x._numerics._ieee import constant_over, reciprocal_of_normal
    from nvfp4x._numerics._nvfp4 import encode_scale

    rng = np.random.default_rng(26)
    any_bits = rng.integers(0, 2**32, 2**16, dtype=np.uint32).view(F32)
    specials = np.array(
        [0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 2.0**-149, 2.0**-126, FLT_MAX, 2688], F32
    )
    # around the overflow of 2688 / amax (amax near 7.9e-36) and the subnormal s_dec
    edge = (2688 / FLT_MAX * 2.0 ** rng.uniform(-4, 4, 2**12)).astype(F32)
    wide = _cases(2**19)["2688 / amax (S_enc)"][1].view(F32)[: 2**16]
    amax = np.concatenate([specials, any_bits, edge, wide])
    with np.errstate(all="ignore"):
        q = F32(2688) / amax
        want = np.where((amax.view(np.uint32) == 0) | (q <= 0), F32(1), np.minimum(q, FLT_MAX))
        assert_bits(jax.jit(jax.vmap(encode_scale))(amax), want, "encode_scale")
        eager = [encode_scale(jnp.asarray(a)) for a in specials[3:6]]
        assert_bits(np.asarray(eager), want[3:6], "encode_scale, eager")
        assert_bits(jax.jit(reciprocal_of_normal)(want), F32(1) / want, "reciprocal_of_normal")
        b = _floats(rng, rng.integers(1, 253, 2**14), 2**14)  # quotients above 2^-126
        b = np.abs(b)
        assert_bits(jax.jit(lambda b: constant_over(1.5, b))(b), F32(1.5) / b, "constant_over")
    with pytest.raises(ValueError, match="`c=0.0`"):
        constant_over(0.0, jnp.float32(1.0))


def test_divide_eagerly_and_broadcast():
    s = np.array([3.0, 7.0, 2.0**-140, 0.0], F32)
    with np.errstate(all="ignore"):
        assert_bits(divide(jnp.float32(1.0), jnp.asarray(s)), F32(1) / s, "eager")


def test_round_to_is_the_cast():
    """`round_to` (the `bf16` format's rounding, kept by XLA:GPU) gives the IEEE cast's
    bits (ml_dtypes', in NumPy: the spec's, not the backend's `convert`, which may flush
    subnormals on a TPU): every sign and exponent (subnormals, inf, NaN) with random and
    tie mantissas. A TPU writes a bfloat16 array's subnormals as ±0 whatever computed
    them (760 of these values on a v5e, 2026-12-05, after `round_to` rounded on the
    bits): there those, and only those, may be ±0."""
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2**32, 2**16, dtype=np.uint32)
    ties = (bits & ~np.uint32(0xFFFF)) | np.uint32(0x8000)  # exact halves of a bf16 step
    a = np.concatenate([bits, ties, np.arange(0, 2**32, 2**16, dtype=np.uint32)]).view(F32)
    got = np.asarray(jax.jit(lambda a: round_to(a, jnp.bfloat16))(a)).astype(F32)
    with np.errstate(all="ignore"):
        want = a.astype(jnp.bfloat16).astype(F32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    flush = bf16_arrays_flush()
    assert_bits_bf16_flush(got[~nan], want[~nan], "round_to vs the cast", flush)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_widen_is_the_cast(dtype):
    """`widen` (how the quantisers read bfloat16 and float16 inputs) gives NumPy's exact
    float32 value of every bit pattern, subnormals included, NaN kept NaN; on a TPU,
    which reads a bfloat16 array's subnormals as ±0 in every operation (a bitcast
    included), bfloat16's subnormals may be ±0."""
    a = np.arange(2**16, dtype=np.uint16).view(jnp.dtype(dtype))
    got = np.asarray(jax.jit(widen)(a))
    want = a.astype(F32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    flush = dtype == jnp.bfloat16 and bf16_arrays_flush()
    assert_bits_bf16_flush(got[~nan], want[~nan], f"widen({jnp.dtype(dtype).name})", flush)


# ---------------------------------------------------------------------------------------
# What XLA gets: no loose division, no loose float32 dot.
# ---------------------------------------------------------------------------------------

_LOC = re.compile(r"^(#loc\d+) = loc\((.*)\)$")
_FLOAT = r"(f16|bf16|f32|f64)"


def loose_arithmetic(text: str) -> list[str]:
    """The operations of a lowered program (StableHLO with debug locations) that a
    backend may compute loosely: a float `divide` outside `divide`'s name scope, a
    `dot_general` with a float32 (or wider) operand below `precision = HIGHEST`. (A cast
    pair `f32 -> bf16 -> f32`, which XLA:GPU removes, is harmless on exact values, as
    quantised operands are: the plugin's rerun below checks those bits instead.)"""
    locations = {}
    for line in text.splitlines():
        if m := _LOC.match(line.strip()):
            locations[m.group(1)] = m.group(2)

    def where(ref: str, seen: set) -> str:  # a location with those it refers to
        if ref in seen:
            return ""
        seen.add(ref)
        loc = locations.get(ref, "")
        return " ".join([loc, *(where(r, seen) for r in re.findall(r"#loc\d+", loc))])

    found = []
    for line in text.splitlines():
        op = line.split("=", 1)[-1]
        ref = re.search(r"loc\((#loc\d+)\)\s*$", line)
        if re.search(rf"stablehlo\.divide .*tensor<([0-9x]*){_FLOAT}>", op):
            if not ref or EXACT_DIVISION not in where(ref.group(1), set()):
                found.append(line.strip())
        elif "stablehlo.dot_general" in op:
            operands = op.rsplit(":", 1)[-1].split("->")[0]
            wide = re.search(r"x(f32|f64)>", operands)
            if wide and "precision = [HIGHEST, HIGHEST]" not in op:
                found.append(line.strip())
    return found


def _qdot_all_three(recipe, fast):
    def f(x, w):
        return nvfp4x.qdot(x, w, recipe=recipe, fast=fast)

    def all_three(x, w):
        return f(x, w), jax.grad(lambda x, w: jnp.sum(f(x, w)), argnums=(0, 1))(x, w)

    return all_three


def _programs():
    """`(name, function, number of arguments)`: `(32, 48)`, then `(16, 48)`."""
    key = jax.random.key(0)
    yield "to_nvfp4-1x16", lambda x: nvfp4x.to_nvfp4(x).dequantize(), 1
    yield (
        "to_nvfp4-16x16-stochastic",
        lambda x: nvfp4x.to_nvfp4(x, block=(16, 16), rounding="stochastic", key=key).dequantize(),
        1,
    )
    yield "fake_quantize-up", lambda x: nvfp4x.fake_quantize(x, scale_rounding="up"), 1
    yield "to_fp8", lambda x: nvfp4x.to_fp8(x).dequantize(), 1
    yield "to_mxfp8", lambda x: nvfp4x.to_mxfp8(x).dequantize(), 1
    yield "rht", nvfp4x.rht, 1
    for name, recipe in RECIPES.items():
        for fast in (True, False):
            path = "fast" if fast else "reference"
            yield f"qdot-{name}-{path}", _qdot_all_three(recipe(), fast), 2
    for name in ("nvfp4_inference", "nvfp4_weight_only", "fp8", "mxfp8"):
        linear = eqx.nn.Linear(48, 16, key=key)
        frozen = nvfp4x.freeze(nvfp4x.quantize(linear, RECIPES[name]()))
        yield f"frozen-{name}", jax.vmap(frozen), 1  # 32 tokens: a dot (few run a loop)


PROGRAMS = {name: (fn, nargs) for name, fn, nargs in _programs()}


@pytest.mark.parametrize("program", list(PROGRAMS), ids=list(PROGRAMS))
def test_no_loose_division_or_dot(program):
    fn, nargs = PROGRAMS[program]
    x = jnp.ones((32, 48), jnp.float32)
    args = (x, x[:16])[:nargs]
    text = jax.jit(fn).lower(*args).as_text(debug_info=True)
    if program.startswith("frozen-nvfp4") and _kernels.pick("frozen_gemm") == "mosaic":
        # A TPU's frozen GEMM is the Mosaic kernel (its dot is in the kernel's body,
        # checked bit for bit against the reference by tests/test_tpu_frozen_kernel.py)
        assert "nvfp4_frozen_matmul_tpu" in text
    elif program.startswith(("qdot", "frozen")):
        assert "stablehlo.dot_general" in text
    loose = loose_arithmetic(text)
    assert not loose, f"{program}: {len(loose)} loose operations, e.g. {loose[:2]}"


def test_the_check_finds_loose_arithmetic():
    """The check above is not vacuous: a bare `/` and a default-precision dot fail it."""
    x = jnp.ones((4, 4), jnp.float32)
    text = (
        jax.jit(lambda a: (a / 3.0, a @ a, divide(a, jnp.float32(3.0))))
        .lower(x)
        .as_text(debug_info=True)
    )
    loose = loose_arithmetic(text)
    assert len(loose) == 2 and "divide" in loose[0] and "dot_general" in loose[1], loose


# ---------------------------------------------------------------------------------------
# Random tensors give the spec's bits (355 of 480 under inexact
# division before the fix).
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [(1, 16), (16, 16)], ids=["1x16", "16x16"])
def test_random_tensors_match_the_spec(block):
    n = 240
    rng = np.random.default_rng(2024)
    x = rng.standard_normal((n, 32, 48)) * 2.0 ** rng.uniform(-30, 30, (n, 1, 1))
    x = (x * 2.0 ** rng.integers(-8, 1, (n, 32, 3)).repeat(16, axis=2)).astype(F32)
    q = jax.jit(jax.vmap(lambda t: nvfp4x.to_nvfp4(t, block=block)))(x)
    codes, scales, tensor_scale = unpack(q.codes), np.asarray(q.scales), q.tensor_scale
    for i in range(n):
        ref = ref_nvfp4(x[i], block)
        assert_bits(tensor_scale[i], ref.tensor_scale, f"tensor {i}: tensor scale")
        assert_bits(scales[i], ref.scales, f"tensor {i}: block scales")
        np.testing.assert_array_equal(codes[i], ref.codes, f"tensor {i}: codes")


# ---------------------------------------------------------------------------------------
# The format and GEMM tests under a GPU's arithmetic.
# ---------------------------------------------------------------------------------------


@pytest.mark.skipif(not UNDER_PLUGIN, reason=f"runs under `-p {PLUGIN}` only")
def test_the_plugin_is_loose():
    """Under the plugin, a bare division and a default-precision dot really are inexact,
    and a cast to bfloat16 and back is no rounding (so the tests run with it would see a
    library that leans on them); a `reduce_precision` still rounds."""
    a = np.random.default_rng(0).uniform(1, 2, (64, 64)).astype(F32)
    assert (np.asarray(jax.jit(lambda a: 1.0 / a)(a)) != F32(1) / a).mean() > 0.05
    assert (np.asarray(jax.jit(lambda a: a @ a)(a)) != a @ a).mean() > 0.5
    bf16 = jnp.bfloat16
    assert_bits(jax.jit(lambda a: a.astype(bf16).astype(jnp.float32))(a), a, "cast pair")
    rounded = a.astype(bf16).astype(F32)
    assert (rounded != a).mean() > 0.5
    assert_bits(jax.jit(lambda a: round_to(a, bf16).astype(jnp.float32))(a), rounded, "round_to")


#: Format and GEMM tests that decide bits with divisions, round by casting, or compare
#: GEMMs with a float32 reference, chosen from those that failed on an H200 (about 30 s of one core
#: in all; the rest of those files would take minutes).
UNDER_INEXACT_ARITHMETIC = [
    "tests/test_exactness.py::test_the_plugin_is_loose",
    "tests/test_exactness.py::test_random_tensors_match_the_spec",
    "tests/test_exactness.py::test_divide_matches_ieee",
    "tests/test_format.py::test_stochastic_is_unbiased",
    "tests/test_format.py::test_block_scale_rounding",
    "tests/test_format_inputs.py::test_reciprocals_match_ieee[jit]",
    "tests/test_format_inputs.py::test_tiny_under_vmap",
    "tests/test_fp8_tables.py::test_fp8_tensor_scaling_lands_on_the_table",
    "tests/test_gemm_jax.py::test_jvp_is_straight_through",
    "tests/test_gemm_reference.py::test_wgrad_with_rht_matches_reference[jit-reference]",
    "tests/test_gemm_reference.py::test_fast_matches_reference_path[bf16]",
]


#: Tests that move values between float types or meet subnormals, run again with
#: `tests/flush_subnormals.py` (a TPU's flushing of subnormals in casts,
#: `reduce_precision`, `abs`, `neg`; XLA:CPU flushes them in arithmetic already).
#: (`test_format_inputs.py::test_tiny_bfloat16`, half this run's time, is left to the
#: TPU runs: a TPU reads a bfloat16 array's subnormals as ±0 whatever the program does,
#: and `test_widen_is_the_cast` covers how bfloat16 inputs are read.)
UNDER_FLUSHED_SUBNORMALS = [
    "tests/test_exactness.py::test_round_to_is_the_cast",
    "tests/test_exactness.py::test_widen_is_the_cast",
    "tests/test_exactness.py::test_subnormal_probe_keeps_ieee_bits",
    "tests/test_fp8_tables.py::test_bits_and_values_follow_the_table",
]


def test_subnormal_probe_keeps_ieee_bits():
    """`benchmarks/subnormals.py` (run on a device to see what its backend flushes)
    finds nvfp4x's bit-level conversions giving IEEE's bits here."""
    from benchmarks.subnormals import main

    assert main() == 0


#: Each plugin with the tests run under it (one subprocess each: the cast-pair removal
#: of `inexact_arithmetic` looks for casts that feed casts, which the flushes between
#: them would hide).
UNDER_PLUGINS = {PLUGIN: UNDER_INEXACT_ARITHMETIC, FLUSH: UNDER_FLUSHED_SUBNORMALS}


@only_on("cpu", reason="the plugins change XLA:CPU's lowering")
@pytest.mark.parametrize("plugin", sorted(UNDER_PLUGINS))
def test_format_and_gemm_tests_under_inexact_arithmetic(plugin):
    path = os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    command = [sys.executable, "-m", "pytest", "-p", plugin, "-n", "0", "-q", "-x"]
    command += ["-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning"]
    result = subprocess.run(
        command + UNDER_PLUGINS[plugin],
        cwd=TESTS.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
