"""`python -m MaxText.convert.orbax_to_hf --checkpoint OUT --out DIR`: our checkpoint to Hugging Face safetensors.

  OUT/model_config.yml (or --model-config) -> the HF tensor list (layout.py), every
  stored leaf checked against it -> shards of at most --max-shard-size, each written
  tensor by tensor from slices of our leaves (read through tensorstore) -> config.json
  (the source config.json where the checkpoint kept one, its mapped fields rewritten)
  and model.safetensors.index.json when there is more than one shard.

Works on a converted checkpoint or a training checkpoint step (with --model-config).
`--dtype auto` writes each tensor in its stored dtype, so HF -> ours -> HF gives
back the same bytes; the routing bias is written as float32, as transformers keeps it.
MTP modules are written as the release lays them out, embed_tokens and
shared_head.head included. DIR appears only when complete.
"""

import json
import math
import re
from pathlib import Path
from typing import NamedTuple

import ml_dtypes  # noqa: F401  (registers bfloat16 and float8 with NumPy)
import numpy as np

from MaxText.config import load_config
from MaxText.convert import checkpoint, hf_config, layout, safetensors_io
from MaxText.convert.cli import ArgumentParser, check_new, staged_dir
from MaxText.errors import UserError, exit_on_user_error

DTYPES = ("auto", "float32", "bfloat16", "float16")


def parse(argv: list[str]):
  p = ArgumentParser(prog="python -m MaxText.convert.orbax_to_hf", description=__doc__.split("\n")[0])
  p.add_argument("--checkpoint", required=True, help="a converted checkpoint (OUT) or a training checkpoint step")
  p.add_argument("--out", required=True, help="new directory for config.json and the safetensors shards")
  p.add_argument("--dtype", default="auto", choices=DTYPES, help="tensor dtype; auto keeps each stored one (default)")
  p.add_argument(
    "--max-shard-size", default="5GB", help="largest shard, e.g. 5GB or 500MB (a bigger tensor gets a shard of its own)"
  )
  p.add_argument("--model-config", default="", help="model config YAML (default: the checkpoint's model_config.yml)")
  return p.parse_args(argv)


def parse_size(text: str) -> int:
  m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", text.upper())
  if not m or float(m.group(1)) <= 0:
    raise UserError(f"--max-shard-size {text!r} must be a positive size such as 5GB or 500MB")
  return int(float(m.group(1)) * 1000 ** "_KMGT".index(m.group(2) or "_"))


class Tensor(NamedTuple):
  name: str
  dtype: np.dtype
  shape: tuple[int, ...]
  entry: layout.Entry

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * self.dtype.itemsize


def split(tensors: list[Tensor], max_bytes: int) -> dict[str, list[Tensor]]:
  """Shard file name -> its tensors, in order, each shard at most max_bytes (or one bigger tensor)."""
  shards, size = [[]], 0
  for t in tensors:
    if shards[-1] and size + t.nbytes > max_bytes:
      shards.append([])
      size = 0
    shards[-1].append(t)
    size += t.nbytes
  if len(shards) == 1:
    return {"model.safetensors": shards[0]}
  return {f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors": shard for i, shard in enumerate(shards)}


def check_leaves(stored: dict, shapes: dict, where: str) -> None:
  for leaf, shape in shapes.items():
    name = ".".join(leaf)
    if not math.prod(shape):
      continue  # empty leaves (no MTP: its bias) are not stored
    if name not in stored:
      raise UserError(f"checkpoint {where} has no {'/'.join(leaf)}, which its model config needs")
    if stored[name][0] != shape:
      raise UserError(
        f"checkpoint {where}: {'/'.join(leaf)} has shape {list(stored[name][0])}, "
        f"its model config implies {list(shape)}"
      )


def main(argv: list[str]) -> int:
  args = parse(argv)
  out, max_bytes = Path(args.out), parse_size(args.max_shard_size)
  check_new(out, "--out")
  state = checkpoint.state_dir(args.checkpoint)
  cfg = load_config(checkpoint.model_config_path(args.checkpoint, args.model_config))
  m, moe = cfg.model, cfg.moe
  base_path = Path(args.checkpoint) / checkpoint.HF_CONFIG
  base = json.loads(base_path.read_text()) if base_path.is_file() else None
  stored, shapes = checkpoint.stored_leaves(state), layout.leaf_shapes(m, moe)
  check_leaves(stored, shapes, args.checkpoint)

  tensors = []
  for e in layout.entries(m, moe, hf_config.rope_interleave(base)):
    if e.leaf[0] == "bias":
      dtype = np.dtype(np.float32)
    else:
      dtype = stored[".".join(e.leaf)][1] if args.dtype == "auto" else np.dtype(args.dtype)
    tensors.append(Tensor(e.hf_name, dtype, layout.hf_shape(e, shapes), e))
  by_name = {t.name: t for t in tensors}
  reader = checkpoint.LeafReader(state)

  def produce(name: str) -> np.ndarray:
    t = by_name[name]
    return np.ascontiguousarray(
      t.entry.transform.to_hf(reader.read(".".join(t.entry.leaf), t.entry.index)), dtype=t.dtype
    )

  shards = split(tensors, max_bytes)
  config_dtype = args.dtype if args.dtype != "auto" else str(stored["params.embed"][1])
  with staged_dir(out, "--out") as tmp:
    for file, part in shards.items():
      safetensors_io.write_file(tmp / file, [(t.name, t.dtype, t.shape) for t in part], produce)
    if len(shards) > 1:
      index = {
        "metadata": {"total_size": sum(t.nbytes for t in tensors)},
        "weight_map": {t.name: file for file, part in shards.items() for t in part},
      }
      (tmp / safetensors_io.INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    config = hf_config.from_model_config(m, moe, base, config_dtype)
    (tmp / hf_config.CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
  dtypes = sorted({str(t.dtype) for t in tensors if t.entry.leaf[0] == "params"})
  print(f"wrote {len(tensors)} tensors ({'/'.join(dtypes)}) in {len(shards)} shard(s) -> {out}")
  return 0


if __name__ == "__main__":
  raise SystemExit(exit_on_user_error(main)())
