"""The Mosaic (Pallas TPU) Hadamard transforms equal the library's defined order bit for bit:
the product alone (`_tpu_rht.transform`) and the scaled one (`transform_scaled`).

On a CPU the kernel runs in the TPU interpreter (`pltpu.InterpretParams()`); on a TPU the
same tests run it compiled. The kernel is picked explicitly (`use("rht", "mosaic")`), so
these tests run it on every backend whatever the default.
"""

import contextlib
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from reference import F32, assert_bits, ref_rht_float32

import nvfp4x
from benchmarks.tpu_compile_check import inlined
from nvfp4x import _kernels
from nvfp4x._kernels import _tpu_rht
from nvfp4x._numerics import _hadamard
from nvfp4x._numerics._ieee import INF_BITS, abs_bits


def data(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """float32 from 2^-90 to 2^110 (no chunk column needs scaling), with exact
    cancellations, a zero column, a column of negative zeros and one of small normals."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * np.exp2(rng.integers(-90, 110, (rows, cols)))
    x[:, 3] = 0.0
    x[:, 4] = -0.0
    x[::2, 5] = -x[1::2, 5]
    x[:, 7] = np.float32(2.0**-99)
    return x.astype(F32)


@pytest.mark.parametrize(
    "shape",
    [(144, 200), (2064, 130)],
    ids=["one tile, rows padded, lanes overhang", "two row tiles, two lane tiles"],
)
def test_the_kernel_is_the_defined_order(shape):
    """The kernel's product equals `_plain` (the XLA path) and the NumPy float32 order,
    bit for bit, signed zeros included; called eagerly (it is jitted) and inside a jit."""
    x = data(*shape)
    want = ref_rht_float32(x)
    got = _tpu_rht.transform(jnp.asarray(x), interpret=_kernels.backend() != "tpu")
    assert_bits(np.asarray(got), want, "kernel")
    plain = jax.jit(lambda a: _hadamard._plain(a.reshape(-1, 16, a.shape[1])).reshape(a.shape))
    assert_bits(np.asarray(plain(jnp.asarray(x))), want, "_plain")


def test_rht_with_the_kernel_picked_is_rht():
    """`nvfp4x.rht` with the kernel picked gives XLA's bits along either axis, eagerly and
    under `jit` (a padded length); columns that need scaling (big, tiny, non-finite) take
    the XLA path in both (the whole array then), and an array the kernel does not take
    (8 columns) runs `_plain`."""
    x = data(150, 130, seed=1)
    special = x.copy()
    special[:, 10] = np.linspace(-1.0, 1.0, x.shape[0], dtype=F32) * F32(2.0**126)  # big
    special[:, 11] = np.float32(1e-35)  # tiny
    special[17, 12] = np.inf
    cases = [(x, 0, "eager"), (x.T, 1, "jit"), (special, 0, "eager"), (data(40, 8), 0, "jit")]
    for a, axis, mode in cases:
        with _kernels.use("rht", "xla"):
            want = np.asarray(nvfp4x.rht(jnp.asarray(a), axis=axis))
        fn = nvfp4x.rht if mode == "eager" else jax.jit(nvfp4x.rht, static_argnames="axis")
        with _kernels.use("rht", "mosaic"):
            got = fn(jnp.asarray(a), axis=axis)
        assert_bits(np.asarray(got), want, f"{mode} {a.shape} axis {axis}")


def test_a_training_step_traced_for_a_tpu_runs_the_kernel_in_both_wgrad_transforms(
    monkeypatch,
):
    """An NVFP4 layer's gradient step with the kernel picked, traced for a TPU, holds the
    kernel twice (wgrad's `dy` and `x`: `_kernels.rht`, whose bits the tests above check)
    and lowers, also when lowered after the `use` block its trace ran in. On a TPU the
    step runs too, and its gradients equal the XLA transform's bit for bit (elsewhere
    the kernel would run interpreted: slow, and its bits are checked above)."""
    model = nvfp4x.quantize(
        eqx.nn.Linear(128, 144, key=jax.random.key(0)), nvfp4x.recipes.nvfp4_training()
    )
    x = jax.random.normal(jax.random.key(1), (256, 128))
    arrays, static = eqx.partition(model, eqx.is_array)

    def loss(arrays, x):
        return jnp.sum(jax.vmap(eqx.combine(arrays, static))(x) ** 2)

    # wgrad's operands by the transform then the quantiser (not the fused operand
    # kernels, a TPU's default, `tests/test_tpu_operand.py`), whose transform is this one.
    apart = functools.partial(_kernels.use, "rht_operand", "xla")
    on_tpu = _kernels.backend() == "tpu"
    if on_tpu:
        with apart(), _kernels.use("rht", "xla"):
            want = jax.jit(jax.grad(loss))(arrays, x)
        with apart(), _kernels.use("rht", "mosaic"):
            got = jax.jit(jax.grad(loss))(arrays, x)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert_bits(np.asarray(g), np.asarray(w), "gradient")
    monkeypatch.setattr(_kernels, "backend", lambda: "tpu")

    def lowered(*picks: tuple[str, str]) -> str:
        with contextlib.ExitStack() as stack:
            for op, implementation in picks:
                stack.enter_context(_kernels.use(op, implementation))
            traced = jax.jit(jax.grad(loss)).trace(arrays, x)
        # Lowered after the block: the GEMM primitives run the picks of their binding.
        return traced.lower(lowering_platforms=("tpu",)).as_text()

    def kernels_in(implementation: str | None) -> tuple[int, int]:
        picks = [("rht_operand", "xla")] + ([("rht", implementation)] if implementation else [])
        text = lowered(*picks)
        return text.count('"nvfp4x_rht_tpu"'), text.count('"nvfp4x_rht_scaled_tpu"')

    # XLA's transform between two kernel steps: no lowering of the GEMMs is reused
    # across picks. A TPU's default is the kernel, for the scaled path too.
    found = [kernels_in(i) for i in ("mosaic", "xla", "mosaic", None)]
    assert found == [(2, 2), (0, 0), (2, 2), (2, 2)]
    # With a TPU's defaults, the fused operand kernels (their own transform) instead, the
    # scaled path in them too (the branch for columns that need it).
    text = lowered()
    assert text.count('"nvfp4x_rht_tpu"') == 0 and text.count('"nvfp4x_rht_stats_tpu"') == 2
    assert text.count('"nvfp4x_rht_scaled_tpu"') == 0
    assert text.count('"nvfp4x_operand_scaled_tpu"') == 2
    # The kernels' exact scalar prologue, as its kernel (in XLA, long to compile), three
    # times: for x in fprop, the weight, and one call for wgrad's two operands (the
    # fused operand's two branches share theirs; no dgrad: the loss is differentiated
    # in the weights only).
    runs = inlined(text)[1]
    assert runs["prologue"] == 3 and runs["scale_parameters"] == 0


def test_the_kernel_lowers_for_a_tpu():
    """The kernel lowers for a TPU (Mosaic's own compile runs on the device), on a square
    operand and on one that pads and overhangs."""
    for shape in ((8192, 8192), (2064, 130)):
        x = jax.ShapeDtypeStruct(shape, jnp.float32)
        lowered = jax.jit(_tpu_rht.transform).trace(x).lower(lowering_platforms=("tpu",))
        assert "nvfp4x_rht_tpu" in lowered.as_text()


def special_data(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """`data` with chunk columns that need `_guarded`'s scaling among the ordinary ones,
    every 9th column from the 10th and the last two (so in both lane tiles): big ones up
    to float32's maximum (transforms near it and past it), with +inf, -inf, both, NaN,
    tiny ones (1e-35, subnormals around 1e-40 and 1e-45, both signs; zero columns from
    `data`), one whose chunks are big, tiny and ordinary in turn, and one of subnormals
    that the last 8 rows of each chunk make ordinary."""
    rng = np.random.default_rng(seed)
    x = data(rows, cols, seed)

    def signs():
        return rng.choice(np.asarray([-1.0, 1.0], F32), rows)

    def normal_with(*at):  # (row, value) pairs
        col = rng.standard_normal(rows).astype(F32)
        for r, v in at:
            col[r] = v
        return col

    per_chunk = (np.arange(rows) // 16) % 3
    columns = [
        F32(3e38) * signs(),
        rng.uniform(2.5e38, 3.4e38, rows),
        rng.uniform(-1.0, 1.0, rows) * F32(3.4e38),
        np.full(rows, 2.0**124) * signs(),  # (exactly `_BIG_BITS`)
        normal_with((5, np.inf)),
        normal_with((40, -np.inf)),
        normal_with((3, np.inf), (4, -np.inf)),
        normal_with((70, np.nan)),
        F32(1e-35) * signs(),
        rng.standard_normal(rows) * F32(1e-40),
        np.where(rng.random(rows) < 0.5, F32(1e-45), F32(0.0)) * signs(),
        np.select([per_chunk == 0, per_chunk == 1], [signs() * F32(3e38), F32(1e-40)], 1.5),
        # Not tiny by the last 8 rows of each chunk alone (2^-100, exactly `_TINY_BITS`):
        # most results are their subnormals' sums, which read as zero (not scaled).
        np.where(np.arange(rows) % 16 < 8, rng.standard_normal(rows) * 1e-40, 2.0**-100),
    ]
    targets = [*range(10, cols - 2, 9), cols - 2, cols - 1]
    for i, c in enumerate(targets):
        x[:, c] = np.asarray(columns[i % len(columns)], F32)
    return x


def _near_max_recomputed(x: np.ndarray) -> tuple[int, int]:
    """How many of `_guarded`'s scaled results of `x` are near float32's maximum, and at
    how many of them `_accurate` changes `_plain`'s bits (the XLA code's steps)."""
    chunks, amax_bits = _hadamard._chunk_columns(jnp.asarray(x))
    scaled, (big, _) = _hadamard._scaled_into_range(chunks, amax_bits)
    y = _hadamard._plain(scaled)
    near_max = big & (abs_bits(y) >= _hadamard._NEAR_MAX_BITS) & (abs_bits(y) < INF_BITS)
    accurate = _hadamard._accurate(scaled, y, near_max)
    changed = np.asarray(accurate).view(np.uint32) != np.asarray(y).view(np.uint32)
    return int(jnp.sum(near_max)), int(changed.sum())


def test_the_scaled_kernel_is_rht_scaled():
    """`transform_scaled` equals `_hadamard.rht_scaled` (XLA's `_guarded`) bit for bit,
    NaNs aside, on big, non-finite, tiny, zero and ordinary chunk columns: results that
    overflow, near float32's maximum (recomputed by `_accurate`, which changes some of
    them here), subnormal, signed zeros; inside a jit, in 256-row tiles (two, the last
    overhanging the rows) and two lane tiles (the last overhanging the columns). (Rows
    padded to a tile: `transform`'s test, the same tiling code.)"""
    shape = (400, 200)
    x = special_data(*shape)
    want = np.asarray(jax.jit(_hadamard.rht_scaled)(jnp.asarray(x)))
    near_max, changed = _near_max_recomputed(x)
    assert near_max > 0 and changed > 0  # (the data reach `_accurate`'s path)
    tiny = (want != 0) & (np.abs(want) < F32(2.0**-126))
    zeros = want == 0
    assert np.isinf(want).any() and np.isnan(want).any() and tiny.any()
    assert (zeros & np.signbit(want)).any() and (zeros & ~np.signbit(want)).any()

    def call(a):
        return _tpu_rht.transform_scaled(a, interpret=_kernels.backend() != "tpu", rows=256)

    assert_bits(np.asarray(jax.jit(call)(jnp.asarray(x))), want, f"{shape}")


def test_the_scaled_kernel_lowers_for_a_tpu():
    """The scaled kernel lowers for a TPU, under its own name."""
    x = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    traced = jax.jit(lambda a: _tpu_rht.transform_scaled(a)).trace(x)
    text = traced.lower(lowering_platforms=("tpu",)).as_text()
    assert '"nvfp4x_rht_scaled_tpu"' in text and '"nvfp4x_rht_tpu"' not in text


_KERNELS = pytest.mark.parametrize(
    "kernel", [_tpu_rht.transform, _tpu_rht.transform_scaled], ids=["product", "scaled"]
)


@_KERNELS
@pytest.mark.parametrize(
    "shape, dtype",
    [((100, 128), jnp.float32), ((128, 64), jnp.float32), ((128, 128), jnp.bfloat16)],
    ids=["rows not whole chunks", "too narrow", "bfloat16"],
)
def test_the_kernel_refuses_what_it_does_not_take(kernel, shape, dtype):
    with pytest.raises(ValueError, match="TPU Hadamard kernel takes float32"):
        kernel(jnp.zeros(shape, dtype))


@_KERNELS
def test_the_kernel_refuses_tiles_of_partial_groups(kernel):
    with pytest.raises(ValueError, match="`rows` must be a positive multiple of 128"):
        kernel(jnp.zeros((256, 128), jnp.float32), rows=100)


def _grouped_and_scanned():
    """`(args, function of (args, x))` pairs: a grouped wgrad (a MoE's experts,
    `_ragged.grouped_wgrad`, two groups of 100 and 156 tokens) and the gradient of a
    `filter_vmap`-built stack of layers run by `lax.scan`, quantised for training;
    operands the kernel takes (128 columns)."""
    from nvfp4x import _ragged

    recipe = nvfp4x.recipes.nvfp4_training()
    sizes = jnp.asarray([100, 156], jnp.int32)
    seeds = jnp.asarray([[1, 2], [3, 4]], jnp.uint32)
    f32 = jnp.dtype(jnp.float32)

    def grouped(args, x):
        dy, xs = args
        return _ragged.grouped_wgrad(dy, xs * x, sizes, seeds, recipe=recipe, dtype=f32)

    tokens = jax.random.normal(jax.random.key(4), (2, 256, 128))
    stack = eqx.filter_vmap(lambda k: eqx.nn.Linear(128, 128, key=k))(
        jax.random.split(jax.random.key(5), 2)
    )
    arrays, static = eqx.partition(nvfp4x.quantize(stack, "nvfp4_training"), eqx.is_array)

    def scanned(arrays, x):
        def body(h, a):
            return jax.vmap(eqx.combine(a, static))(h), None

        return jnp.mean(lax.scan(body, x, arrays)[0] ** 2)

    return [(tuple(tokens), grouped), (arrays, jax.grad(scanned))]


@pytest.mark.parametrize("case", [0, 1], ids=["grouped wgrad", "scanned stack"])
def test_the_kernel_in_grouped_and_scanned_wgrads_equals_xla(case, monkeypatch):
    """The TPU's default transform in a MoE's grouped wgrad and in a scanned stack's
    wgrads: results bit for bit XLA's (on the CPU the kernel in Pallas's generic
    interpreter; the stack's inside its GEMM primitives), and the function traced for a
    TPU lowers with the kernel (`dy` and `x` have one shape here: one lowered branch
    serves both)."""
    args, fn = _grouped_and_scanned()[case]
    x = jax.random.normal(jax.random.key(6), (256, 128))
    results = {}
    for implementation in ("xla", "mosaic"):
        with _kernels.use("rht", implementation):
            # (a new function each time: JAX caches traces by function, not by picks)
            results[implementation] = jax.jit(lambda a, b: fn(a, b))(args, x)
    want, got = jax.tree.leaves(results["xla"]), jax.tree.leaves(results["mosaic"])
    for g, w in zip(got, want, strict=True):
        assert_bits(np.asarray(g), np.asarray(w), "result")
    monkeypatch.setattr(_kernels, "backend", lambda: "tpu")

    def lowered() -> str:
        traced = jax.jit(lambda a, b: fn(a, b)).trace(args, x)
        return traced.lower(lowering_platforms=("tpu",)).as_text()

    # (The stack's 2-D wgrad operands: by the transform then the quantiser here; a TPU's
    # default there is the fused operand kernels, `tests/test_tpu_operand.py`.)
    with _kernels.use("rht_operand", "xla"):
        assert lowered().count('"nvfp4x_rht_tpu"') == 1
    if case == 1:
        text = lowered()
        assert '"nvfp4x_rht_tpu"' not in text and '"nvfp4x_rht_stats_tpu"' in text
