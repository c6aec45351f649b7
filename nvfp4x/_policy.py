"""Recipes (a format per GEMM operand) and policies (module path -> recipe)."""

import dataclasses
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from ._checks import check_bool, check_str
from ._formats import Format
from ._numerics._constants import NVFP4_BLOCKS, ROW_BLOCK, TILE, is_tile

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The formats of one linear layer's three GEMM operands.

    **Arguments:**

    - `weight`: format of the weight `W` (used by fprop and dgrad); `None` keeps its dtype.
    - `input`: format of the activation `x` (fprop along features, wgrad along tokens).
    - `grad`: format of the output gradient `dy` (dgrad along output features, wgrad
      along tokens).
    - `rht`: apply the random Hadamard transform to both wgrad operands along the token
      axis before quantising them.
    - `name`: a label shown by [`nvfp4x.summary`][].

    Recipes are immutable and hashable; change one with `dataclasses.replace` or
    [`nvfp4x.Recipe.replace`][].

    Raises `TypeError` if a format is not an [`nvfp4x.Format`][], `rht` not a bool or
    `name` not a string, and `ValueError` for
    16x16 blocks on `input` or `grad`, stochastic rounding of `weight` or `input`, or
    `scale_rounding="up"` on `weight` ([`nvfp4x.freeze`][] packs weights with the spec's
    round-to-nearest scales, so a frozen model would not compute what was trained).

    ```python
    recipe = nvfp4x.Recipe(
        weight=nvfp4x.Format("nvfp4", block=(16, 16)),
        input=nvfp4x.Format("nvfp4"),
        grad=None,
        name="w4a4",
    )
    str(recipe)   # 'w4a4(w=nvfp4 16x16, x=nvfp4 1x16, dy=-)'
    ```
    """

    weight: Format | None
    input: Format | None
    grad: Format | None
    rht: bool = False
    name: str = "custom"

    def __post_init__(self):
        object.__setattr__(self, "rht", check_bool(self.rht, "Recipe.rht"))
        check_str(self.name, "Recipe.name", '`"w4a4"`')
        for field in ("weight", "input", "grad"):
            fmt = getattr(self, field)
            if fmt is not None and not isinstance(fmt, Format):
                raise TypeError(
                    f"`Recipe.{field}` must be an `nvfp4x.Format` or None, got "
                    f"{type(fmt).__name__}."
                )
        for field in ("input", "grad"):
            fmt = getattr(self, field)
            if fmt is not None and is_tile(fmt.block):
                raise ValueError(
                    f"`Recipe.{field}` cannot use 16x16 blocks: they are for weights. Use "
                    "`block=(1, 16)`."
                )
        if self.weight is not None and self.weight.rounding == "stochastic":
            raise ValueError("Stochastic rounding of weights is not supported; use 'nearest'.")
        if self.input is not None and self.input.rounding == "stochastic":
            raise ValueError("Stochastic rounding of activations is not supported; use 'nearest'.")
        if self.weight is not None and self.weight.scale_rounding != "nearest":
            raise ValueError(
                f"`Recipe.weight` cannot use `scale_rounding={self.weight.scale_rounding!r}`: "
                "`nvfp4x.freeze` packs weights with round-to-nearest block scales, so a frozen "
                "model would differ from the trained one. Use it on `grad` (or `input`)."
            )

    def replace(self, **changes: Any) -> "Recipe":
        """A copy with some fields changed (checked like a new recipe).

        **Arguments:**

        - `**changes`: new values of fields, by name (`weight`, `input`, `grad`, `rht`,
          `name`).

        **Returns:** a new [`nvfp4x.Recipe`][].

        ```python
        no_rht = nvfp4x.recipes.nvfp4_training().replace(rht=False)
        ```
        """
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        def f(x):
            return "-" if x is None else str(x)

        rht = ", rht" if self.rht else ""
        return f"{self.name}(w={f(self.weight)}, x={f(self.input)}, dy={f(self.grad)}{rht})"


def _nvfp4(block=ROW_BLOCK, rounding="nearest", scale_rounding="nearest") -> Format:
    return Format("nvfp4", block, rounding, scale_rounding)


def _weight_block(weight_block: Any) -> tuple[int, int]:
    """`weight_block` as a tuple, or a `ValueError` naming it (not `block`, which the
    caller did not write)."""
    ok = isinstance(weight_block, tuple | list) and len(weight_block) == 2
    block = tuple(weight_block) if ok else None
    if block is None or not all(type(b) is int for b in block) or block not in NVFP4_BLOCKS:
        raise ValueError(
            f"`weight_block={weight_block!r}` is not supported; use `(1, 16)` (16 elements "
            "along the input features) or `(16, 16)` (16x16 tiles)."
        )
    return block


#: The ready-made recipes by name, in the order `recipes` defines them (`_preset`).
_PRESETS: dict[str, Callable[..., "Recipe"]] = {}


def _preset(fn: Callable[..., Recipe]) -> staticmethod:
    """Register a `recipes` constructor under its name (`recipes.get`, recipe names in
    policies) and make it a static method."""
    _PRESETS[fn.__name__] = fn
    return staticmethod(fn)


class recipes:  # noqa: N801 - a namespace of recipe constructors, used as `nvfp4x.recipes.x()`
    """Ready-made recipes. Each call returns an immutable [`nvfp4x.Recipe`][].

    ```python
    nvfp4x.recipes.nvfp4_training()
    nvfp4x.recipes.nvfp4_inference(weight_block=(16, 16))
    nvfp4x.recipes.get("fp8")   # the same as nvfp4x.recipes.fp8()
    ```
    """

    @_preset
    def nvfp4_training(
        *,
        rht: bool = True,
        stochastic_rounding: bool = True,
        weight_block: Sequence[int] = TILE,
        unbiased_sr: bool = False,
    ) -> Recipe:
        """NVIDIA's NVFP4 training recipe (spec §5): W in 16x16 blocks, x and dy in 1x16
        blocks along each GEMM's contraction axis, dy stochastically rounded, and the
        random Hadamard transform on both wgrad operands along the token axis.

        **Arguments:**

        - `rht`: Hadamard transform of the wgrad operands.
        - `stochastic_rounding`: round `dy` stochastically (else to nearest).
        - `weight_block`: `(16, 16)` (default) or `(1, 16)`.
        - `unbiased_sr`: round `dy`'s E4M3 block scales up (`scale_rounding="up"` on the
          grad format, in dgrad and wgrad), so that no element is clamped at 6 and the
          stochastically rounded gradient is unbiased. The default (False) rounds them to
          nearest, bit for bit as Blackwell does, which clamps the largest elements of
          blocks whose scale rounded down and biases the gradient slightly towards zero
          (the Training guide's "Unbiased stochastic rounding").

        **Returns:** the [`nvfp4x.Recipe`][] named `"nvfp4_training"` (with
        `unbiased_sr=True` its `grad` format reads `nvfp4 1x16, SR, scale up`).

        **Raises:** `TypeError` for a flag that is not a bool (`rht="False"` included);
        `ValueError` for a `weight_block` other than `(1, 16)` or `(16, 16)`.

        ```python
        recipe = nvfp4x.recipes.nvfp4_training(stochastic_rounding=False)
        unbiased = nvfp4x.recipes.nvfp4_training(unbiased_sr=True)
        ```
        """
        rht = check_bool(rht, "rht")
        sr = check_bool(stochastic_rounding, "stochastic_rounding")
        unbiased = check_bool(unbiased_sr, "unbiased_sr")
        return Recipe(
            weight=_nvfp4(_weight_block(weight_block)),
            input=_nvfp4(),
            grad=_nvfp4(
                rounding="stochastic" if sr else "nearest",
                scale_rounding="up" if unbiased else "nearest",
            ),
            rht=rht,
            name="nvfp4_training",
        )

    @_preset
    def nvfp4_inference(*, weight_block: Sequence[int] = ROW_BLOCK) -> Recipe:
        """Weights and inputs in NVFP4 with round-to-nearest (W4A4); gradients, if taken,
        flow unquantised through the quantised operands (straight-through).

        **Arguments:**

        - `weight_block`: the weight's NVFP4 blocks: `(1, 16)` (default; 16 elements
          along the input features) or `(16, 16)` (16x16 tiles, as in training).

        **Returns:** the [`nvfp4x.Recipe`][] named `"nvfp4_inference"`, with `grad=None`.

        ```python
        recipe = nvfp4x.recipes.nvfp4_inference(weight_block=(16, 16))
        ```
        """
        return Recipe(
            weight=_nvfp4(_weight_block(weight_block)),
            input=_nvfp4(),
            grad=None,
            name="nvfp4_inference",
        )

    @_preset
    def nvfp4_weight_only(*, weight_block: Sequence[int] = ROW_BLOCK) -> Recipe:
        """NVFP4 weights, inputs in their own dtype (W4A16).

        **Arguments:**

        - `weight_block`: the weight's NVFP4 blocks: `(1, 16)` (default; 16 elements
          along the input features) or `(16, 16)` (16x16 tiles).

        **Returns:** the [`nvfp4x.Recipe`][] named `"nvfp4_weight_only"`, with `input=None`
        and `grad=None`.

        ```python
        frozen = nvfp4x.freeze(nvfp4x.quantize(model, nvfp4x.recipes.nvfp4_weight_only()))
        ```
        """
        return Recipe(
            weight=_nvfp4(_weight_block(weight_block)),
            input=None,
            grad=None,
            name="nvfp4_weight_only",
        )

    @_preset
    def mxfp8() -> Recipe:
        """MXFP8 (E4M3, 32-element power-of-two blocks) for all three operands.

        **Returns:** the [`nvfp4x.Recipe`][] named `"mxfp8"`.
        """
        f = Format("mxfp8")
        return Recipe(weight=f, input=f, grad=f, name="mxfp8")

    @_preset
    def fp8() -> Recipe:
        """FP8 with current per-tensor scaling: E4M3 forward (W, x), E5M2 gradients.

        **Returns:** the [`nvfp4x.Recipe`][] named `"fp8"`.
        """
        return Recipe(
            weight=Format("fp8_e4m3"),
            input=Format("fp8_e4m3"),
            grad=Format("fp8_e5m2"),
            name="fp8",
        )

    @_preset
    def bf16() -> Recipe:
        """No quantisation: all three GEMMs on bfloat16 operands, float32 accumulation.

        **Returns:** the [`nvfp4x.Recipe`][] named `"bf16"`.
        """
        f = Format("bf16")
        return Recipe(weight=f, input=f, grad=f, name="bf16")

    @_preset
    def float32() -> Recipe:
        """No quantisation: all three GEMMs in float32.

        **Returns:** the [`nvfp4x.Recipe`][] named `"float32"`.
        """
        f = Format("float32")
        return Recipe(weight=f, input=f, grad=f, name="float32")

    @staticmethod
    def get(name: str) -> Recipe:
        """The default recipe of a name, e.g. `recipes.get("nvfp4_training")`.

        **Arguments:**

        - `name`: one of `"nvfp4_training"`, `"nvfp4_inference"`, `"nvfp4_weight_only"`,
          `"mxfp8"`, `"fp8"`, `"bf16"`, `"float32"`; anything else raises `ValueError`.

        **Returns:** the [`nvfp4x.Recipe`][] that `recipes.<name>()` returns.
        """
        if not isinstance(name, str) or name not in RECIPE_NAMES:
            raise ValueError(f"Unknown recipe `{name!r}`; use one of {RECIPE_NAMES}.")
        return _PRESETS[name]()


#: The names of the ready-made recipes (the constructors of `recipes`).
RECIPE_NAMES = tuple(_PRESETS)

RecipeLike = Recipe | str | None


def as_recipe(value: Any, where: str) -> Recipe | None:
    """Accept a `Recipe`, a recipe name or `None`; raise a clear error otherwise."""
    if value is None or isinstance(value, Recipe):
        return value
    if isinstance(value, str):
        if value not in RECIPE_NAMES:
            raise ValueError(f"{where}: unknown recipe `{value!r}`; use one of {RECIPE_NAMES}.")
        return recipes.get(value)
    raise TypeError(
        f"{where} gave {type(value).__name__} `{value!r}`; expected an `nvfp4x.Recipe` (e.g. "
        "`nvfp4x.recipes.nvfp4_training()`), a recipe name, or None."
    )


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class Policy:
    """Ordered rules mapping module paths to recipes. Immutable (and hashable), like a
    recipe: build a new one to change it.

    **Arguments:**

    - `rules`: `(regex, recipe | None)` pairs. A layer's path (such as
      `blocks[3].mlp.layers[0]`) is matched with `re.fullmatch`; the first matching rule
      wins; `None` leaves the layer as it is; a layer no rule matches is left as it is.
    - `strict`: if True (default), `quantize` raises a `ValueError` naming any rule that
      matched no layer (a typo in a path usually).
    - `convolutions`: if True, the rules also select convolutions by their paths
      (Equinox's `eqx.nn.Conv1d/2d/3d`, `ConvTranspose*`, and any module whose call
      runs its `weight` as a `lax.conv_general_dilated` kernel), which then run as their
      GEMM in the rule's recipe (a grouped one as one GEMM per group). By default
      convolutions stay as they are.
    - `tensor_scale_groups`: regexes on layer paths. Quantised layers whose paths match
      the same pattern (`re.fullmatch`, first matching pattern) and agree on its first
      capture group (the whole pattern, if it has none) form a group whose NVFP4 weights
      [`nvfp4x.freeze`][] packs with one shared tensor scale, computed from the largest
      amax in the group (per slice of stacked layers). Serving stacks fuse such layers
      (q/k/v, gate/up) into one GEMM with one tensor scale; see the docs page "Deploying
      NVFP4 models". Freeze-only: training GEMMs keep each weight's own tensor scale, so
      a grouped layer's frozen weight can differ from what its training forward
      quantised (the layer with the group's largest amax is unchanged). With `strict`, a
      pattern that matches no quantised layer is an error.

    ```python
    policy = nvfp4x.Policy([
        (r".*lm_head", None),
        (r"blocks\\[(10|11)\\]\\..*", nvfp4x.recipes.bf16()),
        (r".*", nvfp4x.recipes.nvfp4_training()),
    ], tensor_scale_groups=[r"(.*)\\.attn\\.w[qkv]", r"(.*)\\.mlp\\.w_(gate|up)"])
    ```
    """

    rules: tuple[tuple[re.Pattern, Recipe | None], ...]
    strict: bool
    convolutions: bool
    tensor_scale_groups: tuple[re.Pattern, ...]

    def __init__(
        self,
        rules: Sequence[tuple[str, RecipeLike]],
        *,
        strict: bool = True,
        convolutions: bool = False,
        tensor_scale_groups: Sequence[str] = (),
    ):
        if isinstance(rules, str | bytes | Recipe | Mapping) or not isinstance(rules, Iterable):
            raise TypeError(
                f"`Policy(rules)` must be a list of `(regex, recipe)` pairs, got "
                f"{type(rules).__name__} `{rules!r:.60}`. For one recipe everywhere, pass "
                "the recipe (or its name) to `nvfp4x.quantize` directly, or write "
                '`Policy([(r".*", recipe)])`.'
            )
        recipe = lambda i, pattern, r: as_recipe(r, f"Policy rule {i} (`{pattern}`)")
        object.__setattr__(self, "rules", compile_rules(rules, "Policy rule", "recipe", recipe))
        object.__setattr__(self, "strict", check_bool(strict, "strict"))
        object.__setattr__(self, "convolutions", check_bool(convolutions, "convolutions"))
        if isinstance(tensor_scale_groups, str | bytes):
            raise TypeError(
                "`tensor_scale_groups` must be a sequence of regexes, got the string "
                f"`{tensor_scale_groups!r}`; wrap it in a list."
            )
        if isinstance(tensor_scale_groups, Mapping) or not isinstance(
            tensor_scale_groups, Iterable
        ):
            raise TypeError(
                "`tensor_scale_groups` must be a list of regexes on layer paths, got "
                f"{type(tensor_scale_groups).__name__} `{tensor_scale_groups!r:.60}`; for no "
                "groups leave it out (or pass `[]`), e.g. "
                '`tensor_scale_groups=[r"(.*)\\.attn\\.w[qkv]"]`.'
            )
        groups = []
        for i, pattern in enumerate(tensor_scale_groups):
            try:
                groups.append(re.compile(pattern))
            except (re.error, TypeError) as e:
                raise ValueError(
                    f"`tensor_scale_groups[{i}]`: regex `{pattern!r}` does not compile: {e}."
                ) from e
        object.__setattr__(self, "tensor_scale_groups", tuple(groups))

    def lookup(self, path: str) -> tuple[int | None, Recipe | None]:
        """The first rule that matches `path` (with `re.fullmatch`).

        **Arguments:**

        - `path`: a layer path such as `blocks[3].mlp.fc1`.

        **Returns:** `(index of the first matching rule, its recipe)`, or `(None, None)`
        when no rule matches. The recipe may be `None` (keep the layer as it is).

        **Raises:** `TypeError` if `path` is not a string.
        """
        check_str(path, "path", '`"blocks[3].mlp.fc1"`')
        found = first_rule(self.rules, path)
        return (None, None) if found is None else (found[0], found[2])

    def scale_group(self, path: str) -> tuple[int | None, str | None]:
        """The tensor scale group of the layer at `path` (see `tensor_scale_groups`).

        **Arguments:**

        - `path`: a layer path such as `blocks[3].attn.wq`.

        **Returns:** `(index of the first matching pattern, group key)`, the key being
        `"<index>:<first capture group>"` (e.g. `"0:blocks[3]"`), or `(None, None)` when
        no pattern matches.
        """
        check_str(path, "path", '`"blocks[3].attn.wq"`')
        for i, regex in enumerate(self.tensor_scale_groups):
            m = regex.fullmatch(path)
            if m:
                return i, f"{i}:{m.group(1) if regex.groups else ''}"
        return None, None

    def check_used(self, matched: Collection[int], caller: str, matched_nothing: str) -> None:
        """With `strict`, raise `ValueError` naming the rules whose index is not in
        `matched`: "`caller`: rule 2 `regex` `matched_nothing` Pass `Policy(...,
        strict=False)` to allow unused rules." (the one strict unused-rule report)."""
        unused = [i for i in range(len(self.rules)) if i not in matched]
        if self.strict and unused:
            names = ", ".join(f"rule {i} `{self.rules[i][0].pattern}`" for i in unused)
            raise ValueError(
                f"{caller}: {names} {matched_nothing} Pass `Policy(..., strict=False)` to "
                "allow unused rules."
            )

    def __repr__(self) -> str:
        rules = ", ".join(f"({r.pattern!r}, {rec})" for r, rec in self.rules)
        groups = [r.pattern for r in self.tensor_scale_groups]
        return f"Policy([{rules}]" + (f", tensor_scale_groups={groups})" if groups else ")")


def compile_rules(
    rules: Iterable[Any], what: str, target: str, convert: Callable[[int, str, Any], T]
) -> tuple[tuple[re.Pattern, T], ...]:
    """Ordered `(regex, target)` rules (a `Policy`'s, a names map's), compiled: the one
    place that checks such a list. `what` names a rule in errors (`"Policy rule"`),
    `target` its second item (`"recipe"`); `convert(i, pattern, target)` checks and
    converts rule `i`'s target.

    Raises `TypeError` for a rule that is not a pair, `ValueError` for a regex that does
    not compile (and whatever `convert` raises).
    """
    compiled = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, tuple | list) and len(rule) == 2):
            raise TypeError(f"{what} {i} must be a `(regex, {target})` pair, got {rule!r}.")
        pattern, value = rule
        try:
            regex = re.compile(pattern)
        except (re.error, TypeError) as e:
            raise ValueError(f"{what} {i}: regex `{pattern!r}` does not compile: {e}.") from e
        compiled.append((regex, convert(i, pattern, value)))
    return tuple(compiled)


def first_rule(
    rules: Sequence[tuple[re.Pattern, T]], path: str
) -> tuple[int, re.Match[str], T] | None:
    """The first of ordered rules whose regex matches all of `path` (`re.fullmatch`):
    `(its index, the match, its target)`, or None."""
    for i, (regex, value) in enumerate(rules):
        if m := regex.fullmatch(path):
            return i, m, value
    return None


PolicyLike = Policy | Recipe | str | Callable[[str, Any], RecipeLike]
