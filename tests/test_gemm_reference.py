"""The quantised GEMM (spec §5): fprop, dgrad and wgrad against an independent reference,
on every path (the fast path's bfloat16 operands against the float32 reference path too).

The reference (`tests/reference.py`, `ref_gemms`) is written from `shared/spec/nvfp4.md`
§2, §4 and §5 in NumPy (float32 quantiser, float64 GEMMs) with `ml_dtypes` casts; it never
calls into `nvfp4x`. Comparisons with it use a relative error (Frobenius norm of the
difference over the norm of the reference) of 1e-5: float32 summation order, far below
one element's quantisation step.

The GEMM's other tests: `test_gemm_vmap.py` (vmap and batching), `test_gemm_sr.py`
(stochastic rounding), `test_gemm_jax.py` (eager, jit, grad and the rest of JAX;
non-finite input).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    PLAIN,
    RECIPES,
    RTOL,
    K,
    N,
    T,
    assert_close,
    fasts,
    grad_layer_x,
    jit_call,
    jit_grad_layer_x,
    make_layer,
    normal_np,
    rel_err,
)
from reference import F32, ref_gemms, ref_quantize

import nvfp4x

# ---------------------------------------------------------------------------------------
# The three GEMMs against the reference.
# ---------------------------------------------------------------------------------------

XSHAPES = {"tokens": (T, K), "batch-seq": (3, 7, K), "one-example": (K,)}
GEMM_CASES = [
    ("tokens", "eager", True),
    ("tokens", "eager", False),
    ("tokens", "jit", True),
    ("tokens", "jit", False),
    ("batch-seq", "jit", True),
    ("batch-seq", "jit", False),
    ("one-example", "jit", True),
]


@pytest.mark.parametrize(
    "shape_id, mode, fast",
    GEMM_CASES,
    ids=[f"{s}-{m}-{'fast' if f else 'reference'}" for s, m, f in GEMM_CASES],
)
def test_gemms_match_reference(shape_id, mode, fast):
    """fprop, dgrad (dx), wgrad (dW) and the bias gradient through `QuantizedLinear`."""
    xshape = XSHAPES[shape_id]
    layer = make_layer(PLAIN, fast=fast)
    x = jnp.asarray(normal_np(1, xshape))
    g = jnp.asarray(normal_np(2, xshape[:-1] + (N,)))
    fwd = layer if mode == "eager" else functools.partial(jit_call, layer)
    grad = grad_layer_x if mode == "eager" else jit_grad_layer_x
    y = fwd(x)
    glayer, dx = grad(layer, x, g)

    x2, g2 = np.asarray(x).reshape(-1, K), np.asarray(g).reshape(-1, N)
    ry, rdx, rdw = ref_gemms(x2, np.asarray(layer.weight), g2)
    b = np.asarray(layer.bias, np.float64)
    assert y.dtype == jnp.float32 and y.shape == xshape[:-1] + (N,)
    assert_close(np.asarray(y).reshape(-1, N), ry + b, "fprop y")
    assert_close(np.asarray(dx).reshape(-1, K), rdx, "dgrad dx")
    assert_close(glayer.weight, rdw, "wgrad dW")
    assert_close(glayer.bias, g2.astype(np.float64).sum(0), "bias gradient")


def test_qdot_matches_reference():
    """The bare `qdot` with no layer around it."""
    x, w, g = normal_np(3, (T, K)), normal_np(4, (N, K)), normal_np(5, (T, N))

    def f(x, w):
        return jnp.sum(nvfp4x.qdot(x, w, recipe=PLAIN) * jnp.asarray(g))

    y = nvfp4x.qdot(jnp.asarray(x), jnp.asarray(w), recipe=PLAIN)
    dx, dw = jax.grad(f, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    ry, rdx, rdw = ref_gemms(x, w, g)
    assert_close(y, ry, "fprop")
    assert_close(dx, rdx, "dgrad")
    assert_close(dw, rdw, "wgrad")


def test_reference_detects_quantisation():
    """Sanity of the tolerance: the unquantised products are far outside it."""
    x, w, g = normal_np(3, (T, K)), normal_np(4, (N, K)), normal_np(5, (T, N))
    ry, rdx, rdw = ref_gemms(x, w, g)
    assert rel_err(x @ w.T, ry) > 100 * RTOL
    assert rel_err(g @ w, rdx) > 100 * RTOL
    assert rel_err(g.T @ x, rdw) > 100 * RTOL


def grid_data(seed: int, shape) -> np.ndarray:
    """Multiples of 1/8 in [-4, 4]: the Hadamard transform of these is exact in float32
    in any summation order, so the quantiser sees the same bits as the reference."""
    return (np.random.default_rng(seed).integers(-32, 33, shape) / 8).astype(F32)


RHT_CASES = [("jit", True), ("jit", False), ("eager", True)]


@fasts
def test_1x16_weight_blocks_run_along_each_gemms_contraction(fast):
    """With 1x16 weight blocks, fprop quantises W along k and dgrad along n (its own
    contraction axis); with 16x16 tiles both use one quantised weight (the reference above)."""
    recipe = nvfp4x.recipes.nvfp4_training(
        rht=False, stochastic_rounding=False, weight_block=(1, 16)
    )
    x, w, g = (normal_np(s, sh) for s, sh in ((21, (T, K)), (22, (N, K)), (23, (T, N))))

    @jax.jit
    def run(x, w):
        y = nvfp4x.qdot(x, w, recipe=recipe, fast=fast)
        dx = jax.grad(lambda x: jnp.sum(nvfp4x.qdot(x, w, recipe=recipe, fast=fast) * g))(x)
        return y, dx

    y, dx = run(jnp.asarray(x), jnp.asarray(w))
    xv, xs = ref_quantize(x, axis=1)
    wk, wks = ref_quantize(w, axis=1)
    wn, wns = ref_quantize(w, axis=0)
    gv, gs = ref_quantize(g, axis=1)
    assert_close(y, (xv @ wk.T) * (np.float64(xs) * np.float64(wks)), "fprop, W along k")
    assert_close(dx, (gv @ wn) * (np.float64(gs) * np.float64(wns)), "dgrad, W along n")
    # the two layouts give different numbers: the dgrad check is not vacuous
    assert rel_err(dx, (gv @ wk) * (np.float64(gs) * np.float64(wks))) > 100 * RTOL


@pytest.mark.parametrize(
    "mode, fast", RHT_CASES, ids=[f"{m}-{'fast' if f else 'reference'}" for m, f in RHT_CASES]
)
def test_wgrad_with_rht_matches_reference(mode, fast):
    recipe = nvfp4x.recipes.nvfp4_training(stochastic_rounding=False)
    assert recipe.rht
    layer = make_layer(recipe, fast=fast)
    x, g = grid_data(6, (T, K)), grid_data(7, (T, N))
    grad = grad_layer_x if mode == "eager" else jit_grad_layer_x
    glayer, dx = grad(layer, jnp.asarray(x), jnp.asarray(g))
    _, rdx, rdw = ref_gemms(x, np.asarray(layer.weight), g, rht=True)
    _, _, rdw_plain = ref_gemms(x, np.asarray(layer.weight), g, rht=False)
    assert_close(dx, rdx, "dgrad (no RHT there)")
    assert_close(glayer.weight, rdw, "wgrad with RHT")
    # The RHT changes the quantised wgrad: the check above is not vacuous.
    assert rel_err(rdw, rdw_plain) > 100 * RTOL


# ---------------------------------------------------------------------------------------
# fast (bfloat16 operands) against the float32 reference GEMMs, every recipe.
# ---------------------------------------------------------------------------------------


@pytest.fixture(params=["bfloat16", "float32"])
def gemm_dtype(request, monkeypatch):
    """Force the fast path's operand dtype. It is read when a GEMM is traced, so tests
    using this fixture trace afresh under `jax.jit` of a new function (an eager call
    could reuse a primitive's cached trace)."""
    monkeypatch.setenv("NVFP4X_GEMM_DTYPE", request.param)
    return request.param


def test_fast_gemm_dtype_is_the_one_traced(gemm_dtype):
    x, w = jnp.ones((16, 32)), jnp.ones((8, 32))
    recipe = nvfp4x.recipes.nvfp4_training()
    text = jax.jit(lambda x, w: nvfp4x.qdot(x, w, recipe=recipe)).lower(x, w).as_text()
    short = {"bfloat16": "bf16", "float32": "f32"}[gemm_dtype]
    assert f"(tensor<16x32x{short}>, tensor<8x32x{short}>) -> tensor<16x8xf32>" in text


def test_bad_gemm_dtype_env(monkeypatch):
    monkeypatch.setenv("NVFP4X_GEMM_DTYPE", "fp16")
    x, w = jnp.ones((16, 32)), jnp.ones((8, 32))
    recipe = nvfp4x.recipes.nvfp4_training()
    with pytest.raises(ValueError, match="NVFP4X_GEMM_DTYPE='fp16'"):
        jax.jit(lambda x, w: nvfp4x.qdot(x, w, recipe=recipe))(x, w)


@pytest.mark.parametrize("name", list(RECIPES), ids=list(RECIPES))
def test_fast_matches_reference_path(name, monkeypatch):
    """The fast path on bfloat16 operands (forced, so it is tested on every CPU) against
    the float32 reference."""
    monkeypatch.setenv("NVFP4X_GEMM_DTYPE", "bfloat16")
    recipe = RECIPES[name]()
    x, w, g = (jnp.asarray(normal_np(s, sh)) for s, sh in ((8, (T, K)), (9, (N, K)), (10, (T, N))))

    def run(fast):
        def f(x, w):
            return jnp.sum(nvfp4x.qdot(x, w, recipe=recipe, fast=fast) * g)

        # a new function under jit: traced now, with the forced dtype
        @jax.jit
        def all_three(x, w):
            return (nvfp4x.qdot(x, w, recipe=recipe, fast=fast), *jax.grad(f, (0, 1))(x, w))

        return all_three(x, w)

    for what, a, b in zip(("y", "dx", "dW"), run(True), run(False), strict=True):
        assert a.dtype == b.dtype == jnp.float32, what
        assert_close(a, b, f"{name} {what}")


def test_recipe_fields_used_by_reference():
    """The reference (`reference.ref_gemms`) implements `nvfp4_training(rht=False,
    stochastic_rounding=False)`."""
    f = nvfp4x.Format
    assert PLAIN.weight == f("nvfp4", (16, 16), "nearest")
    assert PLAIN.input == f("nvfp4", (1, 16), "nearest")
    assert PLAIN.grad == f("nvfp4", (1, 16), "nearest")
    assert PLAIN.rht is False
