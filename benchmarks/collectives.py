"""The collectives of a compiled program and the bytes they move, read from its HLO text:
what `bench_sharding.py` compares and `multihost.py` measures (its own module, so that
neither of the two imports the other)."""

import re

import numpy as np

COLLECTIVE = re.compile(
    r"= (\S+) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)\("
)
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "u8": 1, "f64": 8, "pred": 1}


def collectives(text: str) -> list[tuple[str, str]]:
    """`(shape, kind)` of every collective in a compiled program, e.g. `("f32[64,128]",
    "all-gather")`; a scalar's shape ends in `[]`."""
    return [(re.sub(r"\{.*\}", "", s), k) for s, k in COLLECTIVE.findall(text)]


def collective_bytes(text: str) -> int:
    """Bytes moved by the non-scalar collectives of a compiled program."""
    total = 0
    for shape, _ in collectives(text):
        m = re.match(r"([a-z0-9]+)\[([0-9,]*)\]", shape)
        assert m is not None, shape  # every collective's result is `dtype[dims]`
        dtype, dims = m.groups()
        if dims:
            total += _BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",")]))
    return total
