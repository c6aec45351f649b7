"""Every page's Python snippets run: the ```python blocks of README.md and
docs/*.md, in order, one namespace per page, as a reader would paste them.

Markers in the Markdown (HTML comments, invisible on the site), right before a block:

- `<!-- docs-test: skip REASON -->`: the block does not run here (it needs a GPU, files
  or a cluster, or is a signature rather than code); the reason is required.
- `<!-- docs-test: setup` ... `-->`: Python run before the block, in the page's namespace,
  for the context the page assumes (a `model`, a batch) at a small size.

Every page starts with the imports the docs take for granted (`eqx`, `jax`, `jnp`, `np`,
`optax`, `nvfp4x`). Blocks run in a temporary directory, with JAX's standard dtype
promotion (what users have), and any warning is an error: a snippet that warns is a
snippet to fix (a block that means to show a warning catches it).
"""

import dataclasses
import os
import re
import textwrap
import warnings

import jax
import pytest
from helpers import ROOT

PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>\S*)\s*$")
_SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s+(?P<reason>.*?)\s*-->", re.S)
_SETUP = re.compile(r"<!--\s*docs-test:\s*setup\s*\n(?P<code>.*?)-->", re.S)
_PRELUDE = """\
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import nvfp4x
"""


@dataclasses.dataclass
class Block:
    line: int  # of the opening fence
    code: str
    setup: str  # hidden setup code run before it
    skip: str | None  # the reason it does not run


def python_blocks(text: str) -> list[Block]:
    """The page's ```python blocks, each with the markers in the text right before it."""
    lines = text.splitlines()
    blocks, i, since = [], 0, 0  # `since`: where the text before this block starts
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or not m["lang"]:
            i += 1
            continue
        start, indent = i, len(m["indent"])
        i += 1
        while i < len(lines) and not _FENCE.match(lines[i]):
            i += 1
        if m["lang"] == "python":
            before = "\n".join(lines[since:start])
            tail = before[before.rfind("```") + 3 :] if "```" in before else before
            skip, setup = _SKIP.search(tail), _SETUP.search(tail)
            body = "\n".join(line[indent:] for line in lines[start + 1 : i])
            blocks.append(
                Block(
                    start + 1,
                    body,
                    textwrap.dedent(setup["code"]) if setup else "",
                    skip["reason"] if skip else None,
                )
            )
        i += 1
        since = i
    return blocks


def test_markers_are_found():
    text = textwrap.dedent(
        """\
        ```python
        a = 1
        ```
        <!-- docs-test: skip needs a GPU -->
        ```python
        gpu()
        ```
        <!-- docs-test: setup
        b = 2
        -->
          ```python
          c = b
          ```
        """
    )
    blocks = python_blocks(text)
    assert [(b.line, b.code, b.setup, b.skip) for b in blocks] == [
        (1, "a = 1", "", None),
        (5, "gpu()", "", "needs a GPU"),
        (11, "c = b", "b = 2\n", None),
    ]


@pytest.mark.parametrize("page", PAGES, ids=PAGES)
def test_page_snippets_run(page, tmp_path, monkeypatch):
    blocks = python_blocks((ROOT / page).read_text())
    runnable = [b for b in blocks if b.skip is None]
    if not runnable:
        pytest.skip(f"{page} has no Python block to run")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{page}"}
    exec(compile(_PRELUDE, page, "exec"), namespace)
    with jax.numpy_dtype_promotion("standard"), warnings.catch_warnings():
        warnings.simplefilter("error")
        for b in runnable:
            where = f"{page}, the block at line {b.line}"
            try:
                if b.setup:
                    setup = f"{page} (setup before line {b.line})"
                    exec(compile(b.setup, setup, "exec"), namespace)
                exec(compile(b.code, f"{page}:{b.line}", "exec"), namespace)
            except Exception as e:
                raise AssertionError(f"{where} fails: {type(e).__name__}: {e}") from e
    assert os.getcwd() == str(tmp_path)


_STACKED = """
class Stack(eqx.Module):
    blocks: eqx.nn.Linear  # eqx.filter_vmap-built: weight (3, 32, 32), run by lax.scan
    head: eqx.nn.Linear

    def __call__(self, x):
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)
        step = lambda h, block: (jnp.tanh(eqx.combine(block, static)(h)), None)
        return self.head(jax.lax.scan(step, x, dynamic)[0])

keys = jax.random.split(jax.random.key(0), 3)
stack = eqx.filter_vmap(lambda k: eqx.nn.Linear(32, 32, key=k))(keys)
model = Stack(stack, eqx.nn.Linear(32, 8, key=keys[0]))
rules = [(r"head", nvfp4x.recipes.bf16()), (r".*", nvfp4x.recipes.nvfp4_training())]
policy = nvfp4x.Policy(rules)
qmodel = nvfp4x.quantize(model, policy)
x, y = jnp.ones((8, 32)), jnp.zeros((8, 8))
loss_fn = lambda m, x, y: jnp.mean((jax.vmap(m)(x) - y) ** 2)
names = {"blocks": "layers.{i}", "head": "head"}
"""


def test_calibration_snippet_runs_on_stacked_layers(tmp_path, monkeypatch):
    """deploying.md's W4A4 calibration (its page runs it on the README's model) on a
    `filter_vmap` stack scanned over, with a bf16 head: one amax per slice."""
    [block] = [
        b for b in python_blocks((ROOT / "docs/deploying.md").read_text()) if "input_amax" in b.code
    ]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(_PRELUDE + _STACKED, namespace)
    with jax.numpy_dtype_promotion("standard"):
        exec(block.code, namespace)
    assert namespace["amax"]["blocks"].shape == (3,)
    assert set(namespace["amax"]) == {"blocks"}
    assert (tmp_path / "out" / "w4a4" / "model.safetensors").exists()
