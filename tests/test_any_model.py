"""Every GEMM on a selected weight is quantised, however the model reads it.

Each test builds a model in the style of public Equinox ports and counts nvfp4x's GEMM
primitive in `jax.make_jaxpr` of the forward and of the gradient."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TRAIN, assert_same_sums, normal, only_on
from jax import lax

import nvfp4x

D, T = 32, 16


def n_qdot(fn, *args) -> int:
    """How many quantised fprop GEMMs `fn` runs (forward, or the forward of a gradient)."""
    return str(jax.make_jaxpr(fn)(*args)).count("nvfp4x_qdot[")


def n_plain(fn, *args) -> int:
    return str(jax.make_jaxpr(fn)(*args)).count("dot_general[")


def x_(seed=1, shape=(T, D)):
    return normal(seed, shape)


class DirectReads(eqx.Module):
    """Linears used as parameter holders, read in every common spelling."""

    c_q: eqx.nn.Linear
    c_k: eqx.nn.Linear
    c_v: eqx.nn.Linear
    lm_head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.c_q = eqx.nn.Linear(D, D, use_bias=False, key=k[0])
        self.c_k = eqx.nn.Linear(D, D, use_bias=False, key=k[1])
        self.c_v = eqx.nn.Linear(D, D, use_bias=False, key=k[2])
        self.lm_head = eqx.nn.Linear(D, 48, use_bias=False, key=k[3])

    def __call__(self, x):
        q = x @ self.c_q.weight.T
        k = jnp.dot(q, self.c_k.weight.T)
        v = lax.dot_general(k, self.c_v.weight, (((1,), (1,)), ((), ())))
        return jnp.einsum("td,vd->tv", v, self.lm_head.weight)

    def called(self, x):
        return self.lm_head(self.c_v(self.c_k(self.c_q(x))))


def test_direct_weight_reads_are_quantised_and_equal_the_called_layers():
    model = DirectReads(jax.random.key(0))
    qmodel = nvfp4x.quantize(model, TRAIN)
    x = x_()
    assert n_plain(model, x) == 4
    assert n_qdot(qmodel, x) == 4
    loss = lambda m: jnp.sum(m(x) ** 2)
    loss_called = lambda m: jnp.sum(m.called(x) ** 2)
    assert n_qdot(jax.grad(loss), qmodel) == 4
    # Bit for bit on a CPU; elsewhere up to float32 summation order (`assert_same_sums`:
    # other programs, which XLA:TPU may sum in another order).
    assert_same_sums(qmodel(x), qmodel.called(x), "direct reads vs called layers")
    # (jitted: eagerly every primitive of both backward passes compiles on its own;
    # eager equals jit is `test_gemm_jax.py`'s)
    g1 = eqx.filter_jit(eqx.filter_grad(loss))(qmodel)
    g2 = eqx.filter_jit(eqx.filter_grad(loss_called))(qmodel)
    assert_same_sums(g1, g2, "gradients, direct reads vs called layers")
    # jit gives the same bits.
    assert_same_sums(eqx.filter_jit(lambda m: m(x))(qmodel), qmodel(x), "jit vs eager")


def test_direct_read_outside_a_module():
    model = DirectReads(jax.random.key(0))
    qmodel = nvfp4x.quantize(model, TRAIN)
    x = x_()
    assert n_qdot(lambda x: x @ qmodel.c_q.weight.T, x) == 1
    assert_same_sums(x @ qmodel.c_q.weight.T, qmodel.c_q(x), "direct read vs called layer")
    # A jnp function outside a quantised call cannot convert it silently...
    with pytest.raises(TypeError):
        jnp.einsum("td,vd->tv", x, qmodel.lm_head.weight)
    # ...and `nvfp4x.quantized` makes any function see it.
    f = nvfp4x.quantized(lambda m, x: jnp.einsum("td,vd->tv", x, m.lm_head.weight))
    assert n_qdot(f, qmodel, x) == 1


class LoRALinear(eqx.Module):
    """A user linear class: own weight, LoRA adapter and scale in its forward."""

    weight: jax.Array
    lora_a: jax.Array
    lora_b: jax.Array
    scale: float = eqx.field(static=True)

    def __init__(self, key, scale=0.5):
        k1, k2, k3 = jax.random.split(key, 3)
        self.weight = jax.random.normal(k1, (D, D)) / D**0.5
        self.lora_a = jax.random.normal(k2, (4, D)) / D**0.5
        self.lora_b = jax.random.normal(k3, (D, 4)) / 2
        self.scale = scale

    def __call__(self, x):
        return x @ self.weight.T + self.scale * (x @ self.lora_a.T) @ self.lora_b.T


def test_user_linear_class_keeps_its_forward():
    model = [LoRALinear(jax.random.key(0)), LoRALinear(jax.random.key(1))]
    qmodel = nvfp4x.quantize(model, nvfp4x.Policy([(r"\[0\]\.weight", TRAIN)]))
    x = x_()
    assert isinstance(qmodel[0].weight, nvfp4x.QWeight) and eqx.is_array(qmodel[1].weight)
    assert isinstance(qmodel[0], LoRALinear) and qmodel[0].scale == 0.5
    assert n_qdot(qmodel[0], x) == 1 and n_plain(qmodel[0], x) == 2
    assert n_qdot(qmodel[1], x) == 0
    # Same numbers as the quantised GEMM of the weight plus the float adapter.
    w = qmodel[0].weight.array
    lin = nvfp4x.QuantizedLinear.from_linear(
        eqx.tree_at(
            lambda m: m.weight, eqx.nn.Linear(D, D, use_bias=False, key=jax.random.key(0)), w
        ),
        TRAIN,
    )
    ref = lin(x) + 0.5 * (x @ qmodel[0].lora_a.T) @ qmodel[0].lora_b.T
    np.testing.assert_allclose(qmodel[0](x), ref, rtol=1e-6, atol=1e-6)
    assert eqx.tree_equal(nvfp4x.dequantize(qmodel), model)


class ScaledLinear(eqx.nn.Linear):
    """A subclass of `eqx.nn.Linear` with an extra field and its own forward."""

    gain: jax.Array

    def __init__(self, key):
        super().__init__(D, D, key=key)
        self.gain = jnp.full((D,), 10.0)

    def __call__(self, x, *, key=None):
        return self.gain * super().__call__(x)


def test_subclass_of_linear_keeps_field_and_forward():
    model = ScaledLinear(jax.random.key(0))
    qmodel = nvfp4x.quantize(model, TRAIN)
    x = x_()
    assert isinstance(qmodel, ScaledLinear) and isinstance(qmodel, eqx.nn.Linear)
    y = jax.vmap(qmodel)(x)
    assert n_qdot(jax.vmap(qmodel), x) == 1
    # The gain survives: the output is 10x the quantised linear's.
    plain = nvfp4x.quantize(eqx.nn.Linear(D, D, key=jax.random.key(0)), TRAIN)
    assert eqx.tree_equal(nvfp4x.dequantize(plain).weight, model.weight)
    np.testing.assert_allclose(y, 10.0 * jax.vmap(plain)(x), rtol=1e-6)
    assert eqx.tree_equal(nvfp4x.dequantize(qmodel), model)


def test_isinstance_masks_select_the_same_leaves():
    model = eqx.nn.MLP(D, 4, 64, 2, key=jax.random.key(0))
    qmodel = nvfp4x.quantize(model, TRAIN)

    def decay_mask(m):
        is_linear = lambda v: isinstance(v, eqx.nn.Linear)
        return jax.tree_util.tree_map(is_linear, m, is_leaf=is_linear)

    def n_selected(m):
        params = eqx.filter(m, eqx.is_inexact_array)
        mask = decay_mask(params)
        return sum(
            leaf.size
            for leaf, keep in zip(
                jax.tree_util.tree_leaves(params),
                jax.tree_util.tree_leaves(
                    jax.tree_util.tree_map(
                        lambda k, p: jax.tree_util.tree_map(lambda _: k, p),
                        mask,
                        params,
                        is_leaf=lambda v: isinstance(v, bool),
                    )
                ),
                strict=True,
            )
            if keep
        )

    assert n_selected(qmodel) == n_selected(model) > 0


def test_weight_norm_quantises_the_effective_weight():
    layer = eqx.nn.WeightNorm(eqx.nn.Linear(D, D, key=jax.random.key(0)))
    qlayer = nvfp4x.quantize(layer, TRAIN)
    x = x_()
    assert isinstance(qlayer, eqx.nn.WeightNorm)
    assert n_qdot(jax.vmap(qlayer), x) == 1
    g = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x) ** 2)))(qlayer)
    assert np.all(np.isfinite(g.layer.weight.array)) and np.all(np.isfinite(g.g))
    # The GEMM's weight is v * g / ||v||: the same product as a QuantizedLinear holding it.
    v = layer.layer.weight
    w_eff = v * layer.g / jnp.linalg.norm(v, axis=1, keepdims=True)
    ref = nvfp4x.quantize(eqx.tree_at(lambda m: m.weight, layer.layer, w_eff), TRAIN)
    np.testing.assert_allclose(jax.vmap(qlayer)(x), ref(x), rtol=1e-5, atol=1e-5)


class Stack(eqx.Module):
    blocks: eqx.nn.Linear  # stacked (L, D, D)

    def __init__(self, key):
        self.blocks = eqx.filter_vmap(lambda k: eqx.nn.Linear(D, D, key=k))(
            jax.random.split(key, 3)
        )

    def __call__(self, x):
        def body(h, layer):
            return jnp.tanh(h @ layer.weight.T), None

        return lax.scan(body, x, self.blocks)[0]


@pytest.mark.parametrize(
    "wrap",
    [
        pytest.param(lambda f: f, id="plain"),
        pytest.param(jax.checkpoint, id="checkpoint"),
        pytest.param(eqx.filter_checkpoint, id="filter_checkpoint"),
        pytest.param(eqx.filter_jit, id="inner-filter_jit"),
    ],
)
def test_scan_and_remat_and_inner_jit(wrap):
    model = Stack(jax.random.key(0))
    qmodel = nvfp4x.quantize(model, TRAIN)

    class Outer(eqx.Module):
        inner: Stack

        def __call__(self, x):
            return wrap(lambda m, x: m(x))(self.inner, x)

    qouter = nvfp4x.quantize(Outer(model), TRAIN)
    x = x_()
    assert n_qdot(qouter, x) == 1  # one GEMM inside the scan body
    np.testing.assert_allclose(qouter(x), qmodel(x), rtol=1e-6, atol=1e-6)
    grad = jax.grad(
        lambda w: jnp.sum(eqx.tree_at(lambda m: m.inner.blocks.weight.array, qouter, w)(x))
    )
    jaxpr = str(jax.make_jaxpr(grad)(qouter.inner.blocks.weight.array))
    assert jaxpr.count("nvfp4x_wgrad[") == 1 and jaxpr.count("nvfp4x_dgrad[") == 1


def test_cond_and_while():
    class Branchy(eqx.Module):
        a: eqx.nn.Linear
        b: eqx.nn.Linear

        def __call__(self, x, flag):
            y = lax.cond(flag, lambda x: x @ self.a.weight.T, lambda x: x @ self.b.weight.T, x)
            return lax.fori_loop(0, 2, lambda i, h: jnp.tanh(h @ self.a.weight.T), y)

    k1, k2 = jax.random.split(jax.random.key(0))
    qmodel = nvfp4x.quantize(
        Branchy(eqx.nn.Linear(D, D, key=k1), eqx.nn.Linear(D, D, key=k2)), TRAIN
    )
    x = x_()
    assert n_qdot(qmodel, x, True) == 3  # two branches and the loop body
    assert n_plain(qmodel, x, True) == 0


def test_custom_vjp_inside_runs_and_warns_for_a_weight():
    @jax.custom_vjp
    def f(h):
        return jnp.sin(h)

    f.defvjp(lambda h: (jnp.sin(h), h), lambda h, g: (g * jnp.cos(h),))

    class M(eqx.Module):
        lin: eqx.nn.Linear

        def __call__(self, x):
            return f(x @ self.lin.weight.T)

    qmodel = nvfp4x.quantize(M(eqx.nn.Linear(D, D, key=jax.random.key(0))), TRAIN)
    x = x_()
    assert n_qdot(qmodel, x) == 1
    g = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(m(x))))(qmodel)
    assert np.all(np.isfinite(g.lin.weight.array))

    @jax.custom_vjp
    def matmul(h, w):
        return h @ w.T

    matmul.defvjp(lambda h, w: (h @ w.T, (h, w)), lambda r, g: (g @ r[1], g.T @ r[0]))

    class N(eqx.Module):
        lin: eqx.nn.Linear

        def __call__(self, x):
            return matmul(x, self.lin.weight)

    qn = nvfp4x.quantize(N(eqx.nn.Linear(D, D, key=jax.random.key(0))), TRAIN)
    with pytest.warns(UserWarning, match=r"`lin`.*custom_vjp"):
        qn(x)


def test_quantize_twice_says_what_happened():
    qmodel = nvfp4x.quantize(eqx.nn.MLP(D, 4, 64, 1, key=jax.random.key(0)), TRAIN)
    with pytest.raises(ValueError, match="already quantised.*dequantize"):
        nvfp4x.quantize(qmodel, TRAIN)


def test_replacing_a_quantised_weight_by_an_array_is_refused():
    qlayer = nvfp4x.quantize(eqx.nn.Linear(D, D, key=jax.random.key(0)), TRAIN)
    broken = eqx.tree_at(lambda m: m.weight, qlayer, jnp.ones((D, D)))
    with pytest.raises(TypeError, match=r"m.weight.array"):
        broken(x_())


# --- eqx.nn.Shared, SpectralNorm, freeze, telemetry, sensitivity on these patterns ---


class Tied(eqx.Module):
    """An LM head tied to the embedding with `eqx.nn.Shared` (Equinox's documented way)."""

    shared: eqx.nn.Shared

    def __init__(self, key, vocab=48):
        k1, k2 = jax.random.split(key)
        embed = eqx.nn.Embedding(vocab, D, key=k1)
        head = eqx.nn.Linear(D, vocab, use_bias=False, key=k2)
        self.shared = eqx.nn.Shared((embed, head), lambda p: p[1].weight, lambda p: p[0].weight)

    def __call__(self, tokens):
        embed, head = self.shared()
        return jax.vmap(head)(jnp.tanh(jax.vmap(embed)(tokens)))


def test_tied_weights_through_shared():
    model = Tied(jax.random.key(0))
    tokens = jnp.arange(T) % 48
    qmodel = nvfp4x.quantize(model, nvfp4x.Policy([(r".*\[1\]", TRAIN)]))
    assert n_qdot(qmodel, tokens) == 1
    table = nvfp4x.summary(qmodel)
    assert "shared.pytree[1]" in table and "nvfp4 16x16" in table
    # The embedding lookup reads the master values; the head's GEMM is quantised.
    grad = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(m(tokens) ** 2)))
    g = grad(nvfp4x.telemetry.enable(qmodel))
    stats = nvfp4x.telemetry.collect(g)
    assert (
        list(stats) == ["shared.pytree[1]"]
        and float(stats["shared.pytree[1]"]["weight"]["amax"]) > 0
    )
    # Frozen, the head's GEMM decodes the packed table (bit-exact quantised weight) and
    # the embedding lookup reads the master values it keeps (tests/test_tied.py).
    frozen = nvfp4x.freeze(qmodel)
    assert str(jax.make_jaxpr(frozen)(tokens)).count("nvfp4x_frozen_qdot[") == 1
    assert_same_sums(frozen(tokens), qmodel(tokens), "frozen vs trained")
    assert "nvfp4 16x16" in nvfp4x.summary(frozen)
    assert eqx.tree_equal(nvfp4x.dequantize(qmodel), model)
    report = nvfp4x.sensitivity(model, lambda m, t: jnp.mean(m(t) ** 2), tokens)
    assert [r.path for r in report.rows] == ["shared.pytree[1]"]
    # The tied weight's gradient is found where the table sits (it must not be NaN);
    # the table is the model's only float array, so both errors are its.
    [row] = report.rows
    assert 0 < row.weight_grad_error == pytest.approx(row.grad_error, rel=1e-6)


def test_spectral_norm_trains_and_freezes():
    layer, state = eqx.nn.make_with_state(eqx.nn.SpectralNorm)(
        eqx.nn.Linear(D, D, key=jax.random.key(0)), "weight", key=jax.random.key(1)
    )
    qlayer = nvfp4x.quantize(layer, TRAIN)
    x = x_()

    def run(m, s):
        return jax.vmap(m, in_axes=(0, None), out_axes=(0, None), axis_name="b")(x, s)

    # The layer's GEMM is quantised; σ (the power iteration and `u W v`) is computed from
    # the master weight, as Equinox computes it on the float layer (not as a
    # 1-token NVFP4 GEMM), so the state is Equinox's bit for bit, and the output is the
    # quantised GEMM of `W / σ`.
    jaxpr = eqx.filter_make_jaxpr(run)(qlayer, state)[0]
    assert str(jaxpr).count("nvfp4x_qdot[") == 1
    y, new_state = run(qlayer, state)
    _, float_state = run(layer, state)
    u, v = new_state.get(layer.uv_index)
    assert_same_sums((u, v), float_state.get(layer.uv_index), "σ's vectors vs Equinox's")
    w = layer.layer.weight
    scaled = eqx.tree_at(lambda m: m.weight, layer.layer, w / jnp.einsum("i,ij,j->", u, w, v))
    assert_same_sums(y, jax.vmap(nvfp4x.quantize(scaled, TRAIN))(x), "the GEMM of W / σ")
    report = nvfp4x.coverage(run, qlayer, state)
    assert not report.unquantised
    assert {r.pass_ for r in report.rows if not r.quantised} == {"normaliser"}
    g = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(run(m, state)[0] ** 2)))(qlayer)
    assert np.all(np.isfinite(g.layer.weight.array))
    # Frozen, the weight keeps its master for σ: the same numbers (tests/test_freeze.py).
    y_frozen, _ = run(nvfp4x.freeze(qlayer), state)
    assert_same_sums(y_frozen, y, "frozen vs trained")


def test_freeze_of_user_layers_is_bit_exact():
    x = x_()
    for model in (LoRALinear(jax.random.key(0)), DirectReads(jax.random.key(0))):
        qmodel = nvfp4x.quantize(model, TRAIN)
        frozen = nvfp4x.freeze(qmodel)
        assert not nvfp4x.telemetry.collect(frozen)
        assert_same_sums(frozen(x), qmodel(x), f"frozen {type(model).__name__}")
    scaled = nvfp4x.quantize(ScaledLinear(jax.random.key(0)), TRAIN)
    assert_same_sums(jax.vmap(nvfp4x.freeze(scaled))(x), jax.vmap(scaled)(x), "frozen subclass")
    assert isinstance(nvfp4x.freeze(scaled).weight, nvfp4x.FrozenWeight)


def test_telemetry_warns_for_a_layer_never_reached():
    model = DirectReads(jax.random.key(0))
    qmodel = nvfp4x.telemetry.enable(nvfp4x.quantize(model, TRAIN))
    x = x_()
    g = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m.c_q)(x) ** 2)))(qmodel)
    with pytest.warns(UserWarning) as caught:
        stats = nvfp4x.telemetry.collect(g)
    unreached = sorted(str(w.message).split("`")[1] for w in caught)
    assert unreached == ["c_k", "c_v", "lm_head"]
    assert float(stats["c_q"]["fprop_x"]["amax"]) > 0


def test_sensitivity_on_a_model_that_reads_attributes():
    model = DirectReads(jax.random.key(0))
    x = x_()

    def loss_fn(m, x):
        # reads a layer's attribute, as real models do (`_Switch` used to break this)
        assert m.lm_head.out_features == 48
        return jnp.mean(m(x) ** 2)

    report = nvfp4x.sensitivity(model, loss_fn, x)
    assert sorted(r.path for r in report.rows) == ["c_k", "c_q", "c_v", "lm_head"]
    # The row of `c_q`: the loss with c_q alone quantised (the others plain).
    only = nvfp4x.quantize(model, nvfp4x.Policy([("c_q", TRAIN)]))
    row = next(r for r in report.rows if r.path == "c_q")
    want = float(loss_fn(only, x)) - float(loss_fn(model, x))
    np.testing.assert_allclose(row.loss_delta, want, rtol=1e-3, atol=1e-7)


def test_sensitivity_warns_for_a_layer_never_reached():
    model = DirectReads(jax.random.key(0))
    x = x_()
    with pytest.warns(UserWarning) as caught:
        nvfp4x.sensitivity(model, lambda m, x: jnp.mean(jax.vmap(m.c_v)(x) ** 2), x)
    assert sorted(str(w.message).split("`")[1] for w in caught) == ["c_k", "c_q", "lm_head"]


def test_enabled_mask_keeps_slices_of_a_stack_high_precision():
    model = Stack(jax.random.key(0))
    qmodel = nvfp4x.quantize(model, TRAIN)
    on = jnp.array([False, True, False])
    masked = eqx.tree_at(lambda m: m.blocks.weight.enabled, qmodel, on, is_leaf=lambda v: v is None)
    x = x_()
    h = x
    for i in range(3):
        w = model.blocks.weight[i]
        if on[i]:
            lin = eqx.tree_at(lambda m: m.weight, eqx.nn.Linear(D, D, key=jax.random.key(0)), w)
            h = jnp.tanh(nvfp4x.quantize(lin, TRAIN).weight @ h.T).T
        else:
            h = jnp.tanh(jnp.matmul(h, w.T, preferred_element_type=jnp.float32))
    np.testing.assert_allclose(masked(x), h, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "spelling",
    [
        pytest.param(lambda f, w: jax.hessian(f)(w), id="hessian"),
        pytest.param(lambda f, w: jax.jacfwd(jax.grad(f))(w), id="jacfwd-grad"),
        pytest.param(lambda f, w: jax.grad(lambda v: jnp.sum(jax.grad(f)(v)))(w), id="grad-grad"),
        pytest.param(lambda f, w: jax.jvp(jax.grad(f), (w,), (w,)), id="hvp"),
        pytest.param(lambda f, w: jax.jit(jax.hessian(f))(w), id="jit-hessian"),
    ],
)
def test_second_derivatives_raise_one_clear_error(spelling):
    qlayer = nvfp4x.quantize(eqx.nn.Linear(D, 16, key=jax.random.key(0)), TRAIN)
    x = x_()

    def f(w):
        return jnp.sum(eqx.tree_at(lambda m: m.weight.array, qlayer, w)(x) ** 2)

    with pytest.raises(NotImplementedError, match="second-order derivatives"):
        spelling(f, qlayer.weight.array)
    # First-order forward mode still works.
    jax.jvp(f, (qlayer.weight.array,), (qlayer.weight.array,))


@only_on("cpu", reason="XLA:CPU has no batched bfloat16 dot (other backends multiply it)")
def test_vmap_of_grad_never_gives_cpu_a_batched_bfloat16_dot(monkeypatch):
    monkeypatch.setenv("NVFP4X_GEMM_DTYPE", "bfloat16")
    qlayer = nvfp4x.quantize(eqx.nn.Linear(D, 16, key=jax.random.key(0)), TRAIN)
    xs = jnp.ones((4, T, D))
    f = jax.vmap(eqx.filter_value_and_grad(lambda m, x: jnp.sum(m(x))), in_axes=(None, 0))
    text = jax.jit(f).lower(qlayer, xs).as_text()
    batched_bf16 = [
        line
        for line in text.splitlines()
        if "dot_general" in line and "batching_dims" in line and "bf16" in line
    ]
    assert not batched_bf16, batched_bf16[:2]
    plain_bf16 = [ln for ln in text.splitlines() if "dot_general" in ln and "bf16" in ln]
    assert plain_bf16  # the unbatched GEMMs do use bfloat16 operands
    _, g = f(qlayer, xs)
    assert np.all(np.isfinite(g.weight.array))


# --- convolutions, opt-in ---


def im2col_reference(x, kernel, stride, padding, recipe):
    """The convolution as its GEMM, written out: NCHW patches times the OIHW kernel, the
    contraction ordered kernel window major, input channels minor (nvfp4x's order)."""
    dn = lax.conv_dimension_numbers(x.shape, kernel.shape, ("NCHW", "OIHW", "NCHW"))
    patches = lax.conv_general_dilated_patches(
        x, kernel.shape[2:], stride, padding, dimension_numbers=dn, precision=lax.Precision.HIGHEST
    )  # (N, C x window, out...), channels major
    n, c, window = x.shape[0], x.shape[1], kernel[0, 0].size
    patches = patches.reshape(n, c, window, -1).transpose(0, 3, 2, 1)  # (N, out, window, C)
    matrix = kernel.transpose(0, 2, 3, 1).reshape(kernel.shape[0], -1)  # (O, window x C)
    lin = eqx.nn.Linear(kernel[0].size, kernel.shape[0], use_bias=False, key=jax.random.key(0))
    lin = eqx.tree_at(lambda m: m.weight, lin, matrix)
    y = nvfp4x.quantize(lin, recipe)(patches.reshape(n, -1, window * c))
    out = y.shape[:1] + tuple(
        (s + lo + hi - k) // st + 1
        for s, (lo, hi), k, st in zip(x.shape[2:], padding, kernel.shape[2:], stride, strict=True)
    )
    return jnp.moveaxis(y.reshape(out + y.shape[-1:]), -1, 1)


def test_convolutions_stay_plain_unless_the_policy_opts_in():
    conv = eqx.nn.Conv2d(3, 8, 3, stride=2, padding=1, use_bias=False, key=jax.random.key(0))
    x = x_(3, (2, 3, 12, 12))
    with pytest.warns(UserWarning, match="no `eqx.nn.Linear`"):
        same = nvfp4x.quantize(conv, TRAIN)
    assert eqx.tree_equal(same, conv)
    qconv = nvfp4x.quantize(conv, nvfp4x.Policy([(".*", TRAIN)], convolutions=True))
    assert isinstance(qconv, eqx.nn.Conv2d) and isinstance(qconv.weight, nvfp4x.QWeight)
    per_image = jax.vmap(qconv)
    assert n_qdot(per_image, x) == 1
    y = per_image(x)
    ref = im2col_reference(x, conv.weight, (2, 2), ((1, 1), (1, 1)), TRAIN)
    assert_same_sums(y, ref, "the convolution vs its GEMM written out")
    # dgrad and wgrad run quantised too.
    step = eqx.filter_value_and_grad(lambda m, x: jnp.sum(jax.vmap(m)(x) ** 2))
    report = nvfp4x.coverage(lambda m, x: step(m, x), qconv, x)
    assert {r.pass_ for r in report.rows if r.quantised} == {"fprop", "wgrad"}
    report = nvfp4x.coverage(jax.grad(lambda x: jnp.sum(per_image(x) ** 2)), x)
    assert {r.pass_ for r in report.rows if r.quantised} == {"fprop", "dgrad"}
    assert eqx.tree_equal(nvfp4x.dequantize(qconv), conv)


@pytest.mark.parametrize(
    "make, shape",
    [
        pytest.param(lambda k: eqx.nn.Conv1d(4, 8, 3, key=k), (4, 20), id="conv1d"),
        pytest.param(lambda k: eqx.nn.Conv3d(2, 4, 2, key=k), (2, 6, 6, 6), id="conv3d"),
        pytest.param(
            lambda k: eqx.nn.ConvTranspose2d(4, 3, 3, stride=2, key=k), (4, 7, 7), id="convT2d"
        ),
    ],
)
def test_other_convolutions_run_quantised(make, shape):
    conv = make(jax.random.key(0))
    qconv = nvfp4x.quantize(conv, nvfp4x.Policy([(".*", TRAIN)], convolutions=True))
    x = x_(4, shape)
    assert n_qdot(qconv, x) == 1
    y, ref = qconv(x), conv(x)
    assert y.shape == ref.shape
    # NVFP4 error, not a different computation: about 10-20 dB of SQNR at 4 bits.
    sqnr = 10 * np.log10(np.sum(np.square(ref)) / np.sum(np.square(y - ref)))
    assert sqnr > 10, sqnr
    g = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2)))(qconv)
    assert np.all(np.isfinite(g.weight.array))


def test_freeze_refuses_a_stack_with_unquantised_slices():
    qmodel = nvfp4x.quantize(Stack(jax.random.key(0)), TRAIN)
    mask = jnp.array([False, True, False])
    masked = eqx.tree_at(
        lambda m: m.blocks.weight.enabled, qmodel, mask, is_leaf=lambda v: v is None
    )
    with pytest.raises(
        ValueError, match=r"`blocks` keeps slices \[0, 2\] of its stack unquantised"
    ):
        nvfp4x.freeze(masked)
    all_on = eqx.tree_at(
        lambda m: m.blocks.weight.enabled, qmodel, jnp.ones(3, bool), is_leaf=lambda v: v is None
    )
    np.testing.assert_array_equal(nvfp4x.freeze(all_on)(x_()), nvfp4x.freeze(qmodel)(x_()))
