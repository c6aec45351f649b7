"""A small NVFP4 training run that checkpoints with `nvfp4x.TrainingCheckpointer` and, when
started again on the same folder, resumes from its last checkpoint.

`tests/test_checkpoint.py` runs it as a script, kills it with SIGKILL, runs it again to
resume, and compares the result (its last checkpoint) with a run never stopped:

```bash
python tests/resumable_training.py DIR [--sleep SECONDS]
```

Everything a step depends on is in the checkpointed state: the quantised model (NVFP4
training recipe: stochastic rounding and the random Hadamard transform on), Adam's
state, the step, the data position, a PRNG key (input noise) and the loss history.
"""

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import nvfp4x

STEPS = 30
EVERY = 4  # checkpoint every EVERY steps
BATCH = 16
FEATURES = 32

_rng = np.random.default_rng(0)
DATA_X = _rng.standard_normal((200, FEATURES)).astype(np.float32)
DATA_Y = np.tanh(DATA_X @ _rng.standard_normal((FEATURES, 16)).astype(np.float32))


def optimizer() -> optax.GradientTransformation:
    return optax.adam(3e-3)


def initial_state() -> dict:
    mlp = eqx.nn.MLP(FEATURES, 16, 64, 1, key=jax.random.key(0))
    model = nvfp4x.quantize(mlp, nvfp4x.recipes.nvfp4_training())
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes weak and strong types
        opt_state = optimizer().init(eqx.filter(model, eqx.is_inexact_array))
    return {
        "model": model,
        "opt_state": opt_state,
        "step": 0,
        "position": 0,  # the next batch's first row
        "key": jax.random.key(1),
        "losses": np.full(STEPS, np.nan, np.float32),
    }


@eqx.filter_jit
def train_step(model, opt_state, x, y, key):
    def loss_fn(m):
        noisy = x + 0.05 * jax.random.normal(key, x.shape)
        return jnp.mean(jnp.square(jax.vmap(m)(noisy) - y))

    with jax.numpy_dtype_promotion("standard"):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optimizer().update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), opt_state, loss


def step(state: dict) -> dict:
    rows = (state["position"] + np.arange(BATCH)) % len(DATA_X)
    key, noise = jax.random.split(state["key"])
    model, opt_state, loss = train_step(
        state["model"], state["opt_state"], DATA_X[rows], DATA_Y[rows], noise
    )
    losses = state["losses"].copy()
    losses[state["step"]] = float(loss)
    return {
        "model": model,
        "opt_state": opt_state,
        "step": state["step"] + 1,
        "position": int((state["position"] + BATCH) % len(DATA_X)),
        "key": key,
        "losses": losses,
    }


def run(directory: str, *, sleep: float = 0.0) -> dict:
    """Train to `STEPS`, resuming from the last checkpoint in `directory` if any."""
    state = initial_state()
    with nvfp4x.TrainingCheckpointer(directory) as ckpt:
        if ckpt.latest_step() is not None:
            state = ckpt.restore(state)
            print(f"resumed from step {state['step']}", flush=True)
        while state["step"] < STEPS:
            state = step(state)
            if state["step"] % EVERY == 0 or state["step"] == STEPS:
                ckpt.save(state["step"], state)
            time.sleep(sleep)
    return state


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds after each step")
    args = parser.parse_args()
    run(args.directory, sleep=args.sleep)
    print("finished")
