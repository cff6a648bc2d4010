"""`python -m MaxText.aot RECIPE --gpu G --num-gpus N --search [--search-budget K]`: the configurations that
fit, ranked by predicted tokens/s per GPU.

Candidates: mesh shapes (expert parallelism inside a node or across up to 4 nodes, the rest fsdp, or a data
axis of 2 over fsdp), remat policies with host offload (`none`, `save_dot_except_moe`, the recipe's own,
`full`) and sequences per GPU (1, 2, 4). Compiling a 671B candidate takes minutes, so each is first scored
without compiling: memory from an analytic estimate (state bytes from the parameter count, activations per
token by policy), time from predict.py's compute model plus the fsdp/expert traffic of an analytic collective
list. Only the `--search-budget` best that the estimate says fit are compiled and planned in full; the table
shows both columns.
"""

import json
import sys
from dataclasses import replace
from pathlib import Path

from MaxText import flops
from MaxText.errors import UserError
from MaxText.plan import fabric as fabric_lib
from MaxText.plan import predict
from MaxText.plan.collectives import Placement

POLICIES = ("none", "save_dot_except_moe", "full")
# Activation bytes kept per token per layer by policy, in units of emb_dim x 2 bytes (bf16): from the proxy's
# measured peaks (docs/memory.md): no remat keeps ~ 60 hidden-size vectors per token per MoE layer (the top-8
# expert rows dominate), recomputing the experts ~ 14, full remat the layer input only (1, and the live layer).
ACT_VECTORS = {"none": 60.0, "save_dot_except_moe": 14.0, "full": 1.0, "custom": 1.0}


def candidates(cfg, num_gpus: int, gpus_per_node: int) -> list[dict]:
  out = []
  experts = cfg.moe.num_experts
  for ep in sorted({gpus_per_node, 2 * gpus_per_node, 4 * gpus_per_node, max(1, gpus_per_node // 2)}):
    if ep > num_gpus or num_gpus % ep or experts % ep:
      continue
    for data in (1, 2):
      fsdp = num_gpus // ep // data
      if fsdp < 1 or num_gpus % (ep * data):
        continue
      for policy in dict.fromkeys((*POLICIES, cfg.model.remat_policy)):
        for batch in (1, 2, 4):
          out.append(
            {
              "ici_expert_parallelism": ep,
              "ici_data_parallelism": data,
              "ici_fsdp_parallelism": fsdp,
              "remat_policy": policy,
              "per_device_batch_size": batch,
            }
          )
  return out


def estimate(cfg, cand: dict, gpu: str, spec, num_gpus: int, gpus_per_node: int, budget: int, fab) -> dict:
  """Analytic memory and time of one candidate (no compile)."""
  m, moe = cfg.model, cfg.moe
  n_params = (
    flops.active_weights_per_token(m, moe)
    + m.num_moe_layers * (moe.num_experts - moe.num_experts_per_tok) * 3 * m.emb_dim * moe.base_moe_mlp_dim
  )
  w = {"float32": 4, "bfloat16": 2}.get(m.weight_dtype, 4)
  mom = sum({"bfloat16": 2}.get(d, 4) for d in (cfg.optimizer.mu_dtype, cfg.optimizer.nu_dtype))
  state = n_params * (w + mom) / num_gpus
  tokens = cand["per_device_batch_size"] * cfg.train.max_target_length
  offload = cand["remat_policy"] == cfg.model.remat_policy == "custom"
  layers = m.base_num_decoder_layers + m.mtp_num_layers
  acts = tokens * m.emb_dim * 2 * ACT_VECTORS.get(cand["remat_policy"], 14.0) * (0.1 if offload else 1) * layers
  # gradients (fp32, sharded) + the largest gathered layer's weights twice (prefetch) + a working set
  layer_w = n_params / max(1, layers) * 2
  peak = state + n_params * 4 / num_gpus + 2 * layer_w / cand["ici_expert_parallelism"] + acts + 4 * 2**30
  c = replace(
    cfg,
    model=replace(m, remat_policy=cand["remat_policy"]),
    train=replace(cfg.train, per_device_batch_size=cand["per_device_batch_size"]),
  )
  local_experts = max(1, moe.num_experts // cand["ici_expert_parallelism"])
  comp = predict.compute_time(
    c,
    spec,
    tokens,
    local_experts,
    {"parameters": n_params * w / num_gpus, "optimizer_state": n_params * mom / num_gpus},
  )
  ep, fsdp, data = cand["ici_expert_parallelism"], cand["ici_fsdp_parallelism"], cand["ici_data_parallelism"]
  ep_nodes = max(1, ep // gpus_per_node)
  fsdp_place = Placement(
    max(1, fsdp // max(1, gpus_per_node // ep)), 1 if ep >= gpus_per_node else gpus_per_node // ep, fsdp
  )
  comm = []
  if fsdp > 1:  # weights gathered forward and again backward (remat), gradients reduce-scattered: overlapped
    gathers = 3 if cand["remat_policy"] != "none" else 2
    t = fabric_lib.collective_time("all-gather", n_params * 2 / ep, fsdp_place, fab) * gathers
    t += fabric_lib.collective_time("reduce-scatter", n_params * 4 / ep, fsdp_place, fab)
    comm.append({"overlapped": True, "seconds": t, "fabric": "inter-node" if fsdp_place.nodes > 1 else "intra-node"})
  if data > 1:
    t = fabric_lib.collective_time("all-reduce", n_params * 4 / num_gpus * data, Placement(data, 1, data), fab)
    comm.append({"overlapped": True, "seconds": t, "fabric": "inter-node"})
  if ep > 1:  # dispatch + combine forward and backward, each MoE layer: exposed
    rows = tokens * moe.num_experts_per_tok * m.emb_dim * 2
    place = Placement(ep_nodes, min(ep, gpus_per_node), ep)
    t = 4 * (m.num_moe_layers + m.mtp_num_layers) * fabric_lib.collective_time("all-to-all", rows, place, fab)
    comm.append({"overlapped": False, "seconds": t, "fabric": "inter-node" if ep_nodes > 1 else "intra-node"})
  s = predict.step(comp, comm)
  return {
    **cand,
    "est_peak_gib": peak / 2**30,
    "est_fits": peak <= budget,
    "est_step_s": s["step_s"],
    "est_tokens_per_s_per_gpu": tokens / s["step_s"],
  }


def main(cfg, args, overrides, plan, format_report) -> int:
  """Ranks the candidates analytically, compiles the best `--search-budget` that fit, prints the table."""
  from MaxText import compile_only
  from MaxText.config import load_config

  spec = compile_only.GPUS[args.gpu]
  fab = fabric_lib.load(args.gpu, args.fabric)
  budget = int(spec.memory_bytes * args.memory_fraction)
  per_node = min(args.num_gpus, args.gpus_per_host)
  rows = [
    estimate(cfg, c, args.gpu, spec, args.num_gpus, per_node, budget, fab)
    for c in candidates(cfg, args.num_gpus, per_node)
  ]
  rows.sort(key=lambda r: (not r["est_fits"], -r["est_tokens_per_s_per_gpu"]))
  print(
    f"search: {len(rows)} candidates, {sum(r['est_fits'] for r in rows)} fit by estimate; "
    f"compiling the best {args.search_budget}",
    flush=True,
  )
  keys = (
    "ici_expert_parallelism",
    "ici_data_parallelism",
    "ici_fsdp_parallelism",
    "remat_policy",
    "per_device_batch_size",
  )
  for r in [r for r in rows if r["est_fits"]][: max(0, args.search_budget)]:
    over = [*overrides, *(f"{k}={r[k]}" for k in keys)]
    try:
      c = load_config(args.recipe, over)
      rep = plan(c, args.gpu, args.num_gpus, args.gpus_per_host, args.memory_fraction, args.fabric)
    except UserError as e:  # a candidate the config refuses: say why, go on with the next
      print(f"search: {' '.join(over[len(overrides) :])}: {e}", flush=True)
      r["compiled_fits"], r["peak_gib"] = False, 0.0
      continue
    r["compiled_fits"] = rep["fits"]
    r["peak_gib"] = rep["memory"]["peak"] / 2**30
    if rep.get("prediction"):
      r["tokens_per_s_per_gpu"] = rep["prediction"]["tokens_per_s_per_gpu"]
      r["model_tflops_per_gpu"] = rep["prediction"]["model_tflops_per_gpu"]
  rows.sort(
    key=lambda r: (
      not r.get("compiled_fits", False),
      not r["est_fits"],
      -r.get("tokens_per_s_per_gpu", r["est_tokens_per_s_per_gpu"]),
    )
  )
  print(
    f"{'ep':>4} {'data':>4} {'fsdp':>4} {'remat':<20} {'batch':>5} {'est GiB':>8} {'est tok/s':>9} "
    f"{'GiB':>7} {'tok/s':>8} {'TFLOP/s':>7}"
  )
  for r in rows[:20]:
    comp = (
      (
        f"{r['peak_gib']:>7.1f} {r.get('tokens_per_s_per_gpu', 0):>8,.0f} {r.get('model_tflops_per_gpu', 0):>7.0f}"
        + ("" if r["compiled_fits"] else " does NOT fit")
      )
      if "compiled_fits" in r
      else ""
    )
    print(
      f"{r['ici_expert_parallelism']:>4} {r['ici_data_parallelism']:>4} {r['ici_fsdp_parallelism']:>4} "
      f"{r['remat_policy']:<20} {r['per_device_batch_size']:>5} {r['est_peak_gib']:>8.1f} "
      f"{r['est_tokens_per_s_per_gpu']:>9,.0f} {comp}"
    )
  if args.json_out:
    Path(args.json_out).write_text(json.dumps({"search": rows}, indent=1))
  best = [r for r in rows if r.get("compiled_fits")]
  if args.search_budget <= 0 and rows and rows[0]["est_fits"]:  # ranking only, nothing compiled
    print("best by estimate (not compiled): " + " ".join(f"{k}={rows[0][k]}" for k in keys))
    return 0
  if not best:
    print("error: search: no compiled candidate fits; raise --search-budget or use more GPUs", file=sys.stderr)
    return 3
  print("best: " + " ".join(f"{k}={best[0][k]}" for k in keys))
  return 0
