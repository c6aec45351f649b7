"""Narrow float types (FP8 E4M3 / E5M2, E8M0, bfloat16) to and from float32, on the bits.

XLA converts between float types with a `convert`, which XLA:CPU computes on the bits,
subnormals kept; a TPU flushes float32 subnormals in arithmetic, inputs and results,
and need not keep a subnormal of either type in a `convert` (an FP8 subnormal such as
E4M3's 2^-9 is a normal float32). The functions here move values between the types in
integer arithmetic (and float32 arithmetic on normal values only), so that their bits
are IEEE's on every backend: `tests/flush_subnormals.py` checks them under an XLA:CPU
that flushes every subnormal a `convert` reads or writes.
"""

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, UInt8

#: Per FP8 element kind: `(mantissa bits, exponent bias, the code of +NaN, the code of
#: +inf or None)`.
_FP8 = {
    jnp.dtype(jnp.float8_e4m3fn): (3, 7, 0x7F, None),
    jnp.dtype(jnp.float8_e5m2): (2, 15, 0x7E, 0x7C),
}


def _f32(u: Array) -> Float[Array, "*s"]:
    """The float32 whose bits are the uint32 `u`."""
    return lax.bitcast_convert_type(u, jnp.float32)


def widen(x: Array) -> Float[Array, "*s"]:
    """A float array as float32: bfloat16 and float16 on the bits (their subnormals
    kept where the backend's `convert` may read them as 0), float32 as it is, anything
    else by a cast. bfloat16 is float32's top half; a float16 `s e m` is rebuilt with
    float32's exponent bias, a subnormal one as `m * 2^-24` (a product of normal
    float32 values, exact).

    On a TPU a bfloat16 array's subnormals read as ±0 whatever reads them: a bitcast to
    uint16 gives the flushed bits there (v5e, 2026-12-05: `bitcast`, this shift behind an
    optimisation barrier, and bitcasts of pairs to uint32 all flushed; the array itself
    crossed `device_put` intact). Nothing in a program can see them; the docs' format
    page says so."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bfloat16:
        u = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
        return _f32(u << 16)
    if x.dtype != jnp.float16:
        return x.astype(jnp.float32)
    u = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    e, m = (u >> 10) & 0x1F, u & 0x3FF
    normal = ((e + 112) << 23) | (m << 13)
    special = jnp.uint32(0x7F800000) | (m << 13)  # inf, NaN (payload kept)
    sub = lax.bitcast_convert_type(m.astype(jnp.float32) * (2.0**-24), jnp.uint32)
    mag = jnp.where(e == 0, sub, jnp.where(e == 0x1F, special, normal))
    return _f32(mag | ((u & 0x8000) << 16))


def fp8_bits(v: Float[Array, "*s"], dtype) -> UInt8[Array, "*s"]:
    """The bit patterns of `dtype` (`float8_e4m3fn`, `float8_e5m2` or `float8_e8m0fnu`)
    for float32 values already on its grid (as the quantisers give them: an FP8 value,
    or for E8M0 a power of two from 2^-127 to 2^127), NaN as the type's NaN (with its
    sign for E4M3 and E5M2); ±inf as E5M2's ±inf and E4M3's NaN. Off-grid values give
    garbage (what a `convert` would round, this truncates).

    A normal FP8 value's code is the float32 exponent rebiased and the top mantissa
    bits; a subnormal one's, `|v|` times `2^(bias - 1 + mantissa bits)` (a float32
    product of normal values, exact, an integer).
    """
    dtype = jnp.dtype(dtype)
    bits = lax.bitcast_convert_type(v.astype(jnp.float32), jnp.uint32)
    mag = bits & 0x7FFFFFFF
    nan = mag > 0x7F800000
    if dtype == jnp.float8_e8m0fnu:
        e = jnp.where(mag < 0x00800000, 0, mag >> 23)  # 2^-127 (subnormal float32): 0
        return jnp.where(nan, 0xFF, e).astype(jnp.uint8)
    nmant, bias, nan_code, inf_code = _FP8[dtype]
    min_normal = (127 + 1 - bias) << 23
    normal = (mag >> (23 - nmant)) - ((127 - bias) << nmant)
    scale = float(2 ** (bias - 1 + nmant))
    small = jnp.where(mag < min_normal, _f32(mag), 0.0)  # normal float32 or 0
    sub = (small * scale).astype(jnp.uint32)
    code = jnp.where(mag < min_normal, sub, normal)
    inf = mag == 0x7F800000
    code = jnp.where(inf, nan_code if inf_code is None else inf_code, code)
    code = jnp.where(nan, nan_code, code)
    return (code | ((bits >> 24) & 0x80)).astype(jnp.uint8)


def decode_e4m3(bits: UInt8[Array, "*s"]) -> Float[Array, "*s"]:
    """The float32 values of `float8_e4m3fn` bit patterns, equal to XLA's conversion
    (NaN for `0x7F`/`0xFF`), in integer arithmetic that fuses and vectorises.

    Normal (exponent field `e > 0`): the float32 with exponent `e + 120` and the three
    mantissa bits on top; subnormal: `m * 2^-9`.
    """
    u = bits.astype(jnp.uint32)
    mag = u & 0x7F
    normal = (mag << 20) + (120 << 23)
    sub = lax.bitcast_convert_type((mag & 7).astype(jnp.float32) * (2.0**-9), jnp.uint32)
    out = jnp.where(mag < 8, sub, normal)
    out = jnp.where(mag == 0x7F, jnp.uint32(0x7FC00000), out)
    return lax.bitcast_convert_type(out | ((u & 0x80) << 24), jnp.float32)


def fp8_values(b: UInt8[Array, "*s"], dtype) -> Float[Array, "*s"]:
    """The float32 values of `dtype` bit patterns (`float8_e4m3fn`, `float8_e5m2`,
    `float8_e8m0fnu`), equal to XLA's and ml_dtypes' conversion (NaN as the canonical
    quiet NaN; E8M0's 2^-127 as the float32 subnormal), built from the bits."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float8_e4m3fn:
        return decode_e4m3(b)
    u = b.astype(jnp.uint32)
    if dtype == jnp.float8_e8m0fnu:
        out = jnp.where(u == 0, jnp.uint32(0x00400000), u << 23)
        return _f32(jnp.where(u == 0xFF, jnp.uint32(0x7FC00000), out))
    if dtype != jnp.float8_e5m2:
        raise ValueError(f"`dtype={dtype}` is not an FP8 type nvfp4x stores.")
    mag = u & 0x7F
    normal = (mag << 21) + (112 << 23)
    sub = lax.bitcast_convert_type((mag & 3).astype(jnp.float32) * (2.0**-16), jnp.uint32)
    out = jnp.where(mag < 4, sub, normal)
    out = jnp.where(mag == 0x7C, jnp.uint32(0x7F800000), out)
    out = jnp.where(mag > 0x7C, jnp.uint32(0x7FC00000), out)
    return _f32(out | ((u & 0x80) << 24))


def bfloat16_bits(a: Float[Array, "*s"]) -> Array:
    """float32 `a` rounded to bfloat16 in integer arithmetic: `bits + 0x7FFF + lsb`,
    the low 16 bits dropped (round to nearest, ties to even; a carry moves into the
    exponent, up to inf), subnormals included; a NaN stays NaN (quieted, its sign and
    top payload kept). **Returns:** a bfloat16 array (a bitcast: no `convert`)."""
    bits = lax.bitcast_convert_type(a.astype(jnp.float32), jnp.uint32)
    lsb = (bits >> 16) & 1
    rounded = (bits + 0x7FFF + lsb) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    out = jnp.where(nan, (bits >> 16) | 0x0040, rounded)
    return lax.bitcast_convert_type(out.astype(jnp.uint16), jnp.bfloat16)


def narrow(x: Float[Array, "*s"], dtype) -> Array:
    """float32 `x` as `dtype`, rounded to nearest even: to bfloat16 on the bits
    (`bfloat16_bits`, subnormals kept on every backend), to any other type by a cast
    (float16's subnormals, below 2^-14, are then the backend's: a TPU may flush them)."""
    if jnp.dtype(dtype) == jnp.bfloat16 and x.dtype == jnp.float32:
        return bfloat16_bits(x)
    return x.astype(dtype)
