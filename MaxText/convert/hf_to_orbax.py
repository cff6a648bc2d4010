"""`python -m MaxText.convert.hf_to_orbax --hf-dir DIR --out OUT`: a Hugging Face DeepSeek-V3 checkpoint to ours.

  DIR/config.json -> our model keys (OUT/model_config.yml, validated by load_config)
  -> every tensor's name, shape and dtype checked against that config (shard headers only)
  -> OUT/state written leaf by leaf and slice by slice: each slice read from its shard,
     FP8 dequantised (fp8.py), laid out our way (layout.py) and cast.

Host memory stays near the largest tensor. OUT appears only when complete; any
error is one line and exit code 2, before anything is written. `--dtype auto`
keeps each tensor's stored precision (FP8 weights dequantise to the config's
dtype, bfloat16 in the release); the routing bias is always float32.
"""

import math
import shutil
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 and float8 with NumPy)
import numpy as np
import yaml

from MaxText.config import Config, load_config
from MaxText.convert import checkpoint, fp8, hf_config, layout
from MaxText.convert.cli import ArgumentParser, check_new, staged_dir
from MaxText.convert.safetensors_io import ShardedCheckpoint
from MaxText.errors import UserError, exit_on_user_error

DTYPES = ("auto", "float32", "bfloat16", "float16")
FLOATS = ("float64", "float32", "bfloat16", "float16")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some exporters save; recomputed from the config


def parse(argv: list[str]):
  p = ArgumentParser(prog="python -m MaxText.convert.hf_to_orbax", description=__doc__.split("\n")[0])
  p.add_argument("--hf-dir", required=True, help="directory with config.json and *.safetensors")
  p.add_argument("--out", required=True, help="new directory for the converted checkpoint")
  p.add_argument("--dtype", default="auto", choices=DTYPES, help="parameter dtype; auto keeps each tensor's (default)")
  p.add_argument("--skip-mtp", action="store_true", help="leave out the multi-token-prediction layers")
  p.add_argument(
    "--model-name", default="", help="model_name in the written model config (default: the directory name)"
  )
  return p.parse_args(argv)


def mtp_layers(hf: dict, shards: ShardedCheckpoint, skip: bool) -> tuple[int, str]:
  """How many MTP modules to convert, and what to say about it."""
  wanted = hf.get("num_nextn_predict_layers") or 0
  present = {layout.mtp_layer_index(n, hf_config.field(hf, "num_hidden_layers")) for n in shards.tensors} - {None}
  if skip:
    return 0, "MTP layers skipped (--skip-mtp)"
  if wanted and not present:
    # transformers' save_pretrained keeps num_nextn_predict_layers but never saves the MTP weights.
    return 0, f"config.json names {wanted} MTP layer(s) but the shards hold none: converted without MTP"
  return wanted, f"{wanted} MTP layer(s) mapped to mtp_layers" if wanted else "no MTP layers"


def _dequant_dtype(hf: dict) -> np.dtype:
  """FP8 weights dequantise to the checkpoint's declared dtype (bfloat16 in the release)."""
  name = hf.get("dtype") or hf.get("torch_dtype")
  return np.dtype(name if name in DTYPES[1:] else "bfloat16")


class Conversion:
  """The checked plan: which tensor fills which slice, in which dtype; `tree()` streams it."""

  def __init__(self, hf: dict, shards: ShardedCheckpoint, cfg: Config, dtype: str, mtp_skipped: bool):
    self.shards, self.m, self.moe = shards, cfg.model, cfg.moe
    self.block = fp8.block_size(hf)
    self.fp8_to = _dequant_dtype(hf) if dtype == "auto" else np.dtype(dtype)
    self.shapes = layout.leaf_shapes(self.m, self.moe)
    all_entries = layout.entries(self.m, self.moe, hf_config.rope_interleave(hf))
    self.aliases = [e for e in all_entries if e.alias and e.hf_name in shards]
    self.by_leaf: dict[tuple, list[layout.Entry]] = {leaf: [] for leaf in self.shapes}
    for e in all_entries:
      if not e.alias:
        self.by_leaf[e.leaf].append(e)
    self._check_names(all_entries, hf, mtp_skipped)
    self._check_tensors(all_entries)
    self.dtypes = {leaf: self._leaf_dtype(leaf, dtype) for leaf in self.shapes}

  def _check_names(self, all_entries, hf, mtp_skipped):
    expected = {e.hf_name for e in all_entries}
    missing = [e.hf_name for e in all_entries if not e.alias and e.hf_name not in self.shards]
    if missing:
      more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
      in_mtp = layout.mtp_layer_index(missing[0], self.m.base_num_decoder_layers) is not None
      hint = "; convert with --skip-mtp to leave the MTP layers out" if in_mtp else ""
      raise UserError(
        f"tensor {missing[0]} is missing from {self.shards.directory}{more}; config.json says it should be there{hint}"
      )
    scales = {fp8.scale_name(n) for n in expected if n in self.shards and fp8.is_fp8(self.shards.tensors[n].dtype)}
    for name, info in self.shards.tensors.items():
      skipped_mtp = mtp_skipped and layout.mtp_layer_index(name, self.m.base_num_decoder_layers) is not None
      if (
        name in expected
        or name in scales
        or skipped_mtp
        or name.endswith(IGNORED_SUFFIXES)
        or not math.prod(info.shape)
      ):
        continue
      if layout.mtp_layer_index(name, self.m.base_num_decoder_layers) is not None:
        raise UserError(
          f"unexpected tensor {name} in {info.file.name}: its layer is beyond "
          "num_hidden_layers + num_nextn_predict_layers "
          f"({self.m.base_num_decoder_layers} + {self.m.mtp_num_layers}) in config.json; "
          "--skip-mtp leaves MTP layers out"
        )
      raise UserError(
        f"unexpected tensor {name} in {info.file.name}: not part of a DeepSeek-V3 checkpoint with this config.json"
      )

  def _check_tensors(self, all_entries):
    for e in all_entries:
      if e.alias and e.hf_name not in self.shards:
        continue
      info = self.shards.tensors[e.hf_name]
      want = layout.hf_shape(e, self.shapes)
      if info.shape != want:
        raise UserError(
          f"tensor {e.hf_name} in {info.file.name} has shape {list(info.shape)}, but config.json implies {list(want)}"
        )
      if info.dtype.name not in FLOATS and not fp8.is_fp8(info.dtype):
        raise UserError(f"tensor {e.hf_name} in {info.file.name} has dtype {info.dtype}, not a floating-point type")
      if fp8.is_fp8(info.dtype):
        scale = fp8.scale_name(e.hf_name)
        if scale not in self.shards:
          raise UserError(f"tensor {e.hf_name} is float8 but its block scales {scale} are missing")
        want_scale = fp8.scale_shape(info.shape, self.block)
        if self.shards.tensors[scale].shape != want_scale:
          got = list(self.shards.tensors[scale].shape)
          raise UserError(
            f"{scale} has shape {got}, but blocks of {list(self.block)} over {list(info.shape)} need {list(want_scale)}"
          )

  def _leaf_dtype(self, leaf, dtype: str) -> np.dtype:
    if leaf[0] == "bias":
      return np.dtype(np.float32)
    if dtype != "auto":
      return np.dtype(dtype)
    stored = {
      self.fp8_to if fp8.is_fp8(d) else d for d in (self.shards.tensors[e.hf_name].dtype for e in self.by_leaf[leaf])
    }
    return stored.pop() if len(stored) == 1 else np.dtype(np.float32)  # mixed: float32 holds each exactly

  def check_aliases(self) -> None:
    """An MTP module's embed_tokens / shared_head.head must equal the main ones: ours shares them."""
    for e in self.aliases:
      main = {("params", "embed"): "model.embed_tokens.weight", ("params", "head"): "lm_head.weight"}[e.leaf]
      same = all(
        np.array_equal(a, b) for a, b in zip(self.shards.read_rows(e.hf_name, 4096), self.shards.read_rows(main, 4096))
      )
      if not same:
        raise UserError(
          f"{e.hf_name} differs from {main}; our MTP modules share the main embedding and head, "
          "so convert with --skip-mtp"
        )

  def _load(self, e: layout.Entry, dtype: np.dtype) -> np.ndarray:
    x = self.shards.read(e.hf_name)
    if fp8.is_fp8(x.dtype):
      x = fp8.dequantize(x, self.shards.read(fp8.scale_name(e.hf_name)), self.block, dtype)
    return np.ascontiguousarray(e.transform.to_ours(x), dtype=dtype)

  def tree(self) -> dict:
    out: dict = {}
    for leaf, shape in self.shapes.items():
      entries, dtype = self.by_leaf[leaf], self.dtypes[leaf]
      depth = len(entries[0].index) if entries else 0
      if math.prod(shape):  # every slice of a leaf comes from exactly one tensor
        assert sorted(e.index for e in entries) == list(np.ndindex(*shape[:depth])), leaf
      node = out
      for k in leaf[:-1]:
        node = node.setdefault(k, {})
      pieces = lambda entries=entries, dtype=dtype: ((e.index, self._load(e, dtype)) for e in entries)  # noqa: E731
      node[leaf[-1]] = checkpoint.StreamedArray(shape, dtype, (1,) * depth + tuple(shape[depth:]), pieces)
    return out


def model_config_text(keys: dict, hf_dir: Path, note: str) -> str:
  header = (
    f"# DeepSeek-V3 model config converted from {hf_dir.resolve()}/config.json by MaxText.convert.hf_to_orbax\n"
    f"# ({note}). Use it as a recipe's model_config; the weights are in state/ beside it.\n"
  )
  return header + yaml.safe_dump(keys, sort_keys=False)


def main(argv: list[str]) -> int:
  args = parse(argv)
  hf_dir, out = Path(args.hf_dir), Path(args.out)
  check_new(out, "--out")
  hf = hf_config.read(hf_dir)
  shards = ShardedCheckpoint(hf_dir)
  mtp, note = mtp_layers(hf, shards, args.skip_mtp)
  keys = hf_config.to_model_keys(hf, model_name=args.model_name or hf_dir.resolve().name, mtp_layers=mtp)
  with staged_dir(out, "--out") as tmp:
    (tmp / checkpoint.MODEL_CONFIG).write_text(model_config_text(keys, hf_dir, note))
    try:
      cfg = load_config(tmp / checkpoint.MODEL_CONFIG)
    except UserError as e:
      why = str(e).replace(f" (set in {tmp / checkpoint.MODEL_CONFIG})", "")
      raise UserError(f"{hf_dir / hf_config.CONFIG_FILE} maps to a model config we cannot build: {why}") from None
    conversion = Conversion(hf, shards, cfg, args.dtype, mtp_skipped=args.skip_mtp)
    conversion.check_aliases()
    shutil.copyfile(hf_dir / hf_config.CONFIG_FILE, tmp / checkpoint.HF_CONFIG)
    checkpoint.write_state(tmp / checkpoint.STATE, conversion.tree())
  dtypes = sorted({str(d) for leaf, d in conversion.dtypes.items() if leaf[0] == "params"})
  print(f"converted {hf_dir} -> {out}: {len(shards.tensors)} tensors, parameters in {'/'.join(dtypes)}, {note}")
  return 0


if __name__ == "__main__":
  raise SystemExit(exit_on_user_error(main)())
