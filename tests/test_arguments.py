"""The argument checks of recipes, policies, `qdot`, the layers and telemetry.

Each wrong argument gets one error that names it and the fix; nothing is taken silently
(a string `"False"` is truthy, a complex array loses its imaginary part when cast). The
checks read static information only, so almost every case here fails before anything is
compiled. The quantisers' own array checks live in `tests/test_format_inputs.py`.

The test run type-checks the package's annotated signatures (jaxtyping + beartype),
which would refuse most of these arguments before the library's checks see them; users
do not run that checker, so the tests here switch it off and check what users get.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

import nvfp4x

TRAIN = nvfp4x.recipes.nvfp4_training()


@pytest.fixture(autouse=True)
def _without_the_test_runs_type_checker(monkeypatch):
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)


NOT_BOOLS = {'str "False"': "False", 'str "no"': "no", "int 1": 1, "int 0": 0, "None": None}

# ---------------------------------------------------------------------------------------
# Flags must be bools.
# ---------------------------------------------------------------------------------------

FLAGS = {
    "Recipe.rht": (lambda v: nvfp4x.Recipe(None, None, None, rht=v), "`Recipe.rht`"),
    "nvfp4_training rht": (lambda v: nvfp4x.recipes.nvfp4_training(rht=v), "`rht`"),
    "nvfp4_training stochastic_rounding": (
        lambda v: nvfp4x.recipes.nvfp4_training(stochastic_rounding=v),
        "`stochastic_rounding`",
    ),
    "nvfp4_training unbiased_sr": (
        lambda v: nvfp4x.recipes.nvfp4_training(unbiased_sr=v),
        "`unbiased_sr`",
    ),
    "Policy strict": (lambda v: nvfp4x.Policy([(".*", TRAIN)], strict=v), "`strict`"),
    "Policy convolutions": (
        lambda v: nvfp4x.Policy([(".*", TRAIN)], convolutions=v),
        "`convolutions`",
    ),
    "qdot fast": (
        lambda v: nvfp4x.qdot(jnp.ones((2, 16)), jnp.ones((4, 16)), recipe=TRAIN, fast=v),
        "`fast`",
    ),
}


@pytest.mark.parametrize("flag", list(FLAGS.values()), ids=list(FLAGS))
@pytest.mark.parametrize("value", list(NOT_BOOLS.values()), ids=list(NOT_BOOLS))
def test_flags_must_be_bools(flag, value):
    make, name = flag
    with pytest.raises(TypeError, match=rf"{name} must be True or False, got"):
        make(value)


def test_numpy_bools_are_bools():
    recipe = nvfp4x.Recipe(None, None, None, rht=np.bool_(True))
    assert recipe.rht is True
    assert nvfp4x.recipes.nvfp4_training(rht=np.bool_(False)).rht is False
    assert nvfp4x.recipes.nvfp4_training(stochastic_rounding=np.bool_(False)).grad.rounding == (
        "nearest"
    )
    assert nvfp4x.Policy([(".*", TRAIN)], strict=np.bool_(False)).strict is False
    # `replace` checks like a new recipe.
    with pytest.raises(TypeError, match=r"`Recipe.rht` must be True or False"):
        TRAIN.replace(rht="False")


# ---------------------------------------------------------------------------------------
# Recipes and formats.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [5, None, ["w4a4"]], ids=["int", "None", "list"])
def test_recipe_name_must_be_a_string(name):
    with pytest.raises(TypeError, match=r"`Recipe.name` must be a string such as"):
        nvfp4x.Recipe(None, None, None, name=name)


def test_format_name_must_be_a_string():
    with pytest.raises(TypeError, match=r"`Format\(name\)` must be a format name .*list"):
        nvfp4x.Format(["nvfp4"])  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"`rounding=\['nearest'\]` is unknown"):
        nvfp4x.Format("nvfp4", rounding=["nearest"])  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"`scale_rounding=1` is unknown"):
        nvfp4x.Format("nvfp4", scale_rounding=1)  # pyright: ignore[reportArgumentType]


BAD_WEIGHT_BLOCKS = {
    "int 16": 16,
    "None": None,
    "one entry": (16,),
    "string": "16x16",
    "floats": (16.0, 16.0),
    "bools": (True, 16),
    "wrong size": (2, 16),
}
PRESETS_WITH_BLOCKS = {
    "nvfp4_training": nvfp4x.recipes.nvfp4_training,
    "nvfp4_inference": nvfp4x.recipes.nvfp4_inference,
    "nvfp4_weight_only": nvfp4x.recipes.nvfp4_weight_only,
}


@pytest.mark.parametrize(
    "preset", list(PRESETS_WITH_BLOCKS.values()), ids=list(PRESETS_WITH_BLOCKS)
)
@pytest.mark.parametrize("block", list(BAD_WEIGHT_BLOCKS.values()), ids=list(BAD_WEIGHT_BLOCKS))
def test_weight_block(preset, block):
    with pytest.raises(ValueError, match=r"`weight_block=.*` is not supported; use `\(1, 16\)`"):
        preset(weight_block=block)


def test_weight_block_spellings():
    for block in ([16, 16], (16, 16)):
        assert nvfp4x.recipes.nvfp4_inference(weight_block=block).weight.block == (16, 16)


# ---------------------------------------------------------------------------------------
# Policies.
# ---------------------------------------------------------------------------------------

BAD_RULES = {
    "None": None,
    "int": 5,
    "recipe name": "nvfp4_training",
    "recipe": TRAIN,
    "dict": {".*": TRAIN},
}


@pytest.mark.parametrize("rules", list(BAD_RULES.values()), ids=list(BAD_RULES))
def test_policy_rules_must_be_a_list(rules):
    with pytest.raises(TypeError, match=r"`Policy\(rules\)` must be a list of `\(regex, recipe"):
        nvfp4x.Policy(rules)


def test_policy_rules_from_an_iterable():
    rules = [(r"a", None), (r".*", TRAIN)]
    assert nvfp4x.Policy(iter(rules)) == nvfp4x.Policy(rules)


@pytest.mark.parametrize("groups", [5, None, {"a": 1}], ids=["int", "None", "dict"])
def test_policy_tensor_scale_groups_must_be_a_list(groups):
    # (was "'int' object is not iterable")
    with pytest.raises(TypeError, match=r"`tensor_scale_groups` must be a list of regexes"):
        nvfp4x.Policy([(".*", TRAIN)], tensor_scale_groups=groups)


@pytest.mark.parametrize("linear", [None, jnp.ones((4, 4))], ids=["None", "array"])
def test_from_linear_needs_a_linear(linear):
    # (was an AttributeError on `None.weight`)
    with pytest.raises(TypeError, match=r"`linear` must be an `eqx.nn.Linear`.*got"):
        nvfp4x.QuantizedLinear.from_linear(linear, TRAIN)


@pytest.mark.parametrize("path", [None, 5, ("blocks", 0)], ids=["None", "int", "tuple"])
def test_policy_paths_must_be_strings(path):
    policy = nvfp4x.Policy([(".*", TRAIN)], tensor_scale_groups=[".*"])
    with pytest.raises(TypeError, match=r"`path` must be a string such as"):
        policy.lookup(path)
    with pytest.raises(TypeError, match=r"`path` must be a string such as"):
        policy.scale_group(path)


# ---------------------------------------------------------------------------------------
# qdot.
# ---------------------------------------------------------------------------------------

X = jnp.ones((4, 16))
W = jnp.ones((8, 16))


def test_qdot_accepts_recipe_names():
    # The same program as with the recipe object (compared as jaxprs: nothing compiled).
    by_name = jax.make_jaxpr(lambda x, w: nvfp4x.qdot(x, w, recipe="nvfp4_training"))(X, W)
    by_recipe = jax.make_jaxpr(lambda x, w: nvfp4x.qdot(x, w, recipe=TRAIN))(X, W)
    assert str(by_name) == str(by_recipe)
    with pytest.raises(ValueError, match=r"unknown recipe `'nvfp5'`; use one of"):
        nvfp4x.qdot(X, W, recipe="nvfp5")


BAD_QDOT = {
    "recipe None": (dict(recipe=None), TypeError, r"`recipe=None`: `qdot` needs a recipe"),
    "recipe int": (dict(recipe=5), TypeError, r"expected an `nvfp4x.Recipe`"),
    "seed float": (
        dict(seed=jnp.zeros(2, jnp.float32)),
        TypeError,
        r"`seed` must be two uint32 words.*jax.random.bits",
    ),
    "seed length 3": (
        dict(seed=jnp.zeros(3, jnp.uint32)),
        TypeError,
        r"`seed` must be two uint32 words.*shape \(3,\)",
    ),
    "seed typed key": (dict(seed=jax.random.key(0)), TypeError, r"`seed` must be two uint32"),
    "seed list": (dict(seed=[1, 2]), TypeError, r"`seed` must be two uint32 words.*list"),
    "x 0-d": (dict(x=jnp.float32(1.0)), ValueError, r"`x` is 0-d"),
    "x int": (dict(x=jnp.ones((4, 16), jnp.int32)), TypeError, r"`x` has dtype `int32`"),
    "x complex": (dict(x=X.astype(jnp.complex64)), TypeError, r"`x` has dtype `complex64`"),
    "w 1-D": (dict(w=jnp.ones(16)), ValueError, r"`w` has shape \(16,\).*2-D weight"),
    "k mismatch": (dict(w=jnp.ones((8, 12))), ValueError, r"`x` has 16 features.*`w`"),
    "name int": (dict(name=5), TypeError, r"`name` must be a string"),
}


@pytest.mark.parametrize("case", list(BAD_QDOT.values()), ids=list(BAD_QDOT))
def test_qdot_arguments(case):
    changes, error, match = case
    args = dict(x=X, w=W, recipe=TRAIN) | changes
    with pytest.raises(error, match=match):
        nvfp4x.qdot(args.pop("x"), args.pop("w"), **args)


def test_qdot_empty():
    # No tokens: an empty product, whose weight gradient is zero; k = 0: zeros.
    y = nvfp4x.qdot(jnp.ones((0, 16)), W, recipe=TRAIN)
    assert y.shape == (0, 8) and y.dtype == jnp.float32
    dw = jax.grad(lambda w: nvfp4x.qdot(jnp.ones((0, 16)), w, recipe=TRAIN).sum())(W)
    np.testing.assert_array_equal(dw, np.zeros((8, 16), np.float32))
    y = nvfp4x.qdot(jnp.ones((3, 0)), jnp.ones((8, 0)), recipe=TRAIN)
    np.testing.assert_array_equal(y, np.zeros((3, 8), np.float32))


# ---------------------------------------------------------------------------------------
# Layers: QuantizedLinear and FrozenLinear take what eqx.nn.Linear takes.
# ---------------------------------------------------------------------------------------


def _layers(in_features=16, out_features=8):
    linear = eqx.nn.Linear(in_features, out_features, key=jax.random.key(0))
    # (The checks do not depend on the recipe: bf16's GEMMs compile fastest.)
    qlayer = nvfp4x.quantize(linear, nvfp4x.recipes.bf16())
    return linear, {"QuantizedLinear": qlayer, "FrozenLinear": nvfp4x.freeze(qlayer)}


LAYER_KINDS = ["QuantizedLinear", "FrozenLinear"]


@pytest.mark.parametrize("kind", LAYER_KINDS)
def test_layer_integer_input_is_float(kind):
    # eqx.nn.Linear promotes an integer (or bool) input to its weight's float dtype (with
    # standard promotion; the test run's strict promotion refuses it). The quantised
    # layer's weight is float32; the frozen bf16 layer stores (and reports) bfloat16.
    linear, layers = _layers()
    layer = layers[kind]
    dtype = jnp.float32 if kind == "QuantizedLinear" else jnp.bfloat16
    x = jnp.arange(16, dtype=jnp.int32) - 8
    want = layer(x.astype(dtype))
    for xi in (x, x.astype(jnp.int8), np.asarray(x)):
        got = layer(xi)
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, want)
    assert layer(jnp.ones(16, bool)).dtype == dtype


@pytest.mark.parametrize("kind", LAYER_KINDS)
@pytest.mark.parametrize("bad", ["x", None], ids=["str", "None"])
def test_layer_refuses_non_arrays(kind, bad):
    layer = _layers()[1][kind]
    with pytest.raises(
        TypeError, match=r"parameter 'x'|takes an array `x` of shape \(\.\.\., 16\)"
    ):
        layer(bad)


@pytest.mark.parametrize("kind", LAYER_KINDS)
def test_layer_refuses_complex_input(kind):
    layer = _layers()[1][kind]
    with pytest.raises(TypeError, match=r"input `x` is complex \(complex64\).*imaginary part"):
        layer(jnp.ones(16, jnp.complex64))


def test_complex_weights_are_refused():
    linear = eqx.nn.Linear(16, 8, key=jax.random.key(0), dtype=jnp.complex64)
    for recipe in ("float32", "nvfp4_training"):
        with pytest.raises(TypeError, match=r"weight of the layer is complex.*\(path, None\)"):
            nvfp4x.quantize(linear, recipe)
    with pytest.raises(TypeError, match=r"weight of layer `\[0\]` is complex"):
        nvfp4x.quantize([linear], "float32")


@pytest.mark.parametrize("kind", LAYER_KINDS)
def test_layer_empty_inputs(kind):
    # No tokens: an empty output. No input features: the bias (x @ W.T is 0).
    linear, layers = _layers()
    assert layers[kind](jnp.ones((0, 16))).shape == (0, 8)
    linear, layers = _layers(in_features=0)
    np.testing.assert_array_equal(layers[kind](jnp.ones(0)), linear(jnp.ones(0)))
    np.testing.assert_array_equal(layers[kind](jnp.ones((3, 0))), np.tile(linear.bias, (3, 1)))


def test_layer_empty_gradient():
    linear = eqx.nn.Linear(16, 8, key=jax.random.key(0))
    qlayer = nvfp4x.quantize(linear, TRAIN)
    grads = eqx.filter_grad(lambda m: m(jnp.ones((0, 16))).sum())(qlayer)
    np.testing.assert_array_equal(grads.weight.array, np.zeros((8, 16), np.float32))


# ---------------------------------------------------------------------------------------
# telemetry.collect takes a gradient, not the model.
# ---------------------------------------------------------------------------------------


def test_collect_refuses_the_model():
    linear = eqx.nn.Linear(16, 16, key=jax.random.key(0))
    qmodel = nvfp4x.telemetry.enable(nvfp4x.quantize([linear, linear], TRAIN))
    with pytest.raises(ValueError, match=r"no layer's probe holds statistics.*not the model"):
        nvfp4x.telemetry.collect(qmodel)
    # A model whose probes an optimiser stepped (against positive statistics).
    stepped = eqx.tree_at(lambda m: m[1].weight.probe, qmodel, -jnp.ones((5, 4)))
    with pytest.raises(ValueError, match=r"probe of layer `\[1\]` holds negative amax"):
        nvfp4x.telemetry.collect(stepped)


# ---------------------------------------------------------------------------------------
# Quantised convolutions, grouped GEMMs (`ragged_dot`) and products with a quantised
# weight take their input as QuantizedLinear does, frozen or not.
# ---------------------------------------------------------------------------------------

FP8_CONVS = nvfp4x.Policy([(".*", nvfp4x.recipes.fp8())], convolutions=True)


class _Experts(eqx.Module):
    """haliax's `MoELinear`: experts `(G, in, out)` run by `lax.ragged_dot`."""

    weight: jax.Array

    def __call__(self, x, group_sizes):
        return jax.lax.ragged_dot(x, self.weight, group_sizes)


class _MoE(eqx.Module):
    experts: _Experts

    def __call__(self, x):
        return self.experts(x, jnp.array([x.shape[0] // 2, x.shape[0] - x.shape[0] // 2]))


class _Product(eqx.Module):
    weight: jax.Array

    def __call__(self, x):
        return jax.lax.dot_general(x, self.weight, (((x.ndim - 1,), (1,)), ((), ())))


def _other_layers() -> dict:
    """A quantised convolution, grouped GEMM and raw product (fp8), and each frozen,
    with the integer input each takes and how to call it."""
    conv = nvfp4x.quantize(eqx.nn.Conv1d(16, 8, 3, key=jax.random.key(0)), FP8_CONVS)
    moe = nvfp4x.quantize(_MoE(_Experts(jax.random.normal(jax.random.key(1), (2, 16, 8)))), "fp8")
    product = nvfp4x.quantize(_Product(jax.random.normal(jax.random.key(2), (8, 16))), "fp8")
    sizes = jnp.array([3, 2], jnp.int32)
    x_conv = jnp.arange(16 * 6, dtype=jnp.int32).reshape(16, 6) % 7 - 3
    x_rows = jnp.arange(5 * 16, dtype=jnp.int32).reshape(5, 16) % 7 - 3
    out = {}
    for name, model, call, x in (
        ("convolution", conv, lambda m, x: m(x), x_conv),
        ("grouped GEMM", moe, lambda m, x: m.experts(x, sizes), x_rows),
        ("product", product, lambda m, x: m(x), x_rows),
    ):
        out[name] = (model, call, x)
        out[f"frozen {name}"] = (nvfp4x.freeze(model), call, x)
    return out


OTHER_LAYERS = _other_layers()


@pytest.mark.parametrize("kind", list(OTHER_LAYERS))
def test_other_layers_cast_integer_input_and_refuse_complex(kind):
    # An int32 input to a quantised convolution gave numbers far from the same values
    # in float32; a grouped GEMM's int32 output was int32 (and truncated).
    model, call, x = OTHER_LAYERS[kind]
    got = call(model, x)  # (booleans take the same path)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, call(model, x.astype(jnp.float32)))
    with pytest.raises(TypeError, match=r"input `x` is complex \(complex64\).*imaginary part"):
        call(model, x.astype(jnp.complex64))


@pytest.mark.parametrize("frozen", [False, True], ids=["quantised", "frozen"])
def test_grouped_gemm_refuses_boolean_group_sizes(frozen):
    model, call, x = OTHER_LAYERS["frozen grouped GEMM" if frozen else "grouped GEMM"]
    for sizes in (jnp.array([True, True]), jnp.array([3.0, 2.0])):
        with pytest.raises(TypeError, match=r"`group_sizes` has dtype `(bool|float32)`.*integer"):
            model.experts(x.astype(jnp.float32), sizes)


@pytest.mark.parametrize("frozen", [False, True], ids=["quantised", "frozen"])
def test_convolution_with_no_output_pixel_is_the_float_result(frozen):
    # An empty spatial axis (ZeroDivisionError) or a window wider than the unpadded input
    # (a slice TypeError) gave no result; the float convolution's is empty.
    float_conv = eqx.nn.Conv2d(16, 8, 3, key=jax.random.key(0))
    qconv = nvfp4x.quantize(float_conv, FP8_CONVS)
    qconv = nvfp4x.freeze(qconv) if frozen else qconv
    for shape in ((16, 0, 5), (16, 2, 5), (16, 0, 0)):
        got = qconv(jnp.ones(shape))
        assert got.shape == float_conv(jnp.ones(shape)).shape and got.dtype == jnp.float32
    grad = jax.grad(lambda x: qconv(x).sum())(jnp.ones((16, 2, 5)))
    np.testing.assert_array_equal(grad, np.zeros((16, 2, 5), np.float32))
