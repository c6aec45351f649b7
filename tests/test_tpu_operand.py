"""The TPU's GEMM operand kernel (16x1, 1x16 and 16x16 blocks) and the fused RHT operand
(`_kernels._tpu_operand`, `"rht_operand"`) equal the reference bit for bit.

On a CPU the kernels run in the TPU interpreter (`pltpu.InterpretParams()`) or, inside
nvfp4x's primitives, in Pallas's generic interpreter; on a TPU compiled. Every case also
lowers for a TPU here (Mosaic's own compile runs on the device).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import F32, assert_bits
from test_kernels import tiny_like

import nvfp4x
from benchmarks.tpu_compile_check import inlined
from nvfp4x import _kernels
from nvfp4x._formats import Format, quantize_operand, quantize_rht_operand, quantize_rht_operands
from nvfp4x._kernels import _tpu_operand, _tpu_quantize, _tpu_rht
from nvfp4x._numerics import _hadamard
from nvfp4x._numerics._nvfp4 import amax_of_bits
from nvfp4x._numerics._threefry import seed_words

ON_TPU = _kernels.backend() == "tpu"


def data(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Normal values whose 16-row blocks span 2^-40..2^40, with E2M1 ties after scaling
    (a block of the grid's midpoints), a zero block, a block of subnormals among normals,
    negative zeros, a NaN, an inf and a -inf (their blocks' scales NaN)."""
    rng = np.random.default_rng(seed)
    scale = np.exp2(rng.integers(-40, 40, (rows // 16, 1, cols)).astype(F32))
    x = (rng.standard_normal((rows // 16, 16, cols)).astype(F32) * scale).reshape(rows, cols)
    x[:16, 1] = np.asarray([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5] * 2, F32)
    x[16:32, 2] = 0.0
    x[32:48, 3] = np.float32(2.0**-130) * np.arange(16, dtype=F32)
    x[33, 3] = np.float32(1e-30)
    x[48:64, 4] = -0.0
    x[5, 6], x[20, 7], x[40, 8] = np.nan, np.inf, -np.inf
    return x


def reference(x, rounding: str, seed_key, rht: bool = False, axis: int = 0, block=(1, 16)):
    """The XLA path: `quantize_operand` along `axis` (the transform first with `rht`) in
    the format's `block`s (1x16 along `axis`, or 16x16), jitted (one compile; its eager
    bits are the same, `tests/test_format.py`)."""
    fmt = Format("nvfp4", rounding=rounding, block=block)

    def run(x, seed_key):
        y = _hadamard.rht(x, axis=0) if rht else x
        return quantize_operand(y, fmt, axis=axis, key=seed_key)

    with _kernels.use("nvfp4_quantize", "xla"), _kernels.use("rht", "xla"):
        return jax.jit(run)(x, seed_key)


CASES = [
    # (block, dtype, rounding, shape, tile rows, looped): rows padded to a group / tiles
    # overhanging the rows (by whole blocks), lanes overhanging the columns.
    ((16, 1), jnp.float32, "nearest", (400, 200), 256, False),
    ((16, 1), jnp.bfloat16, "stochastic", (48, 136), 1024, True),
    ((1, 16), jnp.float32, "stochastic", (304, 208), 256, True),
    ((1, 16), jnp.bfloat16, "nearest", (48, 256), 1024, False),
    ((16, 16), jnp.float32, "stochastic", (400, 208), 256, False),
    ((16, 16), jnp.bfloat16, "nearest", (48, 256), 1024, True),
]


@pytest.mark.parametrize("block,dtype,rounding,shape,rows,looped", CASES)
def test_operand_is_the_reference(block, dtype, rounding, shape, rows, looped):
    """The kernel's bfloat16 block values and tensor scale are the XLA quantiser's, bit
    for bit, NaN blocks, ties, subnormals and signed zeros included (1x16 blocks: the
    data transposed, so that its blocks lie along the rows; 16x16 blocks: a tile's 16
    columns reduced across the lanes)."""
    x = data(*shape[::-1]).T.copy() if block == (1, 16) else data(*shape)
    x = jnp.asarray(x).astype(dtype)
    key = jax.random.key(7) if rounding == "stochastic" else None
    tile = dict(block=(16, 16)) if block == (16, 16) else {}
    want_v, want_s = reference(x, rounding, key, axis=1 if block == (1, 16) else 0, **tile)
    seed = None if key is None else seed_words(key)
    amax = amax_of_bits(x.astype(jnp.float32))
    got_v, got_s = _tpu_operand.operand(
        x,
        amax,
        seed,
        block=block,
        rounding=rounding,
        interpret=not ON_TPU,
        rows=rows,
        looped=looped,
    )
    assert_bits(np.asarray(got_v), np.asarray(want_v), "values")
    assert_bits(np.asarray(got_s), np.asarray(want_s), "tensor scale")


@pytest.mark.parametrize(
    "block,rounding,looped", [((16, 1), "nearest", True), ((16, 16), "stochastic", False)]
)
def test_tininess_branched_once_is_the_reference(block, rounding, looped):
    """`branch_once=True` (`BRANCH_ONCE`: the group loop with no branch and the plain
    product, a second loop for a tiny tensor): the reference's bits on float32 data and
    on a tiny tensor (`s_dec < 2^-64`) whose subnormal elements count."""
    x = data(272, 208)  # (tiles of 256 rows: the second overhangs)
    tiny = tiny_like(x)
    key = jax.random.key(5) if rounding == "stochastic" else None
    seed = None if key is None else seed_words(key)
    tile = dict(block=(16, 16)) if block == (16, 16) else {}
    for v in (x, tiny):
        v = jnp.asarray(v)
        want_v, want_s = reference(v, rounding, key, axis=0, **tile)
        got_v, got_s = _tpu_operand.operand(
            v,
            amax_of_bits(v),
            seed,
            block=block,
            rounding=rounding,
            interpret=not ON_TPU,
            rows=256,
            looped=looped,
            branch_once=True,
        )
        assert_bits(np.asarray(got_v), np.asarray(want_v), "values")
        assert_bits(np.asarray(got_s), np.asarray(want_s), "tensor scale")
    subnormal = np.abs(np.asarray(tiny)) < np.finfo(F32).tiny
    assert np.any(subnormal & (np.asarray(want_v, F32) != 0))  # (they count)


@pytest.mark.parametrize("rounding,looped", [("nearest", False), ("stochastic", True)])
def test_operand_with_the_transform_is_the_transform_then_the_reference(rounding, looped):
    """`rht=True`: the transform's product in the kernel, then the quantiser, gives the
    bits of `_hadamard.rht` then the XLA quantiser; `rht_stats` finds no special column
    and gives the transform's amax (tiles overhanging rows and lanes: their garbage
    masked); both kernels' groups unrolled and looped."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((400, 200)).astype(F32) * np.exp2(rng.integers(-30, 30, 200))
    x[:, 5] = 0.0
    x = jnp.asarray(x.astype(F32))
    key = jax.random.key(8) if rounding == "stochastic" else None
    want_v, want_s = reference(x, rounding, key, rht=True)
    interpret = not ON_TPU
    special, amax = _tpu_operand.rht_stats(x, interpret=interpret, rows=256, looped=looped)
    assert not bool(special)
    assert_bits(np.asarray(amax), np.asarray(amax_of_bits(_hadamard.rht(x, 0))), "amax")
    seed = None if key is None else seed_words(key)
    kw = dict(rounding=rounding, rht=True, interpret=interpret, rows=256, looped=looped)
    got_v, got_s = _tpu_operand.operand(x, amax, seed, **kw)
    assert_bits(np.asarray(got_v), np.asarray(want_v), "values")
    assert_bits(np.asarray(got_s), np.asarray(want_s), "tensor scale")


@pytest.mark.parametrize(
    "where,value,special",
    [
        ((20, 5), np.inf, True),
        ((21, 6), np.nan, True),
        ((392, 199), 2.0**125, True),  # (in the last, overhanging tile)
        ((40, 7), 1e-35, True),  # a column tiny but not zero
        ((41, 8), 2.0**123, False),
        ((42, 9), 0.0, False),  # (an all-zero column of a chunk is not special)
    ],
)
def test_rht_stats_finds_the_columns_the_transform_scales(where, value, special):
    """`rht_stats`'s check is `_hadamard.rht`'s (`special_columns` of each chunk column),
    in Pallas's generic interpreter (what runs inside the primitives off a TPU)."""
    x = np.random.default_rng(1).standard_normal((400, 200)).astype(F32)
    chunk = slice(where[0] // 16 * 16, where[0] // 16 * 16 + 16)
    if value == 1e-35 or value == 0.0:
        x[chunk, where[1]] = F32(value)
    x[where] = F32(value)
    got, _ = _tpu_operand.rht_stats(
        jnp.asarray(x), interpret="plain" if not ON_TPU else False, rows=128
    )
    assert bool(got) == special


def test_the_scaled_kernels_are_the_scaled_transform_then_the_reference():
    """`rht="scaled"` and `rht_stats(..., scaled=True)` (the fused operand's rarely taken
    branch): the scaled transform in the kernel, then the quantiser, give the bits of
    `_hadamard.rht_scaled` then the XLA quantiser with its `amax_of_bits` (NaN results
    ignored): big columns whose results overflow to inf or stay near float32's maximum,
    a NaN, tiny columns with subnormals, zeros; tiles overhanging rows and lanes."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((400, 200)).astype(F32) * np.exp2(rng.integers(-30, 30, 200))
    x[:, 5] = 0.0
    x[3, 4], x[80, 7] = F32(2.0**126), np.nan
    x[40:56, 9] = F32(1e-38)
    x[41, 9], x[42, 9] = F32(2.0**-140), F32(-(2.0**-130))
    x[:16, 11] = np.repeat(np.asarray([1.9, -1.9], F32) * F32(2.0**127), 8)  # (finite)
    x[16:32, 199] = F32(3e38)  # (in the overhanging lanes: its results overflow)
    x = jnp.asarray(x)
    key, rounding = jax.random.key(8), "stochastic"  # (the nearest rounding: the same kernel)
    y = _hadamard.rht_scaled(x)
    want_v, want_s = reference(y, rounding, key)
    interpret = not ON_TPU
    kw = dict(interpret=interpret, rows=256)
    special, amax = _tpu_operand.rht_stats(x, scaled=True, **kw)
    assert bool(special)
    assert_bits(np.asarray(amax), np.asarray(amax_of_bits(y)), "amax")
    got_v, got_s = _tpu_operand.operand(
        x, amax, seed_words(key), rounding=rounding, rht="scaled", **kw
    )
    assert_bits(np.asarray(got_v), np.asarray(want_v), "values")
    assert_bits(np.asarray(got_s), np.asarray(want_s), "tensor scale")


@pytest.mark.parametrize("special", [False, True])
def test_the_scaled_path_alone_is_the_transform(special):
    """`_hadamard.rht_scaled` (the fused operand's other branch: the scaled path on every
    chunk, no `cond`) gives `_hadamard.rht`'s bits, eagerly and under `jit`, whether or
    not a column needs the scaling (big, non-finite, tiny but nonzero; zero columns; rows
    padded to whole chunks)."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((40, 24)).astype(F32) * np.exp2(rng.integers(-20, 20, 24))
    x[:, 1] = 0.0
    if special:
        x[3, 2], x[17, 3], x[33, 4] = np.inf, np.nan, F32(2.0**126)
        x[16:32, 5] = F32(1e-35)
        x[16:20, 5] = [F32(2.0**-130), F32(-(2.0**-140)), F32(3 * 2.0**-149), 0.0]  # subnormal
        x[5, 6] = F32(-(2.0**125))
        # Partial sums that overflow where the result is finite (first output 0).
        x[:16, 7] = np.repeat(np.asarray([1.9, -1.9], F32) * F32(2.0**127), 8)
    x = jnp.asarray(x)
    want = _hadamard.rht(x, 0)
    xp = _hadamard.padded_rows(x)
    for got in (_hadamard.rht_scaled(xp), jax.jit(_hadamard.rht_scaled)(xp)):
        assert_bits(np.asarray(got), np.asarray(want), "transform")


def test_quantize_rht_operand_picks_the_fused_kernels_with_the_same_bits(monkeypatch):
    """`quantize_rht_operand` with `"rht_operand"` picked equals the transform then the
    quantiser, for operands with and without special columns (big, NaN, tiny: the
    `cond`'s other branch, the same kernels with the scaled transform), eagerly, under
    `jit` and vmapped (rows padded to whole chunks, lanes overhanging a tile); traced for
    a TPU it holds both branches' kernels and no XLA loop (the scaled branch is kernels
    only: no float32 transform held by a branch that rarely runs)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((94, 144)).astype(F32)
    big = x.copy()
    big[3, 4], big[80, 7] = F32(2.0**126), np.nan
    big[40:56, 9] = F32(1e-38)  # (a tiny column, subnormals among it)
    fmt = Format("nvfp4", rounding="stochastic")
    key = jax.random.key(9)
    # (One jitted function per pick, for both inputs: compiled once each.)
    reference_fn = jax.jit(lambda a, k: quantize_rht_operand(a, fmt, k))
    fused_fn = jax.jit(lambda a, k: quantize_rht_operand(a, fmt, k))
    for a in (x, big):
        with _kernels.use("rht_operand", "xla"):
            want = reference_fn(jnp.asarray(a), key)
        with _kernels.use("rht_operand", "mosaic"):
            results = [fused_fn(jnp.asarray(a), key)]
            if a is x:  # (eagerly once)
                results.append(quantize_rht_operand(jnp.asarray(a), fmt, key))
        for got in results:
            assert_bits(np.asarray(got[0]), np.asarray(want[0]), "values")
            assert_bits(np.asarray(got[1]), np.asarray(want[1]), "tensor scale")
    # Vmapped (a grouped or stacked GEMM's problems), one with a special column: the
    # batched `cond` runs both sides for both, and the other's bits are its own still.
    pair = jnp.asarray(np.stack([x, big]))
    results = {}
    for implementation in ("xla", "mosaic"):
        with _kernels.use("rht_operand", implementation):
            fn = jax.jit(jax.vmap(lambda a: quantize_rht_operand(a, fmt, key)))
            results[implementation] = fn(pair)
    assert_bits(np.asarray(results["mosaic"][0]), np.asarray(results["xla"][0]), "vmapped values")
    assert_bits(np.asarray(results["mosaic"][1]), np.asarray(results["xla"][1]), "vmapped scales")
    monkeypatch.setattr(_kernels, "backend", lambda: "tpu")
    with _kernels.use("rht_operand", "mosaic"):
        fn = jax.jit(lambda a, k: quantize_rht_operand(a, fmt, k))
        text = fn.trace(jnp.asarray(x), key).lower(lowering_platforms=("tpu",)).as_text()
    assert '"nvfp4x_rht_stats_tpu"' in text and '"nvfp4x_operand_tpu"' in text
    assert '"nvfp4x_rht_scaled_stats_tpu"' in text and '"nvfp4x_operand_scaled_tpu"' in text
    # No other transform kernel (compiled for nothing), and no XLA loop: the scaled
    # branch is its two kernels alone.
    assert '"nvfp4x_rht_tpu"' not in text and '"nvfp4x_rht_scaled_tpu"' not in text
    assert "stablehlo.while" not in text
    # The kernel's parameters (exact scalar arithmetic) are made once for both branches,
    # not in each, by the prologue kernel (no XLA copy of it: long for XLA to compile).
    runs = inlined(text)[1]
    assert runs["prologue"] == 1 and runs["scale_parameters"] == 0
    assert text.count('"nvfp4x_prologue_tpu"') == 1


def test_operands_quantised_together_choose_before_any_work(monkeypatch):
    """`quantize_rht_operands` (wgrad's two operands) runs the fused kernels for both
    where they take both, and quantises each its own way where one request is not the
    kernels' (no format, or 16x16 blocks), the kernels then traced only for the operand
    that runs them (the choice is made before any work). Their work in either order
    (`_kernels.RHT_OPERANDS_TOGETHER`): each operand's prologue kernel its own, or one
    call for both, whose parameters are each operand's own. (Traced and lowered: the
    pair's bits are those of the transform and the quantiser apart in
    `test_a_training_step_with_the_fused_operands_is_the_same`.)"""
    g = jax.ShapeDtypeStruct((40, 144), jnp.float32)
    a = jax.ShapeDtypeStruct((40, 160), jnp.float32)
    sr, plain = Format("nvfp4", rounding="stochastic"), Format("nvfp4")
    tiles = Format("nvfp4", block=(16, 16))
    key = jax.random.key(3)

    def together(second):
        return lambda g, a: quantize_rht_operands([(g, sr, key), (a, second, None)])

    calls = []
    stats = _tpu_operand.rht_stats
    monkeypatch.setattr(
        _tpu_operand, "rht_stats", lambda x, **kw: calls.append(x.shape) or stats(x, **kw)
    )

    def stats_kernels(fn, *args) -> int:  # (the statistics kernel's calls when traced)
        calls.clear()
        jax.make_jaxpr(fn)(*args)
        return len(calls)

    # One prologue call for several operands gives each its own parameters.
    finite = np.random.default_rng(1).standard_normal((2, 64, 128)).astype(F32)
    xs = [jnp.asarray(finite[0]), jnp.asarray(finite[1] * np.float32(1e-30))]  # (a tiny one)
    seeds = [seed_words(key), None]
    kw = dict(block=(16, 1), output="values", interpret=True)
    both = _tpu_quantize.kernel_parameters_many(xs, [None, None], seeds, **kw)
    for x, seed, got in zip(xs, seeds, both, strict=True):
        want = _tpu_quantize.kernel_parameters(x, None, seed, **kw)
        for w, o in zip(want, got, strict=True):
            assert_bits(np.asarray(o), np.asarray(w), "parameters")
    monkeypatch.setattr(_kernels, "backend", lambda: "tpu")
    for order in (True, False):
        monkeypatch.setattr(_kernels, "RHT_OPERANDS_TOGETHER", order)
        with _kernels.use("rht_operand", "mosaic"):
            one = stats_kernels(lambda g: quantize_rht_operand(g, sr, key), g)
            assert one > 0
            for second in (plain, None, tiles) if order else (plain,):  # (the default)
                # the first operand's statistics kernel, and the second's where it runs
                n = stats_kernels(together(second), g, a)
                assert n == one * (2 if second is plain else 1)
                text = jax.jit(together(second)).trace(g, a).lower(lowering_platforms=("tpu",))
                # a prologue kernel for each quantised operand (the transformed 16x16
                # one's by the Mosaic quantiser on a TPU), or one call for the fused
                # pair together; no XLA copy of its arithmetic
                runs = inlined(text.as_text())[1]
                pair = second is plain and order
                assert runs["prologue"] == (1 if second is None or pair else 2)
                assert runs["scale_parameters"] == 0


def test_offset_seed_draws_the_whole_arrays_samples():
    """The TPU quantiser on rows of an array, given the array's amax and its seed moved
    along by the rows' flat offset (`_kernels.offset_seed`), writes those rows of the
    whole array's stochastically rounded values (how a piece of an operand is quantised:
    a ragged GEMM's rows and chunks, `FormatSpec.quantize_piece`)."""
    x = jnp.asarray(data(96, 128, seed=5))
    seed = seed_words(jax.random.key(7))
    amax = amax_of_bits(x)
    # (compiled on a TPU: the Mosaic quantiser)
    kw = dict(block=(16, 1), rounding="stochastic", output="values", interpret=not ON_TPU)
    whole = _tpu_quantize.quantize_2d(x, amax, seed, **kw)[0]
    rows = _tpu_quantize.quantize_2d(x[32:80], amax, _kernels.offset_seed(seed, 32 * 128), **kw)
    assert_bits(np.asarray(rows[0]), np.asarray(whole[32:80]), "values")
    # (and not by chance: unmoved, the samples differ)
    plain = _tpu_quantize.quantize_2d(x[32:80], amax, seed, **kw)[0]
    assert not np.array_equal(np.asarray(plain), np.asarray(whole[32:80]))


def test_a_training_step_with_the_fused_operands_is_the_same(monkeypatch):
    """An NVFP4 layer's gradients with the fused wgrad operands picked equal those with
    the transform and the quantiser apart, bit for bit (inside the GEMM primitives: on a
    CPU Pallas's generic interpreter), for inputs with and without a column the
    transform scales."""
    layer = nvfp4x.quantize(
        eqx.nn.Linear(128, 144, key=jax.random.key(0)), nvfp4x.recipes.nvfp4_training()
    )
    x = jax.random.normal(jax.random.key(1), (136, 128))

    def loss(m, x):
        return jnp.sum(jnp.sin(jax.vmap(m)(x)))

    traced = []
    kernel = _tpu_operand.operand
    monkeypatch.setattr(
        _tpu_operand, "operand", lambda *a, **k: traced.append(k.get("rht")) or kernel(*a, **k)
    )
    # (One jitted step per pick, for both inputs: compiled once each.)
    steps = {i: jax.jit(lambda m, a: jax.grad(loss)(m, a)) for i in ("xla", "mosaic")}
    for a in (x, x.at[3, 5].set(1e30)):
        grads = {}
        for implementation in ("xla", "mosaic"):
            with _kernels.use("rht_operand", implementation):
                grads[implementation] = steps[implementation](layer, a)
        for g, w in zip(
            jax.tree.leaves(grads["mosaic"]), jax.tree.leaves(grads["xla"]), strict=True
        ):
            assert_bits(np.asarray(g), np.asarray(w), "gradient")
    # The fused kernels were traced in wgrad, for dy and x (once: the second input runs
    # the same lowered GEMMs, its special column taking the `cond`'s other branch; on a
    # TPU the kernel also quantises other 16x1 operands, without the transform), and
    # the scaled branch's kernel for both.
    assert traced.count(True) == 2 and traced.count("scaled") == 2


def test_vmapped_kernels_run_one_problem_at_a_time():
    """Vmapped (a grouped convolution's groups, stacked problems), each kernel runs one
    problem after another: it lowers for a TPU (Pallas's own rule puts the quantiser's
    parameters in SMEM blocks of a batched shape, which its TPU lowering refuses: seen on
    a TPU v5e) and gives each problem's own results (its tensor scale, its SR bits):
    interpreted here, compiled on a TPU."""
    x = np.stack([data(128, 144, seed=i) for i in range(2)])
    x[1] *= 8.0  # (another amax, so another tensor scale)
    seed = seed_words(jax.random.key(3))
    op = _tpu_operand.operand
    calls = {  # (name: a function of x and `interpret`)
        "operand": lambda x, i: op(x, None, seed, rounding="stochastic", interpret=i),
        "across": lambda x, i: op(x, None, None, block=(1, 16), interpret=i),
        "rht": lambda x, i: op(x, jnp.float32(2.0**40), None, rht=True, interpret=i),
        "stats": lambda x, i: _tpu_operand.rht_stats(x, interpret=i),
        "transform": lambda x, i: _tpu_rht.transform(x, interpret=i),
    }
    for name, fn in calls.items():
        lowered = jax.jit(jax.vmap(lambda x, f=fn: f(x, False))).trace(x)
        text = lowered.lower(lowering_platforms=("tpu",)).as_text()
        prologues = text.count('kernel_name = "nvfp4x_prologue_tpu"')
        assert prologues == (name in ("operand", "across", "rht")), name
        assert text.count("tpu_custom_call") == 1 + prologues, name
    interpret = not ON_TPU  # (on a TPU compiled: Mosaic's compile of the vmapped calls)
    for name in ("operand", "across"):
        got = jax.vmap(lambda x, f=calls[name]: f(x, interpret))(x)
        for i in range(2):
            want = calls[name](x[i], interpret)
            assert_bits(got[0][i], want[0], f"{name}[{i}]")
            assert_bits(got[1][i], want[1], f"{name}[{i}] tensor scale")


@pytest.mark.parametrize(
    "block,dtype,rounding,rht,looped,branch_once",
    [
        ((16, 1), jnp.float32, "nearest", False, False, False),
        ((16, 1), jnp.bfloat16, "stochastic", False, True, False),
        ((16, 1), jnp.float32, "stochastic", True, False, False),
        ((16, 1), jnp.float32, "nearest", True, True, False),
        ((16, 1), jnp.float32, "stochastic", "scaled", True, False),
        ((1, 16), jnp.float32, "nearest", False, True, False),
        ((1, 16), jnp.bfloat16, "stochastic", False, False, False),
        ((16, 16), jnp.float32, "stochastic", False, True, False),
        ((16, 1), jnp.float32, "stochastic", True, True, True),
        ((16, 16), jnp.bfloat16, "nearest", False, False, True),
    ],
)
def test_the_kernels_lower_for_a_tpu(block, dtype, rounding, rht, looped, branch_once):
    """Each kernel lowers for a TPU on an operand that overhangs tiles on both axes
    (`branch_once`: with its two group loops)."""
    seed = jnp.zeros((2,), jnp.uint32) if rounding == "stochastic" else None

    def fn(x):
        amax = jnp.float32(1.0)
        kw = dict(block=block, rounding=rounding, rht=rht, looped=looped, branch_once=branch_once)
        if block == (16, 1) and not looped:  # (unrolled: fewer groups a tile, less to lower)
            kw["rows"] = 512
        out = _tpu_operand.operand(x, amax, seed, **kw)
        return (out, _tpu_operand.rht_stats(x, scaled=rht == "scaled")) if rht else out

    x = jax.ShapeDtypeStruct((4112, 1000) if block == (16, 1) else (4112, 1008), dtype)
    text = jax.jit(fn).trace(x).lower(lowering_platforms=("tpu",)).as_text()
    scaled = rht == "scaled"
    assert ('"nvfp4x_operand_tpu"' in text) != scaled
    assert ('"nvfp4x_operand_scaled_tpu"' in text) == scaled
    assert ('"nvfp4x_rht_stats_tpu"' in text) == (rht is True)
    assert ('"nvfp4x_rht_scaled_stats_tpu"' in text) == scaled


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: _tpu_operand.operand(jnp.zeros((24, 128)), 1.0), "rows a multiple of 16"),
        (lambda: _tpu_operand.operand(jnp.zeros((32, 64)), 1.0), "at least 128 columns"),
        (
            lambda: _tpu_operand.operand(jnp.zeros((32, 136)), 1.0, block=(1, 16), rht=True),
            "16x1 blocks of float32 with `rht=True`",
        ),
        (
            lambda: _tpu_operand.operand(jnp.zeros((32, 200)), 1.0, block=(1, 16)),
            "columns a multiple",
        ),
        (
            lambda: _tpu_operand.operand(jnp.zeros((32, 136)), 1.0, block=(16, 16)),
            "16x16 blocks",
        ),
        (
            lambda: _tpu_operand.operand(jnp.zeros((32, 128)), 1.0, block=(16, 16), rht=True),
            "16x1 blocks of float32 with `rht=True`",
        ),
        (
            lambda: _tpu_operand.operand(jnp.zeros((32, 128), jnp.bfloat16), 1.0, rht=True),
            "float32 with `rht=True`",
        ),
        (
            lambda: _tpu_operand.operand(jnp.zeros((32, 128)), 1.0, rounding="stochastic"),
            "seed exactly when stochastic",
        ),
        (lambda: _tpu_operand.operand(jnp.zeros((32, 128)), 1.0, rows=100), "multiple of 128"),
        (lambda: _tpu_operand.operand(jnp.zeros((32, 128)), 1.0, rht="plain"), "'scaled'"),
        (lambda: _tpu_operand.rht_stats(jnp.zeros((32, 128), jnp.bfloat16)), "float32"),
    ],
)
def test_the_kernels_refuse_what_they_do_not_take(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_shapes_the_kernels_do_not_take_run_apart():
    """`rht_operand` returns `None` (the caller runs the transform and the quantiser
    apart) for an operand narrower than a lane tile, 16x16 tiles and `scale_rounding="up"`."""
    with _kernels.use("rht_operand", "mosaic"):
        assert (
            _kernels.rht_operand(jnp.ones((64, 100)), (1, 16), "nearest", "nearest", None) is None
        )
        assert (
            _kernels.rht_operand(jnp.ones((64, 128)), (16, 16), "nearest", "nearest", None) is None
        )
        assert _kernels.rht_operand(jnp.ones((64, 128)), (1, 16), "nearest", "up", None) is None


def test_the_quantiser_gives_the_rht_statistics_of_its_read():
    """`_tpu_quantize.quantize_with_stats`'s kernel (the 1x16 quantiser that also gives
    wgrad's RHT statistics from its read) equals `tiled`'s results (SR codes and scales)
    and `rht_stats` of the rows padded to whole chunks, bit for bit, in the TPU
    interpreter: tiles overhanging the rows (a chunk cut short: its garbage rows taken as
    zeros) and the lanes, a column the transform scales in the cut chunk; the two chunks
    along a tile's rows in the kernel's loop (`Tiling.looped`: dynamic column offsets)
    against unrolled."""
    x = np.random.default_rng(6).standard_normal((520, 528)).astype(F32)
    x *= np.exp2(np.random.default_rng(7).integers(-20, 20, 528)).astype(F32)
    x[512:520, 7] = F32(1e-35)  # (a tiny column in the cut chunk)
    a = jnp.asarray(x)
    seed = seed_words(jax.random.key(4))
    kw = dict(block=(1, 16), rounding="stochastic", output="codes", interpret=not ON_TPU)
    tiling = _tpu_quantize.Tiling(512, 512, 256)
    looped = tiling._replace(looped=True)
    *got, (flag, amax) = _tpu_quantize.tiled(a, None, seed, tiling=looped, stats=True, **kw)
    want = _tpu_quantize.tiled(a, None, seed, tiling=tiling, **kw)
    for g, w in zip(got, want, strict=True):
        if w is not None:
            assert_bits(np.asarray(g), np.asarray(w), "quantiser result")
    want_flag, want_amax = _tpu_operand.rht_stats(_hadamard.padded_rows(a), interpret=not ON_TPU)
    assert bool(flag) and bool(want_flag)
    # (the amax too: both take the same maximum, special columns included)
    assert_bits(np.asarray(amax), np.asarray(want_amax), "amax of the transform")
    # With the default tiling it lowers for a TPU (tiles overhanging both axes).
    traced = jax.jit(lambda x: _tpu_quantize.quantize_with_stats(x, rounding="nearest"))
    big = jax.ShapeDtypeStruct((4120, 4112), jnp.float32)
    assert "nvfp4_quantize_tpu" in traced.trace(big).lower(lowering_platforms=("tpu",)).as_text()


def test_input_fusion_lets_xla_fuse_only_the_array_operands(monkeypatch):
    """With `_batching.INPUT_FUSION` on, the quantiser, the fused operand and the RHT
    statistics kernels let XLA fuse their array operand's producer (here a GELU) into
    their reads, and nothing else (the parameters in SMEM, the packing matrix); off (the
    default), no input; lowered for a TPU. On, wgrad's fused operand of a bfloat16
    operand keeps its bits (its `cond` takes the operand as given)."""
    import re

    from nvfp4x._kernels import _batching

    x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    seed = jnp.zeros((2,), jnp.uint32)

    def kernels(x):
        a = jax.nn.gelu(x)
        return (
            _tpu_quantize.quantize_2d(a, None, block=(1, 16), output="values")[0],
            _tpu_operand.operand(a, None, seed, rounding="stochastic", rht=True)[0],
            _tpu_operand.rht_stats(a)[1],
        )

    def fusion(on: bool) -> list[str]:
        monkeypatch.setattr(_batching, "INPUT_FUSION", on)
        jax.clear_caches()
        text = jax.jit(kernels).trace(x).lower(lowering_platforms=("tpu",)).as_text()
        return re.findall(r"allow_input_fusion\\22: \[([a-z,]*)\]", text)

    rng = np.random.default_rng(4)
    a = rng.standard_normal((94, 144)).astype(F32)
    a[3, 4], a[80, 7], a[40:56, 9] = F32(2.0**126), np.nan, F32(1e-38)  # (special columns)
    fmt = Format("nvfp4", rounding="stochastic")
    key = jax.random.key(9)
    try:
        assert fusion(False) == []
        assert sorted(fusion(True)) == sorted(
            ["false,false,false,false,true", "false,false,false,true", "true"]
        )
        # With it on, wgrad's fused operand takes a bfloat16 operand as it is into its
        # `cond` (each branch widens and pads it: rows not whole chunks here), the same
        # bits as the transform then the quantiser.
        x = jnp.asarray(a, jnp.bfloat16)
        with _kernels.use("rht_operand", "xla"):
            want = jax.jit(lambda a, k: quantize_rht_operand(a, fmt, k))(x, key)
        with _kernels.use("rht_operand", "mosaic"):
            got = jax.jit(lambda a, k: quantize_rht_operand(a, fmt, k))(x, key)
        assert_bits(np.asarray(got[0]), np.asarray(want[0]), "values")
        assert_bits(np.asarray(got[1]), np.asarray(want[1]), "tensor scale")
    finally:
        monkeypatch.setattr(_batching, "INPUT_FUSION", False)
        jax.clear_caches()
    # `NVFP4X_TPU_INPUT_FUSION=1` turns it on from the start (a test run on a TPU).
    import os
    import subprocess
    import sys

    code = "from nvfp4x._kernels import _batching; print(_batching.INPUT_FUSION)"
    env = {**os.environ, "NVFP4X_TPU_INPUT_FUSION": "1"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.stdout.strip() == "True", run.stderr[-2000:]
