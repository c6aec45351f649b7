"""Modules with a 2-D `weight` that is not a linear map's are not selected.

In an `eqx.filter_vmap`-stacked model a norm's scale is `(layers, d)`: it has the shape
of a linear weight, but no GEMM ever reads it. Selecting it made `summary` show it as
NVFP4 while it trained in float32, and `freeze` pack it (the frozen forward then failed
inside the scan). The same holds for a learned positional table added to the input and
a user's embedding class. A user's linear class is still selected however it is called."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TRAIN

import nvfp4x
from nvfp4x._sites import layers

D = 32


class RMSNorm(eqx.Module):
    weight: jax.Array

    def __init__(self, d: int):
        self.weight = jnp.ones((d,))

    def __call__(self, x):
        return x * jax.lax.rsqrt(jnp.mean(x**2) + 1e-6) * self.weight


class Block(eqx.Module):
    norm: RMSNorm
    fc: eqx.nn.Linear

    def __init__(self, key):
        self.norm = RMSNorm(D)
        self.fc = eqx.nn.Linear(D, D, key=key)

    def __call__(self, x):
        return x + self.fc(self.norm(x))


class Stacked(eqx.Module):
    blocks: Block

    def __init__(self, key):
        self.blocks = eqx.filter_vmap(Block)(jax.random.split(key, 3))

    def __call__(self, x):
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        def body(x, d):
            return eqx.combine(d, static)(x), None

        return jax.lax.scan(body, x, dynamic)[0]


class Positions(eqx.Module):
    """A learned `(positions, d)` table added to a `(positions, d)` input."""

    weight: jax.Array

    def __init__(self, key):
        self.weight = jax.random.normal(key, (D, D))

    def __call__(self, x):
        return x + self.weight


class TokenTable(eqx.Module):
    """A user's embedding: looked up by an integer index."""

    weight: jax.Array

    def __init__(self, key):
        self.weight = jax.random.normal(key, (100, D))

    def __call__(self, i):
        return self.weight[i]


class MyLinear(eqx.Module):
    """A user's linear layer that needs an argument the abstract trace does not give."""

    weight: jax.Array

    def __init__(self, key):
        self.weight = jax.random.normal(key, (D, D)) / D**0.5

    def __call__(self, x, scale):
        return scale * (self.weight @ x)


class Model(eqx.Module):
    stack: Stacked
    pos: Positions
    table: TokenTable
    mine: MyLinear

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.stack, self.pos = Stacked(k[0]), Positions(k[1])
        self.table, self.mine = TokenTable(k[2]), MyLinear(k[3])

    def __call__(self, idx):
        h = self.pos(jax.vmap(self.table)(idx))
        h = jax.vmap(self.stack)(h)
        return jax.vmap(lambda v: self.mine(v, 2.0))(h)


def test_only_the_linear_maps_are_selected():
    qmodel = nvfp4x.quantize(Model(jax.random.key(0)), TRAIN)
    paths = [row.split()[0] for row in nvfp4x.summary(qmodel).splitlines()[2:-2]]
    assert paths == ["stack.blocks.fc", "mine"]
    assert isinstance(qmodel.stack.blocks.norm.weight, jax.Array)
    assert isinstance(qmodel.pos.weight, jax.Array)
    assert isinstance(qmodel.table.weight, jax.Array)
    assert isinstance(qmodel.mine.weight, nvfp4x.QWeight)


def test_the_stacked_model_trains_and_freezes_with_its_norms_exact():
    model = Model(jax.random.key(0))
    qmodel = nvfp4x.quantize(model, TRAIN)
    idx = jnp.arange(D) % 100
    grads = eqx.filter_grad(lambda m: jnp.mean(m(idx) ** 2))(qmodel)
    assert grads.stack.blocks.norm.weight.shape == (3, D)
    frozen = nvfp4x.freeze(qmodel)
    np.testing.assert_array_equal(frozen.stack.blocks.norm.weight, model.stack.blocks.norm.weight)
    np.testing.assert_array_equal(frozen.pos.weight, model.pos.weight)
    np.testing.assert_array_equal(frozen(idx), qmodel(idx))


def test_a_strict_rule_naming_a_norm_matches_nothing():
    policy = nvfp4x.Policy([(r"stack\.blocks\.norm", TRAIN), (r".*", None)])
    with pytest.raises(ValueError, match="matched no"):
        nvfp4x.quantize(Model(jax.random.key(0)), policy)


def test_the_check_is_cached_per_class_and_shape(monkeypatch):
    from nvfp4x import _sites

    _sites._cached_traced_gemm.cache_clear()
    layers = [Positions(k) for k in jax.random.split(jax.random.key(1), 5)]
    with pytest.warns(UserWarning, match="holds no"):
        qlayers = nvfp4x.quantize(layers, TRAIN)
    assert all(isinstance(layer.weight, jax.Array) for layer in qlayers)
    assert _sites._cached_traced_gemm.cache_info().misses == 1


def test_an_abstract_model_answers_as_the_model_does():
    abstract = eqx.filter_eval_shape(Model, jax.random.key(0))
    assert [path for path, _ in layers(abstract)] == ["stack.blocks.fc", "mine"]
    assert [path for path, _ in layers(Model(jax.random.key(0)))] == ["stack.blocks.fc", "mine"]


def test_clear_caches_empties_every_module_level_cache():
    """`nvfp4x.clear_caches` empties the caches it lists, and every module-level
    `functools` cache in the package is listed (cleared, or kept with a reason)."""
    import functools
    import importlib
    import pkgutil

    from nvfp4x import _caches

    found = set()
    for info in pkgutil.walk_packages(nvfp4x.__path__, "nvfp4x."):
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, functools._lru_cache_wrapper):  # cache and lru_cache
                found.add(value)
    listed = set(_caches.CLEARED) | set(_caches.KEPT)
    assert found == listed, f"caches not listed in `_caches`: {found - listed}"
    model = nvfp4x.quantize(eqx.nn.Linear(32, 16, key=jax.random.key(0)), "nvfp4_training")
    x = jnp.ones((4, 32))
    y = model(x)
    assert any(c.cache_info().currsize for c in _caches.CLEARED)
    nvfp4x.clear_caches()
    assert all(c.cache_info().currsize == 0 for c in _caches.CLEARED)
    np.testing.assert_array_equal(model(x), y)  # compiles again, the same bits
