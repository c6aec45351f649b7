"""Custom policies: which layer gets which recipe, and recipes with changed options.

```bash
python examples/custom_policy.py
python examples/custom_policy.py --smoke
```

A policy maps each `eqx.nn.Linear` of a model, by its path (`encoder.layers[0]`,
`attn.query_proj`, ...), to a recipe, or to `None` to leave it alone. It can be:

- one recipe (or recipe name) for every layer;
- an `nvfp4x.Policy` of ordered `(regex, recipe | None)` rules, first full match wins;
- any callable `(path, linear) -> recipe | None`.
"""

import argparse
import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

import nvfp4x


class Classifier(eqx.Module):
    """An MLP encoder, a self-attention layer over the tokens and a linear head."""

    encoder: eqx.nn.MLP
    attn: eqx.nn.MultiheadAttention
    head: eqx.nn.Linear

    def __init__(self, d: int = 64, n_classes: int = 10, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.encoder = eqx.nn.MLP(d, d, width_size=4 * d, depth=2, key=k1)
        self.attn = eqx.nn.MultiheadAttention(num_heads=4, query_size=d, key=k2)
        self.head = eqx.nn.Linear(d, n_classes, key=k3)

    def __call__(self, x: Float[Array, "tokens d"]) -> Float[Array, " n_classes"]:
        h = jax.vmap(self.encoder)(x)
        h = h + self.attn(h, h, h)
        return self.head(jnp.mean(h, axis=0))


def loss_and_grads(
    model: eqx.Module, x: Float[Array, "batch tokens d"], labels: Array
) -> tuple[Float[Array, ""], eqx.Module]:
    """Cross-entropy of the batch and its gradient with respect to the master weights."""

    def loss_fn(model):
        logits = jax.vmap(model)(x)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))

    return eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(model)


def show(title: str, qmodel: eqx.Module, x: Array, labels: Array, *, grads: bool) -> None:
    """Print the summary of `qmodel` and its loss (and whether its gradients are finite)."""
    if grads:
        loss, g = loss_and_grads(qmodel, x, labels)
        leaves = jax.tree.leaves(eqx.filter(g, eqx.is_array))
        finite = all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in leaves)
        print(f"\n== {title}  (loss {float(loss):.4f}, finite gradients: {finite})")
    else:  # --smoke: the forward pass only (compiling the backward takes a while on CPU)
        loss = eqx.filter_jit(lambda m: jnp.mean(jax.vmap(m)(x)))(qmodel)
        print(f"\n== {title}  (mean logit {float(loss):.4f})")
    print(nvfp4x.summary(qmodel))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="nvfp4x policies and recipes.")
    parser.add_argument("--smoke", action="store_true", help="small inputs, forward only")
    args = parser.parse_args(argv)
    batch, tokens = (4, 16) if args.smoke else (32, 64)
    grads = not args.smoke

    kmodel, kx, ky = jax.random.split(jax.random.key(0), 3)
    model = Classifier(key=kmodel)
    x = jax.random.normal(kx, (batch, tokens, 64))
    labels = jax.random.randint(ky, (batch,), 0, 10)

    # 1. Rules by path. Paths are attribute names joined by dots, sequence indices in
    #    brackets, exactly as `nvfp4x.summary` prints them. Regexes use `re.fullmatch`.
    training = nvfp4x.recipes.nvfp4_training()
    policy = nvfp4x.Policy(
        [
            (r"head", None),  # leave the classifier head as eqx.nn.Linear
            (r"attn\..*", nvfp4x.recipes.bf16()),  # attention projections in bf16
            (r"encoder\.layers\[0\]", training.replace(rht=False)),  # a changed option
            (r".*", training),  # everything else: the full NVFP4 recipe
        ]
    )
    print(policy)
    show("rules by path", nvfp4x.quantize(model, policy), x, labels, grads=grads)

    # A rule that matches no layer is almost always a typo: `quantize` says which one.
    try:
        nvfp4x.quantize(model, nvfp4x.Policy([(r"encoder\.layer\[0\]", training)]))
    except ValueError as e:
        print(f"\nA typo in a rule raises: {e}")

    # 2. A callable policy: decide from the layer itself (here, its size).
    def by_size(path: str, linear: eqx.nn.Linear) -> nvfp4x.Recipe | None:
        if linear.out_features == "scalar" or linear.out_features < 16:
            return None  # too small to be worth quantising (the 10-way head)
        return training

    show("callable policy (by size)", nvfp4x.quantize(model, by_size), x, labels, grads=grads)

    # 3. Recipes with changed options. Recipes are frozen, hashable dataclasses.
    no_rht = nvfp4x.recipes.nvfp4_training(rht=False)
    rtn = nvfp4x.recipes.nvfp4_training(stochastic_rounding=False)
    w1x16 = nvfp4x.recipes.nvfp4_training(weight_block=(1, 16))
    # `Recipe.replace` (or `dataclasses.replace`) changes any field; here dy in MXFP8.
    mx_grads = training.replace(grad=nvfp4x.Format("mxfp8"), name="nvfp4_w_x+mxfp8_dy")
    # Or build one from scratch: NVFP4 weights, activations left in their own dtype.
    w4a16 = nvfp4x.Recipe(
        weight=nvfp4x.Format("nvfp4", block=(16, 16)), input=None, grad=None, name="w4a16"
    )
    assert dataclasses.replace(no_rht, rht=True) == training  # plain values: equal, hashable
    for recipe in (no_rht, rtn, w1x16, mx_grads, w4a16):
        print(recipe)

    policy = nvfp4x.Policy(
        [
            (r"head", None),
            (r"attn\.(query|key)_proj", rtn),
            (r"attn\..*", mx_grads),
            (r"encoder\.layers\[0\]", w1x16),
            (r"encoder\.layers\[1\]", w4a16),
            (r".*", no_rht),
        ]
    )
    qmodel = nvfp4x.quantize(model, policy)
    show("recipes with changed options", qmodel, x, labels, grads=grads)

    # 4. Undo: the plain model with the same master weights.
    assert eqx.tree_equal(nvfp4x.dequantize(qmodel), model)
    print("\nnvfp4x.dequantize(qmodel) == model: True")


if __name__ == "__main__":
    main()
