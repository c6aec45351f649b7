"""IEEE float32 results that do not depend on how a device treats subnormals or divides.

The spec's formulas are IEEE float32, subnormals included. XLA on CPU runs with
denormals-are-zero and flush-to-zero (measured with jax 0.10 on x86, eagerly and under
`jit`: `f32(1e-40) * 2 == 0`, `f32(1e-40) == 0` is True, a max-reduction over
`[1e-40, 2e-40]` gives 0), GPUs keep subnormals, and XLA's constant folding keeps them
too. So any float operation that reads a subnormal operand, or whose result lands below
2^-126, gives different bits on different devices, and even under `jit` and eagerly when
a constant gets folded.

The helpers here reproduce the IEEE results with integer operations on bit patterns and
float operations whose operands and results are all normal (or irrelevant), so their
bits are the same on every device, whatever its subnormal mode. Products of exact
operands are never contracted differently: where a multiplication feeds an addition, the
product is exact, so an FMA gives the same bits.

Division is exact too (`divide`, `reciprocal`): a backend's float32 `/` need not be
correctly rounded (XLA:GPU's is not), so its quotient serves only as an estimate that
integer arithmetic corrects; `tests/test_exactness.py` checks that no other float
division reaches XLA from the quantisers and GEMMs.

Powers of two are applied by adding to the exponent bits (`ldexp_normal`), never by
chains of multiplications by constants: XLA's simplifier folds `(x * 2^75) * 2^74` into
`x * 2^149`, whose constant is inf (or, scaling down, a subnormal that a flushing device
reads as 0).
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from ._bits import widen
from ._constants import FLT_MAX

#: Bits of the smallest normal float32, 2^-126: `|x|` bits below it are zero or subnormal.
MIN_NORMAL_BITS = 0x00800000
#: Bits of +inf; `|x|` bits above it are NaN.
INF_BITS = 0x7F800000

#: The bits of 2^23.
_BITS_2_23 = 0x4B000000


def abs_bits(x: Float[Array, "*s"]) -> Int[Array, "*s"]:
    """The bits of `|x|` as int32: ordered as the magnitudes, NaN above +inf."""
    return jax.lax.bitcast_convert_type(widen(x), jnp.int32) & 0x7FFFFFFF


def from_bits(b: Int[Array, "*s"]) -> Float[Array, "*s"]:
    """The float32 whose bits are the int32 `b`."""
    return jax.lax.bitcast_convert_type(b.astype(jnp.int32), jnp.float32)


def is_zero(x: Float[Array, "*s"]) -> Bool[Array, "*s"]:
    """`x == +0.0` by its bits: false for a subnormal, which a DAZ device compares equal
    to 0. (Deliberately not `(bits & 0x7FFFFFFF) == 0`: LLVM rewrites that test as the
    float comparison `x == 0.0`, assuming IEEE subnormals, and XLA:CPU then runs it with
    DAZ on; measured with jax 0.10. A test of `+0.0` alone has no float equivalent.)"""
    return jax.lax.bitcast_convert_type(widen(x), jnp.int32) == 0


def ldexp_normal(x: Float[Array, "*s"], k: int | Int[Array, "*s"]) -> Float[Array, "*s"]:
    """`x * 2^k` by adding `k` to the exponent bits: exact for a normal `x` whose result
    is normal; anything else (0, subnormal, inf, NaN, or a result out of the normal
    range) gives garbage, so mask those cases with `jnp.where`."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return from_bits(bits + (k << 23))


def scale_down_149(c: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """`c * 2^-149` for `mul_normal`: exact when `|c| >= 2^23` (a normal result), 0 for
    smaller finite `c`, and `c` itself when inf or NaN. (The threshold is an integer
    constant: the Pallas kernel body calls this, and Triton does not bitcast constants.)"""
    bits = abs_bits(c)
    ok = bits >= _BITS_2_23
    out = jnp.where(ok, ldexp_normal(jnp.where(ok, c, 1.0), -149), 0.0)
    return jnp.where(bits >= INF_BITS, c, out)


def mul_normal(
    x: Float[Array, "..."], c: Float[Array, "..."], c_sub: Float[Array, "..."] | None = None
) -> Float[Array, "..."]:
    """`x * c` rounded once, reading a subnormal `x` exactly; `c` is normal (or NaN/inf).

    Exact whenever the IEEE product is at least 2^-103 in magnitude, or overflows (and
    for a normal `x`, whenever it is normal). Smaller products come out as some value of
    the right sign below 2^-103 (possibly ±0): use this only where such values round to
    zero next, as E2M1 codes (below 0.25) and E4M3 block scales (below 2^-10) do.

    A subnormal `x = m * 2^-149` (`m` its 23-bit field, exact as a float) is multiplied
    as `m * c_sub` with `c_sub = scale_down_149(c)` (pass it when `c` is broadcast, so it
    is computed once): exact when `|c| >= 2^23`; for smaller `c` the product is below
    2^-103 and `c_sub = 0` is used.
    """
    x = x.astype(jnp.float32)
    c = jnp.asarray(c, jnp.float32)
    if c_sub is None:
        c_sub = scale_down_149(c)
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    sub = (bits & INF_BITS) == 0
    m = (bits & 0x007FFFFF).astype(jnp.float32)
    m = from_bits(jax.lax.bitcast_convert_type(m, jnp.int32) | (bits & jnp.int32(-(2**31))))
    return jnp.where(sub, m * c_sub, x * c)


def scale_up_149(s: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """`s * 2^149` exactly for `0 <= s < 2^-21`, subnormals included (normal result)."""
    bits = abs_bits(s)
    sub = bits < MIN_NORMAL_BITS
    return jnp.where(sub, bits.astype(jnp.float32), ldexp_normal(jnp.where(sub, 1.0, s), 149))


#: Below this `s`, `mul_exact` takes its exact-rounding path (see there).
TINY_SCALE = 2.0**-64


def is_tiny_scale(s: Float[Array, "*s"]) -> Bool[Array, "*s"]:
    """Whether `mul_exact(p, s)` needs its exact path (`s < 2^-64`): only then can a
    product with `s` of an E2M1 value times an E4M3 scale (at least 2^-10) be subnormal."""
    return abs_bits(s) < abs_bits(jnp.float32(TINY_SCALE))


def split_12(x: Float[Array, "*s"]) -> tuple[Float[Array, "*s"], Float[Array, "*s"]]:
    """`x = hi + lo` exactly (Dekker's split of a float32): `hi` is `x` with the low 12
    bits of its significand cleared, so that for a normal `x` each half has at most 12
    significant bits and the product of two halves is exact."""
    hi = from_bits(jax.lax.bitcast_convert_type(x, jnp.int32) & ~0xFFF)
    return hi, x - hi  # exact: |hi| <= |x| < 2 |hi|


def round_with_remainder(
    t: Float[Array, "*s"], err: Float[Array, "*s"], rint: Callable[[Array], Array] = jnp.round
) -> Float[Array, "*s"]:
    """`t + err` rounded to an integer, half to even, for `t` exactly representable with
    its fraction and `err` an exact remainder of magnitude below half an ulp of `t`:
    `rint(t)` (a half-to-even rounding), a tie (`t` halfway) broken by the sign of
    `err`."""
    r = rint(t)
    frac = t - r  # exact
    n = r + jnp.where((frac == 0.5) & (err > 0), 1.0, 0.0)
    return n - jnp.where((frac == -0.5) & (err < 0), 1.0, 0.0)


def mul_exact(
    p: Float[Array, "..."],
    s: Float[Array, "..."],
    tiny: Bool[Array, "..."] | None = None,
    rint: Callable[[Array], Array] = jnp.round,
) -> Float[Array, "..."]:
    """The IEEE float32 product `p * s`, subnormal results and operands included.

    Preconditions (true of every use in nvfp4x): `p` is 0, NaN, or normal with at most
    12 significant bits and `2^-24 <= |p| <= 2^24` (an E2M1 value times an E4M3 scale,
    or an E4M3 scale); `s` is positive and finite, possibly subnormal (a tensor scale).

    For `s >= 2^-64` no operand or result is subnormal and this is `p * s`. Below,
    `sigma = s * 2^149` (exact, normal) is split into two 12-bit halves, so that
    `p * sigma = A + B` with both products exact; `S + err = A + B` exactly (Fast2Sum),
    and the result is `S * 2^-149` when normal, or else the subnormal whose 23-bit field
    is `A + B` rounded to the nearest integer, ties to even, built from its bits.

    The Pallas kernel body passes `tiny = is_tiny_scale(s)` (Triton does not bitcast the
    constant it compares with) and `rint`, a half-to-even rounding of `0 <= t < 2^23`
    without `jnp.round` (which Triton lacks).
    """
    p = p.astype(jnp.float32)
    s = jnp.asarray(s, jnp.float32)
    if tiny is None:
        tiny = is_tiny_scale(s)
    sigma = jnp.where(tiny, scale_up_149(s), 1.0)
    hi, lo = split_12(sigma)
    a = jnp.abs(p)
    big_a, small_b = a * hi, a * lo  # exact: at most 24 significant bits each
    total = big_a + small_b
    err = small_b - (total - big_a)  # Fast2Sum: total + err == big_a + small_b exactly
    t = jnp.where(total < 2.0**23, total, 0.0)  # (unused above: keeps `rint` in range)
    n = round_with_remainder(t, err, rint)
    sub = from_bits(n.astype(jnp.int32))
    normal = total >= 2.0**23
    mag = jnp.where(normal, ldexp_normal(jnp.where(normal, total, 1.0), -149), sub)
    sign = jax.lax.bitcast_convert_type(p, jnp.int32) & jnp.int32(-(2**31))
    y = from_bits(jax.lax.bitcast_convert_type(mag, jnp.int32) | sign)
    return jnp.where(tiny & ~jnp.isnan(p), y, p * s)


#: The name scope of `divide`: the one place in nvfp4x where a float `div` may be traced
#: (its float estimate, corrected exactly in integers). `tests/test_exactness.py` checks
#: every public quantiser's and GEMM's jaxpr for float divisions outside it.
EXACT_DIVISION = "nvfp4x_exact_division"


def _significand(bits: Int[Array, "*s"]) -> tuple[Int[Array, "*s"], Int[Array, "*s"]]:
    """`(M, E)` with `|x| = M * 2^(E - 150)` and `2^23 <= M < 2^24`, from the bits of a
    finite nonzero `|x|`: the normal significand and biased exponent, or for a subnormal
    its field shifted up to 24 bits (`E <= 0` then)."""
    sub = bits < MIN_NORMAL_BITS
    shift = jnp.where(sub, jax.lax.clz(jnp.maximum(bits, 1)) - 8, 0)
    m = jnp.where(sub, bits << shift, (bits & 0x007FFFFF) | MIN_NORMAL_BITS)
    return m, jnp.where(sub, 1 - shift, bits >> 23)


def _rne_quotient(ma: Int[Array, "*s"], mb: Int[Array, "*s"], t: Int[Array, "*s"]):
    """`RNE(ma * 2^t / mb)` for 24-bit `ma, mb` and `0 <= t <= 24` where the quotient is
    below 2^24, exactly, on any backend: a float estimate (the backend's `/`, which may be
    off by an ulp or two), then the remainder `ma * 2^t - q * mb`, small, so exact modulo
    2^32 in uint32 arithmetic, one correction by `floor(rem / mb)` (at most two either
    way, counted by comparisons), and round half to even on it."""
    num = ldexp_normal(ma.astype(jnp.float32), t)  # exact: at most 2^48
    q = jnp.floor(num / mb.astype(jnp.float32)).astype(jnp.int32)
    u32 = jnp.uint32
    rem = (ma.astype(u32) << t.astype(u32)) - q.astype(u32) * mb.astype(u32)
    rem = jax.lax.bitcast_convert_type(rem, jnp.int32)
    steps = [rem >= mb, rem >= 2 * mb, rem < 0, rem < -mb]
    d = sum(s.astype(jnp.int32) * w for s, w in zip(steps, (1, 1, -1, -1), strict=True))
    q, rem = q + d, rem - d * mb
    up = (2 * rem > mb) | ((2 * rem == mb) & ((q & 1) == 1))
    return q + up.astype(jnp.int32)


def divide(a: Float[Array, "..."], b: Float[Array, "..."]) -> Float[Array, "..."]:
    """The IEEE float32 quotient `a / b`, correctly rounded (ties to even), on every
    backend, whatever its `/` and its subnormal mode: zeros, subnormal operands and
    results, overflow to inf, inf and NaN all as IEEE has them (NaN results are the
    canonical quiet NaN).

    A GPU's float32 `/` is not correctly rounded (XLA:GPU's was measured 1 ulp off for
    1.15% of reciprocals on an H200), so a quotient that decides bits (a tensor scale,
    an inverse block scale, an FP8 element) goes through here. With `|a| = Ma 2^(Ea-150)`
    and `|b| = Mb 2^(Eb-150)` (`_significand`), the quotient's significand is
    `RNE(Ma 2^t / Mb)`, with `t = 23` or `24` for a normal result (24 bits) and fewer
    for a subnormal one, computed exactly in integers (`_rne_quotient`); the sign is the
    xor of the signs. Float operations appear only in the estimate, under the name scope
    `EXACT_DIVISION`.
    """
    with jax.named_scope(EXACT_DIVISION):
        a = jnp.asarray(a, jnp.float32)
        b = jnp.asarray(b, jnp.float32)
        a, b = jnp.broadcast_arrays(a, b)
        ia = jax.lax.bitcast_convert_type(a, jnp.int32)
        ib = jax.lax.bitcast_convert_type(b, jnp.int32)
        sign = (ia ^ ib) & jnp.int32(-(2**31))
        xa, xb = ia & 0x7FFFFFFF, ib & 0x7FFFFFFF
        nan = (xa > INF_BITS) | (xb > INF_BITS) | ((xa == 0) & (xb == 0))
        nan = nan | ((xa == INF_BITS) & (xb == INF_BITS))
        inf = (xa == INF_BITS) | (xb == 0)
        zero = (xa == 0) | (xb == INF_BITS)
        finite = ~(nan | inf | zero)
        ma, ea = _significand(jnp.where(finite, xa, MIN_NORMAL_BITS))
        mb, eb = _significand(jnp.where(finite, xb, MIN_NORMAL_BITS))
        mag = _quotient_bits(ma, ea, mb, eb)
        mag = jnp.where(inf, INF_BITS, jnp.where(zero, 0, mag))
        return jnp.where(nan, jnp.float32(jnp.nan), from_bits(mag | sign))


def _quotient_bits(ma, ea, mb, eb) -> Int[Array, "..."]:
    """The bits of `|a| / |b|` rounded to float32 (ties to even), from the significands
    and exponents of finite nonzero operands (`_significand`)."""
    below = (ma < mb).astype(jnp.int32)
    e = ea - eb + 127 - below  # the result's biased exponent, if normal
    normal = e >= 1
    t = jnp.where(normal, 23 + below, 22 + below + e)  # fewer bits when subnormal
    n = _rne_quotient(ma, mb, jnp.clip(t, 0, 24))
    n = jnp.where(t >= 0, n, jnp.where((t == -1) & (ma > mb), 1, 0))
    # A significand rounded up to 2^24 carries into the exponent, a subnormal one to
    # 2^23 into the smallest normal: adding to the bits does both.
    mag = jnp.where(normal, ((e - 1) << 23) + n, n)
    return jnp.where(normal & ((e >= 255) | (mag >= INF_BITS)), INF_BITS, mag)


def reciprocal(s: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """The IEEE float32 `1 / s`, as `divide(1, s)` bit for bit (subnormal results
    included: the tensor decode scale `s_dec = 1 / S_enc` is subnormal when `S_enc >
    2^126`), in fewer operations: the dividend's significand and exponent are constants."""
    with jax.named_scope(EXACT_DIVISION):
        ib = jax.lax.bitcast_convert_type(jnp.asarray(s, jnp.float32), jnp.int32)
        xb = ib & 0x7FFFFFFF
        finite = (xb != 0) & (xb < INF_BITS)
        mb, eb = _significand(jnp.where(finite, xb, MIN_NORMAL_BITS))
        one = jnp.full_like(mb, MIN_NORMAL_BITS)  # 1.0: significand 2^23, exponent 127
        mag = _quotient_bits(one, jnp.full_like(eb, 127), mb, eb)
        mag = jnp.where(xb == 0, INF_BITS, jnp.where(xb == INF_BITS, 0, mag))
        out = from_bits(mag | (ib & jnp.int32(-(2**31))))
        return jnp.where(xb > INF_BITS, jnp.float32(jnp.nan), out)


def reciprocal_capped(p: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """`min(1 / p, FLT_MAX)` in IEEE float32 for `p >= 0` (`reciprocal`), reading a subnormal
    `p` exactly; `p = 0` gives FLT_MAX; NaN stays NaN."""
    r = reciprocal(p)
    return jnp.where(jnp.isnan(r), r, jnp.minimum(r, FLT_MAX))


def _normal_parts(bits: Int[Array, "*s"]) -> tuple[Int[Array, "*s"], Int[Array, "*s"]]:
    """`_significand` of a positive normal float32's bits (no subnormal path)."""
    return (bits & 0x007FFFFF) | MIN_NORMAL_BITS, bits >> 23


def constant_over(c: float, b: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """`divide(c, b)` bit for bit, for a positive normal float32 constant `c` and a
    positive normal `b` whose quotient is at least 2^-126 (normal, or inf on overflow);
    any other `b` gives garbage (mask it). A third of `divide`'s operations: the
    dividend is a constant, and neither operand nor the result is zero, subnormal,
    infinite or NaN (`encode_scale`'s `2688 / amax`)."""
    cbits = int(np.float32(c).view(np.int32))
    if not MIN_NORMAL_BITS <= cbits < INF_BITS:
        raise ValueError(f"`c={c!r}` is not a positive normal float32.")
    with jax.named_scope(EXACT_DIVISION):
        mb, eb = _normal_parts(jax.lax.bitcast_convert_type(jnp.asarray(b, jnp.float32), jnp.int32))
        ma = (cbits & 0x007FFFFF) | MIN_NORMAL_BITS
        below = (mb > ma).astype(jnp.int32)
        e = (cbits >> 23) - eb + 127 - below  # the quotient's biased exponent (>= 1)
        n = _rne_quotient(jnp.full_like(mb, ma), mb, 23 + below)
        mag = ((e - 1) << 23) + n  # a significand rounded up to 2^24 carries
        return from_bits(jnp.where((e >= 255) | (mag >= INF_BITS), INF_BITS, mag))


def reciprocal_of_normal(s: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """`reciprocal(s)` bit for bit for a positive normal `s` (the result may be subnormal)
    or NaN (NaN); any other `s` gives garbage (mask it). The tensor decode scale
    `1 / S_enc`, without `reciprocal`'s paths for zeros, subnormals, infinities and
    signs."""
    with jax.named_scope(EXACT_DIVISION):
        bits = abs_bits(s)
        nan = bits > INF_BITS
        mb, eb = _normal_parts(jnp.where(nan, MIN_NORMAL_BITS, bits))
        one = jnp.full_like(mb, MIN_NORMAL_BITS)  # 1.0: significand 2^23, exponent 127
        mag = _quotient_bits(one, jnp.full_like(eb, 127), mb, eb)
        return jnp.where(nan, jnp.float32(jnp.nan), from_bits(mag))
