"""`nvfp4x.TrainingCheckpointer`: checkpoints of a training run that lose nothing.

The whole training state (quantised model, Adam state, step, data position, PRNG keys,
Python numbers, packed float8/uint8 leaves) round-trips bit for bit; a corrupted leaf is
refused, naming it; a step cut short is never listed; a training run killed with SIGKILL
and resumed ends with the same bits as one never stopped. (Sharded state:
`tests/multidevice/test_checkpoint_sharded.py`; `nvfp4x.save` / `nvfp4x.load`:
`tests/test_save_load.py`.)
"""

import fcntl
import gc
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
from nvfp4x import _checksum, _files

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
    sums = _checksum.checksums([jnp.asarray(a) for a in arrays])
    assert sums == _checksum.checksums(arrays)
    for dtype, a, s in zip(dtypes, arrays, sums, strict=True):
        flat = a.reshape(-1)
        changed = []
        for i in range(flat.size):  # one element changed at a time
            b = flat.copy()
            b.view(np.uint8)[i * b.itemsize] ^= 1
            changed.append(b.reshape(a.shape))
        for t in _checksum.checksums(changed):
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
    gc.collect()  # Orbax's abandoned coroutines, here rather than in a later test
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


# ---------------------------------------------------------------------------------------
# Damaged metadata, failed saves, two writers.
# ---------------------------------------------------------------------------------------

# More cases, other seeds: `python -m benchmarks.kill_loops` sets these.
FUZZ_CASES = int(os.environ.get("NVFP4X_FUZZ_CASES", "24"))
FUZZ_SEED = int(os.environ.get("NVFP4X_FUZZ_SEED", "0"))


def small_state(seed: int) -> dict:
    return {
        "w": jnp.arange(6.0) + seed,
        "n": 3 + seed,
        "key": jax.random.key(seed),
        "e4m3": (jnp.arange(4.0) + seed).astype(jnp.float8_e4m3fn),
    }


def mutate_json(data: bytes, rng: random.Random) -> bytes:
    """`data` with one value somewhere in its JSON tree replaced by one of another type."""
    tree = json.loads(data)
    slots = []

    def walk(node):
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            slots.append((node, key))
            if isinstance(value, dict | list):
                walk(value)

    walk(tree)
    if not slots:
        return b"[]"
    node, key = rng.choice(slots)
    node[key] = rng.choice([None, "x", [], {}, -1, 2**70, 1.5, True])
    return json.dumps(tree).encode()


def damage(step_dir: pathlib.Path, rng: random.Random) -> str:
    """Damage one of the step's metadata files (not its array data, which the leaves'
    checksums guard) in one of several ways; returns what was done."""
    files = sorted(
        p for p in step_dir.rglob("*") if p.is_file() and "d" not in p.relative_to(step_dir).parts
    )
    path = rng.choice(files)
    data = path.read_bytes()
    how = rng.choice(["flip", "truncate", "empty", "delete", "json"])
    if how == "flip" and data:
        i = rng.randrange(len(data))
        path.write_bytes(data[:i] + bytes([data[i] ^ rng.randrange(1, 256)]) + data[i + 1 :])
    elif how == "truncate" and data:
        path.write_bytes(data[: rng.randrange(len(data))])
    elif how == "delete":
        path.unlink()
    elif how == "json":
        try:
            path.write_bytes(mutate_json(data, rng))
        except ValueError:  # not JSON: flip its first byte instead
            path.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:] if data else b"x")
    else:
        path.write_bytes(b"")
    return f"{how} {path.relative_to(step_dir)}"


def test_damaged_metadata_is_refused_as_corrupted_naming_the_folder_and_step(tmp_path):
    """A fuzz of damage to a step's metadata files (nvfp4x's and Orbax's: bytes flipped,
    files cut short, emptied, deleted, JSON values of another type): every restore
    returns the saved state exactly, or raises `ValueError` naming the folder, the step
    and that it is corrupted (before, ~20% raised KeyError, AssertionError or a bare JSON
    error). A step whose files no longer make it a step is not listed."""
    state = small_state(0)
    saved = tmp_path / "saved"
    with nvfp4x.TrainingCheckpointer(saved, async_save=False) as ckpt:
        ckpt.save(5, state)
    rng = random.Random(FUZZ_SEED)
    outcomes = {}
    for case in range(FUZZ_CASES):
        folder = tmp_path / f"case{case}"
        shutil.copytree(saved, folder)
        what = damage(folder / "5", rng)
        try:
            with nvfp4x.TrainingCheckpointer(folder) as ckpt:
                restored = ckpt.restore(small_state(1), step=5)
        except FileNotFoundError as e:  # no longer a complete step: not listed
            assert re.search(r"no checkpoint of step 5", str(e)), (what, e)
            outcome = "not listed"
        except ValueError as e:
            where = re.escape(str(folder))
            named = rf"`{where}` step 5 (is corrupted|was not written)|`{where}` cannot be opened"
            assert re.search(named, str(e)) and "corrupted" in str(e), (what, e)
            outcome = "refused"
        else:
            assert_same_bits(restored, state, what)
            outcome = "intact"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    gc.collect()  # Orbax's abandoned coroutines, here rather than in a later test
    print(f"damaged metadata, {FUZZ_CASES} cases (seed {FUZZ_SEED}): {outcomes}")
    assert outcomes.get("refused", 0) > 0, outcomes


SPECIAL_FILES = """
import os, sys
sys.path.insert(0, {root!r})
import jax.numpy as jnp
import nvfp4x

folder, step = {folder!r}, os.path.join({folder!r}, "5")
with nvfp4x.TrainingCheckpointer(folder, async_save=False) as ckpt:
    ckpt.save(5, {{"w": jnp.arange(6.0)}})
cases = [(name, "fifo") for name in
         ("_CHECKPOINT_METADATA", "nvfp4x/metadata", "state/_METADATA", "state/_sharding")]
cases += [("state/manifest.ocdbt", "/dev/zero"), ("nvfp4x/metadata", "/dev/zero")]
for name, what in cases:
    path = os.path.join(step, name)
    os.rename(path, path + ".good")
    os.mkfifo(path) if what == "fifo" else os.symlink(what, path)
    try:
        with nvfp4x.TrainingCheckpointer(folder) as ckpt:
            ckpt.restore({{"w": jnp.zeros(6)}}, step=5)
    except ValueError as e:
        print("refused:", e)
    os.unlink(path)
    os.rename(path + ".good", path)
"""


def test_special_files_in_a_step_are_refused_before_orbax_opens_them(tmp_path):
    """A step file replaced by a FIFO (Orbax's and nvfp4x's metadata files) hung the
    restore forever; a link to `/dev/zero` was read until memory ran out. Each is
    refused as corrupted, naming the file and what it is (a subprocess, time-bound)."""
    script = SPECIAL_FILES.format(root=str(HERE.parent), folder=str(tmp_path / "run"))
    out = run_script(["-c", script], timeout=120, what="restore of special files").stdout
    refusals = [line for line in out.splitlines() if line.startswith("refused:")]
    assert len(refusals) == 6, out
    for line, name in zip(refusals, ("_CHECKPOINT_METADATA", "nvfp4x/metadata"), strict=False):
        assert f"step 5 is corrupted: `{tmp_path / 'run' / '5' / name}` is a FIFO" in line, line
    assert sum("is a character device, not a regular file" in line for line in refusals) == 2


def test_step_metadata_records_are_checked_field_by_field(tmp_path):
    """The nvfp4x metadata carries a digest of itself: a value changed, a field lost
    or added is refused as corrupted before anything is compared with `like`."""
    state = small_state(0)
    folder = tmp_path / "ckpt"
    with nvfp4x.TrainingCheckpointer(folder, async_save=False) as ckpt:
        ckpt.save(5, state)
    path = folder / "5" / "nvfp4x" / "metadata"
    good = json.loads(path.read_text())
    assert len(good["digest"]) == 64 and len(good["writer"]) == 16
    cases = {
        "shape": lambda m: m["leaves"][0].update(shape=[7]),
        "lost-digest": lambda m: m.pop("digest"),
        "extra": lambda m: m.update(extra=1),
        "step": lambda m: m.update(step=6),
    }
    for name, change in cases.items():
        metadata = json.loads(json.dumps(good))
        change(metadata)
        path.write_text(json.dumps(metadata))
        with nvfp4x.TrainingCheckpointer(folder) as ckpt:
            try:
                ckpt.restore(state)
            except ValueError as e:
                assert "step 5 is corrupted: its nvfp4x metadata" in str(e), (name, e)
            else:
                raise AssertionError(f"{name}: restored")
    path.write_text(json.dumps(good))


FAILING_SAVES = """
import os, sys, time
import jax.numpy as jnp
import nvfp4x
real = os.makedirs

def failing(path, *args, **kwargs):  # step 2's folder cannot be made (a read-only folder)
    if "2.orbax-checkpoint-tmp" in str(path):
        time.sleep(0.5)  # after `save` has returned
        raise PermissionError(13, "Permission denied (injected)", str(path))
    return real(path, *args, **kwargs)

os.makedirs = failing
root = sys.argv[1]
state = {"w": jnp.ones(4)}
try:
    with nvfp4x.TrainingCheckpointer(os.path.join(root, "with")) as ckpt:
        ckpt.save(1, state)
        ckpt.save(2, state)
except RuntimeError as e:
    print("with:", e, flush=True)
ckpt = nvfp4x.TrainingCheckpointer(os.path.join(root, "next"))
ckpt.save(2, state)
try:
    ckpt.save(3, state)
except RuntimeError as e:
    print("next:", e, flush=True)
ckpt.close()
unclosed = nvfp4x.TrainingCheckpointer(os.path.join(root, "unclosed"))
unclosed.save(2, state)
print("exiting", flush=True)
"""


def test_a_failed_background_save_surfaces_its_error_and_never_holds_the_exit(tmp_path):
    """A background save that cannot create its folder (as in a read-only folder; the
    tests run as root, which ignores permissions, so the failure is injected): its error
    surfaces at the end of the `with` block, at the next save, or, for a checkpointer
    never closed, on stderr at exit, and the process exits at once (it took 303 s, as
    Orbax's threads waited for a signal of the failed save)."""
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", FAILING_SAVES, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    took = time.monotonic() - start
    assert took < 60, f"the exit took {took:.0f} s"
    failed = r"`{}`: the save of step 2 failed, and the step was not written \(PermissionError"
    for name in ("with", "next"):
        assert re.search(rf"{name}: " + failed.format(re.escape(str(tmp_path / name))), done.stdout)
    assert done.stdout.rstrip().endswith("exiting"), done.stdout + done.stderr[-3000:]
    unclosed = failed.format(re.escape(str(tmp_path / "unclosed")))
    assert re.search(rf"at exit: {unclosed}", done.stderr), done.stderr[-3000:]
    with nvfp4x.TrainingCheckpointer(tmp_path / "with") as ckpt:
        assert ckpt.all_steps() == [1]


def test_a_save_that_orbax_fails_with_a_value_error_raises_runtime_error(tmp_path, monkeypatch):
    """A full disk reaches Orbax as tensorstore's `ValueError` ("No space left on
    device"); the docs promise `RuntimeError` naming the folder and the step, whether the
    save failed at once (a synchronous save) or in the background."""
    full = ValueError("RESOURCE_EXHAUSTED: Error writing file: No space left on device")

    def no_space(*_, **__):
        raise full

    state = small_state(0)
    failed = r"`{}`: the save of step {} failed, and the step was not written \(ValueError: "
    with nvfp4x.TrainingCheckpointer(tmp_path / "sync", async_save=False) as ckpt:
        monkeypatch.setattr(ckpt._manager, "save", no_space)
        with pytest.raises(RuntimeError, match=failed.format(re.escape(str(tmp_path / "sync")), 1)):
            ckpt.save(1, state)
        monkeypatch.undo()
    with nvfp4x.TrainingCheckpointer(tmp_path / "async") as ckpt:
        ckpt.save(2, state)
        real = ckpt._manager.wait_until_finished
        monkeypatch.setattr(ckpt._manager, "wait_until_finished", no_space)
        with pytest.raises(
            RuntimeError, match=failed.format(re.escape(str(tmp_path / "async")), 2)
        ):
            ckpt.wait_until_finished()
        real()
        monkeypatch.undo()


TWO_WRITERS = """
import os, sys, time
import jax.numpy as jnp
import nvfp4x
folder, me, go = sys.argv[1], int(sys.argv[2]), sys.argv[3]
state = {"w": jnp.full((1 << 16,), me, jnp.float32), "who": me}
ckpt = nvfp4x.TrainingCheckpointer(folder)
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.001)
try:
    ckpt.save(7, state)
    ckpt.wait_until_finished()
    print("saved", flush=True)
except (ValueError, RuntimeError) as e:
    print("refused:", e, flush=True)
ckpt.close()
"""


def test_two_processes_saving_one_step_one_wins_the_other_is_refused(tmp_path):
    """Two processes save step 7 into one folder at the same moment: one reports the
    save, the other is refused naming the folder and the step, and the step holds the
    winner's state (before, a writer could report success for a step that restore then
    refused as corrupted)."""
    folder, go = tmp_path / "ckpt", tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TWO_WRITERS, str(folder), str(me), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for me in (1, 2)
    ]
    try:
        for proc in procs:
            timer = threading.Timer(TIMEOUT, proc.kill)
            timer.start()
            assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-3000:]
            timer.cancel()
        go.touch()
        outputs = [proc.communicate(timeout=TIMEOUT) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    said = [out.strip().splitlines()[-1] for out, _ in outputs]
    winners = [me for me, line in zip((1, 2), said, strict=True) if line == "saved"]
    assert len(winners) == 1, said
    refused = next(line for line in said if line != "saved")
    where = re.escape(str(folder))
    assert re.fullmatch(
        rf"refused: `{where}`(: step 7 is being written by another process| already has a "
        rf"checkpoint of step 7).*",
        refused,
    ), refused
    with nvfp4x.TrainingCheckpointer(folder) as ckpt:
        restored = ckpt.restore({"w": jnp.zeros((1 << 16,)), "who": 0})
    assert restored["who"] == winners[0] and np.all(np.asarray(restored["w"]) == winners[0])


def test_a_claimed_step_is_refused_unless_its_writer_is_gone(tmp_path):
    state = small_state(0)
    folder = tmp_path / "ckpt"
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    with nvfp4x.TrainingCheckpointer(folder, async_save=False) as ckpt:
        claim = folder / ".nvfp4x-step-3.claim"
        # A live writer holds its claim's lock (`flock`), whatever its process id says
        # (in another container's PID namespace: one that has ended here).
        claim.write_text(f"{_files.HOST} {int(gone.stdout)} 0123456789abcdef")
        holder = os.open(claim, os.O_RDONLY)
        fcntl.flock(holder, fcntl.LOCK_EX)
        with pytest.raises(
            ValueError, match=rf"step 3 is being written by another process \(host {_files.HOST}"
        ):
            ckpt.save(3, state)
        os.close(holder)  # killed: its lock released
        ckpt.save(3, state)
        assert ckpt.all_steps() == [3] and not claim.exists()
        assert_same_bits(ckpt.restore(small_state(1)), state, "after a stale claim")


# (the tests' runtime type checks may name the argument first; users get nvfp4x's)
BAD_ARGUMENTS = {
    "max_to_keep not an int": (
        {"max_to_keep": "3"}, TypeError, r"`max_to_keep` must be an int|parameter 'max_to_keep'"
    ),
    "max_to_keep below 1": ({"max_to_keep": 0}, ValueError, r"`max_to_keep` must be at least 1"),
    "async_save not a bool": (
        {"async_save": "no"}, TypeError, r"`async_save` must be True or False|'async_save'"
    ),
    "directory not a path": (
        {"directory": 3}, TypeError, r"`directory` must be a path|'directory'"
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS.values()), ids=list(BAD_ARGUMENTS))
def test_a_bad_argument_is_refused_by_name(tmp_path, case):
    kwargs, error, match = case
    kwargs = {"directory": tmp_path, **kwargs}
    with pytest.raises(error, match=match):
        nvfp4x.TrainingCheckpointer(kwargs.pop("directory"), **kwargs)


def test_a_traced_state_is_refused(tmp_path):
    with nvfp4x.TrainingCheckpointer(tmp_path / "ckpt", async_save=False) as ckpt:

        @jax.jit
        def step(w):
            ckpt.save(1, {"w": w})
            return w

        with pytest.raises(TypeError, match=r"the leaf `\[w\]` is traced.*outside"):
            step(jnp.ones(3))
        assert ckpt.all_steps() == []
