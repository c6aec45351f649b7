"""The example's settings: `Config` and the tiny `SMOKE` configuration."""

import dataclasses
import math


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
