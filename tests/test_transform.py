"""`quantize` / `dequantize` / `summary`, policies and recipes.

A zoo of Equinox models is quantised, run, differentiated and restored; policies are
checked on paths such as `blocks[3].mlp.layers[0]`; every user error has a test; and a
small classifier trained with `nvfp4_training` is compared with float32 training.
"""

import dataclasses
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import RECIPES, TRAIN, normal

import nvfp4x
from nvfp4x._sites import path_str

D = 24  # feature size, not a multiple of 16


def keys(seed: int, n: int):
    return tuple(jax.random.split(jax.random.key(seed), n))


def is_linear(x) -> bool:
    return isinstance(x, eqx.nn.Linear | nvfp4x.QuantizedLinear)


def tree_equal(a, b) -> bool:
    """`eqx.tree_equal` as a Python bool: same structure, static fields, dtypes and values.
    (It returns a boolean *array* when the trees hold arrays, `False` on a mismatch.)"""
    return bool(eqx.tree_equal(a, b))


def layers_of(model):
    """`[(type, weight shape)]` of every linear layer, in tree order."""
    leaves = jax.tree_util.tree_leaves(model, is_leaf=is_linear)
    return [(type(v), v.weight.shape) for v in leaves if is_linear(v)]


# ---------------------------------------------------------------------------------------
# The zoo.
# ---------------------------------------------------------------------------------------


class Block(eqx.Module):
    """Pre-norm transformer block on one sequence `(seq, D)`; per-token layers are vmapped."""

    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.ln1 = eqx.nn.LayerNorm(D)
        self.attn = eqx.nn.MultiheadAttention(
            2, D, use_query_bias=True, use_output_bias=True, key=k1
        )
        self.ln2 = eqx.nn.LayerNorm(D)
        self.mlp = eqx.nn.MLP(D, D, 2 * D, depth=1, activation=jax.nn.gelu, key=k2)

    def __call__(self, x):
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h)
        return x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))


class ScannedStack(eqx.Module):
    """Blocks made with `eqx.filter_vmap` (weights `(L, out, in)`), run with `lax.scan`."""

    blocks: Block

    def __init__(self, key, n=2):
        self.blocks = eqx.filter_vmap(Block)(jax.random.split(key, n))

    def __call__(self, x):
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def body(h, p):
            return eqx.combine(p, static)(h), None

        return jax.lax.scan(body, x, params)[0]


class Nested(eqx.Module):
    """Linear layers in a list, a tuple and a dict inside a user module."""

    seq: list
    pair: tuple
    heads: dict

    def __init__(self, key):
        k = jax.random.split(key, 5)
        self.seq = [eqx.nn.Linear(D, D, key=k[0]), eqx.nn.Linear(D, D, key=k[1])]
        self.pair = (eqx.nn.Linear(D, 20, key=k[2]), jnp.float32(0.5))
        self.heads = {"a": eqx.nn.Linear(20, 3, key=k[3]), "b": eqx.nn.Linear(20, 5, key=k[4])}

    def __call__(self, x):
        for layer in self.seq:
            x = jnp.tanh(layer(x))
        x = self.pair[0](x) * self.pair[1]
        return jnp.concatenate([self.heads["a"](x), self.heads["b"](x)], axis=-1)


class ScalarIO(eqx.Module):
    inp: eqx.nn.Linear
    out: eqx.nn.Linear
    both: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.inp = eqx.nn.Linear("scalar", D, key=k[0])
        self.out = eqx.nn.Linear(D, "scalar", key=k[1])
        self.both = eqx.nn.Linear("scalar", "scalar", key=k[2])

    def __call__(self, x):  # x: () per example
        return self.both(self.out(jnp.tanh(self.inp(x))))


def per_example(model, xs):
    return jax.vmap(model)(xs)


# name: (constructor, input shape for the whole batch, how to apply the model to it)
ZOO = {
    "mlp": (lambda k: eqx.nn.MLP(D, 5, 32, depth=2, key=k), (6, D), per_example),
    "mlp-scan": (lambda k: eqx.nn.MLP(D, 5, 32, depth=3, scan=True, key=k), (6, D), per_example),
    "transformer-block": (Block, (2, 5, D), per_example),
    "scanned-stack": (ScannedStack, (2, 5, D), per_example),
    "nested-containers": (Nested, (6, D), per_example),
    "sequential": (
        lambda k: eqx.nn.Sequential(
            [
                eqx.nn.Linear(D, 32, key=k),
                eqx.nn.Lambda(jax.nn.gelu),
                eqx.nn.Linear(32, D, key=jax.random.fold_in(k, 1)),
            ]
        ),
        (6, D),
        per_example,
    ),
    "no-bias": (lambda k: eqx.nn.Linear(D, 9, use_bias=False, key=k), (6, D), per_example),
    "scalar-features": (ScalarIO, (6,), per_example),
}


def alternating_policy():
    """`nvfp4_training` for the 1st, 3rd, ... layer and `bf16` for the others: every
    model holds both (and compiling the zoo stays cheap)."""
    count = []

    def policy(path, linear):
        count.append(path)
        return TRAIN if len(count) % 2 == 1 else nvfp4x.recipes.bf16()

    return policy


@pytest.mark.parametrize("name", list(ZOO), ids=list(ZOO))
def test_zoo_quantize_run_grad_dequantize(name):
    make, xshape, apply = ZOO[name]
    model = make(jax.random.key(0))
    qmodel = nvfp4x.quantize(model, alternating_policy())

    before, after = layers_of(model), layers_of(qmodel)
    assert before and all(t is eqx.nn.Linear for t, _ in before)
    assert [s for _, s in after] == [s for _, s in before]
    assert all(t is nvfp4x.QuantizedLinear for t, _ in after)
    assert list(recipe_by_path(qmodel).values())[0] == TRAIN
    # Nothing but the linear layers changed (a user module holding them may run its
    # `__call__` interpreted, as a same-named subclass: values and isinstance unchanged).
    strip = lambda m: jax.tree_util.tree_map(
        lambda v: None if is_linear(v) else v, m, is_leaf=is_linear
    )
    assert isinstance(qmodel, type(model))
    leaves = jax.tree_util.tree_leaves
    assert tree_equal(leaves(strip(qmodel)), leaves(strip(model)))

    x = normal(1, xshape)

    @eqx.filter_jit
    def value_and_grad(m):
        return eqx.filter_value_and_grad(lambda m: jnp.mean(apply(m, x) ** 2))(m)

    loss, grads = value_and_grad(qmodel)
    assert np.isfinite(float(loss)) and float(loss) > 0
    gleaves = jax.tree_util.tree_leaves(eqx.filter(grads, eqx.is_inexact_array))
    assert gleaves and all(np.all(np.isfinite(np.asarray(g))) for g in gleaves)
    qweights = [
        v.weight.array for v in jax.tree_util.tree_leaves(grads, is_leaf=is_linear) if is_linear(v)
    ]
    assert len(qweights) == len(before) and any(np.any(np.asarray(w) != 0) for w in qweights)

    assert tree_equal(nvfp4x.dequantize(qmodel), model)


# ---------------------------------------------------------------------------------------
# Paths, summary and policies.
# ---------------------------------------------------------------------------------------


class Tower(eqx.Module):
    blocks: list
    lm_head: eqx.nn.Linear

    def __init__(self, key, n=4):
        k = jax.random.split(key, n + 1)
        self.blocks = [Block(k[i]) for i in range(n)]
        self.lm_head = eqx.nn.Linear(D, 11, key=k[n])

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return jax.vmap(self.lm_head)(x)


@pytest.fixture(scope="module")
def tower():
    return Tower(jax.random.key(3))


def recipe_by_path(model) -> dict:
    """`{path: recipe or None}` for every linear layer, in tree order."""
    out = {}
    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_linear)[0]
    for path, v in leaves:
        if is_linear(v):
            out[path_str(path)] = v.recipe if isinstance(v, nvfp4x.QuantizedLinear) else None
    return out


def test_summary_paths(tower):
    q = nvfp4x.quantize(tower, TRAIN)
    text = nvfp4x.summary(q)
    for path in (
        "blocks[3].mlp.layers[0]",
        "blocks[3].mlp.layers[1]",
        "blocks[0].attn.query_proj",
        "blocks[2].attn.output_proj",
        "lm_head",
    ):
        assert re.search(rf"(^|\s){re.escape(path)}\s", text, re.M), f"{path} not in\n{text}"
    assert "nvfp4 16x16" in text and "nvfp4 1x16, SR" in text
    # One row per linear layer.
    n_layers = len(layers_of(tower))
    assert n_layers == 4 * 6 + 1
    assert sum(bool(re.match(r"(blocks|lm_head)", line)) for line in text.splitlines()) == n_layers


def test_summary_dict_and_tuple_paths():
    text = nvfp4x.summary(nvfp4x.quantize(Nested(jax.random.key(4)), TRAIN))
    for path in ("seq[0]", "seq[1]", "pair[0]", "heads[a]", "heads[b]"):
        assert re.search(rf"(^|\s){re.escape(path)}\s", text, re.M), f"{path} not in\n{text}"


def test_policy_first_match_wins_and_none_keeps_linear(tower):
    bf16 = nvfp4x.recipes.bf16()
    policy = nvfp4x.Policy(
        [
            (r"lm_head", None),
            (r"blocks\[(2|3)\]\..*", bf16),
            (r"blocks\[3\]\.mlp\..*", nvfp4x.recipes.fp8()),  # shadowed by the rule above
            (r".*", TRAIN),
        ],
        strict=False,
    )
    q = nvfp4x.quantize(tower, policy)
    got = recipe_by_path(q)
    assert q.lm_head is tower.lm_head  # None: the very same eqx.nn.Linear
    for path, recipe in got.items():
        if path == "lm_head":
            assert recipe is None
        elif path.startswith(("blocks[2]", "blocks[3]")):
            assert recipe == bf16, path
        else:
            assert recipe == TRAIN, path
    # The shadowed rule matched nothing by itself: strict mode names it.
    with pytest.raises(ValueError, match=re.escape(r"blocks\[3\]\.mlp\..*")):
        nvfp4x.quantize(tower, nvfp4x.Policy(policy_rules(policy)))


def policy_rules(policy):
    return [(r.pattern, rec) for r, rec in policy.rules]


def test_policy_uses_fullmatch(tower):
    # `re.search` would find "mlp.layers[0]" inside "blocks[0].mlp.layers[0]".
    q = nvfp4x.quantize(tower, nvfp4x.Policy([(r"mlp\.layers\[0\]", TRAIN)], strict=False))
    assert all(t is eqx.nn.Linear for t, _ in layers_of(q))
    q = nvfp4x.quantize(tower, nvfp4x.Policy([(r".*mlp\.layers\[0\]", TRAIN)]))
    quantised = [p for p, r in recipe_by_path(q).items() if r is not None]
    assert quantised == [f"blocks[{i}].mlp.layers[0]" for i in range(4)]


def test_bf16_recipe_still_quantizedlinear():
    lin = eqx.nn.Linear(D, 7, key=jax.random.key(5))
    q = nvfp4x.quantize(lin, nvfp4x.recipes.bf16())
    assert isinstance(q, nvfp4x.QuantizedLinear) and q.recipe == nvfp4x.recipes.bf16()
    x = normal(6, (4, D))
    y = q(x)
    assert y.dtype == jnp.float32
    # Computes in bf16: the product of the bf16-rounded operands, accumulated in float32.
    xb, wb = x.astype(jnp.bfloat16).astype(jnp.float32), lin.weight.astype(jnp.bfloat16)
    want = xb @ wb.astype(jnp.float32).T + lin.bias
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-5)
    # ... not float32's product (at HIGHEST: a TPU's DEFAULT is itself one bfloat16 pass)
    with jax.default_matmul_precision("highest"):
        y32 = jax.vmap(lin)(x)
    assert not np.allclose(np.asarray(y), np.asarray(y32), rtol=1e-6, atol=1e-6)


def test_callable_policy(tower):
    seen = []

    def policy(path, linear):
        seen.append(path)
        assert isinstance(linear, eqx.nn.Linear)
        if path == "lm_head":
            return None
        return "bf16" if linear.out_features > D else TRAIN

    q = nvfp4x.quantize(tower, policy)
    assert seen == list(recipe_by_path(tower))
    got = recipe_by_path(q)
    assert got["lm_head"] is None
    assert got["blocks[1].mlp.layers[0]"] == nvfp4x.recipes.bf16()  # D -> 2D
    assert got["blocks[1].mlp.layers[1]"] == TRAIN


def test_single_recipe_or_name_as_policy(tower):
    inf = nvfp4x.recipes.nvfp4_inference()
    for policy in (inf, "nvfp4_inference"):
        got = recipe_by_path(nvfp4x.quantize(tower, policy))
        assert len(got) == 25 and all(r == inf for r in got.values()), policy


# ---------------------------------------------------------------------------------------
# Bad input.
# ---------------------------------------------------------------------------------------


def test_unknown_format_name():
    with pytest.raises(ValueError, match="nvfp5"):
        nvfp4x.Format("nvfp5")


def test_unknown_recipe_name():
    lin = eqx.nn.Linear(D, D, key=jax.random.key(0))
    with pytest.raises(ValueError, match="nvfp5_training"):
        nvfp4x.quantize(lin, "nvfp5_training")
    with pytest.raises(ValueError, match="nvfp5_training"):
        nvfp4x.Policy([(".*", "nvfp5_training")])


def test_regex_that_does_not_compile():
    with pytest.raises(ValueError, match=re.escape("blocks[(")):
        nvfp4x.Policy([(r"blocks[(", TRAIN)])


def test_rule_matching_nothing(tower):
    rules = [(r"blocks\[9\]\..*", TRAIN), (r".*", nvfp4x.recipes.bf16())]
    with pytest.raises(ValueError, match=re.escape(r"blocks\[9\]\..*")):
        nvfp4x.quantize(tower, nvfp4x.Policy(rules))
    q = nvfp4x.quantize(tower, nvfp4x.Policy(rules, strict=False))
    assert all(r == nvfp4x.recipes.bf16() for r in recipe_by_path(q).values())


def test_callable_returning_non_recipe(tower):
    with pytest.raises(TypeError, match=re.escape("blocks[0].attn.query_proj")):
        nvfp4x.quantize(tower, lambda path, linear: 42)


def test_wrong_last_axis():
    q = nvfp4x.quantize(eqx.nn.Linear(D, 5, key=jax.random.key(0)), TRAIN)
    with pytest.raises(ValueError, match="in_features"):
        q(jnp.ones((3, D + 1), jnp.float32))
    with pytest.raises(ValueError, match="in_features"):
        q(jnp.ones((), jnp.float32))


@pytest.mark.parametrize("shape", [(7, 5), (33, 17), (16, 48)], ids=["7-5", "33-17", "16-48"])
def test_feature_sizes_not_multiples_of_16(shape):
    k, n = shape
    lin = eqx.nn.Linear(k, n, key=jax.random.key(7))
    q = nvfp4x.quantize(lin, TRAIN)
    x = normal(8, (19, k))
    y, g = eqx.filter_jit(lambda m: (m(x), eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2))(m)))(q)
    y32 = jax.vmap(lin)(x)
    assert y.shape == (19, n)
    sqnr = 10 * np.log10(np.sum(np.asarray(y32) ** 2) / np.sum(np.asarray(y - y32) ** 2))
    assert sqnr > 12, sqnr  # NVFP4 on both operands: ~15-20 dB
    assert g.weight.shape == (n, k) and np.all(np.isfinite(np.asarray(g.weight)))


def test_model_without_linear_warns_and_is_unchanged():
    model = [eqx.nn.LayerNorm(D), {"conv": eqx.nn.Conv1d(2, 3, 3, key=jax.random.key(0))}]
    with pytest.warns(UserWarning, match="no `eqx.nn.Linear`"):
        out = nvfp4x.quantize(model, TRAIN)
    assert tree_equal(out, model)


# ---------------------------------------------------------------------------------------
# Recipes.
# ---------------------------------------------------------------------------------------

RECIPE_NAMES = list(RECIPES)


@pytest.mark.parametrize("name", RECIPE_NAMES, ids=RECIPE_NAMES)
def test_recipes_hashable_immutable_readable(name):
    r = getattr(nvfp4x.recipes, name)()
    assert r == getattr(nvfp4x.recipes, name)() and hash(r) == hash(getattr(nvfp4x.recipes, name)())
    assert {r: 1}[getattr(nvfp4x.recipes, name)()] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.rht = not r.rht
    if r.weight is not None:
        with pytest.raises(dataclasses.FrozenInstanceError):
            r.weight.name = "bf16"
    text = str(r)
    assert name in text and "\n" not in text and len(text) < 120
    assert "object at 0x" not in text


def test_nvfp4_training_matches_spec():
    r = nvfp4x.recipes.nvfp4_training()
    F = nvfp4x.Format
    assert r.weight == F("nvfp4", (16, 16), "nearest")
    assert r.input == F("nvfp4", (1, 16), "nearest")
    assert r.grad == F("nvfp4", (1, 16), "stochastic")
    assert r.rht is True
    assert str(r) == "nvfp4_training(w=nvfp4 16x16, x=nvfp4 1x16, dy=nvfp4 1x16, SR, rht)"


def test_nvfp4_training_options():
    r = nvfp4x.recipes.nvfp4_training
    assert r(rht=False).rht is False and r(rht=False).grad.rounding == "stochastic"
    assert (
        r(stochastic_rounding=False).grad.rounding == "nearest" and r(stochastic_rounding=False).rht
    )
    assert r(weight_block=(1, 16)).weight == nvfp4x.Format("nvfp4", (1, 16), "nearest")
    assert len({r(), r(rht=False), r(stochastic_rounding=False), r(weight_block=(1, 16))}) == 4


def test_other_recipes_fields():
    F, rec = nvfp4x.Format, nvfp4x.recipes
    assert rec.nvfp4_inference().input == F("nvfp4", (1, 16)) and rec.nvfp4_inference().grad is None
    assert rec.nvfp4_weight_only().weight.name == "nvfp4" and rec.nvfp4_weight_only().input is None
    fp8 = rec.fp8()
    assert (fp8.weight.name, fp8.input.name, fp8.grad.name) == ("fp8_e4m3", "fp8_e4m3", "fp8_e5m2")
    assert rec.mxfp8().input == F("mxfp8", (1, 32))
    assert all(getattr(rec.bf16(), f) == F("bf16") for f in ("weight", "input", "grad"))


# ---------------------------------------------------------------------------------------
# A small classifier: NVFP4 training within 15% of float32.
# ---------------------------------------------------------------------------------------


def gaussian_mixture(seed, n, classes=4):
    rng = np.random.default_rng(seed)
    centres = np.array([[np.cos(a), np.sin(a)] for a in 2 * np.pi * np.arange(classes) / classes])
    y = rng.integers(0, classes, n)
    x = 1.5 * centres[y] + 0.6 * rng.standard_normal((n, 2))
    return jnp.asarray(x.astype(np.float32)), jnp.asarray(y.astype(np.int32))


def train_classifier(policy, steps=150, batch=128):
    x, y = gaussian_mixture(0, steps * batch)
    # one hidden layer: enough to learn the mixture, and one GEMM fewer to compile
    model = eqx.nn.MLP(2, 4, 64, depth=1, activation=jax.nn.gelu, key=jax.random.key(1))
    if policy is not None:
        model = nvfp4x.quantize(model, policy)
    opt = optax.adam(3e-3)
    state = opt.init(eqx.filter(model, eqx.is_array))

    def loss_fn(m, xb, yb):
        logits = jax.vmap(m)(xb)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, yb))

    @eqx.filter_jit
    def step(m, s, xb, yb):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(m, xb, yb)
        updates, s = opt.update(grads, s, eqx.filter(m, eqx.is_array))
        return eqx.apply_updates(m, updates), s

    # optax's bias correction computes `float ** int32`, which strict promotion rejects.
    with jax.numpy_dtype_promotion("standard"):
        for i in range(steps):
            sl = slice(i * batch, (i + 1) * batch)
            model, state = step(model, state, x[sl], y[sl])
        xe, ye = gaussian_mixture(1, 2048)
        return model, float(eqx.filter_jit(loss_fn)(model, xe, ye))


def test_classifier_nvfp4_training_close_to_float32():
    _, loss32 = train_classifier(None)
    qmodel, loss4 = train_classifier(TRAIN)
    assert loss32 < 0.6, loss32  # it learned something (chance: ln 4 = 1.39)
    assert loss4 <= 1.15 * loss32, (loss4, loss32)
    # The trained master weights come back as plain Linear layers.
    back = nvfp4x.dequantize(qmodel)
    assert all(t is eqx.nn.Linear for t, _ in layers_of(back))
    for a, b in zip(back.layers, qmodel.layers, strict=True):
        assert a.weight is b.weight.array and a.bias is b.bias


def test_no_linear_warning_points_raw_weights_to_qdot():
    params = {"w": jnp.ones((D, D)), "b": jnp.zeros((D,))}  # a model of raw arrays
    with pytest.warns(UserWarning, match=r"raw arrays, call `nvfp4x.qdot\(x, w, recipe=...\)`"):
        assert tree_equal(nvfp4x.quantize(params, TRAIN), params)
