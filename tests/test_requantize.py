"""`nvfp4x.requantize`: switching a quantised model's recipes mid-run (the
paper's precision schedule, NVFP4 then bf16), with its optimiser state."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import nvfp4x


def _setup():
    model = eqx.nn.MLP(32, 8, 64, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (64, 32))
    y = jax.random.normal(jax.random.key(2), (64, 8))
    return model, x, y


def _loss(m, x, y):
    return jnp.mean((jax.vmap(m)(x) - y) ** 2)


def _train(model, optim, opt_state, x, y, steps):
    @eqx.filter_jit
    def step(m, s):
        loss, g = eqx.filter_value_and_grad(_loss)(m, x, y)
        u, s = optim.update(g, s, eqx.filter(m, eqx.is_array))
        return eqx.apply_updates(m, u), s, loss

    losses = []
    for _ in range(steps):
        model, opt_state, loss = step(model, opt_state)
        losses.append(float(loss))
    return model, opt_state, losses


def test_switch_mid_run_keeps_weights_and_optimiser_state():
    """NVFP4 for 3 steps, then bf16: the switch keeps the master weights and the optimiser's
    moments (the same arrays), training carries on, and the switched model runs exactly
    as a model quantised with bf16 from those weights."""
    model, x, y = _setup()
    optim = optax.sgd(1e-2, momentum=0.9)  # (Adam promotes int32 counts: strict mode)
    q = nvfp4x.quantize(model, nvfp4x.recipes.nvfp4_training())
    opt_state = optim.init(eqx.filter(q, eqx.is_array))
    q, opt_state, _ = _train(q, optim, opt_state, x, y, 3)

    s, s_state = nvfp4x.requantize(q, nvfp4x.recipes.bf16(), state=opt_state)
    for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(s), strict=True):
        assert a is b
    for a, b in zip(jax.tree.leaves(opt_state), jax.tree.leaves(s_state), strict=True):
        assert a is b
    assert {layer.recipe.name for layer in s.layers} == {"bf16"}
    assert "bf16" in nvfp4x.summary(s) and "nvfp4_training" not in nvfp4x.summary(s)

    fresh = nvfp4x.quantize(nvfp4x.dequantize(q), nvfp4x.recipes.bf16())
    assert jnp.array_equal(jax.vmap(s)(x), jax.vmap(fresh)(x))
    g_s = eqx.filter_grad(_loss)(s, x, y)
    g_f = eqx.filter_grad(_loss)(fresh, x, y)
    for a, b in zip(jax.tree.leaves(g_s), jax.tree.leaves(g_f), strict=True):
        assert jnp.array_equal(a, b)
    assert not jnp.array_equal(jax.vmap(s)(x), jax.vmap(q)(x))  # the GEMMs did change

    # the old optimiser state does not fit the switched model; the switched one does
    _, _, losses = _train(s, optim, s_state, x, y, 2)
    assert all(jnp.isfinite(jnp.asarray(losses)))
    with pytest.raises(ValueError):
        _train(s, optim, opt_state, x, y, 1)


def test_policy_switches_only_the_layers_it_selects():
    model, x, _ = _setup()
    q = nvfp4x.quantize(model, nvfp4x.recipes.nvfp4_training())
    policy = nvfp4x.Policy([(r"layers\[0\]", nvfp4x.recipes.bf16()), (r".*", None)])
    s = nvfp4x.requantize(q, policy)
    assert [layer.recipe.name for layer in s.layers] == ["bf16", "nvfp4_training", "nvfp4_training"]
    by_name = nvfp4x.requantize(q, lambda path, layer: "fp8" if path == "layers[2]" else None)
    assert by_name.layers[2].recipe == nvfp4x.recipes.fp8()
    assert by_name.layers[0].recipe == q.layers[0].recipe


def test_user_classes_and_telemetry_probes_are_switched_and_kept():
    class Scaled(eqx.Module):
        weight: jax.Array

        def __call__(self, x):
            return 2.0 * (x @ self.weight.T)

    layer = Scaled(jax.random.normal(jax.random.key(3), (16, 32)))
    q = nvfp4x.telemetry.enable(nvfp4x.quantize(layer, nvfp4x.recipes.nvfp4_training()))
    s = nvfp4x.requantize(q, nvfp4x.recipes.bf16())
    assert s.weight.recipe.name == "bf16" and s.weight.probe is q.weight.probe
    x = jax.random.normal(jax.random.key(4), (8, 32))
    ref = 2.0 * (
        x.astype(jnp.bfloat16).astype(jnp.float32)
        @ layer.weight.astype(jnp.bfloat16).astype(jnp.float32).T
    )
    assert jnp.allclose(s(x), ref, rtol=1e-6, atol=1e-6)


def test_bad_switches_are_refused_with_the_reason():
    model, _, _ = _setup()
    bf16 = nvfp4x.recipes.bf16()
    with pytest.raises(ValueError, match="no quantised weight"):
        nvfp4x.requantize(model, bf16)
    partial = nvfp4x.quantize(
        model, nvfp4x.Policy([(r"layers\[2\]", None), (r".*", nvfp4x.recipes.nvfp4_training())])
    )
    with pytest.raises(ValueError, match=r"`layers\[2\]`.*left\s+unquantised"):
        nvfp4x.requantize(partial, bf16)
    with pytest.raises(ValueError, match="matched no quantised weight"):
        nvfp4x.requantize(partial, nvfp4x.Policy([(r"layers\[0\]", bf16), (r"head", bf16)]))
    frozen = nvfp4x.freeze(partial)
    with pytest.raises(ValueError, match="frozen"):
        nvfp4x.requantize(frozen, bf16)
    with pytest.raises(ValueError, match="Unknown recipe|unknown|not a recipe"):
        nvfp4x.requantize(partial, "nvfp5")
