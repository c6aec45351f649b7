"""Guards on the size of the program one NVFP4 quantisation gives XLA.

A training step quantises five operands per layer and XLA inlines every one of them, so
its compile time grows with the size of each. These bounds hold with a margin today;
a change that breaks one should say why the quantiser needs more.
"""

import jax
import jax.numpy as jnp
import pytest

from nvfp4x._formats import quantize_operand
from nvfp4x._numerics._constants import ROW_BLOCK, TILE
from nvfp4x._policy import Format

#: Optimised HLO instructions of one NVFP4 linear layer, forward and backward (64 tokens,
#: 32 -> 48, the full recipe): 3,548 before issue 37's work, 3,443 after (one hash for
#: dgrad's and wgrad's SR keys), 3,623 with wgrad's RHTs as the fast Walsh-Hadamard
#: transform's butterflies in elementwise operations (a summation order defined on every
#: backend, instead of a dot's; four copies: two transforms, each in both branches of its
#: range `cond`; the 8-block step's compile time the same within noise,
#: `benchmarks/bench_compile.py --depths 8`: 9.1 s against the einsum's 9.5 s).
LAYER_INSTRUCTIONS = 3_650

CASES = {
    "1x16 nearest": (Format("nvfp4", ROW_BLOCK, "nearest", "nearest"), -1),
    "1x16 stochastic": (Format("nvfp4", ROW_BLOCK, "stochastic", "nearest"), -1),
    "16x1 stochastic": (Format("nvfp4", ROW_BLOCK, "stochastic", "nearest"), 0),
    "16x16 nearest": (Format("nvfp4", TILE, "nearest", "nearest"), -1),
}


@pytest.mark.parametrize("case", CASES)
def test_one_quantisation_is_small(case):
    fmt, axis = CASES[case]
    key = jax.random.key(0) if fmt.rounding == "stochastic" else None
    lowered = jax.jit(lambda x: quantize_operand(x, fmt, axis, key)).lower(
        jnp.ones((64, 128), jnp.float32)
    )
    # No `lax.cond`: each is two more computations for XLA, in every quantisation.
    assert lowered.as_text().count("stablehlo.case") == 0
    compiled = lowered.compile().as_text()
    # Reduction (block maxima, tensor max), scalar, block-scale and element fusions
    # (each counted twice: the computation and its call): 10-14 today (the tensor max's
    # two maxima in one variadic reduction made 12, but moved data between devices
    # under FSDP: `tests/multidevice/test_sharding.py`).
    assert compiled.count("fused_computation") <= 14


def test_block_scales_are_not_recomputed_per_element():
    """The per-block scale computation (exact products and reciprocals) must reach the
    element loop as materialised arrays, not fused into it once per element."""
    fmt, axis = CASES["1x16 nearest"]
    compiled = (
        jax.jit(lambda x: quantize_operand(x, fmt, axis)).lower(jnp.ones((64, 128))).compile()
    )
    text = compiled.as_text()
    element_loops = [
        c for c in text.split("\n\n") if "bf16[64,8,16]" in c and "fused_computation" in c
    ]
    assert element_loops
    # The exact block-scale path rounds with `round-nearest-even` and E4M3 with
    # `reduce-precision(..., mantissa_bits=3)`; neither belongs in the element loop.
    for loop in element_loops:
        assert "mantissa_bits=3" not in loop


def _layer_program() -> str:
    """The optimised HLO of one NVFP4 linear layer's forward and backward under the full
    training recipe (RHT, SR, 16x16 weights), with a cotangent XLA cannot fold."""
    import nvfp4x

    recipe = nvfp4x.recipes.nvfp4_training()
    x, w, ct = jnp.ones((64, 32)), jnp.ones((48, 32)), jnp.ones((64, 48))

    def loss(x, w, ct):
        return (nvfp4x.qdot(x, w, recipe=recipe) * ct).sum()

    grad = jax.grad(loss, argnums=(0, 1))
    return jax.jit(grad).lower(x, w, jnp.asarray(ct)).compile().as_text()


def test_one_layer_is_small():
    text = _layer_program()
    # wgrad's two RHTs: a `cond` each, and one inside each guarded branch.
    assert text.count(" conditional(") == 4
    # dgrad's and wgrad's SR keys are one hash (`fold_in_tags`, merged by XLA's CSE).
    instructions = [
        line
        for line in text.splitlines()
        if " = " in line and " parameter(" not in line and " constant(" not in line
    ]
    # Before issue 37's work: two key hashes (`LAYER_INSTRUCTIONS`).
    assert len(instructions) <= LAYER_INSTRUCTIONS
