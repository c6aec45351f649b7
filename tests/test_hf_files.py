"""Hugging Face checkpoints as files: nothing lost, nothing let in.

An export killed at any moment leaves the previous export or the new one, whole (a
reader never sees a mix); `import_hf` refuses what it must not read: paths leaving the
folder, safetensors headers whose tensors overlap or leave gaps or trailing bytes,
FIFOs and devices, implausible JSON, and files that lost nvfp4x's checksums. The model
is a small MLP exported twice, weights-only (W4A16) and W4A4, so that a mix of the two
exports would show in the configs. (The format itself: `tests/test_hf.py`.)
"""

import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time

import equinox as eqx
import jax
import numpy as np
import pytest
from helpers import assert_same_bits, dead_pid

import nvfp4x
from nvfp4x import _files
from nvfp4x._hf import _safetensors

NAMES = {"layers[0]": "model.layers.0.mlp.up_proj", "layers[1]": "model.layers.0.mlp.down_proj"}
WRITTEN = ("model.safetensors", "hf_quant_config.json", "config.json")
RECIPES = {"w4a16": "nvfp4_weight_only", "w4a4": "nvfp4_inference"}
AMAX = {"w4a16": None, "w4a4": {"layers[0]": 2.0, "layers[1]": 3.5}}
KILL_SECONDS = float(os.environ.get("NVFP4X_KILL_SECONDS", "2"))  # longer: benchmarks/kill_loops.py
TIMEOUT = 60


def mlp(seed: int = 3) -> eqx.nn.MLP:
    return eqx.nn.MLP(32, 32, 32, 1, key=jax.random.key(seed))


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict:
    """`{kind: (directory, like, frozen)}` for the W4A16 and the W4A4 export."""
    out = {}
    for kind, recipe in RECIPES.items():
        frozen = nvfp4x.freeze(nvfp4x.quantize(mlp(), recipe))
        like = eqx.filter_eval_shape(lambda r=recipe: nvfp4x.freeze(nvfp4x.quantize(mlp(), r)))
        directory = tmp_path_factory.mktemp(kind)
        config = {"architectures": ["TinyMLP"], "hidden_size": 32}
        nvfp4x.export_hf(frozen, directory, names=NAMES, input_amax=AMAX[kind], hf_config=config)
        out[kind] = (directory, like, frozen)
    return out


def read_either(directory, exports) -> str:
    """Import the checkpoint in `directory`, which must be one of `exports` exactly;
    returns which, or `"refused"` where `import_hf` found the folder replaced again and
    again while it read it (a writer swapping exports in without pause) and said so.
    (Each `import_hf` reads one export whole; while a writer swaps exports in, the try
    with one `like` may see the other export, and the next try the first again: a few
    rounds; on a loaded machine the writer's swaps can fall in step with the tries for
    many rounds in a row, each try then refused cleanly as the other export's.)"""
    for _ in range(50):
        for kind, (_, like, frozen) in exports.items():
            try:
                back = nvfp4x.import_hf(directory, like, names=NAMES)
            except ValueError as e:
                if "quantisation mismatch" in str(e):
                    continue
                if "while it was being read" in str(e):
                    return "refused"
                raise
            assert_same_bits(back, frozen, f"read as the {kind} export")
            return kind
    raise AssertionError(f"`{directory}` holds neither export")


# --- export_hf killed at random moments ---

# The child loads nvfp4x/_files.py alone (no jax: it starts in a fraction of a second)
# and writes the two exports' files, alternately, forever, with `write_folder`: the
# call `export_hf` ends with, after it has computed the files' bytes.
WRITER = r"""
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("nvfp4x_files", sys.argv[1])
files = importlib.util.module_from_spec(spec)
spec.loader.exec_module(files)
target, sources = sys.argv[2], sys.argv[3:]
names = ["model.safetensors", "hf_quant_config.json", "config.json"]
exports = [{n: open(os.path.join(s, n), "rb").read() for n in names} for s in sources]
i = 0
while True:
    files.write_folder(target, exports[i % 2])
    print(i, flush=True)
    i += 1
"""


def test_export_killed_at_random_moments_leaves_one_whole_export(exports, tmp_path):
    """A writer of exports is killed with SIGKILL at random moments, again and again (a
    few seconds here): after every kill the folder holds exactly the previous or the new
    export (configs and weights of one export; the folder's own files kept), and while
    it runs, `import_hf` reads one whole export every time. What killed writers left is
    removed by the next export."""
    target = tmp_path / "served"
    target.mkdir()
    (target / "tokenizer.json").write_text('{"kept": true}')
    _, _, first = exports["w4a16"]
    nvfp4x.export_hf(first, target, names=NAMES, hf_config={"architectures": ["TinyMLP"]})
    contents = [{n: (d / n).read_bytes() for n in WRITTEN} for d, _, _ in exports.values()]
    rng = random.Random()
    sources = [str(d) for d, _, _ in exports.values()]
    start, kills, reads = time.monotonic(), 0, {"w4a16": 0, "w4a4": 0, "refused": 0}
    while time.monotonic() - start < KILL_SECONDS or kills < 3:
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, _files.__file__, str(target), *sources],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            timer = threading.Timer(TIMEOUT, proc.kill)
            timer.start()
            first_line = proc.stdout.readline()
            timer.cancel()
            assert first_line.strip() == "0", proc.stderr.read() if proc.poll() else first_line
            until = time.monotonic() + rng.uniform(0.0, 0.1)
            while time.monotonic() < until:  # a reader, while the writer swaps exports in
                reads[read_either(target, exports)] += 1
        finally:
            proc.kill()
            proc.communicate(timeout=TIMEOUT)
        kills += 1
        assert sorted(os.listdir(target)) == sorted([*WRITTEN, "tokenizer.json"]), kills
        got = {n: (target / n).read_bytes() for n in WRITTEN}
        assert got in contents, f"kill {kills}: a mix of two exports"
        assert (target / "tokenizer.json").read_text() == '{"kept": true}'
    _, _, frozen = exports["w4a4"]
    nvfp4x.export_hf(frozen, target, names=NAMES, input_amax=AMAX["w4a4"])
    assert os.listdir(tmp_path) == ["served"], "leftovers of killed exports"
    assert read_either(target, exports) == "w4a4"
    assert reads["w4a16"] + reads["w4a4"] > 0
    print(f"export writer killed {kills} times; import_hf read {reads} meanwhile")


def test_export_keeps_the_folder_and_its_other_files(exports, tmp_path):
    """The swapped-in folder keeps the old one's permissions, other files and subfolders;
    a folder reached through a symlink is replaced behind the symlink."""
    _, _, frozen = exports["w4a16"]
    real = tmp_path / "real"
    (real / "sub").mkdir(parents=True)
    (real / "sub" / "notes.txt").write_text("notes")
    (real / "tokenizer.json").write_text("{}")
    real.chmod(0o750)
    link = tmp_path / "link"
    link.symlink_to(real)
    nvfp4x.export_hf(frozen, link, names=NAMES)
    assert link.is_symlink() and real.is_dir()
    assert real.stat().st_mode & 0o777 == 0o750
    assert (real / "sub" / "notes.txt").read_text() == "notes"
    assert sorted(os.listdir(real)) == [
        "hf_quant_config.json",
        "model.safetensors",
        "sub",
        "tokenizer.json",
    ]
    assert read_either(link, exports) == "w4a16"
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]


def test_without_an_atomic_swap_a_kill_between_two_renames_is_undone(
    exports, tmp_path, monkeypatch
):
    """On a file system without `renameat2`'s exchange the swap is two renames; a kill
    between them leaves the previous folder aside, which the next export puts back
    (keeping its other files) before replacing its export."""
    target = tmp_path / "served"
    shutil.copytree(exports["w4a16"][0], target)
    (target / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(_files, "_exchange", lambda a, b: False)
    _, _, frozen = exports["w4a4"]
    nvfp4x.export_hf(frozen, target, names=NAMES, input_amax=AMAX["w4a4"])
    assert read_either(target, exports) == "w4a4"
    assert os.listdir(tmp_path) == ["served"]
    stem = f".served.nvfp4x-{_files.HOST}-{dead_pid()}-0123abcd"
    target.rename(tmp_path / f"{stem}.old")
    (tmp_path / f"{stem}.lock").write_text("")  # its writer's lock, released by the kill
    _, _, frozen = exports["w4a16"]
    nvfp4x.export_hf(frozen, target, names=NAMES)
    assert read_either(target, exports) == "w4a16"
    assert os.listdir(tmp_path) == ["served"]
    assert (target / "tokenizer.json").read_text() == "{}"


def test_a_failed_export_leaves_the_previous_one(exports, tmp_path, monkeypatch):
    directory, _, _ = exports["w4a16"]
    target = tmp_path / "served"
    shutil.copytree(directory, target)
    before = {n: (target / n).read_bytes() for n in WRITTEN}
    _, _, frozen = exports["w4a4"]

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="injected"):
        nvfp4x.export_hf(frozen, target, names=NAMES, input_amax=AMAX["w4a4"])
    monkeypatch.undo()
    assert {n: (target / n).read_bytes() for n in WRITTEN} == before
    assert os.listdir(tmp_path) == ["served"]


# --- files import_hf must refuse ---


@pytest.fixture
def copy(exports, tmp_path):
    """A fresh copy of the W4A16 export to damage, and how to read it."""
    directory, like, _ = exports["w4a16"]
    target = tmp_path / "ckpt"
    shutil.copytree(directory, target)
    return target, lambda: nvfp4x.import_hf(target, like, names=NAMES)


def split(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def join(header: dict, payload: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + payload


def as_other_writer(target) -> tuple[dict, bytes]:
    """Make the export look like Model Optimizer's (no checksums, another producer), so
    that only the header's own checks stand between a crafted header and the reader."""
    header, payload = split((target / "model.safetensors").read_bytes())
    header["__metadata__"] = {"format": "pt"}
    config = json.loads((target / "hf_quant_config.json").read_text())
    config["producer"] = {"name": "modelopt", "version": "0.37.0"}
    (target / "hf_quant_config.json").write_text(json.dumps(config))
    (target / "model.safetensors").write_bytes(join(header, payload))
    return header, payload


@pytest.mark.parametrize(
    "where", ["parent", "absolute", "nested-parent"], ids=["parent", "absolute", "nested-parent"]
)
def test_index_naming_a_file_outside_the_folder_is_refused(copy, tmp_path, where):
    target, read = copy
    outside = tmp_path / "other"
    outside.mkdir()
    shutil.copy(target / "model.safetensors", outside / "model.safetensors")
    name = {
        "parent": "../other/model.safetensors",
        "absolute": str(outside / "model.safetensors"),
        "nested-parent": "shards/../../other/model.safetensors",
    }[where]
    header, _ = split((target / "model.safetensors").read_bytes())
    header.pop("__metadata__")
    index = {"metadata": {}, "weight_map": dict.fromkeys(header, name)}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    (target / "model.safetensors").unlink()
    with pytest.raises(
        ValueError, match=rf"names the file `{re.escape(name)}`, which is not inside"
    ):
        read()


def test_index_naming_shards_in_a_subfolder_or_symlinks_is_read(copy, exports):
    """Shards in a subfolder, and a shard that is a symlink out of the folder (as Hugging
    Face's cache links `snapshots/<rev>/x` to `blobs/<sha>`) are read."""
    target, read = copy
    blobs = target.parent / "blobs"
    blobs.mkdir()
    (target / "model.safetensors").rename(blobs / "abc123")
    (target / "shards").mkdir()
    (target / "shards" / "model.safetensors").symlink_to(blobs / "abc123")
    header, _ = split((blobs / "abc123").read_bytes())
    header.pop("__metadata__")
    index = {"metadata": {}, "weight_map": dict.fromkeys(header, "shards/model.safetensors")}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_same_bits(read(), exports["w4a16"][2])


def craft(header: dict, payload: bytes, how: str) -> bytes:
    names = sorted(
        (n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"]
    )
    codes = next(n for n in names if n.endswith("up_proj.weight"))
    scale = next(n for n in names if n.endswith("up_proj.weight_scale"))
    last = names[-1]
    if how == "overlap":  # the scale tensor aliasing the codes' bytes
        begin = header[codes]["data_offsets"][0]
        size = np.prod(header[scale]["shape"], dtype=int)
        header[scale]["data_offsets"] = [begin, begin + int(size)]
    elif how == "gap":  # the last tensor moved one byte on, the file one byte longer
        begin, end = header[last]["data_offsets"]
        header[last]["data_offsets"] = [begin + 1, end + 1]
        payload = payload[:begin] + b"\0" + payload[begin:]
    elif how == "trailing":
        payload = payload + b"\0" * 8
    elif how == "size":  # a shape that does not match the bytes
        header[scale]["shape"] = [header[scale]["shape"][0] - 1, header[scale]["shape"][1]]
    elif how == "extra-field":
        header[scale]["offsets_too"] = [0, 0]
    return join(header, payload)


@pytest.mark.parametrize(
    "how, message",
    [
        ("overlap", r"up_proj\.weight` at bytes \d+\.\.\d+ overlaps tensor `.*weight_scale`"),
        ("gap", r"leaves a gap of 1 bytes"),
        ("trailing", r"8 bytes after the last tensor belong to none"),
        ("size", r"spans \d+ bytes, not the size of its shape"),
        ("extra-field", r"header entry of tensor .* is malformed"),
    ],
    ids=["overlap", "gap", "trailing", "size", "extra-field"],
)
def test_safetensors_header_is_checked_as_strictly_as_safetensors_does(copy, how, message):
    target, read = copy
    header, payload = as_other_writer(target)
    read()  # without checksums, the untouched file reads
    (target / "model.safetensors").write_bytes(craft(header, payload, how))
    with pytest.raises(ValueError, match=rf"model\.safetensors`.*{message}"):
        read()


_ONE = '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
_EMPTY = '{"a":{"dtype":"F32","shape":[0,%d],"data_offsets":[0,0]}}'
HEADER_TEXT = {
    "utf-8 BOM": (b"\xef\xbb\xbf" + _ONE.encode(), b"\0" * 4, r"byte order mark"),
    "utf-16": (_ONE.encode("utf-16-le"), b"\0" * 4, r"not UTF-8 text"),
    "offset -0": (_ONE.replace("[0,4]", "[-0,4]").encode(), b"\0" * 4, r"integer `-0`"),
    "lone surrogate name": (
        _ONE.replace('"a"', '"\\ud800"').encode(),
        b"\0" * 4,
        r"lone surrogate escape",
    ),
    "dimension 2^64": ((_EMPTY % 2**64).encode(), b"", r"header entry of tensor `a` is malformed"),
    "dimension 2^64 - 1": ((_EMPTY % (2**64 - 1)).encode(), b"", r"does not fit in 64 bits"),
    "size beyond 64 bits": (
        b'{"a":{"dtype":"F32","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}}',
        b"",
        r"does not fit in 64 bits",
    ),
}


@pytest.mark.parametrize("case", list(HEADER_TEXT.values()), ids=list(HEADER_TEXT))
def test_safetensors_header_text_is_read_as_strictly_as_safetensors_does(case):
    """Headers the safetensors library refuses (its serde JSON: UTF-8 without a byte
    order mark, no lone surrogate, unsigned 64-bit integers) loaded here (Python's
    `json` guesses UTF-16, reads `-0` as 0 and `"\\ud800"` as a string)."""
    import safetensors.numpy

    def file(text: bytes, payload: bytes) -> bytes:
        return len(text).to_bytes(8, "little") + text + payload

    text, payload, message = case
    ok = file(_ONE.encode(), b"\0" * 4)
    safetensors.numpy.load(ok)
    _safetensors.read("ok.safetensors", ok)
    crafted = file(text, payload)
    with pytest.raises(Exception):  # noqa: B017, PT011 - the library's own error types
        safetensors.numpy.load(crafted)
    with pytest.raises(ValueError, match=rf"`x\.safetensors`.*{message}"):
        _safetensors.read("x.safetensors", crafted)


def in_thread(function, seconds: float = 20.0):
    """Run `function` in a daemon thread: `(finished, result or exception)`, so that a
    read that would block forever fails the test instead of hanging it."""
    box = {}

    def run():
        try:
            box["result"] = function()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["result"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive(), box.get("result")


@pytest.mark.parametrize(
    "file, kind",
    [
        ("model.safetensors", "fifo"),
        ("model.safetensors", "dev-zero"),
        ("hf_quant_config.json", "fifo"),
        ("config.json", "dev-zero"),
        ("model.safetensors", "deep-json"),
        ("hf_quant_config.json", "deep-json"),
        ("model.safetensors", "huge-header"),
    ],
    ids=[
        "weights-fifo",
        "weights-dev-zero",
        "config-fifo",
        "config-json-dev-zero",
        "weights-deep-json",
        "config-deep-json",
        "weights-huge-header",
    ],
)
def test_what_is_not_a_plausible_file_is_refused_at_once(copy, file, kind):
    target, read = copy
    path = target / file
    if kind in ("fifo", "dev-zero"):
        path.unlink()
        os.mkfifo(path) if kind == "fifo" else path.symlink_to("/dev/zero")
        message = {"fifo": "is a FIFO", "dev-zero": "is a character device"}[kind]
    elif kind == "deep-json":
        deep = b"[" * 50_000 + b"]" * 50_000
        data = len(deep).to_bytes(8, "little") + deep if file.endswith("tensors") else deep
        path.write_bytes(data)
        message = "nests arrays or objects deeper than"
    else:
        path.write_bytes((10**9).to_bytes(8, "little") + b"{}")
        message = "more than the 100,000,000 allowed"
    finished, result = in_thread(read)
    assert finished, f"import_hf blocked on a {kind}"
    assert isinstance(result, ValueError), result
    assert re.search(rf"`{re.escape(str(path))}`.*{message}", str(result)), str(result)


# --- checksums that fail closed ---


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]


def test_a_flip_in_the_checksum_metadata_never_switches_verification_off(copy):
    """Every byte of the metadata keys that carry nvfp4x's checksums (and of the
    `__metadata__` key itself) flipped in turn, together with a byte of the weights:
    each is refused (before, one flip in a key made the file read as one without
    checksums, and the damaged weights loaded)."""
    target, read = copy
    path = target / "model.safetensors"
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    damaged = flip(data, 8 + n + 5)  # a byte of the first tensor's data
    keys = [b'"__metadata__"', b'"nvfp4x.sha256"', b'"nvfp4x.hf_quant_config.sha256"']
    positions = []
    for key in keys:
        at = data.index(key, 8, 8 + n)
        positions.extend(range(at + 1, at + len(key) - 1))
    assert len(positions) == sum(len(k) - 2 for k in keys)
    for at in positions:
        path.write_bytes(flip(damaged, at))
        with pytest.raises(ValueError, match=rf"`{re.escape(str(path))}`"):
            read()
    # The producer's name in the config flipped as well as the checksums' key: the
    # config's checksum entry, still there, refuses the file.
    path.write_bytes(flip(damaged, data.index(b'"nvfp4x.sha256"', 8, 8 + n) + 3))
    config = target / "hf_quant_config.json"
    text = config.read_bytes()
    config.write_bytes(flip(text, text.index(b'"nvfp4x"') + 1))
    with pytest.raises(ValueError, match=r"no complete nvfp4x checksums.*one of nvfp4x's two"):
        read()
    config.write_bytes(text)
    path.write_bytes(data)
    read()


def test_a_file_that_lost_its_checksums_is_refused_where_the_config_names_nvfp4x(copy):
    target, read = copy
    path = target / "model.safetensors"
    header, payload = split(path.read_bytes())
    digest = header["__metadata__"]["nvfp4x.hf_quant_config.sha256"]
    header["__metadata__"] = {"format": "pt"}
    path.write_bytes(join(header, payload))
    with pytest.raises(
        ValueError, match=r"no complete nvfp4x checksums.*names nvfp4x as its producer"
    ):
        read()
    header["__metadata__"] = {"format": "pt", "nvfp4x.hf_quant_config.sha256": digest}
    path.write_bytes(join(header, payload))
    with pytest.raises(ValueError, match=r"one of nvfp4x's two checksum entries"):
        read()


CONFIG_DISAGREEMENTS = {
    "no quantization_config": (
        lambda q: None, r"has no `quantization_config` object but .*hf_quant_config\.json"
    ),
    "a quantised layer ignored": (
        lambda q: {**q, "ignore": ["model.layers.0.mlp.up_proj"]},
        r"says `ignore: \['model\.layers\.0\.mlp\.up_proj'\]` but .* says `exclude_modules: "
        r"\[\]` \(they differ in \['model\.layers\.0\.mlp\.up_proj'\]\)",
    ),
    "group_size": (
        lambda q: {**q, "config_groups": {"group_0": {
            **q["config_groups"]["group_0"],
            "weights": {**q["config_groups"]["group_0"]["weights"], "group_size": 32},
        }}},
        r"says `config_groups\.group_0\.weights\.group_size: 32` but .* says .*: 16",
    ),
    "top-level group_size": (
        lambda q: {**q, "group_size": "16"}, r"says `group_size: \"16\" \(a string\)` but"
    ),
    "kv_cache_scheme": (
        lambda q: {**q, "kv_cache_scheme": {"num_bits": 8, "type": "float"}},
        r"says `kv_cache_scheme: \{'num_bits': 8, 'type': 'float'\}` but .*_scheme: None`",
    ),
    "quant_method": (
        lambda q: {**q, "quant_method": "compressed-tensors"},
        r"says `quant_method: compressed-tensors` but",
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    "case", list(CONFIG_DISAGREEMENTS.values()), ids=list(CONFIG_DISAGREEMENTS)
)
def test_config_json_must_say_what_hf_quant_config_says(copy, case):
    """`import_hf` reads `hf_quant_config.json`; a serving stack reads `config.json`.
    Before, only `quant_algo` was compared: these loaded silently."""
    change, message = case
    target, read = copy
    config = json.loads((target / "config.json").read_text())
    block = change(config["quantization_config"])
    if block is None:
        del config["quantization_config"]
    else:
        config["quantization_config"] = block
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json` " + message + r".*disagree"):
        read()


def test_configs_that_disagree_are_refused(copy):
    target, read = copy
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"]["quant_algo"] = "NVFP4"
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json` says `quant_algo: NVFP4` but .* disagree"):
        read()


@pytest.mark.parametrize("view", ["transposed", "strided", "scalar"])
def test_strided_arrays_are_written_in_order_and_their_checksums_hold(view):
    """The writer takes arrays as some backends hand them to numpy, strided views (a
    TPU's arrays came back so: the file held the buffer's order, its recorded checksum
    the logical order, and reading it back failed the checksum): each is written in its
    logical order and reads back equal, its checksum verified."""
    import ml_dtypes

    base = np.arange(96, dtype=np.uint8).reshape(8, 12)
    arrays = {
        "transposed": base.T.view(ml_dtypes.float8_e4m3fn),
        "strided": base[::2, 1::3].astype(np.float32),
        "scalar": np.array(3.5, np.float32),  # (0-d)
    }
    array = arrays[view]
    raw = _safetensors.serialise({"w": array, "b": base}, {})
    tensors, _ = _safetensors.read("file", raw)
    assert tuple(tensors["w"].shape) == array.shape  # (a 0-d array stays 0-d)
    got = np.frombuffer(tensors["w"].data, array.dtype).reshape(array.shape)
    assert_same_bits(got, array)
