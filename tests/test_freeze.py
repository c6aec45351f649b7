"""Inference: `nvfp4x.freeze` packs each quantised weight in its recipe's format
and drops the master copy; frozen models take 3.5x fewer weight bytes than bf16,
dequantise one layer at a time, and cannot be differentiated. (Their files:
`test_save_load.py`.)

What "the same" means here: a frozen model's forward is compared with the unfrozen
(`nvfp4x.quantize`-d) model's forward in the same mode (eager with eager, jit with jit,
vmap with vmap), bit for bit (`==`, same dtype and shape) on a CPU; on a GPU, whose XLA
picks each program's GEMM algorithm itself, and on a TPU, whose frozen NVFP4 GEMM is the
Mosaic kernel (its own summation order), up to float32 summation order
(`helpers.assert_same_sums`). Frozen trees are compared leaf by leaf as raw bytes.
"""

import functools
import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import (
    MODES,
    RECIPES,
    Stack,
    assert_same,
    assert_same_bits,
    assert_same_sums,
    freeze_jit,
    frozen_model,
    inputs,
    make,
    quantized,
    recipe_names,
)

import nvfp4x
from benchmarks.bench_inference import (
    linear_layers as layers_of,
    to_bf16,
    weight_bytes as weight_nbytes,
)

# ---------------------------------------------------------------------------------------
# Helpers.
# ---------------------------------------------------------------------------------------

NVFP4_RECIPES = ("nvfp4_inference", "nvfp4_weight_only", "nvfp4_training")
E4M3 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu

nvfp4_names = pytest.mark.parametrize("name", NVFP4_RECIPES)


# ---------------------------------------------------------------------------------------
# The frozen forward equals the unfrozen forward, bit for bit.
# ---------------------------------------------------------------------------------------


FORWARD_CASES = [
    pytest.param(model, name, id=f"{name}-{model}")
    for model in ("mixed", "stack-scan")
    for name in RECIPES
] + [pytest.param("scalar", name, id=f"{name}-scalar") for name in NVFP4_RECIPES]


@pytest.mark.parametrize("model,name", FORWARD_CASES)
def test_frozen_forward_is_bit_exact(model, name):
    qmodel = quantized(model, name)
    frozen = frozen_model(model, name)
    assert not any(isinstance(v, nvfp4x.QuantizedLinear) for v in layers_of(frozen))
    assert all(isinstance(v, nvfp4x.FrozenLinear) for v in layers_of(frozen))
    x = inputs(model)
    # An eager `lax.scan` compiles its body as one program, as jit does: for the stacked
    # model the eager mode would repeat the jit case, so it runs jit and vmap only.
    modes = ("jit", "vmap") if model == "stack-scan" else ("eager", "jit", "vmap")
    for mode in modes:
        fn = MODES[mode]
        want = fn(qmodel, x)
        got = fn(frozen, x)
        assert np.all(np.isfinite(np.asarray(want))), f"{model}/{name}/{mode}: non-finite"
        assert_same_sums(got, want, f"{model}/{name}: frozen vs unfrozen, {mode}")


def test_frozen_jit_is_one_compilation_per_structure():
    """A frozen model is an ordinary jit argument: new weights (same shapes and recipe) do
    not retrace, and the outputs follow the weights passed, not a baked-in constant."""
    traces = []

    @eqx.filter_jit
    def f(m, x):
        traces.append(None)
        return jax.vmap(m)(x)

    recipe = nvfp4x.recipes.nvfp4_inference()
    qa = nvfp4x.quantize(make("mixed", 0), recipe)
    qb = nvfp4x.quantize(make("mixed", 5), recipe)
    x = inputs("mixed")
    ya, yb = f(freeze_jit(qa), x), f(freeze_jit(qb), x)
    assert len(traces) == 1
    assert not np.array_equal(np.asarray(ya), np.asarray(yb))
    assert_same_sums(ya, MODES["jit-vmap"](qa, x), "first model vs its unfrozen form, jit")
    assert_same_sums(yb, MODES["jit-vmap"](qb, x), "second model vs its unfrozen form, jit")


# ---------------------------------------------------------------------------------------
# What a frozen layer holds.
# ---------------------------------------------------------------------------------------

#: recipe -> (container type, {field: dtype}) of the frozen weight.
HELD = {
    "nvfp4_inference": (nvfp4x.NVFP4Array, {"codes": np.uint8, "scales": E4M3}),
    "nvfp4_weight_only": (nvfp4x.NVFP4Array, {"codes": np.uint8, "scales": E4M3}),
    "nvfp4_training": (nvfp4x.NVFP4Array, {"codes": np.uint8, "scales": E4M3}),
    "mxfp8": (nvfp4x.MXFP8Array, {"data": E4M3, "scales": E8M0}),
    "fp8": (nvfp4x.FP8Array, {"data": E4M3, "scale": np.float32}),
    "bf16": (jax.Array, {}),
    "float32": (jax.Array, {}),
}


@recipe_names
def test_frozen_weight_is_held_in_its_format(name):
    model = "mixed"
    master = make(model)
    frozen = frozen_model(model, name)
    kind, fields = HELD[name]
    for i, (m, f) in enumerate(zip(layers_of(master), layers_of(frozen), strict=True)):
        where = f"{model}/{name} layer {i}"
        assert isinstance(f.weight, nvfp4x.FrozenWeight), (where, type(f.weight))
        assert isinstance(f.weight.packed, kind), (where, type(f.weight.packed))
        assert tuple(f.weight.shape) == m.weight.shape, where
        for field, dtype in fields.items():
            assert getattr(f.weight, field).dtype == np.dtype(dtype), (where, field)
        if name == "bf16":
            assert f.weight.dtype == jnp.bfloat16, where
        if name == "float32":
            assert f.weight.dtype == jnp.float32, where
        assert_same(f.bias, m.bias, f"{where}: bias kept")


fake_quantize_jit = jax.jit(nvfp4x.fake_quantize, static_argnames=("block",))
# (jitted: one compilation per shape instead of an eager dispatch of every quantiser op)
to_nvfp4_jit = jax.jit(nvfp4x.to_nvfp4, static_argnames=("block",))
dequantize_jit = eqx.filter_jit(lambda w: w.dequantize())


@nvfp4_names
def test_frozen_nvfp4_weight_has_no_master_copy(name):
    model = "mixed"
    recipe = RECIPES[name]()
    master = make(model)
    frozen = frozen_model(model, name)
    shapes = {m.weight.shape for m in layers_of(master)}
    for path, leaf in jax.tree_util.tree_flatten_with_path(frozen)[0]:
        if eqx.is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.floating):
            assert leaf.shape not in shapes, (
                f"{model}/{name}: `{jax.tree_util.keystr(path)}` {leaf.dtype}{leaf.shape} "
                "looks like a master copy of a weight"
            )
    for i, (m, f) in enumerate(zip(layers_of(master), layers_of(frozen), strict=True)):
        w = f.weight.packed
        assert isinstance(w, nvfp4x.NVFP4Array)
        assert w.codes.dtype == np.uint8
        assert w.scales.dtype == E4M3
        assert w.tensor_scale.dtype == np.float32 and w.tensor_scale.shape == ()
        assert w.block == recipe.weight.block
        # The packed weight decodes to the quantiser's numbers (computed independently
        # by the unpacked path), so the frozen GEMM runs on the same operand.
        want = fake_quantize_jit(m.weight, block=recipe.weight.block)
        got = dequantize_jit(w)
        assert_same(got, want, f"{model}/{name} layer {i}: dequantised weight")


@nvfp4_names
def test_frozen_stack_has_one_tensor_scale_per_layer(name):
    recipe = RECIPES[name]()
    nlayers, d = 4, 40
    stack = Stack(d, nlayers, jax.random.key(3))
    # Layers of very different magnitudes, so each slice needs its own tensor scale.
    factors = 2.0 ** (6 * jnp.arange(nlayers, dtype=jnp.float32) - 9)
    stack = eqx.tree_at(
        lambda s: s.layers.weight, stack, stack.layers.weight * factors[:, None, None]
    )
    qstack = nvfp4x.quantize(stack, recipe)
    frozen = freeze_jit(qstack)
    w = frozen.layers.weight.packed
    assert isinstance(frozen.layers, nvfp4x.FrozenLinear)
    assert isinstance(w, nvfp4x.NVFP4Array)
    assert w.tensor_scale.shape == (nlayers,)
    assert w.shape == (nlayers, d, d)
    assert len(set(np.asarray(w.tensor_scale).tolist())) == nlayers
    for i in range(nlayers):
        one = to_nvfp4_jit(stack.layers.weight[i], block=recipe.weight.block)
        assert_same(w.tensor_scale[i], one.tensor_scale, f"{name}: tensor scale of layer {i}")
        assert_same(w.codes[i], one.codes, f"{name}: codes of layer {i}")
        assert_same(w.scales[i].view(np.uint8), one.scales.view(np.uint8), f"{name}: scales {i}")
    x = inputs("stack-scan")
    # (jit only: an eager vmap of a `lax.scan` compiles the same batched scan program)
    fn = MODES["jit-vmap"]
    assert_same_sums(fn(frozen, x), fn(qstack, x), f"{name}: scaled stack, jit-vmap")


@pytest.mark.parametrize("name", ["nvfp4_inference", "nvfp4_training", "mxfp8", "fp8"])
def test_eager_freeze_equals_jitted_freeze(name):
    """What a user gets from `nvfp4x.freeze` eagerly is what the other tests (which freeze
    under jit to save time) check: the same packed bits and the same static fields."""
    qmodel = quantized("odd-features", name, keep_last=True)
    eager = nvfp4x.freeze(qmodel)
    assert_same_bits(eager, frozen_model("odd-features", name, keep_last=True), name)


def test_freeze_leaves_unquantised_layers_alone():
    policy = nvfp4x.Policy([(r"layers\[2\]", None), (r".*", nvfp4x.recipes.nvfp4_inference())])
    master = make("odd-features")
    frozen = freeze_jit(nvfp4x.quantize(master, policy))
    kinds = [type(v) for v in layers_of(frozen)]
    assert kinds == [nvfp4x.FrozenLinear, nvfp4x.FrozenLinear, eqx.nn.Linear]
    assert_same_bits(layers_of(frozen)[2], layers_of(master)[2], "unquantised layer")
    # Freezing twice changes nothing.
    assert_same_bits(freeze_jit(frozen), frozen, "freeze(freeze(m))")


# ---------------------------------------------------------------------------------------
# Bytes: in memory and on disk.
# ---------------------------------------------------------------------------------------


@functools.cache
def wide_model() -> eqx.nn.MLP:
    """256x1024 layers (multiples of 16): 256->1024->1024->256."""
    return eqx.nn.MLP(256, 256, 1024, 2, key=jax.random.key(11))


@functools.cache
def frozen_wide(name: str) -> Any:
    return freeze_jit(nvfp4x.quantize(wide_model(), RECIPES[name]()))


@nvfp4_names
def test_weight_bytes_at_least_3_5x_smaller_than_bf16(name):
    frozen = frozen_wide(name)
    packed = weight_nbytes(frozen)
    bf16 = weight_nbytes(to_bf16(wide_model()))
    assert bf16 == 2 * sum(m.weight.size for m in layers_of(wide_model()))
    # nbytes counts what is really held: codes + block scales + tensor scale.
    for layer in layers_of(frozen):
        w = layer.weight
        assert w.nbytes == w.codes.nbytes + w.scales.nbytes + w.tensor_scale.nbytes
    ratio = bf16 / packed
    assert ratio >= 3.5, f"{name}: bf16 {bf16:,} B / frozen {packed:,} B = {ratio:.3f}"


@nvfp4_names
def test_checkpoint_file_at_least_3_4x_smaller_than_bf16(name, tmp_path):
    frozen = frozen_wide(name)
    eqx.tree_serialise_leaves(tmp_path / "bf16.eqx", to_bf16(wide_model()))
    eqx.tree_serialise_leaves(tmp_path / "frozen.eqx", frozen)
    nvfp4x.save(str(tmp_path / "frozen.nvfp4x"), frozen)
    bf16 = (tmp_path / "bf16.eqx").stat().st_size
    for file in ("frozen.eqx", "frozen.nvfp4x"):
        size = (tmp_path / file).stat().st_size
        assert bf16 / size >= 3.4, f"{name} {file}: {bf16:,} B / {size:,} B = {bf16 / size:.3f}"


# ---------------------------------------------------------------------------------------
# summary.
# ---------------------------------------------------------------------------------------


def summary_rows(table: str) -> list[list[str]]:
    """Rows of the table, cells split on runs of 2+ spaces; rule lines dropped."""
    lines = [ln for ln in table.splitlines() if ln.strip() and not set(ln.strip()) <= {"-", " "}]
    return [re.split(r"\s{2,}", ln.strip()) for ln in lines]


@recipe_names
def test_summary_of_frozen_model(name):
    frozen = frozen_model("mixed", name)
    rows = summary_rows(nvfp4x.summary(frozen))
    body, total = rows[1:-1], rows[-1]
    layers = layers_of(frozen)
    assert len(body) == len(layers)
    held_sum = 0
    for row, layer in zip(body, layers, strict=True):
        assert any("(frozen)" in cell for cell in row), row
        held = int(row[-2].replace(",", ""))
        want = sum(int(leaf.nbytes) for leaf in jax.tree_util.tree_leaves(layer.weight))
        assert held == want, (row, want)
        held_sum += held
    assert total[0] == "total"
    assert int(total[-2].replace(",", "")) == held_sum == weight_nbytes(frozen)


# ---------------------------------------------------------------------------------------
# No differentiation through a frozen model.
# ---------------------------------------------------------------------------------------


def frozen_loss(m, x):
    return jnp.sum(jax.vmap(m)(x))


@recipe_names
def test_grad_of_frozen_model_raises(name):
    frozen = frozen_model("mixed", name)
    x = inputs("mixed")
    with pytest.raises(TypeError, match="frozen"):
        eqx.filter_grad(frozen_loss)(frozen, x)
    with pytest.raises(TypeError, match="frozen"):
        eqx.filter_jit(eqx.filter_grad(frozen_loss))(frozen, x)
    with pytest.raises(TypeError, match="frozen"):
        jax.grad(lambda x: frozen_loss(frozen, x))(x)
    with pytest.raises(TypeError, match="frozen"):
        jax.jit(jax.grad(lambda x: frozen_loss(frozen, x)))(x)


def test_grad_of_frozen_stack_raises():
    frozen = frozen_model("stack-scan", "nvfp4_inference")
    x = inputs("stack-scan")
    with pytest.raises(TypeError, match="frozen"):
        eqx.filter_grad(frozen_loss)(frozen, x)
    with pytest.raises(TypeError, match="frozen"):
        jax.grad(lambda x: frozen_loss(frozen, x))(x)


# ---------------------------------------------------------------------------------------
# Peak memory: one layer's dequantised weight at a time.
# ---------------------------------------------------------------------------------------


MEMORY_MODELS = {
    # 8 layers of 512x512: an unrolled eqx.nn.MLP, and a stack run with lax.scan.
    "mlp": lambda key: eqx.nn.MLP(512, 512, 512, 7, key=key),
    "stack-scan": lambda key: Stack(512, 8, key),
}


@pytest.mark.parametrize("model", list(MEMORY_MODELS))
@pytest.mark.parametrize("name", ["nvfp4_inference", "nvfp4_weight_only"])
def test_jitted_frozen_forward_dequantises_per_layer(name, model):
    d, nlayers, batch = 512, 8, 4
    frozen = freeze_jit(nvfp4x.quantize(MEMORY_MODELS[model](jax.random.key(13)), RECIPES[name]()))
    weights = [layer.weight for layer in layers_of(frozen)]
    assert sum(int(np.prod(w.shape)) for w in weights) == nlayers * d * d
    params, static = eqx.partition(frozen, eqx.is_array)

    def forward(p, x):
        return jax.vmap(eqx.combine(p, static))(x)

    x = jnp.zeros((batch, d), jnp.float32)
    analysis = jax.jit(forward).lower(params, x).compile().memory_analysis()
    if analysis is None:
        pytest.skip("memory_analysis() returned None on this backend")
    temp = analysis.temp_size_in_bytes
    all_dequantised_bf16 = nlayers * d * d * 2
    assert temp < all_dequantised_bf16, (
        f"{name}/{model}: peak temporary bytes {temp:,} >= {all_dequantised_bf16:,}, the bf16 "
        f"dequantised weights of all {nlayers} layers: they are decoded all at once"
    )


def test_a_frozen_linear_is_an_eqx_linear_like_the_quantized_one():
    """A filter written for `eqx.nn.Linear` selects the same layers before and after
    `freeze` (as it does before and after `quantize`)."""
    mlp = eqx.nn.MLP(8, 4, 16, 1, key=jax.random.key(0))
    model = nvfp4x.quantize(mlp, "nvfp4_inference")
    frozen = nvfp4x.freeze(model)
    linears = lambda m: [
        x for x in jax.tree.leaves(m, is_leaf=lambda x: isinstance(x, eqx.nn.Linear))
        if isinstance(x, eqx.nn.Linear)
    ]  # fmt: skip
    assert all(isinstance(x, nvfp4x.FrozenLinear) for x in linears(frozen))
    assert len(linears(frozen)) == len(linears(model)) == len(linears(mlp)) == 2


# --- weights a wrapper transforms before its GEMM (issue 34) ---


class _NormedLinear(eqx.Module):
    """A user's wrapper that reads its layer's weight before the GEMM (a learned
    per-row scale over the row norm, as weight-normalised ports write it)."""

    layer: eqx.nn.Linear
    scale: jax.Array

    def __init__(self, key):
        self.layer = eqx.nn.Linear(32, 32, key=key)
        self.scale = jnp.linspace(0.5, 1.5, 32)[:, None]

    def __call__(self, x):
        w = self.layer.weight
        w = w * self.scale / jnp.linalg.norm(w, axis=1, keepdims=True)
        return x @ w.T + self.layer.bias


def _wrapped_models():
    key = jax.random.key(0)
    spectral, state = eqx.nn.make_with_state(eqx.nn.SpectralNorm)(
        eqx.nn.Linear(32, 32, key=key), "weight", key=jax.random.key(1)
    )
    weight_norm = eqx.nn.WeightNorm(eqx.nn.Conv1d(16, 32, 3, key=key))
    return spectral, state, weight_norm


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_frozen_weight_wrappers_equal_training_bit_for_bit(jit):
    # `eqx.nn.SpectralNorm` (σ by power iteration on the master weight) and
    # `eqx.nn.WeightNorm` (`v * g / ||v||`) transform the master weight before the
    # GEMM: `freeze` finds them and keeps the master, so the frozen forward computes
    # the same quantised GEMM of the same effective weight.
    spectral, state, weight_norm = _wrapped_models()
    policy = nvfp4x.Policy([(".*", RECIPES["nvfp4_training"]())], convolutions=True)
    x = jax.random.normal(jax.random.key(2), (8, 32))
    xc = jax.random.normal(jax.random.key(3), (16, 20))
    maybe = eqx.filter_jit if jit else lambda f: f

    @maybe
    def run(m, s, inference):
        return jax.vmap(lambda xi: m(xi, s, inference=inference))(x)[0]

    qs = nvfp4x.quantize(spectral, policy)
    fs = nvfp4x.freeze(qs)
    assert fs.layer.weight.master is not None
    for inference in (False, True):
        assert_same_sums(run(fs, state, inference), run(qs, state, inference), "spectral")
    qw = nvfp4x.quantize(weight_norm, policy)
    fw = nvfp4x.freeze(qw)
    assert fw.layer.weight.master is not None
    call = maybe(lambda m: m(xc))
    assert_same_sums(call(fw), call(qw), "weight norm")


def test_frozen_user_wrapper_is_refused_without_its_master_and_exact_with_it():
    # A wrapper `freeze` cannot see: the frozen forward refuses the transform by the
    # weight's name and the fix; with the fix it equals training bit for bit.
    qmodel = nvfp4x.quantize(_NormedLinear(jax.random.key(0)), RECIPES["nvfp4_training"]())
    x = jax.random.normal(jax.random.key(2), (8, 32))
    with pytest.raises(ValueError, match=r"`layer` is transformed by `mul`.*tied=\[\"layer\"\]"):
        nvfp4x.freeze(qmodel)(x)
    frozen = nvfp4x.freeze(qmodel, tied=["layer"])
    assert_same_sums(frozen(x), qmodel(x), "user wrapper, eager")
    jitted = eqx.filter_jit(lambda m: m(x))
    assert_same_sums(jitted(frozen), jitted(qmodel), "user wrapper, jit")
