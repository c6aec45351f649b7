"""`coverage`: which GEMMs of a traced function ran in which format, with proof."""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax import lax
from jax._src import source_info_util

from ._conv import CONV_PASS, conv_tw_p, conv_tx_p
from ._dispatch import LAYOUT, NORMALISER, record_unquantised
from ._frozen import frozen_grouped_p, frozen_p
from ._gemm import dgrad_p, qdot_p, tw_p, tx_p, wgrad_p
from ._policy import Recipe
from ._prims import GEMM_PRIMITIVES, Literal, jaxprs_in_params, ragged_dot_general_p
from ._probe import layer_stats
from ._qweight import QWeight
from ._ragged import (
    grouped_dgrad_p,
    grouped_qdot_p,
    grouped_tw_p,
    grouped_tx_p,
    grouped_wgrad_p,
)
from ._sites import is_qweight, layer_path, path_str
from ._table import text_table

_PASS = {qdot_p: "fprop", tx_p: "fprop (jvp)", tw_p: "fprop (jvp)", dgrad_p: "dgrad",
         wgrad_p: "wgrad"}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class CoverageRow:
    """One GEMM of the traced program.

    - `path`: the layer (or weight) it consumes, as the policy matches it; for a GEMM
      of two activations (attention's QK and PV) `(activations)`.
    - `pass_`: `"fprop"`, `"dgrad"`, `"wgrad"` for nvfp4x's GEMMs; `"fprop"` or
      `"backward"` for plain ones, `"normaliser"` for the matrix-vector products that
      estimate a weight's normaliser from its master values (`eqx.nn.SpectralNorm`'s σ).
    - `shape`: `(M, K) x (K, N)` with batch dimensions folded into `M`, `batch` times.
    - `flops`: `2 * M * K * N * batch * repeats` (`repeats`: scan iterations).
    - `formats`: `(a, b)`, the format of each operand (`"nvfp4 1x16"`, `"float32"`...).
    - `quantised`: whether the GEMM ran through nvfp4x.
    """

    path: str
    pass_: str
    shape: str
    flops: int
    formats: tuple[str, str]
    quantised: bool

    @property
    def format(self) -> str:
        """The GEMM's format: the operands' common format name, or `a x b`."""
        a, b = (f.split(" ")[0] for f in self.formats)
        return a if a == b else f"{a} x {b}"


@dataclasses.dataclass(frozen=True)
class CoverageReport:
    """What [`nvfp4x.coverage`][] found: every GEMM with its path, pass, shape, FLOPs and
    operand formats; FLOP totals per format; and the selected weights that reached a
    GEMM unquantised (`unquantised`, each `(path, where)`), which should be empty.

    `str(report)` is a table; `report.share("nvfp4")` the fraction of GEMM FLOPs whose
    operands were both NVFP4.
    """

    rows: tuple[CoverageRow, ...]
    unquantised: tuple[tuple[str, str], ...]

    @property
    def total_flops(self) -> int:
        return sum(r.flops for r in self.rows)

    def flops_by_format(self) -> dict[str, int]:
        """`{format: FLOPs}`, largest first."""
        out: dict[str, int] = {}
        for r in self.rows:
            out[r.format] = out.get(r.format, 0) + r.flops
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def share(self, fmt: str = "nvfp4") -> float:
        """The fraction of the GEMM FLOPs that ran in format `fmt` (both operands)."""
        total = self.total_flops
        return self.flops_by_format().get(fmt, 0) / total if total else 0.0

    def __str__(self) -> str:
        header = ("path", "pass", "shape", "FLOPs", "operand a", "operand b")
        body = [(r.path, r.pass_, r.shape, _si(r.flops), *r.formats) for r in self.rows]
        lines = [text_table(header, body)]
        total = self.total_flops
        lines.append("")
        lines.append(f"GEMM FLOPs per format (total {_si(total)}FLOP):")
        for fmt, flops in self.flops_by_format().items():
            lines.append(f"  {fmt:<24} {_si(flops):>9}FLOP  {100 * flops / total:5.1f}%")
        if self.unquantised:
            lines.append("")
            lines.append("SELECTED WEIGHTS THAT REACHED A GEMM UNQUANTISED:")
            lines.extend(f"  {p}: {why}" for p, why in self.unquantised)
        return "\n".join(lines)


def _fmt_name(fmt) -> str | None:
    return None if fmt is None else str(fmt)


def _dtype_name(aval) -> str:
    return np.dtype(aval.dtype).name


def _read_gemm(eqn, passes: dict) -> tuple[Recipe, list, int, int, str]:
    """One of nvfp4x's GEMM equations: `(recipe, operand avals, batch axes, batch
    problems, pass)`, the pass named by `passes`."""
    recipe: Recipe = eqn.params["recipe"]
    avals = [v.aval for v in eqn.invars]
    nb = eqn.params["nbatch"]
    return recipe, avals, nb, math.prod(avals[0].shape[:nb]), passes[eqn.primitive]


def _quantised_row(eqn, repeats: int) -> CoverageRow:
    recipe, avals, nb, batch, kind = _read_gemm(eqn, _PASS)
    if kind == "wgrad":  # ct (tokens..., n), a (tokens..., k)
        ct, a = avals[0], avals[1]
        n, k = ct.shape[-1], a.shape[-1]
        m = math.prod(ct.shape[nb:-1])  # contraction over tokens
        shape, flops = f"({n}, {m}) x ({m}, {k})", 2 * m * n * k
        fa, fb = recipe.grad, recipe.input
    elif kind == "dgrad":  # ct (tokens..., n), wv (n, k)
        ct, wv = avals[0], avals[1]
        n, k = wv.shape[-2], wv.shape[-1]
        m = math.prod(ct.shape[nb:-1])
        shape, flops = f"({m}, {n}) x ({n}, {k})", 2 * m * n * k
        fa, fb = recipe.grad, recipe.weight
    else:  # x (tokens..., k), w (n, k)
        x, w = avals[0], avals[1]
        n, k = w.shape[-2], w.shape[-1]
        m = math.prod(x.shape[nb:-1])
        shape, flops = f"({m}, {k}) x ({k}, {n})", 2 * m * n * k
        fa, fb = recipe.input, recipe.weight
        if eqn.primitive is tw_p:
            fb = None
        if eqn.primitive is tx_p:
            fa = None
    return _recipe_row(eqn, kind, shape, flops * repeats, batch, (fa, fb))


def _recipe_row(
    eqn, kind: str, shape: str, flops: int, batch: int, fmts, path: str | None = None
) -> CoverageRow:
    """The row of one of nvfp4x's GEMMs: `shape` and `flops` of one problem, `batch`
    problems, `fmts` the operands' formats from the recipe (None: the dtype); `path`
    the weight's (default: the primitive's `name`)."""
    if batch > 1:
        shape += f" x{batch}"
    dtype = _dtype_name(eqn.invars[0].aval)
    formats = (_fmt_name(fmts[0]) or dtype, _fmt_name(fmts[1]) or dtype)
    path = path or eqn.params.get("name") or "(unnamed)"
    return CoverageRow(path, kind, shape, flops * batch, formats, True)


def _conv_row(eqn, repeats: int) -> CoverageRow:
    """A convolution's GEMM on the fast path (`_conv.py`): the patch GEMM it computes,
    `(tokens, window x in) x (window x in, out)`, tokens the output pixels."""
    recipe, avals, nb, batch, kind = _read_gemm(eqn, CONV_PASS)
    out = eqn.outvars[0].aval
    if kind == "wgrad":  # ct (images..., out..., n), x (images..., in..., C) -> (n, k)
        ct = avals[0]
        n, k = out.shape[-2], out.shape[-1]
        m = math.prod(ct.shape[nb:-1])
        shape, fmts = f"({n}, {m}) x ({m}, {k})", (recipe.grad, recipe.input)
    elif kind == "dgrad":  # ct (images..., out..., n), wv (n, k)
        ct, wv = avals[0], avals[1]
        n, k = wv.shape[-2], wv.shape[-1]
        m = math.prod(ct.shape[nb:-1])
        shape, fmts = f"({m}, {n}) x ({n}, {k})", (recipe.grad, recipe.weight)
    else:  # x (images..., in..., C), w (n, k) -> (images..., out..., n)
        w = avals[1]
        n, k = w.shape[-2], w.shape[-1]
        m = math.prod(out.shape[nb:-1])
        shape = f"({m}, {k}) x ({k}, {n})"
        fmts = (
            None if eqn.primitive is conv_tx_p else recipe.input,
            None if eqn.primitive is conv_tw_p else recipe.weight,
        )
    return _recipe_row(eqn, kind, shape, 2 * m * n * k * repeats, batch, fmts)


_GROUPED_PASS = {grouped_qdot_p: "fprop", grouped_tx_p: "fprop (jvp)",
                 grouped_tw_p: "fprop (jvp)", grouped_dgrad_p: "dgrad",
                 grouped_wgrad_p: "wgrad"}  # fmt: skip


def _grouped_row(eqn, repeats: int) -> CoverageRow:
    """A grouped GEMM (`ragged_dot` on experts): each token meets one expert, so its
    FLOPs are `2 * tokens * n * k` however many experts there are; the shape shows the
    experts as `[G experts]`."""
    recipe, avals, nb, batch, kind = _read_gemm(eqn, _GROUPED_PASS)
    if kind == "wgrad":  # ct (T, n), a (T, k), sizes (G,)
        ct, a, sizes = avals[0], avals[1], avals[2]
        m, n, k, g = ct.shape[-2], ct.shape[-1], a.shape[-1], sizes.shape[-1]
        shape = f"({n}, {m}) x ({m}, {k}) [{g} experts]"
        fa, fb = recipe.grad, recipe.input
    else:  # x or ct (T, .), w (G, n, k)
        a, w = avals[0], avals[1]
        g, n, k = w.shape[-3], w.shape[-2], w.shape[-1]
        m = a.shape[-2]
        if kind == "dgrad":
            shape = f"({m}, {n}) x ({n}, {k}) [{g} experts]"
            fa, fb = recipe.grad, recipe.weight
        else:
            shape = f"({m}, {k}) x ({k}, {n}) [{g} experts]"
            fa = None if eqn.primitive is grouped_tx_p else recipe.input
            fb = None if eqn.primitive is grouped_tw_p else recipe.weight
    return _recipe_row(eqn, kind, shape, 2 * m * n * k * repeats, batch, (fa, fb))


def _plain_ragged_row(eqn, repeats: int, origin: dict, named: dict) -> CoverageRow:
    """A float `ragged_dot`: `2 * M * K * N` for each of its output's rows (each row is
    one group's product), whichever of its three modes."""
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    out = eqn.outvars[0].aval
    dims = eqn.params["ragged_dot_dimension_numbers"]
    (lc, _), _ = dims.dot_dimension_numbers
    k = math.prod(lhs.shape[i] for i in lc)
    if tuple(dims.lhs_ragged_dimensions)[0] in tuple(lc):  # ragged contraction: (G, ...)
        flops = 2 * math.prod(out.shape[1:]) * k
    else:
        flops = 2 * math.prod(out.shape) * k
    shape = f"ragged {lhs.shape} x {rhs.shape}"
    return _float_row(eqn, origin, named, shape, flops * repeats)


def _frozen_row(eqn, repeats: int) -> CoverageRow:
    """A frozen layer's GEMM on its packed leaves, or frozen experts' grouped GEMM
    (`frozen_grouped_p`), counted as `_grouped_row` counts the unfrozen one: each token
    meets one expert (however the kernel computes it)."""
    p = eqn.params
    recipe: Recipe = p["recipe"]
    grouped = eqn.primitive is frozen_grouped_p  # (x, sizes, *leaves)
    x = eqn.invars[0].aval
    leaves = [v.aval for v in eqn.invars[1 + grouped :]]
    if p.get("indexed"):  # a layer of a stack, by its index (`scan_layers`)
        leaves = leaves[:-1]
    w = jax.tree_util.tree_unflatten(p["wdef"], leaves)
    n, k = w.shape[-2], w.shape[-1]
    if grouped and p["experts_kn"]:
        n, k = k, n
    nb = p["nbatch"]
    m, batch = math.prod(x.shape[nb:-1]), math.prod(x.shape[:nb])
    shape, fmts = f"({m}, {k}) x ({k}, {n})", (recipe.input, recipe.weight)
    flops = 2 * m * n * k * repeats
    if grouped:
        return _recipe_row(eqn, "fprop", f"{shape} [{w.shape[-3]} experts]", flops, batch, fmts)
    return _recipe_row(eqn, "fprop", shape, flops, batch, fmts, "(frozen)")


def _plain_row(eqn, repeats: int, origin: dict, named: dict) -> CoverageRow:
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    if eqn.primitive is lax.dot_general_p:
        (lc, rc), (lb, _) = eqn.params["dimension_numbers"]
        k = math.prod(lhs.shape[i] for i in lc)
        batch = math.prod(lhs.shape[i] for i in lb)
        m = math.prod(lhs.shape) // (k * batch)
        n = math.prod(rhs.shape) // (k * batch)
        shape = f"({m}, {k}) x ({k}, {n})" + (f" x{batch}" if batch > 1 else "")
        flops = 2 * m * n * k * batch
    else:  # convolution: output elements x kernel window x input features x 2
        out = eqn.outvars[0].aval
        flops = 2 * math.prod(out.shape) * math.prod(rhs.shape) // rhs.shape[0]
        shape = f"conv {lhs.shape} * {rhs.shape}"
    return _float_row(eqn, origin, named, shape, flops * repeats)


def _float_row(eqn, origin: dict, named: dict, shape: str, flops: int) -> CoverageRow:
    """The row of a float GEMM (`dot_general`, convolution, `ragged_dot`) of `shape` and
    `flops`: its pass from its name scope, its path from its operands' origins. A GEMM
    whose operands are no model array's (a wgrad: the input times the cotangent) is
    named by the weight of the forward GEMM it derives from, the one traced from the same
    source call (`named`: source call -> the paths of the GEMMs traced there), if that
    call's GEMMs read one weight only."""
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    scope = str(eqn.source_info.name_stack)
    pass_ = "backward" if "transpose" in scope else "fprop"
    if NORMALISER in scope:  # e.g. SpectralNorm's σ, read from the master weight
        pass_ = "normaliser"
    paths = [_origin(origin, v) for v in eqn.invars[:2]]
    path = next((p for p in paths if p is not None), None)
    call = _source_call(eqn)
    if path is not None and call is not None:
        named.setdefault(call, set()).add(path)
    elif path is None and len(known := named.get(call, ())) == 1:
        [path] = known
    path = path or "(activations)"
    formats = (_dtype_name(lhs), _dtype_name(rhs))
    return CoverageRow(path, pass_, shape, flops, formats, False)


def _origin(origin: dict, var) -> str | None:
    return None if isinstance(var, Literal) else origin.get(var)


def _source_call(eqn) -> tuple | None:
    """Where `eqn` was traced from: its user frames (file, lines and columns), the same
    for a GEMM and the backward GEMMs JAX derives from it; None if unknown."""
    frames = source_info_util.user_frames(eqn.source_info.traceback)
    key = tuple(
        (f.file_name, f.start_line, f.start_column, f.end_line, f.end_column) for f in frames
    )
    return key or None


#: nvfp4x's own GEMM primitives and the function that makes each one's row.
_RECIPE_ROWS: dict[Any, Callable[[Any, int], CoverageRow]] = {
    **dict.fromkeys(_PASS, _quantised_row),
    frozen_p: _frozen_row,
    frozen_grouped_p: _frozen_row,
    **dict.fromkeys(_GROUPED_PASS, _grouped_row),
    **dict.fromkeys(CONV_PASS, _conv_row),
}


def _walk(jaxpr, origin: dict, repeats: int, rows: list, flagged: list, selected: set, named: dict):
    """Collect the GEMMs of `jaxpr` (and its sub-jaxprs); `origin` maps a variable to the
    path of the model array it is (through layout changes and placements); `named`, see
    `_float_row`."""
    for eqn in jaxpr.eqns:
        prim = eqn.primitive
        if (row_of := _RECIPE_ROWS.get(prim)) is not None:
            rows.append(row_of(eqn, repeats))
            continue
        if prim in GEMM_PRIMITIVES:
            ragged = prim is ragged_dot_general_p
            row = (_plain_ragged_row if ragged else _plain_row)(eqn, repeats, origin, named)
            rows.append(row)
            if row.path in selected and row.pass_ != "normaliser":
                flagged.append((row.path, f"a plain {prim.name} ({row.pass_})"))
            continue
        if eqn.params.get("name") == layer_stats.__name__:  # telemetry's, not the model's
            continue
        if prim in LAYOUT and _origin(origin, eqn.invars[0]) is not None:
            origin[eqn.outvars[0]] = origin[eqn.invars[0]]
            continue
        times = eqn.params.get("length", 1) if prim is lax.scan_p else 1
        for sub in jaxprs_in_params(eqn.params):
            inner = dict(_map_inputs(eqn, sub, origin))
            _walk(sub, inner, repeats * times, rows, flagged, selected, named)


def _map_inputs(eqn, sub, origin):
    """Pair a sub-jaxpr's inputs with the equation's operands (aligned from the end, as
    control-flow primitives put their extra operands, e.g. a cond's index, first)."""
    outer = [v for v in eqn.invars]
    inner = sub.invars
    offset = len(outer) - len(inner)
    for i, v in enumerate(inner):
        j = i + offset
        if 0 <= j < len(outer) and _origin(origin, outer[j]) is not None:
            yield v, origin[outer[j]]


def coverage(fn: Callable, *args: Any, **kwargs: Any) -> CoverageReport:
    """Trace `fn(*args, **kwargs)` and report every GEMM in it: its path, pass, shape,
    FLOPs and the format of each operand, with FLOP totals per format and, flagged, every
    weight the policy selected that reached a GEMM unquantised.

    `fn` may be a forward pass or a whole training step (`value_and_grad` and an optimiser
    update): the backward GEMMs (dgrad, wgrad) are in the trace and counted. Nothing is
    computed; the function is only traced. Looks through `jit`, `scan` (FLOPs times its
    length), `cond` (every branch), `while` (one iteration), `checkpoint` and custom
    derivatives.

    **Arguments:**

    - `fn`: the function to trace.
    - `*args`, `**kwargs`: its arguments (arrays, models, or `jax.ShapeDtypeStruct`s).

    **Returns:** an [`nvfp4x.CoverageReport`][]: print it, or read `report.share("nvfp4")`
    and `report.unquantised`.

    ```python
    report = nvfp4x.coverage(lambda m, x: jnp.sum(jax.vmap(m)(x)), qmodel, x)
    print(report)
    report.share("nvfp4")   # the fraction of GEMM FLOPs with both operands in NVFP4
    ```
    """
    with record_unquantised() as seen:
        closed, _ = eqx.filter_make_jaxpr(fn)(*args, **kwargs)[:2]
    leaves = jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=is_qweight)[0]
    arrays = [
        (p, x)
        for p, x in leaves
        if eqx.is_array(x) or isinstance(x, QWeight | jax.ShapeDtypeStruct)
    ]
    origin, selected = {}, set()
    for var, p in zip(closed.jaxpr.invars, _expand(arrays), strict=False):
        if p is None:  # an input that is not a model's field: no name
            continue
        origin[var] = p
        if p.startswith("!"):
            origin[var] = p[1:]
            selected.add(p[1:])
    rows: list[CoverageRow] = []
    flagged: list[tuple[str, str]] = []
    _walk(closed.jaxpr, origin, 1, rows, flagged, selected, {})
    unquantised = tuple(dict.fromkeys([*seen, *flagged]))
    return CoverageReport(tuple(rows), unquantised)


def _expand(arrays):
    """The traced inputs' paths in order, relative to their argument (`head.weight` of a
    model passed first), a layer's weight named by its layer (`head`): a `QWeight`
    contributes its array (marked `!`, named by its policy path) and its probe. An input
    that is no module's field (the batch `x`, `(x, y)`) has no path (None): a GEMM of
    it with a layer's weight is named by the layer."""
    for p, x in arrays:
        name = path_str(p[2:])  # past `(args, kwargs)` and the argument
        if isinstance(x, QWeight):
            yield "!" + (x.path or layer_path(name))
            if x.probe is not None:
                yield name + ".probe"
        elif any(isinstance(k, jax.tree_util.GetAttrKey) for k in p[2:]):
            yield layer_path(name)
        else:
            yield None


def _si(flops: int | float) -> str:
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if flops >= size:
            return f"{flops / size:.3g} {unit}"
    return f"{flops:.0f} "
