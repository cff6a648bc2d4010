"""XLA's "Involuntary full rematerialization" warnings, captured from file descriptor 2 and counted
(MaxText/xla_warnings.py). The tiny model's training step on fsdp 2 x expert 4 makes one for each embedding
lookup when the lookup reads the fsdp-split table directly, and none with the model's own lookup
(model.embed_tokens gathers the table first)."""

import jax
import jax.numpy as jnp

from MaxText import model, xla_warnings
from MaxText.model import Batch
from MaxText.sharding import make_mesh
from MaxText.train_step import Trainer

WARNING = (
  "W1206 03:14:16.984200   11288 spmd_partitioner.cc:661] [SPMD] Involuntary full rematerialization. The compiler "
  "cannot go from sharding {mesh['fsdp'=2], [{'fsdp'}, {}]} to {mesh['fsdp'=2], [{}, {'fsdp'}]} efficiently for "
  "HLO operation %gather = f32[16,64,64]{2,1,0} gather(%all-gather, %p.1), sharding={...}. As the last resort, ..."
)


def test_warnings_are_parsed_to_their_operations():
  log = xla_warnings.Captured()
  log.text = "\n".join(["I1206 compiling", WARNING, "W1206 another warning", WARNING])
  assert log.involuntary_rematerializations() == ["%gather = f32[16,64,64]{2,1,0}"] * 2
  line = xla_warnings.describe(log.involuntary_rematerializations())
  assert line.startswith("XLA partitioner: 2 involuntary full rematerialization(s)")
  assert line.endswith(": %gather = f32[16,64,64]{2,1,0}")  # distinct operations, each once
  assert xla_warnings.describe([]) == "XLA partitioner: no involuntary full rematerialization"


def compile_tiny_step(tiny_config) -> xla_warnings.Captured:
  cfg = tiny_config(
    "ici_fsdp_parallelism=2", "ici_expert_parallelism=4", "moe_dispatch=allgather", "base_num_decoder_layers=2"
  )
  trainer = Trainer(cfg, make_mesh(cfg.mesh, jax.devices()[:8]))
  b, s = trainer.global_batch, cfg.train.max_target_length
  batch = Batch(*(jax.ShapeDtypeStruct((b, s), dt) for dt in (jnp.int32, jnp.int32, jnp.float32)))
  with xla_warnings.capture_stderr() as log:
    trainer.jit_step().lower(trainer.abstract_state(), batch).compile()
  return log


def test_the_tiny_training_step_on_fsdp_x_expert_replicates_nothing(tiny_config):
  log = compile_tiny_step(tiny_config)
  assert log.involuntary_rematerializations() == [], log.text[-3000:]


def test_a_lookup_in_the_split_table_is_counted(tiny_config, monkeypatch):
  def direct_lookup(table, ids, shard):  # what model.py did before embed_tokens
    return shard(jnp.take(table, ids, axis=0), ("batch", "seq", "act_embed"))

  monkeypatch.setattr(model, "embed_tokens", direct_lookup)
  found = compile_tiny_step(tiny_config).involuntary_rematerializations()
  assert found and all("f32[" in op or "bf16[" in op for op in found), found
