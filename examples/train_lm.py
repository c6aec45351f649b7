"""Train a small Llama-style byte-level language model twice: float32 and NVFP4.

The same model (same initial weights, same batches) is trained once unquantised in
float32 and once under NVIDIA's NVFP4 training recipe with the paper's precision policy:
every linear layer in NVFP4 (16x16 weight blocks, 1x16 activation and gradient blocks,
stochastic rounding of gradients, random Hadamard transform in wgrad), except the last
~15% of blocks (bf16) and the LM head (left as it is). Embeddings, norms and attention's
softmax and batched matmuls are not linear layers and stay unquantised.

```bash
python examples/train_lm.py                    # default config: both runs, CPU-friendly
python examples/train_lm.py --smoke            # a tiny config, seconds
python examples/train_lm.py --data my.txt --steps 1000 --layers 8
python examples/train_lm.py --checkpoint-dir ckpt   # resumable: run it again after a crash
python examples/train_lm.py --export out/lm-nvfp4     # + a Hugging Face NVFP4 checkpoint
python examples/train_lm.py --generate-from out/lm-nvfp4 --prompt "import os"
```

With `--export DIR`, the NVFP4 model is frozen after training (q/k/v and gate/up sharing
a tensor scale, as serving stacks fuse them) and written with `nvfp4x.export_hf` as a W4A4
checkpoint in NVIDIA Model Optimizer's format (activation scales calibrated on two
validation batches), with a `config.json` of the equivalent `LlamaForCausalLM`; it is then
read back with `nvfp4x.import_hf` (checked bit for bit) and a few dozen bytes are
generated from it greedily. `--smoke` does the same into `OUT/nvfp4_hf`.

With `--checkpoint-dir DIR`, both runs save their training state (model, optimiser
state, losses so far; the step fixes the next batch) with `nvfp4x.TrainingCheckpointer`
every `--checkpoint-every` steps. Started again with the same arguments after a crash or
a kill, the script resumes each run from its last checkpoint and ends with the losses
and weights of a run never stopped.

The corpus is, by default, the Python standard library's own source files (present on
every machine, no download): the sorted file list, shuffled with a fixed seed, read
until a byte budget is reached; every 10th file goes to the validation split. With
`--data FILE`, the first bytes of FILE are used and the last 10% held out.

Outputs (in `--out`, default `out/train_lm`): `losses.csv` (step, baseline, nvfp4) and
`loss_curves.png`.

Importing this file has no side effects, so other scripts can reuse its pieces:

```python
import train_lm                                   # with examples/ on sys.path
cfg = train_lm.Config(steps=200)
data = train_lm.load_data(cfg)
model = train_lm.build_model(cfg, jax.random.key(cfg.seed))
result = train_lm.train(nvfp4x.quantize(model, some_policy), cfg, data, label="mine")
```
"""

import argparse
import csv
import dataclasses
import functools
import json
import math
import os
import sys
import sysconfig
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray, UInt8

import nvfp4x

# --- configuration ---


@dataclasses.dataclass(frozen=True)
class Config:
    """Model, data and optimisation settings.

    **Fields:** `d_model`, `n_layers`, `n_heads` (the model; the SwiGLU hidden size is
    `8/3 d_model` rounded up to a multiple of 64), `seq` and `batch` (tokens per step are
    `seq * batch` bytes), `steps`, `lr` (peak of a linear-warmup + cosine schedule down to
    `lr / 10`), `warmup` (steps), `weight_decay` (AdamW, matrices only), `seed` (weights
    and batch order), `data_bytes` (corpus budget, train + validation), `eval_seqs`
    (validation windows of length `seq`).
    """

    d_model: int = 192
    n_layers: int = 6
    n_heads: int = 3
    seq: int = 128
    batch: int = 16
    steps: int = 250
    lr: float = 3e-3
    warmup: int = 25
    weight_decay: float = 0.1
    seed: int = 0
    data_bytes: int = 3_000_000
    eval_seqs: int = 256
    vocab: int = 256

    def __post_init__(self):
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"`d_model={self.d_model}` must split into `n_heads={self.n_heads}` heads of "
                "even size (rotary embeddings rotate pairs of features)."
            )
        if self.steps < 1 or self.warmup < 0 or self.warmup >= self.steps:
            raise ValueError(
                f"Need `steps >= 1` and `0 <= warmup < steps`; got steps={self.steps}, "
                f"warmup={self.warmup}."
            )

    @property
    def d_ff(self) -> int:
        """The SwiGLU hidden size: `8/3 d_model`, rounded up to a multiple of 64."""
        return 64 * math.ceil(8 * self.d_model / 3 / 64)


#: A tiny configuration for `--smoke` (and the tests).
SMOKE = Config(
    d_model=64,
    n_layers=2,
    n_heads=2,
    seq=32,
    batch=4,
    steps=8,
    warmup=2,
    data_bytes=100_000,
    eval_seqs=8,
)


# --- the model: one sequence in, logits out; `jax.vmap` it over a batch ---


class RMSNorm(eqx.Module):
    """`x / rms(x) * weight` over the feature axis."""

    weight: Float[Array, " d"]
    eps: float = eqx.field(static=True)

    def __init__(self, d: int, eps: float = 1e-6):
        self.weight = jnp.ones((d,), jnp.float32)
        self.eps = eps

    def __call__(self, x: Float[Array, "seq d"]) -> Float[Array, "seq d"]:
        ms = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(ms + self.eps) * self.weight


def rotary(x: Float[Array, "seq heads hd"], base: float = 10_000.0) -> Float[Array, "seq heads hd"]:
    """Rotary position embedding (rotate-half form) along the head dimension."""
    seq, _, hd = x.shape
    inv_freq = 1.0 / base ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
    angle = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def per_token(linear: Any, x: Float[Array, "seq d"]) -> Float[Array, "seq out"]:
    """Apply a linear layer to every token. `eqx.nn.Linear` acts on one vector, so this
    vmaps it; a `nvfp4x.QuantizedLinear` gives the same bits vmapped or called on the
    whole `(seq, d)` array (its tensor scales cover everything in the call)."""
    return jax.vmap(linear)(x)


class Attention(eqx.Module):
    """Causal multi-head self-attention with rotary embeddings (no biases)."""

    wq: eqx.nn.Linear
    wk: eqx.nn.Linear
    wv: eqx.nn.Linear
    wo: eqx.nn.Linear
    n_heads: int = eqx.field(static=True)

    def __init__(self, d: int, n_heads: int, *, key: PRNGKeyArray):
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.wq = eqx.nn.Linear(d, d, use_bias=False, key=kq)
        self.wk = eqx.nn.Linear(d, d, use_bias=False, key=kk)
        self.wv = eqx.nn.Linear(d, d, use_bias=False, key=kv)
        self.wo = eqx.nn.Linear(d, d, use_bias=False, key=ko)
        self.n_heads = n_heads

    def __call__(self, x: Float[Array, "seq d"]) -> Float[Array, "seq d"]:
        seq, d = x.shape
        hd = d // self.n_heads

        def heads(linear):
            return per_token(linear, x).reshape(seq, self.n_heads, hd)

        q, k, v = rotary(heads(self.wq)), rotary(heads(self.wk)), heads(self.wv)
        scores = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        out = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v)
        return per_token(self.wo, out.reshape(seq, d))


class SwiGLU(eqx.Module):
    """`w_down(silu(w_gate x) * w_up x)`, the Llama MLP."""

    w_gate: eqx.nn.Linear
    w_up: eqx.nn.Linear
    w_down: eqx.nn.Linear

    def __init__(self, d: int, d_ff: int, *, key: PRNGKeyArray):
        kg, ku, kd = jax.random.split(key, 3)
        self.w_gate = eqx.nn.Linear(d, d_ff, use_bias=False, key=kg)
        self.w_up = eqx.nn.Linear(d, d_ff, use_bias=False, key=ku)
        self.w_down = eqx.nn.Linear(d_ff, d, use_bias=False, key=kd)

    def __call__(self, x: Float[Array, "seq d"]) -> Float[Array, "seq d"]:
        gate = jax.nn.silu(per_token(self.w_gate, x))
        return per_token(self.w_down, gate * per_token(self.w_up, x))


class Block(eqx.Module):
    """A pre-norm transformer block: `x + attn(norm(x))`, then `x + mlp(norm(x))`."""

    attn_norm: RMSNorm
    attn: Attention
    mlp_norm: RMSNorm
    mlp: SwiGLU

    def __init__(self, cfg: Config, *, key: PRNGKeyArray):
        ka, km = jax.random.split(key)
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = Attention(cfg.d_model, cfg.n_heads, key=ka)
        self.mlp_norm = RMSNorm(cfg.d_model)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_ff, key=km)

    def __call__(self, x: Float[Array, "seq d"]) -> Float[Array, "seq d"]:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(eqx.Module):
    """A byte-level Llama-style decoder. Linear layers sit at paths such as
    `blocks[3].attn.wq`, `blocks[3].mlp.w_gate` and `lm_head` (see `nvfp4x.summary`)."""

    embed: eqx.nn.Embedding
    blocks: list[Block]
    norm: RMSNorm
    lm_head: eqx.nn.Linear

    def __init__(self, cfg: Config, *, key: PRNGKeyArray):
        ke, kh, *kb = jax.random.split(key, cfg.n_layers + 2)
        self.embed = eqx.nn.Embedding(cfg.vocab, cfg.d_model, key=ke)
        self.blocks = [Block(cfg, key=k) for k in kb]
        self.norm = RMSNorm(cfg.d_model)
        self.lm_head = eqx.nn.Linear(cfg.d_model, cfg.vocab, use_bias=False, key=kh)

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        x = self.embed.weight[tokens]
        for block in self.blocks:
            x = block(x)
        return per_token(self.lm_head, self.norm(x))


def build_model(cfg: Config, key: PRNGKeyArray) -> Transformer:
    """The unquantised float32 model of `cfg`, initialised from `key`."""
    return Transformer(cfg, key=key)


def bf16_tail(n_layers: int, fraction: float = 0.15) -> int:
    """How many final blocks the paper's policy keeps in bf16: `round(fraction * n)`, at
    least 1 and at most `n - 1` (so that some block is in NVFP4)."""
    return min(max(1, round(fraction * n_layers)), n_layers - 1)


#: The layers a serving stack fuses into one GEMM with one tensor scale (q/k/v and
#: gate/up of each block): `nvfp4x.freeze` gives them a shared tensor scale when the
#: policy groups them, which `nvfp4x.export_hf` needs (see `paper_policy`).
FUSED_SCALE_GROUPS = (r"(.*)\.attn\.w[qkv]", r"(.*)\.mlp\.w_(gate|up)")


def paper_policy(
    cfg: Config,
    *,
    training: nvfp4x.Recipe | None = None,
    tensor_scale_groups: tuple[str, ...] = (),
) -> nvfp4x.Policy:
    """The NVFP4 paper's precision policy for this model: LM head untouched, the last ~15%
    of blocks in bf16, every other linear layer under `training` (by default
    `nvfp4x.recipes.nvfp4_training()`). `tensor_scale_groups` (e.g.
    `FUSED_SCALE_GROUPS`, for a model to export) is passed to `nvfp4x.Policy`: it changes
    what `nvfp4x.freeze` packs, not training."""
    training = nvfp4x.recipes.nvfp4_training() if training is None else training
    tail = bf16_tail(cfg.n_layers)
    last = "|".join(str(i) for i in range(cfg.n_layers - tail, cfg.n_layers))
    rules = [(r"lm_head", None)]
    if tail:
        rules.append((rf"blocks\[({last})\]\..*", nvfp4x.recipes.bf16()))
    rules.append((r".*", training))
    return nvfp4x.Policy(rules, tensor_scale_groups=tensor_scale_groups)


# --- data ---


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


# --- training ---


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


# --- deployment: a Hugging Face checkpoint that serving stacks read, and text from it ---


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


def generate(model: Any, cfg: Config, prompt: bytes, n: int) -> bytes:
    """`n` bytes after `prompt`, greedily: each step reads the last `cfg.seq` bytes (the
    context the model was trained on; a shorter prompt is left-padded with spaces) and
    appends the most likely next byte. One compiled forward for every step."""
    step = _next_byte(cfg.seq)
    text = bytearray(b" " * max(0, cfg.seq - len(prompt)) + prompt)
    for _ in range(n):
        window = np.frombuffer(bytes(text[-cfg.seq :]), np.uint8).astype(np.int32)
        text.append(int(step(model, window)))
    return bytes(text[-n:]) if n else b""


@functools.cache
def _next_byte(seq: int):
    del seq  # one compiled step per context length
    return eqx.filter_jit(lambda model, window: jnp.argmax(model(window)[-1]))


# --- outputs ---


def write_outputs(
    out: str, baseline: TrainResult, quant: TrainResult, *, title: str = ""
) -> tuple[str, str]:
    """Write `losses.csv` (step, baseline, nvfp4) and `loss_curves.png` (both curves, and
    the relative gap between them) to `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out, exist_ok=True)
    csv_path = os.path.join(out, "losses.csv")
    with open(csv_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "baseline", "nvfp4"])
        for i, (a, b) in enumerate(zip(baseline.losses, quant.losses, strict=True)):
            writer.writerow([i + 1, f"{a:.6f}", f"{b:.6f}"])

    steps = np.arange(1, len(baseline.losses) + 1)
    k = max(1, len(steps) // 25)  # moving average over ~4% of the run
    smooth = lambda v: np.convolve(v, np.ones(k) / k, mode="valid")
    fig, (ax, gap_ax) = plt.subplots(
        2, 1, figsize=(7, 5.6), dpi=120, sharex=True, gridspec_kw=dict(height_ratios=[2.2, 1])
    )
    for res, color, name in ((baseline, "C0", "float32 baseline"), (quant, "C3", "NVFP4 recipe")):
        ax.plot(steps, res.losses, color=color, alpha=0.2, lw=0.8)
        ax.plot(steps[k - 1 :], smooth(res.losses), color=color, lw=1.6, label=name)
    ax.set_ylabel("training loss (nats / byte)")
    ax.set_title(title or "float32 vs NVFP4 training", fontsize=10)
    lo = min(baseline.losses.min(), quant.losses.min())
    hi = np.percentile(np.concatenate([baseline.losses, quant.losses]), 95)
    ax.set_ylim(lo - 0.05 * (hi - lo), hi)
    ax.grid(alpha=0.3)
    ax.legend()
    gap = 100 * (quant.losses - baseline.losses) / baseline.losses
    gap_ax.axhline(0, color="0.5", lw=0.8)
    gap_ax.plot(steps, gap, color="C3", alpha=0.2, lw=0.8)
    gap_ax.plot(steps[k - 1 :], smooth(gap), color="C3", lw=1.6)
    gap_ax.set_ylabel("gap (%)")
    gap_ax.set_xlabel(f"step (thick lines: moving average over {k} steps)")
    gap_ax.grid(alpha=0.3)
    fig.tight_layout()
    png_path = os.path.join(out, "loss_curves.png")
    fig.savefig(png_path)
    plt.close(fig)
    return csv_path, png_path


def write_telemetry(out: str, records: list) -> tuple[str, str]:
    """Write `telemetry.csv` (step, layer, operand, statistics) and `telemetry.png` (each
    statistic per operand over steps, averaged over the quantised layers) to `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from nvfp4x._telemetry import OPERANDS, STATS

    os.makedirs(out, exist_ok=True)
    csv_path = os.path.join(out, "telemetry.csv")
    with open(csv_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "layer", "operand", *STATS])
        for step, table in enumerate(records, start=1):
            for layer, ops in table.items():
                for op in OPERANDS:
                    writer.writerow([step, layer, op, *(f"{float(ops[op][s]):.6g}" for s in STATS)])
    fig, axes = plt.subplots(2, 2, figsize=(9, 6), dpi=120, sharex=True)
    steps = np.arange(1, len(records) + 1)
    for ax, stat in zip(axes.ravel(), STATS, strict=True):
        for op in OPERANDS:
            series = [np.mean([float(t[layer][op][stat]) for layer in t]) for t in records]
            ax.plot(steps, series, label=op, lw=1.2)
        ax.set_title(stat, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0, 0].set_yscale("log")
    axes[0, 0].legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.suptitle("NVFP4 operand statistics, mean over quantised layers", fontsize=10)
    fig.tight_layout()
    png_path = os.path.join(out, "telemetry.png")
    fig.savefig(png_path)
    plt.close(fig)
    return csv_path, png_path


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


def generate_from(directory: str, prompt: str, n: int) -> bytes:
    """Read the checkpoint in `directory` and print `n` greedily generated bytes."""
    model, cfg = load_export(directory)
    text = generate(model, cfg, prompt.encode(), n)
    print(f"{directory}: {cfg.n_layers} blocks, d_model={cfg.d_model}; greedy continuation:")
    print(prompt + text.decode("utf-8", errors="replace"))
    return text


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    if args.generate_from is not None:
        generate_from(args.generate_from, args.prompt, args.generate)
        return {}
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


if __name__ == "__main__":
    main()
