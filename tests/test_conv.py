"""Convolutions end to end, built as the Equinox U-Net and DCGAN examples and a
Gated-DeltaNet LM's short convolution write them.

Every selected convolution's GEMMs (fprop, dgrad, wgrad) run through nvfp4x (counted
in the jaxprs of the forward and the gradient), `coverage` counts them as NVFP4 and
nothing else, `freeze` packs each kernel as trained (frozen == unfrozen, bit for bit),
telemetry runs, and what is a convolution does not depend on how the class is written.
(Frozen and unfrozen outputs are compared by `assert_same_sums`: bit for bit on a CPU;
on a TPU a frozen NVFP4 patch GEMM is the Mosaic kernel, which sums in its own order.)
"""

import contextlib
import dataclasses
import functools
import itertools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TRAIN, assert_close, assert_same, assert_same_sums, normal
from jax import lax
from jaxtyping import Array

import nvfp4x
from nvfp4x import _kernels
from nvfp4x._conv import (
    Geometry,
    _signs_carry,
    conv_patches,
    conv_wgrad,
    conv_wgrad_operands,
    reference_only,
    shifted_wgrad,
    shifted_wgrad_operands,
    shifts_rows,
    wgrad_plan,
)
from nvfp4x._gemm import wgrad_quantised

CONVS = nvfp4x.Policy([(".*", TRAIN)], convolutions=True)
FLOAT_CONVS = nvfp4x.Policy([(".*", nvfp4x.recipes.float32())], convolutions=True)


class ShortConv(eqx.Module):
    """A causal depthwise short convolution over `(tokens, channels)`, its kernel held as
    `weight` `(channels, 1, size)` (Gated DeltaNet's, as Equinox ports write it)."""

    weight: Array

    def __init__(self, channels: int, size: int, key):
        self.weight = jax.random.normal(key, (channels, 1, size)) / size

    def __call__(self, x):
        size = self.weight.shape[-1]
        y = lax.conv_general_dilated(
            x.T[None], self.weight, (1,), [(size - 1, 0)], feature_group_count=x.shape[-1]
        )
        return y[0].T


class TinyUNet(eqx.Module):
    """Down, a grouped middle, up two ways (DCGAN's ConvTranspose2d k4 s2 p1, the
    U-Net's k2 s2), with a skip connection."""

    down: eqx.nn.Conv2d
    mid: eqx.nn.Conv2d
    up: eqx.nn.ConvTranspose2d
    up2: eqx.nn.ConvTranspose2d

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.down = eqx.nn.Conv2d(3, 16, 3, stride=2, padding=1, key=k[0])
        self.mid = eqx.nn.Conv2d(16, 16, 3, padding=1, groups=4, key=k[1])
        self.up = eqx.nn.ConvTranspose2d(16, 3, 4, stride=2, padding=1, key=k[2])
        self.up2 = eqx.nn.ConvTranspose2d(16, 3, 2, stride=2, key=k[3])

    def __call__(self, x):  # (3, H, W)
        h = jax.nn.relu(self.down(x))
        h = jax.nn.relu(self.mid(h))
        return self.up(h) + self.up2(h) + x


class Mixer(eqx.Module):
    """A Gated-DeltaNet-style block: projection, depthwise short conv, projection."""

    proj_in: eqx.nn.Linear
    conv: ShortConv
    proj_out: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.proj_in = eqx.nn.Linear(16, 32, key=k[0])
        self.conv = ShortConv(32, 4, k[1])
        self.proj_out = eqx.nn.Linear(32, 16, key=k[2])

    def __call__(self, x):  # (tokens, 16)
        return jax.vmap(self.proj_out)(jax.nn.silu(self.conv(jax.vmap(self.proj_in)(x))))


UNET_CONVS = ("down", "mid", "up", "up2")
X = normal(1, (2, 3, 8, 8))
TOKENS = normal(2, (12, 16))


def unet_loss(model, x):
    return jnp.mean(jax.vmap(model)(x) ** 2)


def count(text: str, name: str) -> int:
    """How many of nvfp4x's GEMMs `name` (`nvfp4x_qdot`, `nvfp4x_dgrad`, `nvfp4x_wgrad`)
    the jaxpr holds, on patches or as a convolution (`nvfp4x_conv_qdot`...)."""
    conv = name.replace("nvfp4x_", "nvfp4x_conv_")
    return text.count(f"{name}[") + text.count(f"{conv}[")


def test_every_selected_convolution_gemm_runs_quantised_and_coverage_says_so():
    qmodel = nvfp4x.quantize(TinyUNet(jax.random.key(0)), CONVS)
    assert all(isinstance(getattr(qmodel, n).weight, nvfp4x.QWeight) for n in UNET_CONVS)
    grad = jax.grad(unet_loss, argnums=(0, 1))
    text = str(jax.make_jaxpr(grad)(qmodel, X))
    # each convolution's fprop, dgrad (the input's gradient) and wgrad
    assert count(text, "nvfp4x_qdot") == len(UNET_CONVS)
    assert count(text, "nvfp4x_dgrad") == len(UNET_CONVS)
    assert count(text, "nvfp4x_wgrad") == len(UNET_CONVS)
    # the patches are slices, not a convolution, and no float GEMM is left
    assert "conv_general_dilated" not in text and "dot_general" not in text
    report = nvfp4x.coverage(grad, qmodel, X)
    assert report.share("nvfp4") == 1.0, str(report)
    assert sorted((r.path, r.pass_) for r in report.rows) == sorted(
        (n, p) for n in UNET_CONVS for p in ("fprop", "dgrad", "wgrad")
    )
    assert not report.unquantised


def test_plain_gemm_rows_are_named_by_their_layer_not_the_input():
    model = eqx.nn.MLP(8, 4, 16, 2, key=jax.random.key(0))
    qmodel = nvfp4x.quantize(model, nvfp4x.Policy([(r"layers\[0\]", TRAIN), (".*", None)]))
    batch = (jnp.ones((4, 8)), jnp.ones((4, 4)))
    report = nvfp4x.coverage(lambda m, b: jnp.sum(jax.vmap(m)(b[0])), qmodel, batch)
    assert [r.path for r in report.rows] == ["layers[0]", "layers[1]", "layers[2]"]


@pytest.mark.parametrize(
    "make, shape",
    [
        pytest.param(
            lambda k: eqx.nn.ConvTranspose2d(4, 3, 4, stride=2, padding=1, key=k),
            (2, 4, 5, 5),
            id="convT-k4s2p1",
        ),
        pytest.param(
            lambda k: eqx.nn.Conv1d(8, 8, 3, stride=2, dilation=2, padding=3, groups=8, key=k),
            (2, 8, 19),
            id="depthwise-strided-dilated",
        ),
        pytest.param(  # windows that tile the input: the patches by reshape, not slices
            lambda k: eqx.nn.Conv2d(3, 8, (4, 2), stride=(4, 2), padding=((1, 2), (0, 1)), key=k),
            (2, 3, 10, 9),
            id="patch-embedding",
        ),
    ],
)
def test_the_gemm_is_the_convolution(make, shape):
    """Unquantised operands (`float32()` recipe): the patch GEMM is the convolution, up
    to float32 summation order, for every geometry (padding, dilation, stride, groups).
    (The plain convolution at HIGHEST precision, as the recipe's GEMMs: a TPU's DEFAULT
    multiplies float32 in one bfloat16 pass.)"""
    conv = make(jax.random.key(0))
    f32 = nvfp4x.quantize(conv, FLOAT_CONVS)
    x = normal(3, shape)
    loss = lambda m, x: jnp.sum(jnp.sin(jax.vmap(m)(x)))
    both = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    yq, (gq, gxq) = both(f32, x)
    with jax.default_matmul_precision("highest"):
        y, (g, gx) = both(conv, x)
    assert_close(yq, y, "forward")
    assert_close(gq.weight.array, g.weight, "wgrad")
    assert_close(gxq, gx, "dgrad")


FAST_CASES = [
    pytest.param(
        lambda k: eqx.nn.Conv2d(16, 16, 3, padding=1, key=k), (2, 16, 7, 5), True, id="c16-odd"
    ),
    pytest.param(
        lambda k: eqx.nn.Conv2d(32, 16, 3, stride=2, padding=(1, 2), dilation=2, key=k),
        (2, 32, 9, 11),
        False,
        id="c32-stride-pad-dilation",
    ),
    pytest.param(  # stride 3 reads every third pixel: an inf elsewhere is never read
        lambda k: eqx.nn.Conv1d(48, 16, 1, stride=3, key=k), (3, 48, 10), False, id="c48-unread"
    ),
    pytest.param(  # wgrad skips the chunks where a tap reads nothing (`WgradPlan` compact)
        lambda k: eqx.nn.ConvTranspose2d(32, 16, 4, stride=4, padding=1, groups=2, key=k),
        (2, 32, 2, 9),
        True,
        id="convT-k4s4-groups",
    ),
    pytest.param(  # a U-Net's up-sampling: the taps of a column phase share wgrad's operand
        lambda k: eqx.nn.ConvTranspose2d(16, 3, 2, stride=2, key=k),
        (2, 16, 3, 8),
        True,
        id="convT-k2s2-grouped",
    ),
    pytest.param(  # output rows of 16 pixels: wgrad on shifted copies of dy (`shifts_rows`)
        lambda k: eqx.nn.Conv2d(16, 8, 3, padding=1, key=k), (2, 16, 4, 16), True, id="c16-rows"
    ),
]


@pytest.mark.parametrize("make, shape, eager", FAST_CASES)
def test_the_fast_convolution_is_the_patch_gemm(make, shape, eager):
    """Input channels (per group) a multiple of 16: each 16-element block of a patch is
    one pixel's channels, so the fast path (the input quantised once, real convolutions)
    computes the reference's patch GEMMs (SR on) up to float32 summation order (a code
    or scale that differed would move far more): jitted, fprop and wgrad are bit for
    bit on this CPU, dgrad (the transposed convolution sums the patches' parts in
    another order) and an eager fprop are not."""
    qconv = nvfp4x.quantize(make(jax.random.key(0)), CONVS)
    x = normal(7, shape)
    if len(shape) == 3:
        x = x.at[:, :, 1].set(jnp.inf)  # an unread pixel
    ct = jnp.cos(jnp.arange(math.prod(jax.eval_shape(jax.vmap(qconv), x).shape)))

    def grad(m, x):  # fprop, then wgrad and dgrad of a fixed cotangent
        y, vjp = eqx.filter_vjp(lambda m, x: jax.vmap(m)(x), m, x)
        return y, vjp(ct.reshape(y.shape).astype(y.dtype))

    fast_text = str(jax.make_jaxpr(grad)(qconv, x))
    got = (grad if eager else eqx.filter_jit(grad))(qconv, x)
    with reference_only():
        ref_text = str(jax.make_jaxpr(grad)(qconv, x))
        want = eqx.filter_jit(grad)(qconv, x)
    assert "nvfp4x_conv_qdot[" in fast_text and "nvfp4x_conv_wgrad[" in fast_text
    assert "nvfp4x_conv" not in ref_text
    (y, (gw, gx)), (y0, (gw0, gx0)) = got, want
    assert np.all(np.isfinite(np.asarray(y)))
    assert_close(y, y0, "fprop", rtol=1e-6)
    assert_close(gw.weight.array, gw0.weight.array, "wgrad", rtol=1e-6)
    assert_close(gx, gx0, "dgrad", rtol=1e-6)


WGRAD_CASES = [
    pytest.param(  # ConvTranspose2d k4 s4 padding 1 on two 2x9 images: 408 tokens
        Geometry((4, 4), (1, 1), ((2, 2), (2, 2)), (4, 4), (1, 1), (2, 9)),
        TRAIN,
        "compact",
        id="convT-k4s4-compact",
    ),
    pytest.param(  # k4 s4 on 3x4 images: 16 output pixels a row, the taps of one
        # column phase (4 rows) read the same chunks, one operand for each such group
        Geometry((4, 4), (1, 1), ((3, 3), (3, 3)), (4, 4), (1, 1), (3, 4)),
        TRAIN,
        "grouped",
        id="convT-k4s4-grouped",
    ),
    pytest.param(  # k2 s2 (a U-Net's up-sampling) on 3x8 images, grouped in pairs
        Geometry((2, 2), (1, 1), ((1, 1), (1, 1)), (2, 2), (1, 1), (3, 8)),
        TRAIN,
        "grouped",
        id="convT-k2s2-grouped",
    ),
    pytest.param(  # neighbouring taps read the same chunks; no RHT, nearest rounding
        Geometry((3, 3), (2, 2), ((1, 2), (2, 1)), (1, 1), (2, 2), (9, 11)),
        nvfp4x.recipes.nvfp4_training(rht=False, stochastic_rounding=False),
        "dense",
        id="stride-pad-dilation-dense",
    ),
]


def patch_matrix_operand(plan, operand: Array) -> np.ndarray:
    """The fast wgrad's patch operand in the patch matrix's layout `(chunks x unit,
    window x C)`: a compact one put back at its chunks, zeros elsewhere."""
    operand = np.asarray(operand.astype(jnp.float32))
    if plan.chunks is None:
        return operand
    window, slots = plan.chunks.shape
    c = operand.shape[-1]
    parts = operand.reshape(len(plan.taps), slots, plan.unit, c)  # a group's taps share one
    out = np.zeros((plan.nchunks + 1, plan.unit, window, c), np.float32)
    for group, taps in enumerate(plan.taps):
        for j in taps:
            out[plan.chunks[j], :, j] = parts[group]
    assert not np.any(out[-1]), "a slot without a chunk holds values"
    return out[:-1].reshape(plan.nchunks * plan.unit, window * c)


@pytest.mark.parametrize("geom, recipe, layout", WGRAD_CASES)
def test_the_fast_wgrad_multiplies_the_reference_quantised_operands(geom, recipe, layout):
    """wgrad's patch operand, built from the distinct chunks of the patches (and for a
    transposed convolution only where a tap reads input), is the reference's `Q(H
    patches)` value for value, and `Q(H dy)` and both tensor scales are its own (SR key,
    RHT); the GEMM of a compact plan (tap by tap, or taps that share an operand side
    by side) equals the reference's up to float32
    summation order, and a non-finite `dy` in a chunk some tap skips still gives NaN. (Eagerly and
    vmapped over groups, through the layers: `test_the_fast_convolution_is_the_patch_gemm`.)"""
    x, dy = normal(8, (2, *geom.in_spatial, 16)), normal(9, (2, *geom.out_spatial, 8))
    seed = jnp.array([3, 4], jnp.uint32)
    plan = wgrad_plan(geom, 2, 16)
    compact = layout != "dense"
    assert (plan.chunks is not None) == compact
    assert (compact and plan.taps.shape[1] > 1) == (layout == "grouped")
    fast = lambda dy, x: conv_wgrad_operands(dy, x, seed, recipe=recipe, geom=geom)[1:]
    ref = lambda dy, x: wgrad_quantised(dy, conv_patches(x, geom), seed, recipe)
    want = jax.jit(ref)(dy, x)
    rows = plan.nchunks * plan.unit
    pad = lambda a: np.pad(np.asarray(a.astype(jnp.float32)), [(0, rows - a.shape[0]), (0, 0)])
    g, gs, operand, xs = jax.jit(fast)(dy, x)
    np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), pad(want[0]), "Q(H dy)")
    np.testing.assert_array_equal(patch_matrix_operand(plan, operand), pad(want[2]), "Q(H x)")
    assert_same(gs, want[1], "dy's tensor scale")
    assert_same(xs, want[3], "x's tensor scale")
    if not compact:  # the dense GEMM is the reference's `quantised_dot` on these operands
        return
    run = jax.jit(
        functools.partial(
            conv_wgrad, seed=seed, recipe=recipe, dtype=jnp.dtype(jnp.float32), geom=geom
        )
    )
    for grad in (dy, dy.at[1, -1, -1, 2].set(jnp.inf)):  # the last token: most taps skip it
        gv, gs, xv, xs = (np.asarray(a, np.float64) for a in jax.jit(ref)(grad, x))
        with np.errstate(invalid="ignore"):
            want = gv.T @ xv * (gs * xs)  # the reference's GEMM, in float64
        got = np.asarray(run(grad, x))
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        finite = ~np.isnan(want)
        assert finite.any() and (grad is dy) == finite.all()
        assert_close(got[finite], want[finite], "wgrad", rtol=1e-6)


CANONICAL_CASES = [
    # (geometry, images, k: the residue modulus each distinct chunk's pixels share); the
    # 2-D k4 s4 and k2 s2 layouts take this path in `WGRAD_CASES` too
    pytest.param(  # DCGAN's k4 s2 padding 1: output rows not whole chunks
        Geometry((4, 4), (1, 1), ((2, 2), (2, 2)), (2, 2), (1, 1), (3, 5)), 2, 2, id="k4s2p1"
    ),
    pytest.param(Geometry((4,), (1,), ((3, 3),), (4,), (1,), (11,)), 3, 4, id="1d-k4s4"),
    pytest.param(Geometry((8,), (1,), ((7, 7),), (8,), (1,), (6,)), 2, 8, id="1d-k8s8"),
]


@pytest.mark.parametrize("geom, images, k", CANONICAL_CASES)
def test_the_patch_operand_from_canonical_chunks_is_the_reference(geom, images, k):
    """Where each distinct chunk's pixels lie at one residue modulo `k` (a transposed
    convolution's output phases), wgrad's patch operand is quantised from the canonical
    chunks (`WgradPlan.canon`: each set of pixels once, at residue 0) and put back with
    Sylvester signs: value for value the reference's `Q(H patches)`, on columns that
    take the transform's guarded path too (non-finite, near float32's maximum, tiny,
    subnormal, zero, negative zero), with its tensor scale; and nowhere else."""
    plan = wgrad_plan(geom, images, 16)
    assert plan.canon is not None and plan.source is not None and plan.flips is not None
    assert plan.canon.size < plan.pixels.size  # fewer rows transformed and quantised
    live = plan.pixels.reshape(-1, 16) != images * math.prod(geom.in_spatial)
    residues = [set(np.nonzero(row)[0] % k) for row in live]
    assert all(len(r) <= 1 for r in residues) and any(r - {0} for r in residues)
    x = normal(8, (images, *geom.in_spatial, 16))
    specials = [jnp.inf, -jnp.inf, jnp.nan, 2.0**126, -(2.0**127), 2.0**-110, 1e-41, -0.0, 0.0]
    for c, v in enumerate(specials):  # a special value in one pixel of channel c
        x = x.at[(c % images, *(c % n for n in geom.in_spatial), c)].set(v)
    x = x.at[..., 12].multiply(2.0**-120)  # a whole column tiny
    x = x.at[..., 13].multiply(2.0**124)  # and one big
    dy = normal(9, (images, *geom.out_spatial, 8))
    seed = jnp.array([3, 4], jnp.uint32)
    fast = lambda dy, x: conv_wgrad_operands(dy, x, seed, recipe=TRAIN, geom=geom)[1:]
    ref = lambda dy, x: wgrad_quantised(dy, conv_patches(x, geom), seed, TRAIN)
    want = jax.jit(ref)(dy, x)
    rows = plan.nchunks * plan.unit
    pad = lambda a: np.pad(np.asarray(a.astype(jnp.float32)), [(0, rows - a.shape[0]), (0, 0)])
    _, _, operand, xs = jax.jit(fast)(dy, x)  # (eagerly: through the layers, above)
    np.testing.assert_array_equal(patch_matrix_operand(plan, operand), pad(want[2]))
    assert_same(xs, want[3], "x's tensor scale")
    # Without the transform (or in blocks that span chunks), chunks at other residues
    # hold other values: the distinct chunks are quantised where they lie.
    assert _signs_carry(TRAIN)
    assert not _signs_carry(NO_RHT) and not _signs_carry(nvfp4x.recipes.mxfp8())
    no_rht = lambda dy, x: conv_wgrad_operands(dy, x, seed, recipe=NO_RHT, geom=geom)[3]
    want = jax.jit(lambda dy, x: wgrad_quantised(dy, conv_patches(x, geom), seed, NO_RHT))(dy, x)
    got = patch_matrix_operand(plan, jax.jit(no_rht)(dy, x))
    np.testing.assert_array_equal(got, pad(want[2]))


def test_transposed_and_patch_embedding_steps_lower_for_tpu(monkeypatch):
    """A training step of a `ConvTranspose2d` k4 s4 (wgrad from canonical chunks), of a
    patch embedding (patches by reshape), and of a grouped `ConvTranspose2d` through the
    patch GEMM (`reference_only`: its groups vmap the GEMM, so the fused operand kernel,
    which must run them one at a time), traced for a TPU (its kernels compiled, not
    interpreted) and lowered here, with the Mosaic quantiser's kernel in it (for operands
    this narrow the first two's wgrad transform and quantiser run as XLA's)."""
    monkeypatch.setattr(_kernels, "backend", lambda: "tpu")
    key = jax.random.key(2)
    grouped = eqx.nn.ConvTranspose2d(32, 16, 4, stride=4, padding=1, groups=2, key=key)
    cases = [  # (shapes no other test runs: traces made for a TPU are not reused)
        (eqx.nn.ConvTranspose2d(16, 3, 4, stride=4, key=jax.random.key(0)), (3, 16, 5, 4), None),
        (eqx.nn.Conv2d(3, 16, 4, stride=4, key=jax.random.key(1)), (3, 3, 20, 12), None),
        (grouped, (2, 32, 3, 9), "nvfp4x_operand_tpu"),
    ]
    try:
        for layer, shape, kernel in cases:
            params, static = eqx.partition(nvfp4x.quantize(layer, CONVS), eqx.is_array)
            loss = lambda p, x, s=static: jnp.mean(jax.vmap(eqx.combine(p, s))(x) ** 2)
            x = jax.ShapeDtypeStruct(shape, jnp.float32)
            with reference_only() if kernel else contextlib.nullcontext():
                traced = jax.jit(jax.grad(loss)).trace(params, x)
                text = traced.lower(lowering_platforms=("tpu",)).as_text()
            assert "nvfp4_quantize_tpu" in text, type(layer).__name__
            assert kernel is None or kernel in text, kernel
    finally:
        jax.clear_caches()


NO_RHT = nvfp4x.recipes.nvfp4_training(rht=False)
SHIFTED_CASES = [
    pytest.param(
        Geometry((3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), (1, 1), (5, 16)), TRAIN, id="3x3-pad1"
    ),
    pytest.param(  # a dilated leading axis, a strided last one, uneven padding, 32 wide
        Geometry((3, 2), (1, 2), ((0, 2), (1, 0)), (1, 1), (2, 1), (6, 32)),
        NO_RHT,
        id="dilated-strided-no-rht",
    ),
    pytest.param(  # 3 rows out, dilation 4: input rows 3 and 7 are read by no tap
        Geometry((3, 3), (1, 1), ((0, 0), (1, 1)), (1, 1), (4, 1), (11, 16)),
        TRAIN,
        id="unread-rows",
    ),
    pytest.param(
        Geometry((2, 3, 3), (1, 1, 1), ((1, 0), (1, 1), (1, 1)), (1, 1, 1), (1, 2, 1), (3, 4, 16)),
        NO_RHT,
        id="3d-no-rht",
    ),
]


@pytest.mark.parametrize("geom, recipe", SHIFTED_CASES)
def test_the_shifted_wgrad_multiplies_the_reference_quantised_operands(geom, recipe):
    """A convolution whose output rows are whole 16-token chunks and whose leading axes
    have stride 1 (`shifts_rows`): wgrad quantises the input once per tap of the last
    axis and pairs it with `Q(H dy)` placed at each leading tap's rows. Mapped back to
    the patch matrix, the operands are the reference's value for value (RHT, SR key,
    both tensor scales; rows no tap reads count in no amax), the GEMM equals the
    reference's up to float32 summation order, and a non-finite `dy` gives NaN where
    the reference does."""
    assert shifts_rows(geom, 16)
    x, dy = normal(8, (2, *geom.in_spatial, 16)), normal(9, (2, *geom.out_spatial, 8))
    x = x.at[0, 3].set(1e4) if geom.rhs_dilation[0] == 4 else x  # an unread row, largest
    seed = jnp.array([3, 4], jnp.uint32)
    ref = jax.jit(lambda dy, x: wgrad_quantised(dy, conv_patches(x, geom), seed, recipe))
    fast = jax.jit(lambda dy, x: shifted_wgrad_operands(dy, x, seed, recipe=recipe, geom=geom))
    gv, gs, pv, ps = ref(dy, x)
    g, gs2, q, ps2 = fast(dy, x)
    assert_same(gs2, gs, "dy's tensor scale")
    assert_same(ps2, ps, "x's tensor scale")
    # `q` and `g` back in the patch matrix's layout: tap (i, j) of output row h reads
    # `q`'s tap j at padded row h + i x dilation, where `g` holds dy's row h for tap i.
    out, lead = geom.out_spatial, geom.window[:-1]
    padded = [o + (k - 1) * d for o, k, d in zip(out[:-1], lead, geom.rhs_dilation, strict=False)]
    q = np.asarray(q.astype(jnp.float32)).reshape(2, *padded, out[-1], geom.window[-1], 16)
    g = np.asarray(g.astype(jnp.float32)).reshape(2, *padded, out[-1], math.prod(lead), 8)
    patches = np.zeros((2, *out, *geom.window, 16), np.float32)
    for t, offset in enumerate(itertools.product(*(range(k) for k in lead))):
        rows = tuple(
            slice(i * d, i * d + o) for i, d, o in zip(offset, geom.rhs_dilation, out, strict=False)
        )
        patches[(slice(None), ..., *offset, slice(None), slice(None))] = q[(slice(None), *rows)]
        np.testing.assert_array_equal(
            g[(slice(None), *rows, slice(None), t)].reshape(-1, 8),
            np.asarray(gv.astype(jnp.float32)),
            f"Q(H dy) at tap {offset}'s rows",
        )
        zeros = np.ones(g.shape[:-2], bool)
        zeros[(slice(None), *rows)] = False
        assert not np.any(g[..., t, :][zeros]), "dy placed outside its tap's rows"
    want_p = np.asarray(pv.astype(jnp.float32))
    np.testing.assert_array_equal(patches.reshape(want_p.shape), want_p, "Q(H x)")
    run = jax.jit(
        lambda dy, x: shifted_wgrad(
            dy, x, seed, recipe=recipe, dtype=jnp.dtype(jnp.float32), geom=geom
        )
    )
    for grad in (dy, dy.at[1, -1, -1, 2].set(jnp.inf)):
        gv, gs, pv, ps = (np.asarray(a, np.float64) for a in ref(grad, x))
        with np.errstate(invalid="ignore"):
            want = gv.T @ pv * (gs * ps)  # the reference's GEMM, in float64
        got = np.asarray(run(grad, x))
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        if grad is dy:
            assert_close(got, want, "wgrad", rtol=1e-6)


def test_only_whole_rows_with_unit_leading_strides_shift():
    """`shifts_rows` holds exactly where its pairing is the patch GEMM's."""
    base = dict(
        window=(3, 3), strides=(1, 1), padding=((1, 1), (1, 1)),
        lhs_dilation=(1, 1), rhs_dilation=(1, 1), in_spatial=(4, 16),
    )  # fmt: skip
    assert shifts_rows(Geometry(**base), 16)
    assert shifts_rows(Geometry(**base), 1)
    for change in (
        dict(in_spatial=(4, 12)),  # rows of 12 tokens: chunks straddle rows
        dict(strides=(2, 1)),  # a leading stride
        dict(lhs_dilation=(2, 2)),  # transposed: `WgradPlan`'s compact layout
        dict(window=(1, 3)),  # no leading taps to share chunks
    ):
        assert not shifts_rows(Geometry(**{**base, **change}), 16), change
    assert not shifts_rows(Geometry((3,), (1,), ((1, 1),), (1,), (1,), (16,)), 16)


PIXEL_SHUFFLES = [((4, 4), (3, 5)), ((4,), (7,)), ((2, 3, 2), (2, 3, 2))]


@pytest.mark.parametrize("window, spatial", PIXEL_SHUFFLES)
def test_a_transposed_convolution_whose_kernel_is_its_stride_is_one_gemm(window, spatial):
    """`Geometry.conv` where `pixel_shuffle` (a GEMM over the channels, its outputs put in
    place) and its transpose (dgrad) give the convolution's and its transpose's values
    up to float32 summation order; padding or output padding make it a plain
    convolution again."""
    nsp = len(window)
    geom = Geometry(
        window, (1,) * nsp, tuple((w - 1, w - 1) for w in window), window, (1,) * nsp, spatial
    )
    assert geom.pixel_shuffle
    padded = dataclasses.replace(geom, padding=((window[0] - 2, window[0] - 1),) + geom.padding[1:])
    assert not padded.pixel_shuffle  # (ConvTranspose's padding=1 or output_padding)
    a, kernel = normal(0, (2, *spatial, 5)), normal(1, (3, *window, 5))
    spec = (0, nsp + 1, *range(1, nsp + 1))
    dn = lax.ConvDimensionNumbers(spec, spec, spec)
    hi = lax.Precision.HIGHEST

    def plain(x):
        return lax.conv_general_dilated(
            x, kernel, geom.strides, geom.padding, window, geom.rhs_dilation, dn, precision=hi
        )

    shuffled = jax.jit(lambda x: geom.conv(x, kernel, hi, jnp.float32))
    assert_close(shuffled(a), jax.jit(plain)(a), "the convolution", rtol=1e-6)
    ct = normal(2, (2, *geom.out_spatial, 3))
    (got,) = jax.jit(jax.linear_transpose(shuffled, a))(ct)
    (want,) = jax.jit(jax.linear_transpose(plain, a))(ct)
    assert_close(got, want, "its transpose", rtol=1e-6)


def test_a_grouped_convolution_is_one_problem_per_group():
    conv = eqx.nn.Conv2d(8, 4, 3, groups=2, use_bias=False, key=jax.random.key(0))
    x = normal(4, (2, 8, 6, 6))
    alone = [  # each group quantised alone: its own tensor and block scales
        eqx.tree_at(
            lambda m: m.weight,
            eqx.nn.Conv2d(4, 2, 3, use_bias=False, key=jax.random.key(0)),
            conv.weight[2 * g : 2 * g + 2],
        )
        for g in range(2)
    ]

    @jax.jit
    def run(grouped, alone, x):
        y = jax.vmap(grouped)(x)
        return y, [jax.vmap(a)(x[:, 4 * g : 4 * g + 4]) for g, a in enumerate(alone)]

    y, want = run(nvfp4x.quantize(conv, CONVS), nvfp4x.quantize(alone, CONVS), x)
    for g in range(2):
        assert_close(y[:, 2 * g : 2 * g + 2], want[g], f"group {g}", rtol=1e-6)


def test_freeze_packs_kernels_as_trained_and_equals_the_unfrozen_forward():
    qmodel = nvfp4x.quantize(TinyUNet(jax.random.key(0)), CONVS)
    frozen = nvfp4x.freeze(qmodel)
    assert frozen.down.weight.packed.shape == (16, 27)  # (out, in x window)
    assert frozen.mid.weight.packed.shape == (4, 4, 36)  # one matrix per group
    assert frozen.up.weight.shape == qmodel.up.weight.array.shape
    run = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    assert_same_sums(run(frozen, X), run(qmodel, X), "frozen U-Net")
    # the decoded kernel is the trained kernel's quantised values, in the kernel's shape
    decoded = np.asarray(frozen.down.weight)
    assert decoded.shape == (16, 3, 3, 3)
    assert_close(decoded, qmodel.down.weight.array, "decoded kernel", rtol=0.2)


class _MambaBlock(eqx.Module):
    """A Mamba-style block over `(channels, tokens)`: a causal depthwise `eqx.nn.Conv1d`,
    then a linear, and a user's short convolution on `(tokens, channels)`."""

    conv: eqx.nn.Conv1d
    short: ShortConv
    out: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.conv = eqx.nn.Conv1d(32, 32, 4, padding=((3, 0),), groups=32, key=k[0])
        self.short = ShortConv(32, 4, k[1])
        self.out = eqx.nn.Linear(32, 32, key=k[2])

    def __call__(self, x):
        h = jax.nn.silu(self.conv(x)).T
        return x + jax.vmap(self.out)(self.short(h)).T


class _ScannedStack(eqx.Module):
    """Blocks built by `eqx.filter_vmap` and run by `lax.scan`, as Mamba ports do."""

    layers: _MambaBlock

    def __init__(self, key):
        self.layers = eqx.filter_vmap(_MambaBlock)(jax.random.split(key, 3))

    def __call__(self, x):
        params, static = eqx.partition(self.layers, eqx.is_array)
        body = lambda h, p: (eqx.combine(p, static)(h), None)
        return lax.scan(body, x, params)[0]


def test_stacked_convolutions_scanned_train_and_freeze_as_trained():
    # Each slice's kernel keeps its roles (out, in, window): the stack's axis is not one.
    qmodel = nvfp4x.quantize(_ScannedStack(jax.random.key(0)), CONVS)
    for w in (qmodel.layers.conv.weight, qmodel.layers.short.weight):
        assert w.kernel_axes == (0, 1, 2) and w.stack_shape == (3,) and w.groups == 32
    x = normal(1, (32, 24))
    loss = lambda m: jnp.sum(m(x) ** 2)
    jaxpr = str(jax.make_jaxpr(jax.grad(loss))(qmodel))
    assert jaxpr.count("nvfp4x_qdot[") == 3  # the body's three fprops, scanned once
    g = eqx.filter_jit(eqx.filter_grad(loss))(qmodel)
    assert np.all(np.isfinite(g.layers.conv.weight.array))
    assert float(jnp.abs(g.layers.short.weight.array).max()) > 0
    frozen = nvfp4x.freeze(qmodel)
    run = eqx.filter_jit(lambda m: m(x))
    assert_same_sums(run(frozen), run(qmodel), "frozen scanned convolutions")


def test_telemetry_runs_on_convolutions():
    k = jax.random.split(jax.random.key(0), 2)
    model = eqx.nn.Sequential(
        [
            eqx.nn.Conv2d(3, 8, 3, padding=1, groups=1, key=k[0]),
            eqx.nn.ConvTranspose2d(8, 4, 2, stride=2, groups=2, key=k[1]),
        ]
    )
    qmodel = nvfp4x.telemetry.enable(nvfp4x.quantize(model, CONVS))
    assert qmodel.layers[0].weight.probe.shape == (5, 4)
    assert qmodel.layers[1].weight.probe.shape == (2, 5, 4)  # one per feature group
    grads = eqx.filter_jit(eqx.filter_grad(unet_loss))(qmodel, X)
    stats = nvfp4x.telemetry.collect(grads)
    assert set(stats) == {"layers[0]", "layers[1]"}
    assert stats["layers[1]"]["fprop_x"]["amax"].shape == (2,)
    for path, table in stats.items():
        for op, row in table.items():
            assert np.all(np.asarray(row["amax"]) > 0), (path, op)
            assert np.all(np.isfinite(np.asarray(row["sqnr_db"]))), (path, op)


def test_a_user_conv_module_is_a_convolution_however_it_is_written():
    model = Mixer(jax.random.key(0))
    qmodel = nvfp4x.quantize(model, TRAIN)  # the default: convolutions left alone
    assert isinstance(qmodel.conv.weight, jax.Array)
    assert isinstance(qmodel.proj_in.weight, nvfp4x.QWeight)
    jax.eval_shape(qmodel, TOKENS)  # no refusal
    with pytest.warns(UserWarning, match=r"convolutions \(`\[0\]`.*convolutions=True"):
        nvfp4x.quantize([ShortConv(8, 4, jax.random.key(1))], TRAIN)
    qmodel = nvfp4x.quantize(model, nvfp4x.Policy([("conv", TRAIN)], convolutions=True))
    assert qmodel.conv.weight.kernel_axes == (0, 1, 2) and qmodel.conv.weight.groups == 32
    text = str(jax.make_jaxpr(jax.grad(lambda m: jnp.sum(m(TOKENS) ** 2)))(qmodel))
    assert count(text, "nvfp4x_qdot") == 1 and count(text, "nvfp4x_wgrad") == 1
    assert "conv_general_dilated" not in text
    frozen = nvfp4x.freeze(qmodel)
    assert frozen.conv.weight.packed.shape == (32, 1, 4)  # depthwise: 32 groups of (1, 4)
    run = eqx.filter_jit(lambda m, x: m(x))
    assert_same_sums(run(frozen, TOKENS), run(qmodel, TOKENS), "frozen mixer")


class Untraceable(eqx.Module):
    """A conv module whose call takes two arguments: nvfp4x cannot trace it to tell."""

    weight: Array

    def __call__(self, x, scale):
        return scale * lax.conv_general_dilated(x[None], self.weight, (1,), "SAME")[0]


def test_a_kernel_selected_as_a_linear_weight_is_refused_by_name():
    qmodel = nvfp4x.quantize([Untraceable(normal(5, (4, 4, 3)))], TRAIN)
    with pytest.raises(ValueError, match=r"`\[0\]` was selected as a linear layer's weight"):
        qmodel[0](normal(6, (4, 10)), 2.0)
