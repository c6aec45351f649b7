"""Independent value tables for the 8-bit formats the library rounds to: FP8 E4M3
(`float8_e4m3fn`: NVFP4's block scales, FP8 and MXFP8 elements), FP8 E5M2 and E8M0
(MXFP8's power-of-two block scales).

Each table is decoded here from the bit layout alone (sign, exponent, mantissa, bias),
cross-checked against ml_dtypes, and then used as the oracle for every code: each value
rounds to itself, each midpoint between neighbours rounds to the even code, values past
the largest finite one saturate, NaN stays NaN, eagerly and under `jax.jit`.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from nvfp4x._numerics._bits import fp8_bits, fp8_values
from nvfp4x._numerics._e4m3 import round_e4m3, round_e5m2
from nvfp4x._numerics._fp8 import quantize_fp8, quantize_mxfp8

CODES = np.arange(256)


def e4m3_table() -> np.ndarray:
    """`float8_e4m3fn` by code: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no
    infinities, S.1111.111 is NaN; exponent 0 is subnormal (m/8 x 2^-6)."""
    sign = np.where(CODES >> 7, -1.0, 1.0)
    e, m = (CODES >> 3) & 0xF, CODES & 0x7
    mag = np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * 2.0 ** (e - 7))
    return np.where((e == 0xF) & (m == 0x7), np.nan, sign * mag)


def e5m2_table() -> np.ndarray:
    """E5M2 by code: 1 sign, 5 exponent (bias 15), 2 mantissa bits, IEEE-like: exponent
    31 is inf (m = 0) or NaN; exponent 0 is subnormal (m/4 x 2^-14)."""
    sign = np.where(CODES >> 7, -1.0, 1.0)
    e, m = (CODES >> 2) & 0x1F, CODES & 0x3
    mag = np.where(e == 0, m / 4 * 2.0**-14, (1 + m / 4) * 2.0 ** (e - 15))
    special = np.where(m == 0, np.inf, np.nan)
    return np.where(e == 0x1F, sign * special, sign * mag)


def e8m0_table() -> np.ndarray:
    """E8M0 by code: an unsigned biased exponent, 2^(code - 127); 0xFF is NaN."""
    return np.where(CODES == 0xFF, np.nan, 2.0 ** (CODES.astype(np.float64) - 127))


def test_tables_agree_with_ml_dtypes():
    """Two independent decoders of the same bits (this file's formulas, ml_dtypes)."""
    for table, dtype in (
        (e4m3_table(), ml_dtypes.float8_e4m3fn),
        (e5m2_table(), ml_dtypes.float8_e5m2),
        (e8m0_table(), ml_dtypes.float8_e8m0fnu),
    ):
        got = CODES.astype(np.uint8).view(dtype).astype(np.float64)
        np.testing.assert_array_equal(got, table, err_msg=str(dtype))


TABLES = {
    "e4m3": (e4m3_table, jnp.float8_e4m3fn),
    "e5m2": (e5m2_table, jnp.float8_e5m2),
    "e8m0": (e8m0_table, jnp.float8_e8m0fnu),
}


@pytest.mark.parametrize("name", sorted(TABLES))
def test_bits_and_values_follow_the_table(name):
    """`fp8_values` decodes every code to the table's float32 value (E8M0's 2^-127 the
    float32 subnormal), and `fp8_bits` encodes every value back to its code (NaN to the
    type's NaN), in integer arithmetic: the same bits under `-p flush_subnormals`, where
    a `convert` flushes every subnormal it reads or writes."""
    table, dtype = TABLES[name]
    want = table().astype(np.float32)
    codes = jnp.asarray(CODES.astype(np.uint8))
    got = np.asarray(jax.jit(fp8_values, static_argnums=1)(codes, dtype))
    np.testing.assert_array_equal(
        got.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)]
    )
    assert np.isnan(got[np.isnan(want)]).all()
    back = np.asarray(jax.jit(fp8_bits, static_argnums=1)(jnp.asarray(want), dtype))
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(back[finite], CODES[finite])
    nan = CODES.astype(np.uint8).view(dtype)[~finite].astype(np.float32)
    assert np.isnan(back.view(dtype).astype(np.float32)[~finite]).all(), nan


def test_table_landmarks():
    """The constants everyone quotes, read off the tables."""
    e4m3, e5m2, e8m0 = e4m3_table(), e5m2_table(), e8m0_table()
    assert np.nanmax(e4m3) == 448.0 and np.isnan(e4m3).sum() == 2  # 0x7F, 0xFF
    assert np.min(e4m3[e4m3 > 0]) == 2.0**-9
    assert np.nanmax(e5m2[np.isfinite(e5m2)]) == 57344.0 and np.min(e5m2[e5m2 > 0]) == 2.0**-16
    assert np.nanmin(e8m0) == 2.0**-127 and np.nanmax(e8m0) == 2.0**127
    # the E2M1 block scale of NVFP4 sits in [2^-9, 448]: 126 positive finite codes
    assert np.sum(np.isfinite(e4m3) & (e4m3 > 0)) == 126


ROUNDERS = {
    "e4m3": (round_e4m3, e4m3_table, 448.0),
    "e5m2": (round_e5m2, e5m2_table, 57344.0),
}
JITTED = {name: jax.jit(fn) for name, (fn, _, _) in ROUNDERS.items()}


def _positive_grid(table: np.ndarray) -> np.ndarray:
    """The finite non-negative values in code order (which is also value order)."""
    return np.unique(table[np.isfinite(table) & (table >= 0)])


def _both(name: str, v: np.ndarray) -> list[np.ndarray]:
    fn = ROUNDERS[name][0]
    x = jnp.asarray(v, jnp.float32)
    return [np.asarray(fn(x), np.float64), np.asarray(JITTED[name](x), np.float64)]


@pytest.mark.parametrize("name", ROUNDERS)
def test_every_value_rounds_to_itself(name):
    table = ROUNDERS[name][1]()
    finite = table[np.isfinite(table)]
    for got in _both(name, finite):
        np.testing.assert_array_equal(got, finite)
        # -0 keeps its sign
        np.testing.assert_array_equal(np.signbit(got), np.signbit(finite))


@pytest.mark.parametrize("name", ROUNDERS)
def test_midpoints_round_to_the_even_code(name):
    """Exactly halfway between neighbours: to the one with an even mantissa (the even
    code); a float32 ulp either side: to the nearer one. Both signs."""
    grid = _positive_grid(ROUNDERS[name][1]())
    lo, hi = grid[:-1], grid[1:]
    mid = (lo + hi) / 2  # exact in float32: neighbours differ in the last mantissa bit only
    assert np.array_equal(mid.astype(np.float32).astype(np.float64), mid)
    lo_even = (np.searchsorted(grid, lo) % 2) == 0  # code of a grid value = its index
    want = np.where(lo_even, lo, hi)
    below = np.nextafter(mid.astype(np.float32), np.float32(0)).astype(np.float64)
    above = np.nextafter(mid.astype(np.float32), np.float32(np.inf)).astype(np.float64)
    for sign in (1.0, -1.0):
        for v, expect in ((mid, want), (below, lo), (above, hi)):
            for got in _both(name, sign * v):
                np.testing.assert_array_equal(got, sign * expect)


@pytest.mark.parametrize("name", ROUNDERS)
def test_saturates_past_the_largest_value_and_keeps_nan(name):
    _, table_fn, top = ROUNDERS[name]
    grid = _positive_grid(table_fn())
    assert grid[-1] == top
    step = grid[-1] - grid[-2]
    beyond = np.array([top + step / 2, top + step, 2 * top, 3.0e38], np.float64)
    for got in _both(name, np.concatenate([beyond, -beyond, [np.nan]])):
        np.testing.assert_array_equal(got[:4], top)
        np.testing.assert_array_equal(got[4:8], -top)
        assert np.isnan(got[8])


def test_fp8_tensor_scaling_lands_on_the_table():
    """`quantize_fp8`'s element values are table values, scaled by amax / max."""
    x = jax.random.normal(jax.random.key(0), (64, 64), jnp.float32) * 3.0
    for kind, table in (("e4m3", e4m3_table()), ("e5m2", e5m2_table())):
        q, scale = quantize_fp8(x, kind, jnp.max(jnp.abs(x)))
        values = set(table[np.isfinite(table)].tolist())
        assert set(np.asarray(q, np.float64).ravel().tolist()) <= values
        top = 448.0 if kind == "e4m3" else 57344.0
        assert float(scale) == np.float32(float(jnp.max(jnp.abs(x)))) * np.float32(1 / top)


def test_mxfp8_block_scales_are_e8m0_values():
    """Every MXFP8 block scale is the smallest E8M0 value s with amax / s <= 448
    (spec §6: `2^ceil(log2(amax / 448))`), read off the table, for block maxima across
    the whole float32 range; the elements are E4M3 table values."""
    table = e8m0_table()
    finite = table[np.isfinite(table)]
    rng = np.random.default_rng(0)
    exps = rng.uniform(-120, 127, size=96)
    amax = (2.0**exps * rng.uniform(1, 2, size=96)).astype(np.float32)
    amax = np.concatenate([amax, np.float32([448.0, 448.0 * 2**-10, 449.0, 896.0])])
    blocks = np.zeros((amax.size, 32), np.float32)
    blocks[:, 0] = amax
    blocks[:, 1] = -amax / 3
    q, scale = quantize_mxfp8(jnp.asarray(blocks))
    q, scale = np.asarray(q, np.float64), np.asarray(scale, np.float64)[:, 0]
    a = amax.astype(np.float64)
    # smallest table value s with a / s <= 448, clamped to the library's normal range
    want = np.array([finite[np.argmax(a_i / finite <= 448.0)] for a_i in a])
    want = np.clip(want, 2.0**-126, 2.0**127)
    np.testing.assert_array_equal(scale, want)
    assert np.isin(scale, finite).all()
    e4m3 = e4m3_table()
    assert np.isin(q, e4m3[np.isfinite(e4m3)]).all()
