"""Compiles for compile-only H200s and prints JSON; run by tests/test_gpu_lowering.py in a subprocess
whose PYTHONPATH holds the CUDA plugin (kept out of the main environment so CPU runs stay quiet).

  python tests/compile_only/lower_for_gpu.py train_step RECIPE [key=value ...]
  python tests/compile_only/lower_for_gpu.py mosaic_gmm
"""

import json
import sys

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText import compile_only
from MaxText.config import load_config
from MaxText.model import Batch
from MaxText.sharding import MESH_AXES, mesh_shape
from MaxText.train_step import Trainer


def train_step(recipe: str, overrides: list[str]) -> dict:
  cfg = load_config(recipe, overrides)
  devices = compile_only.devices("h200", 8)
  shape = mesh_shape(cfg.mesh, len(devices))
  import numpy as np

  mesh = Mesh(np.asarray(devices).reshape([shape[a] for a in MESH_AXES]), MESH_AXES)
  trainer = Trainer(cfg, mesh)
  b, s = trainer.global_batch, cfg.train.max_target_length
  batch = Batch(jax.ShapeDtypeStruct((b, s), jnp.int32), jax.ShapeDtypeStruct((b, s), jnp.int32), jax.ShapeDtypeStruct((b, s), jnp.float32))
  compiled = trainer.jit_step().lower(trainer.abstract_state(), batch).compile()
  text = compiled.as_text()
  mem = compiled.memory_analysis()
  return {
      "device_kind": devices[0].device_kind,
      "mesh": shape,
      "temp_bytes": mem.temp_size_in_bytes,
      "argument_bytes": mem.argument_size_in_bytes,
      "collectives": sorted({op for op in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all") if op in text}),
  }


def mosaic_gmm() -> dict:
  from MaxText.moe.gmm import mosaic

  devices = compile_only.devices("h200", 1)
  s = NamedSharding(Mesh(devices, ("x",)), PartitionSpec())
  args = (jax.ShapeDtypeStruct((4096, 7168), jnp.bfloat16), jax.ShapeDtypeStruct((8, 7168, 4096), jnp.bfloat16), jax.ShapeDtypeStruct((8,), jnp.int32))
  compiled = jax.jit(mosaic.gmm, in_shardings=(s, s, s)).lower(*args).compile()
  text = compiled.as_text()
  return {"device_kind": devices[0].device_kind, "mosaic_custom_call": "mosaic_gpu" in text}


if __name__ == "__main__":
  what = sys.argv[1]
  result = train_step(sys.argv[2], sys.argv[3:]) if what == "train_step" else mosaic_gmm()
  print("RESULT " + json.dumps(result))
