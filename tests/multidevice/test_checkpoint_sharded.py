"""`nvfp4x.TrainingCheckpointer` on 8 CPU devices: a sharded training state is saved from
its shards and restored with any sharding, bit for bit; the checksums it records do not
depend on the sharding. (Saved by 2 processes, restored on 1: `test_multiprocess.py`.)

Run in their own process by `tests/test_sharding.py`, which sets
`XLA_FLAGS=--xla_force_host_platform_device_count=8` before JAX starts.
"""

import json
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

import nvfp4x
from nvfp4x import _checksum

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8"
)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((4, 2), ("data", "model"))


def spec_for(a) -> P:
    """Matrices over both mesh axes, vectors over `data`, scalars replicated."""
    if a.ndim >= 2:
        return P("data", "model")
    return P("data") if a.ndim == 1 and a.shape[0] % 4 == 0 else P()


def sharded_state(mesh, seed: int = 0) -> dict:
    mlp = eqx.nn.MLP(64, 32, 128, 1, key=jax.random.key(seed))
    model = nvfp4x.quantize(mlp, nvfp4x.recipes.nvfp4_training())
    params = eqx.filter(model, eqx.is_inexact_array)
    with jax.numpy_dtype_promotion("standard"):
        opt_state = optax.adam(1e-3).init(params)
        _, opt_state = optax.adam(1e-3).update(params, opt_state, params)
    state = {
        "model": model,
        "opt_state": opt_state,
        "keys": jax.random.split(jax.random.key(seed + 1), 8),
        "codes": jnp.arange(64 * 32, dtype=jnp.uint32).reshape(64, 32).astype(jnp.uint8),
        "step": 3,
    }
    put = lambda a: jax.device_put(a, NamedSharding(mesh, spec_for(a)))
    return jax.tree.map(lambda a: put(a) if eqx.is_array(a) else a, state)


def bits(a) -> bytes:
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        a = jax.random.key_data(a)
    return np.asarray(a).tobytes()


LAYOUTS = {
    "one-device": lambda mesh, a: SingleDeviceSharding(jax.devices()[3]),
    "replicated": lambda mesh, a: NamedSharding(mesh, P()),
    "rows": lambda mesh, a: NamedSharding(mesh, P("data")),
    "columns": lambda mesh, a: NamedSharding(mesh, P(None, "model")),
    "both-axes": lambda mesh, a: NamedSharding(mesh, P("data", "model")),
    "rows-8-ways": lambda mesh, a: NamedSharding(mesh, P(("data", "model"))),
}


def test_checksums_do_not_depend_on_the_sharding(mesh):
    """One array of each dtype, laid out six ways: the checksum computed where the shards
    live (no gather: each device sums its shard, one all-reduce adds the sums) equals
    numpy's on the whole array."""
    x = jax.random.normal(jax.random.key(0), (64, 32))
    arrays = [
        x,
        x.astype(jnp.bfloat16),
        x.astype(jnp.float8_e4m3fn),
        (x * 20).astype(jnp.int8).astype(jnp.uint8),
        jax.random.key_data(jax.random.split(jax.random.key(1), 64)),
    ]
    want = _checksum.checksums([np.asarray(a) for a in arrays])
    for name, layout in LAYOUTS.items():
        placed = [jax.device_put(a, layout(mesh, a)) for a in arrays]
        assert _checksum.checksums(placed) == want, name
        if name in ("rows", "columns", "both-axes"):  # partial sums, then one all-reduce
            hlo = _checksum._checksums_jit.lower(placed).compile().as_text()
            assert "all-reduce" in hlo and "all-gather" not in hlo, name


@pytest.fixture(scope="module")
def saved(mesh, tmp_path_factory):
    """`(state, path)`: `sharded_state(mesh)`, saved from its shards as step 3 at `path`
    (once for the module: the tests below only read it)."""
    state, path = sharded_state(mesh), tmp_path_factory.mktemp("sharded_checkpoint")
    with nvfp4x.TrainingCheckpointer(path, async_save=False) as ckpt:
        ckpt.save(3, state)
    return state, path


TARGETS = ["as-saved", "replicated", "one-device", "no-sharding", "abstract-mesh"]


@pytest.mark.parametrize("target", TARGETS)
def test_sharded_state_restores_with_likes_shardings_bit_for_bit(mesh, saved, target):
    """Saved from its shards; restored into a concrete state, into `ShapeDtypeStruct`s
    replicated, on one device or with no sharding (first local device), and into
    `eqx.filter_eval_shape`'s structs over the abstract mesh (under `jax.set_mesh`)."""
    state, path = saved
    abstract = eqx.filter_eval_shape(sharded_state, mesh, 1)

    def structs(sharding_of):
        def one(a):
            if isinstance(a, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding_of(a))
            return a

        return jax.tree.map(one, abstract)

    like = {
        "as-saved": lambda: sharded_state(mesh, 1),
        "replicated": lambda: structs(lambda a: NamedSharding(mesh, P())),
        "one-device": lambda: structs(lambda a: SingleDeviceSharding(jax.devices()[5])),
        "no-sharding": lambda: structs(lambda a: None),
        "abstract-mesh": lambda: abstract,
    }[target]()
    with nvfp4x.TrainingCheckpointer(path, async_save=False) as ckpt:
        assert ckpt.all_steps() == [3]
        if target == "abstract-mesh":
            with pytest.raises(ValueError, match=r"abstract mesh.*jax.set_mesh"):
                ckpt.restore(like)
            with jax.set_mesh(mesh):
                restored = ckpt.restore(like)
        else:
            restored = ckpt.restore(like)
    default = SingleDeviceSharding(jax.local_devices()[0])
    got, saved, want = (jax.tree.leaves(t) for t in (restored, state, like))
    for r, s, w in zip(got, saved, want, strict=True):
        if not eqx.is_array(s):
            assert r == s
            continue
        assert bits(r) == bits(s)
        sharding = default if w.sharding is None else w.sharding
        if target == "abstract-mesh":
            sharding = NamedSharding(mesh, w.sharding.spec)
        assert r.sharding.is_equivalent_to(sharding, r.ndim), (target, r.sharding, sharding)
    if target in ("as-saved", "abstract-mesh"):  # the sharded leaves did stay sharded
        keys = restored["keys"]
        assert keys.sharding.spec == P("data") and len(keys.addressable_shards) == 8


def test_recorded_checksums_equal_one_devices(saved):
    """The checksums written at save, computed on the sharded arrays, are those of the
    same arrays gathered onto one device."""
    state, path = saved
    record = json.loads((pathlib.Path(path) / "3" / "nvfp4x" / "metadata").read_text())
    values = []
    for leaf in jax.tree.leaves(state):
        if isinstance(leaf, int):  # the step, saved as int64
            values.append(np.asarray(leaf, np.int64))
        elif eqx.is_array(leaf):  # (not the MLP's activation functions)
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                leaf = jax.random.key_data(leaf)
            values.append(np.asarray(leaf))
    assert [r["checksum"] for r in record["leaves"]] == _checksum.checksums(values)
