"""Where `split_blocks` of an NVFP4 operand loses values on a TPU (issue 36): each step's
bits against NumPy's (ml_dtypes) on the same inputs. Prints the first differences."""

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4x._formats import Format, quantize_operand
from nvfp4x._kernels._native import NVFP4, split_blocks

x = np.random.default_rng(8).standard_normal((24, 64)).astype(np.float32)
x *= np.exp2(np.arange(-12, 12)[:, None]).astype(np.float32)
values, _ = jax.jit(lambda a: quantize_operand(a, Format("nvfp4"), axis=-1))(jnp.asarray(x))
v = np.asarray(values, np.float32)
codes, scales = jax.jit(lambda a: split_blocks(a, NVFP4))(values)
c = np.asarray(codes.astype(jnp.float32))
s = np.asarray(scales.astype(jnp.float32))
s_bits = np.asarray(jax.lax.bitcast_convert_type(scales, jnp.uint8))
print("backend", jax.default_backend())
back = c * np.repeat(s, 16, axis=-1)
bad = np.argwhere(back != v)
print("differences (host decode of device codes/scales):", len(bad))
for r, k in bad[:8]:
    b = k // 16
    blk = v[r, 16 * b : 16 * b + 16]
    print(
        f"row {r} block {b}: values {blk[:6]} codes {c[r, 16 * b : 16 * b + 6]} "
        f"scale {s[r, b]!r} bits {s_bits[r, b]:#04x} vmax/6 {np.abs(blk).max() / 6!r}"
    )
# The same from the device's decode (the test's way).
dev_back = np.asarray(codes.astype(jnp.float32) * jnp.repeat(scales.astype(jnp.float32), 16, -1))
print("differences (device decode):", int((dev_back != v).sum()))
e4 = np.asarray([2.0**-9, 3 * 2.0**-9, 2.0**-7], np.float32)
print(
    "f32->e4m3->f32 on device:",
    np.asarray(jnp.asarray(e4).astype(jnp.float8_e4m3fn).astype(jnp.float32)),
)
print(
    "jit where+convert:",
    np.asarray(
        jax.jit(lambda a: jnp.where(a > 0, a, 1.0).astype(jnp.float8_e4m3fn).astype(jnp.float32))(
            jnp.asarray(e4)
        )
    ),
)
f4 = np.asarray([0.5, 1, 1.5, 3, 6], np.float32)
print(
    "f32->e2m1->f32 on device:",
    np.asarray(jax.jit(lambda a: a.astype(jnp.float4_e2m1fn).astype(jnp.float32))(jnp.asarray(f4))),
)
print("host e4m3 of scales:", np.asarray(s[np.unique(bad[:, 0]), :4]) if len(bad) else "-")
