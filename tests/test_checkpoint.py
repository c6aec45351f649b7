"""`nvfp4x.TrainingCheckpointer`: checkpoints of a training run that lose nothing.

The whole training state (quantised model, Adam state, step, data position, PRNG keys,
Python numbers, packed float8/uint8 leaves) round-trips bit for bit; a corrupted leaf is
refused, naming it; a step cut short is never listed; a training run killed with SIGKILL
and resumed ends with the same bits as one never stopped. (Sharded state:
`tests/multidevice/test_checkpoint_sharded.py`; `nvfp4x.save` / `nvfp4x.load`:
`tests/test_save_load.py`.)
"""

import json
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import resumable_training
from helpers import assert_same_bits, build_frozen, run_script

import nvfp4x
from nvfp4x import _checkpoint

HERE = pathlib.Path(__file__).parent
TIMEOUT = 240  # seconds, for any subprocess


# ---------------------------------------------------------------------------------------
# nvfp4x.TrainingCheckpointer.
# ---------------------------------------------------------------------------------------


def training_state(seed: int) -> dict:
    """A quantised model, Adam's state after one update, a frozen model's packed leaves
    (uint8 codes and block scales), float8 and bfloat16 arrays, keys of two
    implementations and a legacy uint32 key, numpy arrays, Python numbers."""
    k = jax.random.split(jax.random.key(seed), 4)
    mlp = eqx.nn.MLP(32, 16, 48, 1, key=k[0])
    model = nvfp4x.quantize(mlp, nvfp4x.recipes.nvfp4_training())
    params = eqx.filter(model, eqx.is_inexact_array)
    optimizer = optax.adam(1e-3)
    with jax.numpy_dtype_promotion("standard"):
        opt_state = optimizer.init(params)
        _, opt_state = optimizer.update(params, opt_state, params)
    return {
        "model": model,
        "opt_state": opt_state,
        "frozen": build_frozen(seed),
        "step": 5 + seed,
        "position": 1234 + seed,
        "lr": 0.25 + seed,
        "done": bool(seed),
        "key": k[1],
        "keys": jax.random.split(jax.random.key(seed, impl="rbg"), 3),
        "legacy_key": jax.random.PRNGKey(seed),
        "history": np.arange(6, dtype=np.float32) + seed,
        "np_bf16": (np.arange(4, dtype=np.float32) + seed).astype(jnp.bfloat16),
        "bf16": jnp.arange(5, dtype=jnp.bfloat16) + seed,
        "e4m3": (jnp.arange(-8.0, 8.0) / 4 + seed).astype(jnp.float8_e4m3fn),
        "counter": np.int64(2**40 + seed),
    }


@pytest.fixture(scope="module")
def states(tmp_path_factory) -> tuple[dict, dict, pathlib.Path]:
    """`(state, other, folder)`: two training states of one structure, and a folder
    holding `state` saved as step 5 (to be read only, or copied)."""
    state = training_state(0)
    folder = tmp_path_factory.mktemp("saved") / "ckpt"
    with nvfp4x.TrainingCheckpointer(folder, async_save=False) as ckpt:
        ckpt.save(5, state)
    return state, training_state(1), folder


@pytest.mark.parametrize("like_kind", ["concrete", "eval_shape"])
def test_training_state_round_trip_is_bit_exact(states, like_kind):
    state, other, folder = states
    with nvfp4x.TrainingCheckpointer(folder) as ckpt:
        assert ckpt.all_steps() == [5] and ckpt.latest_step() == 5
        if like_kind == "concrete":
            like = other
        else:  # numpy leaves would become float32/int32 structs: keep them concrete
            numpy = {k: other[k] for k in ("history", "np_bf16", "counter")}
            like = {**eqx.filter_eval_shape(training_state, 1), **numpy}
        restored = ckpt.restore(like)
    assert_same_bits(restored, state, f"restored into a {like_kind} like")
    assert restored["model"].layers[0].weight.recipe == state["model"].layers[0].weight.recipe
    for name in ("step", "position", "lr", "done"):
        assert type(restored[name]) is type(state[name]), name


def test_checksum_is_the_same_for_numpy_and_jax_and_sees_every_word(tmp_path):
    """The checksum of an array is a function of its bits: the same on the numpy and the
    jax path, for every dtype the state may hold; changing any one element changes both
    of its 32-bit lanes."""
    rng = np.random.default_rng(0)
    base = rng.standard_normal((5, 7)).astype(np.float32)
    dtypes = [
        np.float32,
        np.float16,
        jnp.bfloat16,
        jnp.float8_e4m3fn,
        jnp.float8_e5m2,
        np.uint8,
        np.int8,
        np.int32,
        np.uint32,
        np.bool_,
        np.complex64,
    ]
    arrays = []
    for dtype in dtypes:
        a = (base > 0) if dtype == np.bool_ else (base * 20).astype(dtype)
        arrays.append(np.asarray(a, dtype))
    sums = _checkpoint.checksums([jnp.asarray(a) for a in arrays])
    assert sums == _checkpoint.checksums(arrays)
    for dtype, a, s in zip(dtypes, arrays, sums, strict=True):
        flat = a.reshape(-1)
        changed = []
        for i in range(flat.size):  # one element changed at a time
            b = flat.copy()
            b.view(np.uint8)[i * b.itemsize] ^= 1
            changed.append(b.reshape(a.shape))
        for t in _checkpoint.checksums(changed):
            assert t[:8] != s[:8] and t[8:] != s[8:], np.dtype(dtype).name


def flip_leaf(ckpt, leaf_index: int) -> None:
    """Make the checkpointer's Orbax manager return the `leaf_index`-th saved value with
    one bit changed, as a corrupted file that decoded without error would."""
    real = ckpt._manager.restore

    def restore(step, args):
        out = real(step, args=args)
        if "state" in out:
            values = out.state
            v = np.array(values[leaf_index])
            v.reshape(-1).view(np.uint8)[-1] ^= 1
            if isinstance(values[leaf_index], jax.Array):
                v = jax.device_put(v, values[leaf_index].sharding)
            values[leaf_index] = v
        return out

    ckpt._manager.restore = restore


@pytest.mark.parametrize(
    "leaf",
    [
        "[model].layers[0].weight.array",
        "[frozen].layers[0].weight.packed.scale_bits",  # packed E4M3 block scales, uint8
        "[e4m3]",  # a float8_e4m3fn array
        "[key]",
        "[position]",
    ],
)
def test_corrupted_leaf_is_refused_naming_the_checkpoint_and_leaf(states, leaf):
    state, _, folder = states
    with nvfp4x.TrainingCheckpointer(folder) as ckpt:
        paths = [r["path"] for r in _manifest(ckpt, 5)["leaves"]]
        assert leaf in paths, paths
        flip_leaf(ckpt, paths.index(leaf))
        where = re.escape(f"`{ckpt.directory}` step 5 is corrupted: the leaf `{leaf}`")
        with pytest.raises(ValueError, match=where):
            ckpt.restore(state)


def _manifest(ckpt, step: int) -> dict:
    return json.loads(
        (pathlib.Path(ckpt.directory) / str(step) / "nvfp4x" / "metadata").read_text()
    )


def test_flipped_bytes_in_the_array_files_never_restore_a_wrong_state(tmp_path, states):
    """Bytes flipped on disk in the largest array file (Orbax's OCDBT data file): each
    restore either raises (Orbax's reader or nvfp4x's checksum) or returns the saved
    state exactly."""
    state, other, folder = states
    shutil.copytree(folder, tmp_path / "ckpt")
    step = tmp_path / "ckpt" / "5"
    files = [p for p in step.rglob("*") if p.is_file() and "state" in p.parts]
    biggest = max(files, key=lambda p: p.stat().st_size)
    data = biggest.read_bytes()
    rng = np.random.default_rng(0)
    outcomes = []
    for i in sorted({0, len(data) // 2, len(data) - 1, *rng.integers(0, len(data), 5).tolist()}):
        copy = tmp_path / f"flip{i}"
        shutil.copytree(tmp_path / "ckpt", copy)
        target = copy / biggest.relative_to(tmp_path / "ckpt")
        target.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :])
        with nvfp4x.TrainingCheckpointer(copy) as ckpt:
            try:
                restored = ckpt.restore(other)
            except Exception as e:  # any refusal will do; a wrong state will not
                ours = isinstance(e, ValueError) and "is corrupted: the leaf" in str(e)
                outcomes.append("checksum" if ours else type(e).__name__)
                continue
        assert_same_bits(restored, state, f"byte {i} of {biggest.name} flipped")
        outcomes.append("intact")
    # Orbax stores these arrays uncompressed and unchecked: most flips decode without
    # error, and only the checksum stands between them and a silently wrong state.
    assert "checksum" in outcomes, outcomes


def test_a_step_cut_short_is_never_listed_nor_restored(tmp_path, states):
    """A save that died before Orbax renamed its folder into place (simulated: a complete
    copy of a step under Orbax's temporary name) is not a step: not listed, not restored,
    and its folder is removed before the next save (which may be of the same step)."""
    state, other, folder = states
    root = tmp_path / "ckpt"
    shutil.copytree(folder, root)
    unfinished = root / "8.orbax-checkpoint-tmp"
    shutil.copytree(root / "5", unfinished)
    with nvfp4x.TrainingCheckpointer(root, async_save=False) as ckpt:
        assert ckpt.all_steps() == [5] and ckpt.latest_step() == 5
        assert_same_bits(ckpt.restore(other), state, "the last complete step")
        ckpt.save(8, other)  # the resumed run saves that step again
        assert not unfinished.exists()
        assert ckpt.all_steps() == [5, 8]
        assert_same_bits(ckpt.restore(state), other, "the step saved again")


def test_mismatched_or_missing_checkpoints_are_refused(tmp_path, states):
    state, _, _ = states
    with nvfp4x.TrainingCheckpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        with pytest.raises(FileNotFoundError, match="holds no complete checkpoint"):
            ckpt.restore(state)
        ckpt.save(5, state)
        with pytest.raises(ValueError, match=r"already has a checkpoint of step 5 >= 5"):
            ckpt.save(5, state)
        with pytest.raises(FileNotFoundError, match=r"no checkpoint of step 3; it has steps \[5\]"):
            ckpt.restore(state, step=3)
        wider = {**state, "history": np.zeros(7, np.float32)}
        with pytest.raises(
            ValueError, match=r"at the leaf `\[history\]`: saved array float32\[6\]"
        ):
            ckpt.restore(wider)
        extra = {**state, "zz_extra": jnp.zeros(3)}
        with pytest.raises(ValueError, match=r"has \d+ leaves, `like` has \d+"):
            ckpt.restore(extra)
        bf16 = nvfp4x.quantize(
            eqx.nn.MLP(32, 16, 48, 1, key=jax.random.key(0)), nvfp4x.recipes.bf16()
        )
        with pytest.raises(ValueError, match=r"different layer recipes.*requantize"):
            ckpt.restore({**state, "model": bf16})
        with pytest.raises(TypeError, match="`step` must be a non-negative int"):
            ckpt.save(-1, state)


def test_without_orbax_the_error_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "orbax", None)
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)
    with pytest.raises(ImportError, match="pip install orbax-checkpoint"):
        nvfp4x.TrainingCheckpointer(tmp_path)


def test_training_run_killed_and_resumed_ends_with_the_same_bits(tmp_path):
    """`tests/resumable_training.py` (NVFP4 training recipe with stochastic rounding,
    Adam, data position and PRNG key in the state, a checkpoint every 4 of 30 steps) is
    killed with SIGKILL at a random moment after its first checkpoint, then started
    again: it resumes from its last complete checkpoint, and its final losses, weights,
    optimiser state, key and data position equal those of a run never stopped, bit for
    bit. (The run never stopped is this process's; the two script runs share a
    compilation cache.)"""
    folder = tmp_path / "run"
    script = [str(HERE / "resumable_training.py"), str(folder)]
    env = {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    victim = subprocess.Popen(
        [sys.executable, *script, "--sleep", "0.1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    delay = random.uniform(0.0, 0.8)
    box = {}

    def kill_after_first_checkpoint():
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and victim.poll() is None:
            if folder.is_dir() and any(p.isdigit() for p in os.listdir(folder)):
                time.sleep(delay)
                break
            time.sleep(0.01)
        steps = os.listdir(folder) if folder.is_dir() else []
        box["steps_before_kill"] = sorted(int(p) for p in steps if p.isdigit())
        victim.send_signal(signal.SIGKILL)

    killer = threading.Thread(target=kill_after_first_checkpoint)
    killer.start()
    try:  # meanwhile, the run never stopped
        state = resumable_training.initial_state()
        while state["step"] < resumable_training.STEPS:
            state = resumable_training.step(state)
    finally:
        killer.join()
        output = victim.communicate(timeout=TIMEOUT)[0].decode()
    assert victim.returncode == -signal.SIGKILL, output[-3000:]
    assert "finished" not in output
    assert box["steps_before_kill"], output[-3000:]

    resumed = run_script(script, env=env, timeout=TIMEOUT)
    found = re.search(r"resumed from step (\d+)", resumed.stdout)
    assert found, resumed.stdout[-3000:]
    start = int(found.group(1))  # a checkpoint may have completed after the listing
    assert box["steps_before_kill"][-1] <= start < resumable_training.STEPS, (delay, box, start)
    with nvfp4x.TrainingCheckpointer(folder) as ckpt:
        assert ckpt.latest_step() == resumable_training.STEPS
        final = ckpt.restore(resumable_training.initial_state())
    assert np.all(np.isfinite(final["losses"]))
    assert_same_bits(final, state, f"killed {delay:.2f} s after the first checkpoint")
