"""Names: nvfp4x module paths -> checkpoint module names (`hf_names`, `NameRules`, and
the `names` argument of `export_hf` / `import_hf` made into one callable)."""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._checks import check_str
from .._policy import compile_rules, first_rule


def _check_template(i: int, pattern: str, template: Any) -> str:
    example = f'`r"model.\\1.mlp"` (the template for the regex `{pattern}`)'
    return check_str(template, f"rules[{i}][1]", example)


class NameRules:
    """A names map made of `(regex, template)` rules: the first regex that matches a
    module path (`re.fullmatch`) gives its checkpoint name, `match.expand(template)`
    (so `\\1` is the first capture group). A template holding `{i}` names a stacked
    module (built with `eqx.filter_vmap`, a leading layer axis): one tensor per slice,
    `{i}` replaced by the slice's index. Calling it on a path no rule matches returns None.

    Make one with [`nvfp4x.hf_names.rules`][]; `nvfp4x.hf_names.llama` is one.
    """

    def __init__(self, rules: Sequence[tuple[str, str]]):
        self.rules = compile_rules(rules, "Names rule", "template", _check_template)

    def __call__(self, path: str) -> str | None:
        found = first_rule(self.rules, path)
        return None if found is None else found[1].expand(found[2])

    def __repr__(self) -> str:
        return f"NameRules({[(r.pattern, t) for r, t in self.rules]})"


def _llama_rules() -> list[tuple[str, str]]:
    """The example model's map (`examples/nvfp4_lm/model.py`'s field names): its fields
    are the example's, not a convention of nvfp4x or of Equinox."""
    top = [
        (r"embed", "model.embed_tokens"),
        (r"norm", "model.norm"),
        (r"lm_head", "lm_head"),
    ]
    per_block = [
        (r"attn_norm", "input_layernorm"),
        (r"mlp_norm", "post_attention_layernorm"),
        (r"attn\.wq", "self_attn.q_proj"),
        (r"attn\.wk", "self_attn.k_proj"),
        (r"attn\.wv", "self_attn.v_proj"),
        (r"attn\.wo", "self_attn.o_proj"),
        (r"mlp\.w_gate", "mlp.gate_proj"),
        (r"mlp\.w_up", "mlp.up_proj"),
        (r"mlp\.w_down", "mlp.down_proj"),
    ]
    rules = list(top)
    for field, hf in per_block:
        rules.append((rf"blocks\[(\d+)\]\.{field}", rf"model.layers.\1.{hf}"))
        rules.append((rf"blocks\.{field}", "model.layers.{i}." + hf))
    return rules


class hf_names:  # noqa: N801 - a namespace, used as `nvfp4x.hf_names.llama`
    """Ready names maps for [`nvfp4x.export_hf`][] / [`nvfp4x.import_hf`][], and a
    builder for others.

    - `hf_names.llama`: the map of the example model, the Llama-style model of
      `examples/train_lm.py` (`examples/nvfp4_lm/`). It names that model's own fields,
      which are the example's choice, not a convention of nvfp4x or Equinox: another
      model needs its own map (a dict, or `hf_names.rules`). The fields: `embed`,
      `blocks[i].attn_norm`, `blocks[i].attn.wq/wk/wv/wo`, `blocks[i].mlp_norm`,
      `blocks[i].mlp.w_gate/w_up/w_down`, `norm`, `lm_head`, named as Hugging Face's
      `LlamaForCausalLM` names its modules (`model.embed_tokens`,
      `model.layers.i.input_layernorm`, `model.layers.i.self_attn.q_proj`,
      `model.layers.i.post_attention_layernorm`, `model.layers.i.mlp.gate_proj`,
      `model.norm`, `lm_head`). Blocks stacked with `eqx.filter_vmap` (paths
      `blocks.attn.wq`, one leading layer axis) map to `model.layers.{i}.…`: one tensor
      per layer.

    ```python
    nvfp4x.hf_names.llama("blocks[3].attn.wq")   # 'model.layers.3.self_attn.q_proj'
    nvfp4x.hf_names.llama("blocks.mlp.w_up")     # 'model.layers.{i}.mlp.up_proj'
    ```
    """

    llama = NameRules(_llama_rules())

    @staticmethod
    def rules(rules: Sequence[tuple[str, str]]) -> NameRules:
        """A names map from `(regex, template)` rules on module paths.

        **Arguments:**

        - `rules`: pairs; the first regex that matches a module path (`re.fullmatch`)
          gives its checkpoint name, `match.expand(template)` (`\\1` is the first
          capture group). `{i}` in a template marks a stacked module: one tensor per
          slice of its leading axis, `{i}` replaced by the index.

        **Returns:** a callable `path -> name | None` (None where no rule matches, which
        `export_hf` / `import_hf` report as an error naming the path).

        ```python
        names = nvfp4x.hf_names.rules([
            (r"layers\\[(\\d+)\\]\\.fc1", r"model.layers.\\1.mlp.up_proj"),
            (r"head", "lm_head"),
        ])
        ```
        """
        return NameRules(rules)


NamesLike = Mapping[str, str] | Callable[[str], Any]


def namer(names: Any) -> Callable[[str], Any]:
    if isinstance(names, Mapping):
        return names.get
    if callable(names):
        return names
    raise TypeError(
        f"`names` must be a dict (module path -> checkpoint name), a callable, or a ready "
        f"map such as `nvfp4x.hf_names.llama`; got {type(names).__name__}."
    )
