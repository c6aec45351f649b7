"""Communication of a sharded NVFP4 training step against the unquantised one.

For each layout of a two-layer MLP (`d=128`, hidden `256`) on a 4 x 2 (data x model)
mesh of 8 devices, both programs (`jax.value_and_grad` of the loss, jitted) are compiled
and the bytes moved by their non-scalar collectives are summed from the compiled HLO.
The quantised program may add scalar all-reduces (the global amax of each quantised
tensor); beyond those, the target is a ratio of at most 1.

    python benchmarks/bench_sharding.py

Needs 8 devices: on a machine with fewer it runs itself again in a subprocess with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` (host CPU devices). The multi-device
tests (`tests/multidevice/`) assert the same comparison.

    python benchmarks/bench_sharding.py --processes 2

compares JAX's multi-process runtime instead: the training run of
`benchmarks/multihost.py` (a stack of blocks, `nvfp4_training()`, data parallel x FSDP on
a 2 x 4 mesh, automatic and explicit axes) on 2 processes x 4 devices (gloo over the
loopback interface) against 1 process x 8 devices: step time (for information: loopback
gloo is not a datacentre network) and the bytes moved by the step's non-scalar
collectives (target: the same).
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import nvfp4x

if __package__ is None or __package__ == "":  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks import multihost  # noqa: E402
from benchmarks.collectives import collective_bytes, collectives  # noqa: E402

D, H = 128, 256
QUICK_ARGV: list[str] = []  # already quick (compilation only): `run_all --quick` runs it as is
LAYOUTS = ("dp", "fsdp_rows", "fsdp_cols", "tp")
# (layout, tokens, activations pinned to the batch axis, weight block rows): with many
# tokens per weight XLA gathers FSDP weights; with fewer tokens than features it may
# gather activations instead. The last two are the known gaps (docs/sharding.md).
CASES = (
    *((layout, 1024, False, 16) for layout in LAYOUTS),
    ("fsdp_rows", 64, True, 16),
    ("fsdp_cols", 64, True, 16),
    ("tp", 64, True, 16),
    ("fsdp_rows", 64, False, 16),
    ("fsdp_rows", 1024, False, 1),
)


def make_mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def model() -> eqx.nn.MLP:
    return eqx.nn.MLP(D, D, H, 1, key=jax.random.key(0))


def loss(model, x):
    return jnp.mean(jax.vmap(model)(x) ** 2)


def pinned_loss(mesh):
    """`loss` with every layer's output pinned to the batch axis, as training code that
    keeps activations data-parallel does."""
    act = NamedSharding(mesh, P("data"))

    def fn(model, x):
        h = x
        for i, layer in enumerate(model.layers):
            h = jax.lax.with_sharding_constraint(jax.vmap(layer)(h), act)
            h = model.activation(h) if i < len(model.layers) - 1 else h
        return jnp.mean(h**2)

    return fn


def spec(layout: str, path: str, leaf) -> P:
    """The partition spec of one leaf of the MLP under `layout`."""
    if layout == "dp" or leaf.ndim == 0:
        return P()
    if layout == "fsdp_rows":
        return P("data") if leaf.ndim == 2 else P()
    if layout == "fsdp_cols":
        return P(None, "data") if leaf.ndim == 2 else P()
    # tensor parallel: first layer column-parallel (out sharded), second row-parallel (in).
    if "layers[0]" in path:
        return P("model")
    return P(None, "model") if leaf.ndim == 2 else P()


def shard(model, mesh, layout: str):
    def put(path, leaf):
        if not eqx.is_array(leaf):
            return leaf
        return jax.device_put(
            leaf, NamedSharding(mesh, spec(layout, jax.tree_util.keystr(path), leaf))
        )

    return jax.tree_util.tree_map_with_path(put, model)


def compiled_text(fn, model, *args) -> str:
    params, static = eqx.partition(model, eqx.is_array)
    jitted = jax.jit(lambda p, *a: fn(eqx.combine(p, static), *a))
    return jitted.lower(params, *args).compile().as_text()


def compare(mesh, layout: str, tokens: int, pinned: bool, weight_block: int) -> dict:
    """Compile the plain and the quantised step; their collectives and collective bytes."""
    x = jax.device_put(
        jax.random.normal(jax.random.key(1), (tokens, D)), NamedSharding(mesh, P("data"))
    )
    grad_fn = eqx.filter_value_and_grad(pinned_loss(mesh) if pinned else loss)
    plain = compiled_text(grad_fn, shard(model(), mesh, layout), x)
    recipe = nvfp4x.recipes.nvfp4_training(weight_block=(weight_block, 16))
    quant = compiled_text(grad_fn, shard(nvfp4x.quantize(model(), recipe), mesh, layout), x)
    return {
        "plain": collectives(plain),
        "quant": collectives(quant),
        "plain_bytes": collective_bytes(plain),
        "quant_bytes": collective_bytes(quant),
    }


def case_name(layout: str, tokens: int, pinned: bool, weight_block: int) -> str:
    block = f"{weight_block}x16"
    return f"{layout}, {tokens} tokens{', pinned' if pinned else ''}, {block} weights"


def _measure() -> dict:
    mesh = make_mesh()
    out = {}
    for case in CASES:
        r = compare(mesh, *case)
        both = (r["quant_bytes"], r["plain_bytes"])
        out[case_name(*case)] = {
            "plain_bytes": r["plain_bytes"],
            "quant_bytes": r["quant_bytes"],
            "bytes_ratio": both[0] / both[1] if both[1] else "n/a" if not both[0] else "inf",
        }
    return out


def multiprocess(timeout: float = 900) -> dict:
    """Step time and collective bytes of the 2-process run over the 1-process run."""
    import tempfile

    info = {}
    for processes in (2, 1):
        with tempfile.TemporaryDirectory() as out:
            argv = ["-m", "benchmarks.multihost", "--worker", "--measure", "--out", out]
            for r in multihost.launch(argv, processes, timeout=timeout):
                if r.returncode:
                    raise RuntimeError(f"{processes}-process run failed:\n{r.output[-3000:]}")
            info[processes] = json.loads((pathlib.Path(out) / "info_0.json").read_text())
    result = {}
    for run in sorted(info[1]["timings"]):
        two, one = info[2], info[1]
        result[run] = {
            "step_s_2proc": two["timings"][run],
            "step_s_1proc": one["timings"][run],
            "time_ratio": two["timings"][run] / one["timings"][run],
            "collective_bytes_2proc": two["collective_bytes"][run],
            "collective_bytes_1proc": one["collective_bytes"][run],
            "bytes_ratio": two["collective_bytes"][run] / max(one["collective_bytes"][run], 1),
        }
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--processes", type=int, default=1, help="2: compare 2 processes x 4 devices with 1 x 8"
    )
    args = parser.parse_args(argv)
    if args.processes == 2:
        result = multiprocess()
        print("2 processes x 4 devices / 1 process x 8 devices (gloo over loopback)")
        for run, r in result.items():
            print(
                f"  {run:16s} step time {r['time_ratio']:.2f}x "
                f"({r['step_s_2proc'] * 1e3:.0f} ms / {r['step_s_1proc'] * 1e3:.0f} ms), "
                f"collective bytes {r['bytes_ratio']:.3f}x ({r['collective_bytes_2proc']} B)"
            )
        return result
    if jax.device_count() >= 8:
        result = _measure()
    else:
        env = dict(os.environ)
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
        ).strip()
        proc = subprocess.run(
            [sys.executable, __file__, "--json"], env=env, capture_output=True, text=True
        )
        if proc.returncode:
            raise RuntimeError(f"bench_sharding subprocess failed:\n{proc.stderr[-3000:]}")
        result = json.loads(proc.stdout.splitlines()[-1])
    if args.json:
        print(json.dumps(result))
        return result
    print("collective bytes of the NVFP4 training step / the unquantised step, 8 devices")
    for name, r in result.items():
        ratio = r["bytes_ratio"]
        shown = f"{ratio:.3f}x" if isinstance(ratio, float) else ratio
        print(f"  {name:46s} {shown:>8s}   (plain: {r['plain_bytes']} bytes)")
    return result


if __name__ == "__main__":
    main()
