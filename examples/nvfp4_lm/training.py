"""Training: the loss, the optimiser, the jitted steps and the training loop (with
checkpoints, telemetry and a precision switch)."""

import dataclasses
import sys
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int, UInt8

import nvfp4x

from .config import Config
from .data import Data, batch_starts, windows


def loss_fn(model: Any, x: Int[Array, "batch seq"], y: Int[Array, "batch seq"]) -> Float[Array, ""]:
    """Mean next-byte cross-entropy (nats) of `model` vmapped over the batch."""
    logits = jax.vmap(model)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """Gradient clipping at 1, then AdamW (decay on matrices only) with linear warmup and a
    cosine decay to `lr / 10`."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, cfg.warmup, cfg.steps, end_value=cfg.lr / 10
    )
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay, mask=decay_mask),
    )


@eqx.filter_jit
def train_step(model, opt_state, optimizer, x, y):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    return eqx.apply_updates(model, updates), opt_state, loss


@eqx.filter_jit
def train_step_telemetry(model, opt_state, optimizer, x, y):
    """`train_step` that also returns the quantisation statistics of every layer (the
    gradient of the probes `nvfp4x.telemetry.enable` added), computed in the same step."""
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
    stats = nvfp4x.telemetry.collect(grads)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    return eqx.apply_updates(model, updates), opt_state, loss, stats


def gemm_coverage(qmodel: Any, cfg: Config) -> nvfp4x.CoverageReport:
    """`nvfp4x.coverage` of one training step of `qmodel` (traced, not run): every GEMM
    of the forward and backward with its format, and the share of FLOPs in NVFP4."""
    optimizer = make_optimizer(cfg)
    opt_state = optimizer.init(eqx.filter(qmodel, eqx.is_inexact_array))
    tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq), jnp.int32)
    return nvfp4x.coverage(train_step, qmodel, opt_state, optimizer, tokens, tokens)


@eqx.filter_jit
def eval_loss(model, x, y):
    return loss_fn(model, x, y)


@dataclasses.dataclass
class TrainResult:
    """What `train` returns.

    **Fields:** `label`, the trained `model`, `losses` (training loss per step), `val_loss`
    (mean over the fixed validation windows), `seconds` (wall time after compilation),
    `compile_seconds` (first step, compilation included), `tokens_per_second`.
    """

    label: str
    model: Any
    losses: Float[np.ndarray, " steps"]
    val_loss: float
    seconds: float
    compile_seconds: float
    tokens_per_second: float
    telemetry: list | None = None

    @property
    def final_train_loss(self) -> float:
        """Mean training loss over the last 10% of steps (at most 20, at least 1)."""
        n = max(1, min(20, len(self.losses) // 10))
        return float(np.mean(self.losses[-n:]))


def evaluate(model: Any, cfg: Config, tokens: UInt8[np.ndarray, " n"]) -> float:
    """Mean loss over `cfg.eval_seqs` (rounded up to a multiple of `cfg.batch`) evenly
    spaced windows of `tokens`, `cfg.batch` at a time."""
    n = -(-cfg.eval_seqs // cfg.batch) * cfg.batch
    starts = np.linspace(0, len(tokens) - cfg.seq - 1, n).astype(np.int64)
    losses = []
    for i in range(0, len(starts), cfg.batch):
        x, y = windows(tokens, starts[i : i + cfg.batch], cfg.seq)
        losses.append(float(eval_loss(model, x, y)) * len(x))
    return sum(losses) / len(starts)


def train(
    model: Any,
    cfg: Config,
    data: Data,
    *,
    label: str = "model",
    progress: bool = True,
    telemetry: bool = False,
    switch_at: int | None = None,
    switch_to: Any = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 50,
) -> TrainResult:
    """Train `model` (quantised or not) for `cfg.steps` AdamW steps on `data`.

    The batches depend only on `cfg.seed` and the data, so two calls with the same `cfg`
    see the same bytes in the same order.

    **Arguments:**

    - `model`: a `Transformer`, or one returned by `nvfp4x.quantize`.
    - `cfg`, `data`: the configuration and the corpus (`load_data`).
    - `label`: a name for the progress bar.
    - `progress`: show a tqdm bar with the loss and tokens/s.
    - `telemetry`: record every quantised layer's statistics each step (see
      `nvfp4x.telemetry`); the model must hold probes (`nvfp4x.telemetry.enable`).
    - `switch_at`, `switch_to`: before step `switch_at`, switch the quantised model to the
      policy `switch_to` with `nvfp4x.requantize` (weights and optimiser state carry on).
    - `checkpoint_dir`, `checkpoint_every`: save the model, optimiser state and losses to
      `checkpoint_dir` with `nvfp4x.TrainingCheckpointer` every `checkpoint_every` steps
      and after the last (the two latest are kept). If it holds a checkpoint already,
      resume from the latest: the batches follow from the step, stochastic rounding from
      the weights, so the run ends as if never stopped. (Telemetry covers the steps run
      in this call.)

    **Returns:** a `TrainResult`.
    """
    from tqdm.auto import tqdm

    optimizer = make_optimizer(cfg)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    starts = batch_starts(cfg, len(data.train))
    losses = np.zeros(cfg.steps, np.float32)
    first, ckpt = 0, None
    if checkpoint_dir is not None:
        ckpt = nvfp4x.TrainingCheckpointer(checkpoint_dir, max_to_keep=2)
        first = ckpt.latest_step() or 0
        if first:
            if switch_at is not None and first > switch_at:  # saved after the switch
                model, opt_state = nvfp4x.requantize(model, switch_to, state=opt_state)
            like = {"model": model, "opt_state": opt_state, "losses": losses}
            state = ckpt.restore(like)
            model, opt_state, losses = state["model"], state["opt_state"], state["losses"]
            print(f"{label}: resumed from step {first} ({checkpoint_dir})")
    tokens_per_step = cfg.batch * cfg.seq
    bar = tqdm(
        range(first, cfg.steps),
        desc=f"{label:>8}",
        initial=first,
        total=cfg.steps,
        disable=not progress,
        dynamic_ncols=True,
    )
    t0 = time.perf_counter()
    compile_seconds = 0.0
    records = [] if telemetry else None
    for step in bar:
        if step == switch_at:
            model, opt_state = nvfp4x.requantize(model, switch_to, state=opt_state)
        x, y = windows(data.train, starts[step], cfg.seq)
        if telemetry:
            model, opt_state, loss, stats = train_step_telemetry(model, opt_state, optimizer, x, y)
            records.append(jax.device_get(stats))
        else:
            model, opt_state, loss = train_step(model, opt_state, optimizer, x, y)
        losses[step] = float(loss)
        if step == first:
            compile_seconds = time.perf_counter() - t0
            t0 = time.perf_counter()
        elapsed = time.perf_counter() - t0
        rate = tokens_per_step * (step - first) / elapsed if step > first else 0.0
        bar.set_postfix(loss=f"{losses[step]:.3f}", tok_s=f"{rate:,.0f}", refresh=False)
        done = step + 1
        if ckpt is not None and (done % checkpoint_every == 0 or done == cfg.steps):
            ckpt.save(done, {"model": model, "opt_state": opt_state, "losses": losses})
    if ckpt is not None:
        ckpt.close()  # the last save written
    seconds = time.perf_counter() - t0
    ran = cfg.steps - first
    rate = tokens_per_step * (ran - 1) / seconds if ran > 1 else 0.0
    if not np.all(np.isfinite(losses)):
        print(f"warning: {label} loss is not finite at some step", file=sys.stderr)
    val = evaluate(model, cfg, data.val)
    return TrainResult(label, model, losses, val, seconds, compile_seconds, rate, records)
