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
python examples/train_lm.py --time-generation --d-model 2048 --layers 8   # decode speed
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

The code is the package next to this script, `examples/nvfp4_lm` (model, data, training,
export; `nvfp4_lm/cli.py` is this command line), which the benchmarks and tests import:
`import nvfp4_lm` with `examples/` on `sys.path`.
"""

from nvfp4_lm.cli import main

if __name__ == "__main__":
    main()
