"""Frozen models compute what the trained ones did where a weight is read two
ways (an LM head tied to the input embedding: a quantised GEMM and a lookup of the master
values), and where a user's head kept in bf16 is read directly under `jax.jit`.

The models are written the way public Equinox code ties its heads: esm2quinox builds an
`eqx.nn.Embedding` from the head's weight in a property; Equinox's documentation ties
them with `eqx.nn.Shared`."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
from helpers import assert_same_bits, assert_same_sums, normal

import nvfp4x

D, V, T = 32, 48, 16
TOKENS = jnp.arange(T) % V


class Block(eqx.Module):
    """A residual MLP block: float32 parameters, so a bfloat16 input changes the carry's
    dtype (the `lax.scan` of a frozen bf16 tie used to fail on this)."""

    fc: eqx.nn.Linear

    def __init__(self, key):
        self.fc = eqx.nn.Linear(D, D, key=key)

    def __call__(self, x):
        return x + jnp.tanh(self.fc(x))


class ESM2Like(eqx.Module):
    """esm2quinox's tie: the embedding is a property built from the head's weight; the
    layers are a `filter_vmap` stack run by `lax.scan`; the head is called, or read as
    `h @ self.head.weight.T`."""

    layers: Block
    head: eqx.nn.Linear
    read: bool = eqx.field(static=True)

    def __init__(self, key, read=False):
        k1, k2 = jax.random.split(key)
        self.layers = eqx.filter_vmap(Block)(jax.random.split(k1, 2))
        self.head = eqx.nn.Linear(D, V, use_bias=False, key=k2)
        self.read = read

    @property
    def embedding(self):
        return eqx.nn.Embedding(num_embeddings=V, embedding_size=D, weight=self.head.weight)

    def __call__(self, tokens):
        x = jax.vmap(self.embedding)(tokens)
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def step(x, layer):
            return jax.vmap(eqx.combine(layer, static))(x), None

        x, _ = jax.lax.scan(step, x, dynamic)
        return x @ self.head.weight.T if self.read else jax.vmap(self.head)(x)


class SharedTie(eqx.Module):
    """Equinox's documented tie: `eqx.nn.Shared((embedding, head), where, get)`, the
    table held by the embedding (`embed_first`) or by the head."""

    shared: eqx.nn.Shared
    block: Block

    def __init__(self, key, embed_first=True):
        k1, k2, k3 = jax.random.split(key, 3)
        embed = eqx.nn.Embedding(V, D, key=k1)
        head = eqx.nn.Linear(D, V, use_bias=False, key=k2)
        if embed_first:
            where, get = (lambda p: p[1].weight), (lambda p: p[0].weight)
        else:
            where, get = (lambda p: p[0].weight), (lambda p: p[1].weight)
        self.shared = eqx.nn.Shared((embed, head), where, get)
        self.block = Block(k3)

    def __call__(self, tokens):
        embed, head = self.shared()
        step = lambda x, _: (jax.vmap(self.block)(x), None)
        x, _ = jax.lax.scan(step, jax.vmap(embed)(tokens), None, length=2)
        return jax.vmap(head)(x)


def policy(head: nvfp4x.Recipe, name: str) -> nvfp4x.Policy:
    return nvfp4x.Policy([(name, head), (".*", nvfp4x.recipes.nvfp4_training())])


@eqx.filter_jit
def call(model, tokens):
    return model(tokens)


def assert_frozen_equals_trained(qmodel, frozen) -> None:
    """Eagerly and under jit: bit for bit on a CPU; elsewhere up to float32 summation
    order (`assert_same_sums`: a TPU's frozen NVFP4 GEMM is the Mosaic kernel, which
    sums in its own order)."""
    for mode, run in (("eager", lambda m: m(TOKENS)), ("jit", lambda m: call(m, TOKENS))):
        y, y_frozen = run(qmodel), run(frozen)
        assert y_frozen.dtype == y.dtype
        assert_same_sums(y_frozen, y, f"frozen vs trained, {mode}")


@pytest.mark.parametrize(
    "head, read",
    [
        pytest.param(nvfp4x.recipes.nvfp4_training(), False, id="nvfp4-called-head"),
        pytest.param(nvfp4x.recipes.bf16(), True, id="bf16-read-head"),
    ],
)
def test_property_tie_frozen_with_tied_equals_trained(head, read):
    qmodel = nvfp4x.quantize(ESM2Like(jax.random.key(0), read), policy(head, "head"))
    frozen = nvfp4x.freeze(qmodel, tied=["head"])
    assert frozen.head.weight.master is qmodel.head.weight.array
    # The summary's bytes held count the kept master values; its GEMM bytes do not.
    row = next(line for line in nvfp4x.summary(frozen).splitlines() if line.startswith("head"))
    packed = sum(v.nbytes for v in jax.tree.leaves(frozen.head.weight.packed))
    assert row.split()[-2:] == [f"{packed + V * D * 4:,}", f"{packed:,}"], row
    assert jnp.dtype(frozen.embedding(0).dtype) == jnp.float32
    assert_frozen_equals_trained(qmodel, frozen)


def test_property_tie_frozen_without_tied_names_the_fix():
    qmodel = nvfp4x.quantize(ESM2Like(jax.random.key(0)), nvfp4x.recipes.nvfp4_training())
    frozen = nvfp4x.freeze(qmodel)
    assert frozen.head.weight.master is None  # untied weights are packed only
    with pytest.raises(ValueError, match=r'`head`.*gather.*freeze\(qmodel, tied=\["head"\]\)'):
        frozen(TOKENS)


def test_freeze_tied_argument_errors():
    qmodel = nvfp4x.quantize(ESM2Like(jax.random.key(0)), nvfp4x.recipes.nvfp4_training())
    with pytest.raises(ValueError, match=r"`tied` names \['embed'\].*\['head', 'layers.fc'\]"):
        nvfp4x.freeze(qmodel, tied=["embed"])
    with pytest.raises(TypeError, match=r"`tied` must be a list.*\['head'\]"):
        nvfp4x.freeze(qmodel, tied="head")


@pytest.mark.parametrize(
    "head, embed_first",
    [
        pytest.param(nvfp4x.recipes.nvfp4_training(), True, id="nvfp4-table-in-embedding"),
        pytest.param(nvfp4x.recipes.bf16(), False, id="bf16-table-in-head"),
    ],
)
def test_shared_tie_frozen_equals_trained(head, embed_first):
    qmodel = nvfp4x.quantize(SharedTie(jax.random.key(0), embed_first), policy(head, r".*\[1\]"))
    frozen = nvfp4x.freeze(qmodel)  # the tie is found through `eqx.nn.Shared`
    [(_, weight)] = [(p, w) for p, w in weights(frozen) if w.path == "shared.pytree[1]"]
    assert weight.master is not None
    assert [w.master for _, w in weights(frozen) if w.path == "block.fc"] == [None]
    assert_frozen_equals_trained(qmodel, frozen)


class TreeAtTie(eqx.Module):
    """A table tied to the head by placing one weight in both (`eqx.tree_at`)."""

    embed: eqx.nn.Embedding
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.embed = eqx.nn.Embedding(V, D, key=k1)
        self.head = eqx.nn.Linear(D, V, use_bias=False, key=k2)

    def __call__(self, tokens):
        return jax.vmap(self.head)(jnp.tanh(jax.vmap(self.embed)(tokens)))


def test_a_weight_in_two_places_is_found_tied():
    """The quantised head's weight placed in the embedding too (one master array, two
    places): `freeze` finds the tie without being told, and the lookup reads the master
    values as training did."""
    qmodel = nvfp4x.quantize(TreeAtTie(jax.random.key(0)), nvfp4x.recipes.nvfp4_training())
    qmodel = eqx.tree_at(lambda m: m.embed.weight, qmodel, qmodel.head.weight)
    frozen = nvfp4x.freeze(qmodel)
    assert frozen.head.weight.master is not None
    assert_frozen_equals_trained(qmodel, frozen)


def weights(model):
    is_frozen = lambda x: isinstance(x, nvfp4x.FrozenWeight)
    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_frozen)[0]
    return [(p, w) for p, w in leaves if is_frozen(w)]


def test_tied_model_saves_and_loads_bit_exact(tmp_path):
    def build():
        qmodel = nvfp4x.quantize(ESM2Like(jax.random.key(0)), nvfp4x.recipes.nvfp4_training())
        return qmodel, nvfp4x.freeze(qmodel, tied=["head"])

    qmodel, frozen = build()
    nvfp4x.save(tmp_path / "tied.nvfp4x", frozen)
    loaded = nvfp4x.load(tmp_path / "tied.nvfp4x", eqx.filter_eval_shape(lambda: build()[1]))
    assert_frozen_equals_trained(qmodel, loaded)


def test_export_hf_refuses_a_quantised_tied_weight_naming_it(tmp_path):
    qmodel = nvfp4x.quantize(SharedTie(jax.random.key(0)), nvfp4x.recipes.nvfp4_weight_only())
    with pytest.raises(ValueError, match=r"Keep `shared.pytree\[1\]` unquantised \(a rule"):
        nvfp4x.export_hf(nvfp4x.freeze(qmodel), tmp_path / "hf", names=lambda p: p)


def test_export_hf_writes_a_tie_kept_in_bf16_once_unquantised(tmp_path):
    """A tied head the policy keeps in bf16 is written as serving stacks expect a tie:
    one unquantised tensor, the table (the master values its lookup reads), listed as
    excluded from quantisation; read back, the frozen model is the same, bit for bit."""
    head = nvfp4x.recipes.bf16()
    weight_only = nvfp4x.Policy([(r".*\[1\]", head), (".*", nvfp4x.recipes.nvfp4_weight_only())])
    frozen = nvfp4x.freeze(nvfp4x.quantize(SharedTie(jax.random.key(0)), weight_only))
    nvfp4x.export_hf(frozen, tmp_path / "hf", names=lambda p: p)
    with safetensors.safe_open(tmp_path / "hf" / "model.safetensors", "numpy") as f:
        [tied] = [n for n in f.keys() if n.startswith("shared.pytree")]  # noqa: SIM118
        tensor = f.get_tensor(tied)
    # (the embedding holds the table: `eqx.nn.Shared` puts the head's slot aside)
    assert tied == "shared.pytree[0].weight" and tensor.dtype == np.float32
    np.testing.assert_array_equal(tensor, np.asarray(frozen.shared.pytree[0].weight.master))
    config = json.loads((tmp_path / "hf" / "hf_quant_config.json").read_text())
    assert config["quantization"]["quant_algo"] == "W4A16_NVFP4"  # the block's layer
    back = nvfp4x.import_hf(tmp_path / "hf", frozen, names=lambda p: p)
    assert_same_bits(back, frozen)


class UserLinear(eqx.Module):
    """A user's linear class (a LoRA Llama's `lm_head`), read directly."""

    weight: jax.Array

    def __init__(self, key):
        self.weight = jax.random.normal(key, (V, D)) / D**0.5

    def __call__(self, x):
        return x @ self.weight.T


class HeadReadDirectly(eqx.Module):
    body: eqx.nn.Linear
    lm_head: UserLinear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.body = eqx.nn.Linear(D, D, key=k1)
        self.lm_head = UserLinear(k2)

    def __call__(self, x):
        h = jax.vmap(self.body)(x)
        return h @ self.lm_head.weight.T + self.lm_head(x)


def test_user_head_kept_in_bf16_freezes_and_jits():
    head = nvfp4x.recipes.bf16()
    qmodel = nvfp4x.quantize(HeadReadDirectly(jax.random.key(0)), policy(head, "lm_head"))
    frozen = nvfp4x.freeze(qmodel)
    x = normal(1, (T, D))
    for run in (lambda m: m(x), lambda m: call(m, x)):
        with jax.numpy_dtype_promotion("standard"):  # a bf16 frozen weight is bf16
            assert_same_sums(run(frozen), run(qmodel), "frozen vs trained user head")
