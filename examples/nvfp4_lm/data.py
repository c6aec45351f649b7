"""The data: a byte corpus (by default the Python standard library's own sources) and
the training windows drawn from it."""

import dataclasses
import os
import sys
import sysconfig

import numpy as np
from jaxtyping import Int, UInt8

from .config import Config


@dataclasses.dataclass(frozen=True)
class Data:
    """A byte corpus: `train` and `val` token arrays (uint8) and where they came from."""

    train: UInt8[np.ndarray, " n_train"]
    val: UInt8[np.ndarray, " n_val"]
    source: str


def stdlib_files() -> list[str]:
    """The standard library's `.py` files (site-packages and caches excluded), sorted by
    their path relative to the stdlib folder."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "__pycache__"}
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        rel = os.path.relpath(dirpath, root)
        found += [os.path.normpath(os.path.join(rel, f)) for f in filenames if f.endswith(".py")]
    return [os.path.join(root, f) for f in sorted(found)]


def load_data(cfg: Config, path: str | None = None, *, val_fraction: float = 0.1) -> Data:
    """`cfg.data_bytes` bytes of text, split into train and validation.

    **Arguments:**

    - `cfg`: the configuration (`data_bytes`, and `seq` for a minimum size).
    - `path`: a text file; by default the Python standard library's sources (sorted file
      list shuffled with a fixed seed, every 10th file held out for validation).
    - `val_fraction`: the share of the budget held out.

    **Returns:** a `Data`.
    """
    val_budget = int(cfg.data_bytes * val_fraction)
    train_budget = cfg.data_bytes - val_budget
    if path is not None:
        with open(path, "rb") as f:
            raw = np.frombuffer(f.read(cfg.data_bytes), dtype=np.uint8)
        cut = len(raw) - max(int(len(raw) * val_fraction), cfg.seq + 2)
        data = Data(raw[:cut], raw[cut:], f"{path} ({len(raw):,} bytes)")
    else:
        files = stdlib_files()
        order = np.random.default_rng(0).permutation(len(files))  # fixed: same data for any seed
        train, val, n_train, n_val = [], [], 0, 0
        for i, j in enumerate(order):
            if n_train >= train_budget and n_val >= val_budget:
                break
            to_val = i % 10 == 9
            if (n_val >= val_budget) if to_val else (n_train >= train_budget):
                continue
            with open(files[j], "rb") as f:
                text = f.read() + b"\n"
            if to_val:
                val.append(text)
                n_val += len(text)
            else:
                train.append(text)
                n_train += len(text)
        data = Data(
            np.frombuffer(b"".join(train)[:train_budget], dtype=np.uint8),
            np.frombuffer(b"".join(val)[:val_budget], dtype=np.uint8),
            f"Python {sys.version.split()[0]} standard library sources",
        )
    for name in ("train", "val"):
        if len(getattr(data, name)) < cfg.seq + 2:
            raise ValueError(
                f"The {name} split has {len(getattr(data, name))} bytes, fewer than one "
                f"sequence (`seq={cfg.seq}`); give more data or a larger `data_bytes`."
            )
    return data


def batch_starts(cfg: Config, n: int) -> Int[np.ndarray, "steps batch"]:
    """Random window offsets for every training step, fixed by `cfg.seed`."""
    return np.random.default_rng(cfg.seed).integers(0, n - cfg.seq - 1, size=(cfg.steps, cfg.batch))


def windows(
    tokens: UInt8[np.ndarray, " n"], starts: Int[np.ndarray, " batch"], seq: int
) -> tuple[Int[np.ndarray, "batch seq"], Int[np.ndarray, "batch seq"]]:
    """Inputs and next-byte targets for windows of length `seq` starting at `starts`."""
    chunk = tokens[starts[:, None] + np.arange(seq + 1)].astype(np.int32)
    return chunk[:, :-1], chunk[:, 1:]
