"""The accelerator benchmark under its former name: `benchmarks/bench_accel.py`, which
runs on a GPU and on a TPU (see its docstring for the sections and options).

```
python benchmarks/bench_gpu.py [--lean | --quick | --smoke] [--only SECTION ...] [--out PATH]
```
"""

import sys

try:
    from benchmarks import bench_accel
    from benchmarks.bench_accel import *  # noqa: F403 - the same names under the old module
except ImportError:  # run as a script from inside benchmarks/
    import bench_accel  # pyright: ignore[reportMissingImports]
    from bench_accel import *  # noqa: F403  # pyright: ignore[reportMissingImports]


def main(argv: list[str] | None = None) -> dict:
    """`bench_accel.main`, its table headed `bench_gpu`."""
    return bench_accel.main(argv, prog="bench_gpu")


if __name__ == "__main__":
    main()
    sys.exit(0)
