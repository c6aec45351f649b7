"""Helpers shared by the test files: test data, comparisons of values and of bits, the
recipes by name, the GEMM tests' layer and gradients, and running a script in a
subprocess.

The NumPy references of the formats and GEMMs are in `reference.py`. Test files import
both as top-level modules (`from helpers import ...`): pytest puts `tests/` on
`sys.path`, and `pyproject.toml` adds the repository root (for `benchmarks`) and
`examples/`.
"""

import pathlib
import subprocess
import sys
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4x

#: The repository root.
ROOT = pathlib.Path(__file__).resolve().parent.parent

#: Every recipe of `nvfp4x.recipes` by name (listed here, independently of the library).
RECIPES = {
    "nvfp4_training": nvfp4x.recipes.nvfp4_training,
    "nvfp4_inference": nvfp4x.recipes.nvfp4_inference,
    "nvfp4_weight_only": nvfp4x.recipes.nvfp4_weight_only,
    "mxfp8": nvfp4x.recipes.mxfp8,
    "fp8": nvfp4x.recipes.fp8,
    "bf16": nvfp4x.recipes.bf16,
    "float32": nvfp4x.recipes.float32,
}


# ---------------------------------------------------------------------------------------
# Test data.
# ---------------------------------------------------------------------------------------


def normal_np(seed: int, shape, scale: float = 1.0) -> np.ndarray:
    """Standard normal float32 samples (NumPy's PCG64: stable streams), times `scale`."""
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def normal(seed: int, shape) -> jax.Array:
    """`normal_np(seed, shape)` as a JAX array."""
    return jnp.asarray(normal_np(seed, shape))


# ---------------------------------------------------------------------------------------
# Comparisons: the same values, the same bits.
# ---------------------------------------------------------------------------------------


#: The relative error allowed against the NumPy reference GEMMs: float32 summation order,
#: far below one element's quantisation step.
RTOL = 1e-5


def rel_err(got, want) -> float:
    """Frobenius norm of the difference over the norm of `want`."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def assert_close(got, want, what: str, rtol: float = RTOL) -> None:
    err = rel_err(got, want)
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol:g}"


def assert_same(a, b, what: str) -> None:
    """Bit for bit (`==`, NaNs equal to NaNs), same dtype and shape."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    np.testing.assert_array_equal(a, b, err_msg=what)


def assert_trees_same(a, b, what: str) -> None:
    """`assert_same` leaf by leaf."""
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb), what
    for i, (u, v) in enumerate(zip(la, lb, strict=True)):
        assert_same(u, v, f"{what} (leaf {i})")


def leaves_bits(tree: Any) -> list:
    """Every leaf as `(type name, dtype, shape, bytes)` for arrays (key arrays by their
    key data) and as itself otherwise: equal lists mean equal bits."""
    out = []
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            data = np.asarray(jax.random.key_data(leaf))
            out.append(("key", str(leaf.dtype), data.shape, data.tobytes()))
        elif isinstance(leaf, jax.Array | np.ndarray | np.generic):
            a = np.asarray(leaf)
            out.append((type(leaf).__module__.split(".")[0], str(a.dtype), a.shape, a.tobytes()))
        else:
            out.append(leaf)
    return out


def assert_same_bits(got: Any, want: Any, what: str = "") -> None:
    """Same tree structure (static fields included) and every leaf the same bits: arrays
    of the same kind (JAX or NumPy), dtype, shape and bytes; other leaves equal."""
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want), what
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(want)]
    for path, a, b in zip(paths, leaves_bits(got), leaves_bits(want), strict=True):
        assert a == b, f"{what}: leaf {path} differs"


# ---------------------------------------------------------------------------------------
# A quantised linear layer and its gradients (the GEMM tests, `test_gemm_*.py`).
# ---------------------------------------------------------------------------------------

PLAIN = nvfp4x.recipes.nvfp4_training(rht=False, stochastic_rounding=False)
TRAIN = nvfp4x.recipes.nvfp4_training()
# Token and feature sizes that are not multiples of 16.
T, K, N = 37, 40, 24


def make_layer(recipe, k=K, n=N, *, fast=True, use_bias=True, seed=0, dtype=jnp.float32):
    lin = eqx.nn.Linear(k, n, use_bias=use_bias, key=jax.random.key(seed), dtype=dtype)
    if use_bias:  # a bias that is not tiny, so that adding it in float32 is visible
        lin = eqx.tree_at(lambda m: m.bias, lin, jnp.asarray(normal_np(seed + 1, (n,)), dtype))
    q = nvfp4x.quantize(lin, recipe, fast=fast)
    assert isinstance(q, nvfp4x.QuantizedLinear)
    return q


def cot_loss(layer, x, g, key=None):
    """`sum(layer(x) * g)`: its output gradient `dy` is exactly `g`."""
    return jnp.sum(layer(x, key=key).astype(jnp.float32) * g)


grad_layer_x = jax.grad(cot_loss, argnums=(0, 1))
jit_grad_layer_x = jax.jit(grad_layer_x)
jit_call = jax.jit(lambda m, x: m(x))

fasts = pytest.mark.parametrize("fast", [True, False], ids=["fast", "reference"])


class TwoLayer(eqx.Module):
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, d, h, key):
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(d, h, key=k1)
        self.fc2 = eqx.nn.Linear(h, d, key=k2)

    def __call__(self, x, *, key=None):
        keys = (None, None) if key is None else tuple(jax.random.split(key))
        return self.fc2(jax.nn.gelu(self.fc1(x, key=keys[0])), key=keys[1])


# ---------------------------------------------------------------------------------------
# Scripts in a subprocess.
# ---------------------------------------------------------------------------------------


def run_script(
    args: list[str], *, timeout: float, what: str = "", **kwargs
) -> subprocess.CompletedProcess:
    """Run `python ARGS` (text output captured; `kwargs` to `subprocess.run`, e.g. `env`
    and `cwd`), and fail the test, with the ends of its output, if it takes longer than
    `timeout` seconds or exits with an error. `what` names it (default: the command)."""
    what = what or "python " + " ".join(map(str, args))
    try:
        proc = subprocess.run(
            [sys.executable, *args], capture_output=True, text=True, timeout=timeout, **kwargs
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"`{what}` took more than {timeout} s:\n{e.stdout}\n{e.stderr}")
    assert proc.returncode == 0, (
        f"`{what}` exited with {proc.returncode}\n"
        f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
    )
    return proc
