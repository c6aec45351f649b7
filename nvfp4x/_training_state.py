"""A training run's whole state with Orbax: `TrainingCheckpointer`.

Sharded arrays are saved and restored sharded; every leaf is verified on restore by a
checksum that does not depend on how the array is sharded (`_checksum.py`); a single-
process run claims a step (a lock file) before writing it.
"""

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import secrets
import sys
import threading
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from . import _files
from ._checkpoint import _TRACED, _first_difference, _layer_recipes, _refuse_traced
from ._checksum import checksums
from ._files import MAX_JSON_BYTES, irregular_file, load_json, read_regular
from ._sites import path_str

_STATE_FORMAT = "nvfp4x-training-state"
_STATE_VERSION = 1
# Python numbers in a state: saved as 0-d numpy arrays of these dtypes, restored as Python.
_PYTHON_SCALARS = {
    "bool": (bool, np.bool_),
    "int": (int, np.int64),
    "float": (float, np.float64),
    "complex": (complex, np.complex128),
}


def _orbax():
    try:  # an optional dependency (the `checkpoint` extra): imported where it is used
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise ImportError(
            "`nvfp4x.TrainingCheckpointer` saves with Orbax, which is not installed: "
            '`pip install orbax-checkpoint` (or `pip install "nvfp4x[checkpoint]"`).'
        ) from e
    return ocp


def _is_key(leaf: Any) -> bool:
    return jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One saved leaf of a state: where it is, what kind of thing it is and what the
    checkpoint stores for it (key arrays as their `key_data`, Python numbers as 0-d
    numpy arrays)."""

    path: str
    kind: str  # "array", "key" or one of _PYTHON_SCALARS
    shape: tuple[int, ...]
    dtype: str


def _leaf(path: str, leaf: Any) -> _Leaf | None:
    """What the checkpoint holds for `leaf`, or `None` for a leaf that is not saved
    (functions, strings: they come from `like` on restore)."""
    if isinstance(leaf, jax.Array | jax.ShapeDtypeStruct | np.ndarray | np.generic):
        if isinstance(leaf, np.ndarray | np.generic) and (
            leaf.dtype.kind in "OUS" or leaf.dtype.fields is not None
        ):
            raise TypeError(
                f"The state's leaf `{path}` is a numpy array of dtype {leaf.dtype}; only "
                "numeric arrays can be checkpointed. Keep it out of the state."
            )
        kind = "key" if _is_key(leaf) else "array"
        return _Leaf(path, kind, tuple(leaf.shape), str(leaf.dtype))
    for kind, (cls, _) in _PYTHON_SCALARS.items():
        if type(leaf) is cls:
            return _Leaf(path, kind, (), kind)
    return None


def _leaves(state: Any) -> tuple[list, list[_Leaf | None], Any]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    leaves = [leaf for _, leaf in flat]
    return leaves, [_leaf(path_str(p), leaf) for p, leaf in flat], treedef


def _stored(leaf: Any, spec: _Leaf) -> Any:
    if spec.kind == "key":
        return jax.random.key_data(leaf)
    if spec.kind in _PYTHON_SCALARS:
        return np.asarray(leaf, dtype=_PYTHON_SCALARS[spec.kind][1])
    if isinstance(leaf, np.generic):
        return np.asarray(leaf)
    return leaf


def _placement(like: Any, spec: _Leaf) -> jax.sharding.Sharding:
    """Where `like`'s leaf is restored: its sharding, on the first local device if it
    has none, and on the mesh set by `jax.set_mesh` if its mesh is abstract (as
    `eqx.filter_eval_shape` gives for arrays sharded over explicit mesh axes)."""
    sharding = getattr(like, "sharding", None)
    if sharding is None:
        return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if isinstance(sharding, jax.sharding.NamedSharding) and isinstance(
        sharding.mesh, jax.sharding.AbstractMesh
    ):
        mesh = jax.sharding.get_mesh()
        shape = lambda m: tuple(zip(m.axis_names, m.axis_sizes, strict=True))
        if mesh.empty or shape(mesh) != shape(sharding.mesh):
            raise ValueError(
                f"`like`'s leaf `{spec.path}` is sharded over an abstract mesh "
                f"{dict(shape(sharding.mesh))}, and no mesh of that shape is set: restore "
                "inside `with jax.set_mesh(mesh):`, or give `like` concrete shardings."
            )
        return jax.sharding.NamedSharding(mesh, sharding.spec)
    return sharding


def _key_data_target(like: Any, spec: _Leaf) -> jax.ShapeDtypeStruct:
    """Where a key array's `key_data` is restored for `like` (a key array, or a
    `ShapeDtypeStruct` of one): the key's sharding, trailing key words unsharded."""
    if isinstance(like, jax.Array):
        data = jax.random.key_data(like)
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=data.sharding)
    abstract = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(like.shape, like.dtype))
    sharding = _placement(like, spec)
    if isinstance(sharding, jax.sharding.NamedSharding):
        words = (None,) * (abstract.ndim - len(sharding.spec))
        sharding = jax.sharding.NamedSharding(
            sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec, *words)
        )
    elif not isinstance(sharding, jax.sharding.SingleDeviceSharding):
        like = jax.ShapeDtypeStruct(like.shape, like.dtype, sharding=sharding)
        sharding = jax.jit(jax.random.key_data).lower(like).compile().output_shardings
    return jax.ShapeDtypeStruct(abstract.shape, abstract.dtype, sharding=sharding)


def _target(like: Any, spec: _Leaf) -> Any:
    """What Orbax restores the leaf into: a sharded `ShapeDtypeStruct` for a jax leaf, a
    numpy array for a numpy leaf or a Python number."""
    if spec.kind == "key":
        return _key_data_target(like, spec)
    if spec.kind in _PYTHON_SCALARS:
        return np.zeros((), _PYTHON_SCALARS[spec.kind][1])
    if isinstance(like, np.ndarray | np.generic):
        return np.zeros(like.shape, like.dtype)
    return jax.ShapeDtypeStruct(like.shape, like.dtype, sharding=_placement(like, spec))


def _key_impl(like: Any):
    if isinstance(like, jax.Array):
        return jax.random.key_impl(like)
    return like.dtype._impl  # a ShapeDtypeStruct's key dtype names its implementation


def _rebuilt(like: Any, spec: _Leaf, value: Any) -> Any:
    if spec.kind == "key":
        return jax.random.wrap_key_data(value, impl=_key_impl(like))
    if spec.kind in _PYTHON_SCALARS:
        return _PYTHON_SCALARS[spec.kind][0](value[()])
    if isinstance(like, np.generic):
        return np.asarray(value)[()]
    return value


class TrainingCheckpointer:
    """Checkpoints of a training run's state with Orbax: save every few steps, and after
    a crash or a kill resume from the last one to the same bits as a run never stopped.

    `state` is any PyTree: a quantised model (its master weights; recipes and other
    static fields come from `like` on restore), the optimiser state, the step, the data
    position, PRNG keys (typed `jax.random.key` arrays included), NumPy arrays and Python
    numbers. Other leaves (functions, strings) are not saved and come from `like`.

    - **Sharded.** Each process writes the shards it holds (Orbax); restore places every
      array with `like`'s sharding, which may differ from the one saved.
    - **Atomic.** A step is written to a temporary folder and renamed when complete
      (Orbax); a save cut short is never listed by `latest_step` nor restored, and its
      folder is removed (from when a `TrainingCheckpointer` opens the directory, at the
      latest before its first save).
    - **Verified.** Each step records every leaf's path, shape, dtype and a checksum of
      its bits, computed where the array lives (a jitted reduction, no gather, equal
      for any sharding). `restore` checks them all and raises `ValueError` naming the
      folder, the step and what is wrong: a corrupted checkpoint is never returned.
    - **One writer per step.** A single-process run claims a step (a lock file in the
      folder) before writing it: a second process saving the same step into the same
      folder is refused by name, and a save is reported done only once its own files
      are the step's.

    Saves are asynchronous by default: `save` returns once the arrays are copied off
    the devices, and the files are written in the background. A background save that
    failed raises its error (`RuntimeError` naming the folder and the step) at the next
    call of the checkpointer, at `wait_until_finished` or at `close` (the end of a
    `with` block); it never holds up the process's exit (a checkpointer not closed is
    closed at exit, its error printed).

    **Arguments:**

    - `directory`: the folder holding one subfolder per saved step (created if needed).
    - `max_to_keep`: keep only the last this many steps (default: all).
    - `async_save`: write in the background (default) or before `save` returns.

    ```python
    with nvfp4x.TrainingCheckpointer("ckpt", max_to_keep=3) as ckpt:
        state = {"model": qmodel, "opt_state": opt_state, "step": 0, "key": key}
        if ckpt.latest_step() is not None:
            state = ckpt.restore(state)   # like: the freshly built state
        while state["step"] < steps:
            state = train_step(state)
            if state["step"] % 100 == 0:
                ckpt.save(state["step"], state)
    ```

    Needs `orbax-checkpoint` (`pip install "nvfp4x[checkpoint]"`).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = None,
        async_save: bool = True,
    ):
        if max_to_keep is not None:
            if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int | np.integer):
                raise TypeError(
                    f"`max_to_keep` must be an int (at least 1) or None, got "
                    f"{type(max_to_keep).__name__} {max_to_keep!r}."
                )
            if max_to_keep < 1:
                raise ValueError(f"`max_to_keep` must be at least 1 or None, got {max_to_keep}.")
            max_to_keep = int(max_to_keep)
        if not isinstance(async_save, bool | np.bool_):
            raise TypeError(
                f"`async_save` must be True or False, got {type(async_save).__name__} "
                f"{async_save!r}."
            )
        if not isinstance(directory, str | os.PathLike):
            raise TypeError(
                f"`directory` must be a path (str or os.PathLike), got {type(directory).__name__}."
            )
        ocp = _orbax()
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=bool(async_save),
            cleanup_tmp_directories=True,
            create=True,
        )
        self._ocp = ocp
        _check_listed_files(self.directory)
        try:
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        except (ValueError, KeyError, TypeError, AttributeError, AssertionError) as e:
            raise ValueError(
                f"`{self.directory}` cannot be opened: a step's Orbax metadata is corrupted"
                f"{_damaged_steps(self.directory)} ({type(e).__name__}: {e}). Move that "
                "step's folder away, or restore it from a good copy."
            ) from e
        self._pending: list[_Pending] = []  # saves not yet confirmed, oldest first
        self._closed = False
        _close_at_exit(self)

    def __repr__(self) -> str:
        return f"TrainingCheckpointer({self.directory!r})"

    def __enter__(self) -> "TrainingCheckpointer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def all_steps(self) -> list[int]:
        """**Returns:** the steps with a complete checkpoint, in increasing order."""
        self._surface(wait=False)
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """**Returns:** the last step with a complete checkpoint, or `None` if there is
        none (a step still being written, or cut short by a crash, does not count)."""
        self._surface(wait=False)
        return self._manager.latest_step()

    def save(self, step: int, state: Any) -> None:
        """Checkpoint `state` as step `step`.

        **Arguments:**

        - `step`: the step number, larger than every step already saved in the folder.
        - `state`: the PyTree to save (see the class).

        **Returns:** nothing; with `async_save`, the files are complete after
        `wait_until_finished` (which raises if the save failed).

        **Raises:** `ValueError` for a step not larger than the folder's latest, or one
        that another process is writing; `RuntimeError` if an earlier background save
        failed; `TypeError` for a traced state (call it outside `jax.jit`).
        """
        if isinstance(step, Tracer):
            raise TypeError(_TRACED.format(what="`step`"))
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
            raise TypeError(f"`step` must be a non-negative int, got {step!r}.")
        step = int(step)
        _refuse_traced(state, "TrainingCheckpointer.save")
        self._surface(wait=True)  # Orbax waits for the previous save anyway
        latest = self._manager.latest_step()
        if latest is not None and step <= latest:
            raise ValueError(
                f"`{self.directory}` already has a checkpoint of step {latest} >= {step}: "
                "steps must increase. Restore the latest step and continue from it, or "
                "checkpoint into another directory."
            )
        leaves, specs, _ = _leaves(state)
        saved = [(leaf, spec) for leaf, spec in zip(leaves, specs, strict=True) if spec]
        values = [_stored(leaf, spec) for leaf, spec in saved]
        token = secrets.token_hex(8)
        metadata = {
            "format": _STATE_FORMAT,
            "version": _STATE_VERSION,
            "step": step,
            "writer": token,
            "layers": _layer_recipes(state),
            "leaves": [
                {**dataclasses.asdict(spec), "checksum": checksum}
                for (_, spec), checksum in zip(saved, checksums(values), strict=True)
            ],
        }
        metadata["digest"] = _metadata_digest(metadata)
        args: dict[str, Any] = {"nvfp4x": self._ocp.args.JsonSave(metadata)}
        if values:
            args["state"] = self._ocp.args.StandardSave(values)
        claim = self._claim(step, token)
        try:
            started = self._manager.save(step, args=self._ocp.args.Composite(**args))
        except BaseException as e:
            _release(claim)
            raise self._failed(step, e) from e
        pending = _Pending(step, token, claim, _operation_id())
        if not started:
            _release(claim)
            raise ValueError(f"Orbax declined to save step {step} in `{self.directory}`.")
        self._pending.append(pending)
        if not self._manager.is_saving_in_progress():
            self._surface(wait=True)

    def restore(self, like: Any, step: int | None = None) -> Any:
        """Read a checkpoint into the structure of `like`, verifying every leaf.

        **Arguments:**

        - `like`: a state of the same structure: the freshly built state, or its
          `eqx.filter_eval_shape` (then arrays whose `ShapeDtypeStruct` has no sharding
          go to the first local device). Arrays are restored with `like`'s shardings;
          static fields and leaves that are not saved are taken from `like`.
        - `step`: the step to read (default: the latest).

        **Returns:** `like` with every saved leaf read from the checkpoint (key arrays
        as key arrays, Python numbers as Python numbers).

        **Raises:** `FileNotFoundError` if there is no such checkpoint; `ValueError` if
        the checkpoint does not match `like` (structure, shapes, dtypes, recipes), or
        naming the folder and the step as corrupted if its files cannot be read or a
        leaf's checksum differs.
        """
        self._surface(wait=True)
        where = f"`{self.directory}`"
        _check_listed_files(self.directory)
        self._manager.reload()
        if step is None:
            step = self._manager.latest_step()
            if step is None:
                raise FileNotFoundError(f"{where} holds no complete checkpoint.")
        elif step not in self._manager.all_steps():
            raise FileNotFoundError(
                f"{where} has no checkpoint of step {step}; it has steps {self.all_steps()}."
            )
        where = f"{where} step {step}"
        fix = "Restore an earlier step, or the files from a good copy."
        # Before Orbax opens anything: it would wait forever on a FIFO and read
        # `/dev/zero` until memory runs out.
        problem = irregular_file(self._step_dir(step), max_bytes=MAX_JSON_BYTES)
        if problem is not None:
            raise ValueError(f"{where} is corrupted: {problem}. {fix}")
        ocp = self._ocp
        restore = lambda **items: self._manager.restore(step, args=ocp.args.Composite(**items))
        try:
            metadata = restore(nvfp4x=ocp.args.JsonRestore())["nvfp4x"]
        except Exception as e:  # Orbax raises many types for damaged files
            if isinstance(e, FileNotFoundError | KeyError) and not self._has_item(step):
                raise ValueError(
                    f"{where} was not written by `nvfp4x.TrainingCheckpointer`."
                ) from e
            raise ValueError(
                f"{where} is corrupted: its nvfp4x metadata cannot be read "
                f"({type(e).__name__}: {e}). {fix}"
            ) from e
        records = _parse_metadata(where, metadata, step, fix)
        leaves, specs, treedef = _leaves(like)
        saved = [(i, spec) for i, spec in enumerate(specs) if spec]
        _check_matches(where, metadata, records, [spec for _, spec in saved], like)
        targets = [_target(leaves[i], spec) for i, spec in saved]
        try:
            values = restore(state=ocp.args.StandardRestore(targets))["state"] if targets else []
            found = checksums(values)
        except Exception as e:  # the metadata matches `like`: the files must too
            raise ValueError(
                f"{where} is corrupted: its arrays cannot be read ({type(e).__name__}: {e}). {fix}"
            ) from e
        for (_, spec), record, got in zip(saved, records, found, strict=True):
            if got != record.checksum:
                raise ValueError(
                    f"{where} is corrupted: the leaf `{spec.path}` read back has checksum "
                    f"{got}, the checkpoint recorded {record.checksum}. {fix}"
                )
        out = list(leaves)
        for (i, spec), value in zip(saved, values, strict=True):
            out[i] = _rebuilt(leaves[i], spec, value)
        return jax.tree_util.tree_unflatten(treedef, out)

    def wait_until_finished(self) -> None:
        """Block until every save started so far is written and renamed into place.

        **Raises:** `RuntimeError` naming the folder and the step if a save failed or
        did not commit (another writer's files hold the step)."""
        self._surface(wait=True)

    def close(self) -> None:
        """Finish pending saves and release Orbax's resources; a failed save raises its
        error here, after the resources are released."""
        if self._closed:
            return
        try:
            self._surface(wait=True)
        finally:
            self._closed = True
            try:
                self._manager.close()
            except Exception:  # an error already raised above, or raised once by Orbax
                _release_waiters([p.operation for p in self._pending])
                with contextlib.suppress(Exception):
                    self._manager.close()
            for pending in self._pending:
                _release(pending.claim)
            self._pending.clear()

    # --- pending saves ---

    def _surface(self, *, wait: bool) -> None:
        """Raise the error of a background save that failed, and confirm one that
        finished (a step is done only if its files are this checkpointer's); `wait`:
        wait for a save in progress, else leave it pending."""
        if not self._pending or (not wait and self._manager.is_saving_in_progress()):
            return
        pending, self._pending = self._pending, []
        try:
            try:
                self._manager.wait_until_finished()
            except Exception as e:
                _release_waiters([p.operation for p in pending])
                raise self._failed(", ".join(str(p.step) for p in pending), e) from e
            if jax.process_count() == 1:  # one run's processes: Orbax coordinates them
                for p in pending:
                    self._confirm(p)
        finally:
            for p in pending:
                _release(p.claim)

    def _failed(self, step: int | str, error: BaseException) -> BaseException:
        """The error to raise for a save of `step` that Orbax failed: `RuntimeError`
        naming the folder and the step, whatever Orbax raised (a full disk reaches it as
        tensorstore's `ValueError`), with that error as its cause."""
        if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit: as they are
            return error
        return RuntimeError(
            f"`{self.directory}`: the save of step {step} failed, and the step was not "
            f"written ({type(error).__name__}: {error})."
        )

    def _confirm(self, pending: "_Pending") -> None:
        if os.path.isdir(self._step_dir(pending.step)):
            try:
                path = os.path.join(self._step_dir(pending.step), "nvfp4x", "metadata")
                metadata = load_json(read_regular(path), f"`{path}`")
                writer = metadata.get("writer") if isinstance(metadata, dict) else None
            except (OSError, ValueError):  # unreadable: not ours either
                writer = None
            if writer == pending.token:
                return
            raise RuntimeError(
                f"`{self.directory}`: the save of step {pending.step} did not commit: the "
                "step's files are not this save's (another process wrote the same step into "
                "this folder). Give each run its own folder."
            )
        raise RuntimeError(
            f"`{self.directory}`: the save of step {pending.step} did not commit: the step "
            "is not in the folder after the save ended."
        )

    def _step_dir(self, step: int) -> str:
        """The folder of a committed step (Orbax names it by the step's number)."""
        return os.path.join(self.directory, str(step))

    def _has_item(self, step: int) -> bool:
        """Whether the step has an `nvfp4x` item (a step nvfp4x wrote, even damaged)."""
        return os.path.isdir(os.path.join(self._step_dir(step), "nvfp4x"))

    def _claim(self, step: int, token: str) -> str | None:
        """Claim `step` for this process (a lock file, single-process runs): refuse it
        if another live process holds it, or committed it meanwhile."""
        if jax.process_count() > 1:  # Orbax coordinates the processes of one run
            return None
        path = os.path.join(self.directory, f".nvfp4x-step-{step}.claim")
        record = f"{_files.HOST} {os.getpid()} {token}"
        for _ in range(2):
            try:  # locked (`flock`) while this process lives: the proof it is not gone
                _files.create_locked(path, record.encode())
            except FileExistsError:
                holder = _claim_holder(path)
                if holder is not None:
                    raise ValueError(
                        f"`{self.directory}`: step {step} is being written by another "
                        f"process ({holder}): two writers of one step into one folder. Give "
                        "each run its own folder."
                    ) from None
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # a killed writer's claim
                continue
            break
        else:
            raise ValueError(f"`{self.directory}`: could not claim step {step} (contended).")
        if os.path.isdir(self._step_dir(step)):
            _release(path)
            raise ValueError(
                f"`{self.directory}` already has a checkpoint of step {step} (written by "
                "another process): steps must increase."
            )
        return path


def _check_listed_files(directory: str) -> None:
    """Raise `ValueError` naming the step and file if a step's `_CHECKPOINT_METADATA`
    (which Orbax reads for every step when it lists them) is not a regular file of
    plausible size: Orbax would wait forever on a FIFO, read `/dev/zero` until memory
    runs out."""
    with contextlib.suppress(OSError):
        names = sorted((n for n in os.listdir(directory) if n.isdigit()), key=int)
        for name in names:
            path = os.path.join(directory, name, "_CHECKPOINT_METADATA")
            if not os.path.lexists(path):
                continue
            problem = irregular_file(path, max_bytes=MAX_JSON_BYTES)
            if problem is not None:
                raise ValueError(
                    f"`{directory}` cannot be opened: step {name} is corrupted: {problem}. "
                    "Move that step's folder away, or restore it from a good copy."
                )


def _damaged_steps(directory: str) -> str:
    """`" (step 5)"` where one step's `_CHECKPOINT_METADATA` is not a JSON object (for
    an error message: which step made Orbax fail), else `""`."""
    damaged = []
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if not name.isdigit():
                continue
            try:
                path = os.path.join(directory, name, "_CHECKPOINT_METADATA")
                raw = read_regular(path, max_bytes=_files.MAX_JSON_BYTES)
                ok = isinstance(load_json(raw, f"`{path}`"), dict)
            except (OSError, ValueError):
                ok = False
            if not ok:
                damaged.append(int(name))
    return f" (step {damaged[0]})" if len(damaged) == 1 else ""


@dataclasses.dataclass
class _Pending:
    """A save started and not yet confirmed."""

    step: int
    token: str  # the `writer` recorded in its nvfp4x metadata
    claim: str | None  # its lock file
    operation: str | None  # Orbax's operation id of the save


def _claim_holder(path: str) -> str | None:
    """Who holds the claim at `path` (`"host <hash>, pid <id>"`), or None where its
    writer is gone (`_files.writer_gone`, the rule for temporaries too: the claim's
    lock released)."""
    if _files.writer_gone(path):
        return None
    try:
        text = read_regular(path, max_bytes=4096).decode(errors="replace")
        host, pid, _ = text.split()
    except (OSError, ValueError):
        host, pid = "?", "?"  # (written before it was linked into place: unreadable)
    if not os.path.lexists(path):
        return None  # released meanwhile
    return f"host {host}, pid {pid}"


def _release(claim: str | None) -> None:
    if claim is not None:
        _files.let_go(claim)


def _operation_id() -> str | None:
    try:
        from orbax.checkpoint._src.futures import synchronization
    except ImportError:  # pragma: no cover - another Orbax layout
        return None
    return synchronization.OperationIdGenerator.get_current_operation_id()


def _release_waiters(operations: list[str | None]) -> None:
    """Wake Orbax's threads still waiting for a signal of a failed save (they would wait
    out Orbax's coordination timeout, 300 s or more, and hold the process's exit)."""
    try:
        from orbax.checkpoint._src.futures import future
    except ImportError:  # pragma: no cover - another Orbax layout
        return
    signalling = getattr(future, "_SignalingThread", None)
    set_signals = getattr(future, "set_signals", None)
    wanted = {op for op in operations if op is not None}
    if signalling is None or set_signals is None or not wanted:
        return  # another Orbax: `tests/test_checkpoint.py` times the exit after a failure
    for thread in threading.enumerate():
        if not isinstance(thread, signalling):
            continue
        operation = getattr(thread, "_operation_id", None)
        if operation in wanted:
            setattr(thread, "_cancelled", True)  # noqa: B010 - it returns without running its target
            with contextlib.suppress(Exception):
                set_signals(getattr(thread, "_receive_signals", ()), operation_id=operation)


def _close_at_exit(checkpointer: TrainingCheckpointer) -> None:
    """Close `checkpointer` when the interpreter exits, before it waits for threads."""
    ref = weakref.ref(checkpointer)

    def close() -> None:
        ckpt = ref()
        if ckpt is None or ckpt._closed:
            return
        try:
            ckpt.close()
        except Exception as e:  # nobody left to raise to: say it
            print(f"nvfp4x.TrainingCheckpointer at exit: {e}", file=sys.stderr)

    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        with contextlib.suppress(RuntimeError):  # the interpreter is already exiting
            register(close)


_METADATA_KEYS = {"format", "version", "step", "writer", "layers", "leaves", "digest"}


def _metadata_digest(metadata: dict) -> str:
    """The sha256 of the step's nvfp4x metadata, all of it but the digest itself (steps
    written before nvfp4x recorded it have none, and no `writer`)."""
    rest = {k: v for k, v in metadata.items() if k != "digest"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def _parse_metadata(where: str, metadata: Any, step: int, fix: str) -> list["_Record"]:
    """The step's leaf records, every field checked: a damaged metadata file is refused
    as corrupted, naming the folder and the step, never a `KeyError` later."""

    def corrupted(what: str) -> ValueError:
        return ValueError(f"{where} is corrupted: its nvfp4x metadata {what}. {fix}")

    if not isinstance(metadata, dict):
        raise corrupted(f"is a {type(metadata).__name__}, not an object")
    unknown = sorted(set(metadata) - _METADATA_KEYS)
    if unknown:
        raise corrupted(f"has unknown entries {unknown}")
    if "digest" in metadata:
        if metadata["digest"] != _metadata_digest(metadata):
            raise corrupted("fails its sha256 digest")
    elif "writer" in metadata:  # written with a digest, which was lost
        raise corrupted("has lost its sha256 digest")
    if metadata.get("format") != _STATE_FORMAT:
        raise ValueError(
            f"{where} was not written by `nvfp4x.TrainingCheckpointer`, or is corrupted "
            f"(format {metadata.get('format')!r}). {fix}"
        )
    version = metadata.get("version")
    if version != _STATE_VERSION:
        raise ValueError(
            f"{where} has training-state format version {version!r}; this nvfp4x reads "
            f"version {_STATE_VERSION} (or the step is corrupted)."
        )
    if metadata.get("step") != step or type(metadata.get("step")) is not int:
        raise corrupted(f"records step {metadata.get('step')!r}")
    layers = metadata.get("layers")
    if not isinstance(layers, dict) or not all(
        isinstance(v, list) and len(v) == 2 and all(isinstance(s, str) for s in v)
        for v in layers.values()
    ):
        raise corrupted("has malformed layer recipes")
    leaves = metadata.get("leaves")
    if not isinstance(leaves, list):
        raise corrupted("has no list of leaves")
    records = []
    kinds = {"array", "key", *_PYTHON_SCALARS}
    for i, leaf in enumerate(leaves):
        ok = (
            isinstance(leaf, dict)
            and set(leaf) == {"path", "kind", "shape", "dtype", "checksum"}
            and isinstance(leaf["path"], str)
            and leaf["kind"] in kinds
            and isinstance(leaf["shape"], list)
            and all(type(d) is int and d >= 0 for d in leaf["shape"])
            and isinstance(leaf["dtype"], str)
            and isinstance(leaf["checksum"], str)
            and re.fullmatch(r"[0-9a-f]{16}", leaf["checksum"]) is not None
        )
        if not ok:
            raise corrupted(f"has a malformed record for leaf {i}: {leaf!r:.200}")
        spec = _Leaf(leaf["path"], leaf["kind"], tuple(leaf["shape"]), leaf["dtype"])
        records.append(_Record(spec, leaf["checksum"]))
    return records


@dataclasses.dataclass(frozen=True)
class _Record:
    """A leaf as the checkpoint records it."""

    spec: _Leaf
    checksum: str


def _check_matches(
    where: str, metadata: dict, records: list[_Record], specs: list[_Leaf], like: Any
) -> None:
    fix = "Build `like` the same way as the state that was saved (model, policy, optimiser)."
    for record, spec in zip(records, specs, strict=False):
        saved = record.spec
        if saved.path != spec.path:
            raise ValueError(
                f"{where} does not match `like`: the checkpoint has the leaf `{saved.path}` "
                f"where `like` has `{spec.path}`. {fix}"
            )
        if saved != spec:
            raise ValueError(
                f"{where} does not match `like` at the leaf `{spec.path}`: saved "
                f"{saved.kind} {saved.dtype}{list(saved.shape)}, `like` has {spec.kind} "
                f"{spec.dtype}{list(spec.shape)}. {fix}"
            )
    if len(records) != len(specs):
        raise ValueError(
            f"{where} does not match `like`: the checkpoint has {len(records)} leaves, "
            f"`like` has {len(specs)}. {fix}"
        )
    layers = _layer_recipes(like)
    saved_layers = metadata.get("layers", {})
    if saved_layers != json.loads(json.dumps(layers)):
        diff = _first_difference(saved_layers, layers)
        raise ValueError(
            f"{where} does not match `like`: different layer recipes ({diff}). To resume "
            "under another policy, restore into the saved one and `nvfp4x.requantize`."
        )
