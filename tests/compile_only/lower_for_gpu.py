"""Compiles for compile-only H200s (H100s where asked) and prints JSON; run by tests/test_gpu_lowering.py in a
subprocess whose PYTHONPATH holds the CUDA plugin (kept out of the main environment so CPU runs stay quiet).

  python tests/compile_only/lower_for_gpu.py train_step RECIPE [key=value ...]
  python tests/compile_only/lower_for_gpu.py mosaic_gmm [h200 | h100]   # and the tile table it lowered with
  python tests/compile_only/lower_for_gpu.py memory RECIPE [key=value ...]   # one H200: host offload
  python tests/compile_only/lower_for_gpu.py ep_layer RECIPE [key=value ...]   # MoE layer fwd+bwd, EP over 8 H200s
  python tests/compile_only/lower_for_gpu.py permute_gather   # what the permute's row gather computes per element
"""

import json
import re
import sys

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText import compile_only
from MaxText.config import load_config
from MaxText.model import Batch
from MaxText.sharding import MESH_AXES, mesh_shape
from MaxText.train_step import Trainer


def compile_train_step(cfg, mesh) -> tuple:
  """The train step at the recipe's global batch, compiled for `mesh`: (HLO text, memory analysis)."""
  trainer = Trainer(cfg, mesh)
  b, s = trainer.global_batch, cfg.train.max_target_length
  batch = Batch(
    jax.ShapeDtypeStruct((b, s), jnp.int32),
    jax.ShapeDtypeStruct((b, s), jnp.int32),
    jax.ShapeDtypeStruct((b, s), jnp.float32),
  )
  with compile_only.lowering_for(mesh.devices.flat):
    compiled = trainer.jit_step().lower(trainer.abstract_state(), batch).compile()
  return compiled.as_text(), compiled.memory_analysis()


def train_step(recipe: str, overrides: list[str]) -> dict:
  cfg = load_config(recipe, overrides)
  devices = compile_only.devices("h200", 8)
  shape = mesh_shape(cfg.mesh, len(devices))
  import numpy as np

  mesh = Mesh(np.asarray(devices).reshape([shape[a] for a in MESH_AXES]), MESH_AXES)
  text, mem = compile_train_step(cfg, mesh)
  return {
    "device_kind": devices[0].device_kind,
    "mesh": shape,
    "temp_bytes": mem.temp_size_in_bytes,
    "argument_bytes": mem.argument_size_in_bytes,
    "collectives": sorted({op for op in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all") if op in text}),
  }


def memory(recipe: str, overrides: list[str]) -> dict:
  """The train step on one H200: what it keeps in host memory.

  (Compile-only devices have no memory spaces in their API, so state shardings with
  memory_kind=pinned_host cannot be expressed here; activation offload goes through
  the remat policy's memory-space moves, which can.)"""
  import re

  import numpy as np

  cfg = load_config(recipe, ["ici_fsdp_parallelism=1", *overrides])
  devices = compile_only.devices("h200", 1)
  mesh = Mesh(np.asarray(devices).reshape([1] * len(MESH_AXES)), MESH_AXES)
  text, mem = compile_train_step(cfg, mesh)
  return {
    "device_kind": devices[0].device_kind,
    "argument_bytes": mem.argument_size_in_bytes,
    "temp_bytes": mem.temp_size_in_bytes,
    "host_argument_bytes": mem.host_argument_size_in_bytes,
    "host_output_bytes": mem.host_output_size_in_bytes,
    "host_temp_bytes": mem.host_temp_size_in_bytes,
    # Shapes placed in host memory space S(5) and the async copies that move them.
    "host_shapes": len(re.findall(r"\{[^{}]*S\(5\)[^{}]*\}", text)),
  }


def mosaic_gmm(gpu: str = "h200") -> dict:
  """The `mosaic` expert GEMM (kernels/mosaic_gmm.py) on one `gpu`: the Mosaic GPU custom calls its forward
  and its forward + backward compile to, at DeepSeek-V3's gate/up shape, and the tile table the kernels
  were lowered with (the compile-only GPU's, not this CPU's)."""
  from MaxText import gmm
  from MaxText.kernels import mosaic_tiles

  devices = compile_only.devices(gpu, 1)
  s = NamedSharding(Mesh(devices, ("x",)), PartitionSpec())
  args = (
    jax.ShapeDtypeStruct((4096, 7168), jnp.bfloat16),
    jax.ShapeDtypeStruct((8, 7168, 4096), jnp.bfloat16),
    jax.ShapeDtypeStruct((8,), jnp.int32),
  )
  gemm = gmm.build("mosaic")

  def loss_grads(x, w, sizes):
    return jax.grad(lambda x, w: jnp.sum(jnp.square(gemm(x, w, sizes).astype(jnp.float32))), argnums=(0, 1))(x, w)

  def mosaic_calls(f) -> int:
    with compile_only.lowering_for(devices):
      text = jax.jit(f, in_shardings=(s, s, s)).lower(*args).compile().as_text()
    return sum(1 for line in text.splitlines() if 'custom_call_target="mosaic_gpu' in line)

  with compile_only.lowering_for(devices):
    table = mosaic_tiles.choose_table(mosaic_tiles.current_device_kind())[0]
  return {
    "device_kind": devices[0].device_kind,
    "tile_table": table.name if table else None,
    "fwd_mosaic_kernels": mosaic_calls(gemm),
    "fwd_bwd_mosaic_kernels": mosaic_calls(loss_grads),
  }


def permute_gather() -> dict:
  """Gathers inside the fusion that writes the permuted rows (one H200, DeepSeek-V3 widths, 32 experts,
  top-8, rows padded to 128), for the permute and for the same take without its index materialised.
  More than one means each element recomputes index lookups of the permutation plan."""
  from MaxText.moe import permute

  devices = compile_only.devices("h200", 1)
  s = NamedSharding(Mesh(devices, ("x",)), PartitionSpec())
  args = (jax.ShapeDtypeStruct((8192, 7168), jnp.bfloat16), jax.ShapeDtypeStruct((8192, 8), jnp.int32))

  def gathers_in_row_fusion(f) -> int:
    text = (
      jax.jit(lambda x, ids: f(x, permute.plan(ids, 32, 128)), in_shardings=(s, s)).lower(*args).compile().as_text()
    )
    computations = re.split(r"\n(?=%\S+ \()", text)
    rows = [c for c in computations if re.match(r"%\S+ \(.*\) -> bf16\[\d+,(1,)?7168\]", c) and " gather(" in c]
    assert len(rows) == 1, [c.split("\n", 1)[0] for c in rows]
    return rows[0].count(" gather(")

  def unmaterialised(x, p):
    return jnp.take(x, p.row_copy // p.dest.shape[1], axis=0, mode="fill", fill_value=0)

  return {"permute": gathers_in_row_fusion(permute.permute), "unmaterialised": gathers_in_row_fusion(unmaterialised)}


def ep_layer(recipe: str, overrides: list[str]) -> dict:
  """The MoE layer's forward and backward under expert parallelism (moe_dispatch=...) on 8 H200s."""
  import numpy as np

  from MaxText import params
  from MaxText.moe.layer import moe, moe_specs
  from MaxText.sharding import Sharder, param_shardings

  cfg = load_config(recipe, overrides)
  devices = compile_only.devices("h200", 8)
  shape = mesh_shape(cfg.mesh, len(devices))
  mesh = Mesh(np.asarray(devices).reshape([shape[a] for a in MESH_AXES]), MESH_AXES)
  shard = Sharder(mesh)
  specs = moe_specs(cfg.model.emb_dim, cfg.moe)
  dtype = jnp.dtype(cfg.model.dtype)
  x = jax.ShapeDtypeStruct(
    (cfg.train.per_device_batch_size * len(devices), cfg.train.max_target_length, cfg.model.emb_dim), dtype
  )
  bias = jax.ShapeDtypeStruct((cfg.moe.num_experts,), jnp.float32)

  def loss(p, x, bias):
    out, stats = moe(p, x, bias, cfg.moe, shard)
    return jnp.sum(out.astype(jnp.float32) ** 2), stats.ep_overflow

  in_shardings = (
    param_shardings(specs, mesh),
    shard.named(("batch", "seq", "act_embed")),
    NamedSharding(mesh, PartitionSpec()),
  )
  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), in_shardings=in_shardings)
  text = grad.lower(params.abstract(specs, dtype), x, bias).compile().as_text()
  ops = ("ragged-all-to-all", "all-to-all", "all-gather", "reduce-scatter", "all-reduce")
  found = {op for op in ops if re.search(rf"(?<![-\w]){op}(-start)?\(", text)}
  return {"device_kind": devices[0].device_kind, "mesh": shape, "collectives": sorted(found)}


if __name__ == "__main__":
  what = sys.argv[1]
  if what == "train_step":
    result = train_step(sys.argv[2], sys.argv[3:])
  elif what == "memory":
    result = memory(sys.argv[2], sys.argv[3:])
  elif what == "ep_layer":
    result = ep_layer(sys.argv[2], sys.argv[3:])
  elif what == "permute_gather":
    result = permute_gather()
  else:
    result = mosaic_gmm(*sys.argv[2:3])
  print("RESULT " + json.dumps(result))
