"""`python -m MaxText.score --checkpoint OUT --input-ids ids.npy --output logits.npy`: a checkpoint's logits.

Loads the checkpoint's model config (OUT/model_config.yml as written by
MaxText.convert.hf_to_orbax, or --model-config), its parameters and routing
bias, and writes the float32 logits [batch, seq, vocab] of an integer token-id
array [batch, seq], computed in float32 on one device (dot-product attention,
the dropless MoE, XLA grouped GEMM), positions 0..seq-1 in every row. The MTP
modules do not change these logits and are not run. This is what the parity
tests compare with transformers' DeepseekV3ForCausalLM.
"""

from pathlib import Path

import numpy as np

from MaxText.config import load_config
from MaxText.convert.cli import ArgumentParser, check_writable, staged_file
from MaxText.errors import UserError, exit_on_user_error

# Scoring is exact float32 inference whatever the training recipe chose.
FLOAT32_INFERENCE = (
  "dtype=float32",
  "weight_dtype=float32",
  "logits_dot_in_fp32=true",
  "attention=dot_product",
  "moe_dispatch=sort",
  "capacity_factor=-1",
  "moe_gmm_backend=xla",
  "remat_policy=none",
)


def parse(argv: list[str]):
  p = ArgumentParser(prog="python -m MaxText.score", description=__doc__.split("\n")[0])
  p.add_argument("--checkpoint", required=True, help="a converted checkpoint (OUT) or a training checkpoint step")
  p.add_argument("--input-ids", required=True, help=".npy of integer token ids [batch, seq]")
  p.add_argument("--output", required=True, help=".npy to write float32 logits [batch, seq, vocab] to")
  p.add_argument("--model-config", default="", help="model config YAML (default: the checkpoint's model_config.yml)")
  return p.parse_args(argv)


def read_ids(path: Path, vocab_size: int) -> np.ndarray:
  if not path.is_file():
    raise UserError(f"--input-ids {path} does not exist")
  try:
    ids = np.load(path, allow_pickle=False)
  except (ValueError, OSError) as e:
    raise UserError(f"--input-ids {path} is not a .npy array: {e}") from None
  if ids.ndim != 2 or 0 in ids.shape:
    raise UserError(f"--input-ids {path} has shape {list(ids.shape)}; it must be [batch, seq] with both > 0")
  if not np.issubdtype(ids.dtype, np.integer):
    raise UserError(f"--input-ids {path} holds {ids.dtype}; token ids must be integers")
  if ids.min() < 0 or ids.max() >= vocab_size:
    raise UserError(
      f"--input-ids {path} has ids in [{ids.min()}, {ids.max()}], outside the vocabulary [0, {vocab_size})"
    )
  return ids.astype(np.int32)


def logits(checkpoint: str | Path, cfg, ids: np.ndarray) -> np.ndarray:
  """float32 logits [batch, seq, vocab] of `ids` under checkpoint's weights, for a float32 `cfg`."""
  import jax
  import jax.numpy as jnp

  from MaxText import model, params
  from MaxText.convert.checkpoint import load_bias, load_params
  from MaxText.sharding import Sharder

  specs = model.model_specs(cfg.model, cfg.moe)
  specs.pop("mtp_layers", None)
  p = load_params(checkpoint, params.abstract(specs, jnp.float32))
  bias = load_bias(checkpoint, jax.eval_shape(lambda: model.bias_state(cfg.model, cfg.moe)))
  batch = model.Batch(jnp.asarray(ids), jnp.zeros_like(ids), jnp.zeros(ids.shape, jnp.float32))

  @jax.jit
  def run(p, bias, batch):
    return model.forward(p, bias, batch, cfg.model, cfg.moe, Sharder())[2]

  return np.asarray(run(p, bias, batch), np.float32)


def main(argv: list[str]) -> int:
  from MaxText.convert.checkpoint import model_config_path, state_dir

  args = parse(argv)
  check_writable(Path(args.output), "--output")  # every input checked before anything is computed or written
  state_dir(args.checkpoint)
  cfg = load_config(model_config_path(args.checkpoint, args.model_config), FLOAT32_INFERENCE)
  ids = read_ids(Path(args.input_ids), cfg.model.vocab_size)
  out = Path(args.output)
  with staged_file(out, "--output") as tmp:
    result = logits(args.checkpoint, cfg, ids)
    with open(tmp, "wb") as f:
      np.save(f, result)
  print(f"logits {list(result.shape)} float32 -> {out}")
  return 0


if __name__ == "__main__":
  raise SystemExit(exit_on_user_error(main)())
