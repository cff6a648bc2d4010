"""Expert parallelism (MaxText/moe/ep/) on 8 CPU devices: every backend against the single-device
sort path, outputs and gradients in float32, for balanced, random and adversarial routing; dedup on
and off; byte counts; overflow detection with a small buffer; config errors.

ragged_a2a cannot run on XLA:CPU; here jax.lax.ragged_all_to_all is replaced by a direct
implementation of its documented semantics (dense all_to_all of padded slices), so its offsets,
sizes and buffer cuts are checked numerically; the real collective's lowering is checked for 8
H200s in tests/test_gpu_lowering.py.
"""

import dataclasses
import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import params
from MaxText.errors import UserError
from MaxText.moe.dispatch import get_dispatcher
from MaxText.moe.ep.parallel import routed_ep
from MaxText import gmm
from MaxText.moe.layer import moe_specs, routed_experts
from MaxText.sharding import make_mesh

E, K, D, F = 16, 3, 16, 8  # experts, top-k, embed, expert width
BATCH, SEQ = 8, 8  # 64 tokens: 8 per device
EP, FSDP = 4, 2  # 4 expert-parallel ranks (4 experts each), two independent token groups


def _emulated_ragged_all_to_all(
  operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, axis_index_groups=None
):
  """jax.lax.ragged_all_to_all as its docstring defines it, out of dense all_to_all (runs on CPU)."""
  assert axis_index_groups is None
  n, rest = operand.shape[0], operand.shape[1:]
  r = jnp.arange(n)
  take = jnp.where(r[None, :] < send_sizes[:, None], input_offsets[:, None] + r[None, :], n)
  chunks = jnp.take(operand, take, axis=0, mode="fill", fill_value=0)  # [peers, n, ...]
  got = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)
  where = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
  dst = jnp.where(r[None, :] < recv_sizes[:, None], where[:, None] + r[None, :], output.shape[0])
  return output.at[dst.reshape(-1)].set(got.reshape(-1, *rest), mode="drop")


@pytest.fixture(autouse=True)
def _ragged_on_cpu(monkeypatch):
  monkeypatch.setattr(jax.lax, "ragged_all_to_all", _emulated_ragged_all_to_all)


def _cfg(tiny_config, *overrides):
  return tiny_config(
    f"num_experts={E}",
    f"num_experts_per_tok={K}",
    "n_routing_groups=1",
    "topk_routing_group=1",
    f"ici_expert_parallelism={EP}",
    f"ici_fsdp_parallelism={FSDP}",
    *overrides,
  ).moe


def _routing(kind: str, tokens=BATCH * SEQ, seed=0):
  rng = np.random.default_rng(seed)
  if kind == "balanced":  # every expert gets tokens*k/E copies
    ids = (np.arange(tokens * K) % E).reshape(tokens, K)
  elif kind == "random":
    ids = np.stack([rng.permutation(E)[:K] for _ in range(tokens)])
  elif kind == "one_expert":  # every token picks expert 5 (and two others)
    ids = np.stack([[5, *rng.choice([e for e in range(E) if e != 5], K - 1, replace=False)] for _ in range(tokens)])
  elif kind == "one_rank":  # every copy goes to rank 2's experts (8..11)
    ids = np.stack([8 + rng.permutation(E // EP)[:K] for _ in range(tokens)])
  w = rng.uniform(0.1, 1.0, (tokens, K)).astype(np.float32)
  return jnp.asarray(ids, jnp.int32), jnp.asarray(w)


ROUTINGS = ("balanced", "random", "one_expert", "one_rank")


def _inputs():
  p = params.initialize(moe_specs(D, _SPEC_CFG), jax.random.key(0), jnp.float32, 0.2)
  experts = {k: p[k] for k in ("wi_0", "wi_1", "wo")}
  x = jax.random.normal(jax.random.key(1), (BATCH, SEQ, D))
  cot = jax.random.normal(jax.random.key(2), (BATCH, SEQ, D))
  return experts, x, cot


@dataclasses.dataclass(frozen=True)
class _SpecCfg:  # what moe_specs reads
  num_experts: int = E
  base_moe_mlp_dim: int = F
  shared_experts: int = 0


_SPEC_CFG = _SpecCfg()
_GMM = gmm.build("xla")


def _experts(w, rows, sizes):
  return routed_experts(w, rows, sizes, _GMM)


@functools.cache
def _reference():
  sort = get_dispatcher("sort", -1)

  def f(experts, x, w, ids, cot):
    tokens = x.reshape(-1, D)
    got = sort.dispatch(tokens, ids, E)
    out = sort.combine(_experts(experts, got.rows, got.group_sizes), w, got).reshape(x.shape)
    return jnp.sum(out * cot), out

  return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))


def _ep_step(cfg, mesh):
  def f(experts, x, w, ids, cot):
    out, overflow, sent, nodedup = routed_ep(_experts, experts, x, ids, w, cfg, mesh)
    return jnp.sum(out * cot), (out, overflow, sent, nodedup)

  return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))


def _remote(ids, local=E // EP):
  """Copies and (token, rank) units that leave their token's rank, from the routing (numpy)."""
  ids = np.asarray(ids)
  home = np.arange(ids.shape[0]) // (ids.shape[0] // (EP * FSDP)) % EP  # device order: fsdp-major, then expert
  dest = ids // local
  copies = int(np.sum(dest != home[:, None]))
  units = sum(len(set(dest[t]) - {home[t]}) for t in range(ids.shape[0]))
  return copies, units


@pytest.mark.parametrize("backend", ["dense_a2a", "ragged_a2a", "allgather"])
def test_backend_equals_single_device_for_every_routing(tiny_config, backend):
  mesh = make_mesh(_cfg_mesh(tiny_config))
  experts, x, cot = _inputs()
  steps = {
    dedup: _ep_step(_cfg(tiny_config, f"moe_dispatch={backend}", f"moe_dedup={dedup}"), mesh)
    for dedup in ("false", "true")
  }
  row_bytes = D * 4
  for kind in ROUTINGS:
    ids, w = _routing(kind)
    (_, want), want_g = _reference()(experts, x, w, ids, cot)
    got = {}
    for dedup, step in steps.items():
      (_, (out, overflow, sent, nodedup)), g = step(experts, x, w, ids, cot)
      np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6, err_msg=f"{backend} dedup={dedup} {kind}")
      for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"{backend} dedup={dedup} {kind} gradient")
      assert int(overflow) == 0
      got[dedup] = (out, g, float(sent), float(nodedup))
    np.testing.assert_allclose(got["true"][0], got["false"][0], rtol=1e-6, atol=1e-6)
    copies, units = _remote(ids)
    if backend == "allgather":  # ring all-gather + reduce-scatter: blocks of T tokens each way, per device
      expected = EP * FSDP * (EP - 1) * (BATCH * SEQ // (EP * FSDP)) * (2 * row_bytes + 8 * K)
      assert got["false"][2] == got["true"][2] == expected
      continue
    assert got["false"][2] == got["false"][3] == got["true"][3] == copies * (2 * row_bytes + 8)
    assert got["true"][2] == units * (2 * row_bytes + 8 * K)  # K = min(k, local experts) slots per unit
    if kind == "one_rank":
      assert units < copies  # every token's 3 experts share one rank: dedup sends one unit for three copies


def _cfg_mesh(tiny_config):
  return tiny_config(f"ici_expert_parallelism={EP}", f"ici_fsdp_parallelism={FSDP}").mesh


@pytest.mark.parametrize("backend", ["dense_a2a", "ragged_a2a"])
def test_small_buffers_count_the_overflow(tiny_config, backend):
  mesh = make_mesh(_cfg_mesh(tiny_config))
  factor = 0.5
  cfg = _cfg(tiny_config, f"moe_dispatch={backend}", f"moe_ep_buffer_factor={factor}")
  experts, x, cot = _inputs()
  step = _ep_step(cfg, mesh)
  tokens = BATCH * SEQ // (EP * FSDP)
  ids, w = _routing("balanced")
  (_, (out, overflow, _, _)), _ = step(experts, x, w, ids, cot)
  (_, want), _ = _reference()(experts, x, w, ids, cot)
  # balanced routing needs tokens*k/R = 6 units per rank pair; 0.5x holds 3
  assert int(overflow) > 0
  ids, w = _routing("one_rank")
  (_, (out, overflow, _, _)), _ = step(experts, x, w, ids, cot)
  if backend == "dense_a2a":  # each of 8 senders has tokens*k units for rank 2 and room for ceil(0.5*tokens*k/R)
    assert int(overflow) == EP * FSDP * (tokens * K - int(np.ceil(factor * tokens * K / EP)))
  else:  # rank 2's buffer holds ceil(0.5*tokens*k) units of the EP * tokens * k sent to it, per token group
    assert int(overflow) == FSDP * (EP * tokens * K - int(np.ceil(factor * tokens * K)))
  # what did fit was computed exactly: tokens whose copies all arrived match the reference
  (_, want), _ = _reference()(experts, x, w, ids, cot)
  match = np.all(np.isclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-6), axis=-1)
  assert 0 < match.sum() < match.size


def test_config_checks(tiny_config):
  with pytest.raises(
    UserError, match="moe_dispatch='te' .* choose one of: sort, capacity, ragged_a2a, dense_a2a, allgather"
  ):
    tiny_config("moe_dispatch=te")
  with pytest.raises(UserError, match="moe_ep_buffer_factor"):
    tiny_config("moe_dispatch=dense_a2a", "moe_ep_buffer_factor=0")
  with pytest.raises(UserError, match="dropless"):
    tiny_config("moe_dispatch=allgather", "capacity_factor=1.5")
  with pytest.raises(UserError, match="not divisible by the expert-parallel size 3"):
    tiny_config("moe_dispatch=dense_a2a", "ici_expert_parallelism=3")


# ---- the whole training step ----
STEP = (
  "max_target_length=16",
  "per_device_batch_size=2",
  "learning_rate=1e-2",
  "warmup_steps_fraction=0",
  "remat_policy=none",
  "ici_expert_parallelism=4",
  "ici_fsdp_parallelism=2",
  "base_num_decoder_layers=2",
  "mtp_num_layers=0",
)  # one MoE layer: fast compiles


def _losses(cfg, steps=2):
  from MaxText.data import SyntheticData
  from MaxText.train_step import Trainer

  trainer = Trainer(cfg, make_mesh(cfg.mesh))
  data = SyntheticData(cfg.data, trainer.global_batch, cfg.train.max_target_length, cfg.model.vocab_size)
  state, step = trainer.init_state(), trainer.jit_step()
  out = []
  for i in range(steps):
    state, metrics = step(state, trainer.device_batch(data.batch(i)))
    out.append({k: float(v) for k, v in metrics.items()})
  return out


def test_train_step_with_expert_parallelism_equals_sort(tiny_config):
  reference = _losses(tiny_config(*STEP, "steps=2"))
  for overrides in (("moe_dispatch=dense_a2a", "moe_dedup=true"), ("moe_dispatch=allgather",)):
    got = _losses(tiny_config(*STEP, "steps=2", *overrides))
    for key in ("loss", "grad_norm", "expert_load_max"):
      np.testing.assert_allclose(
        [m[key] for m in got], [m[key] for m in reference], rtol=2e-5, err_msg=f"{overrides} {key}"
      )
    assert all(m["ep_overflow"] == 0 and m["ep_sent_bytes"] > 0 for m in got)
    if "moe_dedup=true" in overrides:
      assert all(m["ep_sent_bytes"] < m["ep_sent_bytes_nodedup"] for m in got)
  assert all(m["ep_sent_bytes"] == 0 for m in reference)


def test_overflow_stops_the_run_before_the_update(tiny_config, tmp_path, capsys):
  from MaxText.train import EpBufferOverflow, train

  cfg = tiny_config(
    *STEP,
    "steps=3",
    "moe_dispatch=dense_a2a",
    "moe_ep_buffer_factor=0.25",
    f"base_output_directory={tmp_path}",
    "run_name=ep",
  )
  with pytest.raises(EpBufferOverflow, match="moe_ep_buffer_factor=0.25"):
    train(cfg)
  assert "EP OVERFLOW" in capsys.readouterr().out
  assert not (tmp_path / "ep" / "checkpoints" / "1").exists()


def test_dispatch_benchmark_cpu_dry_run(tmp_path):
  import json
  import sys

  from conftest import REPO

  sys.path.insert(0, str(REPO / "benchmarks"))
  import moe_dispatch

  assert moe_dispatch.main(["--cpu-dry-run", "--out", str(tmp_path), "--routings", "skewed", "--iters", "1"]) == 0
  results = json.loads((tmp_path / "moe_dispatch.json").read_text())
  by = {(r["backend"], r["dedup"]): r for r in results["transport"]}
  assert "ragged" in by[("ragged_a2a", False)]["skipped"]
  for backend in ("dense_a2a", "allgather"):
    for dedup in (False, True):
      r = by[(backend, dedup)]
      assert r["check"] == "ok" and r["dispatch_ms"] > 0 and r["combine_ms"] > 0 and r["dispatch_of_ceiling"] > 0
  assert by[("dense_a2a", True)]["payload_bytes_per_gpu"] < by[("dense_a2a", False)]["payload_bytes_per_gpu"]
  assert by[("dense_a2a", True)]["duplicate_fraction_remote"] > 0
  assert all(
    r["fwd_bwd_ms"] > 0 and r["overflow"] == 0 for r in results["layer"] if r["backend"] in ("dense_a2a", "allgather")
  )
  assert "nvidia-smi topo -m" in (tmp_path / "moe_dispatch.md").read_text()


@pytest.mark.parametrize("reduce_dtype,dtype", [("compute", jnp.bfloat16), ("float32", jnp.float32)])
def test_expert_weight_gradients_leave_as_reduce_scatters(tiny_config, reduce_dtype, dtype):
  """Inside the shard_map each device gathers its experts' weights over fsdp; their gradient goes back as one
  reduce-scatter per weight in weight_grad_reduce_dtype (half the bytes of the all-reduce a boundary
  gather's gradient needs)."""
  mesh = make_mesh(_cfg_mesh(tiny_config))
  experts, x, cot = _inputs()
  experts = {k: v.astype(jnp.bfloat16) for k, v in experts.items()}  # the compute dtype, as the model passes them
  ids, w = _routing("random")
  cfg = _cfg(tiny_config, "moe_dispatch=dense_a2a", f"weight_grad_reduce_dtype={reduce_dtype}")
  jaxpr = jax.make_jaxpr(_ep_step(cfg, mesh))(experts, x, w, ids, cot)

  def eqns(j):
    for e in j.eqns:
      yield e
      for sub in jax.extend.core.jaxprs_in_params(e.params):
        yield from eqns(sub)

  found = list(eqns(jaxpr.jaxpr))
  local = {k: (E // EP, *v.shape[1:]) for k, v in experts.items()}  # [local experts, embed or mlp, ...] gathered
  scattered = [e for e in found if e.primitive.name == "reduce_scatter"]
  shapes = sorted(tuple(e.invars[0].aval.shape) for e in scattered if e.invars[0].aval.dtype == dtype)
  assert shapes == sorted(local.values()), [(e.invars[0].aval, e.params.get("axis_name")) for e in scattered]
  assert all(e.params["axis_name"] == ("fsdp",) for e in scattered)
  weights_summed = [e for e in found if e.primitive.name == "psum" and any(
    tuple(v.aval.shape) in local.values() for v in e.invars
  )]  # fmt: skip
  assert not weights_summed  # no all-reduce of the gathered weights' gradient
