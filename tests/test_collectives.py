"""The planner's collective parser (MaxText/plan/collectives.py) on steps compiled for 16 compile-only H100s
(2 nodes of 8): each collective kind's bytes against sizes computed by hand, its replica groups, which stay
inside a node, runs per step through a scanned loop, asynchronous overlap; and the fabric model's times."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from MaxText.plan import collectives, fabric, predict
from MaxText.plan.collectives import Placement

PLUGIN_SITE = REPO / ".venv" / "gpu-aot"
needs_plugin = pytest.mark.skipif(
  not (PLUGIN_SITE / "jax_plugins").is_dir() and "MAXTEXT_GPU_AOT_SITE" not in os.environ,
  reason=f"CUDA plugin not installed in {PLUGIN_SITE}: make install",
)

# Compiled in a subprocess: the CUDA plugin must be on the path before jax starts.
PROGRAMS = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax import shard_map
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from MaxText import compile_only

devs = compile_only.devices("h100", 16, 8)
mesh = Mesh(np.array(devs).reshape(2, 8), ("fsdp", "expert"))
spec = P("fsdp", "expert")
sds = lambda shape, dt=jnp.float32, s=spec: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, s))
out = {}

def each_kind(x, y, z):
  a = jax.lax.all_gather(x, "fsdp", tiled=True)                  # local f32[128,64] -> f32[256,64]
  b = jax.lax.psum_scatter(y, "expert", tiled=True)              # local bf16[128,128] -> bf16[16,128]
  c = jax.lax.psum(z, "fsdp")                                    # f32[32,8]
  d = jax.lax.all_to_all(a, "expert", 0, 0, tiled=True)          # f32[256,64]
  e = jax.lax.ppermute(c, "expert", [(i, (i + 1) % 8) for i in range(8)])
  return a.sum() + b.sum() + d.sum() + e.sum()

def ragged(x, o, i, oo, ss, rs):
  return jax.lax.ragged_all_to_all(x, o, i, ss, oo, rs, axis_name="expert")

def scanned(w, x):
  def body(c, wi):
    return jnp.tanh(c @ jax.lax.all_gather(wi, "fsdp", tiled=True)), None
  return jax.lax.psum(jax.lax.scan(body, x, w)[0].sum(), ("fsdp", "expert"))

with compile_only.lowering_for(devs):
  f = jax.jit(shard_map(each_kind, mesh=mesh, in_specs=(spec,) * 3, out_specs=P(), check_vma=False))
  out["each_kind"] = f.lower(sds((256, 512)), sds((256, 1024), jnp.bfloat16), sds((64, 64))).compile().as_text()
  flat = P(("fsdp", "expert"))
  f = jax.jit(shard_map(ragged, mesh=mesh, in_specs=(flat,) * 6, out_specs=flat, check_vma=False))
  args = [sds((16 * 128, 64), jnp.bfloat16, flat), sds((16 * 256, 64), jnp.bfloat16, flat)]
  args += [sds((16 * 8,), jnp.int32, flat)] * 4
  out["ragged"] = f.lower(*args).compile().as_text()
  f = jax.jit(jax.grad(shard_map(scanned, mesh=mesh, in_specs=(P(None, "fsdp"), P()), out_specs=P(), check_vma=False)))
  w, x = sds((6, 256, 256), jnp.bfloat16, P(None, "fsdp")), sds((64, 256), jnp.bfloat16, P())
  out["scanned"] = f.lower(w, x).compile().as_text()
json.dump(out, open(sys.argv[1], "w"))
"""


@pytest.fixture(scope="module")
def hlo(tmp_path_factory):
  path = tmp_path_factory.mktemp("hlo") / "hlo.json"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "PYTHONPATH": f"{PLUGIN_SITE}{os.pathsep}{REPO}"}
  proc = subprocess.run([sys.executable, "-c", PROGRAMS, str(path)], cwd=REPO, env=env, capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(path.read_text())


def by_kind(text):
  found = collectives.parse(text)
  return {c.kind: c for c in found}, found


NODE0, NODE1 = list(range(8)), list(range(8, 16))


@needs_plugin
def test_each_kind_bytes_groups_and_nodes(hlo):
  k, found = by_kind(hlo["each_kind"])
  assert sorted(k) == ["all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter"]
  assert len(found) == 5
  ag, rs, ar, a2a, cp = (
    k[n] for n in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
  )
  assert (ag.size, ag.in_bytes) == (256 * 64 * 4, 128 * 64 * 4)  # gathered output, per-GPU input
  assert (rs.size, rs.out_bytes) == (128 * 128 * 2, 16 * 128 * 2)  # input reduced, scattered output
  assert ar.size == 32 * 8 * 4 and a2a.size == 256 * 64 * 4 and cp.size == 32 * 8 * 4
  # Mesh (fsdp=2, expert=8) over devices 0..15, 8 to a node: expert groups are nodes, fsdp pairs cross them.
  assert sorted(map(sorted, ag.groups)) == [[i, i + 8] for i in range(8)]
  assert sorted(map(sorted, rs.groups)) == [NODE0, NODE1]
  ids = list(range(16))
  assert collectives.classify(ag, ids, 8) == Placement(nodes=2, per_node=1, group_size=2)
  assert collectives.classify(ar, ids, 8).crosses_nodes
  assert collectives.classify(rs, ids, 8) == Placement(nodes=1, per_node=8, group_size=8)
  assert not collectives.classify(a2a, ids, 8).crosses_nodes and not collectives.classify(cp, ids, 8).crosses_nodes
  # Another device order (the expert axis across nodes) moves the same groups across nodes.
  transposed = [(p % 8) * 2 + p // 8 for p in range(16)]
  assert collectives.classify(rs, transposed, 8).crosses_nodes
  assert all(c.count == 1 for c in found)


@needs_plugin
def test_ragged_all_to_all_is_sized_by_its_send_buffer(hlo):
  k, _ = by_kind(hlo["ragged"])
  r = k["ragged-all-to-all"]
  assert r.size == 128 * 64 * 2 and r.out_bytes == 256 * 64 * 2  # send rows, not the worst-case receive buffer
  assert sorted(map(sorted, r.groups)) == [NODE0, NODE1]


@needs_plugin
def test_scanned_collectives_run_once_per_layer_and_overlap(hlo):
  _, found = by_kind(hlo["scanned"])
  gathers = [c for c in found if c.kind == "all-gather"]
  scatters = [c for c in found if c.kind == "reduce-scatter"]  # the gathers' transpose, in the backward loop
  assert sum(c.count for c in gathers) == 6 and sum(c.count for c in scatters) == 6  # 6 scanned layers
  assert all(c.size == 256 * 256 * 2 for c in gathers + scatters)
  assert any(c.is_async and c.overlapped for c in gathers)  # the schedule puts the layer's work between
  s = collectives.summary(found)
  assert s["all-gather"]["bytes"] == 6 * 256 * 256 * 2


def test_replica_group_spellings():
  attrs = "replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}"
  assert collectives.replica_groups(attrs, 8) == [[0, 2, 4, 6], [1, 3, 5, 7]]
  assert collectives.replica_groups("replica_groups={{0,1},{2,3}}", 4) == [[0, 1], [2, 3]]
  assert collectives.replica_groups("replica_groups={}", 4) == [[0, 1, 2, 3]]
  mesh = "replica_groups=mesh['a'=2,'b'=2,'c'=2] {'a','c'}, x=1"
  assert collectives.replica_groups(mesh, 8) == [[0, 1, 4, 5], [2, 3, 6, 7]]
  assert collectives.shape_bytes("((bf16[4,8]{1,0}), f32[2]{0:S(1)}, u32[])") == 64 + 8 + 4


def test_fabric_times_follow_nccl_ring_factors_and_overrides(tmp_path):
  f = fabric.load("h200")
  size = 1e9
  intra = fabric.collective_time("all-gather", size, Placement(1, 8, 8), f)
  assert intra == pytest.approx((8.4 + 7 * 3.4) * 1e-6 + 7 / 8 * size / 360e9)
  across = fabric.collective_time("all-gather", size, Placement(16, 1, 16), f)
  assert across == pytest.approx((8.4 + 15 * 14) * 1e-6 + 15 / 16 * size / 45e9)
  assert fabric.collective_time("all-reduce", size, Placement(1, 8, 8), f) > 1.9 * intra
  a2a = fabric.collective_time("all-to-all", size, Placement(4, 8, 32), f)  # 24/32 of it leaves the node
  assert a2a == pytest.approx((8.4 + 14) * 1e-6 + size * 24 / 32 / 40e9)
  (tmp_path / "mine.json").write_text('{"net_busbw_GBps": 90}')
  mine = fabric.load("h200", str(tmp_path / "mine.json"))
  assert mine.net_busbw_GBps == 90 and "mine.json" in mine.source
  assert fabric.collective_time("all-gather", size, Placement(16, 1, 16), mine) < across
  (tmp_path / "bad.json").write_text('{"nvlink": 1}')
  with pytest.raises(Exception, match="unknown key"):
    fabric.load("h200", str(tmp_path / "bad.json"))


def test_exposed_communication_and_weak_scaling():
  comp = predict.Compute({"attention": 1.0}, 1.0)
  comm = [
    {"overlapped": True, "seconds": 0.5, "fabric": "inter-node"},
    {"overlapped": False, "seconds": 0.2, "fabric": "intra-node"},
  ]
  s = predict.step(comp, comm)
  assert s["exposed_communication_s"] == pytest.approx(0.2) and s["step_s"] == pytest.approx(1.2)
  s = predict.step(comp, [{**comm[0], "seconds": 1.5}])  # more than 90% of the compute cannot hide
  assert s["exposed_communication_s"] == pytest.approx(0.6)


def test_weak_scaling_leaves_out_the_state_share_that_shrinks_with_the_cluster():
  """At the same tokens per GPU, collectives inside a node cost the same at any size: the efficiency stays
  100% however large the offloaded state's serial copies and the update are on the smallest cluster (their
  share shrinks with more GPUs; counted, it read 226% for the 671B on 128 x H100 against 8 GPUs)."""
  comp = predict.Compute({"attention": 1.0, "optimizer": 0.1}, 1.1)
  fab = fabric.load("h100", None)
  size, count = 64e6, 20
  seconds = fabric.collective_time("all-to-all", size, Placement(1, 8, 8), fab) * count
  a2a = {"kind": "all-to-all", "size": size, "count": count, "nodes": 1, "per_node": 8, "group_size": 8}
  comm = [{**a2a, "overlapped": False, "seconds": seconds, "fabric": "intra-node"}]
  rows = predict.weak_scaling(comp, comm, 128, 8, fab, state_copy_bytes=20e9)
  assert [r["num_gpus"] for r in rows] == [8, 16, 32, 64, 128, 256, 512, 1024]
  assert all(r["efficiency"] == pytest.approx(1.0) for r in rows)
  # the 8-GPU step holds 16 times the 128-GPU share of the state's copies and update
  by_n = {r["num_gpus"]: r for r in rows}
  assert by_n[8]["state_s"] == pytest.approx(16 * by_n[128]["state_s"])
  assert by_n[8]["step_s"] - by_n[128]["step_s"] == pytest.approx(15 * by_n[128]["state_s"])
