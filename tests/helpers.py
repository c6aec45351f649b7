"""Helpers shared by the test files: test data, comparisons of values and of bits, the
recipes by name, the GEMM tests' layer and gradients, the inference tests' models (and
their frozen forms, cached), and running a script in a subprocess.

The NumPy references of the formats and GEMMs are in `reference.py`. Test files import
both as top-level modules (`from helpers import ...`): pytest puts `tests/` on
`sys.path`, and `pyproject.toml` adds the repository root (for `benchmarks`) and
`examples/`.
"""

import functools
import pathlib
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

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


#: The kinds of tensor `tensors` draws: every one a format must get right.
TENSOR_KINDS = (
    "gaussian",
    "heavy_tail",
    "log_spread",  # magnitudes 2^-40 .. 2^40 in one tensor
    "zeros",
    "zero_blocks",
    "underflow_blocks",  # some blocks far below amax: E4M3-subnormal or zero scales
    "outlier",
    "non_finite",
    "tiny",  # tensor scales in float32's subnormal range, subnormal elements
)
#: Those without NaN or infinity.
FINITE_KINDS = tuple(k for k in TENSOR_KINDS if k != "non_finite")


@st.composite
def tensors(draw, shapes, kinds=TENSOR_KINDS, dtype=np.float32) -> tuple[str, np.ndarray]:
    """A hypothesis strategy: `(kind, array)`, an array of one of `shapes` (few: each shape
    is a compile) in `dtype`, of one of `kinds`, scaled by a drawn power of two (2^-40 to
    2^40, except `log_spread` and `tiny`, which set their own magnitudes)."""
    shape = draw(st.sampled_from(list(shapes)))
    kind = draw(st.sampled_from(kinds))
    e = draw(st.integers(-40, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = rng.standard_normal(shape)
    cols = shape[-1]
    chunks = [slice(j, min(j + 16, cols)) for j in range(0, cols, 16)]
    if kind == "heavy_tail":
        x = np.clip(rng.standard_cauchy(shape), -(2.0**60), 2.0**60)
    elif kind == "log_spread":
        x = rng.choice([-1.0, 1.0], shape) * 2.0 ** rng.uniform(-40, 40, shape)
        e = 0
    elif kind == "zeros":
        x = np.zeros(shape)
    elif kind == "zero_blocks":
        for c in chunks:
            if rng.random() < 0.5:
                x[..., c] = 0.0
    elif kind == "underflow_blocks":
        for c in chunks:
            x[..., c] *= 2.0 ** rng.choice([0, -12, -16, -20, -30])
    elif kind == "outlier":
        idx = tuple(int(rng.integers(n)) for n in shape)
        x[idx] = rng.choice([-1.0, 1.0]) * 2.0 ** draw(st.integers(10, 40))
    elif kind == "non_finite":
        for _ in range(draw(st.integers(1, 3))):
            idx = tuple(int(rng.integers(n)) for n in shape)
            x[idx] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    elif kind == "tiny":
        x = x * 2.0 ** draw(st.integers(-140, -110))
        e = 0
    return kind, (x * 2.0**e).astype(np.float32).astype(dtype)


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


#: Whether two programs that compute the same sums get the same bits: on a CPU, where
#: XLA orders a GEMM or a reduction by its shapes and dtypes. Not on a GPU: XLA:GPU fuses
#: each GEMM and reduction with its neighbours and picks its algorithm per fusion
#: (autotuned), so another program (a frozen model, a rematerialised gradient) may sum in
#: another order. Everything that decides bits before the sums is bit-exact everywhere
#: (`docs/format.md`).
SAME_SUMS_ACROSS_PROGRAMS = jax.default_backend() == "cpu"


def only_on(*backends: str, reason: str):
    """A `pytest` mark that skips a test, saying why, unless `jax.default_backend()` is
    one of `backends`: for a test of one backend's property (an XLA:CPU flag, a plugin
    that changes XLA:CPU's lowering), so that on a TPU or a GPU it skips only itself."""
    return pytest.mark.skipif(
        jax.default_backend() not in backends, reason=f"{'/'.join(backends)} only: {reason}"
    )


def assert_same_sums(a: Any, b: Any, what: str) -> None:
    """Two programs' results, leaf by leaf: bit for bit where
    `SAME_SUMS_ACROSS_PROGRAMS`, else up to float32 summation order (`RTOL`: a code or
    scale that differed would move a leaf far more). There NaN and ±inf must sit where
    they sit in `b` (a sum's order does not make or remove them), the finite values are
    compared by `assert_close`, and a leaf whose finite values are all zero must be
    zero in `a` too; integer and boolean leaves are compared bit for bit."""
    if SAME_SUMS_ACROSS_PROGRAMS:
        assert_trees_same(a, b, what)
        return
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb), what
    for i, (u, v) in enumerate(zip(la, lb, strict=True)):
        u, v, where = np.asarray(u), np.asarray(v), f"{what} (leaf {i})"
        assert u.dtype == v.dtype and u.shape == v.shape, (where, u.dtype, v.dtype)
        if not np.issubdtype(u.dtype, np.inexact) and u.dtype not in _LOW_FLOATS:
            assert_same(u, v, where)
            continue
        u, v = u.astype(np.float64), v.astype(np.float64)
        finite = np.isfinite(v)
        np.testing.assert_array_equal(u[~finite], v[~finite], err_msg=f"{where}: non-finite")
        assert np.isfinite(u[finite]).all(), f"{where}: non-finite where `b` is finite"
        if not np.any(v[finite]):
            np.testing.assert_array_equal(u[finite], v[finite], err_msg=f"{where}: zeros")
            continue
        assert_close(u[finite], v[finite], where)


#: NumPy's extension float dtypes (`ml_dtypes`), which `np.inexact` does not cover.
_LOW_FLOATS = tuple(
    np.dtype(t) for t in (jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float16)
)


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
# Models to quantise and freeze (the inference tests, `test_freeze.py`, `test_save_load.py`).
# ---------------------------------------------------------------------------------------

recipe_names = pytest.mark.parametrize("name", list(RECIPES))


class Stack(eqx.Module):
    """`nlayers` Linear layers made with `eqx.filter_vmap` (one stacked weight) and run
    with `jax.lax.scan`, the way deep models avoid unrolling."""

    layers: Any

    def __init__(self, d: int, nlayers: int, key: jax.Array):
        keys = jax.random.split(key, nlayers)
        self.layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(d, d, key=k))(keys)

    def __call__(self, x: jax.Array) -> jax.Array:
        params, static = eqx.partition(self.layers, eqx.is_array)

        def body(h, p):
            return jnp.tanh(eqx.combine(p, static)(h)), None

        return jax.lax.scan(body, x, params)[0]


def mixed(key: jax.Array) -> eqx.nn.Sequential:
    """Feature sizes that are multiples of 16 and sizes that are not, in one model:
    32 -> 64 (both multiples), 64 -> 40 (the output is not), 40 -> 24 (neither). One
    model covers both kinds of layer for the price of one compilation per test."""
    k = jax.random.split(key, 3)
    return eqx.nn.Sequential(
        [
            eqx.nn.Linear(32, 64, key=k[0]),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.Linear(64, 40, key=k[1]),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.Linear(40, 24, key=k[2]),
        ]
    )


MODELS: dict[str, tuple[Callable[[jax.Array], Any], tuple[int, ...]]] = {
    # name: (make(key), shape of one example)
    "mixed": (mixed, (32,)),
    "stack-scan": (lambda key: Stack(40, 3, key), (40,)),
    # The checkpoint tests' model (its last layer is kept plain by `ckpt_policy`).
    "odd-features": (lambda key: eqx.nn.MLP(40, 24, 56, 2, key=key), (40,)),
    "scalar": (lambda key: eqx.nn.MLP("scalar", "scalar", 20, 1, key=key), ()),
}


def make(model: str, seed: int = 0) -> Any:
    return MODELS[model][0](jax.random.key(seed))


def inputs(model: str, seed: int = 1) -> jax.Array:
    return normal(seed, (12,) + MODELS[model][1])  # 12 tokens (not a multiple of 16)


def call(m, x):
    return m(x)


def vcall(m, x):
    return jax.vmap(m)(x)


MODES: dict[str, Callable[[Any, jax.Array], jax.Array]] = {
    "eager": call,
    "jit": eqx.filter_jit(call),  # the model is a jit argument, not a closed-over constant
    "vmap": vcall,
    "jit-vmap": eqx.filter_jit(vcall),
}


def ckpt_policy(name: str) -> nvfp4x.Policy:
    """The recipe everywhere except an MLP's last layer, kept as a plain `eqx.nn.Linear`."""
    return nvfp4x.Policy([(r"layers\[2\]", None), (r".*", RECIPES[name]())])


# Freezing eagerly dispatches (and compiles) every packing op on its own: seconds per
# model on this CPU. Most tests freeze under `eqx.filter_jit` once per model and recipe;
# `test_eager_freeze_equals_jitted_freeze` shows that both give the same bits.
freeze_jit = eqx.filter_jit(nvfp4x.freeze)


@functools.cache
def quantized(model: str, name: str, seed: int = 0, keep_last: bool = False) -> Any:
    policy = ckpt_policy(name) if keep_last else RECIPES[name]()
    return nvfp4x.quantize(make(model, seed), policy)


@functools.cache
def frozen_model(model: str, name: str, seed: int = 0, keep_last: bool = False) -> Any:
    return freeze_jit(quantized(model, name, seed, keep_last))


def build_frozen(seed: int) -> Any:
    """A small frozen NVFP4 MLP (`nvfp4_inference`): the checkpoint tests' model."""
    mlp = eqx.nn.MLP(32, 16, 48, 1, key=jax.random.key(seed))
    return nvfp4x.freeze(nvfp4x.quantize(mlp, nvfp4x.recipes.nvfp4_inference()))


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


def dead_pid() -> int:
    """The id of a process of this host that has ended."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout)
