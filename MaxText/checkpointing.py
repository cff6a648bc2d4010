"""Checkpoints with orbax-checkpoint: periodic (async) saves, keep the newest K, exact resume.

  <run_dir>/checkpoints/<step>/
    state/   the TrainState: params, optimizer state, routing bias, step (sharded arrays, OCDBT)
    data/    process_<i>-of-<n>.json: each process's data-iterator state
    config/  the flat config, process count and global batch that wrote it (JSON)

Orbax writes a step into `<step>.orbax-checkpoint-tmp*` and renames it once
every item is committed, so a crash during a save (SIGKILL, lost node) leaves
the earlier steps as they were; the half-written directory is ignored and
removed at the next start. Older steps are deleted only after a newer one is
complete. The train state holds no RNG (no dropout); the data order lives in
the data state, so params + optimizer + bias + step + data state is all a
resumed run needs to continue bit for bit.

A resume checks the checkpoint against the config first: the data stream's keys
must match (else the data state means nothing) and the train state's tree,
shapes and dtypes must match; otherwise a UserError names the keys that differ.
Under batch_size_schedule the data state counts microbatches and each step's
count follows from the schedule and the step, so the schedule is one of the
data stream's keys.
"""

import dataclasses
import json
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from MaxText.config import Config
from MaxText.errors import UserError

# The keys that decide which batches the data iterator yields: a resume must not change them.
DATA_KEYS_FROM_TRAIN = ("per_device_batch_size", "max_target_length", "batch_size_schedule")
# What a key added after checkpoints were written means in them: the value that kept the old behaviour.
ABSENT_MEANS = {"batch_size_schedule": "", "piece_shuffle_window": 0}
# Sections whose keys can change the train state's tree, shapes or dtypes (listed when they differ).
STATE_SECTIONS = ("model", "moe", "optimizer")


def _process_file() -> str:
  return f"process_{jax.process_index()}-of-{jax.process_count()}.json"


class ProcessJsonHandler(ocp.JsonCheckpointHandler):
  """Like orbax's JSON item, but every process writes and reads its own file (data-iterator states differ)."""

  async def _save_fn(self, x, directory):
    (directory / _process_file()).write_text(json.dumps(x))

  def restore(self, directory, item=None, args=None):
    path = directory / _process_file()
    if not path.exists():
      raise FileNotFoundError(f"{path} not found")
    return json.loads(path.read_text())


@ocp.args.register_with_handler(ProcessJsonHandler, for_save=True)
@dataclasses.dataclass
class ProcessJsonSave(ocp.args.CheckpointArgs):
  item: dict


@ocp.args.register_with_handler(ProcessJsonHandler, for_restore=True)
@dataclasses.dataclass
class ProcessJsonRestore(ocp.args.CheckpointArgs):
  item: dict | None = None


def with_shardings(abstract, shardings):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def _leaf_map(tree, is_leaf=None) -> dict[str, tuple[tuple[int, ...], str]]:
  """'params/embed' -> (shape, dtype) for every array leaf (NamedTuples and lists flatten alike)."""

  def name(key) -> str:
    for attr in ("name", "key", "idx"):
      if hasattr(key, attr):
        return str(getattr(key, attr))
    return str(key)

  leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
  return {"/".join(name(k) for k in path): (tuple(leaf.shape), str(leaf.dtype)) for path, leaf in leaves}


class Checkpointer:
  """Saves and restores one run's checkpoints under `directory`."""

  def __init__(self, directory: Path, cfg: Config, abstract_state, global_batch: int, data_batch: int | None = None):
    """data_batch: sequences per batch of the data iterator when not a step's (batch_size_schedule)."""
    self.directory, self.cfg = Path(directory).absolute(), cfg  # orbax takes absolute paths only
    self.abstract_state = abstract_state  # ShapeDtypeStructs with shardings: the restore target
    self.identity = {"process_count": jax.process_count(), "global_batch": global_batch}
    if data_batch is not None and data_batch != global_batch:
      self.identity["data_batch"] = data_batch
    self.last_saved: int | None = None
    t = cfg.train
    options = ocp.CheckpointManagerOptions(
      max_to_keep=t.max_num_checkpoints_to_keep,
      enable_async_checkpointing=t.async_checkpointing,
      cleanup_tmp_directories=True,
      create=False,  # the run directory is made only after every check has passed
    )
    handlers = {
      "state": ocp.StandardCheckpointHandler(),
      "data": ProcessJsonHandler(),
      "config": ocp.JsonCheckpointHandler(),
    }
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
    # Orbax removes an earlier run's unfinished saves in a background thread that neither close() nor
    # wait_until_finished() joins; a process exiting soon after (a refused resume) would tear the thread
    # down mid-way and print its traceback. The removal is quick: finish it here.
    join_cleanup = getattr(self.manager, "_maybe_await_cleanup_tmp_directory", None)
    if join_cleanup is not None:
      join_cleanup()

  def latest_step(self) -> int | None:
    return self.manager.latest_step() if self.directory.is_dir() else None

  # ---- resume ----
  def check_compatible(self, step: int) -> None:
    """UserError naming the keys that differ if checkpoint `step` cannot continue under this config."""
    where = self.directory / str(step)
    saved = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config
    now = {**self.cfg.to_flat_dict(), **self.identity}
    data_keys = [f.name for f in dataclasses.fields(self.cfg.data)] + list(DATA_KEYS_FROM_TRAIN)
    data_keys += list(dict.fromkeys([*self.identity, "data_batch"]))  # data_batch: also where one side has none
    saved = {**ABSENT_MEANS, **saved}
    changed = [k for k in data_keys if saved.get(k) != now.get(k)]
    if changed:
      raise UserError(
        f"checkpoint {where} is from an incompatible config: the data stream differs in {_diff(changed, saved, now)}; "
        "restore those values or start a new run_name (load_parameters_path keeps the parameters)"
      )
    ckpt_leaves = _leaf_map(
      self.manager.item_metadata(step).state.tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype")
    )
    want = _leaf_map(self.abstract_state)
    # In tree order (params first); names present on one side only come after.
    mismatch = [k for k in want if ckpt_leaves.get(k) != want[k]] + sorted(set(ckpt_leaves) - set(want))
    if mismatch:
      first = mismatch[0]
      detail = f"{first}: checkpoint {_fmt(ckpt_leaves.get(first))}, now {_fmt(want.get(first))}"
      keys = [
        k
        for s in STATE_SECTIONS
        for k in (f.name for f in dataclasses.fields(getattr(self.cfg, s)))
        if saved.get(k) != now.get(k)
      ]
      differ = _diff(keys, saved, now) if keys else "no config key (the code changed the state's layout)"
      raise UserError(
        f"checkpoint {where} is from an incompatible config: its train state does not match ({detail}); "
        f"keys that differ: {differ}; to resume, set them back to the checkpoint's values, "
        "or choose a new run_name to start a new run with this config"
      )

  def restore(self, step: int):
    """(train state, data-iterator state) of checkpoint `step`, sharded like the abstract state."""
    args = ocp.args.Composite(state=ocp.args.StandardRestore(self.abstract_state), data=ProcessJsonRestore())
    restored = self.manager.restore(step, args=args)
    # Rebuild the exact pytree types (optax NamedTuples) from the target's structure.
    state = jax.tree.unflatten(jax.tree.structure(self.abstract_state), jax.tree.leaves(restored.state))
    return state, restored.data

  # ---- save ----
  def save(self, step: int, state, data_state: dict) -> None:
    """Starts saving `state` as `step`; with async_checkpointing it returns once the arrays are copied off the
    device."""
    self.directory.mkdir(parents=True, exist_ok=True)
    config = {**self.cfg.to_flat_dict(), **self.identity}
    args = ocp.args.Composite(
      state=ocp.args.StandardSave(state), data=ProcessJsonSave(data_state), config=ocp.args.JsonSave(config)
    )
    self.manager.save(step, args=args, force=True)
    self.last_saved = step

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()


def check_parameters(state_dir: Path, abstract_params, path: str) -> None:
  """UserError when the checkpoint state directory `state_dir` (given as `path`) holds parameters of other shapes
  or dtypes than `abstract_params`, read from its metadata only (nothing is restored)."""
  meta = ocp.PyTreeCheckpointer().metadata(state_dir).item_metadata.tree
  saved = _leaf_map(meta, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
  want = {f"params/{k}": v for k, v in _leaf_map(abstract_params).items()}
  bad = sorted(k for k in want if saved.get(k) != want[k])
  if bad:
    first = bad[0]
    raise UserError(
      f"load_parameters_path {path}: parameters do not match this model "
      f"({first}: checkpoint {_fmt(saved.get(first))}, now {_fmt(want[first])}); "
      "use the model config (and weight_dtype) the checkpoint was written with"
    )


def load_parameters(path: str, abstract_params) -> dict:
  """The params of the checkpoint at `path` (a step directory or its state/ item), sharded like `abstract_params`."""
  p = Path(path).expanduser().absolute()
  if (p / "state").is_dir():
    p = p / "state"
  if not (p / "_METADATA").exists():
    raise UserError(f"load_parameters_path {path} is not a checkpoint step directory (no state/_METADATA)")
  check_parameters(p, abstract_params, path)
  target = {"params": abstract_params}
  restore_args = ocp.checkpoint_utils.construct_restore_args(target)
  restored = ocp.PyTreeCheckpointer().restore(
    p, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True)
  )
  return restored["params"]


def _fmt(leaf) -> str:
  return "absent" if leaf is None else f"{list(leaf[0])} {leaf[1]}"


def _diff(keys: list[str], saved: dict, now: dict) -> str:
  return ", ".join(f"{k} (checkpoint {saved.get(k)!r}, now {now.get(k)!r})" for k in keys)
