"""Native low-precision GEMMs give the emulated GEMM's numbers, and one place picks them.

The `fp8` recipe's three GEMMs run on `float8_e4m3fn`/`float8_e5m2` operands (a
cuBLASLt FP8 GEMM on GPUs with FP8 tensor cores, here XLA:CPU's FP8 dot); NVFP4 and
MXFP8 GEMMs run as block-scaled GEMMs (`jax.nn.scaled_matmul` on Blackwell; here
`jax.lax.scaled_dot`, which XLA decomposes, fed the same codes and scales). The
quantised operands are the same numbers as the emulated GEMM's: the results may differ
by float32 summation order only, at most `2 K 2^-24 sum|a b|` for a contraction of `K`
(the tolerance asserted), and are bit for bit the same where all contractions are 16
long. Which implementation runs is `nvfp4x._kernels`'s choice per backend and CUDA
compute capability, tested here with the capability mocked.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_sums, normal, normal_np

import nvfp4x
from nvfp4x import _kernels
from nvfp4x._formats import Format, quantize_operand
from nvfp4x._gemm import wgrad_operands
from nvfp4x._kernels import _native

FP8 = nvfp4x.recipes.fp8()
BLOCK_RECIPES = {
    "nvfp4_training": nvfp4x.recipes.nvfp4_training(),  # 16x16 weight, RHT, SR
    "nvfp4_1x16": nvfp4x.recipes.nvfp4_training(weight_block=(1, 16), rht=False),
    "mxfp8": nvfp4x.recipes.mxfp8(),
}


def gemms(recipe, op: str, impl: str, x, w, g):
    """`(y, dx, dW)` of `qdot` traced with implementation `impl` of `op` (a new
    function under `jax.jit`), the emulated GEMMs on bfloat16 operands."""

    def all_three(x, w):
        def loss(x, w):
            return jnp.sum(nvfp4x.qdot(x, w, recipe=recipe) * g)

        return (nvfp4x.qdot(x, w, recipe=recipe), *jax.grad(loss, (0, 1))(x, w))

    with _kernels.use(op, impl), _kernels.use("gemm_operands", "bfloat16"):
        return jax.jit(all_three)(x, w)


quantize = jax.jit(quantize_operand, static_argnames=("fmt", "axis"))
split_blocks = jax.jit(_native.split_blocks, static_argnames="native")


def summation_bound(recipe, x, w, g) -> tuple[np.ndarray, ...]:
    """For `(y, dx, dW)` of a recipe with nearest rounding: `2 K 2^-24 sum|a b|` per
    output, from the quantised operands times their tensor scales (wgrad's after the
    RHT, when the recipe has it)."""

    def q(a, fmt, axis):
        v, s = quantize(a, fmt=fmt, axis=axis)
        return np.abs(np.asarray(v, np.float64)) * (1.0 if s is None else float(s))

    gt, xt = wgrad_operands(g, x, recipe)
    eps = 2.0 * 2.0**-24
    return (
        eps * x.shape[1] * q(x, recipe.input, -1) @ q(w, recipe.weight, -1).T,
        eps * w.shape[0] * q(g, recipe.grad, -1) @ q(w, recipe.weight, 0),
        eps * gt.shape[0] * q(gt, recipe.grad, 0).T @ q(xt, recipe.input, 0),
    )


#: Cases that failed on an NVIDIA H200 (jax 0.11.2) in the one GPU run of these tests
#: (the run was cut before their tracebacks were written): the native FP8 GEMM beyond
#: the summation-order bound, `split_blocks` of NVFP4 operands (used only on
#: Blackwell). They pass on the CPU. The FP8 GEMM then ran at DEFAULT precision, for
#: which XLA:GPU asks cuBLASLt for FP8 fast accumulation (partial sums in less than
#: float32); it now asks HIGHEST (float32 accumulation): not yet rerun on a GPU. Native
#: FP8 stays opt-in until it is (`_kernels`).
FAILED_ON_H200 = pytest.mark.xfail(
    jax.default_backend() == "gpu",
    reason="failed on an H200, not yet diagnosed (see FAILED_ON_H200)",
    strict=False,
)
# --- the choice ---


@pytest.mark.parametrize(
    "cc,fp8,block_scaled",
    [
        (None, "xla", "xla"),
        ("8.0", "xla", "xla"),  # A100: no FP8 tensor cores
        ("8.6", "xla", "xla"),
        ("8.9", "xla", "xla"),  # Ada (native FP8: opt-in, see `_kernels`)
        ("9.0", "xla", "xla"),  # H100, H200
        ("10.0", "xla", "scaled_matmul"),  # B200
        ("12.0", "xla", "scaled_matmul"),  # RTX Blackwell
    ],
    ids=["none", "8.0", "8.6", "8.9", "9.0", "10.0", "12.0"],
)
def test_gemm_defaults_follow_the_compute_capability(monkeypatch, cc, fp8, block_scaled):
    monkeypatch.setattr(_kernels, "capability", lambda: cc)
    assert _kernels.pick("fp8_gemm", "gpu") == fp8
    assert _kernels.pick("block_scaled_gemm", "gpu") == block_scaled
    assert _kernels.pick("gemm_operands", "gpu") == "bfloat16"
    assert _kernels.pick("fp8_gemm", "cpu") == _kernels.pick("block_scaled_gemm", "cpu") == "xla"
    with _kernels.use("fp8_gemm", "xla"), _kernels.use("block_scaled_gemm", "lax_scaled_dot"):
        assert _kernels.pick("fp8_gemm", "gpu") == "xla"
        assert _kernels.pick("block_scaled_gemm", "gpu") == "lax_scaled_dot"


def test_capability_is_a_cuda_version_or_none():
    cc = _kernels.capability()
    if jax.default_backend() == "cpu":
        assert cc is None
    else:
        assert cc is None or cc.replace(".", "").isdigit()


def test_gemm_operand_dtype_is_picked_in_kernels(monkeypatch):
    monkeypatch.delenv(_kernels.GEMM_DTYPE_ENV, raising=False)
    with _kernels.use("gemm_operands", "bfloat16"):
        assert nvfp4x._formats.gemm_dtype(True) == jnp.bfloat16
        assert nvfp4x._formats.gemm_dtype(False) is None  # fast=False: the reference
    monkeypatch.setenv(_kernels.GEMM_DTYPE_ENV, "float32")
    assert nvfp4x._formats.fast_gemm_dtype() == jnp.float32
    with _kernels.use("gemm_operands", "bfloat16"):  # `use` overrides the environment
        assert nvfp4x._formats.fast_gemm_dtype() == jnp.bfloat16


@pytest.mark.parametrize("cc,native", [("8.6", False), ("9.0", True)], ids=["8.6", "9.0"])
def test_fp8_recipe_traces_the_native_gemm_on_fp8_gpus(monkeypatch, cc, native):
    """With the backend and capability mocked and native FP8 on by default (as it will
    be once it measures faster): an FP8 `dot_general` in all three GEMMs exactly where
    the device has FP8 tensor cores, and never with `fast=False`."""
    monkeypatch.setattr(_kernels, "backend", lambda: "gpu")
    monkeypatch.setattr(_kernels, "capability", lambda: cc)
    monkeypatch.setattr(_kernels, "NATIVE_FP8_BY_DEFAULT", True)
    x, w = jnp.ones((32, 48)), jnp.ones((16, 48))

    def text(fast):
        def step(x, w):
            y, vjp = jax.vjp(lambda x, w: nvfp4x.qdot(x, w, recipe=FP8, fast=fast), x, w)
            return y, vjp(y)

        return jax.jit(step).lower(x, w).as_text()

    fp8_dots = [line for line in text(True).splitlines() if "dot_general" in line and "f8E" in line]
    assert len(fp8_dots) == (3 if native else 0), fp8_dots
    if native:
        assert "f8E" not in "".join(ln for ln in text(False).splitlines() if "dot_general" in ln)


def test_scaled_matmul_off_a_gpu_names_the_alternative():
    x, w = normal(0, (16, 32)), normal(1, (8, 32))
    recipe = BLOCK_RECIPES["nvfp4_1x16"]
    if jax.default_backend() == "gpu":
        pytest.skip("jax.nn.scaled_matmul runs on this backend")
    with (
        _kernels.use("block_scaled_gemm", "scaled_matmul"),
        pytest.raises(ValueError, match="lax_scaled_dot"),
    ):
        jax.jit(lambda x, w: nvfp4x.qdot(x, w, recipe=recipe))(x, w)


# --- the numbers ---


def test_fp8_native_is_bit_for_bit_the_emulated_gemm_at_contractions_of_16():
    """All three contractions 16 long (T = K = N = 16): the same bits, jitted and eagerly,
    and the lowered program does run FP8 dots."""
    x, w, g = normal(0, (16, 16)), normal(1, (16, 16)), normal(2, (16, 16))
    want = gemms(FP8, "fp8_gemm", "xla", x, w, g)
    got = gemms(FP8, "fp8_gemm", "native", x, w, g)
    for what, a, b in zip(("y", "dx", "dW"), got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=what)
    with _kernels.use("fp8_gemm", "native"), _kernels.use("gemm_operands", "bfloat16"):
        eager = nvfp4x.qdot(x, w, recipe=FP8)  # the primitive's own compiled computation
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(want[0]), err_msg="eager y")


def test_native_fp8_dots_ask_for_float32_accumulation():
    """Every FP8 dot of the native GEMMs (fprop, dgrad, wgrad) asks for HIGHEST
    precision: at DEFAULT, XLA:GPU runs cuBLASLt's FP8 fast accumulation, whose partial
    sums are narrower than float32."""
    x, w = normal(0, (32, 48)), normal(1, (16, 48))

    def loss(x, w):
        return jnp.sum(nvfp4x.qdot(x, w, recipe=FP8) ** 2)

    with _kernels.use("fp8_gemm", "native"), _kernels.use("gemm_operands", "bfloat16"):
        text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line and "f8E" in line]
    assert len(dots) == 3, dots  # fprop, dgrad, wgrad
    assert all("HIGHEST" in line for line in dots), dots


@pytest.mark.parametrize(
    "recipe,op,impl",
    [
        pytest.param(FP8, "fp8_gemm", "native", marks=FAILED_ON_H200),
        *((r, "block_scaled_gemm", "lax_scaled_dot") for r in BLOCK_RECIPES.values()),
    ],
    ids=["fp8", *BLOCK_RECIPES],
)
def test_native_gemms_equal_the_emulated_ones_up_to_summation_order(recipe, op, impl):
    """Edge shapes: tokens, k and n not multiples of 16 or 32 (the block-scaled GEMM
    pads its contraction with zero blocks). On a CPU `lax.scaled_dot` decomposes an
    NVFP4 GEMM into the emulated GEMM on bfloat16 operands: the same bits
    (stochastically rounded `dy` included; MXFP8's padding to 32 changes the order)."""
    x, w, g = normal(3, (40, 72)), normal(4, (24, 72)), normal(5, (40, 24))
    want = gemms(recipe, op, "xla", x, w, g)
    got = gemms(recipe, op, impl, x, w, g)
    for what, a, b in zip(("y", "dx", "dW"), got, want, strict=True):
        assert np.isfinite(np.asarray(a)).all(), what
        if recipe.input.name == "nvfp4" and jax.default_backend() == "cpu":
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=what)
    if recipe.grad.rounding == "nearest":
        bounds = summation_bound(recipe, x, w, g)
        for what, a, b, bound in zip(("y", "dx", "dW"), got, want, bounds, strict=True):
            diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
            assert np.all(diff <= bound), (what, np.max(diff - bound))


def test_native_fp8_gemm_keeps_non_finite_values_non_finite():
    """(A block-scaled GEMM's NaN blocks get NaN scales: `test_split_blocks_...`.)"""
    recipe = FP8
    x = normal_np(6, (32, 48))
    x[3, 5] = np.nan
    x[7, 40] = np.inf
    w = normal(7, (16, 48))
    with _kernels.use("fp8_gemm", "native"):
        y = jax.jit(lambda x, w: nvfp4x.qdot(x, w, recipe=recipe))(jnp.asarray(x), w)
    y = np.asarray(y)
    assert np.isnan(y[[3, 7]]).all()
    assert np.isfinite(np.delete(y, [3, 7], axis=0)).all()


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("nvfp4", marks=FAILED_ON_H200),
        pytest.param("nvfp4_sr", marks=FAILED_ON_H200),
        "mxfp8",
    ],
)
def test_split_blocks_writes_the_quantised_values_exactly(name):
    """Every block of a quantised operand becomes codes x one block scale with exactly
    its values: blocks of every magnitude (subnormal E4M3 scales, the largest code
    below 6 after stochastic rounding), zero blocks; a NaN block and values no block of
    the format holds get a NaN scale. (On a TPU v5e the blocks with subnormal E4M3
    scales came back as zeros while the split took its scales by XLA's converts; it
    takes them by bit arithmetic since, and passes there: 2026-12-06.)"""
    x = normal_np(8, (24, 64)) * np.exp2(np.arange(-12, 12)[:, None]).astype(np.float32)
    x[2] = 0.0
    x[5, 17] = np.nan
    fmt = {
        "nvfp4": Format("nvfp4"),
        "nvfp4_sr": Format("nvfp4", rounding="stochastic"),
        "mxfp8": Format("mxfp8"),
    }[name]
    key = jax.random.key(0) if fmt.rounding == "stochastic" else None
    values, _ = quantize(jnp.asarray(x), fmt=fmt, axis=-1, key=key)
    native = fmt.spec.native
    codes, scales = split_blocks(values, native)
    assert codes.dtype == native.element and scales.dtype == native.scale
    block = native.block
    back = codes.astype(jnp.float32) * jnp.repeat(scales.astype(jnp.float32), block, axis=-1)
    v, b = np.asarray(values, np.float32), np.asarray(back)
    nan_blocks = np.isnan(v).reshape(24, -1, block).any(-1)
    np.testing.assert_array_equal(np.isnan(np.asarray(scales, np.float32)), nan_blocks)
    finite = ~np.repeat(nan_blocks, block, axis=-1)
    np.testing.assert_array_equal(b[finite].view(np.uint32), v[finite].view(np.uint32))
    if name == "nvfp4":  # a block no NVFP4 block holds (1.001 x 7 and 1.001 x 1)
        odd = jnp.asarray([[7.007, 1.001] + [0.0] * (block - 2)], jnp.float32)
        assert np.isnan(np.asarray(split_blocks(odd, native)[1], np.float32)).all()


def test_frozen_fp8_layer_runs_the_native_gemm_as_the_unfrozen_one():
    """Frozen == unfrozen with the native FP8 GEMM picked (32 tokens: not the CPU's
    few-token path): bit for bit on a CPU, up to float32 summation order elsewhere (two
    programs: `assert_same_sums`)."""
    layer = nvfp4x.quantize(eqx.nn.Linear(48, 24, key=jax.random.key(0)), FP8)
    frozen = nvfp4x.freeze(layer)
    x = normal(9, (32, 48))
    with _kernels.use("fp8_gemm", "native"), _kernels.use("gemm_operands", "bfloat16"):
        text = jax.jit(jax.vmap(frozen)).lower(x).as_text()
        got = jax.jit(jax.vmap(frozen))(x)
        want = jax.jit(jax.vmap(layer))(x)
    assert any("dot_general" in ln and "f8E4M3" in ln for ln in text.splitlines())
    assert_same_sums(got, want, "frozen vs unfrozen, native FP8 GEMM")
