"""Which buffers a compiled step holds at its peak: a rough liveness walk over the
optimised, scheduled HLO of a program (issue 37: the NVFP4 step's temporaries).

```
python benchmarks/hlo_memory.py PROGRAM.hlo.txt[.gz] [--top N]
```

`bench_accel.py --only profile --out PATH` writes each profiled program's optimised HLO
next to `PATH` (`<PATH>.<label>.hlo.txt.gz`); on a TPU its entry computation is in the
order the program runs. This walks that order: every instruction that makes a buffer in
device memory (not an alias: `get-tuple-element`, `bitcast`, `tuple`; not the arguments,
constants or the program's outputs; not operands placed in another memory space, layouts
with `S(n)`, a TPU's VMEM and SMEM) holds its bytes from its instruction to its last
use. It prints the largest sum and the buffers live there, each with its instruction,
the line range it lives over and its JAX source (`op_name`). XLA's own buffer assignment
shares and reuses buffers that this walk counts apart, and allocates a `conditional`'s
branch buffers, which it does not see, so its peak is not `memory_analysis()`'s
temporaries: it says which arrays make them up.
"""

import argparse
import gzip
import re
import sys
from typing import NamedTuple

_INSTRUCTION = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$")
_ARRAY = re.compile(
    r"\b(pred|[su](?:4|8|16|32|64)|bf16|f16|f32|f64|f8e\w+)\[([\d,]*)\](\{[^}]*\})?"
)
#: Instructions that make no buffer of their own.
_ALIASES = {"get-tuple-element", "bitcast", "tuple", "parameter", "constant", "after-all"}
#: Instructions whose operand lists are followed by attributes naming computations.
_CALLS = ("calls=", "branch_computations=", "to_apply=", "condition=", "body=")


class Buffer(NamedTuple):
    name: str
    opcode: str
    start: int
    end: int
    nbytes: int
    shape: str
    source: str


def array_bytes(shape: str) -> int:
    """Bytes of the arrays in an HLO shape (a tuple's elements summed), those whose layout
    puts them in another memory space (`S(n)`) left out."""
    total = 0
    for dtype, dims, layout in _ARRAY.findall(shape):
        if layout and "S(" in layout:
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        width = re.match(r"[a-z]+?(\d+)", dtype)  # (s4, f8e4m3fn, bf16, f32...; pred: a byte)
        total += n * (int(width.group(1)) if width else 8) // 8
    return total


def entry_lines(text: str) -> list[str]:
    """The instruction lines of the module's entry computation."""
    start = re.search(r"^ENTRY .*\{\s*$", text, re.M)
    if not start:
        raise ValueError("no ENTRY computation in the HLO text")
    lines = []
    for line in text[start.end() :].splitlines():
        if line.strip() == "}":
            break
        lines.append(line)
    return lines


def buffers(text: str) -> list[Buffer]:
    """The entry computation's buffers with their live ranges (instruction indices)."""
    parsed = []
    for line in entry_lines(text):
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        root, name, shape, opcode, rest = m.groups()
        operands = rest
        for marker in (*_CALLS, "metadata=", "backend_config=", "custom_call_target="):
            operands = operands.split(marker)[0]
        source = re.search(r'op_name="([^"]*)"', rest)
        parsed.append(
            (name, shape, opcode, re.findall(r"%([\w.\-]+)", operands), bool(root), source)
        )
    index = {p[0]: i for i, p in enumerate(parsed)}

    def origins(name: str, seen: frozenset = frozenset()) -> set[str]:
        """The buffer-making instructions whose buffers `name` is (aliases followed)."""
        if name not in index or name in seen:
            return set()
        _, _, opcode, operands, _, _ = parsed[index[name]]
        if opcode in ("get-tuple-element", "bitcast", "tuple"):
            return (
                set().union(*(origins(o, seen | {name}) for o in operands)) if operands else set()
            )
        return {name}

    last: dict[str, int] = {}
    outputs: set[str] = set()
    for i, (name, _, _, operands, root, _) in enumerate(parsed):
        for o in operands:
            for b in origins(o):
                last[b] = i
        if root:
            outputs |= origins(name)
    result = []
    for i, (name, shape, opcode, _, _, source) in enumerate(parsed):
        if opcode in _ALIASES or opcode.endswith("-start") or name in outputs:
            continue
        nbytes = array_bytes(shape)
        if nbytes:
            where = source.group(1) if source else ""
            result.append(Buffer(name, opcode, i, last.get(name, i), nbytes, shape, where))
    return result


def peak(bufs: list[Buffer]) -> tuple[int, int, list[Buffer]]:
    """`(bytes, instruction index, buffers live there)` at the largest sum."""
    events = sorted({b.start for b in bufs})
    best = (0, 0, [])
    for i in events:
        live = [b for b in bufs if b.start <= i <= b.end]
        total = sum(b.nbytes for b in live)
        if total > best[0]:
            best = (total, i, live)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("hlo")
    p.add_argument("--top", type=int, default=20)
    a = p.parse_args(argv)
    opener = gzip.open if a.hlo.endswith(".gz") else open
    with opener(a.hlo, "rt") as f:
        bufs = buffers(f.read())
    total, at, live = peak(bufs)
    print(
        f"{len(bufs)} buffers; the largest sum live: {total / 2**20:,.0f} MiB at instruction {at}"
    )
    for b in sorted(live, key=lambda b: -b.nbytes)[: a.top]:
        print(
            f"{b.nbytes / 2**20:9,.1f} MiB  {b.start:5d}-{b.end:<5d} {b.opcode:13s} "
            f"{b.name:30s} {b.shape[:60]}  {b.source[-80:]}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
