"""`nvfp4x.save` / `nvfp4x.load` (and `eqx.tree_serialise_leaves`) of frozen models.

A frozen model round-trips bit for bit, into a concrete or an `eqx.filter_eval_shape`
skeleton; a file that does not match the skeleton (another recipe, other shapes, an
unfrozen model, another format version, not a checkpoint at all) is refused. A save
that fails or is killed half-way leaves the previous file intact; a flipped byte
anywhere or a truncated file is refused, naming the file; files of format version 1
(no checksum) still load, with a warning. (Training state: `test_checkpoint.py`.)
"""

import errno
import fcntl
import io
import json
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    MODES,
    assert_same,
    assert_same_bits,
    build_frozen,
    ckpt_policy,
    dead_pid,
    freeze_jit,
    frozen_model,
    inputs,
    make,
    recipe_names,
)

import nvfp4x
from nvfp4x import _files

TIMEOUT = 240  # seconds, for any subprocess

# ---------------------------------------------------------------------------------------
# Helpers.
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def frozen_pair() -> tuple[Any, Any]:
    """Two frozen NVFP4 models of one structure, different weights."""
    return build_frozen(0), build_frozen(1)


def saved_file(tmp_path: pathlib.Path, model: Any) -> tuple[pathlib.Path, bytes]:
    path = tmp_path / "model.nvfp4x"
    nvfp4x.save(path, model)
    return path, path.read_bytes()


def header_of(data: bytes) -> tuple[dict, int]:
    """The JSON header of an `nvfp4x.save` file and where its payload starts."""
    magic = data.index(b"\n") + 1
    end = magic + 8 + int.from_bytes(data[magic : magic + 8], "little")
    return json.loads(data[magic + 8 : end]), end


# ---------------------------------------------------------------------------------------
# Frozen models round-trip; files that do not match are refused.
# ---------------------------------------------------------------------------------------


def frozen_like(name: str, kind: str, seed: int = 7) -> Any:
    """A `like` for loading, built from a skeleton with *other* values (seed 7)."""

    if kind == "concrete":
        return frozen_model("odd-features", name, seed, keep_last=True)
    return eqx.filter_eval_shape(
        lambda: nvfp4x.freeze(nvfp4x.quantize(make("odd-features", seed), ckpt_policy(name)))
    )


def write_eqx(path, model) -> None:
    eqx.tree_serialise_leaves(path, model)


def read_eqx(path, like):
    return eqx.tree_deserialise_leaves(path, like)


def write_nvfp4x(path, model) -> None:
    nvfp4x.save(str(path), model)


def read_nvfp4x(path, like):
    return nvfp4x.load(str(path), like)


CHECKPOINT_IO = {"eqx": (write_eqx, read_eqx), "nvfp4x": (write_nvfp4x, read_nvfp4x)}


@pytest.mark.parametrize("io_kind", list(CHECKPOINT_IO))
@pytest.mark.parametrize("like_kind", ["concrete", "eval_shape"])
@recipe_names
def test_checkpoint_round_trip_is_bit_exact(name, like_kind, io_kind, tmp_path):
    write, read = CHECKPOINT_IO[io_kind]
    frozen = frozen_model("odd-features", name, keep_last=True)
    path = tmp_path / "model.eqx"
    write(path, frozen)
    like = frozen_like(name, like_kind)
    loaded = read(path, like)
    assert_same_bits(loaded, frozen, f"{name}: {io_kind} round trip, like={like_kind}")
    x = inputs("odd-features")
    for mode in ("vmap", "jit-vmap"):
        fn = MODES[mode]
        assert_same(fn(loaded, x), fn(frozen, x), f"{name}: loaded model's outputs, {mode}")


def saved(tmp_path, name: str = "nvfp4_inference", model: str = "odd-features") -> tuple:
    frozen = frozen_model(model, name, keep_last=True)
    path = tmp_path / "model.nvfp4x"
    nvfp4x.save(str(path), frozen)
    return path, path.read_bytes()


@pytest.mark.parametrize(
    "where", ["in-magic", "in-length", "in-header", "at-leaves", "mid-leaves", "last-byte"]
)
def test_load_truncated_checkpoint_raises(tmp_path, where):
    path, data = saved(tmp_path)
    like = frozen_like("nvfp4_inference", "concrete")
    nvfp4x.load(str(path), like)  # the intact file loads
    _, end = header_of(data)
    cut = {
        "in-magic": 5,
        "in-length": data.index(b"\n") + 4,
        "in-header": end - 10,
        "at-leaves": end,
        "mid-leaves": (end + len(data)) // 2,
        "last-byte": len(data) - 1,
    }[where]
    path.write_bytes(data[:cut])
    with pytest.raises(ValueError, match=r"truncated|corrupt|not an nvfp4x checkpoint"):
        nvfp4x.load(str(path), like)


RECIPE_MISMATCHES = {
    # saved under -> loaded into; the arrays have the same shapes and dtypes in each pair.
    "w4a4-into-w4a16": ("nvfp4_inference", nvfp4x.recipes.nvfp4_weight_only),
    "w4a16-into-w4a4": ("nvfp4_weight_only", nvfp4x.recipes.nvfp4_inference),
    "training-into-inference-16x16": (
        "nvfp4_training",
        lambda: nvfp4x.recipes.nvfp4_inference(weight_block=(16, 16)),
    ),
}


@pytest.mark.parametrize("pair", list(RECIPE_MISMATCHES))
@pytest.mark.parametrize("like_kind", ["concrete", "eval_shape"])
def test_load_into_another_recipe_raises(tmp_path, pair, like_kind):
    saved_as, other = RECIPE_MISMATCHES[pair]
    path, _ = saved(tmp_path, saved_as)

    policy = nvfp4x.Policy([(r"layers\[2\]", None), (r".*", other())])
    qmodel = nvfp4x.quantize(make("odd-features", 7), policy)
    if like_kind == "concrete":
        like = freeze_jit(qmodel)
    else:
        like = eqx.filter_eval_shape(lambda: nvfp4x.freeze(qmodel))
    # The premise: the arrays alone cannot tell the two apart.
    frozen_saved = frozen_model("odd-features", saved_as, keep_last=True)
    assert array_structs(frozen_saved) == array_structs(like)
    with pytest.raises(ValueError, match=rf"recipe.*layers\[0\].*{saved_as}"):
        nvfp4x.load(str(path), like)


def array_structs(model: Any) -> list[tuple]:
    leaves = jax.tree_util.tree_leaves(model)
    return [(v.shape, v.dtype) for v in leaves if hasattr(v, "shape") and hasattr(v, "dtype")]


def test_load_with_different_shapes_raises(tmp_path):
    path, _ = saved(tmp_path)
    wider = freeze_jit(
        nvfp4x.quantize(
            eqx.nn.MLP(40, 24, 64, 2, key=jax.random.key(7)), ckpt_policy("nvfp4_inference")
        )
    )
    with pytest.raises(ValueError, match=r"shape"):
        nvfp4x.load(str(path), wider)
    deeper = freeze_jit(
        nvfp4x.quantize(
            eqx.nn.MLP(40, 24, 56, 3, key=jax.random.key(7)),
            nvfp4x.Policy([(r"layers\[3\]", None), (r".*", nvfp4x.recipes.nvfp4_inference())]),
        )
    )
    with pytest.raises(ValueError, match=r"does not match"):
        nvfp4x.load(str(path), deeper)


def test_load_unfrozen_checkpoint_into_frozen_like_raises(tmp_path):
    qmodel = nvfp4x.quantize(make("odd-features", 0), ckpt_policy("nvfp4_inference"))
    path = tmp_path / "q.nvfp4x"
    nvfp4x.save(str(path), qmodel)
    with pytest.raises(ValueError, match=r"FrozenLinear|QuantizedLinear|freeze"):
        nvfp4x.load(str(path), frozen_like("nvfp4_inference", "concrete"))


def eqx_file(tmp_path) -> bytes:
    frozen = frozen_model("odd-features", "bf16", keep_last=True)
    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, frozen)
    return buf.getvalue()


NOT_CHECKPOINTS = {
    "empty": lambda tmp_path: b"",
    "text": lambda tmp_path: b"hello, this is not a checkpoint\n" * 20,
    "random": lambda tmp_path: np.random.default_rng(0).bytes(4096),
    "plain-eqx-file": eqx_file,
}


@pytest.mark.parametrize("kind", list(NOT_CHECKPOINTS))
def test_load_non_checkpoint_raises(tmp_path, kind):
    path = tmp_path / "file.bin"
    path.write_bytes(NOT_CHECKPOINTS[kind](tmp_path))
    with pytest.raises(ValueError, match=r"not an nvfp4x checkpoint|truncated|corrupt"):
        nvfp4x.load(str(path), frozen_like("nvfp4_inference", "concrete"))


@pytest.mark.parametrize(
    "version, message",
    [
        (999, r"has checkpoint format version 999; this nvfp4x reads versions 1 to 2"),
        # (was "has checkpoint format version 2; this nvfp4x reads versions 1 to 2")
        ("2", r'`format_version` is "2" \(a string\), not an integer'),
    ],
    ids=["999", "string"],
)
def test_load_other_format_version_raises(tmp_path, version, message):
    path, data = saved(tmp_path)
    magic = data.index(b"\n") + 1
    header, end = header_of(data)
    header["format_version"] = version
    raw = json.dumps(header).encode()
    path.write_bytes(data[:magic] + len(raw).to_bytes(8, "little") + raw + data[end:])
    with pytest.raises(ValueError, match=message):
        nvfp4x.load(str(path), frozen_like("nvfp4_inference", "concrete"))


# ---------------------------------------------------------------------------------------
# A save that fails, a file changed or cut short, an old file.
# ---------------------------------------------------------------------------------------


class FailingFile:
    """A binary file whose writes fail with ENOSPC once `limit` bytes are written."""

    def __init__(self, f, limit: int):
        self._f, self._left = f, limit

    def write(self, data: bytes) -> int:
        if len(data) > self._left:
            self._f.write(data[: self._left])
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        self._left -= len(data)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)


def inject(monkeypatch, where: str, size: int) -> None:
    """Make the next `nvfp4x.save` of a `size`-byte file fail at `where`."""
    if where == "serialiser":
        real = eqx.tree_serialise_leaves

        def half_then_fail(f, tree):
            real(f, tree)
            f.truncate(f.tell() // 2)
            raise RuntimeError("serialiser died (injected)")

        monkeypatch.setattr(eqx, "tree_serialise_leaves", half_then_fail)
    elif where == "write":
        real_fdopen = os.fdopen
        failing = lambda *a, **k: FailingFile(real_fdopen(*a, **k), size // 2)
        monkeypatch.setattr(os, "fdopen", failing)
    elif where == "fsync":

        def fail(fd):
            raise OSError(errno.EIO, "I/O error (injected)")

        monkeypatch.setattr(os, "fsync", fail)
    elif where == "rename":

        def fail(src, dst):
            raise OSError(errno.EXDEV, "rename failed (injected)")

        monkeypatch.setattr(os, "replace", fail)


@pytest.mark.parametrize("where", ["serialiser", "write", "fsync", "rename"])
def test_failed_save_leaves_the_previous_checkpoint_and_no_temporary_file(
    tmp_path, monkeypatch, frozen_pair, where
):
    old, new = frozen_pair
    path, data = saved_file(tmp_path, old)
    inject(monkeypatch, where, len(data))
    with pytest.raises((OSError, RuntimeError), match="injected"):
        nvfp4x.save(path, new)
    monkeypatch.undo()
    assert path.read_bytes() == data, f"{where}: the previous checkpoint was changed"
    assert sorted(os.listdir(tmp_path)) == ["model.nvfp4x"], f"{where}: left {os.listdir(tmp_path)}"
    assert_same_bits(nvfp4x.load(path, new), old, f"{where}: the previous checkpoint")


def test_atomic_write_keeps_the_replaced_files_permissions(tmp_path):
    path = tmp_path / "file.bin"
    with _files.atomic_write(path) as f:
        f.write(b"one")
    assert path.stat().st_mode & 0o777 == 0o666 & ~_files.umask()
    path.chmod(0o640)
    with _files.atomic_write(path) as f:
        f.write(b"two")
    assert path.read_bytes() == b"two"
    assert path.stat().st_mode & 0o777 == 0o640


def test_a_new_file_follows_the_umask_of_when_it_is_written(tmp_path):
    previous = os.umask(0o077)  # set after nvfp4x was imported: must still count
    try:
        assert _files.umask() == 0o077
        with _files.atomic_write(tmp_path / "file.bin") as f:
            f.write(b"one")
        _files.write_folder(tmp_path / "folder", {"a.txt": b"a"})
    finally:
        os.umask(previous)
    assert (tmp_path / "file.bin").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "folder").stat().st_mode & 0o777 == 0o700
    assert _files.umask() == previous


SAVER = """
import sys
import jax.numpy as jnp
import nvfp4x
assert not any(m.startswith("orbax") for m in sys.modules), "import nvfp4x imported orbax"
i = 0
while True:  # a 16 MiB checkpoint, over and over, each with its own values
    nvfp4x.save(sys.argv[1], {"i": jnp.int32(i), "w": jnp.full((4, 1 << 20), i, jnp.float32)})
    print(i, flush=True)
    i += 1
"""


def test_save_killed_mid_write_leaves_a_complete_checkpoint(tmp_path):
    """A process saving a 16 MiB checkpoint in a loop is killed with SIGKILL at a random
    moment: the file at the path is one complete save (all its values from one `i`).
    (This also checks that `import nvfp4x` does not import Orbax.)"""
    path = tmp_path / "model.nvfp4x"
    # On the CPU: on a TPU host this process holds the chip, which one process at a time
    # can open (the saver's arrays are the file's contents, wherever they were made).
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-c", SAVER, str(path)], stdout=subprocess.PIPE, text=True, env=env
    )
    delay = random.uniform(0.0, 0.3)
    try:
        timer = threading.Timer(TIMEOUT, proc.kill)
        timer.start()
        first = proc.stdout.readline()  # the first save is complete
        timer.cancel()
        assert first.strip() == "0", f"the saver failed before its first save: {first!r}"
        time.sleep(delay)
    finally:
        proc.send_signal(signal.SIGKILL)
        rest = proc.communicate(timeout=TIMEOUT)[0]
    saves = 1 + len(rest.split())
    like = {
        "i": jax.ShapeDtypeStruct((), jnp.int32),
        "w": jax.ShapeDtypeStruct((4, 1 << 20), jnp.float32),
    }
    loaded = nvfp4x.load(path, like)
    i = int(loaded["i"])
    assert i >= 0 and np.all(np.asarray(loaded["w"]) == i), f"killed after {delay:.2f} s"
    assert i >= saves - 1, (i, saves)
    # At most the killed write's temporary file and its lock file are left next to it,
    # and the next save of that path removes them (the lock died with its process).
    others = [p for p in os.listdir(tmp_path) if p != "model.nvfp4x"]
    temporary = rf"\.model\.nvfp4x\.nvfp4x-[0-9a-f]{{8}}-{proc.pid}-[0-9a-f]{{8}}\.(tmp|lock~?)"
    assert len(others) <= 3 and all(re.fullmatch(temporary, p) for p in others), others
    nvfp4x.save(path, loaded)
    assert os.listdir(tmp_path) == ["model.nvfp4x"]


def _locked(path) -> int:
    """Create `path` and hold its `flock` (a writer that runs): the open descriptor."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_stale_temporaries_are_removed_but_not_a_live_writers(tmp_path, frozen_pair):
    """Temporaries named as `nvfp4x.save` names them, each with its lock file: one whose
    lock no process holds (its writer killed) is removed, with its lock file, by the next
    save or load of that path; one whose lock is held (a concurrent writer, here with
    the id of a process that has ended, as a writer in another container's PID
    namespace shows: removed before), one of another target and files nvfp4x did not
    make are kept."""
    old, _ = frozen_pair
    path, _ = saved_file(tmp_path, old)
    gone, host = dead_pid(), _files.HOST
    stale = tmp_path / f".model.nvfp4x.nvfp4x-{host}-{gone}-0123abcd.tmp"
    live = tmp_path / f".model.nvfp4x.nvfp4x-{host}-{gone}-4567cdef.tmp"
    other_target = tmp_path / f".other.nvfp4x.nvfp4x-{host}-{gone}-0123abcd.tmp"
    not_ours = tmp_path / ".model.nvfp4x.Xy12ab.tmp"
    unlocked = tmp_path / f".model.nvfp4x.nvfp4x-{host}-{gone}-89abcdef.tmp"  # no lock file
    holder = _locked(tmp_path / f".model.nvfp4x.nvfp4x-{host}-{gone}-4567cdef.lock")
    try:
        for use in ("load", "save"):
            for p in (stale, live, other_target, not_ours, unlocked):
                p.write_bytes(b"partial")
            (tmp_path / f".model.nvfp4x.nvfp4x-{host}-{gone}-0123abcd.lock").write_bytes(b"")
            if use == "load":
                nvfp4x.load(path, old)
            else:
                nvfp4x.save(path, old)
            assert not stale.exists() and not stale.with_suffix(".lock").exists(), use
            assert live.exists() and live.with_suffix(".lock").exists(), use
            assert other_target.exists() and not_ours.exists(), use
            assert unlocked.exists(), use  # its writer cannot be proven gone: its age
    finally:
        os.close(holder)


def test_one_rule_says_when_a_writer_is_gone(tmp_path):
    """`_files.writer_gone` decides for temporaries and for the training checkpointer's
    claims alike: gone when the file's lock (its lock file's, for a temporary) exists
    and no process holds it, or when the file is untouched for `STALE_AFTER_S`; never
    for a file this process holds; process ids are not read."""
    path = tmp_path / "claim"
    path.write_text("x")
    assert _files.writer_gone(str(path))  # its lock not held: its writer died
    fd = _locked(path)
    assert not _files.writer_gone(str(path))  # held (by another open file, here)
    day_old = time.time() - _files.STALE_AFTER_S - 60
    os.utime(path, (day_old, day_old))
    assert _files.writer_gone(str(path))  # however held: a day without a change
    os.close(fd)
    held = str(tmp_path / "held")
    _files.create_locked(held, b"me")
    try:
        assert not _files.writer_gone(held)
        os.utime(held, (day_old, day_old))
        assert not _files.writer_gone(held)  # this process's own: never
    finally:
        _files.let_go(held)
    assert not os.path.exists(held) and os.listdir(tmp_path) == ["claim"]
    temporary = tmp_path / f".m.nvfp4x-{_files.HOST}-1-0123abcd.tmp"
    temporary.write_text("x")
    assert not _files.writer_gone(str(temporary))  # no lock file: wait for its age
    temporary.with_suffix(".lock").write_text("")
    assert _files.writer_gone(str(temporary))
    assert not _files.writer_gone(str(tmp_path / "missing"))


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder"])
def test_load_refuses_what_is_not_a_regular_file(tmp_path, frozen_pair, kind):
    """A FIFO would block a reader forever and `/dev/zero` never ends: both are refused
    at once, naming the file (a symlink is followed to what it points at)."""
    _, new = frozen_pair
    path = tmp_path / "model.nvfp4x"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    else:
        path.mkdir()
    what = {"fifo": "FIFO", "dev-zero": "character device", "folder": "folder"}[kind]
    with pytest.raises(ValueError, match=rf"`{re.escape(str(path))}` is a {what}.*not a regular"):
        nvfp4x.load(path, new)


@pytest.mark.parametrize("how", ["path", "link"])
def test_load_refuses_a_kernel_file_by_name(tmp_path, frozen_pair, how):
    """`/proc/self/mem` is a regular file to `stat` whose every read fails (a bare
    `OSError: [Errno 5]` before): refused by name, as the kernel's file it is."""
    _, new = frozen_pair
    path = pathlib.Path("/proc/self/mem")
    if how == "link":
        (tmp_path / "model.nvfp4x").symlink_to(path)
        path = tmp_path / "model.nvfp4x"
    with pytest.raises(ValueError, match=rf"`{re.escape(str(path))}` is the kernel's `/proc/"):
        nvfp4x.load(path, new)


@pytest.mark.parametrize("header", ["deep", "duplicate-key", "huge-length"])
def test_load_refuses_implausible_headers_naming_the_file(tmp_path, frozen_pair, header):
    old, new = frozen_pair
    path, data = saved_file(tmp_path, old)
    _, start = header_of(data)
    magic = data.index(b"\n") + 1
    raw = {
        "deep": b"[" * 100_000 + b"]" * 100_000,
        "duplicate-key": b'{"format_version": 2, "format_version": 2, "layers": {}}',
        "huge-length": None,
    }[header]
    if raw is None:
        path.write_bytes(data[:magic] + (2**63).to_bytes(8, "little") + data[magic + 8 :])
    else:
        path.write_bytes(data[:magic] + len(raw).to_bytes(8, "little") + raw + data[start:])
    with pytest.raises(ValueError, match=rf"`{re.escape(str(path))}`.*(truncated or corrupt)"):
        nvfp4x.load(path, new)


def test_flipped_byte_anywhere_is_refused_naming_the_file(tmp_path, frozen_pair):
    old, new = frozen_pair
    path, data = saved_file(tmp_path, old)
    header, start = header_of(data)
    assert header["format_version"] == 2 and len(header["payload_sha256"]) == 64
    rng = np.random.default_rng(0)
    in_payload = {start, len(data) - 1, *rng.integers(start, len(data), 40).tolist()}
    in_header = {0, start - 1, *rng.integers(0, start, 40).tolist()}
    name = re.escape(str(path))
    for i in sorted(in_payload | in_header):
        path.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :])
        match = rf"`{name}` is corrupted: the sha256" if i >= start else rf"`{name}`"
        with pytest.raises(ValueError, match=match):
            nvfp4x.load(path, new)


@pytest.mark.parametrize("cut", ["at-payload", "mid-payload", "last-byte"])
def test_truncated_file_is_refused_naming_the_file(tmp_path, frozen_pair, cut):
    old, new = frozen_pair
    path, data = saved_file(tmp_path, old)
    _, start = header_of(data)
    at = {"at-payload": start, "mid-payload": (start + len(data)) // 2, "last-byte": len(data) - 1}
    path.write_bytes(data[: at[cut]])
    with pytest.raises(ValueError, match=rf"`{re.escape(str(path))}` is truncated"):
        nvfp4x.load(path, new)


def test_version_1_file_loads_with_a_warning(tmp_path, frozen_pair):
    """A file as nvfp4x 0.1 wrote it (header: format version 1, layers, arrays; no
    checksum) loads to the same bits, warning that it cannot be verified."""
    old, new = frozen_pair
    path, data = saved_file(tmp_path, old)
    header, start = header_of(data)
    v1 = {"format_version": 1, "layers": header["layers"], "arrays": header["arrays"]}
    raw = json.dumps(v1).encode()
    magic = data.index(b"\n") + 1
    path.write_bytes(data[:magic] + len(raw).to_bytes(8, "little") + raw + data[start:])
    with pytest.warns(UserWarning, match=r"version 1, which carries no checksum.*Save it again"):
        loaded = nvfp4x.load(path, eqx.filter_eval_shape(build_frozen, 3))
    assert_same_bits(loaded, old, "version-1 file")
    nvfp4x.save(path, loaded)  # saving it again gives a version-2 file
    assert header_of(path.read_bytes())[0]["format_version"] == 2


def test_save_under_jit_names_the_traced_leaf(tmp_path):
    path = tmp_path / "model.nvfp4x"

    @jax.jit
    def step(w):
        nvfp4x.save(path, {"w": w})
        return w

    with pytest.raises(TypeError, match=r"nvfp4x\.save: the leaf `\[w\]` is traced.*outside"):
        step(jnp.ones(3))
    assert not path.exists()
