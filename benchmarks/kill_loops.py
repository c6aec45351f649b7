"""The long variants of the files' kill loops and fuzzes (the test suite runs them for a
few seconds): nothing lost, nothing let in.

    python -m benchmarks.kill_loops                  # 60 s per kill loop, 2,000 damaged steps
    python -m benchmarks.kill_loops --seconds 600 --cases 10000 --seed 3

1. `export_hf` itself, in a child process that exports two models (weights-only and
   W4A4) into one folder alternately, killed with SIGKILL at random moments and started
   again until `--seconds` have passed: after every kill the folder must read, with
   `import_hf`, as exactly one of the two exports, its two configs agreeing.
2. The test suite's export kill loop (`tests/test_hf_files.py`: the write phase alone,
   with a reader running meanwhile) for `--seconds`.
3. The test suite's fuzz of damaged training-checkpoint metadata
   (`tests/test_checkpoint.py`) with `--cases` cases.

Not a timed benchmark: it prints what it did and exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

EXPORTER = r"""
import sys
import equinox as eqx
import jax
import nvfp4x

names = {"layers[0]": "model.layers.0.mlp.up_proj", "layers[1]": "model.layers.0.mlp.down_proj"}
mlp = eqx.nn.MLP(32, 32, 32, 1, key=jax.random.key(3))
models = [
    (nvfp4x.freeze(nvfp4x.quantize(mlp, "nvfp4_weight_only")), None),
    (nvfp4x.freeze(nvfp4x.quantize(mlp, "nvfp4_inference")), {"layers[0]": 2.0, "layers[1]": 3.5}),
]
i = 0
while True:
    frozen, amax = models[i % 2]
    nvfp4x.export_hf(frozen, sys.argv[1], names=names, input_amax=amax,
                     hf_config={"architectures": ["TinyMLP"]})
    print(i, flush=True)
    i += 1
"""


def export_hf_kill_loop(seconds: float, rng: random.Random) -> int:
    import equinox as eqx
    import jax

    import nvfp4x

    names = {"layers[0]": "model.layers.0.mlp.up_proj", "layers[1]": "model.layers.0.mlp.down_proj"}
    mlp = lambda: eqx.nn.MLP(32, 32, 32, 1, key=jax.random.key(3))
    likes = {
        recipe: eqx.filter_eval_shape(lambda r=recipe: nvfp4x.freeze(nvfp4x.quantize(mlp(), r)))
        for recipe in ("nvfp4_weight_only", "nvfp4_inference")
    }
    with tempfile.TemporaryDirectory() as tmp:
        target = os.path.join(tmp, "served")
        start, kills = time.monotonic(), 0
        while time.monotonic() - start < seconds:
            proc = subprocess.Popen(
                [sys.executable, "-c", EXPORTER, target], stdout=subprocess.PIPE, text=True
            )
            assert proc.stdout is not None
            first = proc.stdout.readline()
            if first.strip() != "0":
                proc.kill()
                raise RuntimeError(f"the exporter failed before its first export: {first!r}")
            time.sleep(rng.uniform(0.0, 0.5))
            proc.kill()
            proc.communicate()
            kills += 1
            read = []
            for recipe, like in likes.items():
                try:
                    nvfp4x.import_hf(target, like, names=names)
                    read.append(recipe)
                except ValueError as e:
                    if "quantisation mismatch" not in str(e):
                        raise
            if len(read) != 1:
                raise AssertionError(f"kill {kills}: the folder reads as {read}")
            with open(os.path.join(target, "config.json")) as f:
                theirs = json.load(f)["quantization_config"]["quant_algo"]
            with open(os.path.join(target, "hf_quant_config.json")) as f:
                ours = json.load(f)["quantization"]["quant_algo"]
            if theirs != ours:
                raise AssertionError(f"kill {kills}: config.json {theirs}, hf_quant_config {ours}")
        return kills


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="per kill loop")
    parser.add_argument("--cases", type=int, default=2000, help="damaged training steps")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    kills = export_hf_kill_loop(args.seconds, rng)
    print(f"export_hf killed {kills} times: the folder always read as one whole export")
    env = {
        **os.environ,
        "NVFP4X_KILL_SECONDS": str(args.seconds),
        "NVFP4X_FUZZ_CASES": str(args.cases),
        "NVFP4X_FUZZ_SEED": str(args.seed),
    }
    tests = [
        "tests/test_hf_files.py::test_export_killed_at_random_moments_leaves_one_whole_export",
        "tests/test_checkpoint.py::"
        "test_damaged_metadata_is_refused_as_corrupted_naming_the_folder_and_step",
    ]
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-n", "0", *tests]
    sys.exit(subprocess.run(command, cwd=ROOT, env=env).returncode)


if __name__ == "__main__":
    main()
