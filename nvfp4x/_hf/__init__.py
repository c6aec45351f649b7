"""Checkpoints that serving stacks read: `export_hf` / `import_hf` write and read the
"unified Hugging Face checkpoint" of NVIDIA's Model Optimizer (safetensors files, tensor
names aligned with the original model's, `hf_quant_config.json`), which vLLM, SGLang and
TensorRT-LLM load for NVFP4.

Per NVFP4 linear layer `<name>` (docs page "Deploying NVFP4 models" has the sources):

- `<name>.weight`: uint8 `[out, in/2]`, two E2M1 codes per byte, element `2i` in the low
  nibble (nvfp4x's packing, unchanged);
- `<name>.weight_scale`: float8_e4m3fn `[out, in/16]`, one decode scale per 16 inputs,
  row-major and unswizzled (a 16x16 tile's scale is repeated over its 16 rows);
- `<name>.weight_scale_2`: float32 `[]`, the tensor decode scale (nvfp4x's
  `tensor_scale`, bit for bit);
- `<name>.input_scale`: float32 `[]`, the activations' static tensor decode scale
  (W4A4, `quant_algo: NVFP4`); absent for weights-only layers (`W4A16_NVFP4`).


The package, along its seams: `_names` (names maps), `_plan` (which leaf is written
under which name), `_safetensors` (the file format and its checksums), `_folder` (the
checkpoint folder), `_modelopt` (Model Optimizer's config), `_codecs` (one codec per
weight format, keyed by format name), `_export` and `_import`.
"""

from ._export import export_hf as export_hf
from ._import import import_hf as import_hf
from ._names import NameRules as NameRules, NamesLike as NamesLike, hf_names as hf_names
