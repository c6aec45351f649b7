"""Files that lose nothing and let nothing in.

- `atomic_write`: one file written all at once or not at all (temporary file, fsync,
  rename over the target).
- `atomic_folder`: a folder replaced as a whole or not at all: written into a sibling
  folder, then swapped in with one atomic rename (`renameat2(RENAME_EXCHANGE)` on Linux,
  `renamex_np(RENAME_SWAP)` on macOS), so a reader of the folder sees the old contents
  or the new, never a mix.
- Temporaries carry recognisable names (`.<target>.nvfp4x-<host>-<pid>-<random>.<kind>`)
  and a lock file beside them (`...<random>.lock`) that the writer holds locked
  (`flock`) while it writes: the next write of the same target removes those a killed
  process left behind (its lock released by the kernel when it died), and never those of
  a writer still running, in any PID namespace on any host whose file system honours
  the lock (a container sharing the volume, whose process ids mean nothing here).
- `read_regular` / `load_json`: reads that refuse what is not a regular file (a FIFO
  would block, `/dev/zero` never ends) or not plausible JSON (too large, too deep,
  duplicate keys), naming the file.
"""

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import stat
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, BinaryIO

try:
    import fcntl
except ImportError:  # Windows: no `flock`; temporaries are then removed by age only
    fcntl = None

#: A temporary is stale after this many seconds without a change, whoever made it; before
#: that, only when its lock file can be locked (its writer is gone).
STALE_AFTER_S = 24 * 3600
#: The largest JSON file (config, index, checkpoint header) nvfp4x reads.
MAX_JSON_BYTES = 100_000_000  # the safetensors library's limit for its header
#: The deepest nesting of arrays and objects accepted in such a file.
MAX_JSON_DEPTH = 64

#: This host, as temporaries and claims name it (a hash of its name).
HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_TEMPORARY = re.compile(
    r"\.(?P<target>.+)\.nvfp4x-(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-[0-9a-f]{8}\.(?P<kind>[a-z]+~?)"
)
_live: set[str] = set()  # absolute paths of the temporaries this process is writing
_held: dict[str, int] = {}  # path -> descriptor of a locked file this process holds
_live_lock = threading.Lock()
_umask_lock = threading.Lock()


# --- temporaries ---


@contextlib.contextmanager
def _temporary(target: str, kind: str) -> Iterator[str]:
    """A fresh temporary path next to `target`, recorded as live while the block runs."""
    directory, base = os.path.split(target)
    stem = f".{base}.nvfp4x-{HOST}-{os.getpid()}-{secrets.token_hex(4)}"
    path = os.path.join(directory, f"{stem}.{kind}")
    lock = os.path.join(directory, f"{stem}.lock")
    with _live_lock:
        _live.add(path)
    try:
        create_locked(lock)  # held while the temporary may exist
        try:
            yield path
        finally:
            let_go(lock)
    finally:
        with _live_lock:
            _live.discard(path)


def lock_of(path: str) -> str:
    """The lock file of the temporary `path` (a temporary named as `_temporary` names
    them: the same name with the kind `lock`); a lock file is its own."""
    return (
        path[: path.rindex(".")] + ".lock" if _TEMPORARY.fullmatch(os.path.basename(path)) else path
    )


def create_locked(path: str, content: bytes = b"") -> None:
    """Create the file `path` holding `content`, locked (`flock`) by this process until
    `let_go`; `FileExistsError` if it exists. It is made under a private name, locked,
    then linked into place, so that no other process ever sees it unlocked."""
    unique = _TEMPORARY.fullmatch(os.path.basename(path)) is not None  # (a random part)
    private = f"{path}~" if unique else f"{path}.{secrets.token_hex(4)}~"
    while True:
        fd = os.open(private, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        if fcntl is None:
            break
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_nlink:
            break
        # Removed between its creation and its lock by a cleaner that found it
        # unlocked (`writer_gone`, as for a writer killed there): made again.
        os.close(fd)
    try:
        os.write(fd, content)
        os.link(private, path)
    except BaseException:
        os.close(fd)
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(private)
    with _live_lock:
        _live.add(path)
        _held[path] = fd


def _lock_free(lock: str) -> bool:
    """Whether the lock file `lock` exists and no process holds its lock (taking it for
    a moment, without waiting). False where it cannot be told (no `flock`: Windows)."""
    if fcntl is None:
        return False
    try:
        fd = os.open(lock, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held (EWOULDBLOCK), or locks not supported here
        return False
    finally:
        os.close(fd)  # (releases the lock if taken)
    return True


def writer_gone(path: str, lock: str | None = None) -> bool:
    """Whether the writer of `path` (a temporary, or a claim on a step) is gone, so that
    `path` may be removed: the one rule for every leftover of a killed writer.

    Never while this process holds it; else when it is untouched for `STALE_AFTER_S`,
    or when its lock file `lock` (default: `lock_of(path)`), which its writer holds
    locked (`flock`) as long as it runs, exists and can be locked: the kernel released
    it when the writer died, whatever its host or PID namespace (process ids are not
    compared: in another container on the same host name they mean nothing here). A
    path that cannot be read, or whose lock file is missing, waits for its age.
    """
    lock = lock_of(path) if lock is None else lock
    with _live_lock:
        if path in _live or lock in _live:
            return False
    try:
        age = time.time() - os.lstat(path).st_mtime
    except OSError:
        return False
    if age > STALE_AFTER_S:
        return True
    if path.endswith("~"):  # a lock file not yet linked: locked by its writer, if alive
        return _lock_free(path)
    return _lock_free(lock)


def hold(path: str) -> None:
    """Mark `path` (a file this process made) as held by this process: `writer_gone`
    says no for it until `let_go`."""
    with _live_lock:
        _live.add(path)


def let_go(path: str) -> None:
    """Remove `path`, held with `hold` or `create_locked`, and stop holding it (its lock
    released after it is removed; a missing file is fine)."""
    with contextlib.suppress(OSError):
        os.unlink(path)
    with _live_lock:
        _live.discard(path)
        fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)


def umask() -> int:
    """The process's umask now (read when a file is made, so that a change after import
    counts): from `/proc/self/status` where Linux gives it, else by setting it and
    setting it back (`os.umask` cannot be read otherwise; other threads may then see the
    stand-in for a moment, as `os.umask` is process-wide)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"Umask:"):
                return int(line.split()[1], 8)
    with _umask_lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def remove_stale_temporaries(target: str | os.PathLike) -> list[str]:
    """Remove the temporaries that writes of `target` left behind when their process
    was killed (files or folders named `.<target>.nvfp4x-<host>-<pid>-<random>.<kind>`),
    then their lock files: those whose lock file no process holds (`writer_gone`), and
    any untouched for `STALE_AFTER_S`. A temporary of a live writer is never removed.

    **Returns:** the paths removed (errors, such as a read-only folder, are ignored).
    """
    target = os.path.abspath(os.fspath(target))
    directory, base = os.path.split(target)
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in sorted(names, key=lambda n: n.endswith((".lock", ".lock~"))):  # locks last
        m = _TEMPORARY.fullmatch(name)
        if m is None or m["target"] != base:
            continue
        path = os.path.join(directory, name)
        if not writer_gone(path):
            continue
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except OSError:
            continue
        removed.append(path)
    return removed


# --- one file ---


def fsync_directory(directory: str) -> None:
    """Make a rename in `directory` durable (POSIX; Windows cannot open a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Write the file at `path` all at once or not at all.

    Yields a binary file opened on a temporary file in `path`'s directory. When the
    `with` block ends, that file is flushed and fsynced, then renamed over `path`
    (`os.replace`, atomic on POSIX and Windows) and the directory is fsynced where the
    OS allows, so a reader sees either the old file or the complete new one, also after
    a crash or a kill. If the block raises, the temporary file is removed and `path` is
    left as it was; temporaries of writes of `path` killed before they finished are
    removed first. The new file keeps the permissions of the file it replaces (a new
    one gets those of `open`).

    **Arguments:**

    - `path`: the file to write; its directory must exist.

    **Returns:** a context manager yielding the open binary file.

    ```python
    with atomic_write("model.safetensors") as f:
        f.write(data)
    ```
    """
    path = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(path)
    remove_stale_temporaries(path)
    try:
        mode = os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o666 & ~umask()
    with _temporary(path, "tmp") as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, mode)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    fsync_directory(directory)


# --- one folder ---


def _exchange(a: str, b: str) -> bool:
    """Swap the paths `a` and `b` in one atomic step; False where the OS or the file
    system cannot (then nothing was changed)."""
    if sys.platform == "linux":
        name, flag, args = "renameat2", 2, lambda x, y: (-100, x, -100, y)  # AT_FDCWD
    elif sys.platform == "darwin":
        name, flag, args = "renamex_np", 2, lambda x, y: (x, y)  # RENAME_SWAP
    else:
        return False
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (AttributeError, OSError):
        return False
    if function(*args(os.fsencode(a), os.fsencode(b)), flag) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), a, None, b)


def _copy_entry(source: str, destination: str) -> None:
    """Hard-link (or copy, where links are refused) a file, a symlink or a folder."""

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst, follow_symlinks=False)
        except OSError:
            shutil.copy2(src, dst, follow_symlinks=False)

    if os.path.islink(source):
        os.symlink(os.readlink(source), destination)
    elif os.path.isdir(source):
        shutil.copytree(source, destination, symlinks=True, copy_function=link)
    else:
        link(source, destination)


@contextlib.contextmanager
def atomic_folder(directory: str | os.PathLike, replaced: Callable[[str], bool]) -> Iterator[str]:
    """Replace the folder `directory` as a whole or not at all.

    Yields a new folder next to `directory` that holds every entry of `directory`
    (hard links, or copies) except those `replaced(name)` selects. When the block ends,
    that folder is fsynced and swapped with `directory` in one atomic rename, and the
    old contents are removed: a reader of `directory` sees the old folder or the new
    one, never a mix, also after a kill at any moment (the next call removes what a
    killed one left). If the block raises, `directory` is left as it was.

    On a file system without an atomic swap, two renames (the old folder aside, the new
    one in its place): a reader may then find no folder for a moment, never a mix, and
    a kill between the two is undone by the next call. Where no rename can do it
    (Windows, a folder that is a mount point or whose parent is not writable), the files
    are written into `directory` itself, one atomic file at a time, with a `UserWarning`
    saying why.

    **Arguments:**

    - `directory`: the folder (created if needed; a symlink is followed, and its target
      replaced).
    - `replaced`: which of the existing entries' names the block writes anew (they are
      not carried over).

    **Returns:** a context manager yielding the folder to write into.
    """
    target = os.path.realpath(os.fspath(directory))
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    recover_folder(target)
    remove_stale_temporaries(target)
    exists = os.path.isdir(target)
    if exists and os.path.ismount(target):
        why = "it is a mount point"
    elif not os.access(parent, os.W_OK):
        why = f"its parent `{parent}` is not writable"
    elif sys.platform not in ("linux", "darwin"):
        why = f"{sys.platform} cannot swap two folders in one rename"
    else:
        why = None
    if why is not None:
        warnings.warn(
            f"`{target}` is written in place, one file at a time, because {why}: a reader "
            "may see a mix of old and new files until the export ends.",
            UserWarning,
            stacklevel=3,
        )
        os.makedirs(target, exist_ok=True)
        yield target
        return
    mode = (os.stat(target).st_mode & 0o7777) if exists else (0o777 & ~umask())
    with _temporary(target, "new") as staging, _temporary(target, "old") as old:
        os.mkdir(staging, 0o700)
        try:
            if exists:
                for name in os.listdir(target):
                    if not replaced(name):
                        _copy_entry(os.path.join(target, name), os.path.join(staging, name))
            yield staging
            os.chmod(staging, mode)
            fsync_directory(staging)
            leftover = None
            if not exists:
                os.rename(staging, target)  # fails if another writer made it meanwhile
            elif _exchange(staging, target):
                leftover = staging  # now holding the old contents
            else:  # two renames: a reader may find no folder in between, never a mix
                os.rename(target, old)
                os.rename(staging, target)
                leftover = old
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        fsync_directory(parent)
        if leftover is not None:
            shutil.rmtree(leftover, ignore_errors=True)


def recover_folder(directory: str | os.PathLike) -> None:
    """Put back the previous folder where a kill fell between the two renames of a swap
    without `renameat2` (the folder gone, its old contents under a temporary name).
    `atomic_folder` does it first; call it before reading the folder to write anew."""
    target = os.path.realpath(os.fspath(directory))
    if os.path.lexists(target):
        return
    directory, base = os.path.split(target)
    try:
        names = os.listdir(directory)
    except OSError:
        return
    olds = []
    for name in names:
        m = _TEMPORARY.fullmatch(name)
        if m is None or m["target"] != base or m["kind"] != "old":
            continue
        path = os.path.join(directory, name)
        if os.path.isdir(path) and writer_gone(path):
            olds.append((os.stat(path).st_mtime, path))
    if olds:
        with contextlib.suppress(OSError):
            os.rename(max(olds)[1], target)


def write_folder(directory: str | os.PathLike, files: Mapping[str, bytes]) -> None:
    """Write `files` (`{name: bytes}`) into the folder `directory` as a whole or not at
    all (`atomic_folder`): the folder's other entries are kept, and a reader sees it
    before or after, never in between.

    **Arguments:**

    - `directory`: the folder (created if needed).
    - `files`: the files to write, by name; existing files of these names are replaced.
    """
    with atomic_folder(directory, replaced=files.__contains__) as folder:
        for name, data in files.items():
            with atomic_write(os.path.join(folder, name)) as f:
                f.write(data)


# --- reading what may not be trusted ---


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "folder"),
        (stat.S_ISFIFO, "FIFO (named pipe)"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return name
    return "special file"


def read_regular(
    path: str | os.PathLike,
    *,
    dir_fd: int | None = None,
    max_bytes: int | None = None,
    display: str | None = None,
) -> bytes:
    """The bytes of the regular file at `path` (symlinks followed).

    Opened without blocking, so that a FIFO is refused instead of waiting for a writer;
    anything that is not a regular file (a FIFO, a device such as `/dev/zero`, a folder)
    raises `ValueError` naming the file, as does a file larger than `max_bytes`.

    **Arguments:**

    - `path`: the file (relative to `dir_fd` when given).
    - `dir_fd`: an open folder that `path` is relative to.
    - `max_bytes`: the largest plausible size.
    - `display`: how errors name the file (default: `path`).
    """
    shown = display or os.fspath(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags, dir_fd=dir_fd) if dir_fd is not None else os.open(path, flags)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise ValueError(
            f"`{shown}` is a {_kind(info.st_mode)}, not a regular file: nvfp4x reads "
            "checkpoints from regular files only. Point it at the file itself."
        )
    opened = _kernel_file(fd)
    if opened is not None:
        os.close(fd)
        raise ValueError(
            f"`{shown}` is the kernel's `{opened}` (a file of /proc or /sys, not on disk), "
            "not a checkpoint file. Point it at the checkpoint itself."
        )
    with open(fd, "rb") as f:
        if max_bytes is not None and info.st_size > max_bytes:
            raise ValueError(
                f"`{shown}` has {info.st_size:,} bytes, more than the {max_bytes:,} a file of "
                "this kind can plausibly hold: it is not a checkpoint file, or corrupted."
            )
        try:
            return f.read()
        except OSError as e:  # named: a bare `[Errno 5]` says nothing of which file
            raise OSError(e.errno, f"`{shown}` cannot be read ({e.strerror})") from e


def _kernel_file(fd: int) -> str | None:
    """The path of the open file `fd` where it is a kernel file of /proc or /sys (regular
    to `stat`, but not data: `/proc/self/mem` fails every read), else None."""
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # no /proc (macOS): nothing to tell
        return None
    return path if path.startswith(("/proc/", "/sys/")) else None


def irregular_file(directory: str | os.PathLike, *, max_bytes: int, data: str = "d") -> str | None:
    """What makes the folder `directory` unsafe to hand to a reader that opens its files
    blindly (Orbax), or None: a file (symlinks followed) that is not a regular file or a
    folder (a FIFO would block the reader forever, `/dev/zero` never ends), or a regular
    file larger than `max_bytes` outside the array-data folders named `data` (whose files
    are read by the ranges their manifest records). Reads nothing but metadata.
    """
    root = os.fspath(directory)
    if not os.path.isdir(root) or os.path.islink(root):  # one file (or a link to one)
        here, name = os.path.split(root)
        return _irregular(here, name, max_bytes, in_data=False)
    for here, folders, files in os.walk(root, followlinks=False):
        in_data = data in os.path.relpath(here, root).split(os.sep)
        for name in folders + files:
            problem = _irregular(here, name, max_bytes, in_data=in_data)
            if problem is not None:
                return problem
    return None


def _irregular(here: str, name: str, max_bytes: int, *, in_data: bool) -> str | None:
    """`irregular_file` for the entry `name` of the folder `here`."""
    path = os.path.join(here, name)
    try:
        info = os.stat(path)  # (follows links: what a reader opens)
    except OSError as e:
        return f"`{path}` cannot be read ({e.strerror or e})"
    if stat.S_ISDIR(info.st_mode):
        return f"`{path}` is a link to a folder, not a folder" if os.path.islink(path) else None
    if not stat.S_ISREG(info.st_mode):
        return f"`{path}` is a {_kind(info.st_mode)}, not a regular file"
    if not in_data and info.st_size > max_bytes:
        return (
            f"`{path}` has {info.st_size:,} bytes, more than the {max_bytes:,} a metadata "
            "file can plausibly hold"
        )
    return None


def shown(value: Any) -> str:
    """A value read from a JSON file, for a message: a string in quotes marked as one (a
    `"16"` is not the number 16), anything else as JSON writes it."""
    if isinstance(value, str):
        return f"{json.dumps(value)} (a string)"
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _unsigned_int(text: str) -> int:
    if text.startswith("-"):  # `-0` included: not an unsigned integer
        raise ValueError(f"the integer `{text}` is negative (written as a signed number)")
    return int(text)


def _no_constant(text: str) -> Any:
    raise ValueError(f"`{text}` is not JSON (NaN and Infinity are Python's extension)")


def _lone_surrogate(value: Any) -> str | None:
    """A string of `value` (keys included) holding a lone surrogate, or None."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return v
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} appears twice")
        out[key] = value
    return out


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest


def load_json(data: bytes, what: str, *, unsigned: bool = False) -> Any:
    """Parse `data` as JSON, refusing (`ValueError` naming `what`, as "`path`" or
    "`path`: the header") invalid text, text that is not UTF-8 (UTF-16, or a UTF-8 byte
    order mark: JSON is UTF-8 without one, and Rust's serde, which the safetensors
    library and serving stacks read with, refuses them; Python's `json` would guess), a
    string with a lone surrogate escape (`"\\ud800"`: no character), a key given
    twice, more than `MAX_JSON_BYTES` or nesting deeper than `MAX_JSON_DEPTH`. With
    `unsigned` (a safetensors header: its numbers are unsigned), an integer written `-0`
    (serde reads it as the float -0.0) and `NaN` / `Infinity` are refused too."""
    if len(data) > MAX_JSON_BYTES:
        raise ValueError(f"{what} has {len(data):,} bytes of JSON, more than {MAX_JSON_BYTES:,}.")
    if bytes(data[:3]) == b"\xef\xbb\xbf":
        raise ValueError(f"{what} starts with a UTF-8 byte order mark, which JSON does not allow.")
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} is not UTF-8 text (JSON must be; UTF-16?): {e}.") from None
    if "\0" in text:
        raise ValueError(f"{what} is not UTF-8 text (JSON must be): it holds NUL bytes (UTF-16?).")
    try:
        value = json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_int=_unsigned_int if unsigned else int,
            parse_constant=_no_constant if unsigned else None,
        )
    except RecursionError:
        value = None
        deep = True
    except ValueError as e:
        raise ValueError(f"{what} is not valid JSON (corrupted or truncated): {e}.") from None
    else:
        deep = _depth(value) > MAX_JSON_DEPTH
    if deep:
        raise ValueError(
            f"{what} nests arrays or objects deeper than {MAX_JSON_DEPTH} levels (corrupted)."
        )
    bad = _lone_surrogate(value)
    if bad is not None:
        raise ValueError(
            f"{what} has a string with a lone surrogate escape ({ascii(bad)[:60]}), which is "
            "no character (corrupted or crafted)."
        )
    return value
