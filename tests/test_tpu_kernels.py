"""The Mosaic (Pallas TPU) NVFP4 quantiser equals the reference bit for bit.

On a CPU the kernel runs in the TPU interpreter (`pltpu.InterpretParams()`, which
simulates a TPU's semantics); on a TPU the same tests run it compiled. Each case is
one compilation (the interpreter's are several seconds each), reused across data: edge
arrays (NaN and inf blocks, zero rows, subnormals, a block far below the amax), tiny
tensors (subnormal amax, subnormal products with `s_dec`), SR keys, both input dtypes,
all three block layouts and all three outputs, tiles that overhang the array on both
axes. Every case also lowers for a TPU here (Mosaic's own compile runs on the device).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kernels import edge_array, on_cpu, same_floats, same_nvfp4, scaled, tiny_like

import nvfp4x
from benchmarks.tpu_quantize_check import lowers_for_tpu, main
from nvfp4x import _kernels
from nvfp4x._formats import Format, quantize_operand
from nvfp4x._kernels import _tpu_quantize
from nvfp4x._numerics import _e2m1
from nvfp4x._numerics._constants import GOLDEN_RATIO_32
from nvfp4x._numerics._nvfp4 import expand, from_blocks, scale_blocks
from nvfp4x._numerics._pack import pack


def traced_with(impl: str, fn, *args):
    """`jax.jit(fn)` traced with implementation `impl` and compiled, checked to hold the
    kernel exactly when `impl` is `"mosaic"` (pass a new function per implementation:
    `jax.jit` reuses a trace). The reference is compiled for the CPU (`on_cpu`: its
    arguments there), where the kernel's results are compared with it."""
    with _kernels.use("nvfp4_quantize", impl):
        traced = jax.jit(fn).trace(*(on_cpu(args) if impl == "xla" else args))
    assert ("pallas_call" in str(traced.jaxpr)) == (impl == "mosaic"), impl
    return traced.lower().compile()


def test_mosaic_to_nvfp4_equals_reference():
    """`to_nvfp4` under `jit` (packed codes, scale bits, tensor scale), float32, 1x16, on
    the edge array, then tiny tensors through the same compilation."""

    def to():  # a new function per implementation
        return lambda x: nvfp4x.to_nvfp4(x)

    x = edge_array(jnp.float32)
    want, got = traced_with("xla", to(), x), traced_with("mosaic", to(), x)
    # tiny tensors (`s_dec < 2^-64`): amax ~1e-36, 86% of the elements subnormal (before
    # `scaled` built them in NumPy, XLA:CPU flushed this one to all zeros); amax ~1e-19
    for data in (x, scaled(x, 1e-42), scaled(x, 1e-25)):
        same_nvfp4(got(data), want(*on_cpu((data,))))


def as_the_device_reads(x):
    """`x` as this backend's arithmetic reads it: on a TPU a bfloat16 array's subnormals
    are zeros of their sign in every operation (docs/format.md, the CPU / GPU / TPU
    table), so the reference on the CPU is given them so; elsewhere `x`."""
    if _kernels.backend() != "tpu" or x.dtype != jnp.bfloat16:
        return x
    v = np.asarray(x, np.float32)
    tiny = np.abs(v) < float(jnp.finfo(jnp.bfloat16).tiny)  # (2^-126)
    return jnp.asarray(np.where(tiny, np.copysign(np.float32(0), v), v)).astype(x.dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_mosaic_fake_quantize_equals_reference(dtype):
    """`fake_quantize` (the dequantised values in the input's dtype), SR, 1x16: a
    normal tensor and a tiny one, whose products with `s_dec < 2^-64` are subnormal
    (bfloat16: the kernel's values and the XLA fallback's meet in one `lax.cond`)."""

    def fq():
        return lambda x, key: nvfp4x.fake_quantize(x, rounding="stochastic", key=key)

    x = edge_array(dtype, rows=7, cols=48)
    x, key = jnp.where(jnp.isinf(x), 2.0, x), jax.random.key(2)
    want, got = traced_with("xla", fq(), x, key), traced_with("mosaic", fq(), x, key)
    # (a subnormal decode scale, amax 1e-37: the kernel flushed its values on a TPU
    # v5e, so `fake_quantize` takes the XLA path there)
    tiny = tiny_like(x)
    for data in (x, x * 1e-33, tiny):
        expected = want(*on_cpu((as_the_device_reads(data), key)))
        assert np.any(np.signbit(expected) & (expected == 0))  # -0.0 among them
        same_floats(got(data, key), expected)


def test_mosaic_operand_equals_reference_eagerly(monkeypatch):
    """The GEMM operand path (bfloat16 block values `e2m1 * scale_b` and the tensor
    scale), called eagerly: bfloat16, SR, along the leading axis (16x1 blocks: wgrad's
    tokens)."""
    fmt = Format("nvfp4", block=(1, 16), rounding="stochastic")
    x, key = edge_array(jnp.bfloat16, rows=41, cols=40), jax.random.key(3)
    calls = []
    kernel = _tpu_quantize.quantize_2d
    monkeypatch.setattr(
        _tpu_quantize, "quantize_2d", lambda *a, **k: calls.append(k["block"]) or kernel(*a, **k)
    )
    with _kernels.use("nvfp4_quantize", "xla"):  # the reference, on the CPU
        want = jax.jit(lambda x, key: quantize_operand(x, fmt, 0, key))(*on_cpu((x, key)))
    with _kernels.use("nvfp4_quantize", "mosaic"):
        got = quantize_operand(x, fmt, 0, key)
    assert calls == [(16, 1)]
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    values = np.asarray(want[0], np.float32)
    assert np.any(np.signbit(values) & (values == 0))  # -0.0 among them
    same_floats(got[0], want[0])


def test_mosaic_values_both_ways_equal_reference():
    """The GEMM operand's block values (1x16, to the nearest, float32) equal the
    reference's: by the comparisons then decoded (`Tiling.arithmetic=False`) on the edge
    array, and by float arithmetic (the default, which every other case here runs) on a
    tiny tensor (`s_dec < 2^-64`), whose subnormal elements give nonzero values
    (`_tpu_quantize.magnitudes`' exact steps: a TPU's arithmetic, and XLA:CPU's under
    the interpreter, would flush them)."""
    fmt = Format("nvfp4", block=(1, 16), rounding="nearest")
    x = edge_array(jnp.float32, rows=40, cols=112)
    tiny = tiny_like(x)
    for data, arithmetic in ((x, False), (tiny, True)):
        with _kernels.use("nvfp4_quantize", "xla"):
            want = jax.jit(lambda x: quantize_operand(x, fmt, 1, None))(*on_cpu((data,)))[0]
        got = _tpu_quantize.tiled(
            data,
            None,
            None,
            block=(1, 16),
            rounding="nearest",
            output="values",
            interpret=jax.default_backend() != "tpu",
            tiling=_tpu_quantize.Tiling(512, 512, 256, arithmetic=arithmetic),
        )[0]
        same_floats(got, want)
    subnormal = np.abs(np.asarray(tiny)) < np.finfo(np.float32).tiny
    assert np.any(subnormal & (np.asarray(want, np.float32) != 0))  # (they count)


def reference_values(x, block, amax, seed):
    """The block values `e2m1 * scale_b` (bfloat16) by the reference's steps, to the
    nearest where `seed` is None, else stochastically as `reference_codes` draws."""
    v, scale_b, s_dec = scale_blocks(x, block, amax)
    q = _e2m1.round_nearest(v) if seed is None else _e2m1.round_stochastic(v, thresholds(v, seed))
    return from_blocks(q * expand(scale_b, block), block).astype(jnp.bfloat16), s_dec


@pytest.mark.parametrize(
    "block,rounding", [((1, 16), "stochastic"), ((16, 16), "nearest")], ids=["1x16-sr", "16x16"]
)
def test_tininess_branched_once_a_tile_keeps_the_bits(block, rounding):
    """`Tiling.branch_once` (the chunk loop with no branch in it, the plain product, and
    a second loop of 128-column chunks for a tiny tensor) with `Tiling.unroll=2`: the
    block values equal the reference's on a normal array and on a tiny tensor whose
    subnormal elements count, and the dequantised values equal those of the default
    tiling (tiles overhanging the array: `test_mosaic_tiles_overhanging_both_edges`)."""
    t = _tpu_quantize.Tiling(512, 512, 512, branch_once=True, unroll=2)
    x = jnp.tile(edge_array(jnp.float32, rows=40, cols=112), (7, 5))[:256, :512]
    x = jnp.where(jnp.isinf(x), 3.0, x)  # (a NaN block stays: its values NaN)
    tiny = tiny_like(x)
    seed = jax.random.bits(jax.random.key(4), (2,), jnp.uint32) if rounding != "nearest" else None
    interpret = jax.default_backend() != "tpu"
    kw = dict(block=block, rounding=rounding, interpret=interpret)
    for data in (x, tiny):
        want, s_want = jax.jit(reference_values, static_argnums=1)(
            *on_cpu((data,)), block, None, seed
        )
        got, _, s_dec = _tpu_quantize.tiled(data, None, seed, output="values", tiling=t, **kw)
        same_floats(got, want)
        assert np.asarray(s_dec).view(np.uint32) == np.asarray(s_want).view(np.uint32)
        deq = [
            _tpu_quantize.tiled(data, None, seed, output="dequantized", tiling=tiling, **kw)[0]
            for tiling in (t, _tpu_quantize.Tiling(512, 512, 512))
        ]
        same_floats(*deq)
    subnormal = np.abs(np.asarray(tiny)) < np.finfo(np.float32).tiny
    assert np.any(subnormal & (np.asarray(want, np.float32) != 0))  # (they count)


def test_mosaic_tiles_overhanging_both_edges():
    """bfloat16, 16x16 tiles, SR: several tiles along both axes, the last ones
    overhanging the array (their reads outside it are garbage, their writes dropped),
    given amax below `max|x|` (scales clamp at 448), SR by each element's index
    whatever the tiling; the two chunks along a tile's rows in the kernel's loop (their
    column offsets dynamic: `Tiling.looped`; unrolled, the statistics test's other
    half)."""
    small = _tpu_quantize.Tiling(512, 512, looped=True)
    x = jnp.tile(edge_array(jnp.bfloat16, rows=37, cols=112), (15, 5))[:528, :528]
    seed = jax.random.bits(jax.random.key(9), (2,), jnp.uint32)
    amax = jnp.float32(1e5)
    block = (16, 16)
    codes, bits, s_dec = _tpu_quantize.quantize_2d(
        x,
        amax,
        seed,
        block=block,
        rounding="stochastic",
        tiling=small,
        interpret=jax.default_backend() != "tpu",
    )
    q, scale_b, s_want = jax.jit(reference_codes, static_argnums=1)(x, block, amax, seed)
    np.testing.assert_array_equal(np.asarray(codes), np.asarray(q))
    np.testing.assert_array_equal(np.asarray(bits), np.asarray(scale_b))
    assert np.asarray(s_dec).view(np.uint32) == np.asarray(s_want).view(np.uint32)


def thresholds(v, seed):
    """The SR thresholds of the elements of `v` (`scale_blocks`' view, flat in `x`'s
    order) as `_e2m1.uniform` draws them from the seed words `seed`."""
    index = jnp.arange(v.size, dtype=jnp.uint32).reshape(v.shape)
    h = _e2m1._fmix32(index * jnp.uint32(GOLDEN_RATIO_32) + seed[0])
    return ((_e2m1._fmix32(h ^ seed[1]) >> 16).astype(jnp.float32) + 0.5) * (1.0 / 65536.0)


def reference_codes(x, block, amax, seed):
    """Packed SR codes, scale bits and `s_dec` by the reference's steps, the thresholds
    drawn as `_e2m1.uniform` draws them from the seed words `seed`."""
    v, scale_b, s_dec = scale_blocks(x, block, amax)
    codes = _e2m1.encode(_e2m1.round_stochastic(v, thresholds(v, seed))).reshape(x.shape)
    bits = jax.lax.bitcast_convert_type(scale_b.astype(jnp.float8_e4m3fn), jnp.uint8)
    return pack(codes), bits, s_dec


def test_chooser_picks_mosaic_on_tpu():
    assert _kernels.pick("nvfp4_quantize", "tpu") == "mosaic"
    assert _kernels.pick("nvfp4_quantize", "cpu") == "xla"
    x = jnp.ones((16, 32), jnp.float32)
    with _kernels.use("nvfp4_quantize", "mosaic"):
        assert _kernels.nvfp4_quantizer(x, (16, 16), "nearest", "nearest", None, None)
        assert _kernels.nvfp4_quantizer(x, (1, 16), "nearest", "up", None, None) is None
        half = x.astype(jnp.float16)
        assert _kernels.nvfp4_quantizer(half, (1, 16), "nearest", "nearest", None, None) is None


@pytest.mark.parametrize(
    "block,output,dtype,rounding",
    [
        ((1, 16), "codes", jnp.float32, "stochastic"),
        ((16, 16), "values", jnp.bfloat16, "nearest"),
        ((16, 1), "dequantized", jnp.bfloat16, "stochastic"),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_mosaic_kernel_lowers_for_tpu(block, output, dtype, rounding):
    """Mosaic lowering, each block layout, output, dtype and rounding once, on an array
    whose tiles overhang it on both axes (every combination, and every tiling of the
    sweep: `python -m benchmarks.tpu_quantize_check --lower-only`)."""
    assert lowers_for_tpu((8208, 16400), dtype, block, rounding, output)


@pytest.mark.parametrize(
    "block,dtype,rounding,output",
    [
        ((1, 16), jnp.bfloat16, "stochastic", "dequantized"),
        ((16, 16), jnp.float32, "nearest", "values"),
    ],
    ids=["1x16", "16x16"],
)
def test_tininess_branched_once_lowers_for_tpu(block, dtype, rounding, output):
    """`Tiling.branch_once` with `unroll=2` (its two loops) lowers for a TPU."""
    t = _tpu_quantize.Tiling(2048, 512, 512, branch_once=True, unroll=2)
    assert lowers_for_tpu((4112, 8208), dtype, block, rounding, output, t)


def test_vmapped_mosaic_quantiser_lowers_for_tpu():
    """A vmapped quantisation (a stack of layers' weights, as `freeze` quantises a
    stacked model) lowers for a TPU: one array after another, where Pallas's own
    batching rule gave a block of the SMEM parameters that Mosaic refuses (seen on a
    TPU v5e: `freeze` of an 8-layer stack failed)."""
    stack = jax.ShapeDtypeStruct((3, 32, 256), jnp.float32)
    seed = jnp.zeros((2,), jnp.uint32)

    def one(x, amax):
        return _tpu_quantize.quantize_2d(x, amax, seed, rounding="stochastic")

    amax = jax.ShapeDtypeStruct((3,), jnp.float32)
    lowered = jax.jit(jax.vmap(one)).trace(stack, amax).lower(lowering_platforms=("tpu",))
    assert "nvfp4_quantize_tpu" in lowered.as_text()


def test_tpu_quantize_check_smoke(tmp_path):
    """The device script runs (tiny shapes, interpreted here) and writes its table."""
    out = tmp_path / "check.md"
    assert main(["--smoke", "--no-sweep", "--out", str(out)]) == 0
    text = out.read_text()
    assert "| to_nvfp4 1x16 float32 48x112 | yes |" in text
    # the GEMM operand's sweep: the comparisons, the arithmetic, the operand kernel
    assert main(["--smoke", "--values-sweep", "--out", str(out)]) == 0
    rows = [r for r in out.read_text().splitlines() if r.startswith("| 1x16 float32")]
    assert len(rows) == 3 and all("| True |" in r for r in rows), rows


def test_tpu_lane_check_smoke(tmp_path):
    """The lane check runs (interpreted here: the 1x16 kernel and its patched forms,
    whose bits it compares with the library's) and writes its table."""
    from benchmarks import tpu_lane_check

    out = tmp_path / "lane.md"
    assert tpu_lane_check.main(["--smoke", "--tiled", "--repeats", "1", "--out", str(out)]) == 0
    rows = [r for r in out.read_text().splitlines() if r.startswith("| tiled 1x16 nearest")]
    assert len(rows) == 1 + len(tpu_lane_check.PATCHES), rows


def _kernel_dot_precisions(jaxpr) -> list:
    """The `precision` of every `dot_general` inside the Pallas calls of `jaxpr`."""
    found = []

    def walk(jp, inside: bool) -> None:
        for eqn in jp.eqns:
            if inside and eqn.primitive.name == "dot_general":
                found.append(eqn.params["precision"])
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub, inside or eqn.primitive.name == "pallas_call")

    walk(jaxpr.jaxpr, False)
    return found


def test_kernel_dots_ignore_a_callers_default_matmul_precision():
    """Under `jax.default_matmul_precision("highest")` (a common setting in user code)
    every MXU dot inside the TPU kernels (the quantiser's code packing, the frozen GEMM's
    layouts) still names one bfloat16 pass: Mosaic refuses a float32-precision dot of
    bfloat16 operands ("Bad lhs type", seen on a TPU v5e, where this setting made the
    main example's cached decode fail to compile)."""
    from nvfp4x._kernels import _tpu_frozen_gemm

    x = jax.ShapeDtypeStruct((512, 512), jnp.float32)
    codes = jax.ShapeDtypeStruct((64, 256), jnp.uint8)
    bits = jax.ShapeDtypeStruct((64, 32), jnp.uint8)
    calls = [
        (functools.partial(_tpu_quantize.quantize_2d, block=b), (x,)) for b in ((1, 16), (16, 16))
    ]
    for layout, m in (("planes", 1), ("chunks", 1), ("pairs", 1), ("wide", 130)):
        fn = functools.partial(
            _tpu_frozen_gemm.frozen_matmul, block=(1, 16), n=64, operand="float32", layout=layout
        )
        calls.append((fn, (jax.ShapeDtypeStruct((m, 512), jnp.float32), codes, bits)))
    one_pass = (jax.lax.Precision.DEFAULT, jax.lax.Precision.DEFAULT)
    for fn, args in calls:
        with jax.default_matmul_precision("highest"):
            precisions = _kernel_dot_precisions(jax.make_jaxpr(fn)(*args))
        assert precisions and set(precisions) == {one_pass}, precisions


def bfloat16_subnormals() -> np.ndarray:
    """A bfloat16 array made on the host: tensor amax 2^-118, its blocks of bfloat16
    subnormals (2^-133..2^-127) and small normals, whose block scales are not zero
    relative to it."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((32, 64)).astype(np.float32) * np.float32(2.0**-130)
    x[0, :16] = np.float32(2.0**-118) * np.linspace(-1, 1, 16, dtype=np.float32)
    x[1, 16:32] = np.float32(2.0**-133) * np.arange(16, dtype=np.float32)
    return x.astype(jnp.bfloat16)


@pytest.mark.skipif(
    _kernels.backend() == "tpu",
    reason="a TPU reads a bfloat16 array's subnormals as zero in every operation "
    "(docs/format.md, the CPU / GPU / TPU table): there the reference flushes them too",
)
@pytest.mark.parametrize("block", [(1, 16), "operand 16x1"])
def test_mosaic_reads_bfloat16_subnormals_exactly(block):
    """The Mosaic quantisers on a bfloat16 tensor whose values are mostly bfloat16
    subnormals, its amax 2^-118 (so that they decide codes and block scales): the
    reference's codes, scales and tensor scale (`to_nvfp4` in 1x16 blocks), and its block
    values (the GEMM operand in 16x1 blocks, `_tpu_operand`'s kernel), in the TPU
    interpreter. The tests' other tiny tensors scale on the device, where bfloat16
    results that small are zeros on a TPU; this data is made on the host."""
    x = jnp.asarray(bfloat16_subnormals())
    assert np.count_nonzero(np.asarray(x.astype(jnp.float32))) > 1000  # (not flushed)
    if block == "operand 16x1":

        def to():
            return lambda x: quantize_operand(x, Format("nvfp4"), axis=0)

        want, got = traced_with("xla", to(), x), traced_with("mosaic", to(), x)
        expected = want(*on_cpu((x,)))
        assert np.count_nonzero(np.asarray(expected[0])) > 100  # (the subnormals count)
        for g, w in zip(got(x), expected, strict=True):
            same_floats(g, w)
        return

    def to():
        return lambda x: nvfp4x.to_nvfp4(x, block=block)

    want, got = traced_with("xla", to(), x), traced_with("mosaic", to(), x)
    expected = want(*on_cpu((x,)))
    assert np.count_nonzero(np.asarray(expected.codes)) > 100  # (the subnormals count)
    same_nvfp4(got(x), expected)


#: Tensor amaxes for the prologue kernel (random ones join them in `PROLOGUE_AMAXES`):
#: zeros, subnormals (read on their bits), the tiny-scale threshold's neighbourhood
#: (`s_dec` near 2^-64 and subnormal), ordinary and huge values, the largest finite, inf,
#: NaN and negatives (which the reference maps).
PROLOGUE_EDGES = np.asarray(
    [
        0.0,
        -0.0,
        1e-45,
        1e-40,
        1.1754942e-38,
        1.1754944e-38,
        1e-35,
        2.5e-35,
        3.2e-35,
        3.3e-35,
        1e-30,
        1.5e-16,
        1.46e-16,
        1.0,
        3.0,
        6.0,
        2688.0,
        448.0 * 6,
        1e10,
        3e38,
        3.4028235e38,
        np.inf,
        -np.inf,
        np.nan,
        -1.0,
        -1e-40,
    ],
    np.float32,
)
PROLOGUE_AMAXES = np.concatenate(
    [PROLOGUE_EDGES, np.exp(np.random.default_rng(0).uniform(-103, 88, 90)).astype(np.float32)]
)


def test_the_prologue_kernel_is_the_exact_prologue():
    """`_tpu_quantize.prologue` (the quantiser kernels' scalar prologue as one kernel, a
    grid step per tensor) gives `_exact.scale_parameters`' bits, computed by the reference
    on the CPU (where XLA keeps subnormals): the tensor scale, the parameter vector and
    the inverse table, for every amax of `PROLOGUE_AMAXES` in one call, and the edge
    cases (`PROLOGUE_EDGES`) one at a time under `jit`; and lowers for a TPU. E4M3 codes
    decode as `float8_e4m3fn` does."""
    from nvfp4x._kernels import _exact

    codes = np.arange(_exact.E4M3_CODES, dtype=np.uint8)
    want_values = codes.view(jnp.float8_e4m3fn).astype(np.float32)
    want_values[-1] = np.nan  # (the kernels' NaN slot)
    got_values = np.asarray(_exact.e4m3_value(jnp.asarray(codes, jnp.int32)))
    np.testing.assert_array_equal(got_values.view(np.int32), want_values.view(np.int32))

    interpret = _kernels.backend() != "tpu"
    amaxes = jnp.asarray(PROLOGUE_AMAXES)
    made = np.asarray(_tpu_quantize.prologue(amaxes, interpret=interpret))
    one = jax.jit(lambda a: _tpu_quantize.prologue(a[None], interpret=interpret)[0])
    reference = jax.jit(_exact.scale_parameters)
    for i, amax in enumerate(PROLOGUE_AMAXES):
        s_dec, head, table = (np.asarray(v) for v in reference(*on_cpu((jnp.float32(amax),))))
        params = np.zeros(16, np.float32)
        params[:4], params[4:12] = head, table[7 << 3 : (7 << 3) + 8]
        alone = [np.asarray(one(jnp.float32(amax)))] if i < len(PROLOGUE_EDGES) else []
        for got in (made[i], *alone):
            for g, w in ((got[2, 2], s_dec), (got[2, :16], params), (got[:2].ravel(), table)):
                same_floats(g, w)
    text = jax.jit(_tpu_quantize.prologue).trace(amaxes).lower(lowering_platforms=("tpu",))
    assert '"nvfp4x_prologue_tpu"' in text.as_text()
