"""The frozen GEMM kernel (`nvfp4x._kernels._pallas_gemm`, decoding packed NVFP4 weight
tiles inside the GEMM) against the reference frozen forward, and its choice.

The kernel runs interpreted on a CPU (compiled on a GPU, where the same tests run it
natively), with small tiles so that a few rows and columns exercise every edge: token
counts 1, 3, 16 and 33 (a GEMV padded to 16 rows; more tokens than a tile), output
and input features that are not multiples of the tiles nor of 16, and ones that are,
1x16 blocks and 16x16 tiles, bfloat16 and float32 operands, NaN block scales and
infinite activations. It also lowers for CUDA here, with the default tiles and every
tile the benchmark sweeps (Triton's shape rules checked without a GPU).

Equality: the kernel's products are exact (block values times bfloat16 activations, or
times the three exact bfloat16 parts of float32 ones); only the float32 summation
order differs from the reference's dot, so the outputs agree within `TOLERANCE * k *
2^-24 * (|x| @ |W|.T)` (each sum's error is at most `terms * 2^-24` of the sum of its
terms' magnitudes; the kernel sums `3 k` terms for float32 operands, the reference
`k`), and NaN and infinities land in the same places with the same signs.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4x
from nvfp4x import _kernels
from nvfp4x._formats import quantize_operand
from nvfp4x._formats._dot import scaled_dot
from nvfp4x._kernels import _pallas_gemm
from nvfp4x._kernels._pallas_gemm import Tiles

pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"
)

#: Of `k * 2^-24 * (|x| @ |W|.T)`: the kernel's `3 k` terms and the reference's `k`.
TOLERANCE = 4
#: Small tiles: several programs and steps on small arrays.
SMALL = Tiles(16, 16, 32, 4, 1)
INTERPRET = jax.default_backend() != "gpu"


def weight(n: int, k: int, block, nan: bool = False) -> nvfp4x.NVFP4Array:
    """An NVFP4 weight over a wide range of magnitudes (with a NaN block: a NaN scale,
    in the last, padded block of a row when `k` is not a multiple of 16)."""
    w = np.array(jax.random.normal(jax.random.key(0), (n, k)), np.float32)
    w *= np.exp2(np.asarray(jax.random.randint(jax.random.key(1), (n, 1), -6, 6)))
    w[n // 2, :16] = 0.0  # an all-zero block (scale 0)
    if nan:
        w[1, k - 1] = np.nan
        w[n - 1, 20] = np.nan
    return nvfp4x.to_nvfp4(jnp.asarray(w), block=block)


def activations(m: int, k: int, dtype, inf: bool = False) -> jax.Array:
    x = np.array(jax.random.normal(jax.random.key(2), (m, k)), np.float32)
    x[:, 5] *= 1e4  # a wide range within a row
    if inf:
        x[m - 1, 3] = np.inf
        x[0, k - 1] = -np.inf
    return jnp.asarray(x).astype(dtype)


def check_close(got, want, x, wv, k: int, scale=1.0) -> None:
    """`got` within the tolerance (module docstring) of `want`, products scaled by
    `scale`; NaN and inf alike."""
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
    np.testing.assert_array_equal(np.isinf(g), np.isinf(w))
    np.testing.assert_array_equal(g[np.isinf(g)], w[np.isinf(w)])
    xa = np.abs(np.nan_to_num(np.asarray(x, np.float64), posinf=0.0, neginf=0.0))
    wa = np.abs(np.nan_to_num(np.asarray(wv, np.float64)))
    bound = TOLERANCE * k * 2.0**-24 * (xa @ wa.T) * np.abs(np.float64(scale))
    finite = np.isfinite(w)
    diff = np.abs(g[finite] - w[finite])
    assert np.all(diff <= bound[finite]), np.max(diff / bound[finite])


def reference(x, q: nvfp4x.NVFP4Array, operand: str):
    """The reference frozen product before the scales: `scaled_dot` on `operand()`."""
    wv, _ = q.operand()
    dtype = jnp.dtype(jnp.bfloat16) if operand == "bfloat16" else None
    dims = ((1,), (1,))
    return jax.jit(functools.partial(scaled_dot, dims=dims, dtype=dtype))(x, None, wv, None)


CASES = {
    # name: (block, tokens, out, in, operand, tiles, nan and inf)
    "1x16_1_token_float32_edges": ((1, 16), 1, 40, 100, "float32", SMALL, False),
    "16x16_3_tokens_bfloat16_edges": ((16, 16), 3, 40, 100, "bfloat16", SMALL, False),
    "1x16_16_tokens_bfloat16_fitting": ((1, 16), 16, 32, 128, "bfloat16", SMALL, False),
    "16x16_33_tokens_float32": ((16, 16), 33, 48, 96, "float32", Tiles(16, 32, 64, 4, 1), False),
    "1x16_3_tokens_float32_nan_inf": ((1, 16), 3, 40, 100, "float32", SMALL, True),
    "16x16_bfloat16_nan_inf_default_tiles": ((16, 16), 1, 40, 100, "bfloat16", None, True),
    "1x16_16_tokens_bfloat16_depth_past_k": (
        (1, 16),
        16,
        32,
        64,
        "bfloat16",
        Tiles(16, 32, 128),
        False,
    ),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_kernel_equals_reference(case):
    block, m, n, k, operand, tiles, special = case
    q = weight(n, k, block, nan=special)
    dtype = jnp.bfloat16 if operand == "bfloat16" else jnp.float32
    x = activations(m, k, dtype, inf=special)
    got = _pallas_gemm.frozen_matmul(
        x,
        q.codes,
        q.scale_bits,
        block=block,
        n=n,
        operand=operand,
        tiles=tiles,
        interpret=INTERPRET,
    )
    assert got.shape == (m, n) and got.dtype == jnp.float32
    check_close(got, reference(x, q, operand), x, q.operand()[0], k)
    if special:  # the NaN blocks and infinite activations reach the outputs
        assert np.isnan(np.asarray(got)).any() and np.isinf(np.asarray(got)).any()


def test_split3_is_exact():
    """float32 activations as three bfloat16 parts whose sum is exactly the value, for
    every exponent whose parts are normal (below, a device may flush the last parts:
    an error under `2^-126` of the value's weight), the largest floats (never rounded up
    to inf), inf and NaN."""
    exps = np.arange(-100, 128, dtype=np.float64)
    sig = np.array([1.0, 1.0 + 2.0**-23, 1.5 + 2.0**-9, 2.0 - 2.0**-23])
    v = (np.exp2(exps)[:, None] * sig[None, :]).ravel()
    v = v[np.isfinite(v.astype(np.float32))].astype(np.float32)
    v = np.concatenate([v, -v, np.float32([0.0, np.finfo(np.float32).max])])
    hi, mid, lo = jax.jit(_pallas_gemm._split3)(jnp.asarray(v))
    total = sum(np.asarray(p, np.float64) for p in (hi, mid, lo))
    np.testing.assert_array_equal(total, v.astype(np.float64))
    special = jnp.float32([np.inf, -np.inf, np.nan])
    hi, mid, lo = jax.jit(_pallas_gemm._split3)(special)
    np.testing.assert_array_equal(np.asarray(hi, np.float32), np.asarray(special))
    assert not np.any(np.asarray(mid, np.float32)) and not np.any(np.asarray(lo, np.float32))


def test_frozen_forward_runs_the_kernel(monkeypatch):
    """`FrozenLinear` (W4A4: the activations quantised by the existing quantiser, then
    fed to the kernel as block values) with the Pallas GEMM picked: the kernel runs
    (a spy counts it) and the forward is the reference's within the tolerance."""
    calls = []
    kernel = _pallas_gemm.frozen_matmul

    def spy(*args, **kwargs):
        calls.append(kwargs["operand"])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(_pallas_gemm, "frozen_matmul", spy)
    lin = eqx.nn.Linear(100, 40, key=jax.random.key(3))
    frozen = nvfp4x.freeze(nvfp4x.quantize(lin, nvfp4x.recipes.nvfp4_inference()))
    x = activations(3, 100, jnp.float32)
    with _kernels.use("frozen_gemm", "xla"):
        want = jax.jit(lambda x: frozen(x))(x)
    assert calls == []
    with _kernels.use("frozen_gemm", "pallas"):
        got = jax.jit(lambda x: frozen(x))(x)
    assert len(calls) == 1
    w = frozen.weight.packed
    xv, xs = quantize_operand(x, frozen.recipe.input, axis=-1)
    assert xs is not None
    check_close(got, want, xv, w.operand()[0], 100, scale=xs * w.tensor_scale)


def test_chooser_and_uncovered_cases():
    assert _kernels.pick("frozen_gemm", "gpu") == "xla"  # opt-in: see `_kernels`
    assert _kernels.pick("frozen_gemm", "cpu") == "xla"
    codes, scale_bits = jnp.zeros((32, 32), jnp.uint8), jnp.zeros((32, 4), jnp.uint8)
    args = (codes, scale_bits, (1, 16), (32, 64))
    # The default: XLA (`None`, the caller runs the reference) except on a TPU, which
    # picks the Mosaic kernel.
    default = _kernels.frozen_gemm(jnp.ones((2, 64)), *args)
    assert (default is None) == (_kernels.pick("frozen_gemm") == "xla")
    assert default is None or not jnp.any(default)  # zero codes: a zero product
    assert _kernels.pick("frozen_gemm", "tpu") == "mosaic"
    assert _kernels.frozen_gemm(jnp.ones((2, 64), jnp.int32), *args, "pallas") is None
    assert _kernels.frozen_gemm(jnp.ones((0, 64)), *args, "pallas") is None


def test_bad_arguments_raise():
    codes, scale_bits = jnp.zeros((32, 32), jnp.uint8), jnp.zeros((32, 4), jnp.uint8)
    x = jnp.ones((2, 64), jnp.bfloat16)
    call = functools.partial(_pallas_gemm.frozen_matmul, x, block=(1, 16), n=32)
    with pytest.raises(ValueError, match="not the packed layout"):
        call(codes[:, :16], scale_bits, operand="bfloat16")
    with pytest.raises(ValueError, match="`operand='float16'`"):
        call(codes, scale_bits, operand="float16")
    with pytest.raises(ValueError, match="`tiles`"):
        call(codes, scale_bits, operand="bfloat16", tiles=Tiles(8, 16, 32))
    with pytest.raises(ValueError, match="`tiles.features`"):
        _pallas_gemm.check_tiles(Tiles(16, 16, 32), (32, 16))


#: `(tiles, block, operand, (out, in))`: the default tiles in both layouts, both
#: operands, fitting and overhanging; the swept tiles as the benchmark runs them.
LOWERED = [
    (tiles, block, operand, shape)
    for _, tiles in _pallas_gemm.DEFAULT_TILES
    for block in ((1, 16), (16, 16))
    for operand, shape in (
        ("bfloat16", (8192, 8192)),
        ("bfloat16", (8200, 8200)),
        ("float32", (8200, 8200)),
    )
] + [(tiles, (1, 16), "bfloat16", (8192, 8192)) for tiles in _pallas_gemm.SWEEP_TILES]


def test_kernel_lowers_for_cuda():
    """Triton lowering of the default tiles (both block layouts and operands, tiles
    that fit and ones that overhang) and of every tile the benchmark sweeps."""
    for tiles, block, operand, (n, k) in LOWERED:
        rows = n if block == (1, 16) else -(-n // 16) * 16
        dtype = jnp.bfloat16 if operand == "bfloat16" else jnp.float32
        args = (
            jax.ShapeDtypeStruct((tiles.tokens + 1, k), dtype),  # (tokens overhang)
            jax.ShapeDtypeStruct((rows, -(-k // 16) * 8), jnp.uint8),
            jax.ShapeDtypeStruct((rows // block[0], -(-k // 16)), jnp.uint8),
        )
        fn = functools.partial(
            _pallas_gemm.frozen_matmul, block=block, n=n, operand=operand, tiles=tiles
        )
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "nvfp4_frozen_matmul" in text, (tiles, block, operand)
