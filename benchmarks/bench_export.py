"""Export benchmark (issue 15): a frozen NVFP4 model written as a Hugging Face checkpoint
(`nvfp4x.export_hf`, NVIDIA Model Optimizer's format) and read back (`nvfp4x.import_hf`),
against the bf16 safetensors of the same model.

Model: `examples/train_lm.py`'s Llama-style transformer, `--d-model 1024 --layers 8`
(SwiGLU 2752): 100.7M weights in linear layers, random init; every linear layer but the
LM head in `nvfp4_inference` (W4A4, 1x16 weight blocks), q/k/v and gate/up sharing a
tensor scale (`tensor_scale_groups`), activation amax set to 4.0 for every layer (a
stand-in for calibration: it changes neither sizes nor times).

Reported:
- `freeze_s`, `export_s`, `import_s`: median wall times over `--repeats` runs (the first
  run compiles and is not counted; `import_hf` reads into an `eqx.filter_eval_shape`
  skeleton);
- file bytes: `model.safetensors` of the export against `safetensors.numpy.save_file` of
  the same tensors in bf16 (float arrays cast, same names), and the same restricted to
  the NVFP4 linear layers (their `weight`, `weight_scale`, `weight_scale_2`,
  `input_scale` against their bf16 `weight`), with bits per weight;
- `round_trip_bit_identical`: the imported model's leaves against the frozen model's;
- the cost of the shared tensor scales (`tensor_scale_groups` act at freeze only): the
  largest relative change of a grouped layer's frozen weight, and the relative RMS
  change of the logits on `--tokens` random tokens, both against freezing without groups
  (which equals the training forward bit for bit); for scale, the logits' relative RMS
  error of the W4A4 model against the float32 one, with and without the groups.

Run: `python benchmarks/bench_export.py [--d-model 1024] [--layers 8] [--repeats 3]`
(`--quick`: d_model 256, 2 blocks). `main(argv)` returns the numbers as a dict.
"""

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors.numpy

import nvfp4x

ROOT = pathlib.Path(__file__).resolve().parent.parent
QUICK_ARGV = ["--quick"]


sys.path.insert(0, str(ROOT / "examples"))  # the main example's package, examples/nvfp4_lm
import nvfp4_lm as lm  # noqa: E402


def policy(groups: tuple[str, ...]) -> nvfp4x.Policy:
    return nvfp4x.Policy(
        [(r"lm_head", None), (r".*", nvfp4x.recipes.nvfp4_inference())],
        tensor_scale_groups=groups,
    )


def timed(fn, repeats: int) -> tuple[Any, float]:
    """`(result, median seconds)` of `repeats` calls after one untimed call."""
    result = fn()
    jax.block_until_ready(result)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        jax.block_until_ready(result)
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)


def header(path: str) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        out = json.loads(f.read(n))
    out.pop("__metadata__", None)
    return out


def path_of(keys) -> str:
    """`blocks[3].attn.wq`: nvfp4x's path format."""
    out = ""
    for k in keys:
        if isinstance(k, jax.tree_util.GetAttrKey):
            out += ("." if out else "") + k.name
        else:
            out += f"[{k.idx}]"
    return out


def bf16_tensors(model: Any) -> dict[str, np.ndarray]:
    """The unquantised model's tensors under their checkpoint names, floats in bf16."""
    out = {}
    for keys, leaf in jax.tree_util.tree_flatten_with_path(model)[0]:
        name = nvfp4x.hf_names.llama(path_of(keys[:-1]))
        array = np.asarray(leaf)
        if np.issubdtype(array.dtype, np.floating):
            array = array.astype(ml_dtypes.bfloat16)
        out[f"{name}.{keys[-1].name}"] = array
    return out


def layers_of(model: Any) -> dict[str, Any]:
    """`{path: layer}` of the linear layers (plain, quantised or frozen)."""
    kinds = eqx.nn.Linear | nvfp4x.FrozenLinear
    flat = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda v: isinstance(v, kinds))[0]
    return {path_of(k): v for k, v in flat if isinstance(v, kinds)}


def logits(model: Any, tokens: jax.Array) -> jax.Array:
    return eqx.filter_jit(lambda m, t: m(t))(model, tokens)


def run(d_model: int = 1024, layers: int = 8, repeats: int = 3, tokens: int = 128) -> dict:
    cfg = dataclasses.replace(lm.Config(), d_model=d_model, n_layers=layers, n_heads=d_model // 64)
    model = lm.build_model(cfg, jax.random.key(0))
    qmodel = nvfp4x.quantize(model, policy(lm.FUSED_SCALE_GROUPS))
    frozen, freeze_s = timed(lambda: nvfp4x.freeze(qmodel), repeats)
    linears = [p for p in layers_of(model) if p != "lm_head"]
    amax = dict.fromkeys(linears, 4.0)
    params = sum(layer.weight.size for layer in layers_of(model).values())

    with tempfile.TemporaryDirectory() as tmp:
        out_dir = os.path.join(tmp, "nvfp4")

        def export():
            nvfp4x.export_hf(frozen, out_dir, names=nvfp4x.hf_names.llama, input_amax=amax)

        _, export_s = timed(export, repeats)
        like = eqx.filter_eval_shape(lambda: nvfp4x.freeze(qmodel))
        back, import_s = timed(
            lambda: nvfp4x.import_hf(out_dir, like, names=nvfp4x.hf_names.llama), repeats
        )
        same = all(
            np.asarray(a).tobytes() == np.asarray(b).tobytes()
            for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(back), strict=True)
        )
        path = os.path.join(out_dir, "model.safetensors")
        file_bytes = os.path.getsize(path)
        entries = header(path)
        bf16 = bf16_tensors(model)
        bf16_path = os.path.join(tmp, "bf16.safetensors")
        safetensors.numpy.save_file(bf16, bf16_path)
        bf16_bytes = os.path.getsize(bf16_path)

    quantised = {n.rsplit(".", 1)[0] for n in entries if n.endswith(".weight_scale_2")}
    lin_nvfp4 = sum(
        e["data_offsets"][1] - e["data_offsets"][0]
        for n, e in entries.items()
        if n.rsplit(".", 1)[0] in quantised
    )
    lin_bf16 = sum(bf16[f"{m}.weight"].nbytes for m in quantised)
    lin_weights = sum(bf16[f"{m}.weight"].size for m in quantised)

    # what the shared tensor scales cost: against freezing without groups
    plain = nvfp4x.freeze(nvfp4x.quantize(model, policy(())))
    grouped, ungrouped = layers_of(frozen), layers_of(plain)
    changes = []
    for p in linears:
        w_g = grouped[p].weight.packed.dequantize()
        w_0 = ungrouped[p].weight.packed.dequantize()
        changes.append(float(jnp.linalg.norm(w_g - w_0) / jnp.linalg.norm(w_0)))
    x = jax.random.randint(jax.random.key(1), (tokens,), 0, cfg.vocab)
    y_g, y_0, y_f = logits(frozen, x), logits(plain, x), logits(model, x)
    rel = lambda a, b: float(jnp.sqrt(jnp.mean((a - b) ** 2) / jnp.mean(b**2)))
    logit_change, error, error_grouped = rel(y_g, y_0), rel(y_0, y_f), rel(y_g, y_f)

    out = {
        "d_model": d_model,
        "layers": layers,
        "linear_weights": int(params),
        "freeze_s": freeze_s,
        "export_s": export_s,
        "import_s": import_s,
        "round_trip_bit_identical": bool(same),
        "file_bytes_nvfp4": int(file_bytes),
        "file_bytes_bf16": int(bf16_bytes),
        "file_ratio": bf16_bytes / file_bytes,
        "linear_bytes_nvfp4": int(lin_nvfp4),
        "linear_bytes_bf16": int(lin_bf16),
        "linear_ratio": lin_bf16 / lin_nvfp4,
        "linear_bits_per_weight": 8 * lin_nvfp4 / lin_weights,
        "grouped_weight_change_max": max(changes),
        "grouped_logit_change_rms": logit_change,
        "nvfp4_logit_error_rms": error,
        "nvfp4_logit_error_rms_grouped": error_grouped,
    }
    mib = lambda b: f"{b / 2**20:,.1f} MiB"
    print(
        f"{params / 1e6:.1f}M linear weights (d_model {d_model}, {layers} blocks): "
        f"freeze {freeze_s:.2f} s, export {export_s:.2f} s, import {import_s:.2f} s; "
        f"round trip bit-identical: {same}"
    )
    print(
        f"file {mib(file_bytes)} vs bf16 {mib(bf16_bytes)} ({out['file_ratio']:.2f}x); "
        f"linear layers {mib(lin_nvfp4)} vs {mib(lin_bf16)} ({out['linear_ratio']:.3f}x, "
        f"{out['linear_bits_per_weight']:.3f} bits/weight)"
    )
    print(
        f"shared tensor scales (freeze only): grouped weights change by at most "
        f"{max(changes):.2e} (relative), logits by {logit_change:.2e} (relative RMS); "
        f"logits' error against float32: {error:.2e} without groups, {error_grouped:.2e} "
        "with"
    )
    return out


def main(argv: list[str] | None = None) -> dict:
    """Parse `argv` (the command line by default), run, and return the numbers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=1024, help="model width")
    parser.add_argument("--layers", type=int, default=8, help="transformer blocks")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (median)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens for the logits")
    parser.add_argument("--quick", action="store_true", help="d_model 256, 2 blocks")
    args = parser.parse_args(argv)
    if args.quick:
        return run(d_model=256, layers=2, repeats=1, tokens=32)
    return run(args.d_model, args.layers, args.repeats, args.tokens)


if __name__ == "__main__":
    main()
