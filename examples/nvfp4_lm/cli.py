"""Train a small Llama-style byte-level language model twice: float32 and NVFP4.

The command line of `examples/train_lm.py` (its docstring says what it does).
"""

import argparse
import dataclasses
import os
import time
from typing import Any

import equinox as eqx
import jax
import numpy as np

import nvfp4x

from .config import SMOKE, Config
from .data import load_data
from .deploy import bf16_twin, export, generate, generation_speed, load_export
from .model import FUSED_SCALE_GROUPS, build_model, paper_policy
from .outputs import write_outputs, write_telemetry
from .training import gemm_coverage, train


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None, help=f"training steps (default {d.steps})")
    p.add_argument("--batch", type=int, default=None, help=f"sequences per step ({d.batch})")
    p.add_argument("--seq", type=int, default=None, help=f"bytes per sequence ({d.seq})")
    p.add_argument("--d-model", type=int, default=None, help=f"model width ({d.d_model})")
    p.add_argument("--layers", type=int, default=None, help=f"blocks ({d.n_layers})")
    p.add_argument(
        "--heads", type=int, default=None, help=f"heads ({d.n_heads}; d_model/64 with --d-model)"
    )
    p.add_argument("--lr", type=float, default=None, help=f"peak learning rate ({d.lr})")
    p.add_argument("--seed", type=int, default=None, help=f"init and batch seed ({d.seed})")
    p.add_argument("--data", default=None, help="a text file (default: the stdlib sources)")
    p.add_argument("--out", default=os.path.join("out", "train_lm"), help="output folder")
    p.add_argument("--smoke", action="store_true", help="a tiny configuration, seconds")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--bf16-from",
        type=float,
        default=None,
        metavar="FRACTION",
        help="switch every quantised layer to bf16 from this fraction of the steps on "
        "(the paper's precision schedule, e.g. 0.9; nvfp4x.requantize)",
    )
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="checkpoint both runs to DIR/float32 and DIR/nvfp4 (nvfp4x.TrainingCheckpointer, "
        "needs orbax-checkpoint); run again with the same arguments, a killed run resumes "
        "from its last checkpoints to the same losses",
    )
    p.add_argument(
        "--checkpoint-every", type=int, default=50, metavar="N", help="steps between checkpoints"
    )
    p.add_argument(
        "--telemetry",
        action="store_true",
        help="record per-layer NVFP4 operand statistics each step and plot them",
    )
    p.add_argument(
        "--export",
        default=None,
        metavar="DIR",
        help="after training, write the NVFP4 model to DIR as a Hugging Face checkpoint "
        "(NVIDIA Model Optimizer's format, served by vLLM), read it back and generate text "
        "(--smoke: to OUT/nvfp4_hf)",
    )
    p.add_argument(
        "--generate-from",
        default=None,
        metavar="DIR",
        help="no training: read a checkpoint written by --export and generate text from it",
    )
    p.add_argument(
        "--compare-bf16",
        action="store_true",
        help="with --generate-from: also time generation with the same model in bfloat16 "
        "(its weights decoded) and print both speeds",
    )
    p.add_argument(
        "--time-generation",
        action="store_true",
        help="no training: the configuration's model, randomly initialised, quantised by "
        "the paper's policy and frozen, against its bfloat16 twin: generation speed only "
        "(a size where reading the weights dominates, e.g. --d-model 2048 --layers 8)",
    )
    p.add_argument("--prompt", default="def main(argv):\n    ", help="prompt for generation")
    p.add_argument("--generate", type=int, default=48, metavar="N", help="bytes to generate")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> Config:
    base = SMOKE if args.smoke else Config()
    changes = {
        "steps": args.steps,
        "batch": args.batch,
        "seq": args.seq,
        "d_model": args.d_model,
        "n_layers": args.layers,
        "n_heads": args.heads,
        "lr": args.lr,
        "seed": args.seed,
    }
    changes = {k: v for k, v in changes.items() if v is not None}
    if "d_model" in changes and "n_heads" not in changes:
        changes["n_heads"] = max(1, changes["d_model"] // 64)  # heads of 64 features
    if "steps" in changes and "warmup" not in changes:
        changes["warmup"] = min(base.warmup, max(0, changes["steps"] // 10))
    return dataclasses.replace(base, **changes)


def generate_from(directory: str, prompt: str, n: int, compare_bf16: bool = False) -> bytes:
    """Read the checkpoint in `directory` and print `n` greedily generated bytes; with
    `compare_bf16`, also the generation speed of the packed model and of the same model
    in bfloat16 (`bf16_twin`), on this machine's default device."""
    model, cfg = load_export(directory)
    text = generate(model, cfg, prompt.encode(), n)
    print(f"{directory}: {cfg.n_layers} blocks, d_model={cfg.d_model}; greedy continuation:")
    print(prompt + text.decode("utf-8", errors="replace"))
    if compare_bf16:
        compare_speeds(model, cfg, n)
    return text


def compare_speeds(model: Any, cfg: Config, n: int, weight_only: Any = None) -> dict[str, float]:
    """Print and return the generation speed (`generation_speed`, `n` bytes, at least
    2) of the frozen `model` and of its bfloat16 twin (`bf16_twin`), in this process;
    with `weight_only` (the model frozen with NVFP4 weights and bfloat16-or-wider
    activations), its speed too: what the activations' quantisation costs per step."""

    def timed(label: str, m: Any) -> float:  # (each stage printed as it comes)
        print(f"  {label}: compiling and timing ...", flush=True)
        t0 = time.perf_counter()
        speed = generation_speed(m, cfg, max(n, 2))
        seconds = time.perf_counter() - t0
        print(f"  {label}: {speed:,.1f} bytes/s ({seconds:.1f} s with its compile)", flush=True)
        return speed

    packed = timed("NVFP4 packed", model)
    bf16 = timed("bfloat16", bf16_twin(model))
    out = {"packed bytes/s": packed, "bf16 bytes/s": bf16}
    w4a16 = ""
    if weight_only is not None:
        out["packed W4A16 bytes/s"] = speed = timed("NVFP4 weights only (W4A16)", weight_only)
        w4a16 = f", NVFP4 weights only (W4A16) {speed:,.1f} bytes/s ({speed / bf16:.2f}x)"
    print(
        f"generation on {jax.devices()[0].device_kind}, one token per step against a "
        f"key-value cache ({cfg.seq}-byte window): "
        f"NVFP4 packed {packed:,.1f} bytes/s, bfloat16 {bf16:,.1f} bytes/s "
        f"({packed / bf16:.2f}x){w4a16}"
    )
    return out


def time_generation(cfg: Config, n: int) -> dict[str, float]:
    """`--time-generation`: `cfg`'s model from random weights, quantised by the paper's
    policy and frozen (what `--export` packs, without training), against its bfloat16
    twin and the same policy with NVFP4 weights only (W4A16): the speeds only (its text
    means nothing)."""
    model = build_model(cfg, jax.random.key(cfg.seed))
    n_params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    print(
        f"random model: {cfg.n_layers} blocks, d_model={cfg.d_model}, {cfg.n_heads} heads, "
        f"d_ff={cfg.d_ff}, {n_params / 1e6:.2f}M parameters",
        flush=True,
    )

    def frozen_by(label: str, policy: nvfp4x.Policy) -> Any:
        # Eagerly: each weight's quantiser compiles once per shape, not the whole model
        # as one program (the same bits; on the CPU 1.9 s against 5.2 s, on a TPU v5e
        # 15-19 s for d_model 2048 x 8 blocks, where a run with the jitted freeze
        # printed nothing in 530 s).
        t0 = time.perf_counter()
        out = nvfp4x.freeze(nvfp4x.quantize(model, policy))
        jax.block_until_ready(eqx.filter(out, eqx.is_array))
        print(f"  frozen ({label}) in {time.perf_counter() - t0:.1f} s", flush=True)
        return out

    frozen = frozen_by("W4A4", paper_policy(cfg, tensor_scale_groups=FUSED_SCALE_GROUPS))
    weight_only = frozen_by(
        "W4A16",
        paper_policy(
            cfg,
            training=nvfp4x.recipes.nvfp4_weight_only(),
            tensor_scale_groups=FUSED_SCALE_GROUPS,
        ),
    )
    return compare_speeds(frozen, cfg, n, weight_only)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    if args.generate_from is not None:
        generate_from(args.generate_from, args.prompt, args.generate, args.compare_bf16)
        return {}
    if args.time_generation:
        try:
            cfg = config_from_args(args)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from e
        return time_generation(cfg, args.generate)
    export_dir = args.export
    if export_dir is None and args.smoke:
        export_dir = os.path.join(args.out, "nvfp4_hf")
    if export_dir is not None and args.bf16_from is not None:
        raise SystemExit("error: --export writes the NVFP4 model; --bf16-from ends in bf16")
    try:
        cfg = config_from_args(args)
        data = load_data(cfg, args.data)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from e
    model = build_model(cfg, jax.random.key(cfg.seed))
    n_params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    print(
        f"data: {data.source}: {len(data.train):,} train / {len(data.val):,} validation bytes\n"
        f"model: {cfg.n_layers} blocks, d_model={cfg.d_model}, {cfg.n_heads} heads, "
        f"d_ff={cfg.d_ff}, {n_params / 1e6:.2f}M parameters\n"
        f"training: {cfg.steps} steps x {cfg.batch} x {cfg.seq} bytes, peak lr {cfg.lr}"
    )

    groups = FUSED_SCALE_GROUPS if export_dir is not None else ()
    policy = paper_policy(cfg, tensor_scale_groups=groups)
    qmodel = nvfp4x.quantize(model, policy)
    if args.telemetry:  # probes on the NVFP4 layers (not the bf16 tail)
        qmodel = nvfp4x.telemetry.enable(
            qmodel, where=lambda path, layer: layer.recipe.weight.name == "nvfp4"
        )
    report = gemm_coverage(qmodel, cfg)
    if report.unquantised:
        raise SystemExit(f"error: GEMMs on selected weights ran unquantised: {report.unquantised}")
    shares = ", ".join(
        f"{fmt} {flops / report.total_flops:.1%}" for fmt, flops in report.flops_by_format().items()
    )
    print(f"GEMM FLOPs of one training step by format (nvfp4x.coverage): {shares}")
    progress = not args.no_progress
    if args.checkpoint_every < 1:
        raise SystemExit(f"error: --checkpoint-every must be >= 1, got {args.checkpoint_every}")

    def checkpoints(run: str) -> dict[str, Any]:
        if args.checkpoint_dir is None:
            return {}
        path = os.path.join(args.checkpoint_dir, run)
        return {"checkpoint_dir": path, "checkpoint_every": args.checkpoint_every}

    baseline = train(model, cfg, data, label="float32", progress=progress, **checkpoints("float32"))
    switch = {}
    if args.bf16_from is not None:
        if not 0 < args.bf16_from <= 1:
            raise SystemExit(f"error: --bf16-from must be in (0, 1], got {args.bf16_from}")
        switch = {
            "switch_at": int(args.bf16_from * cfg.steps),
            "switch_to": lambda path, _: None if path == "lm_head" else nvfp4x.recipes.bf16(),
        }
        print(f"precision schedule: NVFP4 until step {switch['switch_at']}, then bf16")
    quant = train(
        qmodel,
        cfg,
        data,
        label="nvfp4",
        progress=progress,
        telemetry=args.telemetry,
        **switch,
        **checkpoints("nvfp4"),
    )

    print("\n" + nvfp4x.summary(quant.model) + "\n")
    gap = lambda a, b: (b - a) / a
    print(f"{'':10}{'train loss':>12}{'val loss':>12}{'tokens/s':>12}{'compile s':>12}")
    for r in (baseline, quant):
        print(
            f"{r.label:10}{r.final_train_loss:12.4f}{r.val_loss:12.4f}"
            f"{r.tokens_per_second:12,.0f}{r.compile_seconds:12.1f}"
        )
    train_gap = gap(baseline.final_train_loss, quant.final_train_loss)
    val_gap = gap(baseline.val_loss, quant.val_loss)
    print(f"relative gap (nvfp4 - float32) / float32: train {train_gap:+.2%}, val {val_gap:+.2%}")
    title = (
        f"Byte-level LM ({n_params / 1e6:.1f}M parameters) on {data.source}:\n"
        f"float32 vs the NVFP4 recipe, {cfg.steps} steps of {cfg.batch}x{cfg.seq} bytes"
    )
    csv_path, png_path = write_outputs(args.out, baseline, quant, title=title)
    print(f"wrote {csv_path} and {png_path}")
    if args.telemetry:
        print("wrote {} and {}".format(*write_telemetry(args.out, quant.telemetry)))
    if export_dir is not None:
        frozen = export(quant.model, cfg, data, export_dir)
        back, _ = load_export(export_dir)
        same = all(
            np.asarray(a).tobytes() == np.asarray(b).tobytes()
            for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(back), strict=True)
        )
        print(f"wrote {export_dir} (nvfp4x.export_hf); read back bit for bit: {same}")
        if not same:
            raise SystemExit("error: the exported checkpoint does not read back bit for bit")
        generate_from(export_dir, args.prompt, args.generate)
    return {
        "baseline_train": baseline.final_train_loss,
        "baseline_val": baseline.val_loss,
        "nvfp4_train": quant.final_train_loss,
        "nvfp4_val": quant.val_loss,
        "train_gap": train_gap,
        "val_gap": val_gap,
    }
