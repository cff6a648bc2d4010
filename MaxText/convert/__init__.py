"""Hugging Face DeepSeek-V3 checkpoints in and out of our parameter layout.

  python -m MaxText.convert.hf_to_orbax --hf-dir DIR --out OUT   safetensors + config.json -> OUT
  python -m MaxText.convert.orbax_to_hf --checkpoint OUT --out DIR   and back
  python -m MaxText.score --checkpoint OUT --input-ids ids.npy --output logits.npy

OUT holds model_config.yml (a recipe's `model_config:`), the source config.json
and state/, an orbax checkpoint of {"params", "bias"} that training starts from
with `load_parameters_path=OUT` (`checkpoint.load_params`, `checkpoint.load_bias`).

  hf_config.py       config.json <-> our model keys
  layout.py          which HF tensor is which slice of which of our leaves, and its transform
  safetensors_io.py  reading and writing safetensors one tensor at a time
  fp8.py             dequantising the release's block-scaled FP8 weights
  checkpoint.py      OUT's layout, the streamed orbax writer, the loaders
  cli.py             one-line argument errors, all-or-nothing outputs
"""
