"""Run every benchmark (format, training, compile, inference, sensitivity, sharding,
export, convolutions); one table.

```
python benchmarks/run_all.py [--quick] [--out benchmarks/results.md]
python -m benchmarks [--quick] [--out ...]
```

Each benchmark is a module `benchmarks/bench_<name>.py` with `main(argv) -> dict`. A
module that does not exist yet gets a "missing" row; one that raises gets an "error" row
and the others still run. `--quick` passes the module's quick-mode argv (its
`QUICK_ARGV` if it defines one, else `--quick`, else `--smoke`); a module that accepts
none of them is skipped rather than run at full size.
"""

import argparse
import importlib
import inspect
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BENCHMARKS = (
    "bench_format",
    "bench_training",
    "bench_compile",
    "bench_inference",
    "bench_sensitivity",
    "bench_sharding",
    "bench_export",
    "bench_conv",
    "bench_moe",
)
QUICK_CANDIDATES = (["--quick"], ["--smoke"])


def describe_machine() -> dict[str, str]:
    """Platform, CPU count, Python, JAX version and the default device."""
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu count": str(os.cpu_count()),
        "python": platform.python_version(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        model = names[0] if names else ""
        if model:
            info["cpu model"] = model
    except OSError:
        pass
    try:
        import jax

        import nvfp4x._formats

        info["fast GEMM operands"] = str(nvfp4x._formats.fast_gemm_dtype())
        devices = jax.devices()
        info["jax"] = jax.__version__
        info["backend"] = jax.default_backend()
        info["devices"] = f"{len(devices)} x {devices[0].device_kind}"
    except Exception as e:  # noqa: BLE001 - the description must not stop the run
        info["jax"] = f"unavailable ({type(e).__name__}: {e})"
    return info


def _import(name: str):
    """The module `benchmarks.<name>`, or None when its file does not exist."""
    if not (HERE / f"{name}.py").exists():
        return None
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(f"benchmarks.{name}")


def _takes_argv(main) -> bool:
    try:
        return len(inspect.signature(main).parameters) > 0
    except (TypeError, ValueError):
        return True


def _call(main, argv: list[str]) -> Any:
    return main(argv) if _takes_argv(main) else main()


def run_one(name: str, quick: bool) -> tuple[str, Any, float]:
    """`(status, results or message, seconds)` for one benchmark module."""
    t0 = time.perf_counter()
    try:
        module = _import(name)
    except Exception as e:  # noqa: BLE001
        return "error", f"import failed: {type(e).__name__}: {e}", time.perf_counter() - t0
    if module is None:
        return "missing", f"benchmarks/{name}.py does not exist", 0.0
    main = getattr(module, "main", None)
    if not callable(main):
        return "error", f"benchmarks/{name}.py has no `main(argv)`", 0.0
    if quick and _takes_argv(main):
        own = getattr(module, "QUICK_ARGV", None)
        candidates = [list(own)] if own is not None else list(QUICK_CANDIDATES)
    else:
        candidates = [[]]
    for argv in candidates:
        try:
            result = _call(main, argv)
        except SystemExit as e:  # argparse rejects an unknown quick flag with exit code 2
            if e.code == 2 and argv and len(candidates) > 1:
                continue
            return "error", f"exited with {e.code!r} (argv {argv})", time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - one failing benchmark must not hide the rest
            traceback.print_exc()
            return "error", f"{type(e).__name__}: {e}", time.perf_counter() - t0
        return "ok", result, time.perf_counter() - t0
    return "skipped", "accepts no quick-mode flag; run it without --quick", 0.0


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _flatten(result: Any, prefix: str = "") -> list[tuple[str, str]]:
    if isinstance(result, dict):
        rows = []
        for k, v in result.items():
            rows += _flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return rows
    return [(prefix or "result", _fmt(result))]


def render(machine: dict[str, str], results: list[tuple[str, str, Any, float]], quick: bool) -> str:
    """The markdown page: the machine, then one table of every benchmark's figures."""
    # Headings start at level 2: the docs' Benchmarks page includes this file.
    lines = ["## Results of `python -m benchmarks`", ""]
    if quick:
        lines += ["Quick mode (`--quick`): small sizes, figures are indicative only.", ""]
    lines += ["### Machine", "", "| | |", "| --- | --- |"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in machine.items()]
    lines += ["", "### Figures", "", "| benchmark | metric | value |", "| --- | --- | --- |"]
    for name, status, payload, seconds in results:
        bench = name.removeprefix("bench_")
        if status == "ok":
            for metric, value in _flatten(payload):
                lines.append(f"| {bench} | {_fmt(metric)} | {value} |")
            lines.append(f"| {bench} | wall time (s) | {seconds:.1f} |")
        else:
            lines.append(f"| {bench} | **{status}** | {_fmt(payload)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, to check it runs")
    parser.add_argument("--out", type=Path, default=HERE / "results.md", help="markdown file")
    parser.add_argument(
        "--only", nargs="+", choices=BENCHMARKS, default=list(BENCHMARKS), help="a subset"
    )
    args = parser.parse_args(argv)

    machine = describe_machine()
    results = []
    for name in args.only:
        print(f"[run_all] {name} ...", file=sys.stderr, flush=True)
        status, payload, seconds = run_one(name, args.quick)
        print(f"[run_all] {name}: {status} ({seconds:.1f}s)", file=sys.stderr, flush=True)
        results.append((name, status, payload, seconds))
    page = render(machine, results, args.quick)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page)
    print(page)
    print(f"[run_all] wrote {args.out}", file=sys.stderr)
    return 1 if any(status == "error" for _, status, _, _ in results) else 0


if __name__ == "__main__":
    sys.exit(main())
