"""A converted checkpoint: its directory, its streamed orbax writer, and its loaders.

  OUT/
    model_config.yml  our model keys: a `model_config:` for recipes, and what `score` builds
    hf_config.json    the source config.json, kept for the way back (orbax_to_hf)
    state/            orbax PyTree {"params": <model_specs tree>, "bias": {"moe_layers", "mtp_layers"}}

`state/` is laid out like the `state` item of a training checkpoint (params and
routing bias under the same names), so `load_params` / `load_bias` read either.
Leaves are written one slice at a time (a layer, or one expert of a layer) by
an orbax type handler of our own (it overrides NumpyHandler's write, so it
follows the pinned orbax-checkpoint), so a stacked leaf bigger than host memory
(the 671B model's expert weights: 435 GB) never exists in memory whole; a slice
covers whole storage chunks, so a write never reads back what it overwrites.
Empty leaves (no MTP modules: a [0, experts] bias) are not stored; orbax refuses
zero-size arrays, and `load_bias` gives them back as zeros.
"""

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from MaxText.errors import UserError

STATE = "state"
MODEL_CONFIG = "model_config.yml"
HF_CONFIG = "hf_config.json"


@dataclass(frozen=True)
class StreamedArray:
  """A leaf to save, given as its slices: `pieces()` yields (index into the leading axes, array)."""

  shape: tuple[int, ...]
  dtype: np.dtype
  piece_shape: tuple[int, ...]  # the shape of one slice, with its leading indexed axes as 1
  pieces: Callable[[], Iterator[tuple[tuple[int, ...], np.ndarray]]]

  @property
  def size(self) -> int:
    return math.prod(self.shape)


class _StreamedArrayHandler(ocp.type_handlers.NumpyHandler):
  """Saves a StreamedArray slice by slice; on disk it is an ordinary np.ndarray leaf (restored as any other)."""

  def __init__(self):
    super().__init__(deepcopy_host_arrays=False)

  async def _background_serialize(self, values, infos, args=None):
    # One leaf and one slice at a time: peak memory is one slice. orbax's own context gives the OCDBT
    # B-tree a 100 MB cache pool that grows the writer by ~250 MB; this one caches nothing.
    context = ts.Context({"file_io_concurrency": {"limit": 128}, "cache_pool#ocdbt": {"total_bytes_limit": 0}})
    for value, info, arg in zip(values, infos, args):
      await info.await_path_creation()
      spec = ocp.type_handlers.get_json_tspec_write(
        info,
        use_ocdbt=info.is_ocdbt_checkpoint,
        global_shape=value.shape,
        local_shape=value.piece_shape,
        dtype=value.dtype,
        process_index=0,
        arg=arg,
      )
      store = await ts.open(ts.Spec(spec), create=True, open=True, context=context)
      for index, piece in value.pieces():
        await store[index].write(piece)


def _drop_empty(tree: dict) -> dict:
  out = {}
  for k, v in tree.items():
    v = _drop_empty(v) if isinstance(v, dict) else v
    if v if isinstance(v, dict) else v.size:
      out[k] = v
  return out


def write_state(directory: Path, tree: dict) -> None:
  """Saves a nested dict of StreamedArray (empty leaves dropped) as an orbax PyTree checkpoint at `directory`."""
  # A registry of our own, so that the process-wide one (training checkpoints) is left as it was.
  # (orbax wants a jax.Array handler in any registry it saves with.)
  registry = ocp.type_handlers.create_type_handler_registry(
    (jax.Array, ocp.type_handlers.ArrayHandler()), (StreamedArray, _StreamedArrayHandler())
  )
  checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=registry))
  checkpointer.save(epath.Path(directory), args=ocp.args.PyTreeSave(_drop_empty(tree)))


def state_dir(path: str | Path) -> Path:
  """The orbax state of a converted checkpoint (OUT), a training checkpoint step, or the state dir itself."""
  p = Path(path).expanduser()
  if (p / STATE / "_METADATA").is_file():
    return p / STATE
  if (p / "_METADATA").is_file():
    return p
  what = "does not exist" if not p.exists() else "is not a checkpoint (no state/_METADATA)"
  raise UserError(f"checkpoint {path} {what}")


def _leaf_name(path) -> str:
  return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _tree_metadata(state: Path):
  # The handler's, not a Checkpointer's: a training checkpoint's state/ item has no step metadata of its own.
  return ocp.PyTreeCheckpointHandler().metadata(epath.Path(state))


def stored_leaves(state: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """'params.moe_layers.ffn.wi_0' -> (shape, dtype) for every array stored in `state`."""
  meta = _tree_metadata(state).tree
  leaves = jax.tree_util.tree_flatten_with_path(meta, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))[0]
  return {_leaf_name(path): (tuple(leaf.shape), np.dtype(leaf.dtype)) for path, leaf in leaves}


class LeafReader:
  """Reads slices of stored leaves through tensorstore, without restoring whole leaves."""

  def __init__(self, state: Path):
    self.state = epath.Path(state)
    self.ocdbt = ocp.type_handlers.is_ocdbt_checkpoint(self.state)
    self.zarr3 = bool(_tree_metadata(state).use_zarr3)
    self.context = ocp.type_handlers.get_ts_context(use_ocdbt=self.ocdbt)
    self.stores = {}

  def read(self, name: str, index: tuple[int, ...]) -> np.ndarray:
    if name not in self.stores:
      info = ocp.type_handlers.ParamInfo(
        name=name, parent_dir=self.state, is_ocdbt_checkpoint=self.ocdbt, use_zarr3=self.zarr3, ts_context=self.context
      )
      spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=self.ocdbt)
      self.stores[name] = ts.open(spec, context=self.context).result()
    return self.stores[name][index].read().result()


def _with_sharding(abstract):
  default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None) or default), abstract
  )


def _restore(path, item: str, abstract: dict) -> dict:
  """Leaves of `item` ("params"/"bias") named by `abstract`, cast to its dtypes and placed by its shardings."""
  state = state_dir(path)
  stored = stored_leaves(state)
  for kpath, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
    name = f"{item}.{_leaf_name(kpath)}"
    if name not in stored:
      raise UserError(f"checkpoint {path} has no {name.replace('.', '/')}: it was made for another model config")
    if stored[name][0] != tuple(leaf.shape):
      raise UserError(
        f"checkpoint {path}: {name.replace('.', '/')} has shape {list(stored[name][0])}, "
        f"the model config wants {list(leaf.shape)}"
      )
  target = {item: _with_sharding(abstract)}
  restore_args = ocp.checkpoint_utils.construct_restore_args(target)
  args = ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True)
  restored = ocp.PyTreeCheckpointer().restore(epath.Path(state), args=args)
  return restored[item]


def load_params(path: str | Path, abstract_params: dict) -> dict:
  """The parameters of checkpoint `path` (OUT, or a training checkpoint step) as jax Arrays.

  `abstract_params`: the model_specs tree as jax.ShapeDtypeStruct (params.abstract(specs, dtype)), with
  shardings where they should land (without one, the default device). Stored leaves are cast to the
  abstract dtypes (a bf16 conversion loads into float32 master weights). A leaf that is missing or
  has another shape is a UserError naming it.
  """
  return _restore(path, "params", abstract_params)


def load_bias(path: str | Path, abstract_bias: dict) -> dict:
  """The routing bias (model.bias_state layout) of checkpoint `path`; empty leaves come back as zeros."""
  present = {k: v for k, v in abstract_bias.items() if math.prod(v.shape)}
  restored = _restore(path, "bias", present) if present else {}
  return {k: restored[k] if k in restored else jax.numpy.zeros(v.shape, v.dtype) for k, v in abstract_bias.items()}


def model_config_path(path: str | Path, model_config: str | Path | None = None) -> Path:
  """The model config of checkpoint `path`: `model_config` if given, else OUT/model_config.yml."""
  p = Path(model_config) if model_config else Path(path).expanduser() / MODEL_CONFIG
  if not p.is_file():
    hint = (
      ""
      if model_config
      else "; a checkpoint made by MaxText.convert.hf_to_orbax holds one, for others pass --model-config"
    )
    raise UserError(f"model config {p} does not exist{hint}")
  return p
