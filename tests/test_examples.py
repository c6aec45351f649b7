"""Every example runs end to end in `--smoke` mode.

Each `examples/*.py` runs in its own process (the environment is inherited, so e.g. an
`XLA_FLAGS` set by an example is not disturbed by this test process; the scripts share
the run's compilation cache, see `subprocess_env` in conftest.py), imported through
jaxtyping's import hook with beartype, so that the annotated functions of both the
example and `nvfp4x` are checked at runtime, as the rest of the suite checks `nvfp4x`.
Examples are found by glob: a new example is covered as soon as it exists, and must
accept `--smoke` (and `--out DIR` if it writes files).
"""

import pytest
from helpers import ROOT, run_script

EXAMPLES_DIR = ROOT / "examples"
#: Examples whose `--smoke` run is another test's: name -> where.
RUN_ELSEWHERE = {
    # `--smoke --processes 2` as a script (its processes run `__main__`) and `main(["--smoke"])`
    # in the multi-device process, its module imported through jaxtyping's import hook.
    "sharded_training": "tests/multidevice/test_multiprocess.py",
}
EXAMPLES = sorted(
    p
    for p in EXAMPLES_DIR.glob("*.py")
    if not p.name.startswith("_") and p.stem not in RUN_ELSEWHERE
)
TIMEOUT_S = 300

# Runs `examples/NAME.py` as `__main__` through the import system, so the jaxtyping hook
# instruments it and the packages in `examples/` (`nvfp4_lm`, the main example's code)
# (runpy.run_path would compile it directly, unchecked).
RUNNER = """
import pathlib, runpy, sys
from jaxtyping import install_import_hook
examples, name, *argv = sys.argv[1:]
packages = [p.name for p in pathlib.Path(examples).iterdir() if (p / "__init__.py").exists()]
sys.path.insert(0, examples)
sys.argv = [name + ".py", *argv]
with install_import_hook(["nvfp4x", name, *packages], "beartype.beartype"):
    runpy.run_module(name, run_name="__main__", alter_sys=True)
"""


def test_examples_found():
    names = {p.stem for p in EXAMPLES}
    assert {"train_lm", "quickstart", "custom_policy"} <= names, names
    for name, where in RUN_ELSEWHERE.items():
        assert (EXAMPLES_DIR / f"{name}.py").exists(), name
        assert f"{name}.py" in (ROOT / where).read_text(), (name, where)


def test_train_lm_imports_without_side_effects(capsys, monkeypatch):
    """The benchmarks and tests import the main example's package, `examples/nvfp4_lm`,
    and `examples/train_lm.py` only runs its command line: importing either (afresh
    here) must not train, print or write anything, and the policy's rules must all match
    the model's paths."""
    import importlib
    import sys

    import jax

    import nvfp4x

    for name in [m for m in sys.modules if m.split(".")[0] in ("nvfp4_lm", "train_lm")]:
        monkeypatch.delitem(sys.modules, name)  # put back after the test
    lm = importlib.import_module("nvfp4_lm")
    importlib.import_module("train_lm")
    assert capsys.readouterr().out == ""

    cfg = lm.SMOKE
    model = lm.build_model(cfg, jax.random.key(0))
    qmodel = nvfp4x.quantize(model, lm.paper_policy(cfg))  # strict: every rule used
    last = cfg.n_layers - 1
    assert isinstance(qmodel.blocks[0].mlp.w_gate, nvfp4x.QuantizedLinear)
    assert qmodel.blocks[0].mlp.w_gate.recipe == nvfp4x.recipes.nvfp4_training()
    assert qmodel.blocks[last].attn.wq.recipe == nvfp4x.recipes.bf16()
    assert type(qmodel.lm_head) is type(model.lm_head)  # left as eqx.nn.Linear
    assert "blocks[0].mlp.w_gate" in nvfp4x.summary(qmodel)


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_smoke(path, tmp_path, subprocess_env):
    args = ["--smoke"]
    if "--out" in path.read_text():
        args += ["--out", str(tmp_path / "out")]
    what = f"python examples/{path.name} {' '.join(args)}"
    proc = run_script(
        ["-c", RUNNER, str(EXAMPLES_DIR), path.stem, *args],
        what=what,
        cwd=tmp_path,
        env=subprocess_env,
        timeout=TIMEOUT_S,
    )
    if path.stem == "train_lm":
        assert (tmp_path / "out" / "losses.csv").exists()
        assert (tmp_path / "out" / "loss_curves.png").exists()
        assert "relative gap" in proc.stdout


def test_train_lm_resumes_from_its_last_checkpoint(tmp_path, capsys):
    """`nvfp4_lm.train` with a checkpoint folder (what `--checkpoint-dir` passes): a run
    whose last checkpoint is step 4 of 6 (the later one deleted, as a kill leaves it)
    resumes there and ends with the losses and weights of the run never stopped, bit
    for bit. (A tiny float32 model: the resume logic; killed NVFP4 runs are
    `tests/test_checkpoint.py`'s.)"""
    import dataclasses
    import shutil

    import jax
    import numpy as np
    import nvfp4_lm as lm

    cfg = dataclasses.replace(
        lm.SMOKE, d_model=32, n_layers=1, n_heads=1, seq=16, batch=2, steps=6, warmup=1
    )
    cfg = dataclasses.replace(cfg, data_bytes=20_000, eval_seqs=2)
    data = lm.load_data(cfg)
    model = lm.build_model(cfg, jax.random.key(0))
    folder = tmp_path / "ckpt"
    run = lambda: lm.train(
        model, cfg, data, progress=False, checkpoint_dir=str(folder), checkpoint_every=2
    )
    with jax.numpy_dtype_promotion("standard"):  # as the script runs (optax's Adam needs it)
        whole = run()
        assert sorted(int(p.name) for p in folder.iterdir()) == [4, 6]  # the two latest
        shutil.rmtree(folder / "6")
        resumed = run()
    assert "resumed from step 4" in capsys.readouterr().out
    assert resumed.losses.tobytes() == whole.losses.tobytes()
    for a, b in zip(jax.tree.leaves(resumed.model), jax.tree.leaves(whole.model), strict=True):
        if isinstance(a, jax.Array):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
