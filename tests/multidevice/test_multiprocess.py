"""NVFP4 training on JAX's multi-process runtime: 2 processes x 4 host CPU devices
(`jax.distributed` on 127.0.0.1, gloo collectives) against this process's 8 devices.

The two worker processes (`benchmarks/multihost.py`) run while this process computes the
same things on one process; every launch has a free port and a timeout, and its
processes are killed if it fails.
"""

import json
import threading

import equinox as eqx
import jax
import numpy as np
import pytest
from helpers import ROOT, run_script
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

import nvfp4x
from benchmarks import multihost as mh

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8"
)

TIMEOUT = 300  # seconds for a whole 2-process group


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """`(one, two, infos, out)`: this process's results, the 2-process results (from
    process 0), both processes' `info`, and the workers' output folder."""
    out = tmp_path_factory.mktemp("two_processes")
    argv = ["-m", "benchmarks.multihost", "--worker", "--out", str(out)]
    box = {}

    def two_processes():
        try:
            box["results"] = mh.launch(argv, 2, timeout=TIMEOUT)
        except BaseException as e:  # re-raised below, in the test's thread
            box["error"] = e

    thread = threading.Thread(target=two_processes)
    thread.start()
    try:
        one, _ = mh.run_all(training_only=True)  # meanwhile, the same on 1 process x 8 devices
    finally:
        thread.join()
    if "error" in box:
        raise box["error"]
    for i, r in enumerate(box["results"]):
        assert r.returncode == 0, f"process {i} failed:\n{r.output[-6000:]}"
    two = dict(np.load(out / "results.npz"))
    infos = [json.loads((out / f"info_{i}.json").read_text()) for i in range(2)]
    return one, two, infos, out


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))


def _worst(one: dict, two: dict, prefix: str) -> float:
    keys = [k for k in one if k.startswith(prefix)]
    assert keys and all(k in two for k in keys)
    return max(_rel(two[k], one[k]) for k in keys)


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
@pytest.mark.parametrize("what", ["losses", "grads", "weights", "opt"])
def test_training_on_two_processes_matches_one(runs, axis_type, what):
    """Losses, first-step gradients, final weights and optimiser state of the NVFP4
    stack (SR and RHT on) on 2 processes are as close to the 1-process run as the float32
    model's own two runs are (the collectives sum in another order: last bits)."""
    one, two, _, _ = runs
    f32 = _worst(one, two, f"{axis_type}_f32_{what}")
    nvfp4 = _worst(one, two, f"{axis_type}_nvfp4_{what}")
    assert f32 <= 1e-6, f"float32 runs differ by {f32:.2e} (expected last bits)"
    assert nvfp4 <= max(2 * f32, 2.5e-7), f"NVFP4 runs differ by {nvfp4:.2e}, float32 {f32:.2e}"
    if what == "losses":  # the NVFP4 runs did quantise
        assert not np.allclose(one[f"{axis_type}_nvfp4_losses"], one[f"{axis_type}_f32_losses"])


@pytest.mark.parametrize("block", ["1x16", "16x16"])
def test_codes_scales_and_global_amax_match_one_device(runs, block):
    """`to_nvfp4` of an array sharded over both processes, whose only large value lies in
    the last process's rows: the codes, block scales and tensor scale of one process and
    of one device, bit for bit (the tensor amax is global)."""
    _, two, _, _ = runs
    x = mh.spread_input()
    big_row = int(np.argmax(np.max(np.abs(x), axis=1)))
    assert big_row >= x.shape[0] // 2  # rows over `data`: the second process's half
    ref = jax.jit(lambda a: nvfp4x.to_nvfp4(a, block=(1, 16) if block == "1x16" else (16, 16)))(x)
    for name, want in [
        ("codes", ref.codes),
        ("scales", ref.scale_bits),
        ("tensor_scale", ref.tensor_scale),
    ]:
        np.testing.assert_array_equal(two[f"{name}_{block}"], np.asarray(want))


def test_freeze_across_processes_gives_one_device_codes(runs):
    """`freeze` of the trained model sharded 8 ways over both processes: the packed
    leaves equal one device's freeze of the same weights, and each process holds only its
    half of every sharded leaf's bytes."""
    _, two, infos, _ = runs
    n = sum(k.startswith("explicit_nvfp4_weights_") for k in two)
    weights = [two[f"explicit_nvfp4_weights_{i}"] for i in range(n)]
    frozen = nvfp4x.freeze(mh.with_weights(weights))
    leaves = jax.tree.leaves(eqx.filter(frozen, eqx.is_array))
    assert len(leaves) == sum(k.startswith("frozen_") for k in two)
    for i, leaf in enumerate(leaves):
        np.testing.assert_array_equal(two[f"frozen_{i}"], np.asarray(leaf), err_msg=f"leaf {i}")
    for info in infos:
        sharded = [(held, total) for spec, held, total in info["held"] if "'data', 'fsdp'" in spec]
        assert len(sharded) >= 6  # codes and block scales of the three weights
        assert all(2 * held == total for held, total in sharded)
        assert all(held == total for spec, held, total in info["held"] if "data" not in spec)


def test_checkpoint_from_two_processes_restores_on_one(runs):
    """The sharded training state, saved with `nvfp4x.TrainingCheckpointer` by both
    processes (each writing its own shards; the checksums computed on the global arrays),
    restored on one process, checksums verified: on one device and sharded 8 ways."""
    _, two, _, out = runs
    path = out / "checkpoint"
    assert [p.name for p in sorted((path / "0" / "state").glob("ocdbt.process_*"))] == [
        "ocdbt.process_0",
        "ocdbt.process_1",
    ]
    params = eqx.filter(mh.model(True), eqx.is_array)
    state = {"model": params, "opt_state": mh.optimizer().init(params)}
    mesh = jax.make_mesh((8,), ("x",))
    one_device = SingleDeviceSharding(jax.devices()[0])

    def target(sharding_of):
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding_of(a)), state
        )

    eight_ways = target(
        lambda a: NamedSharding(mesh, P("x") if a.ndim >= 1 and a.shape[0] % 8 == 0 else P())
    )
    with nvfp4x.TrainingCheckpointer(path) as ckpt:
        assert ckpt.all_steps() == [0]
        for like in (target(lambda a: one_device), eight_ways):
            restored = ckpt.restore(like)
            got_w = jax.tree.leaves(restored["model"])
            got_o = jax.tree.leaves(restored["opt_state"])
            for i, a in enumerate(got_w):
                np.testing.assert_array_equal(np.asarray(a), two[f"explicit_nvfp4_weights_{i}"])
            for i, a in enumerate(got_o):
                np.testing.assert_array_equal(np.asarray(a), two[f"explicit_nvfp4_opt_{i}"])
            for a, t in zip(jax.tree.leaves(restored), jax.tree.leaves(like), strict=True):
                assert a.sharding == t.sharding


def test_a_dying_process_stops_the_other_within_the_heartbeat_timeout(tmp_path):
    """The last process exits in the middle of a training step (of the float32 model: the
    runtime's behaviour, which nvfp4x does not change); the other, waiting in that step's
    collectives, exits with an error within the configured heartbeat timeout instead of
    hanging."""
    heartbeat = 5
    argv = ["-m", "benchmarks.multihost", "--worker", "--out", str(tmp_path)]
    argv += ["--die-after", "1", "--heartbeat", str(heartbeat)]
    survivor, victim = mh.launch(argv, 2, timeout=TIMEOUT)
    assert victim.returncode == 17, victim.output[-3000:]
    assert "exiting in step 1" in victim.output
    assert survivor.returncode != 0, survivor.output[-3000:]
    assert survivor.ended - victim.ended <= heartbeat + 20, (survivor.ended, victim.ended)


def test_sharded_training_example_on_two_processes_prints_the_one_process_curve():
    """`examples/sharded_training.py --processes 2` starts its two processes itself and
    prints the loss curve this process gets from the same script."""
    example = ROOT / "examples" / "sharded_training.py"
    args = [str(example), "--smoke", "--processes", "2", "--timeout", "240"]
    proc = run_script(args, timeout=TIMEOUT)
    assert "over 2 process(es)" in proc.stdout
    two = [float(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("step")]
    from jaxtyping import install_import_hook

    # (examples/ is on sys.path: pyproject.toml.) Its annotations checked at runtime, as
    # tests/test_examples.py runs the other examples (which leaves this one to this test).
    with install_import_hook(["sharded_training"], "beartype.beartype"):
        import sharded_training

    with jax.numpy_dtype_promotion("standard"):  # as the script runs (optax's Adam needs it)
        one = sharded_training.main(["--smoke"])
    assert len(two) == len(one) == 3
    np.testing.assert_allclose(two, one, rtol=1e-6)
