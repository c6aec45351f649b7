"""The main example as a package: a small Llama-style byte-level language model, its data,
training under a precision policy, and its export as a Hugging Face NVFP4 checkpoint.

`examples/train_lm.py` is its command line (`nvfp4_lm.cli.main`); the benchmarks and
tests import the package. Importing it has no side effects, so other scripts can reuse
its pieces:

```python
import nvfp4_lm                                   # with examples/ on sys.path
cfg = nvfp4_lm.Config(steps=200)
data = nvfp4_lm.load_data(cfg)
model = nvfp4_lm.build_model(cfg, jax.random.key(cfg.seed))
result = nvfp4_lm.train(nvfp4x.quantize(model, some_policy), cfg, data, label="mine")
```

Modules: `config` (`Config`, `SMOKE`), `model` (the transformer, `paper_policy`), `data`
(the corpus and its windows), `training` (loss, optimiser, `train`), `deploy` (Hugging
Face export, generation), `outputs` (CSV files and plots), `cli` (the command line).
"""

from .config import SMOKE as SMOKE, Config as Config
from .data import (
    Data as Data,
    batch_starts as batch_starts,
    load_data as load_data,
    stdlib_files as stdlib_files,
    windows as windows,
)
from .deploy import (
    Bf16Linear as Bf16Linear,
    bf16_twin as bf16_twin,
    calibrate_input_amax as calibrate_input_amax,
    config_from_hf as config_from_hf,
    export as export,
    generate as generate,
    generation_speed as generation_speed,
    hf_config as hf_config,
    load_export as load_export,
)
from .model import (
    FUSED_SCALE_GROUPS as FUSED_SCALE_GROUPS,
    Attention as Attention,
    Block as Block,
    RMSNorm as RMSNorm,
    SwiGLU as SwiGLU,
    Transformer as Transformer,
    bf16_tail as bf16_tail,
    build_model as build_model,
    paper_policy as paper_policy,
    per_token as per_token,
    rotary as rotary,
)
from .outputs import write_outputs as write_outputs, write_telemetry as write_telemetry
from .training import (
    TrainResult as TrainResult,
    eval_loss as eval_loss,
    evaluate as evaluate,
    gemm_coverage as gemm_coverage,
    loss_fn as loss_fn,
    make_optimizer as make_optimizer,
    train as train,
    train_step as train_step,
    train_step_telemetry as train_step_telemetry,
)
