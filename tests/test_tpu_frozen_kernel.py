"""The TPU frozen GEMM kernel (`nvfp4x._kernels._tpu_frozen_gemm`, Pallas Mosaic: packed
NVFP4 weight tiles decoded in VMEM, multiplied on the MXU) against the reference frozen
forward, and its choice.

Off a TPU the kernel runs in Pallas's TPU interpreter (reads past an array's end give
NaN there, so an unmasked overhang shows); on a TPU the same tests run it compiled.
Each interpreted configuration costs seconds to compile, so few cases cover the edges
together: 1 token (padded to 16), 17 tokens (two tiles of tokens), a weight smaller than
a tile (padded) and one that overhangs the tiles in both directions (outputs and a
contraction that is not a multiple of 16 nor of the tile's depth), 1x16 blocks and 16x16
tiles, float32 and bfloat16 activations, NaN blocks and infinite activations; then
`FrozenLinear` stacks with the kernel picked, eagerly, under `jax.lax.scan` (jit) and
`jax.vmap` over the stack, W4A16 and W4A4; frozen experts (`ragged_dot`) at a few
tokens, every expert by the kernel, alone and stacked. It also lowers for TPUs here
with the default tiles and every tile the device sweep times, and a frozen experts'
program with the kernel.

Equality is `tests/test_frozen_kernel.py`'s: exact products, float32 summation order
only (`check_close`).
"""

import dataclasses
import functools
import itertools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Stack, assert_same_bits
from test_frozen_kernel import activations, check_close, reference, weight

import nvfp4x
from nvfp4x import _kernels, _prims, _ragged
from nvfp4x._formats import quantize_operand
from nvfp4x._kernels import _tpu_frozen_gemm
from nvfp4x._kernels._tpu_frozen_gemm import Tiles
from nvfp4x._numerics._constants import E2M1_VALUES
from nvfp4x._numerics._pack import decode_e4m3

INTERPRET = jax.default_backend() != "tpu"


def test_decoders_equal_the_reference_for_every_pattern():
    """The kernel's E4M3 scale decoder (halved) and E2M1 lookup (doubled), for every bit
    pattern and every nibble position of a word."""
    bits = jnp.arange(256, dtype=jnp.int32)
    got = np.asarray(jax.jit(_tpu_frozen_gemm.half_scales)(bits))
    want = np.asarray(decode_e4m3(bits.astype(jnp.uint8))) / 2
    np.testing.assert_array_equal(got, want)  # (NaN where the reference's is)
    codes = jnp.arange(16, dtype=jnp.int32)
    e2m1 = np.array([*E2M1_VALUES, *(-v for v in E2M1_VALUES)], np.float32)
    for shift in range(0, 32, 4):
        words = (codes << shift) | (0x5A5A5A5A & ~(0xF << shift))  # other nibbles busy
        got = np.asarray(_tpu_frozen_gemm.double_e2m1(words, shift))
        np.testing.assert_array_equal(got, 2 * e2m1)
        np.testing.assert_array_equal(np.signbit(got), np.arange(16) >= 8)  # -0.0 too


CASES = {
    # name: (block, tokens, out, in, operand, tiles)
    "1x16_1_token_float32_small_weight": ((1, 16), 1, 40, 100, "float32", None),
    "16x16_17_tokens_bfloat16_overhangs": (
        (16, 16),
        17,
        600,
        2100,
        "bfloat16",
        Tiles(16, 512, 2048),
    ),
    # the many-token layout (interleaves in VMEM): two tiles of 128 tokens, two of
    # features, 16x16 tiles, three bfloat16 parts
    "16x16_130_tokens_float32_wide": ((16, 16), 130, 520, 100, "float32", Tiles(128, 512, 2048)),
}


#: The layouts each case runs in: the default one (None: "pairs" at a few tokens), and
#: "planes", "chunks" (the planes decoded and multiplied a `CHUNK` at a time) and
#: "pairs" (as "chunks", a byte's two nibbles packed into one bfloat16 chunk) on the
#: few-token cases.
LAYOUTS = [(name, None) for name in CASES] + [
    (name, layout)
    for layout in ("planes", "chunks", "pairs")
    for name in ("1x16_1_token_float32_small_weight", "16x16_17_tokens_bfloat16_overhangs")
]


def case_matmul(name: str, **options):
    """`CASES[name]`'s kernel call (`frozen_matmul` with its block, size, operand and
    tiles, interpreted off a TPU, and `options`) and its activations (infinities in the
    first and last tokens)."""
    block, m, n, k, operand, tiles = CASES[name]
    x = activations(m, k, jnp.bfloat16 if operand == "bfloat16" else jnp.float32, inf=True)
    mm = functools.partial(
        _tpu_frozen_gemm.frozen_matmul,
        block=block,
        n=n,
        operand=operand,
        tiles=tiles,
        interpret=INTERPRET,
        **options,
    )
    return mm, x


@pytest.mark.parametrize(
    "name, layout", LAYOUTS, ids=[f"{n}-{layout or 'default'}" for n, layout in LAYOUTS]
)
def test_kernel_equals_reference(name, layout):
    block, m, n, k, operand, tiles = CASES[name]
    q = weight(n, k, block, nan=True)
    mm, x = case_matmul(name, layout=layout)
    got = mm(x, q.codes, q.scale_bits)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    check_close(got, reference(x, q, operand), x, q.operand()[0], k)
    # the NaN blocks and infinite activations reach the outputs (finite ones too, with
    # more than one token: the infinities are in the first and last tokens)
    assert np.isnan(np.asarray(got)).any() and np.isinf(np.asarray(got)).any()
    assert m == 1 or np.isfinite(np.asarray(got)[1:-1]).mean() > 0.5


@pytest.fixture
def kernel_calls(monkeypatch):
    """The operands of every call of the kernel (a spy)."""
    calls = []
    kernel = _tpu_frozen_gemm.frozen_matmul

    def spy(*args, **kwargs):
        calls.append(kwargs["operand"])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(_tpu_frozen_gemm, "frozen_matmul", spy)
    return calls


def _stack(recipe, d=40, nlayers=2):
    stack = Stack(d, nlayers, jax.random.key(4))
    return nvfp4x.freeze(nvfp4x.quantize(stack, recipe)).layers


def _per_layer(layers, x, mode):
    """Each layer of the stack on `x` (not chained: a layer's inputs stay the same, so
    the check bounds one GEMM), by `jax.lax.scan` under jit or `jax.vmap` over it."""
    params, static = eqx.partition(layers, eqx.is_array)
    if mode == "scan":
        body = lambda c, p: (c, eqx.combine(p, static)(x))
        return jax.jit(lambda p: jax.lax.scan(body, 0, p)[1])(params)
    return jax.vmap(lambda p: eqx.combine(p, static)(x))(params)


@pytest.mark.parametrize("mode", ["scan", "vmap"])
def test_frozen_stack_runs_the_kernel(mode, kernel_calls):
    """W4A16 (`nvfp4_weight_only`) stacks, float32 activations: each slice's GEMM runs the
    kernel (the spy counts the traces) and equals the reference forward's."""
    layers = _stack(nvfp4x.recipes.nvfp4_weight_only())
    x = activations(16, 40, jnp.float32)
    with _kernels.use("frozen_gemm", "xla"):
        want = _per_layer(layers, x, mode)
    assert kernel_calls == []
    with _kernels.use("frozen_gemm", "mosaic"):
        got = _per_layer(layers, x, mode)
    assert kernel_calls and set(kernel_calls) == {"float32"}
    w = layers.weight.packed
    wv = w.operand()[0]  # (layers, out, in) block values
    for i in range(w.shape[0]):
        check_close(got[i], want[i], x, wv[i], 40, scale=w.tensor_scale[i])


def test_frozen_layer_w4a4_eager(kernel_calls):
    """A W4A4 layer (`nvfp4_inference`) called eagerly: its activations quantised by the
    existing quantiser, their bfloat16 values fed to the kernel."""
    lin = eqx.nn.Linear(100, 40, key=jax.random.key(3))
    frozen = nvfp4x.freeze(nvfp4x.quantize(lin, nvfp4x.recipes.nvfp4_inference()))
    x = activations(3, 100, jnp.float32)
    with _kernels.use("frozen_gemm", "xla"):
        want = frozen(x)
    with _kernels.use("frozen_gemm", "mosaic"):
        got = frozen(x)
    assert kernel_calls == ["bfloat16"]
    w = frozen.weight.packed
    xv, xs = quantize_operand(x, frozen.recipe.input, axis=-1)
    assert xs is not None
    check_close(got, want, xv, w.operand()[0], 100, scale=xs * w.tensor_scale)


def test_default_on_tpus_only():
    assert _kernels.pick("frozen_gemm", "tpu") == "mosaic"  # measured there: `_kernels`
    assert _kernels.pick("frozen_gemm", "cpu") == "xla"
    assert _kernels.pick("frozen_gemm", "gpu") == "xla"
    codes, scale_bits = jnp.zeros((32, 32), jnp.uint8), jnp.zeros((32, 4), jnp.uint8)
    args = (codes, scale_bits, (1, 16), (32, 64))
    assert _kernels.frozen_gemm(jnp.ones((2, 64), jnp.int32), *args, "mosaic") is None
    assert _kernels.frozen_gemm(jnp.ones((0, 64)), *args, "mosaic") is None


def test_bad_tiles_raise():
    for tiles in (Tiles(8, 512, 2048), Tiles(16, 256, 2048), Tiles(16, 512, 1024)):
        with pytest.raises(ValueError, match="`tiles`"):
            _tpu_frozen_gemm.check_tiles(tiles)
    x = jnp.ones((2, 64), jnp.bfloat16)
    codes, scale_bits = jnp.zeros((32, 32), jnp.uint8), jnp.zeros((32, 4), jnp.uint8)
    with pytest.raises(ValueError, match="not the packed layout"):
        _tpu_frozen_gemm.frozen_matmul(
            x, codes[:, :16], scale_bits, block=(1, 16), n=32, operand="bfloat16"
        )


#: `(tiles, block, operand, (out, in))`: the default tiles in both layouts and operands,
#: on weights that fit the tiles and ones that overhang them; every swept tile.
LOWERED = [
    (tiles, block, operand, shape)
    for _, tiles in _tpu_frozen_gemm.DEFAULT_TILES
    for block in ((1, 16), (16, 16))
    for operand, shape in (("bfloat16", (8192, 8192)), ("float32", (8200, 8200)))
] + [
    (tiles, (1, 16), "bfloat16", (8192, 8192))
    for bucket in _tpu_frozen_gemm.SWEEP_TILES.values()
    for tiles in bucket
]
#: The few-token layouts named explicitly ("planes", "chunks", "pairs"): the few-token
#: default tiles, both blocks and operands, a weight that overhangs the tiles.
LOWERED_CHUNKS = [
    (tiles, block, operand, (8200, 8200))
    for most, tiles in _tpu_frozen_gemm.DEFAULT_TILES
    if most is not None and most <= 16
    for block in ((1, 16), (16, 16))
    for operand in ("bfloat16", "float32")
]


def test_kernel_lowers_for_tpu():
    """Mosaic lowering (on this machine; Mosaic's own compile runs on a TPU) of the
    default tiles (both block layouts and operands, weights that fit and overhang, tokens
    over a tile), of every tile the sweep times, and of each few-token layout by name."""
    cases = [(*c, None) for c in LOWERED]
    cases += [(*c, layout) for c in LOWERED_CHUNKS for layout in ("planes", "chunks", "pairs")]
    for tiles, block, operand, (n, k), layout in cases:
        rows = n if block == (1, 16) else -(-n // 16) * 16
        dtype = jnp.bfloat16 if operand == "bfloat16" else jnp.float32
        args = (
            jax.ShapeDtypeStruct((tiles.tokens + 1, k), dtype),
            jax.ShapeDtypeStruct((rows, -(-k // 16) * 8), jnp.uint8),
            jax.ShapeDtypeStruct((rows // block[0], -(-k // 16)), jnp.uint8),
        )
        fn = functools.partial(
            _tpu_frozen_gemm.frozen_matmul,
            block=block,
            n=n,
            operand=operand,
            tiles=tiles,
            layout=layout,
        )
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
        name = "nvfp4_frozen_matmul_tpu" + (f"_{layout}" if layout in ("chunks", "pairs") else "")
        assert name in text, (tiles, block, operand, layout)


def test_attribution_variants_lower_for_tpu():
    """`benchmarks/tpu_frozen_check.py --attribute`'s diagnostic kernels lower for a TPU
    (1 and 16 tokens' tiles, both weight blocks), and `--dma`'s (every tile, uint8 and
    uint32 codes, one DMA or 4 per tile), so that a device call is not spent on
    an error the CPU can show."""
    from benchmarks import tpu_frozen_check

    for tokens in (1, 16):
        tiles = _tpu_frozen_gemm.default_tiles(tokens)
        for block in ((1, 16), (16, 16)):
            args = (
                jax.ShapeDtypeStruct((tokens, 4096), jnp.bfloat16),
                jax.ShapeDtypeStruct((4096, 2048), jnp.uint8),
                jax.ShapeDtypeStruct((4096 // block[0], 256), jnp.uint8),
            )
            for variant in tpu_frozen_check.ATTRIBUTION:
                fn = functools.partial(
                    tpu_frozen_check.attribution_matmul, block=block, variant=variant, tiles=tiles
                )
                lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",))
                assert "frozen_attribution_" in lowered.as_text(), (tokens, block, variant)
    scales = jax.ShapeDtypeStruct((8192, 512), jnp.uint8)
    for dtype, per in ((jnp.uint8, 2), (jnp.uint32, 8)):
        codes = jax.ShapeDtypeStruct((8192, 8192 // per), dtype)
        for (features, depth), split in itertools.product(tpu_frozen_check.DMA_TILES, (1, 4)):
            fn = functools.partial(
                tpu_frozen_check.dma_read, features=features, depth=depth, split=split
            )
            lowered = jax.jit(fn).trace(codes, scales).lower(lowering_platforms=("tpu",))
            assert "frozen_dma_probe" in lowered.as_text(), (dtype, features, depth, split)


@pytest.mark.slow
def test_device_check_smoke(tmp_path):
    """`benchmarks/tpu_frozen_check.py --smoke` (tiny shapes, interpreted off a TPU):
    its check passes and it writes its table; `--smoke --dma` times every read pattern
    without an error."""
    from benchmarks import tpu_frozen_check

    out = tmp_path / "tpu_frozen.md"
    rows = tpu_frozen_check.main(["--smoke", "--out", str(out)])
    values = {what: value for what, value, _ in rows.rows}
    assert values["check W4A4 float32 activations, 1 tokens"] == "ok"
    assert "**error**" not in values.values()
    assert "| W4A4 float32 activations (mosaic), 1 tokens |" in out.read_text()
    assert values["one jitted call of nothing"].endswith(" ms")
    # `--dma`: every read pattern, each call taking the last one's result (`--inner`).
    dma_rows = tpu_frozen_check.main(["--smoke", "--dma"]).rows
    assert len(dma_rows) == 11  # (one tile at d=512; three whole-layer reads)
    assert not [what for what, value, _ in dma_rows if value == "**error**"]


def test_tiles_fit_the_vmem_budget():
    """Float32 activations (three bfloat16 parts) at the default many-token tile would
    bound 83.5 MiB of VMEM: a program takes 512 tokens (grid 8 x 4 x 4 for 4096 x 8192
    by 8192), bfloat16 ones keep 1024 (grid 4 x 4 x 4)."""
    shapes = ((8192, 4096), jnp.uint8), ((8192, 512), jnp.uint8)
    weight = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    for operand, grid in (("float32", "(8, 4, 4)"), ("bfloat16", "(4, 4, 4)")):
        x = jax.ShapeDtypeStruct((4096, 8192), getattr(jnp, operand))
        mm = functools.partial(
            _tpu_frozen_gemm.frozen_matmul, block=(1, 16), n=8192, operand=operand
        )
        assert f"grid={grid}" in str(jax.make_jaxpr(mm)(x, *weight)), operand


@pytest.mark.parametrize(
    "name", ["1x16_1_token_float32_small_weight", "16x16_130_tokens_float32_wide"]
)
def test_a_layer_of_a_stack_by_its_index(name):
    """`layer=`: the kernel reads one layer's tiles from stacked codes and scales by an
    index (prefetched, in the index maps): bit for bit the call on that layer's arrays,
    eagerly and under `jit` with a traced index, an index past either end clipped as
    `lax.dynamic_index_in_dim` clips it; a 2-D weight with an index is refused."""
    block, _, n, k, _, _ = CASES[name]
    other = nvfp4x.to_nvfp4(jax.random.normal(jax.random.key(5), (n, k)), block=block)
    layers = [weight(n, k, block), weight(n, k, block, nan=True), other]
    codes = jnp.stack([q.codes for q in layers])
    bits = jnp.stack([q.scale_bits for q in layers])
    mm, x = case_matmul(name)
    by_index = jax.jit(lambda x, c, s, i: mm(x, c, s, layer=i))
    for index, want_layer in ((1, 1), (-4, 0), (7, 2)):
        want = np.asarray(mm(x, layers[want_layer].codes, layers[want_layer].scale_bits))
        if index == 1:  # (eagerly, with a Python index, once)
            assert_same_bits(np.asarray(mm(x, codes, bits, layer=index)), want)
        assert_same_bits(np.asarray(by_index(x, codes, bits, jnp.int32(index))), want)
    with pytest.raises(ValueError, match="stacked `codes` and `scale_bits`"):
        mm(x, layers[0].codes, layers[0].scale_bits, layer=0)


@pytest.mark.parametrize(
    "name, layout",
    [
        ("16x16_17_tokens_bfloat16_overhangs", "planes"),
        ("16x16_17_tokens_bfloat16_overhangs", "pairs"),
        ("16x16_130_tokens_float32_wide", None),
    ],
)
def test_tile_scales_expanded_in_the_kernel(name, layout):
    """`tile_scales="kernel"` (the default): 16x16 tiles' scale bits go in as they are
    stored (one row per 16 weight rows) and each step expands its tile of them in VMEM:
    bit for bit the
    call that expands them before it (`jnp.repeat`, an eighth of the codes' bytes written
    and read again per call), in each layout, for a layer of a stack too; the program
    around the kernel makes no expanded copy of the scales, and it lowers for a TPU."""
    block, _, n, k, _, tiles = CASES[name]
    q = weight(n, k, block, nan=True)
    mm, x = case_matmul(name, layout=layout)
    want = np.asarray(mm(x, q.codes, q.scale_bits, tile_scales="caller"))
    assert_same_bits(np.asarray(mm(x, q.codes, q.scale_bits)), want)  # (the default)
    if layout == "pairs":  # a layer of a stack: its scales read by the index too
        stack = [jnp.stack([jnp.zeros_like(a), a]) for a in (q.codes, q.scale_bits)]
        got = mm(x, *stack, tile_scales="kernel", layer=1)
        assert_same_bits(np.asarray(got), want)
        # and the feature chunks' loop not unrolled (the default: wholly) or by 2
        for unroll in (1, 2):
            got = mm(x, q.codes, q.scale_bits, unroll=unroll)
            assert_same_bits(np.asarray(got), want)
    with pytest.raises(ValueError, match="tile_scales"):
        mm(x, q.codes, q.scale_bits, tile_scales="xla")
    if layout == "planes":  # (a chunk size or unrolling for a layout that does not chunk)
        with pytest.raises(ValueError, match="chunk_rows=256.*'planes'"):
            mm(x, q.codes, q.scale_bits, chunk_rows=256)
        with pytest.raises(ValueError, match="unroll=True.*'planes'"):
            mm(x, q.codes, q.scale_bits, unroll=True)
    lower = functools.partial(mm, interpret=False)
    text = jax.jit(functools.partial(lower, tile_scales="kernel")).trace(x, q.codes, q.scale_bits)
    assert "nvfp4_frozen_matmul_tpu" in text.lower(lowering_platforms=("tpu",)).as_text()

    def expanded_copies(tile_scales: str) -> list:
        """The uint8 arrays of the expanded scales' shape `(rows, k/16)` or larger that the
        program around the kernel (not the kernel's body) makes."""
        shapes = []

        def walk(jp):
            for eqn in jp.eqns:
                shapes.extend(v.aval.shape for v in eqn.outvars if v.aval.dtype == jnp.uint8)
                if eqn.primitive.name != "pallas_call":
                    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                        walk(sub)

        fn = functools.partial(lower, tile_scales=tile_scales)
        walk(jax.make_jaxpr(fn)(x, q.codes, q.scale_bits).jaxpr)
        widths = (-(-k // 16), tiles.depth // 16)  # the scales', as stored or padded
        return [
            sh for sh in shapes if len(sh) == 2 and sh[0] >= q.codes.shape[0] and sh[1] in widths
        ]

    assert expanded_copies("caller") and not expanded_copies("kernel")


def test_a_scan_over_a_stack_by_index_copies_no_layer():
    """Under `lax.scan` over layer indices, with the stack whole, the TPU program holds
    no slice of the stacked codes (a scan over the stack itself copies each layer's
    slice before the custom call: 0.41 ms of a 0.69 ms read of 4 layers of 8192x8192,
    seen on a TPU v5e)."""
    n = k = 8192
    codes = jax.ShapeDtypeStruct((4, n, k // 2), jnp.uint8)
    bits = jax.ShapeDtypeStruct((4, n, k // 16), jnp.uint8)
    x = jax.ShapeDtypeStruct((1, k), jnp.bfloat16)
    mm = functools.partial(_tpu_frozen_gemm.frozen_matmul, block=(1, 16), n=n, operand="bfloat16")

    def by_index(x, c, s):
        step = lambda h, i: (mm(h, c, s, layer=i).astype(h.dtype), None)  # noqa: E731
        return jax.lax.scan(step, x, jnp.arange(4))[0]

    def by_slice(x, c, s):
        step = lambda h, cs: (mm(h, *cs).astype(h.dtype), None)  # noqa: E731
        return jax.lax.scan(step, x, (c, s))[0]

    for fn, copies in ((by_index, False), (by_slice, True)):
        text = jax.jit(fn).trace(x, codes, bits).lower(lowering_platforms=("tpu",)).as_text()
        sliced = re.findall(r"dynamic_slice[^\n]*tensor<4x8192x4096xui8>", text)
        assert bool(sliced) == copies, fn.__name__
    # The many-token layout and 16x16 tiles (their scales sliced and expanded) lower too.
    tiles16 = jax.ShapeDtypeStruct((4, n // 16, k // 16), jnp.uint8)
    x256 = jax.ShapeDtypeStruct((256, k), jnp.float32)
    mm16 = functools.partial(_tpu_frozen_gemm.frozen_matmul, block=(16, 16), n=n, operand="float32")
    lowered = jax.jit(lambda x, c, s: mm16(x, c, s, layer=2)).trace(x256, codes, tiles16)
    assert "nvfp4_frozen_matmul_tpu_wide" in lowered.lower(lowering_platforms=("tpu",)).as_text()


@pytest.mark.parametrize(
    "out_in, tokens, grid",
    [
        ((8192, 8192), 1, "(1, 4, 2)"),  # the sweep's weight: the table's tile as it is
        ((2048, 2048), 1, "(1, 4, 1)"),  # a d_model 2048 projection: (512, 2048), 4 steps
        ((5504, 2048), 16, "(1, 6, 1)"),  # its MLP's up projection: (1024, 2048)
        ((2048, 5504), 1, "(1, 2, 2)"),  # and down: (1024, 4096), the last depth overhangs
        ((40, 100), 1, "(1, 1, 1)"),  # smaller than the smallest tile: padded to it
        ((2048, 2048), 4096, "(4, 1, 1)"),  # a prefill: its steps along the tokens count
    ],
)
def test_default_tiles_fit_the_weight(out_in, tokens, grid):
    """The default tiles shrink to the weight (no padded copy of a weight as wide or deep
    as the layouts' steps allow: a d_model 2048 model's projections were padded to
    4096-deep tiles, twice the work) and narrow until a call has `MIN_WEIGHT_STEPS`
    grid steps where the weight allows (steps along the tokens included)."""
    n, k = out_in
    weight = [
        jax.ShapeDtypeStruct((n, -(-k // 16) * 8), jnp.uint8),
        jax.ShapeDtypeStruct((n, -(-k // 16)), jnp.uint8),
    ]
    x = jax.ShapeDtypeStruct((tokens, k), jnp.bfloat16)
    mm = functools.partial(_tpu_frozen_gemm.frozen_matmul, block=(1, 16), n=n, operand="bfloat16")
    jaxpr = jax.make_jaxpr(mm)(x, *weight)
    text = str(jaxpr)
    assert f"grid={grid}" in text, re.findall(r"grid=\([^)]*\)", text)
    padded = []  # the uint8 arrays padded (the codes, the scales' bits)

    def walk(jp):
        for eqn in jp.eqns:
            if eqn.primitive.name == "pad" and eqn.invars[0].aval.dtype == jnp.uint8:
                padded.append(eqn.invars[0].aval.shape)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    assert bool(padded) == (n < 512), padded


# --- frozen experts (`ragged_dot`): every expert's GEMM by the kernel at a few tokens ---

#: Experts `(G, out, in)`, tokens sorted by expert: uneven groups, an empty one, and
#: 5 tokens past every group; a NaN token inside a group and one past them.
EXPERTS, OUT, IN, TOKENS = 4, 40, 48, 24
EXPERT_SIZES = (5, 0, 11, 3)
#: The two ways a model reads experts stored `(G, out, in)` with a grouped GEMM: read
#: transposed by `ragged_dot` (PyTorch's layout), or contracted on their last axis.
_EXPERT_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())),
    lhs_ragged_dimensions=(0,),
    rhs_group_dimensions=(0,),
)


class OutInExperts(eqx.Module):
    weight: jax.Array
    read: str = eqx.field(static=True)

    def __call__(self, x, sizes):
        if self.read == "ragged_dot":
            return jax.lax.ragged_dot(x, jnp.swapaxes(self.weight, 1, 2), sizes)
        return jax.lax.ragged_dot_general(x, self.weight, sizes, _EXPERT_DIMS)


def _experts(read: str, activations: str):
    """Frozen experts; `activations`: `"nvfp4"` (W4A4, `nvfp4_training`'s 16x16 tiles,
    which a frozen `ragged_dot` needs) or `"float"` (W4A16: the same weights)."""
    recipe = nvfp4x.recipes.nvfp4_training()
    if activations == "float":
        recipe = dataclasses.replace(recipe, input=None)
    w = jax.random.normal(jax.random.key(6), (EXPERTS, OUT, IN))
    return nvfp4x.freeze(nvfp4x.quantize(OutInExperts(w, read), recipe))


def _tokens(m: int = TOKENS) -> jax.Array:
    x = activations(m, IN, jnp.float32)
    return x.at[2].set(jnp.nan).at[m - 2].set(jnp.nan)


def _check_experts(got, want, frozen, x, sizes) -> None:
    """Each group's rows within `check_close`'s bound of the XLA path's (the operands
    the kernel multiplies: `grouped_fprop`'s quantised rows, each expert's block
    values); rows past every group zero in both."""
    recipe, w = frozen.weight.recipe, frozen.weight.packed

    @jax.jit  # (one compile, not one per eager operation)
    def rows(x, sizes):
        return _ragged.quantize_rows(x, recipe.input, _ragged.groups(sizes, x.shape[0]), None)

    xv, xs = rows(x, sizes)
    xs = jnp.ones(x.shape[:1]) if xs is None else xs
    wv = w.operand()[0]
    start = 0
    for e, size in enumerate(np.asarray(sizes)):
        rows = slice(start, start + size)
        scale = (xs[rows] * w.tensor_scale[e])[:, None]
        check_close(got[rows], want[rows], xv[rows], wv[e], IN, scale=scale)
        start += size
    assert np.all(np.asarray(got[start:]) == 0) and np.all(np.asarray(want[start:]) == 0)


@pytest.mark.parametrize("read", ["ragged_dot", "ragged_dot_general"])
@pytest.mark.parametrize("activations", ["nvfp4", "float"])
def test_frozen_experts_run_the_kernel_at_few_tokens(read, activations, kernel_calls):
    """Frozen experts stored `(G, out, in)` at a few tokens: every expert's GEMM by the
    kernel, each token its own expert's row; the XLA path's results up to float32
    summation order, eagerly and under jit, NaN tokens where they were (a NaN token
    past every group gives zeros, as `ragged_dot` does)."""
    frozen = _experts(read, activations)
    x, sizes = _tokens(), jnp.asarray(EXPERT_SIZES, jnp.int32)
    _prims._compiled.cache_clear()  # (the spy counts traces: a cached program has none)
    call = lambda: eqx.filter_jit(lambda m, x, s: m(x, s))  # (one per choice: a jitted
    with _kernels.use("frozen_gemm", "xla"):  # function keeps what it was traced with)
        want, want_jit = frozen(x, sizes), call()(frozen, x, sizes)
    assert kernel_calls == []
    with _kernels.use("frozen_gemm", "mosaic"):
        got_jit = call()(frozen, x, sizes)  # (the primitive's program, traced once here,
        assert kernel_calls  # then cached: the eager call runs it again)
        got = frozen(x, sizes)
    operand = "bfloat16" if activations == "nvfp4" else "float32"
    assert set(kernel_calls) == {operand}
    assert np.isnan(np.asarray(got[2])).all() and not np.isnan(np.asarray(got[3:])).any()
    _check_experts(got, want, frozen, x, sizes)
    _check_experts(got_jit, want_jit, frozen, x, sizes)


def test_frozen_experts_many_tokens_or_stored_in_out_keep_xla(kernel_calls):
    """Past `FEW_EXPERT_TOKENS` tokens, or for experts stored `(G, in, out)` (packed
    along the outputs), the decoded experts' `ragged_dot` runs, as before."""
    frozen = _experts("ragged_dot", "float")
    _prims._compiled.cache_clear()  # (the spy counts traces: a cached program has none)
    many = nvfp4x._frozen.FEW_EXPERT_TOKENS + 1
    x, sizes = _tokens(many), jnp.asarray([many - 20, 0, 20, 0], jnp.int32)
    with _kernels.use("frozen_gemm", "mosaic"):
        jaxpr = str(jax.make_jaxpr(frozen)(x, sizes).eqns[0].params)
        got = frozen(x, sizes)
    with _kernels.use("frozen_gemm", "xla"):
        want = frozen(x, sizes)
    assert kernel_calls == [] and "mosaic" in jaxpr
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    in_out = nvfp4x.freeze(nvfp4x.quantize(_InOut(EXPERTS, IN, OUT), frozen.weight.recipe))
    x = _tokens()
    with _kernels.use("frozen_gemm", "mosaic"):
        in_out(x, jnp.asarray(EXPERT_SIZES, jnp.int32))
    assert kernel_calls == []


class _InOut(eqx.Module):
    """Experts stored `(G, in, out)`, as Levanter's MoE holds them."""

    weight: jax.Array

    def __init__(self, experts, din, dout):
        self.weight = jax.random.normal(jax.random.key(7), (experts, din, dout))

    def __call__(self, x, sizes):
        return jax.lax.ragged_dot(x, self.weight, sizes)


def test_frozen_experts_lower_for_tpu_with_the_kernel(monkeypatch):
    """Traced for a TPU (the kernel compiled, not interpreted) and lowered here: the
    Mosaic kernel's custom call, and no `ragged_dot` (no decoded experts)."""
    frozen = _experts("ragged_dot", "float")
    monkeypatch.setattr(_kernels, "backend", lambda: "tpu")
    x = jax.ShapeDtypeStruct((TOKENS - 1, IN), jnp.float32)  # (a shape no test ran)
    sizes = jax.ShapeDtypeStruct((EXPERTS,), jnp.int32)
    fn = jax.jit(lambda x, s: frozen(x, s))
    text = fn.trace(x, sizes).lower(lowering_platforms=("tpu",)).as_text()
    assert "nvfp4_frozen_matmul_tpu" in text and "ragged_dot" not in text


@pytest.mark.parametrize("mode", ["scan", "vmap"])
def test_stacked_frozen_experts_run_the_kernel(mode, kernel_calls):
    """A stack of expert layers (`eqx.filter_vmap`-made), called under `jax.lax.scan`
    (jit) or `jax.vmap`: each layer's experts by the kernel, each layer its own
    problem."""
    recipe = nvfp4x.recipes.nvfp4_training()
    w = jax.random.normal(jax.random.key(8), (2, EXPERTS, OUT, IN))
    stack = eqx.filter_vmap(lambda w: OutInExperts(w, "ragged_dot"))(w)
    frozen = nvfp4x.freeze(nvfp4x.quantize(stack, recipe))
    x, sizes = _tokens(), jnp.asarray(EXPERT_SIZES, jnp.int32)
    params, static = eqx.partition(frozen, eqx.is_array)
    layer = lambda p: eqx.combine(p, static)(x, sizes)
    run = {
        "scan": lambda: jax.jit(lambda p: jax.lax.scan(lambda c, q: (c, layer(q)), 0, p)[1]),
        "vmap": lambda: jax.vmap(layer),
    }[mode]
    _prims._compiled.cache_clear()  # (the spy counts traces: a cached program has none)
    with _kernels.use("frozen_gemm", "xla"):
        want = run()(params)
    assert kernel_calls == []
    with _kernels.use("frozen_gemm", "mosaic"):
        got = run()(params)
    assert kernel_calls
    for i in range(2):
        one = eqx.combine(jax.tree_util.tree_map(lambda a, i=i: a[i], params), static)
        _check_experts(got[i], want[i], one, x, sizes)
