"""The Hugging Face checkpoint's per-format codecs and what they ask the formats: NVFP4's
row form (`to_rows` / `from_rows`, bit for bit on padded, tiled and stacked weights),
tensor scale <-> amax, and the refusal of weights whose format has no codec. (The
checkpoints themselves: `tests/test_hf.py`.)"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_bits

import nvfp4x
from nvfp4x._formats._nvfp4 import (
    amax_for_tensor_scale,
    from_rows,
    rows_fit,
    tensor_decode_scale,
    to_rows,
)


@pytest.mark.parametrize(
    "shape, block",
    [
        ((20, 32), (1, 16)),
        ((20, 32), (16, 16)),  # 20 rows: the last tile padded
        ((3, 17, 48), (16, 16)),  # stacked
    ],
    ids=["rows", "tiles_padded", "tiles_stacked"],
)
def test_rows_round_trip_bit_for_bit(shape, block):
    w = jax.random.normal(jax.random.key(0), shape) * 3.0
    quantise = lambda x: nvfp4x.to_nvfp4(x, block=block)
    q = jax.jit(jax.vmap(quantise) if len(shape) == 3 else quantise)(w)
    codes, bits, ts = to_rows(q)
    out, inn = shape[-2:]
    assert codes.shape == (*shape[:-2], out, inn // 2)
    assert bits.shape == (*shape[:-2], out, inn // 16)
    # The rows decode by the spec's formula to the packed weight's values.
    lo, hi = codes & 0xF, codes >> 4
    nibbles = np.stack([lo, hi], axis=-1).reshape(*codes.shape[:-1], inn)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    e2m1 = np.where(nibbles & 8, -1.0, 1.0).astype(np.float32) * grid[nibbles & 7]
    scales = bits.view(jnp.float8_e4m3fn).astype(np.float32).repeat(16, axis=-1)
    values = e2m1 * scales * ts.reshape(*ts.shape, 1, 1)
    decoded = jax.jit(lambda q: q.dequantize(jnp.float32))(q)
    np.testing.assert_array_equal(values, np.asarray(decoded))
    assert_same_bits(from_rows((codes, bits, ts), q), q)
    like = eqx.filter_eval_shape(lambda: q)  # values not read
    assert_same_bits(from_rows((codes, bits, ts), like), q)


def test_rows_fit_only_tile_constant_scales():
    bits = np.arange(20 * 2, dtype=np.uint8).reshape(20, 2)
    assert rows_fit(bits, (1, 16))
    assert not rows_fit(bits, (16, 16))
    tiles = np.repeat(np.array([[1, 2], [3, 4]], np.uint8), 16, axis=0)[:20]
    assert rows_fit(tiles, (16, 16))
    like = jax.eval_shape(lambda: nvfp4x.to_nvfp4(jnp.ones((20, 32)), block=(16, 16)))
    with pytest.raises(ValueError, match="vary within 16-row tiles"):
        from_rows((np.zeros((20, 16), np.uint8), bits, np.float32(1)), like)


@pytest.mark.parametrize("amax", [1e-30, 0.37, 3.0, 448.0 * 6 * 1e6], ids=str)
def test_amax_for_tensor_scale_inverts_it(amax):
    scale = tensor_decode_scale(amax)
    assert tensor_decode_scale(amax_for_tensor_scale(scale)).tobytes() == scale.tobytes()


class _Pair(eqx.Module):
    a: eqx.nn.Linear
    b: eqx.nn.Linear

    def __call__(self, x):
        return self.b(self.a(x))


def _pair(key=0):
    ka, kb = jax.random.split(jax.random.key(key))
    return _Pair(eqx.nn.Linear(32, 32, key=ka), eqx.nn.Linear(32, 16, key=kb))


NAMES = {"a": "model.a", "b": "model.b"}


def test_formats_without_a_codec_are_refused_naming_the_layer(tmp_path):
    nvfp4 = nvfp4x.freeze(nvfp4x.quantize(_pair(), "nvfp4_weight_only"))
    nvfp4x.export_hf(nvfp4, tmp_path, names=NAMES)
    policy = nvfp4x.Policy([(r"a", nvfp4x.recipes.mxfp8()), (r".*", "nvfp4_weight_only")])
    mixed = nvfp4x.freeze(nvfp4x.quantize(_pair(), policy))
    with pytest.raises(ValueError, match=r"export_hf: `a` is frozen in mxfp8.*NVFP4 recipe"):
        nvfp4x.export_hf(mixed, tmp_path / "mx", names=NAMES)
    like = eqx.filter_eval_shape(lambda: mixed)
    with pytest.raises(ValueError, match=r"import_hf: `a` is frozen in mxfp8"):
        nvfp4x.import_hf(tmp_path, like, names=NAMES)
