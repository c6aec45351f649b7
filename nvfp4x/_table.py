"""Plain-text tables, as `summary`, `CoverageReport` and `SensitivityReport` print them."""

from collections.abc import Sequence


def text_table(
    header: Sequence[object], body: Sequence[Sequence[object]], footer: Sequence[object] = ()
) -> str:
    """Columns left-aligned to their widest cell, two spaces apart, a rule of dashes under
    the header, and the `footer` row (if any) between two more rules under the body."""
    table = [list(map(str, row)) for row in (header, *body, *([footer] if footer else []))]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in table]
    rule = "  ".join("-" * w for w in widths)
    lines.insert(1, rule)
    if footer:
        lines.insert(len(lines) - 1, rule)
    return "\n".join(lines)
