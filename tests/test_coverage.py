"""`nvfp4x.coverage`: every GEMM of a traced function, with its layer, pass, shape, FLOPs
and operand formats; FLOP totals and shares per format; and, flagged, every selected
weight that reached a GEMM unquantised.

The FLOPs below are written out by hand (`2 * M * K * N`) for an MLP of 32 -> 64 -> 16
features on 8 tokens, so that a change to the counting shows as a changed number.
"""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp

import nvfp4x

TOKENS = 8
X = jax.ShapeDtypeStruct((TOKENS, 32), jnp.float32)  # traced only: nothing is computed
FPROP_0 = 2 * TOKENS * 32 * 64  # layers[0]: (8, 32) x (32, 64)
FPROP_1 = 2 * TOKENS * 64 * 16  # layers[1]: (8, 64) x (64, 16)
NVFP4 = ("nvfp4 1x16", "nvfp4 16x16")  # the training recipe's (input, weight)


def mlp() -> eqx.nn.MLP:
    return eqx.nn.MLP(32, 16, 64, 1, key=jax.random.key(0))


def forward(model, x):
    return jax.vmap(model)(x)


def loss(model, x):
    return jnp.sum(forward(model, x) ** 2)


def table(report: nvfp4x.CoverageReport) -> list[tuple]:
    return [(r.path, r.pass_, r.shape, r.flops, r.formats, r.quantised) for r in report.rows]


def test_a_forward_pass_lists_each_layers_gemm_with_its_flops():
    report = nvfp4x.coverage(forward, nvfp4x.quantize(mlp(), "nvfp4_training"), X)
    assert table(report) == [
        ("layers[0]", "fprop", "(8, 32) x (32, 64)", FPROP_0, NVFP4, True),
        ("layers[1]", "fprop", "(8, 64) x (64, 16)", FPROP_1, NVFP4, True),
    ]
    assert report.total_flops == FPROP_0 + FPROP_1
    assert report.unquantised == ()
    text = str(report)
    assert text.splitlines()[0].split() == [
        "path", "pass", "shape", "FLOPs", "operand", "a", "operand", "b"
    ]  # fmt: skip
    assert "GEMM FLOPs per format (total 49.2 kFLOP):" in text
    assert "UNQUANTISED" not in text


def test_a_training_step_adds_dgrad_and_wgrad():
    """The gradient of the weights: wgrad for every layer (`(N, M) x (M, K)`, gradient
    in NVFP4 with stochastic rounding against the layer's input), dgrad for every layer
    but the first (its input needs no gradient)."""
    report = nvfp4x.coverage(eqx.filter_grad(loss), nvfp4x.quantize(mlp(), "nvfp4_training"), X)
    grad = "nvfp4 1x16, SR"
    assert sorted(table(report)) == sorted([
        ("layers[0]", "fprop", "(8, 32) x (32, 64)", FPROP_0, NVFP4, True),
        ("layers[1]", "fprop", "(8, 64) x (64, 16)", FPROP_1, NVFP4, True),
        ("layers[1]", "dgrad", "(8, 16) x (16, 64)", FPROP_1, (grad, "nvfp4 16x16"), True),
        ("layers[1]", "wgrad", "(16, 8) x (8, 64)", FPROP_1, (grad, "nvfp4 1x16"), True),
        ("layers[0]", "wgrad", "(64, 8) x (8, 32)", FPROP_0, (grad, "nvfp4 1x16"), True),
    ])  # fmt: skip
    assert report.share("nvfp4") == 1.0 and report.unquantised == ()


def test_scan_multiplies_the_flops_by_its_length():
    """Layers stacked by `eqx.filter_vmap` and run by `lax.scan`: one row, the GEMM of one
    layer, with `length` times its FLOPs."""
    length = 3
    keys = jax.random.split(jax.random.key(1), length)
    stack = eqx.filter_vmap(lambda k: eqx.nn.Linear(32, 32, key=k))(keys)

    class Stack(eqx.Module):
        layers: eqx.nn.Linear

        def __call__(self, x):
            params, static = eqx.partition(self.layers, eqx.is_array)
            step = lambda h, p: (eqx.combine(p, static)(h), None)
            return jax.lax.scan(step, x, params)[0]

    report = nvfp4x.coverage(forward, nvfp4x.quantize(Stack(stack), "nvfp4_training"), X)
    one = 2 * TOKENS * 32 * 32
    assert table(report) == [("layers", "fprop", "(8, 32) x (32, 32)", length * one, NVFP4, True)]


def test_flops_by_format_and_share():
    """`flops_by_format` sums the FLOPs of each format, largest first; `share(fmt)` is a
    format's fraction of all GEMM FLOPs (0 for a format that did not run)."""
    policy = nvfp4x.Policy(
        [(r"layers\[1\]", nvfp4x.recipes.bf16()), (r".*", nvfp4x.recipes.nvfp4_training())]
    )
    report = nvfp4x.coverage(eqx.filter_grad(loss), nvfp4x.quantize(mlp(), policy), X)
    nvfp4, bf16 = 2 * FPROP_0, 3 * FPROP_1  # layers[0]: fprop, wgrad; layers[1]: all three
    assert list(report.flops_by_format().items()) == [("nvfp4", nvfp4), ("bf16", bf16)]
    assert report.share() == report.share("nvfp4") == nvfp4 / (nvfp4 + bf16)
    assert report.share("bf16") == bf16 / (nvfp4 + bf16)
    assert report.share("fp8") == 0.0
    assert "bf16                        49.2 kFLOP   42.9%" in str(report)
    empty = nvfp4x.coverage(lambda x: 2 * x, X)
    assert (empty.rows, empty.total_flops, empty.share(), empty.flops_by_format()) == (
        (),
        0,
        0.0,
        {},
    )


def test_share_counts_a_gemm_only_when_both_operands_are_in_the_format():
    """Weight-only NVFP4 (W4A16): the input stays float32, so the GEMM's format is
    `float32 x nvfp4` and none of its FLOPs count as NVFP4."""
    report = nvfp4x.coverage(forward, nvfp4x.quantize(mlp(), "nvfp4_weight_only"), X)
    assert [(r.formats, r.format) for r in report.rows] == 2 * [
        (("float32", "nvfp4 1x16"), "float32 x nvfp4")
    ]
    assert report.share("nvfp4") == 0.0
    assert report.flops_by_format() == {"float32 x nvfp4": FPROP_0 + FPROP_1}


def test_plain_gemms_are_named_by_their_layer_or_as_activations():
    """A layer the policy leaves float: its GEMM is named by the layer, not quantised, not
    flagged (it was not selected). A product of two activations: `(activations)`."""
    policy = nvfp4x.Policy([(r"layers\[0\]", nvfp4x.recipes.nvfp4_training())])
    report = nvfp4x.coverage(forward, nvfp4x.quantize(mlp(), policy), X)
    assert table(report)[1] == (
        "layers[1]", "fprop", "(16, 64) x (64, 8)", FPROP_1, ("float32", "float32"), False
    )  # fmt: skip
    assert report.unquantised == ()
    scores = nvfp4x.coverage(lambda q, k: q @ k.T, X, X)
    assert table(scores) == [
        ("(activations)", "fprop", "(8, 32) x (32, 8)", 2 * 8 * 32 * 8, ("float32",) * 2, False)
    ]
    backward = nvfp4x.coverage(eqx.filter_grad(loss), mlp(), X)
    assert ("layers[1]", "backward") in {(r.path, r.pass_) for r in backward.rows}
    assert not any(r.quantised for r in backward.rows)


def test_a_frozen_layer_is_listed_as_frozen():
    frozen = nvfp4x.freeze(nvfp4x.quantize(mlp(), "nvfp4_inference"))
    report = nvfp4x.coverage(forward, frozen, X)
    assert [(r.path, r.pass_, r.flops, r.quantised) for r in report.rows] == [
        ("(frozen)", "fprop", FPROP_0, True),
        ("(frozen)", "fprop", FPROP_1, True),
    ]


@jax.custom_vjp
def _own_matmul(x, w):
    return x @ w.T


_own_matmul.defvjp(lambda x, w: (x @ w.T, (x, w)), lambda res, g: (g @ res[1], g.T @ res[0]))


class OwnGradient(eqx.Module):
    """A layer whose GEMM is a `jax.custom_vjp` function: nvfp4x cannot quantise it."""

    weight: jax.Array

    def __call__(self, x, *, key=None):
        return _own_matmul(x, self.weight)


def test_a_selected_weight_that_reaches_a_plain_gemm_is_flagged():
    model = eqx.nn.Sequential([OwnGradient(jnp.ones((16, 32)))])
    qmodel = nvfp4x.quantize(model, "nvfp4_training")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the same finding, as a warning (tested elsewhere)
        report = nvfp4x.coverage(forward, qmodel, X)
    assert table(report) == [
        ("layers[0]", "fprop", "(8, 32) x (32, 16)", 2 * 8 * 32 * 16, ("float32",) * 2, False)
    ]
    assert report.unquantised == (
        ("layers[0]", "a `jax.custom_vjp` function"),
        ("layers[0]", "a plain dot_general (fprop)"),
    )
    assert "SELECTED WEIGHTS THAT REACHED A GEMM UNQUANTISED:\n  layers[0]: a `jax" in str(report)


_EXPERT_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (1,)), ((), ())),
    lhs_ragged_dimensions=(0,),
    rhs_group_dimensions=(0,),
)


class LevanterMoE(eqx.Module):
    """A Levanter-style MoE MLP: raw expert arrays `w1`, `w3` `(E, d, h)` and `w2`
    `(E, h, d)` (experts `(E, k, n)`), each placed by a sharding constraint, then run by
    `lax.ragged_dot_general` on tokens sorted by expert (silu(x w1) * x w3, then w2)."""

    router: eqx.nn.Linear
    w1: jax.Array
    w2: jax.Array
    w3: jax.Array

    def __init__(self, key, experts=4, d=32, h=48):
        k = jax.random.split(key, 4)
        self.router = eqx.nn.Linear(d, experts, use_bias=False, key=k[0])
        self.w1 = jax.random.normal(k[1], (experts, d, h))
        self.w3 = jax.random.normal(k[2], (experts, d, h))
        self.w2 = jax.random.normal(k[3], (experts, h, d))

    def __call__(self, x):
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        w1, w2, w3 = (
            jax.lax.with_sharding_constraint(w, sharding) for w in (self.w1, self.w2, self.w3)
        )
        gate, chosen = jax.lax.top_k(jax.vmap(self.router)(x), 2)
        order = jnp.argsort(chosen.reshape(-1))
        sizes = jnp.bincount(chosen.reshape(-1), length=self.w1.shape[0]).astype(jnp.int32)
        xs = jnp.take(x, order // 2, axis=0)
        dot = lambda a, w: jax.lax.ragged_dot_general(a, w, sizes, _EXPERT_DIMS)
        out = dot(jax.nn.silu(dot(xs, w1)) * dot(xs, w3), w2)
        back = jnp.zeros_like(out).at[order].set(out).reshape(x.shape[0], 2, -1)
        return jnp.sum(back * jax.nn.softmax(gate)[..., None], axis=1)


def test_raw_expert_weights_of_a_moe_block_are_named():
    """The expert GEMMs of raw arrays read through sharding constraints are named by
    their weights, in the forward and in the backward (a wgrad multiplies two
    activations: it is named by the weight of the GEMM it derives from)."""
    model = LevanterMoE(jax.random.key(0))
    grad = eqx.filter_grad(lambda m, x: jnp.sum(m(x) ** 2))
    report = nvfp4x.coverage(grad, model, X)
    ragged = [(r.path, r.pass_) for r in report.rows if r.shape.startswith("ragged")]
    assert sorted(p for p, kind in ragged if kind == "fprop") == ["w1", "w2", "w3"]
    assert sorted(p for p, kind in ragged if kind == "backward") == ["w1", "w2", "w2", "w3"]
    # A quantised weight placed by a sharding constraint is still the weight: its GEMM
    # runs in NVFP4 (it ran in float32, silently).
    layer = LevanterMoE(jax.random.key(0)).router
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    placed = lambda m, x: x @ jax.lax.with_sharding_constraint(m.weight, sharding).T
    report = nvfp4x.coverage(nvfp4x.quantized(placed), nvfp4x.quantize(layer, "nvfp4_training"), X)
    assert report.share("nvfp4") == 1.0 and not report.unquantised
