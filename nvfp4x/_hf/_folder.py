"""A checkpoint folder read through one open handle of it, and the shard names an index
may give (files inside the folder only)."""

import os
from typing import Any

from .._files import MAX_JSON_BYTES, load_json, read_regular

#: The file names of a checkpoint folder.
HF_QUANT_CONFIG = "hf_quant_config.json"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


class Folder:
    """A checkpoint folder, its files read through one open handle of it (where the OS
    allows): while `export_hf` swaps a new export in, a reader keeps reading the folder
    it opened, and `changed()` says that it should read again."""

    def __init__(self, directory: str):
        self.directory = directory
        self.fd: int | None = None
        if os.open in os.supports_dir_fd and hasattr(os, "O_DIRECTORY"):
            self.fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def exists(self, name: str) -> bool:
        try:
            if self.fd is None:
                os.stat(self.path(name))
            else:
                os.stat(name, dir_fd=self.fd)
        except FileNotFoundError:
            return False
        return True

    def read(self, name: str, max_bytes: int | None = None) -> bytes:
        if self.fd is None:
            return read_regular(self.path(name), max_bytes=max_bytes)
        return read_regular(name, dir_fd=self.fd, max_bytes=max_bytes, display=self.path(name))

    def json(self, name: str) -> Any:
        return load_json(self.read(name, MAX_JSON_BYTES), f"`{self.path(name)}`")

    def changed(self) -> bool:
        """Whether the folder at the path is no longer the one opened (swapped)."""
        if self.fd is None:
            return False
        try:
            now = os.stat(self.directory)
        except FileNotFoundError:
            return True
        then = os.fstat(self.fd)
        return (now.st_dev, now.st_ino) != (then.st_dev, then.st_ino)


def shard_name(name: Any, index: str) -> str:
    """A `weight_map` file name, refused if it is not a relative path inside the folder
    (an absolute path, `..`, a drive): an index must not make nvfp4x read other files."""
    if not isinstance(name, str):
        raise ValueError(f"`{index}`: the `weight_map` entry {name!r} is not a file name.")
    parts = name.replace("\\", "/").split("/")
    if (
        not name
        or "\0" in name
        or os.path.isabs(name)
        or name.startswith(("/", "\\"))
        or os.path.splitdrive(name)[0]
        or any(p in ("", "..") for p in parts)
    ):
        raise ValueError(
            f"`{index}`: the `weight_map` names the file `{name}`, which is not inside the "
            "checkpoint folder: refused (an index may only name files in its own folder)."
        )
    return name
