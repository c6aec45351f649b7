"""The model: a byte-level Llama-style decoder (one sequence in, logits out; `jax.vmap`
it over a batch), and the NVFP4 paper's precision policy for it."""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

import nvfp4x

from .config import Config

#: A layer's key-value cache: keys and values `(window, heads, head_dim)`, a ring buffer.
KVCache = tuple[Array, Array]


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


def rotary(
    x: Float[Array, "seq heads hd"], base: float = 10_000.0, start: Any = 0
) -> Float[Array, "seq heads hd"]:
    """Rotary position embedding (rotate-half form) along the head dimension, the tokens
    at positions `start, start + 1, ...` (`start` may be traced: a decoding step's)."""
    seq, _, hd = x.shape
    inv_freq = 1.0 / base ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
    position = jnp.arange(seq, dtype=jnp.float32) + jnp.asarray(start, jnp.float32)
    angle = position[:, None] * inv_freq[None, :]
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

    def __call__(
        self, x: Float[Array, "seq d"], window: int | None = None
    ) -> Float[Array, "seq d"]:
        return self.prefill(x, window)[0]

    def _qkv(self, x: Float[Array, "seq d"], start: Any = 0) -> tuple[Array, Array, Array]:
        seq, d = x.shape
        hd = d // self.n_heads

        def heads(linear):
            return per_token(linear, x).reshape(seq, self.n_heads, hd)

        q, k = rotary(heads(self.wq), start=start), rotary(heads(self.wk), start=start)
        return q, k, heads(self.wv)

    def _attend(self, q, k, v, mask=None) -> Float[Array, "seq d"]:
        seq, heads, hd = q.shape
        scores = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        if mask is not None:
            scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        out = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v)
        return per_token(self.wo, out.reshape(seq, heads * hd))

    def prefill(
        self, x: Float[Array, "seq d"], window: int | None = None
    ) -> tuple[Float[Array, "seq d"], KVCache]:
        """The causal attention of `x` (positions from 0; `window`: each token attending
        to the last `window` tokens only, itself included) and its keys and values, the
        cache `decode` continues from."""
        q, k, v = self._qkv(x)
        i = jnp.arange(x.shape[0])
        mask = i[:, None] >= i[None, :]
        if window is not None:
            mask = mask & (i[:, None] - i[None, :] < window)
        return self._attend(q, k, v, mask), (k, v)

    def decode(
        self, x: Float[Array, "1 d"], pos: Any, cache: KVCache
    ) -> tuple[Float[Array, "1 d"], KVCache]:
        """One token at position `pos` (at least the cache's length) attending to itself
        and the cache's other tokens, a ring buffer of the last `window` keys and values
        (their order does not matter): the token's key and value replace the oldest, at
        `pos % window`. Sliding-window attention: `prefill(x, window)`'s last row, for
        `x` every token so far."""
        q, k, v = self._qkv(x, start=pos)
        slot = pos % cache[0].shape[0]
        keys, values = cache[0].at[slot].set(k[0]), cache[1].at[slot].set(v[0])
        return self._attend(q, keys, values), (keys, values)


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

    def __call__(
        self, x: Float[Array, "seq d"], window: int | None = None
    ) -> Float[Array, "seq d"]:
        return self.prefill(x, window)[0]

    def prefill(
        self, x: Float[Array, "seq d"], window: int | None = None
    ) -> tuple[Float[Array, "seq d"], KVCache]:
        """`self(x, window)` and its attention's keys and values (`Attention.prefill`)."""
        a, cache = self.attn.prefill(self.attn_norm(x), window)
        x = x + a
        return x + self.mlp(self.mlp_norm(x)), cache

    def decode(self, x: Float[Array, "1 d"], pos: Any, cache: KVCache):
        """One token at position `pos` with its attention's cache (`Attention.decode`)."""
        a, cache = self.attn.decode(self.attn_norm(x), pos, cache)
        x = x + a
        return x + self.mlp(self.mlp_norm(x)), cache


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

    def __call__(
        self, tokens: Int[Array, " seq"], window: int | None = None
    ) -> Float[Array, "seq vocab"]:
        """Every token's next-byte logits; `window`: sliding-window attention (each
        token attends to the last `window` tokens, itself included), which a
        key-value-cached decode computes (`prefill`, `decode`)."""
        x = self.embed.weight[tokens]
        for block in self.blocks:
            x = block(x, window)
        return per_token(self.lm_head, self.norm(x))

    def prefill(self, tokens: Int[Array, " seq"]) -> tuple[Float[Array, " vocab"], list[KVCache]]:
        """The last token's logits and every block's keys and values for `tokens`
        (positions from 0): the start of a key-value-cached decode (`decode`), whose
        window is `len(tokens)` tokens."""
        x, caches = self.embed.weight[tokens], []
        for block in self.blocks:
            x, cache = block.prefill(x)
            caches.append(cache)
        return per_token(self.lm_head, self.norm(x[-1:]))[0], caches

    def decode(
        self, token: Int[Array, ""], pos: Any, caches: list[KVCache]
    ) -> tuple[Float[Array, " vocab"], list[KVCache]]:
        """The logits after `token` at position `pos` (the first after `prefill`'s
        tokens is their count), every layer's GEMMs on one token, attention over the
        last `window` tokens (the cache's length, this one included), and the caches
        with its keys and values in place of the oldest: `self(tokens, window)[-1]` for
        `tokens` every token so far, up to float32 rounding (for a model whose
        activations are quantised per call, W4A4, each step's own tensor scales)."""
        x, new = self.embed.weight[token][None], []
        for block, cache in zip(self.blocks, caches, strict=True):
            x, cache = block.decode(x, pos, cache)
            new.append(cache)
        return per_token(self.lm_head, self.norm(x))[0], new


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
