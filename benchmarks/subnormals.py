"""What the default backend does with float subnormals, op by op, and whether nvfp4x's
bit-level replacements give IEEE's bits there (issue 36).

Run on the device (one process, a few seconds of compiles):

    python benchmarks/subnormals.py            # prints a table; exit status 1 if a
                                               # replacement differs from IEEE

Each row applies one operation under `jax.jit` to float32 values around the subnormal
range and compares with NumPy's IEEE result: `keeps` (IEEE bits), `flushes` (a
subnormal read or written as a zero of its sign), or `differs`. The `nvfp4x` rows must
say `keeps` on every backend, except those of a bfloat16 array on a TPU, which may say
`flushes`: a TPU reads and writes a bfloat16 array's subnormals as ±0 in every
operation, a bitcast included (v5e, 2026-12-05); the others say what the backend does
(XLA:CPU flushes arithmetic, comparisons and max, keeps `convert`, `reduce_precision`,
`abs`, `neg`).
"""

import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from nvfp4x._formats._plain import round_to
from nvfp4x._numerics._bits import fp8_bits, fp8_values, narrow, widen

F32 = np.float32


def _values() -> np.ndarray:
    rng = np.random.default_rng(0)
    sub = rng.integers(1, 2**23, 64, dtype=np.uint32).view(F32)
    near = (2.0 ** rng.uniform(-130, -120, 64)).astype(F32)
    return np.concatenate([sub, -sub, near, [0.0, 2.0**-149, 2.0**-126, 1.5]]).astype(F32)


def _tiny(a: np.ndarray) -> np.ndarray:
    """Where `a` is subnormal (or zero) in its own float type; nowhere for integers."""
    if a.dtype.kind in "iub":
        return np.zeros(a.shape, bool)
    return np.abs(a.astype(np.float64)) < float(ml_dtypes.finfo(a.dtype).smallest_normal)


def _verdict(got: np.ndarray, want: np.ndarray, arg: np.ndarray) -> str:
    """`keeps` (IEEE's bits), `flushes` (a zero where the operand or the IEEE result is
    subnormal in its type) or `differs (count)`."""
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype != want.dtype:
        got = got.astype(want.dtype)
    g, w = got.view(np.uint8).reshape(got.size, -1), want.view(np.uint8).reshape(want.size, -1)
    same = (g == w).all(axis=1) | (np.isnan(got.astype(F32)) & np.isnan(want.astype(F32)))
    if same.all():
        return "keeps"
    zero = got.astype(F32) == 0
    tiny = _tiny(want) | _tiny(np.asarray(arg))
    return "flushes" if (same | (zero & tiny)).all() else f"differs ({(~same).sum()})"


def _bf16_array_row(name: str) -> bool:
    """nvfp4x rows that read or write a bfloat16 array, on a TPU: there every operation
    reads and writes a bfloat16 array's subnormals as ±0, a bitcast included (v5e,
    2026-12-05), so nothing can keep them; elsewhere they must keep IEEE's bits."""
    return jax.default_backend() == "tpu" and name.startswith("nvfp4x") and "bf16" in name


def main() -> int:
    x = _values()
    e4m3 = ml_dtypes.float8_e4m3fn
    x8 = (np.arange(256, dtype=np.uint8)).view(e4m3)
    x8 = x8[~np.isnan(x8.astype(F32))]
    bf = x.astype(ml_dtypes.bfloat16)
    # Every E2M1 value (0.5 and -0.5 its subnormals), as float32 and as float4_e2m1fn;
    # the native GEMMs' `split_blocks` writes its codes by this convert.
    f4 = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn)
    with np.errstate(all="ignore"):
        rows = {
            "x * 2 (arithmetic)": (lambda a: a * 2, x, x * F32(2)),
            "max(x, 0)": (lambda a: jnp.maximum(a, 0.0), x, np.maximum(x, F32(0))),
            "abs": (jnp.abs, x, np.abs(x)),
            "neg": (lambda a: -a, x, -x),
            "reduce_precision bf16": (
                lambda a: lax.reduce_precision(a, exponent_bits=8, mantissa_bits=7),
                x,
                x.astype(ml_dtypes.bfloat16).astype(F32),
            ),
            "convert f32 -> bf16": (lambda a: a.astype(jnp.bfloat16), x, bf),
            "convert bf16 -> f32": (lambda a: a.astype(jnp.float32), bf, bf.astype(F32)),
            "convert f32 -> e4m3": (
                lambda a: a.astype(jnp.float8_e4m3fn),
                x8.astype(F32),
                x8,
            ),
            "convert e4m3 -> f32": (lambda a: a.astype(jnp.float32), x8, x8.astype(F32)),
            "convert f32 -> e2m1": (lambda a: a.astype(jnp.float4_e2m1fn), f4.astype(F32), f4),
            "convert e2m1 -> f32": (lambda a: a.astype(jnp.float32), f4, f4.astype(F32)),
            "convert f32 -> e2m1 (x 2^-9)": (
                lambda a: (a * F32(512)).astype(jnp.float4_e2m1fn),
                f4.astype(F32) / F32(512),
                f4,
            ),
            "convert f16 -> f32": (
                lambda a: a.astype(jnp.float32),
                np.arange(1, 1024, dtype=np.uint16).view(np.float16),
                np.arange(1, 1024, dtype=np.uint16).view(np.float16).astype(F32),
            ),
            "nvfp4x round_to bf16": (lambda a: round_to(a, jnp.bfloat16), x, bf),
            "nvfp4x narrow bf16": (lambda a: narrow(a, jnp.bfloat16), x, bf),
            "nvfp4x widen bf16": (widen, bf, bf.astype(F32)),
            "nvfp4x widen f16": (
                widen,
                np.arange(1, 1024, dtype=np.uint16).view(np.float16),
                np.arange(1, 1024, dtype=np.uint16).view(np.float16).astype(F32),
            ),
            "nvfp4x fp8_bits e4m3": (
                lambda a: lax.bitcast_convert_type(fp8_bits(a, e4m3), jnp.float8_e4m3fn),
                x8.astype(F32),
                x8,
            ),
            "nvfp4x fp8_values e4m3": (
                lambda b: fp8_values(b, e4m3),
                x8.view(np.uint8),
                x8.astype(F32),
            ),
        }
    print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind})")
    bad = 0
    for name, (fn, arg, want) in rows.items():
        got = np.asarray(jax.jit(fn)(jnp.asarray(arg)))
        verdict = _verdict(got, np.asarray(want), np.asarray(arg))
        allowed = ("keeps", "flushes") if _bf16_array_row(name) else ("keeps",)
        bad += name.startswith("nvfp4x") and verdict not in allowed
        note = "  (a TPU's bfloat16 array: see docs/format.md)" if len(allowed) > 1 else ""
        print(f"{name:28s} {verdict}{note if verdict != 'keeps' else ''}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
