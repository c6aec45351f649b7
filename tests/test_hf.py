"""Hugging Face (Model Optimizer "unified") checkpoints: `nvfp4x.export_hf` / `import_hf`.

The model is the main example's Llama-style transformer (`examples/nvfp4_lm`, the code of
`examples/train_lm.py`; its smoke size), named as Hugging Face's Llama by
`nvfp4x.hf_names.llama`. Round trips compare every leaf's bits; an independent decoder
(numpy and the standard library only: the safetensors header parsed by hand, E2M1 from a
literal table, E4M3 decoded by hand) checks the file against the frozen weights' own
decoding, bit for bit.
"""

import json
import pathlib
import re
import shutil
import struct
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import nvfp4_lm as lm
import pytest
import safetensors.numpy
from helpers import assert_same_bits

import nvfp4x
from nvfp4x._hf import _names
from nvfp4x._hf._codecs import ALGOS
from nvfp4x._hf._modelopt import config_json_block

CFG = lm.SMOKE  # d_model 64, 2 blocks, 2 heads, SwiGLU 192
NAMES = nvfp4x.hf_names.llama
FUSED = [r"(.*)\.attn\.w[qkv]", r"(.*)\.mlp\.w_(gate|up)"]
BLOCK0 = [f"blocks[0].{p}" for p in ("attn.wq", "attn.wk", "attn.wv", "attn.wo")] + [
    f"blocks[0].mlp.{p}" for p in ("w_gate", "w_up", "w_down")
]


def build(seed: int = 0):
    return lm.build_model(CFG, jax.random.key(seed))


def w4a4_policy(groups=FUSED) -> nvfp4x.Policy:
    """The paper's policy (LM head untouched, last block bf16, the rest in the training
    recipe with 16x16 weight blocks: W4A4 in nvfp4x), fused layers sharing scales."""
    return nvfp4x.Policy(
        [
            (r"lm_head", None),
            (r"blocks\[1\]\..*", nvfp4x.recipes.bf16()),
            (r".*", nvfp4x.recipes.nvfp4_training()),
        ],
        tensor_scale_groups=groups,
    )


def like_of(policy, make=build):
    return eqx.filter_eval_shape(lambda: nvfp4x.freeze(nvfp4x.quantize(make(1), policy)))


def s_dec(amax: float) -> np.float32:
    """The spec's tensor decode scale `1 / f32(2688 / amax)` (not `f32(amax / 2688)`)."""
    return np.float32(1.0) / (np.float32(2688.0) / np.float32(amax))


# --- an independent reader: numpy and the standard library only ---

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
RAW = {"U8": "u1", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "F8_E4M3": "u1"}


def read_raw(path) -> dict[str, tuple[str, np.ndarray]]:
    """`{name: (dtype code, raw array)}`: 8-byte little-endian header length, JSON header,
    payload; BF16 and F8 come back as their bit patterns."""
    data = pathlib.Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        raw = np.frombuffer(data[8 + n + begin : 8 + n + end], dtype=RAW[info["dtype"]])
        out[name] = (info["dtype"], raw.reshape(info["shape"]))
    return out


def e4m3_decode(bits: np.ndarray) -> np.ndarray:
    """float8_e4m3fn by hand: bias 7, subnormals below exponent 1, 0x7F/0xFF NaN."""
    b = bits.astype(np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 0x7
    value = np.where(e == 0, m / 8.0 * 2.0**-6, (1.0 + m / 8.0) * 2.0 ** (e - 7.0))
    value = np.where((e == 15) & (m == 7), np.nan, value)
    return (sign * value).astype(np.float32)


def decode_layer(raw, name: str) -> np.ndarray:
    """The spec's decoding: `(e2m1 × block scale) × weight_scale_2`, element 2i in the
    low nibble, one scale per 16 inputs."""
    codes = raw[f"{name}.weight"][1]
    low, high = codes & 0xF, codes >> 4
    nibbles = np.stack([low, high], axis=-1).reshape(codes.shape[0], -1)
    values = np.asarray(E2M1, np.float32)[nibbles]
    scale = np.repeat(e4m3_decode(raw[f"{name}.weight_scale"][1]), 16, axis=-1)
    ts = raw[f"{name}.weight_scale_2"][1].reshape(())
    assert raw[f"{name}.weight_scale_2"][0] == "F32"
    return (values * scale) * ts


# --- shared checkpoints ---


@pytest.fixture(scope="module")
def w4a4(tmp_path_factory):
    """The W4A4 export of the paper-policy model: (frozen, directory, input amax)."""
    frozen = nvfp4x.freeze(nvfp4x.quantize(build(), w4a4_policy()))
    amax = {p: 2.0 + 0.25 * i for i, p in enumerate(BLOCK0)}
    directory = tmp_path_factory.mktemp("w4a4")
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": CFG.d_model}
    nvfp4x.export_hf(frozen, directory, names=NAMES, input_amax=amax, hf_config=config)
    return frozen, directory, amax


def test_w4a4_round_trip_is_bit_identical(w4a4):
    frozen, directory, _ = w4a4
    back = nvfp4x.import_hf(directory, like_of(w4a4_policy()), names=NAMES)
    assert_same_bits(back, frozen)
    x = jnp.arange(CFG.seq, dtype=jnp.int32) * 7 % CFG.vocab
    forward = eqx.filter_jit(lambda m, t: m(t))
    np.testing.assert_array_equal(forward(back, x), forward(frozen, x))


def test_bf16_twin_of_the_export_is_the_same_model_in_bfloat16(w4a4):
    """`--generate-from DIR --compare-bf16`'s baseline: every frozen layer of the read
    checkpoint a `Bf16Linear` holding its decoded weight in bfloat16, the logits close
    to the packed model's; and both generate."""
    frozen, directory, _ = w4a4
    back = nvfp4x.import_hf(directory, like_of(w4a4_policy()), names=NAMES)
    twin = lm.bf16_twin(back)
    is_frozen = lambda n: isinstance(n, nvfp4x.FrozenLinear)  # noqa: E731
    frozen_layers = [n for n in jax.tree.leaves(back, is_leaf=is_frozen) if is_frozen(n)]
    is_twin = lambda n: isinstance(n, lm.Bf16Linear)  # noqa: E731
    twins = [n for n in jax.tree.leaves(twin, is_leaf=is_twin) if is_twin(n)]
    assert frozen_layers and len(twins) == len(frozen_layers)
    assert not any(map(is_frozen, jax.tree.leaves(twin, is_leaf=is_frozen)))
    assert all(t.weight.dtype == jnp.bfloat16 for t in twins)
    wq = back.blocks[0].attn.wq
    want = np.asarray(wq.weight.packed.dequantize().astype(jnp.bfloat16), np.float32)
    np.testing.assert_array_equal(np.asarray(twin.blocks[0].attn.wq.weight, np.float32), want)
    x = jnp.arange(CFG.seq, dtype=jnp.int32) * 7 % CFG.vocab
    got, ref = np.asarray(twin(x), np.float32), np.asarray(back(x), np.float32)
    assert np.linalg.norm(got - ref) <= 0.1 * np.linalg.norm(ref)
    for model in (back, twin):
        assert lm.generation_speed(model, CFG, 2) > 0


#: One step of the example's cached decode, a program of its own (`generate` runs them all
#: in one, `deploy._greedy_decode`).
decode_step = eqx.filter_jit(lambda model, token, pos, caches: model.decode(token, pos, caches))


def test_cached_decode_is_sliding_window_attention(w4a4):
    """`generate`'s key-value-cached decode (`Transformer.prefill`, then `decode`: one
    token per step, attention over a ring buffer of the last `CFG.seq` tokens): each
    step's logits are the sliding-window forward's (`model(tokens, window=CFG.seq)`) of
    every token so far, past the window's length (the ring buffer wraps), up to float32
    rounding, for the float model and a frozen W4A16 one (no per-call activation
    scales); the first byte `generate` gives is the uncached one's, the frozen W4A4
    export read back generates with either, and `generate`'s one-program decode loop
    gives the step-by-step loop's bytes."""
    recipe = nvfp4x.recipes.nvfp4_weight_only()
    steps = 6  # (each evicts the oldest token: the ring buffer wraps at its first step)
    text = (np.arange(CFG.seq + steps) * 7 % CFG.vocab).astype(np.int32)
    forward = eqx.filter_jit(lambda m, t: m(t, window=CFG.seq))
    # Float32 matmuls throughout: a TPU's default (one bfloat16 pass) differs between
    # the two programs by ~4e-3 of the logits' scale (seen on a v5e), which is not what
    # this compares.
    with jax.default_matmul_precision("highest"):
        for model in (build(), nvfp4x.freeze(nvfp4x.quantize(build(), recipe))):
            want = np.asarray(forward(model, jnp.asarray(text)))  # row j: after token j
            logits, caches = lm.deploy._prefill(model, jnp.asarray(text[: CFG.seq]))
            for i in range(steps + 1):
                row = want[CFG.seq - 1 + i]
                tol = dict(rtol=1e-3, atol=1e-4 * np.abs(row).max())
                np.testing.assert_allclose(np.asarray(logits), row, **tol, err_msg=f"step {i}")
                if i < steps:
                    token, pos = jnp.int32(text[CFG.seq + i]), jnp.int32(CFG.seq + i)
                    logits, caches = decode_step(model, token, pos, caches)
    _, directory, _ = w4a4
    back = nvfp4x.import_hf(directory, like_of(w4a4_policy()), names=NAMES)
    prompt = b"def f(x):"
    for model in (build(), back):
        cached, plain = (lm.generate(model, CFG, prompt, 4, cache=c) for c in (True, False))
        assert len(cached) == 4 and cached[:1] == plain[:1]
        if not isinstance(model.blocks[0].attn.wq, nvfp4x.FrozenLinear):
            # The cached decode's one program (`lax.scan` over the steps) is the
            # step-by-step loop.
            window = np.frombuffer(b" " * (CFG.seq - len(prompt)) + prompt, np.uint8)
            logits, caches = lm.deploy._prefill(model, jnp.asarray(window, jnp.int32))
            stepwise = []
            for i in range(4):
                stepwise.append(int(jnp.argmax(logits)))
                token = jnp.int32(stepwise[-1])
                logits, caches = decode_step(model, token, CFG.seq + i, caches)
            assert cached == bytes(stepwise)


def test_time_generation_needs_no_checkpoint(capsys):
    """`train_lm.py --time-generation`: no training, no files: a random model of the
    configuration, quantised by the paper's policy and frozen, against its bf16 twin and
    the same policy with NVFP4 weights only."""
    from nvfp4_lm import cli

    speeds = cli.main(["--smoke", "--time-generation", "--generate", "2"])
    assert set(speeds) == {"packed bytes/s", "bf16 bytes/s", "packed W4A16 bytes/s"}
    assert min(speeds.values()) > 0
    out = capsys.readouterr().out
    assert "random model: 2 blocks" in out and "weights only (W4A16)" in out


def test_w4a4_files_follow_model_optimizer(w4a4):
    frozen, directory, amax = w4a4
    hq = json.loads((directory / "hf_quant_config.json").read_text())
    assert hq["producer"]["name"] == "nvfp4x"
    q = hq["quantization"]
    assert (q["quant_algo"], q["kv_cache_quant_algo"], q["group_size"]) == ("NVFP4", None, 16)
    bf16_tail = {f"model.layers.1.{m}" for m in ("self_attn.q_proj", "mlp.down_proj")}
    assert {"lm_head"} | bf16_tail <= set(q["exclude_modules"])
    assert not any(m.startswith("model.layers.0.") for m in q["exclude_modules"])
    config = json.loads((directory / "config.json").read_text())
    assert config["hidden_size"] == CFG.d_model  # the given config, kept
    qc = config["quantization_config"]
    assert (qc["quant_method"], qc["quant_algo"], qc["ignore"]) == (
        "modelopt",
        "NVFP4",
        q["exclude_modules"],
    )
    assert qc["config_groups"]["group_0"]["input_activations"]["group_size"] == 16

    raw = read_raw(directory / "model.safetensors")
    q_proj = "model.layers.0.self_attn.q_proj"
    assert raw[f"{q_proj}.weight"][0] == "U8" and raw[f"{q_proj}.weight"][1].shape == (64, 32)
    assert raw[f"{q_proj}.weight_scale"][0] == "F8_E4M3"
    assert raw[f"{q_proj}.weight_scale"][1].shape == (64, 4)
    assert raw[f"{q_proj}.weight_scale_2"][1].shape == ()
    # weight_scale_2 is nvfp4x's tensor scale, bit for bit
    ts = np.asarray(frozen.blocks[0].attn.wq.weight.packed.tensor_scale)
    assert raw[f"{q_proj}.weight_scale_2"][1].tobytes() == ts.tobytes()
    # input_scale: the NVFP4 decode scale of the calibrated amax; q/k/v share the largest
    scales = {raw[f"model.layers.0.self_attn.{p}_proj.input_scale"][1].item() for p in "qkv"}
    assert scales == {s_dec(amax["blocks[0].attn.wv"])}
    for p in ("gate", "up"):
        assert f"model.layers.0.mlp.{p}_proj.input_scale" in raw
    # fused layers share one weight_scale_2 (tensor_scale_groups)
    qkv = {raw[f"model.layers.0.self_attn.{p}_proj.weight_scale_2"][1].tobytes() for p in "qkv"}
    assert len(qkv) == 1
    # unquantised tensors in their dtype
    assert raw["model.layers.1.self_attn.q_proj.weight"][0] == "BF16"
    assert raw["lm_head.weight"][0] == "F32" and raw["model.norm.weight"][0] == "F32"
    assert raw["model.embed_tokens.weight"][1].shape == (CFG.vocab, CFG.d_model)
    assert "model.layers.1.self_attn.q_proj.input_scale" not in raw


def test_numpy_decoder_reproduces_the_frozen_weights(w4a4):
    """16x16 tiles written as 1x16 rows decode to the frozen weights bit for bit."""
    frozen, directory, _ = w4a4
    raw = read_raw(directory / "model.safetensors")
    for path in BLOCK0:
        layer = frozen.blocks[0]
        for part in path.split(".")[1:]:
            layer = getattr(layer, part)
        packed = layer.weight.packed
        assert packed.block == (16, 16)
        want = np.asarray(packed.dequantize(jnp.float32))
        got = decode_layer(raw, NAMES(path))
        assert got.tobytes() == want.tobytes(), path


def test_odd_rows_and_weight_only(tmp_path):
    """A 16x16-block layer whose rows are not a multiple of 16 (the last tile is cut),
    written weights-only (W4A16_NVFP4, no input_scale), decoded by hand and read back."""

    def make(seed):
        k1, k2 = jax.random.split(jax.random.key(seed))
        return {
            "proj": eqx.nn.Linear(32, 40, key=k1),
            "out": eqx.nn.Linear(32, 8, use_bias=False, key=k2),
        }

    policy = nvfp4x.Policy([(r".*", nvfp4x.recipes.nvfp4_weight_only(weight_block=(16, 16)))])
    frozen = nvfp4x.freeze(nvfp4x.quantize(make(0), policy))
    names = {"[proj]": "model.proj", "[out]": "model.out"}
    nvfp4x.export_hf(frozen, tmp_path, names=names)
    raw = read_raw(tmp_path / "model.safetensors")
    assert raw["model.proj.weight"][1].shape == (40, 16) and "model.proj.bias" in raw
    assert not any(n.endswith("input_scale") for n in raw)
    q = json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]
    assert q["quant_algo"] == "W4A16_NVFP4" and q["exclude_modules"] == []
    for key, name in names.items():
        want = np.asarray(frozen[key[1:-1]].weight.packed.dequantize(jnp.float32))
        assert decode_layer(raw, name).tobytes() == want.tobytes()
    back = nvfp4x.import_hf(tmp_path, like_of(policy, make), names=names)
    assert_same_bits(back, frozen)
    # a 1x16 `like` reads 16x16 checkpoints (each row holds its tile's scale) ...
    rows = nvfp4x.Policy([(r".*", nvfp4x.recipes.nvfp4_weight_only())])
    back = nvfp4x.import_hf(tmp_path, like_of(rows, make), names=names)
    np.testing.assert_array_equal(
        back["proj"].weight.packed.dequantize(), frozen["proj"].weight.packed.dequantize()
    )
    # ... and a 1x16 checkpoint is refused by a 16x16 `like` if its scales vary in a tile
    frozen_rows = nvfp4x.freeze(nvfp4x.quantize(make(0), rows))
    shutil.rmtree(tmp_path)
    nvfp4x.export_hf(frozen_rows, tmp_path, names=names)
    with pytest.raises(ValueError, match=r"varies within 16-row tiles.*weight_block=\(1, 16\)"):
        nvfp4x.import_hf(tmp_path, like_of(policy, make), names=names)


class Stacked(eqx.Module):
    """train_lm's Transformer with its blocks built by `eqx.filter_vmap` (one leading
    layer axis on every array of `blocks`)."""

    embed: eqx.nn.Embedding
    blocks: lm.Block
    norm: lm.RMSNorm
    lm_head: eqx.nn.Linear

    def __init__(self, seed: int):
        k_embed, k_head, k_blocks = jax.random.split(jax.random.key(seed), 3)
        keys = jax.random.split(k_blocks, CFG.n_layers)
        self.embed = eqx.nn.Embedding(CFG.vocab, CFG.d_model, key=k_embed)
        self.blocks = eqx.filter_vmap(lambda k: lm.Block(CFG, key=k))(keys)
        self.norm = lm.RMSNorm(CFG.d_model)
        self.lm_head = eqx.nn.Linear(CFG.d_model, CFG.vocab, use_bias=False, key=k_head)

    def as_list(self):
        """The same weights as train_lm's Transformer (blocks in a list)."""
        model = build()
        blocks = [jax.tree.map(lambda x, i=i: x[i], self.blocks) for i in range(CFG.n_layers)]
        model = eqx.tree_at(lambda m: m.blocks, model, blocks)
        return eqx.tree_at(
            lambda m: (m.embed, m.norm, m.lm_head), model, (self.embed, self.norm, self.lm_head)
        )


def test_stacked_layers_write_one_tensor_per_layer(tmp_path):
    """A vmap-built model writes one tensor per layer: the very tensors of the same
    weights built as a list (tensor scales per slice, groups per slice)."""
    policy = nvfp4x.Policy(
        [
            (r"lm_head", None),
            # stacked norms have 2-D weights: nvfp4x would take them for linear layers
            (r"blocks\.(attn|mlp)_norm", None),
            (r".*", nvfp4x.recipes.nvfp4_weight_only(weight_block=(16, 16))),
        ],
        tensor_scale_groups=FUSED,
        strict=False,  # the norm rule has nothing to match in the list-built model
    )
    model = Stacked(2)
    assert model.blocks.attn.wq.weight.shape == (2, 64, 64)
    frozen = nvfp4x.freeze(nvfp4x.quantize(model, policy))
    listed = nvfp4x.freeze(nvfp4x.quantize(model.as_list(), policy))
    assert frozen.blocks.attn.wq.weight.packed.tensor_scale.shape == (2,)
    nvfp4x.export_hf(listed, tmp_path / "list", names=NAMES)
    nvfp4x.export_hf(frozen, tmp_path / "stack", names=NAMES)
    a = read_raw(tmp_path / "list/model.safetensors")
    b = read_raw(tmp_path / "stack/model.safetensors")
    assert sorted(a) == sorted(b) and "model.layers.1.mlp.up_proj.weight_scale_2" in b
    for name in a:
        assert a[name][0] == b[name][0] and a[name][1].tobytes() == b[name][1].tobytes(), name

    like = eqx.filter_eval_shape(lambda: nvfp4x.freeze(nvfp4x.quantize(Stacked(3), policy)))
    back = nvfp4x.import_hf(tmp_path / "stack", like, names=NAMES)
    assert_same_bits(back, frozen)


def test_mixed_policy_round_trip(tmp_path):
    """W4A4 and W4A16 layers (MIXED_PRECISION), float32 and bf16 recipes, an excluded
    LM head; fused W4A4 layers share the largest input amax."""
    policy = nvfp4x.Policy(
        [
            (r"lm_head", None),
            (r"blocks\[0\]\.attn\.w[qkv]", nvfp4x.recipes.nvfp4_inference()),
            (r"blocks\[0\]\.attn\.wo", nvfp4x.recipes.nvfp4_weight_only()),
            (r"blocks\[0\]\.mlp\..*", nvfp4x.recipes.float32()),
            (r".*", nvfp4x.recipes.bf16()),
        ],
        tensor_scale_groups=[FUSED[0]],
    )
    frozen = nvfp4x.freeze(nvfp4x.quantize(build(), policy))
    amax = {"blocks[0].attn.wq": 1.0, "blocks[0].attn.wk": 5.0, "blocks[0].attn.wv": 2.0}
    nvfp4x.export_hf(frozen, tmp_path, names=NAMES, input_amax=amax)
    q = json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]
    assert q["quant_algo"] == "MIXED_PRECISION"
    assert q["quantized_layers"]["model.layers.0.self_attn.o_proj"]["quant_algo"] == "W4A16_NVFP4"
    assert q["quantized_layers"]["model.layers.0.self_attn.q_proj"] == {
        "quant_algo": "NVFP4",
        "group_size": 16,
    }
    assert "model.layers.0.mlp.up_proj" not in q["quantized_layers"]
    raw = read_raw(tmp_path / "model.safetensors")
    assert {raw[f"model.layers.0.self_attn.{p}_proj.input_scale"][1].item() for p in "qkv"} == {
        s_dec(5.0)
    }
    assert raw["model.layers.0.mlp.up_proj.weight"][0] == "F32"
    assert raw["model.layers.1.mlp.up_proj.weight"][0] == "BF16"
    assert_same_bits(nvfp4x.import_hf(tmp_path, like_of(policy), names=NAMES), frozen)
    # `config.json`'s per-layer map must be the one nvfp4x reads (a serving stack reads it)
    hq = json.loads((tmp_path / "hf_quant_config.json").read_text())
    config = {"quantization_config": config_json_block(hq, ALGOS)}
    (tmp_path / "config.json").write_text(json.dumps(config))
    nvfp4x.import_hf(tmp_path, like_of(policy), names=NAMES)  # (as `export_hf` writes it)
    o_proj = "model.layers.0.self_attn.o_proj"
    config["quantization_config"]["quantized_layers"][o_proj]["quant_algo"] = "NVFP4"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"`quantized_layers\.{re.escape(o_proj)}: .*disagree"):
        nvfp4x.import_hf(tmp_path, like_of(policy), names=NAMES)


# --- refusals ---


def rewrite(path, drop=(), add=None, change=None):
    """Write `path` again as another writer would (no nvfp4x metadata, another producer
    in `hf_quant_config.json`), with tensors dropped, added or changed."""
    raw = read_raw(path)
    views = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn}
    tensors = {n: a.view(views.get(d, a.dtype)) for n, (d, a) in raw.items() if n not in drop}
    tensors.update(add or {})
    tensors.update(change or {})
    safetensors.numpy.save_file(tensors, str(path), metadata={"format": "pt"})
    config = pathlib.Path(path).parent / "hf_quant_config.json"
    raw = json.loads(config.read_text())
    raw["producer"] = {"name": "modelopt", "version": "0.37.0"}
    config.write_text(json.dumps(raw, indent=4))


@pytest.fixture
def bad(w4a4, tmp_path):
    """A fresh copy of the W4A4 checkpoint to damage, and how to read it."""
    _, directory, _ = w4a4
    copy = tmp_path / "ckpt"
    shutil.copytree(directory, copy)
    like = like_of(w4a4_policy())
    return copy, lambda **kw: nvfp4x.import_hf(copy, like, names=NAMES, **kw)


def set_quantization(directory, **changes):
    path = directory / "hf_quant_config.json"
    config = json.loads(path.read_text())
    config["quantization"].update(changes)
    path.write_text(json.dumps(config))


def test_model_optimizer_style_checkpoint_reads_unverified(w4a4, bad):
    """Without nvfp4x's checksums (as Model Optimizer writes files), nothing to verify."""
    frozen, _, _ = w4a4
    directory, read = bad
    rewrite(directory / "model.safetensors")
    assert_same_bits(read(), frozen)


def test_refuses_missing_tensor(bad):
    directory, read = bad
    rewrite(directory / "model.safetensors", drop=["model.layers.0.mlp.up_proj.weight_scale"])
    with pytest.raises(
        ValueError, match=r"no tensor `model\.layers\.0\.mlp\.up_proj\.weight_scale`.*missing"
    ):
        read()


def test_refuses_unexpected_tensor_unless_told(bad):
    directory, read = bad
    extra = {"model.layers.0.self_attn.k_proj.k_scale": np.ones((), np.float32)}
    rewrite(directory / "model.safetensors", add=extra)
    with pytest.raises(ValueError, match=r"k_proj\.k_scale`.*\(unexpected\).*ignore_unexpected"):
        read()
    read(ignore_unexpected=True)


def test_refuses_shape_mismatch(bad):
    directory, read = bad
    wrong = {"model.norm.weight": np.ones((CFG.d_model + 16,), np.float32)}
    rewrite(directory / "model.safetensors", change=wrong)
    with pytest.raises(
        ValueError, match=r"`model\.norm\.weight` has shape \[80\].*\[64\]: shape mismatch"
    ):
        read()


def test_refuses_dtype_mismatch(bad):
    directory, read = bad
    wrong = {"model.norm.weight": np.ones((CFG.d_model,), np.float16)}
    rewrite(directory / "model.safetensors", change=wrong)
    with pytest.raises(
        ValueError, match=r"`model\.norm\.weight` is F16.*needs F32: dtype mismatch"
    ):
        read()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"quant_algo": "MXFP4"}, r"quant_algo: MXFP4.*E8M0"),
        ({"quant_algo": "NVFP4_AWQ"}, r"quant_algo: NVFP4_AWQ.*pre_quant_scale"),
        ({"quant_algo": "W4A16_AWQ", "group_size": 128}, r"quant_algo: W4A16_AWQ.*pre_quant_scale"),
        ({"quant_algo": "FP8"}, r"quant_algo: FP8` \(FP8 checkpoints"),
        ({"group_size": 32}, r"group_size: 32"),
        ({"kv_cache_quant_algo": "FP8"}, r"KV cache quantisation"),
        # (was "unsupported `group_size: 16`; nvfp4x reads group size 16 only")
        ({"group_size": "16"}, r'`group_size` is "16" \(a string\), not an integer'),
    ],
    ids=["mxfp4", "nvfp4_awq", "w4a16_awq", "fp8", "group_size_32", "kv_cache", "group_size_str"],
)
def test_refuses_unsupported_quantisation(bad, changes, message):
    directory, read = bad
    set_quantization(directory, **changes)
    with pytest.raises(ValueError, match=message):
        read()


def test_refuses_truncated_file(bad):
    directory, read = bad
    path = directory / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"is truncated: tensor .* of a payload"):
        read()
    path.write_bytes(data[:64])
    with pytest.raises(ValueError, match=r"is truncated: its header claims"):
        read()


def test_refuses_flipped_byte(bad):
    directory, read = bad
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    data[8 + n + 1000] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"tensor `.*` fails its sha256 checksum"):
        read()


def test_refuses_changed_quant_config(bad):
    directory, read = bad
    config = json.loads((directory / "hf_quant_config.json").read_text())
    config["quantization"]["exclude_modules"].remove("lm_head")
    (directory / "hf_quant_config.json").write_text(json.dumps(config, indent=4) + "\n")
    with pytest.raises(ValueError, match=r"hf_quant_config\.json` fails the sha256 checksum"):
        read()


def test_refuses_quantisation_mismatch(w4a4):
    """A W4A4 checkpoint read into weights-only recipes: the activations would differ."""
    _, directory, _ = w4a4
    policy = nvfp4x.Policy(
        [
            (r"lm_head", None),
            (r"blocks\[1\]\..*", nvfp4x.recipes.bf16()),
            (r".*", nvfp4x.recipes.nvfp4_weight_only(weight_block=(16, 16))),
        ]
    )
    with pytest.raises(
        ValueError, match=r"stores `model\.layers\.0\..*` `NVFP4`.*quantisation mismatch"
    ):
        nvfp4x.import_hf(directory, like_of(policy), names=NAMES)


# --- fused projections ---


def test_fused_layers_need_one_tensor_scale(tmp_path):
    policy = w4a4_policy(groups=())
    frozen = nvfp4x.freeze(nvfp4x.quantize(build(), policy))
    amax = dict.fromkeys(BLOCK0, 3.0)
    with pytest.raises(
        ValueError, match=r"gate_proj.*up_proj.*one tensor scale.*tensor_scale_groups"
    ):
        nvfp4x.export_hf(frozen, tmp_path, names=NAMES, input_amax=amax)
    with pytest.warns(
        UserWarning, match=r"requantised `model\.layers\.0\..*_proj` .*tensor_scale_groups"
    ):
        nvfp4x.export_hf(frozen, tmp_path, names=NAMES, input_amax=amax, requantize_fused=True)
    raw = read_raw(tmp_path / "model.safetensors")
    for group in (["q", "k", "v"], ["gate", "up"]):
        names = [
            f"model.layers.0.{'self_attn' if len(group) == 3 else 'mlp'}.{p}_proj" for p in group
        ]
        assert len({raw[f"{n}.weight_scale_2"][1].tobytes() for n in names}) == 1
    # requantised rows no longer sit in 16x16 tiles: read with 1x16 weights, values close
    rows = nvfp4x.Policy(
        [
            (r"lm_head", None),
            (r"blocks\[1\]\..*", nvfp4x.recipes.bf16()),
            (r".*", nvfp4x.recipes.nvfp4_inference()),
        ]
    )
    back = nvfp4x.import_hf(tmp_path, like_of(rows), names=NAMES)
    got = back.blocks[0].attn.wk.weight.packed.dequantize()
    want = frozen.blocks[0].attn.wk.weight.packed.dequantize()
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 0.2


def test_fused_layers_need_one_precision(tmp_path):
    policy = nvfp4x.Policy(
        [(r"lm_head|blocks\[0\]\.attn\.wq", None), (r".*", nvfp4x.recipes.nvfp4_weight_only())],
        tensor_scale_groups=FUSED,
    )
    frozen = nvfp4x.freeze(nvfp4x.quantize(build(), policy))
    match = r"`model\.layers\.0\.self_attn\.q_proj` \(unquantised\).*different precision"
    with pytest.raises(ValueError, match=match):
        nvfp4x.export_hf(frozen, tmp_path, names=NAMES)


def test_freeze_shares_tensor_scales_in_groups():
    model = build()
    grouped = nvfp4x.freeze(nvfp4x.quantize(model, w4a4_policy()))
    plain = nvfp4x.freeze(nvfp4x.quantize(model, w4a4_policy(groups=())))
    attn = [getattr(grouped.blocks[0].attn, w).weight.packed for w in ("wq", "wk", "wv")]
    assert len({np.asarray(p.tensor_scale).tobytes() for p in attn}) == 1
    own = [getattr(plain.blocks[0].attn, w).weight.packed for w in ("wq", "wk", "wv")]
    top = max(range(3), key=lambda i: float(own[i].tensor_scale))
    assert_same_bits(attn[top], own[top])  # the group's largest amax: unchanged
    wo = (grouped.blocks[0].attn.wo.weight.packed, plain.blocks[0].attn.wo.weight.packed)
    assert_same_bits(*wo)  # not in a group


def test_unused_scale_group_pattern_is_an_error():
    policy = nvfp4x.Policy(
        [(r".*", nvfp4x.recipes.nvfp4_inference())], tensor_scale_groups=[r"nope"]
    )
    with pytest.raises(ValueError, match=r"`tensor_scale_groups` pattern\(s\) `nope` matched no"):
        nvfp4x.quantize(build(), policy)


# --- the names map and the arguments ---


@pytest.fixture(scope="module")
def weight_only_frozen():
    policy = nvfp4x.Policy(
        [(r"lm_head", None), (r".*", nvfp4x.recipes.nvfp4_weight_only())],
        tensor_scale_groups=FUSED,
    )
    return nvfp4x.freeze(nvfp4x.quantize(build(), policy))


def test_names_map_errors(weight_only_frozen, tmp_path):
    frozen = weight_only_frozen
    partial = lambda path: None if path == "blocks[1].mlp_norm" else NAMES(path)
    with pytest.raises(ValueError, match=r"no checkpoint name for module `blocks\[1\]\.mlp_norm`"):
        nvfp4x.export_hf(frozen, tmp_path, names=partial)
    twice = lambda path: "model.norm" if path == "blocks[0].mlp_norm" else NAMES(path)
    with pytest.raises(
        ValueError, match=r"both map to the checkpoint tensor `model\.norm\.weight`"
    ):
        nvfp4x.export_hf(frozen, tmp_path, names=twice)
    with pytest.raises(TypeError, match=r"returned int `3` for module `embed`"):
        nvfp4x.export_hf(frozen, tmp_path, names=lambda path: 3)
    with pytest.raises(TypeError, match=r"names"):
        nvfp4x.export_hf(frozen, tmp_path, names=["embed"])
    stacked = lambda path: NAMES(path).replace("layers.0", "layers.{i}")
    with pytest.raises(ValueError, match=r"not stacked but its checkpoint name .* has the `\{i\}`"):
        nvfp4x.export_hf(frozen, tmp_path, names=stacked)
    as_dict = {p: NAMES(p) for p in ["embed", "norm", "lm_head"]}
    with pytest.raises(ValueError, match=r"no checkpoint name for module `blocks\[0\]\.attn_norm`"):
        nvfp4x.export_hf(frozen, tmp_path, names=as_dict)
    assert not (tmp_path / "model.safetensors").exists()  # nothing written by a refusal


def test_input_amax_of_a_layer_without_quantised_activations_is_refused(
    weight_only_frozen, tmp_path
):
    with pytest.raises(
        ValueError, match=r"`input_amax` names `blocks\[0\]\.attn\.wq`, whose recipe"
    ):
        nvfp4x.export_hf(
            weight_only_frozen, tmp_path, names=NAMES, input_amax={"blocks[0].attn.wq": 1.0}
        )


def test_a_model_not_frozen_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"quantised training weight.*nvfp4x\.freeze"):
        nvfp4x.export_hf(nvfp4x.quantize(build(), "nvfp4_inference"), tmp_path, names=NAMES)


def test_quantised_activations_need_their_input_amax(tmp_path):
    w4a4 = nvfp4x.freeze(nvfp4x.quantize(build(), w4a4_policy()))
    with pytest.raises(
        ValueError, match=r"`blocks\[0\]\.attn\.wq` quantises its activations.*input_amax"
    ):
        nvfp4x.export_hf(w4a4, tmp_path, names=NAMES)


def test_a_folder_holding_another_exports_shards_is_refused(weight_only_frozen, tmp_path):
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"already holds \['model-00001-of-00002\.safetensors'\]"):
        nvfp4x.export_hf(weight_only_frozen, tmp_path, names=NAMES)


def test_names_rules():
    names = nvfp4x.hf_names.rules([(r"layers\[(\d+)\]\.fc", r"model.layers.\1.mlp.up_proj")])
    assert names("layers[12].fc") == "model.layers.12.mlp.up_proj"
    assert names("head") is None
    assert NAMES("blocks[3].mlp_norm") == "model.layers.3.post_attention_layernorm"
    assert NAMES("blocks.attn.wo") == "model.layers.{i}.self_attn.o_proj"
    with pytest.raises(ValueError, match=r"does not compile"):
        nvfp4x.hf_names.rules([(r"(", "x")])
    # A template that is not a string (refused by `hf_names.rules`' annotation first where
    # beartype checks calls, as in this test run):
    with pytest.raises(TypeError, match=r"`rules\[1\]\[1\]` must be a string .* regex `head`"):
        _names._check_template(1, "head", 3)


class _ConvBlock(eqx.Module):
    conv: eqx.nn.Conv1d

    def __init__(self, key):
        self.conv = eqx.nn.Conv1d(32, 32, 4, padding=((3, 0),), key=key)

    def __call__(self, x):
        return x + jax.nn.silu(self.conv(x))


class _Layers(eqx.Module):
    layers: Any


def test_stacked_convolutions_export_one_tensor_per_layer(tmp_path):
    """Convolutions in a `filter_vmap`-built stack export as stacked linears do: the
    tensors of the same kernels built as a list, read back bit for bit."""
    keys = jax.random.split(jax.random.key(0), 2)
    stacked = _Layers(eqx.filter_vmap(_ConvBlock)(keys))
    listed = _Layers([_ConvBlock(k) for k in keys])
    policy = nvfp4x.Policy([(".*", nvfp4x.recipes.nvfp4_weight_only())], convolutions=True)
    frozen = nvfp4x.freeze(nvfp4x.quantize(stacked, policy))
    names = {"layers.conv": "model.layers.{i}.conv"}
    nvfp4x.export_hf(frozen, tmp_path / "stack", names=names)
    list_names = {f"layers[{i}].conv": f"model.layers.{i}.conv" for i in range(2)}
    listed = nvfp4x.freeze(nvfp4x.quantize(listed, policy))
    nvfp4x.export_hf(listed, tmp_path / "list", names=list_names)
    a = read_raw(tmp_path / "list/model.safetensors")
    b = read_raw(tmp_path / "stack/model.safetensors")
    assert sorted(a) == sorted(b) and "model.layers.1.conv.weight_scale_2" in b
    for name in a:
        assert a[name][0] == b[name][0] and a[name][1].tobytes() == b[name][1].tobytes(), name
    assert_same_bits(nvfp4x.import_hf(tmp_path / "stack", frozen, names=names), frozen)
