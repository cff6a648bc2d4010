"""A step-time prediction for a cluster: compute at measured kernel rates, plus the communication that the
compiled schedule leaves exposed.

Compute (per GPU) is the step's model FLOPs split by kernel class, each at the rate that class ran in the
1-GPU proxy's per-scope profile on an H200 (benchmarks/results/2026-12-03-h200-proxy-profile/profile.md,
2 x 4096 tokens; scope time includes each class's glue kernels), corrected for the changes measured since:

  attention (cuDNN flash, fwd+bwd scopes)      327 TFLOP/s  77.2 ms / 1.53 (MLA's v unpadded, attention.json)
                                                            = 50.5 ms for 16.5 TFLOP (the kernel alone: 463)
  expert GEMMs, bf16 `mosaic` (gmm scopes)     604 TFLOP/s  96.2 ms - 10 ms (gate/up fused, proxy-b4)
                                                            = 86 ms for 51.9 TFLOP (kernels alone: 673-770)
    fp8_blockwise                              1.10 x bf16  docs/quantization.md: 0.99-1.23x bf16 fwd+bwd
    `xla` (ragged_dot, masked dense)           min(190, 730 / groups) TFLOP/s (2026-12-03-h200-ws-kernels:
                                               179-189 at 4 groups, 90 at 8, 22 at 32)
  dense GEMMs (MLA, dense and shared MLPs,     668 TFLOP/s  attention_out, mla_q/kv, mlp, shared_experts,
    the MTP projection)                                     router and MTP non-head scopes: 101.5 ms
  output heads, bf16 (fp32 operands: 293)      473 TFLOP/s  78.8 ms fp32, 30 ms less in bf16 (proxy-profile)
  AdamW update                                 HBM at 90% of its bandwidth (the profile's 26.8 ms for ~4 B
                                               fp32 parameters is 93%)
  everything else (norms, router, permute,     +10.2% of the GEMM and attention time: the "other",
    combine, embedding, casts)                 permute, combine, router, moe and embed scopes, 29.3 ms

These rates are fitted to the b2 profile; the prediction is checked against the later measurements of the
current recipe at 2, 4 and 5 sequences (2026-12-03-h200-proxy-b4; docs/performance.md).

Remat adds its recompute: `full` the forward of every layer again (1/3 of their training FLOPs),
`custom` / `save_dot_except_moe` the routed experts' forward, `save_dot_except_mlp` the experts' and the
MLPs'. The H100 is taken to run kernels at the H200's rates (same SMs and clocks); only its HBM bandwidth
(the optimizer) differs.

Communication: each collective's time from MaxText/plan/fabric.py, times its runs per step. A synchronous
collective, or an asynchronous one with no compute scheduled between start and done, is exposed. The
asynchronous ones with work between them hide behind compute: at most `overlap` (0.9) of the compute time,
the rest is exposed. Host offload's copies (PCIe, 54 GB/s each way, measured on the H200) overlap likewise.
"""

from dataclasses import dataclass

from MaxText import flops
from MaxText.plan import fabric as fabric_lib
from MaxText.plan.collectives import Collective, classify

# Measured H200 kernel rates, TFLOP/s (module docstring).
RATES = {
  "attention": 327.0,
  "expert_gemm_bf16": 604.0,
  "fp8_speedup": 1.10,
  "xla_ragged_dot_4_groups": 190.0,
  "xla_ragged_dot_work": 730.0,  # TFLOP/s x groups: the masked-dense ragged_dot's cost grows with the groups
  "dense_gemm": 668.0,
  "head_bf16": 473.0,
  "head_fp32": 293.0,
}
OTHER_FRACTION = 0.102  # elementwise, routing, permute, combine: 29.3 ms of the proxy's b2 profile
HBM_EFFICIENCY = 0.90
HOST_COPY_BPS = 54e9  # d2h and h2d inside jit, H200 (../shared/reference/h200-measurements-2026-12-02.md)
OVERLAP = 0.9  # of the compute time, what asynchronous collectives can hide behind
A2A_KINDS = ("all-to-all", "ragged-all-to-all")


@dataclass
class Compute:
  seconds: dict  # per kernel class
  total: float


def _dtype_bytes(name: str, default: int = 4) -> int:
  return {"float32": 4, "bfloat16": 2, "float16": 2}.get(name or "", default)


def recompute_of(m) -> dict[str, float]:
  """Extra forward passes remat adds, per FLOP class (fractions of that class's forward)."""
  p = m.remat_policy
  if p == "none":
    return {}
  if p == "full" or p in ("save_qkv_proj", "save_out_proj"):
    return {"attention": 1.0, "experts": 1.0, "dense": 1.0}
  if p == "save_dot_except_moe":
    return {"experts": 1.0}
  if p == "save_dot_except_mlp":
    return {"experts": 1.0, "dense": 0.3}
  if p == "custom":
    out = {}
    if any(getattr(m, k, "") == "remat" for k in ("moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo")):
      out["experts"] = 1.0
    if any(getattr(m, k, "") == "remat" for k in ("query_proj", "key_proj", "value_proj", "attention_out")):
      out["attention"] = 1.0
    return out
  return {"attention": 1.0, "experts": 1.0, "dense": 1.0}


def flop_classes(cfg, tokens_per_gpu: float) -> dict[str, float]:
  """Training FLOPs per GPU per step by kernel class (model FLOPs; remat not included)."""
  m, moe, s = cfg.model, cfg.moe, cfg.train.max_target_length
  attn_layers = m.base_num_decoder_layers + m.mtp_num_layers
  moe_layers = m.num_moe_layers + m.mtp_num_layers
  attention = 3 * attn_layers * flops.attention_flops_per_token(m, s)
  experts = 3 * 2 * moe_layers * 3 * m.emb_dim * moe.base_moe_mlp_dim * moe.num_experts_per_tok
  heads = 3 * 2 * m.emb_dim * m.vocab_size * (1 + m.mtp_num_layers)
  total = flops.training_flops_per_token(m, moe, s)
  dense = total - attention - experts - heads
  return {
    k: v * tokens_per_gpu for k, v in dict(attention=attention, experts=experts, dense=dense, heads=heads).items()
  }


def compute_time(cfg, gpu_spec, tokens_per_gpu: float, local_experts: int, state_bytes: dict) -> Compute:
  """Seconds of kernels per GPU per step (module docstring). state_bytes: per-GPU parameter and optimizer
  bytes on the device (the AdamW update's traffic)."""
  m, moe = cfg.model, cfg.moe
  f = flop_classes(cfg, tokens_per_gpu)
  extra = recompute_of(m)
  backend, quant = moe.moe_gmm_backend, moe.quantization
  if backend == "xla":
    gmm_rate = min(RATES["xla_ragged_dot_4_groups"], RATES["xla_ragged_dot_work"] / max(1, local_experts))
  else:
    gmm_rate = RATES["expert_gemm_bf16"] * (RATES["fp8_speedup"] if quant == "fp8_blockwise" else 1.0)
  head_rate = RATES["head_fp32"] if m.logits_dot_in_fp32 else RATES["head_bf16"]
  attn_rate = RATES["attention"] if m.attention == "cudnn_flash" else RATES["attention"] / 2  # unmeasured guess
  sec = {
    "attention": f["attention"] * (1 + extra.get("attention", 0) / 3) / (attn_rate * 1e12),
    "expert_gemms": f["experts"] * (1 + extra.get("experts", 0) / 3) / (gmm_rate * 1e12),
    "dense_gemms": f["dense"] * (1 + extra.get("dense", 0) / 3) / (RATES["dense_gemm"] * 1e12),
    "heads": f["heads"] / (head_rate * 1e12),
  }
  sec["other"] = OTHER_FRACTION * sum(sec.values())
  # AdamW: read params, grads, mu, nu; write params, mu, nu, and the bf16 compute copy of the weights.
  params = state_bytes.get("parameters", 0)
  opt = state_bytes.get("optimizer_state", 0)
  n_params = params / _dtype_bytes(m.weight_dtype)
  traffic = 2 * params + n_params * 4 + 2 * opt + n_params * 2
  sec["optimizer"] = traffic / (gpu_spec.memory_bandwidth * HBM_EFFICIENCY)
  return Compute(sec, sum(sec.values()))


def communication(collectives: list[Collective], device_ids, gpus_per_node: int, fab) -> list[dict]:
  """Each collective with its placement and its time per step."""
  out = []
  for c in collectives:
    place = classify(c, device_ids, gpus_per_node)
    t = fabric_lib.time_of(c, place, fab)
    out.append(
      {
        **c.as_dict(),
        "nodes": place.nodes,
        "per_node": place.per_node,
        "fabric": "inter-node" if place.crosses_nodes else "intra-node",
        "seconds_each": t,
        "seconds": t * c.count,
      }
    )
  return out


def serial_state_copy_bytes(memory: dict) -> float:
  """`step`'s serial_host_copy_bytes (counted in and out) for offloaded state (MaxText/host_offload.py): the
  moments cross twice, the fp32 master weights three times (in as the step starts, in again for the update,
  out), i.e. 1.5 x the two-way count."""
  return memory.get("optimizer_state_offloaded", 0) + 1.5 * memory.get("parameters_offloaded", 0)


def step(
  compute: Compute, comm: list[dict], host_copy_bytes: float = 0.0, serial_host_copy_bytes: float = 0.0,
  overlap: float = OVERLAP,
) -> dict:  # fmt: skip
  """Compute + exposed communication. Host copies go out and back every step: `host_copy_bytes` (offloaded
  activations and parameters) overlap compute; `serial_host_copy_bytes` (offloaded optimizer state, copied in
  after the backward pass and out after the update: MaxText/host_offload.py) have nothing to hide behind."""
  serial = 2 * serial_host_copy_bytes / HOST_COPY_BPS
  exposed = sum(c["seconds"] for c in comm if not c["overlapped"]) + serial
  hideable = sum(c["seconds"] for c in comm if c["overlapped"]) + 2 * host_copy_bytes / HOST_COPY_BPS
  hidden = min(hideable, overlap * compute.total)
  exposed += hideable - hidden
  return {
    "compute_s": compute.total,
    "compute_by_class_s": compute.seconds,
    "communication_s": sum(c["seconds"] for c in comm),
    "intra_node_s": sum(c["seconds"] for c in comm if c["fabric"] == "intra-node"),
    "inter_node_s": sum(c["seconds"] for c in comm if c["fabric"] == "inter-node"),
    "host_copies_s": 2 * (host_copy_bytes + serial_host_copy_bytes) / HOST_COPY_BPS,
    "overlapped_s": hidden,
    "exposed_communication_s": exposed,
    "step_s": compute.total + exposed,
  }


def moe_latency(comm: list[dict], moe_layers: int) -> dict:
  """Dispatch + combine per MoE layer: the expert-parallel all-to-alls (and the allgather dispatch's
  all-gathers, in the ep_dispatch / ep_combine scopes), forward and backward, per layer and step. The
  experts' weight gathers and gradient reduce-scatters inside the same shard_map are neither."""
  fwd = bwd = 0.0
  for c in comm:
    is_moe = c["kind"] in A2A_KINDS or (
      c["kind"] == "all-gather" and ("ep_dispatch" in c["op_name"] or "ep_combine" in c["op_name"])
    )
    if not is_moe:
      continue
    if "transpose(" in c["op_name"]:
      bwd += c["seconds"]
    else:
      fwd += c["seconds"]
  n = max(1, moe_layers)
  return {"forward_s": fwd / n, "backward_s": bwd / n, "per_layer_s": (fwd + bwd) / n}


def rescale(comm: list[dict], factor: float) -> list[dict]:
  """The same collectives on `factor` times as many nodes, weak scaling: a group that crosses nodes grows
  with the cluster (the fsdp/data axes span nodes), a group inside a node stays. Buffers keep their size
  (an all-gather gathers the same weights; a reduce-scatter reduces the same gradients)."""
  from MaxText.plan.collectives import Placement

  out = []
  for c in comm:
    if c["fabric"] != "inter-node" and not (factor < 1):
      out.append(c)
      continue
    nodes = max(1, round(c["nodes"] * factor))
    n = max(1, c["per_node"] * nodes) if c["kind"] != "collective-permute" else 2
    place = Placement(nodes, c["per_node"] if nodes > 1 else min(n, c["per_node"]), n)
    out.append({**c, "nodes": nodes, "group_size": n, "fabric": "inter-node" if nodes > 1 else "intra-node"})
    out[-1]["seconds_each"] = fabric_lib.collective_time(c["kind"], c["size"], place, c["_fabric"])
    out[-1]["seconds"] = out[-1]["seconds_each"] * c["count"]
  return out


def weak_scaling(
  compute: Compute, comm: list[dict], num_gpus: int, gpus_per_node: int, fab, host_copy_bytes=0.0, state_copy_bytes=0.0
):
  """Predicted step time and efficiency from 8 to 1,024 GPUs at the same tokens per GPU (module docstring of
  `rescale`); the optimizer's share shrinks as the state spreads over more GPUs."""
  base_nodes = max(1, num_gpus // gpus_per_node)
  rows = []
  for n_gpus in (8, 16, 32, 64, 128, 256, 512, 1024):
    if n_gpus < gpus_per_node:
      continue
    factor = (n_gpus // gpus_per_node) / base_nodes
    scaled = rescale([{**c, "_fabric": fab} for c in comm], factor)
    sec = dict(compute.seconds)
    sec["optimizer"] = sec.get("optimizer", 0.0) * num_gpus / n_gpus
    state_copies = state_copy_bytes * num_gpus / n_gpus
    s = step(Compute(sec, sum(sec.values())), scaled, host_copy_bytes, state_copies)
    rows.append(
      {
        "num_gpus": n_gpus,
        "step_s": s["step_s"],
        "exposed_communication_s": s["exposed_communication_s"],
        # the state's share: the update and the offloaded state's serial copies, per GPU's share of the state
        "state_s": sec["optimizer"] + 2 * state_copies / HOST_COPY_BPS,
      }
    )
  # Efficiency: per-GPU throughput against the smallest cluster's, the state's shrinking share excluded (it
  # favours larger clusters and is not scaling: with the 671B's optimizer state offloaded, its copies alone
  # took 8 GPUs' step to 16 times 128 GPUs' share).
  if rows:
    ref = rows[0]["step_s"] - rows[0]["state_s"]
    for r in rows:
      work = r["step_s"] - r["state_s"]
      r["efficiency"] = ref / work if work > 0 else 1.0
  return rows


def predict(
  cfg, gpu: str, gpu_spec, num_gpus: int, gpus_per_node: int, mesh_shape: dict, collectives, device_ids,
  memory: dict, fabric_file: str | None = None,
) -> dict:  # fmt: skip
  """The whole prediction for one compiled step (what the planner prints and writes to --json)."""
  fab = fabric_lib.load(gpu, fabric_file)
  tokens_per_gpu = cfg.train.per_device_batch_size * cfg.train.max_target_length  # microbatches split this
  local_experts = max(1, cfg.moe.num_experts // max(1, mesh_shape.get("expert", 1)))
  state = {"parameters": memory.get("parameters", 0), "optimizer_state": memory.get("optimizer_state", 0)}
  comp = compute_time(cfg, gpu_spec, tokens_per_gpu, local_experts, state)
  comm = communication(collectives, device_ids, gpus_per_node, fab)
  # Offloaded activations go out and back every step, overlapped; the state's copies are serial.
  state_copies = serial_state_copy_bytes(memory)
  state_offloaded = memory.get("optimizer_state_offloaded", 0) + memory.get("parameters_offloaded", 0)
  host = memory.get("host_offloaded", 0) - state_offloaded
  s = step(comp, comm, host, state_copies)
  model_flops = flops.training_flops_per_token(cfg.model, cfg.moe, cfg.train.max_target_length) * tokens_per_gpu
  tflops = model_flops / s["step_s"] / 1e12
  peak = flops.peak_tflops(gpu_spec.name) or 989.0
  moe_layers = cfg.model.num_moe_layers + cfg.model.mtp_num_layers
  exposed = sorted((c for c in comm if not c["overlapped"]), key=lambda c: -c["seconds"])[:5]
  return {
    **s,
    "tokens_per_gpu": tokens_per_gpu,
    "tokens_per_s_per_gpu": tokens_per_gpu / s["step_s"],
    "model_tflops_per_gpu": tflops,
    "mfu": tflops / peak,
    "moe_dispatch_combine_per_layer": moe_latency(comm, moe_layers),
    "weak_scaling": weak_scaling(comp, comm, num_gpus, gpus_per_node, fab, host, state_copies),
    "fabric": fabric_lib.as_dict(fab),
    "largest_exposed": [
      {k: c[k] for k in ("name", "kind", "size", "group_size", "fabric", "count", "seconds")} for c in exposed
    ],
    "collectives": [{k: v for k, v in c.items() if k != "_fabric"} for c in comm],
  }


def format_prediction(p: dict, num_gpus: int) -> list[str]:
  ms = lambda s: f"{s * 1e3:,.1f} ms"  # noqa: E731
  cls = ", ".join(f"{k} {ms(v)}" for k, v in p["compute_by_class_s"].items())
  moe = p["moe_dispatch_combine_per_layer"]
  ws = ", ".join(f"{r['num_gpus']}: {r['efficiency'] * 100:.0f}%" for r in p["weak_scaling"])
  kinds: dict = {}
  for c in p["collectives"]:
    k = kinds.setdefault(c["kind"], [0, 0.0, 0.0])
    k[0] += c["count"]
    k[1] += c["size"] * c["count"]
    k[2] += c["seconds"]
  lines = [
    f"predicted step on {num_gpus} GPUs: {ms(p['step_s'])} = compute {ms(p['compute_s'])} + exposed "
    f"communication {ms(p['exposed_communication_s'])}; {p['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
    f"{p['model_tflops_per_gpu']:,.0f} model TFLOP/s per GPU, MFU {p['mfu'] * 100:.1f}%",
    f"  compute at measured kernel rates: {cls}",
    f"  communication {ms(p['communication_s'])} per step (intra-node {ms(p['intra_node_s'])}, inter-node "
    f"{ms(p['inter_node_s'])}, host copies {ms(p['host_copies_s'])}); {ms(p['overlapped_s'])} hidden behind compute",
    *(
      f"    {k:<19} {v[0]:>5} runs {v[1] / 1e9:>9.2f} GB {ms(v[2]):>11}"
      for k, v in sorted(kinds.items(), key=lambda kv: -kv[1][2])
    ),
    f"  MoE dispatch+combine per layer: {ms(moe['per_layer_s'])} (forward {ms(moe['forward_s'])}, "
    f"backward {ms(moe['backward_s'])})",
    f"  weak scaling (same tokens/GPU): {ws}",
    f"  fabric: {p['fabric']['name']}: NVLink {p['fabric']['nvlink_busbw_GBps']:.0f} GB/s, network "
    f"{p['fabric']['net_busbw_GBps']:.0f} GB/s per GPU ({p['fabric']['source']})",
  ]
  return lines
