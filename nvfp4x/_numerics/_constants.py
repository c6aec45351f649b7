"""Named limits of the formats nvfp4x implements (spec §1, §6)."""

import numpy as np

#: Elements per NVFP4 block (along one axis).
BLOCK = 16
#: NVFP4's blocks: 16 elements along the last axis, and 16x16 tiles (weights).
ROW_BLOCK = (1, BLOCK)
TILE = (BLOCK, BLOCK)
#: The blocks an NVFP4 array or operand may have, the default first.
NVFP4_BLOCKS = (ROW_BLOCK, TILE)
#: Bytes of packed E2M1 codes per block along the last axis (two codes per byte).
BLOCK_BYTES = BLOCK // 2
#: Elements per MXFP8 block.
MX_BLOCK = 32
#: Largest E2M1 magnitude.
E2M1_MAX = 6.0
#: Largest finite E4M3 (`float8_e4m3fn`) magnitude.
E4M3_MAX = 448.0
#: Largest finite E5M2 magnitude.
E5M2_MAX = 57344.0
#: Smallest normal E4M3 magnitude; below it E4M3 is subnormal with step 2^-9.
E4M3_MIN_NORMAL = 2.0**-6
#: `E4M3_MAX * E2M1_MAX`: the largest magnitude one NVFP4 block can hold at unit tensor scale.
NVFP4_RANGE = E4M3_MAX * E2M1_MAX
#: Smallest normal E5M2 magnitude; below it E5M2 is subnormal with step 2^-16.
E5M2_MIN_NORMAL = 2.0**-14
#: float32's largest finite value.
FLT_MAX = float(np.finfo(np.float32).max)
#: `f32(1/6)`, the constant of the block-scale formula.
INV_E2M1_MAX = float(np.float32(1.0) / np.float32(6.0))
#: Magnitudes of the E2M1 codes 0..7; bit 3 of a code is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: `2^32 / golden ratio`, odd: the multiplicative hashing constant (Knuth) with which
#: the GEMM mixes a weight checksum into its seed and checkpoints hash their words.
GOLDEN_RATIO_32 = 0x9E3779B9
#: The sign vector of the random Hadamard transform, as Transformer Engine uses it.
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def is_tile(block: object) -> bool:
    """Whether `block` is NVFP4's 16x16 tile (one scale for 16 rows and 16 columns of a
    weight) rather than a block along one axis: the one spelling of that question."""
    return isinstance(block, tuple | list) and tuple(block) == TILE
