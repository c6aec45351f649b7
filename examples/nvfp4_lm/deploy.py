"""Deployment: a Hugging Face checkpoint that serving stacks read, and text from it."""

import dataclasses
import functools
import json
import os
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import nvfp4x

from .config import SMOKE, Config
from .data import Data, windows
from .model import FUSED_SCALE_GROUPS, build_model, paper_policy
from .training import loss_fn


def hf_config(cfg: Config) -> dict[str, Any]:
    """This model as Hugging Face's `LlamaForCausalLM` configures it (`config.json`): the
    same layers (pre-norm RMSNorm, rotate-half rotary embeddings with base 10000, SwiGLU,
    no biases, untied LM head) over 256 byte tokens. Weights are float32 where they are
    not NVFP4."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "head_dim": cfg.d_model // cfg.n_heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10_000.0,
        "max_position_embeddings": cfg.seq,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def config_from_hf(hf: dict[str, Any]) -> Config:
    """The `Config` of a checkpoint's `config.json` written by `hf_config`."""
    cfg = dataclasses.replace(
        SMOKE,
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        seq=hf["max_position_embeddings"],
        vocab=hf["vocab_size"],
    )
    if cfg.d_ff != hf["intermediate_size"]:
        raise ValueError(
            f"`intermediate_size={hf['intermediate_size']}` is not this example's SwiGLU size "
            f"{cfg.d_ff} for `hidden_size={cfg.d_model}`: not a checkpoint of this model."
        )
    return cfg


def calibrate_input_amax(
    qmodel: Any, cfg: Config, data: Data, batches: int = 2
) -> dict[str, float]:
    """The activation amax of every layer whose recipe quantises its input to NVFP4, the
    largest over `batches` validation batches (`nvfp4x.telemetry`'s `fprop_x` amax): a
    W4A4 checkpoint's static `input_scale` (nvfp4x itself scales activations per call)."""
    nvfp4_input = lambda path, w: w.recipe.input is not None and w.recipe.input.name == "nvfp4"
    probed = nvfp4x.telemetry.enable(nvfp4x.telemetry.disable(qmodel), where=nvfp4_input)
    grad = eqx.filter_jit(eqx.filter_grad(loss_fn))
    starts = np.linspace(0, len(data.val) - cfg.seq - 1, batches * cfg.batch).astype(np.int64)
    amax: dict[str, float] = {}
    for i in range(batches):
        x, y = windows(data.val, starts[i * cfg.batch : (i + 1) * cfg.batch], cfg.seq)
        for path, ops in nvfp4x.telemetry.collect(grad(probed, x, y)).items():
            amax[path] = max(amax.get(path, 0.0), float(ops["fprop_x"]["amax"]))
    return amax


def export(qmodel: Any, cfg: Config, data: Data, directory: str) -> Any:
    """Freeze the trained NVFP4 model and write it to `directory` as a W4A4 NVFP4 Hugging
    Face checkpoint (`nvfp4x.export_hf`, names as `LlamaForCausalLM`'s, a `config.json`
    from `hf_config`, activation scales calibrated on validation batches). The model
    must have been quantised with `tensor_scale_groups=FUSED_SCALE_GROUPS`.

    **Returns:** the frozen model."""
    amax = calibrate_input_amax(qmodel, cfg, data)
    frozen = nvfp4x.freeze(nvfp4x.telemetry.disable(qmodel))
    nvfp4x.export_hf(
        frozen, directory, names=nvfp4x.hf_names.llama, input_amax=amax, hf_config=hf_config(cfg)
    )
    return frozen


def load_export(directory: str) -> tuple[Any, Config]:
    """Read a checkpoint written by `export` (`nvfp4x.import_hf`, bit for bit) into this
    model, frozen; its configuration comes from the checkpoint's `config.json`."""
    with open(os.path.join(directory, "config.json")) as f:
        cfg = config_from_hf(json.load(f))
    policy = paper_policy(cfg, tensor_scale_groups=FUSED_SCALE_GROUPS)
    like = eqx.filter_eval_shape(
        lambda: nvfp4x.freeze(nvfp4x.quantize(build_model(cfg, jax.random.key(0)), policy))
    )
    return nvfp4x.import_hf(directory, like, names=nvfp4x.hf_names.llama), cfg


def generate(model: Any, cfg: Config, prompt: bytes, n: int, *, cache: bool = True) -> bytes:
    """`n` bytes after `prompt`, greedily, with a context of `cfg.seq` bytes (the
    length the model was trained on; a shorter prompt is left-padded with spaces).
    `cache=True`: the last `cfg.seq` bytes run once (`Transformer.prefill`), then each
    byte is one step on one token against every layer's key-value cache
    (`Transformer.decode`: each GEMM reads its weight for one token, as a serving stack
    decodes), every layer attending to its last `cfg.seq` positions (sliding-window
    attention), the `n - 1` steps and their greedy choices in one compiled program
    (`lax.scan`: no host round trip per byte, as a serving stack's decode loop);
    `cache=False`: each byte reruns the last `cfg.seq` bytes from scratch, one call per
    byte. The first byte is the same either way; later ones may differ (past the first
    window, a cached layer's keys carry context from before it)."""
    text = bytearray(b" " * max(0, cfg.seq - len(prompt)) + prompt)
    window = lambda: np.frombuffer(bytes(text[-cfg.seq :]), np.uint8).astype(np.int32)  # noqa: E731
    if not cache:
        step = _next_byte(cfg.seq)
        for _ in range(n):
            text.append(int(step(model, window())))
        return bytes(text[-n:]) if n else b""
    if not n:
        return b""
    logits, caches = _prefill(model, window())
    tokens = _greedy_decode(model, logits, caches, np.int32(cfg.seq), n)
    return bytes(np.asarray(tokens).tolist())  # (a token past 255 raises, as bytes do)


_prefill = eqx.filter_jit(lambda model, tokens: model.prefill(tokens))


@eqx.filter_jit
def _greedy_decode(model: Any, logits: Any, caches: Any, start: Any, n: int) -> Any:
    """`n` greedy tokens after `prefill`'s `logits` and `caches`: the first from
    `logits`, each next one from a `decode` step on the last at position `start + i`;
    one program (`n` static: one compile per length)."""

    def step(carry, i):
        logits, caches = carry
        token = jnp.argmax(logits).astype(jnp.int32)
        logits, caches = model.decode(token, start + i, caches)
        return (logits, caches), token

    (logits, _), tokens = jax.lax.scan(step, (logits, caches), jnp.arange(n - 1))
    return jnp.append(tokens, jnp.argmax(logits).astype(jnp.int32))


class Bf16Linear(eqx.Module):
    """A linear layer with its weight in bfloat16: `x` cast to bfloat16, multiplied with
    float32 accumulation, the bias added, cast back to `x`'s dtype (a bf16 serving
    stack's GEMM)."""

    weight: Any
    bias: Any

    def __call__(self, x: Any) -> Any:
        y = jnp.matmul(x.astype(jnp.bfloat16), self.weight.T, preferred_element_type=jnp.float32)
        return (y if self.bias is None else y + self.bias).astype(x.dtype)


def bf16_twin(model: Any) -> Any:
    """The same model with bfloat16 weights, the baseline of `generation_speed`: every
    frozen layer a `Bf16Linear` holding its packed weight decoded (`dequantize()`,
    tensor scale included) and rounded to bfloat16; the rest (embedding, norms,
    attention) as it is. Its numbers are close to the frozen model's, not the same."""

    def unpack(node: Any) -> Any:
        if not isinstance(node, nvfp4x.FrozenLinear):
            return node
        if len(node.weight_shape) != 2:
            raise ValueError(f"a stacked frozen layer {node.weight_shape}: not this model's")
        packed = getattr(node.weight, "packed", node.weight)  # (an array where not packed)
        weight = packed.dequantize() if hasattr(packed, "dequantize") else packed
        bias = None if node.bias is None else node.bias.astype(jnp.float32)
        return Bf16Linear(jnp.asarray(weight).astype(jnp.bfloat16), bias)

    return jax.tree.map(unpack, model, is_leaf=lambda n: isinstance(n, nvfp4x.FrozenLinear))


def generation_speed(
    model: Any, cfg: Config, n: int, prompt: bytes = b"def ", *, cache: bool = True
) -> float:
    """Bytes per second of `generate` (`cache` as there) over `n` bytes (at least 2),
    after a run of the same length that compiles its programs (not counted)."""
    generate(model, cfg, prompt, max(2, n), cache=cache)  # compiles
    t0 = time.perf_counter()
    generate(model, cfg, prompt, max(2, n), cache=cache)
    return max(2, n) / (time.perf_counter() - t0)


@functools.cache
def _next_byte(seq: int):
    del seq  # one compiled step per context length
    return eqx.filter_jit(lambda model, window: jnp.argmax(model(window)[-1]))
