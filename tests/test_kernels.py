"""The per-backend quantiser kernels equal the reference bit for bit, and one place picks them.

The Pallas NVFP4 kernel runs interpreted on a CPU (compiled on a GPU, where the same
tests then run it natively), on shapes with edges: rows and columns that are not
multiples of the tile or of 16, NaN and inf blocks, all-zero blocks, subnormal inputs,
tiny tensors (subnormal amax, subnormal tensor scale), given amax, stochastic rounding.
It also lowers for CUDA here (Triton lowering and shape rules checked without a GPU).

Two things the interpreter cannot show are checked on the kernel's body instead (they
broke the kernel on an H200 while the interpreter was bit for bit): every read and write
of a tile that overhangs its array is masked (Triton reads and writes such a tile at the
flat offsets, over the next row and past the buffer, where the interpreter pads), and no
float is negated (Triton's `-x` is `0 - x`: `-0.0` becomes `+0.0`).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4x
from nvfp4x import _kernels
from nvfp4x._formats import Format, quantize_operand
from nvfp4x._kernels import _exact, _pallas_nvfp4
from nvfp4x._numerics import _e2m1
from nvfp4x._numerics._e4m3 import round_e4m3
from nvfp4x._numerics._ieee import mul_exact

# jax 0.11 warns at every lowering of a Pallas Triton kernel that the backend is
# deprecated (it will need a Mosaic GPU form before JAX drops Triton); only that warning.
pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"
)

DTYPES = [jnp.float32, jnp.bfloat16]
DTYPE_IDS = ["float32", "bfloat16"]


def edge_array(dtype, rows: int = 37, cols: int = 100) -> jax.Array:
    """Normal values over a wide range, with a NaN block, an inf block, a -inf element,
    an all-zero row, a block of subnormals and a block far below the tensor's amax."""
    x = np.array(jax.random.normal(jax.random.key(0), (rows, cols)), np.float32)
    x *= np.exp2(np.asarray(jax.random.randint(jax.random.key(1), (rows, 1), -20, 20)))
    x[1, 3] = np.nan
    x[2, 20] = np.inf
    x[3, cols - 1] = -np.inf
    x[4] = 0.0
    x[5, :16] = np.float32(3e-39) * np.arange(16)  # subnormal (float32 and bfloat16)
    x[6, 16:32] = 1e-30
    return jnp.asarray(x).astype(dtype)


def scaled(x, scale):
    """`x` with non-finite values replaced by 1, times `scale` (a tiny tensor), in NumPy:
    XLA:CPU's product would flush subnormal results (and a subnormal `scale`) to zero."""
    finite = np.where(np.isfinite(np.asarray(x, np.float32)), np.asarray(x, np.float32), 1.0)
    out = jnp.asarray(finite.astype(np.float32) * np.float32(scale)).astype(x.dtype)
    assert np.count_nonzero(np.asarray(out, np.float32)), "scaled to all zeros"
    return out


def tiny_like(x, amax: float = 1e-37):
    """`x` with non-finite values replaced by 1, scaled so that its largest magnitude is
    `amax` (a tiny tensor: `s_dec < 2^-64`, its small elements subnormal), in float64
    rounded once to float32 (the scale may be below float32's range)."""
    v = np.asarray(x, np.float32)
    finite = np.where(np.isfinite(v), v, 1.0).astype(np.float64)
    out = (finite * (amax / np.abs(finite).max())).astype(np.float32)
    assert np.count_nonzero(out), "scaled to all zeros"
    return jnp.asarray(out).astype(x.dtype)


def same_nvfp4(a: nvfp4x.NVFP4Array, b: nvfp4x.NVFP4Array) -> None:
    np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
    np.testing.assert_array_equal(np.asarray(a.scale_bits), np.asarray(b.scale_bits))
    np.testing.assert_array_equal(
        np.asarray(a.tensor_scale).view(np.uint32), np.asarray(b.tensor_scale).view(np.uint32)
    )
    assert (a.shape, a.dtype, a.block) == (b.shape, b.dtype, b.block)


@functools.partial(jax.jit, static_argnames=("impl", "block", "rounding", "vmapped"))
def to_nvfp4(
    x, key=None, amax=None, *, impl: str, block=(1, 16), rounding="nearest", vmapped=False
):
    """`nvfp4x.to_nvfp4` jitted, traced with implementation `impl` (one compilation per
    shape and case, shared by the tests)."""
    fn = functools.partial(nvfp4x.to_nvfp4, block=block, rounding=rounding, key=key, amax=amax)
    with _kernels.use("nvfp4_quantize", impl):
        return jax.vmap(fn)(x) if vmapped else fn(x)


def on_cpu(tree):
    """`tree` on the CPU, where the reference is computed: there its float32 `/` is
    IEEE (on a GPU XLA's may be an ULP off), so a kernel on a GPU is compared with the
    spec's bits."""
    cpu = jax.devices("cpu")[0]
    put = lambda v: jax.device_put(v, cpu) if isinstance(v, jax.Array) else v
    return jax.tree_util.tree_map(put, tree)


def check_kernel(x, **kwargs) -> None:
    want = to_nvfp4(on_cpu(x), **on_cpu(kwargs), impl="xla")
    same_nvfp4(to_nvfp4(x, impl="pallas", **kwargs), want)


def jit_with(impl: str, fn, *args):
    """`jax.jit(fn)(*args)` traced with implementation `impl`, checked to have run the
    kernel exactly when `impl` is `"pallas"` (`jax.jit` reuses the trace of a function
    it traced before, outside `use`: pass a new function for each implementation)."""
    with _kernels.use("nvfp4_quantize", impl):
        traced = jax.jit(fn).trace(*args)
    assert ("pallas_call" in str(traced.jaxpr)) == (impl == "pallas"), impl
    return traced.lower().compile()(*args)


def same_floats(got, want) -> None:
    """The same float bits, NaN where NaN (any payload); `-0.0` is not `+0.0`, nor inf
    the largest finite float."""
    g, w = np.atleast_1d(np.asarray(got, np.float32)), np.atleast_1d(np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
    bits = lambda v: np.where(np.isnan(v), np.float32(0), v).view(np.uint32)
    np.testing.assert_array_equal(bits(g), bits(w))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_pallas_to_nvfp4_equals_reference(dtype):
    """Round to nearest, the default tiling (stochastic rounding, 1x16 and 16x16: with
    small tiles in `test_pallas_small_tiles_overhanging_both_edges`)."""
    check_kernel(edge_array(dtype))


@pytest.mark.parametrize(
    "scale",
    [1e-42, 1e-25],
    ids=["subnormal_amax", "tiny_tensor"],
)
def test_pallas_to_nvfp4_tiny_tensors(scale):
    # (`scaled`: XLA:CPU's product would flush the parts below 2^-126, 80% of the `1e-42`
    # tensor, to zeros)
    check_kernel(scaled(edge_array(jnp.float32, rows=7, cols=48), scale))


@pytest.mark.parametrize(
    "dtype,scale", [(jnp.float32, 1.0), (jnp.bfloat16, 1e-33)], ids=["float32", "bfloat16_tiny"]
)
def test_pallas_fake_quantize_equals_reference(dtype, scale):
    """`fake_quantize`: the dequantised values in the input's dtype, a tiny tensor's
    subnormal products (`s_dec < 2^-64`) included."""
    x = edge_array(jnp.float32, rows=7, cols=48)
    x = (jnp.where(jnp.isinf(x), 2.0, x) * scale).astype(dtype)  # an inf amax: s_dec = 1
    key = jax.random.key(2)

    def fq():  # a new function per implementation (see `jit_with`)
        return lambda x, key: nvfp4x.fake_quantize(x, rounding="stochastic", key=key)

    want = jit_with("xla", fq(), *on_cpu((x, key)))
    assert np.any(np.signbit(want) & (want == 0))  # -0.0 among them
    same_floats(jit_with("pallas", fq(), x, key), want)


def test_pallas_to_nvfp4_given_amax_batched_and_vmapped():
    x = edge_array(jnp.float32, rows=8, cols=32).reshape(2, 4, 32)
    check_kernel(x, amax=jnp.float32(2.0))  # below max|x|: block scales clamp at 448
    check_kernel(x, vmapped=True)


@pytest.mark.parametrize(
    "block,rounding,axis",
    [((1, 16), "stochastic", 0)],
    ids=["16x1_sr_leading_axis"],  # the other layouts: through qdot below
)
def test_pallas_operand_equals_reference(block, rounding, axis):
    """The GEMM operand path: bfloat16 block values `e2m1 * scale_b` and the tensor
    scale, along the last axis (fprop's x, dgrad's dy), the leading one (wgrad's tokens)
    and in 16x16 tiles (weights)."""
    check_operand(edge_array(jnp.bfloat16, rows=41, cols=40), block, rounding, axis)


def check_operand(x, block, rounding, axis) -> None:
    fmt = Format("nvfp4", block=block, rounding=rounding)
    key = jax.random.key(3)

    def quantize():  # a new function per implementation (see `jit_with`)
        return lambda x, key: quantize_operand(x, fmt, axis, key)

    want = jit_with("xla", quantize(), *on_cpu((x, key)))
    got = jit_with("pallas", quantize(), x, key)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    values = np.asarray(want[0], np.float32)
    assert np.any(np.signbit(values) & (values == 0))  # -0.0 among them
    same_floats(got[0], want[0])


@pytest.mark.parametrize(
    "dtype,block,rounding",
    [
        (jnp.bfloat16, (1, 16), "stochastic"),
        (jnp.float32, (16, 16), "stochastic"),
        (jnp.bfloat16, (16, 1), "stochastic"),
    ],
    ids=["bfloat16_sr", "float32_16x16_sr", "bfloat16_16x1_sr_operand"],
)
def test_pallas_small_tiles_overhanging_both_edges(monkeypatch, dtype, block, rounding):
    """Tiles of 32 columns and at most 1,024 elements on the edge array (37x100, padded
    to its blocks): several programs along both axes, the last ones overhanging the array on
    both: the same bits (SR thresholds by the element's index, whatever the tiling)."""
    shape = {(1, 16): (37, 112), (16, 16): (48, 112), (16, 1): (48, 100)}[block]  # padded
    small = _pallas_nvfp4.Tiling(cols=32, elements=1024)
    tr, tc = _pallas_nvfp4._tile(*shape, block, small)
    assert shape[0] % tr and shape[1] % tc and shape[0] > tr and shape[1] > tc
    calls = []

    def small_tiles(*args, **kwargs):
        calls.append(kwargs["block"])
        return quantize_2d(*args, **kwargs, tiling=small)

    quantize_2d = _pallas_nvfp4.quantize_2d
    monkeypatch.setattr(_pallas_nvfp4, "quantize_2d", small_tiles)
    x, key = edge_array(dtype), jax.random.key(7)
    if block == (16, 1):  # the operand path along the leading axis (wgrad's tokens)
        check_operand(x, (1, 16), rounding, 0)
    else:
        kwargs = {"key": key, "block": block, "rounding": rounding}
        want = to_nvfp4(on_cpu(x), **on_cpu(kwargs), impl="xla")
        to = lambda x, key: nvfp4x.to_nvfp4(x, block=block, rounding=rounding, key=key)
        same_nvfp4(jit_with("pallas", to, x, key), want)
    assert calls == [block]


def test_qdot_with_the_pallas_quantisers_equals_reference():
    """All three GEMMs of the NVFP4 training recipe (16x16 weight, 1x16 x and dy, SR, RHT
    on wgrad's operands along the tokens) with every operand quantised by the kernel:
    the same outputs and gradients (bit for bit on the CPU; on a GPU up to the
    reference's float32 division, which the exactness work fixes)."""
    recipe = nvfp4x.recipes.nvfp4_training()
    x = jax.random.normal(jax.random.key(0), (40, 48))
    w = jax.random.normal(jax.random.key(1), (32, 48))

    def loss(x, w):
        return jnp.sum(nvfp4x.qdot(x, w, recipe=recipe) ** 2)

    def run(impl):
        with _kernels.use("nvfp4_quantize", impl):
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)

    got, want = run("pallas"), run("xla")
    for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        if jax.default_backend() == "cpu":
            np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
        else:
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-2, atol=1e-3)


def test_uncovered_cases_take_the_reference():
    """float16 input, `scale_rounding="up"`, SR without a key, and 16x1 blocks over an
    odd number of columns (the codes pack pairs along the rows): no kernel."""
    x = jnp.ones((16, 32), jnp.float32)
    with _kernels.use("nvfp4_quantize", "pallas"):
        assert _kernels.nvfp4_quantizer(x, (16, 1), "nearest", "nearest", None, None)
        odd = x[:, :31]
        assert _kernels.nvfp4_quantizer(odd, (16, 1), "nearest", "nearest", None, None) is None
        assert _kernels.nvfp4_operand(odd, (1, 16), "nearest", "nearest", 0, None) is None
    with _kernels.use("nvfp4_quantize", "pallas"):
        assert _kernels.nvfp4_quantizer(x, (1, 16), "nearest", "nearest", None, None)
        assert _kernels.nvfp4_quantizer(x, (16, 16), "nearest", "nearest", None, None)
        assert _kernels.nvfp4_quantizer(x[0], (16, 16), "nearest", "nearest", None, None) is None
        assert _kernels.nvfp4_quantizer(x, (1, 16), "nearest", "up", None, None) is None
        assert _kernels.nvfp4_quantizer(x, (1, 16), "stochastic", "nearest", None, None) is None
        half = x.astype(jnp.float16)
        assert _kernels.nvfp4_quantizer(half, (1, 16), "nearest", "nearest", None, None) is None
    with _kernels.use("nvfp4_quantize", "xla"):
        assert _kernels.nvfp4_quantizer(x, (1, 16), "nearest", "nearest", None, None) is None


def test_chooser_defaults_and_override():
    assert _kernels.pick("nvfp4_quantize", "cpu") == "xla"
    assert _kernels.pick("nvfp4_quantize", "gpu") == "pallas"
    assert _kernels.pick("nvfp4_quantize", "tpu") == "mosaic"
    with _kernels.use("nvfp4_quantize", "pallas"):
        assert _kernels.pick("nvfp4_quantize", "cpu") == "pallas"
        with _kernels.use("nvfp4_quantize", "xla"):
            assert _kernels.pick("nvfp4_quantize") == "xla"
        assert _kernels.pick("nvfp4_quantize") == "pallas"
    default = {"gpu": "pallas", "tpu": "mosaic"}.get(_kernels.backend(), "xla")
    assert _kernels.pick("nvfp4_quantize") == default
    unknown = "`cuda` is not an implementation of `nvfp4_quantize`"
    with pytest.raises(ValueError, match=unknown), _kernels.use("nvfp4_quantize", "cuda"):
        pass
    with pytest.raises(ValueError, match="`gemm` is not an operation"):
        _kernels.pick("gemm")


@pytest.mark.parametrize(
    "dtype,block,rounding,output,shape",
    [
        (jnp.float32, (1, 16), "nearest", "codes", (8192, 16384)),
        (jnp.bfloat16, (1, 16), "stochastic", "values", (8192, 16384)),
        (jnp.float32, (16, 16), "nearest", "dequantized", (8192, 16384)),
        (jnp.bfloat16, (16, 1), "stochastic", "values", (8192, 16384)),
        (jnp.bfloat16, (16, 16), "stochastic", "values", (8208, 16400)),
    ],
    ids=[
        "float32_codes",
        "bfloat16_sr_values",
        "float32_16x16_dequantized",
        "bfloat16_16x1_sr_values",
        "bfloat16_16x16_sr_values_overhanging",
    ],
)
def test_pallas_kernel_lowers_for_cuda(dtype, block, rounding, output, shape):
    """Triton lowering, tiles that fit and (the masked reads and writes) tiles that
    overhang."""
    assert lowers_for_cuda(shape, dtype, block, rounding, output)


def lowers_for_cuda(shape, dtype, block, rounding, output, tiling=None) -> bool:
    x = jax.ShapeDtypeStruct(shape, dtype)
    fn = jax.jit(
        lambda x: _pallas_nvfp4.quantize_2d(
            x,
            None,
            jnp.zeros((2,), jnp.uint32),
            block=block,
            rounding=rounding,
            output=output,
            tiling=tiling,
        )
    )
    return "nvfp4_quantize_2d" in fn.trace(x).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("tiling", _pallas_nvfp4.CANDIDATES[1:], ids=str)
def test_pallas_sweep_tilings_lower_for_cuda(tiling):
    """Every tiling the GPU benchmark's sweep tries (the default: above) lowers for both
    block layouts it times, on its array shape."""
    assert lowers_for_cuda((8192, 16384), jnp.float32, (1, 16), "nearest", "codes", tiling)
    assert lowers_for_cuda((8192, 16384), jnp.bfloat16, (16, 16), "nearest", "codes", tiling)


def kernel_body(shape, block, output: str):
    """The equations of the kernel's body (nested ones included) for a bfloat16 array
    of `shape`, stochastic rounding (traced only)."""
    fn = functools.partial(
        _pallas_nvfp4.quantize_2d, block=block, rounding="stochastic", output=output
    )
    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda x: fn(x, None, jnp.zeros((2,), jnp.uint32)))(x).jaxpr

    def equations(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from equations(sub)

    (call,) = [e for e in equations(jaxpr) if e.primitive.name == "pallas_call"]
    return list(equations(call.params["jaxpr"]))


@pytest.mark.parametrize(
    "shape,block,output,overhangs",
    [
        ((37, 112), (1, 16), "codes", True),
        ((48, 112), (16, 16), "dequantized", True),
        ((48, 40), (16, 1), "values", True),
        ((64, 512), (1, 16), "dequantized", False),
    ],
    ids=["1x16_codes", "16x16_dequantized", "16x1_values", "fitting_tiles"],
)
def test_pallas_kernel_body_is_safe_on_triton(shape, block, output, overhangs):
    """What the interpreter does not check: a tile that overhangs the array is read and
    written only through masks (plain `ref[...]` where every tile fits, the fast path);
    no float is negated (`-0.0` would become `+0.0`) nor divided (approximate there).
    Each tile of `x` is read once and only the output asked for is written (codes and
    scales, or the values alone)."""
    body = kernel_body(shape, block, output)
    tiles = 0
    for eqn in body:
        name = eqn.primitive.name
        if name in ("get", "swap", "masked_load", "masked_swap"):
            if len(eqn.invars[0].aval.shape) == 2:  # x and the outputs (not the parameters)
                tiles += 1
                assert name.startswith("masked") == overhangs, name
            if name.startswith("masked"):
                args = eqn.params["args_tree"].unflatten(eqn.invars)
                assert (args[2 if name == "masked_load" else 3] is not None) == overhangs
        if name in ("neg", "div"):
            assert not jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating), name
    assert tiles == (3 if output == "codes" else 2)  # x; codes and scales, or values


# The exact helpers against the reference's steps, on values that decide bits.


def special_floats() -> np.ndarray:
    """Every float32 exponent with a few significands, both signs, zeros, subnormals,
    inf and NaN."""
    exps = np.arange(-149, 128, dtype=np.float64)
    sig = np.array([1.0, 1.0 + 2.0**-23, 1.25, 1.5, 1.75 - 2.0**-22, 1.999999])
    v = (np.exp2(exps)[:, None] * sig[None, :]).ravel()
    v = v[np.isfinite(v.astype(np.float32))].astype(np.float32)
    rng = np.random.default_rng(0).standard_normal(4000).astype(np.float32)
    extra = np.array([0.0, -0.0, np.inf, -np.inf, np.nan], np.float32)
    return np.concatenate([v, -v, rng, rng * 1e-38, extra])


def bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def jitted(fn, *args):
    """`fn(*args)` under `jax.jit` (one compilation instead of one per operation)."""
    return jax.jit(fn)(*args)


def reference(fn, *args):
    """`fn(*args)` jitted on the CPU (see `on_cpu`)."""
    return jax.jit(fn)(*on_cpu(args))


def test_block_steps_are_exact():
    v = special_floats()
    a = np.clip(np.abs(v[~np.isnan(v)]), 0, 448).astype(np.float32)
    e4m3 = np.asarray(reference(round_e4m3, a))
    np.testing.assert_array_equal(bits(jitted(_exact.round_e4m3_nonneg, a)), bits(e4m3))
    s = np.array([1e-3, 3e-30, 2e-39], np.float32)[:, None]
    np.testing.assert_array_equal(
        bits(jitted(lambda p, s: _exact.mul_exact(p, s, s < 2.0**-64), e4m3, s)),
        bits(reference(mul_exact, e4m3, s)),
    )
    np.testing.assert_array_equal(
        np.asarray(jitted(_exact.e4m3_bits, e4m3)),
        np.asarray(jnp.asarray(e4m3).astype(jnp.float8_e4m3fn)).view(np.uint8),
    )


def test_element_steps_are_exact():
    v = special_floats()
    grid = np.linspace(-7.0, 7.0, 4097, dtype=np.float32)
    u = _e2m1.uniform(jax.random.key(0), grid.shape)
    for x in (v, grid):
        np.testing.assert_array_equal(
            np.asarray(jitted(_exact.encode_nearest, x)),
            np.asarray(reference(_e2m1.encode_nearest, x)),
        )
    np.testing.assert_array_equal(
        np.asarray(jitted(_exact.encode_stochastic, grid, u)),
        np.asarray(reference(lambda g, u: _e2m1.encode(_e2m1.round_stochastic(g, u)), grid, u)),
    )
    codes = np.arange(16, dtype=np.int32)
    decoded = bits(jitted(_exact.decode, codes))
    np.testing.assert_array_equal(decoded, bits(_e2m1.decode(jnp.asarray(codes, jnp.uint8))))
    assert decoded[8] == 0x80000000  # code 8 is -0.0
