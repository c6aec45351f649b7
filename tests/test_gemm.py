"""The quantised GEMM (spec §5): fprop, dgrad and wgrad against an independent reference,
and how the GEMM composes with JAX's transformations.

The reference below is written from `shared/spec/nvfp4.md` §2, §4 and §5 in NumPy
(float32 quantiser, float64 GEMMs) with `ml_dtypes` casts; it never calls into `nvfp4x`.
Comparisons with it use a relative error (Frobenius norm of the difference over the norm
of the reference) of 1e-5: float32 summation order, far below one element's
quantisation step. Comparisons between two runs of the library (vmap vs batch, eager vs
jit, checkpoint, per-example gradients) are bit for bit; `lax.scan` vs an unrolled loop
is compared to float32 rounding (XLA fuses a scan body differently).
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from helpers import RECIPES, assert_same, assert_trees_same, normal_np

import nvfp4x

# ---------------------------------------------------------------------------------------
# The NumPy reference (spec §2, §4, §5), independent of nvfp4x.
# ---------------------------------------------------------------------------------------

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max
E4M3 = ml_dtypes.float8_e4m3fn
E2M1 = ml_dtypes.float4_e2m1fn
#: Transformer Engine's RHT sign vector (spec §4).
TE_SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], np.float64)
RTOL = 1e-5


def ref_quantize(a, axis: int = -1, tile: bool = False):
    """Spec §2 with round to nearest even: `(block values, s_dec)`.

    `block values` are `e2m1_value * block_scale` (exact; float64 here) in `a`'s shape, so
    the dequantised tensor is `values * s_dec`. 1x16 blocks run along `axis`; `tile=True`
    uses 16x16 tiles of a 2-D weight. Padding is zeros.
    """
    a = np.asarray(a, F32)
    if tile:
        r, c = a.shape
        ap = np.pad(a, [(0, -r % 16), (0, -c % 16)])
        blocks = ap.reshape(ap.shape[0] // 16, 16, ap.shape[1] // 16, 16)
        axes = (1, 3)
    else:
        a = np.moveaxis(a, axis, -1)
        n = a.shape[-1]
        ap = np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, -n % 16)])
        blocks = ap.reshape(*ap.shape[:-1], ap.shape[-1] // 16, 16)
        axes = (-1,)
    with np.errstate(all="ignore"):
        amax = F32(np.max(np.abs(ap), initial=F32(0)))
        s_enc = np.minimum(F32(2688) / amax, FLT_MAX)
        if amax == 0 or s_enc == 0:
            s_enc = F32(1)
        s_dec = F32(1) / s_enc
        bamax = np.max(np.abs(blocks), axis=axes, keepdims=True)
        # Clamp to 448 before the E4M3 cast (ml_dtypes maps > 464 to NaN).
        sb = np.minimum(bamax * (s_enc * (F32(1) / F32(6))), F32(448))
        sb = sb.astype(E4M3).astype(F32)
        inv = np.minimum(F32(1) / (sb * s_dec), FLT_MAX)
        codes = np.clip(blocks * inv, F32(-6), F32(6)).astype(E2M1).astype(F32)
    vals = (codes * sb).astype(np.float64).reshape(ap.shape)
    if tile:
        return vals[:r, :c], s_dec
    return np.moveaxis(vals[..., :n], -1, axis), s_dec


def ref_deq(a, axis: int = -1, tile: bool = False) -> np.ndarray:
    vals, s = ref_quantize(a, axis, tile)
    return vals * np.float64(s)


def ref_rht_tokens(a: np.ndarray) -> np.ndarray:
    """`H = diag(s) @ H16 / 4` applied to each chunk of 16 rows (tokens) of a 2-D array,
    rows zero-padded to a multiple of 16 (spec §4). Float64, returned as float32."""
    h16 = np.ones((1, 1))
    while h16.shape[0] < 16:
        h16 = np.block([[h16, h16], [h16, -h16]])
    h = TE_SIGNS[:, None] * h16 / 4
    a = np.asarray(a, np.float64)
    ap = np.pad(a, [(0, -a.shape[0] % 16), (0, 0)])
    chunks = ap.reshape(-1, 16, ap.shape[1])
    return np.einsum("ij,cjk->cik", h, chunks).reshape(ap.shape).astype(F32)


def ref_gemms(x, w, g, *, rht: bool = False):
    """The three GEMMs of `nvfp4_training(rht=..., stochastic_rounding=False)`.

    `x: (t, k)`, `w: (n, k)`, `g = dy: (t, n)`. Each operand has its own tensor scale.
    """
    x, w, g = (np.asarray(v, F32) for v in (x, w, g))
    xv, xs = ref_quantize(x, axis=1)  # x along k
    wv, ws = ref_quantize(w, tile=True)  # W 16x16
    gv, gs = ref_quantize(g, axis=1)  # dy along n
    y = (xv @ wv.T) * (np.float64(xs) * np.float64(ws))
    dx = (gv @ wv) * (np.float64(gs) * np.float64(ws))
    if rht:
        g, x = ref_rht_tokens(g), ref_rht_tokens(x)
    gt, gts = ref_quantize(g, axis=0)  # dy along t
    xt, xts = ref_quantize(x, axis=0)  # x along t
    dw = (gt.T @ xt) * (np.float64(gts) * np.float64(xts))
    return y, dx, dw


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def assert_close(got, want, what: str, rtol: float = RTOL) -> None:
    err = rel_err(got, want)
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol:g}"


# ---------------------------------------------------------------------------------------
# Helpers.
# ---------------------------------------------------------------------------------------

PLAIN = nvfp4x.recipes.nvfp4_training(rht=False, stochastic_rounding=False)
TRAIN = nvfp4x.recipes.nvfp4_training()
# Token and feature sizes that are not multiples of 16.
T, K, N = 37, 40, 24


def make_layer(recipe, k=K, n=N, *, fast=True, use_bias=True, seed=0, dtype=jnp.float32):
    lin = eqx.nn.Linear(k, n, use_bias=use_bias, key=jax.random.key(seed), dtype=dtype)
    if use_bias:  # a bias that is not tiny, so that adding it in float32 is visible
        lin = eqx.tree_at(lambda m: m.bias, lin, jnp.asarray(normal_np(seed + 1, (n,)), dtype))
    q = nvfp4x.quantize(lin, recipe, fast=fast)
    assert isinstance(q, nvfp4x.QuantizedLinear)
    return q


def cot_loss(layer, x, g, key=None):
    """`sum(layer(x) * g)`: its output gradient `dy` is exactly `g`."""
    return jnp.sum(layer(x, key=key).astype(jnp.float32) * g)


grad_layer_x = jax.grad(cot_loss, argnums=(0, 1))
jit_grad_layer_x = jax.jit(grad_layer_x)
jit_call = jax.jit(lambda m, x: m(x))

fasts = pytest.mark.parametrize("fast", [True, False], ids=["fast", "reference"])


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


# ---------------------------------------------------------------------------------------
# vmap-transparent numerics: bit for bit.
# ---------------------------------------------------------------------------------------


def test_vmap_equals_batch_call():
    layer = make_layer(TRAIN)
    xs = jnp.asarray(normal_np(11, (6, K)))
    assert_same(jax.vmap(layer)(xs), layer(xs), "vmap over tokens")
    xs3 = jnp.asarray(normal_np(12, (4, 5, K)))
    assert_same(jax.vmap(layer)(xs3), layer(xs3), "vmap over examples (seq, k)")


def test_nested_vmap_equals_batch_call():
    layer = make_layer(TRAIN)
    xs = jnp.asarray(normal_np(13, (3, 5, K)))
    assert_same(jax.vmap(jax.vmap(layer))(xs), layer(xs), "vmap(vmap(layer))")
    assert_same(
        jax.jit(jax.vmap(jax.vmap(layer)))(xs), jit_call(layer, xs), "jit(vmap(vmap(layer)))"
    )


class TwoLayer(eqx.Module):
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, d, h, key):
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(d, h, key=k1)
        self.fc2 = eqx.nn.Linear(h, d, key=k2)

    def __call__(self, x, *, key=None):
        keys = (None, None) if key is None else tuple(jax.random.split(key))
        return self.fc2(jax.nn.gelu(self.fc1(x, key=keys[0])), key=keys[1])


@pytest.mark.parametrize("use_key", [False, True], ids=["no-key", "key"])
def test_weight_gradient_of_vmapped_model_equals_batched(use_key):
    model = nvfp4x.quantize(TwoLayer(K, N, jax.random.key(1)), TRAIN)
    xs = jnp.asarray(normal_np(14, (4, 9, K)))
    g = jnp.asarray(normal_np(15, (4, 9, K)))
    key = jax.random.key(7) if use_key else None

    def loss_vmap(m):
        return jnp.sum(jax.vmap(lambda x: m(x, key=key))(xs) * g)

    def loss_batch(m):
        return jnp.sum(m(xs, key=key) * g)

    gv = eqx.filter_jit(eqx.filter_grad(loss_vmap))(model)
    gb = eqx.filter_jit(eqx.filter_grad(loss_batch))(model)
    assert_trees_same(gv, gb, "grad of vmapped model vs batched call")


def test_vmap_of_grad_gives_per_example_gradients():
    layer = make_layer(TRAIN)
    xs = jnp.asarray(normal_np(16, (4, 7, K)))
    gs = jnp.asarray(normal_np(17, (4, 7, N)))
    gl, gx = jax.jit(jax.vmap(grad_layer_x, in_axes=(None, 0, 0)))(layer, xs, gs)
    assert gl.weight.shape == (4, N, K)
    for i in range(4):
        li, xi = jit_grad_layer_x(layer, xs[i], gs[i])
        assert_same(gl.weight[i], li.weight, f"example {i}: dW")
        assert_same(gl.bias[i], li.bias, f"example {i}: db")
        assert_same(gx[i], xi, f"example {i}: dx")
    # Not the batch's total gradient handed to every example.
    total = jit_grad_layer_x(layer, xs, gs)[0].weight
    assert not np.allclose(np.asarray(gl.weight[0]), np.asarray(total))


def test_eager_equals_jit():
    # Without a bias the GEMMs give the same bits eagerly and under jit.
    layer = make_layer(TRAIN, use_bias=False)
    x, g = jnp.asarray(normal_np(18, (T, K))), jnp.asarray(normal_np(19, (T, N)))
    assert_same(layer(x), jit_call(layer, x), "fprop")
    assert_same(layer(x), eqx.filter_jit(layer)(x), "fprop (filter_jit)")
    assert_trees_same(grad_layer_x(layer, x, g), jit_grad_layer_x(layer, x, g), "grads")


def test_eager_and_jit_with_bias_differ_by_at_most_one_fused_rounding():
    # Under jit XLA fuses `acc * scale + bias` (an FMA on CPU): one rounding fewer than
    # the eager sequence, so outputs may differ by one float32 ulp, never more.
    layer = make_layer(TRAIN)
    x = jnp.asarray(normal_np(18, (T, K)))
    eager, jitted = np.asarray(layer(x)), np.asarray(jit_call(layer, x))
    bias = np.asarray(layer.bias)
    # eager rounds the product and then the sum, the FMA only the sum: at most one ulp
    # of each summand apart
    ulp = np.spacing(np.maximum(np.abs(eager - bias), np.abs(bias)).astype(F32))
    assert np.all(np.abs(eager - jitted) <= 2 * ulp)
    assert not np.array_equal(eager, np.zeros_like(eager))


def test_vmap_over_stacked_weights_is_independent_layers():
    """A vmapped weight (ensemble / stacked layers): independent problems."""
    lins = eqx.filter_vmap(lambda k: eqx.nn.Linear(K, N, key=k))(
        jax.random.split(jax.random.key(2), 3)
    )
    stack = nvfp4x.quantize(lins, TRAIN)
    assert stack.weight.shape == (3, N, K)
    x = jnp.asarray(normal_np(20, (5, K)))
    ys = eqx.filter_vmap(lambda lay: lay(x))(stack)
    params, static = eqx.partition(stack, eqx.is_array)
    for i in range(3):
        one = eqx.combine(jax.tree_util.tree_map(lambda a, i=i: a[i], params), static)
        assert_same(ys[i], one(x), f"stacked layer {i}")


# ---------------------------------------------------------------------------------------
# Stochastic rounding.
# ---------------------------------------------------------------------------------------


def test_sr_same_key_same_gradients_different_keys_differ():
    layer = make_layer(TRAIN)
    x, g = jnp.asarray(normal_np(21, (T, K))), jnp.asarray(normal_np(22, (T, N)))
    k1, k2 = jax.random.key(1), jax.random.key(2)
    a = jit_grad_layer_x(layer, x, g, k1)
    b = jit_grad_layer_x(layer, x, g, k1)
    c = jit_grad_layer_x(layer, x, g, k2)
    assert_trees_same(a, b, "same key")
    assert not np.array_equal(np.asarray(a[1]), np.asarray(c[1])), "dx: keys ignored"
    assert not np.array_equal(np.asarray(a[0].weight), np.asarray(c[0].weight)), "dW: keys ignored"


def test_sr_without_key_is_reproducible():
    layer = make_layer(TRAIN)
    x, g = jnp.asarray(normal_np(23, (T, K))), jnp.asarray(normal_np(24, (T, N)))
    assert_trees_same(grad_layer_x(layer, x, g), grad_layer_x(layer, x, g), "same dy, no key")
    assert_trees_same(
        jit_grad_layer_x(layer, x, g), jit_grad_layer_x(layer, x, g), "same dy, no key, jit"
    )


def test_sr_training_loop_without_key_draws_fresh_rounding():
    """An optimiser loop that never mentions keys: wgrad's stochastic rounding differs
    from step to step. With the same `x` and `dy` every step, the round-to-nearest wgrad
    `Q(H dy)^T Q(H x)` does not depend on the weight at all, so any change between steps
    is fresh rounding."""
    x, g = jnp.asarray(normal_np(25, (T, K))), jnp.asarray(normal_np(26, (T, N)))
    opt = optax.sgd(1e-3)

    def run(recipe):
        layer = make_layer(recipe)
        state = opt.init(layer)
        dws = []
        for _ in range(3):
            grads, _ = jit_grad_layer_x(layer, x, g)
            dws.append(np.asarray(grads.weight))
            updates, state = opt.update(grads, state)
            layer = eqx.apply_updates(layer, updates)
        return dws

    rn = run(nvfp4x.recipes.nvfp4_training(stochastic_rounding=False))
    assert all(np.array_equal(rn[0], d) for d in rn[1:])  # the premise
    sr = run(TRAIN)
    for i in range(len(sr)):
        for j in range(i):
            assert not np.array_equal(sr[i], sr[j]), f"steps {j} and {i} rounded alike"


# dy -> 2*dy and dy -> -dy leave the scaled values of the quantiser unchanged up to an
# exact factor (the tensor scale doubles / the signs flip), so with the same thresholds
# `grad(c * dy) == c * grad(dy)` exactly. Without a key the thresholds are seeded by the
# weight (documented: fresh every optimiser step, identical on every device layout, shared
# by microbatches of one step), so the identity holds; distinct keys break it.
CHANGES = {"double": 2.0, "negate": -1.0}


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
@pytest.mark.parametrize("which", ["dx", "dW"])
def test_sr_thresholds_follow_weight_and_key_not_dy(change, which):
    c = CHANGES[change]
    x, g = jnp.asarray(normal_np(27, (T, K))), jnp.asarray(normal_np(28, (T, N)))
    layer = make_layer(TRAIN)

    def pick(grads):
        return np.asarray(grads[1] if which == "dx" else grads[0].weight)

    sr1, sr2 = pick(jit_grad_layer_x(layer, x, g)), pick(jit_grad_layer_x(layer, x, c * g))
    np.testing.assert_array_equal(sr2, np.float32(c) * sr1)

    # (the key is an argument of the jitted gradient: one compilation for both keys, and
    # for every case of this test)
    k1, k2 = (pick(jit_grad_layer_x(layer, x, g, jax.random.key(i))) for i in (1, 2))
    assert not np.array_equal(k1, k2), f"{which}: different keys rounded alike"


def sr_problem():
    """`dy` with a ±2688 element in every 1x16 block along n *and* along t (and sizes that
    are multiples of 16): every block scale is exactly 448 and the tensor scale 1, so
    no element saturates and stochastic rounding is exactly unbiased."""
    t, n, k = 32, 32, 24
    rng = np.random.default_rng(29)
    u = rng.uniform(-6, 6, (t, n))
    tt, nn = np.meshgrid(np.arange(t), np.arange(n), indexing="ij")
    u = np.where((tt - nn) % 16 == 0, 6.0 * rng.choice([-1.0, 1.0], (t, n)), u)
    g = (448 * u).astype(F32)
    x = normal_np(30, (t, k))
    return x, g


def test_sr_is_unbiased():
    """Mean over keys of dx and dW approaches the rounding-free value (dy unquantised, the
    other operand quantised as usual) better than any single draw, and at the 1/sqrt(K)
    rate of independent unbiased draws."""
    recipe = nvfp4x.recipes.nvfp4_training(rht=False)
    x, g = sr_problem()
    layer = make_layer(recipe, k=x.shape[1], n=g.shape[1], use_bias=False)
    w = np.asarray(layer.weight)
    want_dx = g.astype(np.float64) @ ref_deq(w, tile=True)
    want_dw = g.astype(np.float64).T @ ref_deq(x, axis=0)
    nkeys = 64
    dxs, dws = [], []
    for i in range(nkeys):
        gl, dx = jit_grad_layer_x(layer, jnp.asarray(x), jnp.asarray(g), jax.random.key(100 + i))
        dxs.append(np.asarray(dx, np.float64))
        dws.append(np.asarray(gl.weight, np.float64))
    for what, draws, want in (("dx", dxs, want_dx), ("dW", dws, want_dw)):
        single = np.array([np.linalg.norm(d - want) for d in draws])
        mean_err = np.linalg.norm(np.mean(draws, axis=0) - want)
        rms = np.sqrt(np.mean(single**2))
        assert single.min() > 0, f"{what}: a draw without rounding error?"
        assert mean_err < single.min(), f"{what}: mean {mean_err:.4g} vs best {single.min():.4g}"
        # Independent unbiased draws: E|mean - want|^2 = rms^2 / K. The norms of these
        # ~1000-element errors concentrate; 2x leaves ample room for chance, not for bias.
        assert mean_err < 2 * rms / np.sqrt(nkeys), f"{what}: {mean_err:.4g} vs {rms:.4g}"


# ---------------------------------------------------------------------------------------
# Composition with JAX / Equinox / optax: one test each.
# ---------------------------------------------------------------------------------------


def test_jit_and_filter_jit():
    model = nvfp4x.quantize(TwoLayer(K, N, jax.random.key(3)), TRAIN)
    x = jnp.asarray(normal_np(31, (T, K)))
    y = eqx.filter_jit(model)(x)
    assert_same(y, jax.jit(lambda m, x: m(x))(model, x), "filter_jit vs jax.jit")
    assert_close(y, model(x), "jit vs eager")  # bit for bit: test_eager_equals_jit


def test_grad_and_filter_grad():
    layer = make_layer(TRAIN)
    x, g = jnp.asarray(normal_np(32, (T, K))), jnp.asarray(normal_np(33, (T, N)))
    gf = eqx.filter_jit(eqx.filter_grad(cot_loss))(layer, x, g)
    gj, _ = jit_grad_layer_x(layer, x, g)
    assert isinstance(gf, nvfp4x.QuantizedLinear) and gf.recipe == TRAIN
    assert gf.weight.shape == layer.weight.shape and gf.bias.shape == layer.bias.shape
    assert all(np.all(np.isfinite(np.asarray(v))) for v in jax.tree_util.tree_leaves(gf))
    assert_trees_same(gf, gj, "filter_grad vs jax.grad")


def test_vmap_composes():
    """`jax.vmap` of a whole quantised model (per-example calls) equals the batched call."""
    model = nvfp4x.quantize(TwoLayer(K, N, jax.random.key(5)), TRAIN)
    xs = jnp.asarray(normal_np(34, (6, 3, K)))
    assert_same(jax.vmap(model)(xs), model(xs), "vmap(model)")


def test_scan_over_stacked_layers_matches_unrolled_loop():
    d, nlayers = 24, 2
    keys = jax.random.split(jax.random.key(6), nlayers)
    stack = eqx.filter_vmap(lambda k: eqx.nn.Linear(d, d, key=k))(keys)
    qstack = nvfp4x.quantize(stack, TRAIN)
    assert isinstance(qstack, nvfp4x.QuantizedLinear) and qstack.weight.shape == (nlayers, d, d)
    x, g = jnp.asarray(normal_np(35, (T, d))), jnp.asarray(normal_np(36, (T, d)))

    def loss_scan(q):
        params, static = eqx.partition(q, eqx.is_array)

        def body(h, p):
            return jnp.tanh(eqx.combine(p, static)(h)), None

        h, _ = jax.lax.scan(body, x, params)
        return jnp.sum(h * g)

    def loss_loop(q):
        params, static = eqx.partition(q, eqx.is_array)
        h = x
        for i in range(nlayers):
            layer = eqx.combine(jax.tree_util.tree_map(lambda a, i=i: a[i], params), static)
            h = jnp.tanh(layer(h))
        return jnp.sum(h * g)

    # (one compiled program per loss gives both the loss and its gradient)
    jit = eqx.filter_jit
    loss_s, gs = jit(eqx.filter_value_and_grad(loss_scan))(qstack)
    loss_l, gl = jit(eqx.filter_value_and_grad(loss_loop))(qstack)
    assert_close(loss_s, loss_l, "loss")
    assert gs.weight.shape == (nlayers, d, d)
    # XLA fuses a scan body differently from the unrolled loop: float32 rounding only.
    assert_close(gs.weight, gl.weight, "scan vs unrolled loop dW")
    assert_close(gs.bias, gl.bias, "scan vs unrolled loop db")


def test_checkpoint():
    layer = make_layer(TRAIN)
    x, g = jnp.asarray(normal_np(37, (T, K))), jnp.asarray(normal_np(38, (T, N)))
    got = jax.jit(jax.grad(jax.checkpoint(cot_loss), argnums=(0, 1)))(layer, x, g)
    assert_trees_same(got, jit_grad_layer_x(layer, x, g), "jax.checkpoint")


def test_jvp_is_straight_through():
    x, w = normal_np(39, (T, K)), normal_np(40, (N, K))
    xt, wt = normal_np(41, (T, K)), normal_np(42, (N, K))

    def f(x, w):
        return nvfp4x.qdot(x, w, recipe=TRAIN)

    y, ty = jax.jvp(f, tuple(map(jnp.asarray, (x, w))), tuple(map(jnp.asarray, (xt, wt))))
    qx, qw = ref_deq(x, axis=1), ref_deq(w, tile=True)
    assert_close(y, qx @ qw.T, "primal")
    assert_close(ty, xt.astype(np.float64) @ qw.T + qx @ wt.T.astype(np.float64), "tangent")


def test_bfloat16_parameters_and_inputs():
    bf = jnp.bfloat16
    layer = make_layer(TRAIN, dtype=bf)
    assert layer.weight.dtype == bf
    x, g = jnp.asarray(normal_np(43, (T, K)), bf), jnp.asarray(normal_np(44, (T, N)))
    y = layer(x)
    assert y.dtype == bf and y.shape == (T, N)
    gl, gx = grad_layer_x(layer, x, g)
    assert gl.weight.dtype == bf and gl.bias.dtype == bf and gx.dtype == bf
    for v in (y, gl.weight, gx):
        assert np.all(np.isfinite(np.asarray(v, F32)))
    # The same numbers as the float32 layer on the same (bf16-representable) values,
    # up to the final bfloat16 rounding.
    layer32 = jax.tree_util.tree_map(
        lambda a: a.astype(jnp.float32) if eqx.is_array(a) else a, layer
    )
    y32 = layer32(x.astype(jnp.float32))
    assert rel_err(y, y32) < 2**-7


def test_optax_adam_steps_master_weights():
    model = make_layer(TRAIN)
    x = jnp.asarray(normal_np(45, (64, K)))
    target = jnp.asarray(normal_np(46, (64, K)) @ normal_np(47, (K, N)) / np.sqrt(K))
    opt = optax.adam(1e-2)
    state = opt.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(m, s):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(m)
        updates, s = opt.update(grads, s, eqx.filter(m, eqx.is_array))
        return eqx.apply_updates(m, updates), s, loss

    m, losses = model, []
    # optax's bias correction computes `float ** int32`, which strict promotion rejects.
    with jax.numpy_dtype_promotion("standard"):
        for _ in range(15):
            m, state, loss = step(m, state)
            losses.append(float(loss))
    assert isinstance(m, nvfp4x.QuantizedLinear) and m.recipe == TRAIN
    for new, old in zip(
        jax.tree_util.tree_leaves(m), jax.tree_util.tree_leaves(model), strict=True
    ):
        assert new.dtype == old.dtype == jnp.float32
        assert not np.array_equal(np.asarray(new), np.asarray(old))
    assert losses[-1] < 0.7 * losses[0], losses


# ---------------------------------------------------------------------------------------
# Non-finite input.
# ---------------------------------------------------------------------------------------

NONFINITE_RECIPES = ["nvfp4_training", "nvfp4_inference", "mxfp8", "fp8", "bf16", "float32"]


@pytest.mark.parametrize("name", NONFINITE_RECIPES, ids=NONFINITE_RECIPES)
@fasts
def test_nan_in_x_gives_nan_rows(name, fast):
    layer = make_layer(RECIPES[name](), fast=fast)
    x = normal_np(47, (T, K))
    x[2, 5] = np.nan
    x[30, 39] = np.nan  # in the padded last block of k
    for y in (jit_call(layer, jnp.asarray(x)),):
        y = np.asarray(y)
        bad = np.isin(np.arange(T), [2, 30])
        assert np.all(np.isnan(y[bad])), "a NaN input must give NaN outputs in its row"
        assert np.all(np.isfinite(y[~bad])), "other rows stay finite"


@pytest.mark.parametrize("name", ["nvfp4_training", "nvfp4_inference"])
def test_inf_in_x_is_never_finite_garbage(name):
    layer = make_layer(RECIPES[name]())
    x = normal_np(48, (T, K))
    x[4, 0] = np.inf
    y = np.asarray(layer(jnp.asarray(x)))
    assert np.all(np.isnan(y[4])), "an infinite input poisons its NVFP4 block: NaN row"
    assert np.all(np.isfinite(np.delete(y, 4, axis=0)))


def test_nan_in_weight_gives_nan_columns_of_its_tile():
    layer = make_layer(TRAIN)
    w = np.asarray(layer.weight).copy()
    w[3, 7] = np.nan  # 16x16 tile (0, 0): output features 0..15
    layer = eqx.tree_at(lambda m: m.weight.array, layer, jnp.asarray(w))
    y = np.asarray(layer(jnp.asarray(normal_np(49, (T, K)))))
    assert np.all(np.isnan(y[:, :16]))
    assert np.all(np.isfinite(y[:, 16:]))


def test_nan_in_output_gradient():
    layer = make_layer(TRAIN)
    x, g = normal_np(50, (T, K)), normal_np(51, (T, N))
    g[1, 3] = np.nan
    gl, dx = jit_grad_layer_x(layer, jnp.asarray(x), jnp.asarray(g))
    dx, dw = np.asarray(dx), np.asarray(gl.weight)
    assert np.all(np.isnan(dx[1])) and np.all(np.isfinite(np.delete(dx, 1, axis=0)))
    # wgrad: dy's column 3 holds the NaN (its 16-token block, mixed by the RHT).
    assert np.all(np.isnan(dw[3])) and np.all(np.isfinite(np.delete(dw, 3, axis=0)))


def test_recipe_fields_used_by_reference():
    """The reference above implements `nvfp4_training(rht=False, stochastic_rounding=False)`."""
    f = nvfp4x.Format
    assert PLAIN.weight == f("nvfp4", (16, 16), "nearest")
    assert PLAIN.input == f("nvfp4", (1, 16), "nearest")
    assert PLAIN.grad == f("nvfp4", (1, 16), "nearest")
    assert PLAIN.rht is False
