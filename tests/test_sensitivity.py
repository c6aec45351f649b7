import math

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import nvfp4x
from nvfp4x._sensitivity import SensitivityReport, SensitivityRow, sensitivity


def _loss_fn(model, batch):
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _harmful_mlp():
    """MLP(16, 4, 32, 2) whose middle layer holds a 1e6 outlier on a dead input: the
    float model ignores it, but NVFP4's tensor scale then flushes every other block of
    that layer's weight to zero."""
    model = eqx.nn.MLP(16, 4, 32, 2, key=jax.random.key(0))
    first = model.layers[0]
    model = eqx.tree_at(
        lambda m: (m.layers[0].weight, m.layers[0].bias),
        model,
        (first.weight.at[0].set(0.0), first.bias.at[0].set(0.0)),
    )
    return eqx.tree_at(
        lambda m: m.layers[1].weight, model, model.layers[1].weight.at[0, 0].set(1e6)
    )


_RECIPE = nvfp4x.recipes.nvfp4_inference()


@pytest.fixture(scope="module")
def setup():
    model = _harmful_mlp()
    x = jax.random.normal(jax.random.key(1), (64, 16))
    noise = jax.random.normal(jax.random.key(2), (64, 4))
    y = jax.vmap(model)(x) + 0.1 * noise  # a teacher: the float model fits almost exactly
    # W4A4 compiles fastest of the NVFP4 recipes (each layer is one compilation), and the
    # outlier harms the weight operand whatever the recipe does with gradients.
    report = sensitivity(model, _loss_fn, (x, y), recipe=_RECIPE)
    return model, (x, y), report


def test_one_row_per_linear(setup):
    _, _, report = setup
    assert isinstance(report, SensitivityReport)
    assert report.recipe == _RECIPE
    assert sorted(r.path for r in report.rows) == ["layers[0]", "layers[1]", "layers[2]"]
    for row in report.rows:
        assert isinstance(row, SensitivityRow)
        assert all(math.isfinite(v) for v in row[1:])
        assert row.grad_error >= 0 and row.weight_grad_error >= 0


def test_sorted_most_sensitive_first(setup):
    _, _, report = setup
    keys = [(abs(r.loss_delta), r.grad_error) for r in report.rows]
    assert keys == sorted(keys, reverse=True)


def test_harmful_layer_ranks_first(setup):
    _, _, report = setup
    first, second = report.rows[0], report.rows[1]
    assert first.path == "layers[1]"
    assert abs(first.loss_delta) > 10 * abs(second.loss_delta)
    assert first.weight_grad_error > 0.5


def test_report_is_immutable_and_prints(setup):
    _, _, report = setup
    with pytest.raises(AttributeError):
        report.rows = ()
    text = str(report)
    assert "layers[1]" in text and "loss delta" in text
    assert text.index("layers[1]") < text.index("layers[0]")


@pytest.mark.parametrize(
    "keep_fraction, n_kept",
    [(0.0, 0), (0.15, 1), (0.34, 2), (1.0, 3)],
    ids=["none", "default", "two", "all"],
)
def test_suggest_policy(setup, keep_fraction, n_kept):
    model, _, report = setup
    policy = report.suggest_policy(keep_fraction=keep_fraction)
    assert isinstance(policy, nvfp4x.Policy)
    kept = {r.path for r in report.rows[:n_kept]}
    qmodel = nvfp4x.quantize(model, policy)
    bf16 = nvfp4x.recipes.bf16()
    for i, layer in enumerate(qmodel.layers):
        assert isinstance(layer, nvfp4x.QuantizedLinear)
        assert layer.recipe == (bf16 if f"layers[{i}]" in kept else _RECIPE)


def test_suggest_policy_other_recipe(setup):
    model, _, report = setup
    policy = report.suggest_policy(recipe=nvfp4x.recipes.mxfp8())
    qmodel = nvfp4x.quantize(model, policy)
    assert qmodel.layers[1].recipe == nvfp4x.recipes.bf16()
    assert qmodel.layers[0].recipe == nvfp4x.recipes.mxfp8()


@pytest.mark.parametrize("keep_fraction", [-0.1, 1.5], ids=["negative", "above_one"])
def test_bad_keep_fraction(setup, keep_fraction):
    _, _, report = setup
    with pytest.raises(ValueError, match="keep_fraction"):
        report.suggest_policy(keep_fraction=keep_fraction)


def test_model_without_linear():
    model = eqx.nn.LayerNorm(4)
    with pytest.raises(ValueError, match="no `eqx.nn.Linear`"):
        sensitivity(model, lambda m, b: jnp.sum(m(b)), jnp.ones(4))


def test_bad_recipe():
    model = eqx.nn.Linear(4, 4, key=jax.random.key(0))
    with pytest.raises(TypeError, match="recipe"):
        sensitivity(model, lambda m, b: jnp.sum(m(b)), jnp.ones(4), recipe="nvfp4_training")


def _assert_same_report(a, b):
    assert [r.path for r in a.rows] == [r.path for r in b.rows]
    assert a.base_loss == b.base_loss
    scale = max(abs(r.loss_delta) for r in b.rows) + abs(b.base_loss)
    for ra, rb in zip(a.rows, b.rows, strict=True):
        # The same quantised numbers; only float32 summation order may differ.
        assert abs(ra.loss_delta - rb.loss_delta) <= 1e-6 * scale
        assert ra.grad_error == pytest.approx(rb.grad_error, rel=1e-4, abs=1e-7)
        assert ra.weight_grad_error == pytest.approx(rb.weight_grad_error, rel=1e-4, abs=1e-7)


def test_vmapped_sweep_matches_reference_loop(setup):
    """The default (vmapped, `lax.map`) sweep against one compiled pass per layer, with
    stochastic rounding and the RHT in the backward pass."""
    model, batch, _ = setup
    recipe = nvfp4x.recipes.nvfp4_training()
    swept = sensitivity(model, _loss_fn, batch, recipe=recipe, layers_per_pass=2)
    looped = sensitivity(model, _loss_fn, batch, recipe=recipe, layers_per_pass=None)
    _assert_same_report(swept, looped)


def test_each_variant_has_its_own_tensor_scale():
    """Variants vmapped together must not share a tensor amax. Here the first layer's
    output is ~1e-7 unquantised (its rows are orthogonal to every input) but ~0.1 when
    that layer is quantised, so an amax shared across variants would change the figures
    of the layers after it (layers[2]'s loss delta moves by ~8%)."""
    k = jax.random.split(jax.random.key(7), 4)
    u = jax.random.normal(k[0], (16,))
    u = u / jnp.linalg.norm(u)
    x = jax.random.normal(k[1], (64, 1)) * u
    model = eqx.nn.MLP(16, 4, 32, 2, activation=lambda v: v, key=k[2])
    w0 = model.layers[0].weight
    w0 = w0 - jnp.outer(w0 @ u, u)
    model = eqx.tree_at(
        lambda m: (m.layers[0].weight, m.layers[0].bias), model, (w0, jnp.zeros(32))
    )
    assert float(jnp.max(jnp.abs(jax.vmap(model.layers[0])(x)))) < 1e-6
    y = jax.random.normal(k[3], (64, 4))
    swept = sensitivity(model, _loss_fn, (x, y), recipe=_RECIPE, layers_per_pass=3)
    looped = sensitivity(model, _loss_fn, (x, y), recipe=_RECIPE, layers_per_pass=None)
    _assert_same_report(swept, looped)


def test_stacked_layers_under_scan():
    model = eqx.nn.MLP(16, 4, 32, depth=4, scan=True, key=jax.random.key(3))
    x = jax.random.normal(jax.random.key(4), (32, 16))
    y = jax.random.normal(jax.random.key(5), (32, 4))
    swept = sensitivity(model, _loss_fn, (x, y), recipe=_RECIPE)
    looped = sensitivity(model, _loss_fn, (x, y), recipe=_RECIPE, layers_per_pass=None)
    # The stacked middle layers `(3, 32, 32)` are one Linear, measured as one.
    assert sorted(r.path for r in swept.rows) == ["layers[0]", "layers[1]", "layers[2]"]
    _assert_same_report(swept, looped)


@pytest.mark.parametrize(
    "bad, error",
    [(0, ValueError), (-1, ValueError), (2.5, TypeError), (True, TypeError)],
    ids=["zero", "negative", "float", "bool"],
)
def test_bad_layers_per_pass(bad, error):
    model = eqx.nn.Linear(4, 4, key=jax.random.key(0))
    # (beartype, switched on in the tests, rejects a float before the function body does)
    with pytest.raises(error, match="layers_per_pass"):
        sensitivity(model, lambda m, b: jnp.sum(m(b)), jnp.ones(4), layers_per_pass=bad)
