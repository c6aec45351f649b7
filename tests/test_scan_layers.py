"""`nvfp4x.scan_layers`: `lax.scan` over a stack of frozen layers whose GEMMs read each
layer from the whole stack by index (`FrozenLayerOfStack`), instead of the slice that
`lax.scan` copies before a kernel call on a TPU. Checked here: the same numbers as
`lax.scan` bit for bit (XLA path, and the TPU kernel interpreted), eagerly and jitted;
the kernel is handed the stack and an index, and the program lowered for a TPU slices
no packed weight; what reads the weight itself still sees the layer's slice; bad
stacks are refused by name."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params

import nvfp4x
from nvfp4x import _kernels


class Block(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    norm: eqx.nn.LayerNorm

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(64, 96, key=k1)
        self.down = eqx.nn.Linear(96, 64, use_bias=False, key=k2)
        self.norm = eqx.nn.LayerNorm(64)

    def __call__(self, h):
        u = jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.norm)(h)))
        return h + jax.vmap(self.down)(u)


class ReadsItsWeight(eqx.Module):
    """A block whose second product reads the frozen weight itself (`x @ w.T`)."""

    up: eqx.nn.Linear

    def __call__(self, h):
        return h + (jax.vmap(self.up)(h) @ self.up.weight)[:, :64]


LAYERS = 3
H = jax.random.normal(jax.random.key(1), (5, 64))


def stack(recipe: str, block=Block):
    blocks = eqx.filter_vmap(block)(jax.random.split(jax.random.key(0), LAYERS))
    return nvfp4x.freeze(nvfp4x.quantize(blocks, recipe))


def body(h, block):
    return block(h), jnp.sum(h)


def by_scan(frozen, h, **kw):
    arrays, static = eqx.partition(frozen, eqx.is_array)
    return jax.lax.scan(lambda h, a: body(h, eqx.combine(a, static)), h, arrays, **kw)


def by_index(frozen, h, **kw):
    return nvfp4x.scan_layers(body, h, frozen, **kw)


def frozen_gemms(jaxpr):
    """The frozen GEMMs' equations of `jaxpr`, inner jaxprs included."""
    for e in jaxpr.eqns:
        if e.primitive.name == "nvfp4x_frozen_qdot":
            yield e
        for sub in jaxprs_in_params(e.params):
            yield from frozen_gemms(sub)


def assert_bits(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint32), np.asarray(y).view(np.uint32))


@pytest.mark.parametrize("recipe", ["nvfp4_inference", "nvfp4_weight_only"])
@pytest.mark.parametrize("jit", [False, True])
def test_scan_layers_is_lax_scan_bit_for_bit(recipe, jit):
    frozen = stack(recipe)
    run = eqx.filter_jit if jit else (lambda f: f)
    assert_bits(run(by_index)(frozen, H), run(by_scan)(frozen, H))
    assert_bits(run(by_index)(frozen, H, reverse=True), run(by_scan)(frozen, H, reverse=True))
    seen = []

    def record(h, block):
        seen.append(type(block.up).__name__)
        return body(h, block)

    nvfp4x.scan_layers(record, H, frozen)
    assert seen == ["FrozenLayerOfStack"]
    text = str(jax.make_jaxpr(lambda m, h: by_index(m, h))(frozen, H))
    assert text.count("indexed=True") == 2 and "indexed=False" not in text


def test_the_tpu_kernel_reads_the_layer_from_the_stack():
    """With the Mosaic kernel (interpreted here): the same bits as `lax.scan` over the
    kernel on each slice; the kernel's operands are the whole stack; lowered for a TPU,
    no packed weight is sliced in the program (`lax.scan`'s slices them: a copy per
    layer and step before the call)."""
    frozen = stack("nvfp4_inference")
    with _kernels.use("frozen_gemm", "mosaic"):
        got = eqx.filter_jit(by_index)(frozen, H)
        want = eqx.filter_jit(by_scan)(frozen, H)
        jaxpr = jax.make_jaxpr(by_index)(frozen, H)
    assert_bits(got, want)
    gemms = [e for e in frozen_gemms(jaxpr.jaxpr) if e.params["indexed"]]
    assert len(gemms) == 2 and all(e.params["gemm"] == "mosaic" for e in gemms)
    for e in gemms:  # the packed leaves whole (a leading axis of layers), the index last
        assert all(v.aval.shape[0] == LAYERS for v in e.invars[1:-1])
        assert e.invars[-1].aval.shape == () and e.invars[-1].aval.dtype == jnp.int32
    tpu = lambda: "tpu"  # noqa: E731 - traced as for a TPU (the kernel compiled, not interpreted)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_kernels, "backend", tpu)
        for fn, slices in ((by_index, 0), (by_scan, 4)):
            lowered = jax.jit(fn).trace(frozen, H).lower(lowering_platforms=("tpu",)).as_text()
            assert lowered.count("nvfp4_frozen_matmul_tpu") == 2, fn
            assert len(re.findall(r"dynamic_slice.*xui8>", lowered)) == slices, fn


def test_what_reads_the_weight_sees_the_layer():
    frozen = stack("nvfp4_inference", lambda k: ReadsItsWeight(eqx.nn.Linear(64, 64, key=k)))
    assert_bits(eqx.filter_jit(by_index)(frozen, H), eqx.filter_jit(by_scan)(frozen, H))


def test_layers_of_different_lengths_are_refused():
    frozen = stack("nvfp4_inference")
    bad = eqx.tree_at(lambda m: m.norm.weight, frozen, frozen.norm.weight[:2])
    with pytest.raises(ValueError, match="one length.*filter_vmap"):
        nvfp4x.scan_layers(body, H, bad)
    with pytest.raises(ValueError, match="one length"):
        nvfp4x.scan_layers(body, H, {"scalar": jnp.float32(1.0)})


def test_an_ensemble_of_stacks_vmapped():
    """`jax.vmap` over an ensemble of stacks (each member its own weights): each member's
    scan, by index, equals its `lax.scan`, on the XLA path and the TPU kernel's."""
    make = lambda k: eqx.filter_vmap(Block)(jax.random.split(k, LAYERS))  # noqa: E731
    ensemble = eqx.filter_vmap(make)(jax.random.split(jax.random.key(2), 2))
    frozen = nvfp4x.freeze(nvfp4x.quantize(ensemble, "nvfp4_inference"))
    run = lambda f: eqx.filter_jit(eqx.filter_vmap(f, in_axes=(0, None)))  # noqa: E731
    for impl in ("xla", "mosaic"):
        with _kernels.use("frozen_gemm", impl):
            assert_bits(run(by_index)(frozen, H), run(by_scan)(frozen, H))
