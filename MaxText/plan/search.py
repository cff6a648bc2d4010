"""`python -m MaxText.aot RECIPE --gpu G --num-gpus N --search [--search-budget K]`: the configurations that
fit, ranked by predicted tokens/s per GPU.

Candidates: mesh shapes (expert parallelism over half a node, a node, or 2 or 4 nodes, the rest fsdp, or a
data axis of 2 over fsdp), remat policies (`none`, `save_dot_except_moe`, `full`, the recipe's own), the output
head's chunk (the recipe's `loss_chunk_tokens` or a quarter of it), sequences per GPU (1, 2, 4), and the
state's place (`STATE_PLACES`): all on the device; the optimizer state in pinned host memory
(`optimizer_memory_host_offload`: the step copies it in after the backward pass, MaxText/host_offload.py, so
it leaves the backward pass's peak; it costs its bytes over PCIe in and out every step, not overlapped; on an
H100 the 1-GPU proxy's peak fell from 63.1 to 51.0 GiB and its step grew by ~0.6 s for 2 x 15.9 GB); or the
fp32 master weights there too (`parameter_memory_host_offload`: the forward and backward passes read a
compute-dtype copy, so the device holds 2 bytes a parameter instead of 4 until the update; the weights cross
PCIe three times a step).

Compiling a 671B candidate takes minutes, so every candidate is first scored without compiling, and only
`--search-budget` of them are compiled:

  memory   exact where it can be: the parameters and optimizer state per GPU from the candidate's own
           shardings (MaxText/train_step.py's state, no compile), its float32 gradients the parameters'
           size again. The rest, the working set, from the config's shapes (`memory_terms`): the largest
           layer's gathered weights (LAYER_WEIGHT_COPIES in the compute dtype, prefetch included) and its
           float32 weight gradient before the reduce-scatter; MOE_ROW_BUFFERS [rows, emb] buffers of the
           routed experts, rows as the EP backend sizes them (worst case: MaxText/moe/ep/); one chunk of
           the output head (float32 logits, compute-dtype dlogits, the float32 head gradient, the gathered head); and
           the activations the remat policy keeps on the device, every layer. The working set is then
           calibrated against the compiled candidates (`Calibration`): a factor per tokens-per-GPU value
           compiled (least squares), linear between them, the nearest one's beyond. One factor for all did
           not do: the 671B on 128 x H200 compiled to 0.91 x the terms at 4,096 tokens per GPU and 2.3 x at
           16,384 (2026-12-06), XLA keeping more per token at larger batches than the terms count.
  time     predict.py's compute model plus the fsdp/expert traffic of an analytic collective list.

The first compile is the recipe's own configuration (the calibration); each further compile is the
best-ranked candidate that the calibrated estimate says fits and that is not compiled yet (until one is
confirmed to fit, among the tokens-per-GPU values already calibrated), and recalibrates. Each compile
prints the estimate made before it beside its compiled peak; the table marks the compiled ones.
"""

import contextlib
import io
import json
import sys
from pathlib import Path

from MaxText import flops
from MaxText.errors import UserError
from MaxText.plan import fabric as fabric_lib
from MaxText.plan import predict
from MaxText.plan.collectives import Placement

POLICIES = ("none", "save_dot_except_moe", "full")
BATCHES = (1, 2, 4)
# Compute-dtype copies of one layer's gathered weights live at once: the layer's own and the next one's,
# gathered ahead (the latency-hiding scheduler's prefetch).
LAYER_WEIGHT_COPIES = 2
# [rows, emb] compute-dtype buffers live at once in an MoE layer's backward pass: the received units
# expanded to rows, the down GEMM's output, and the gradients of both. The 671B plan on 128 x H200
# (2026-12-06, XLA's memory-usage report) holds several bf16[262144, 7168] buffers at its peak; the
# calibration absorbs the rest.
MOE_ROW_BUFFERS = 4
KEYS = (
  "ici_expert_parallelism",
  "ici_data_parallelism",
  "ici_fsdp_parallelism",
  "remat_policy",
  "loss_chunk_tokens",
  "per_device_batch_size",
  "optimizer_memory_host_offload",
  "parameter_memory_host_offload",
)
# (optimizer state, parameters) in pinned host memory: each offload in the order it saves the most per byte
# copied.
STATE_PLACES = ((False, False), (True, False), (True, True))


def _bytes(dtype: str) -> int:
  return {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 4)


def candidates(cfg, num_gpus: int, gpus_per_node: int) -> list[dict]:
  out = []
  experts = cfg.moe.num_experts
  chunk = cfg.model.loss_chunk_tokens
  chunks = dict.fromkeys((chunk, chunk // 4 if chunk >= 4 else chunk))
  for ep in sorted({gpus_per_node, 2 * gpus_per_node, 4 * gpus_per_node, max(1, gpus_per_node // 2)}):
    if ep > num_gpus or num_gpus % ep or experts % ep:
      continue
    for data in (1, 2):
      if num_gpus % (ep * data):
        continue
      fsdp = num_gpus // ep // data
      for policy in dict.fromkeys((*POLICIES, cfg.model.remat_policy)):
        for loss_chunk in chunks:
          for batch in BATCHES:
            for opt, par in STATE_PLACES:
              out.append(dict(zip(KEYS, (ep, data, fsdp, policy, loss_chunk, batch, opt, par), strict=True)))
  return out


def own_candidate(cfg, mesh_shape: dict) -> dict:
  """The recipe's own configuration as a candidate (the calibration compile)."""
  values = (
    mesh_shape["expert"],
    mesh_shape["data"],
    mesh_shape["fsdp"],
    cfg.model.remat_policy,
    cfg.model.loss_chunk_tokens,
    cfg.train.per_device_batch_size,
    cfg.train.optimizer_memory_host_offload,
    cfg.train.parameter_memory_host_offload,
  )
  return dict(zip(KEYS, values, strict=True))


def overrides_of(cand: dict) -> list[str]:
  return [f"{k}={str(cand[k]).lower() if isinstance(cand[k], bool) else cand[k]}" for k in KEYS]


def state_bytes(cfg, devices) -> dict:
  """Per-GPU bytes of the train state under cfg's mesh on `devices`, from its shardings (nothing compiled)."""
  from MaxText.sharding import make_mesh, per_device_bytes
  from MaxText.train_step import Trainer

  with contextlib.redirect_stdout(io.StringIO()):  # the Trainer names its expert GEMM: once is enough
    trainer = Trainer(cfg, make_mesh(cfg.mesh, devices))
  state, sh = trainer.abstract_state(), trainer.device_state_shardings
  return {
    "parameters": per_device_bytes(state.params, sh.params),
    "optimizer_state": per_device_bytes(state.opt_state, sh.opt_state),
    "other_state": per_device_bytes((state.bias, state.step), (sh.bias, sh.step)),
    "mesh": {a: int(n) for a, n in trainer.mesh.shape.items()},
  }


def routed_rows(moe, ep: int, tokens: int) -> int:
  """Rows of the routed experts' GEMM input on one GPU: for the EP backends, their receive buffers (the worst
  case, or moe_ep_buffer_factor x the balanced share) times the expert slots a unit carries; otherwise the
  token copies (tokens x top-k)."""
  from MaxText.moe import ep as ep_lib

  k = moe.num_experts_per_tok
  if not ep_lib.is_ep(moe.moe_dispatch):
    return tokens * k
  from MaxText.moe.ep import dense_a2a, ragged_a2a

  plan = ep_lib.EpPlan("expert", ep, moe.num_experts, k, tokens, moe.moe_dedup, moe.moe_ep_buffer_factor)
  if moe.moe_dispatch == "ragged_a2a":
    return ragged_a2a.receive_buffer(plan) * plan.slots
  if moe.moe_dispatch == "dense_a2a":
    return ep * dense_a2a.capacity(plan) * plan.slots
  return ep * tokens * min(k, plan.local_experts)  # allgather: every rank's tokens, a row per local expert


def largest_layer_params(cfg, ep: int) -> int:
  """Parameters one GPU gathers for its largest layer: the layer's weights whole (fsdp gathers them), its
  routed experts' weights divided over the expert axis."""
  import math

  from MaxText import model
  from MaxText.params import is_spec

  import jax

  specs = model.model_specs(cfg.model, cfg.moe)
  best = 0
  for stack in ("dense_layers", "moe_layers", "mtp_layers"):
    if stack not in specs:
      continue
    total = 0
    for s in jax.tree.leaves(specs[stack], is_leaf=is_spec):
      per_layer = math.prod(s.shape[1:])  # axis 0 stacks the layers
      total += per_layer // ep if "exp" in s.axes else per_layer
    best = max(best, total)
  return best


def kept_activation_bytes(cfg, rows: int) -> int:
  """Bytes the remat policy keeps on the device for the backward pass, all layers (per GPU)."""
  from MaxText import remat

  m, moe, t = cfg.model, cfg.moe, cfg.train
  batch = t.per_device_batch_size // max(1, t.gradient_accumulation_steps) or 1
  seq = t.max_target_length
  policy = m.remat_policy
  if policy == "none":
    keep = None  # everything
  elif policy == "custom":
    keep = {n for n, where in remat.custom_locations(m).items() if where == "device"}
  else:
    keep = set(remat.NAMED_PRESETS.get(policy, ()))
  layers_input_on_device = policy != "custom" or remat.custom_locations(m).get("decoder_layer_input") != "offload"
  total = 0
  stacks = (("dense", m.first_num_dense_layers), ("moe", m.num_moe_layers + m.mtp_num_layers))
  for kind, n in stacks:
    sizes = remat.tensor_bytes(m, moe, batch, seq, kind)
    if kind == "moe":  # the routed tensors have the EP buffers' rows, not tokens x top-k
      for name in ("moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo"):
        if name in sizes:
          sizes[name] = sizes[name] * rows // max(1, batch * seq * moe.num_experts_per_tok)
    kept = sum(b for name, b in sizes.items() if (keep is None or name in keep) and name != "decoder_layer_input")
    if layers_input_on_device:  # the scan carries each layer's input to the backward pass
      kept += sizes["decoder_layer_input"]
    total += n * kept
  return total


def head_bytes(cfg, tokens: int, fsdp: int) -> int:
  """The output head's loss at its peak: one chunk's float32 logits and compute-dtype dlogits, the float32 head
  gradient accumulated over the chunks, and the head gathered in the compute dtype (MaxText/layers/loss_head.py)."""
  from MaxText.layers import loss_head

  m = cfg.model
  _, rows = loss_head._layout(tokens, m.loss_chunk_tokens)
  act = _bytes(m.dtype)
  v, d = m.vocab_size, m.emb_dim
  gathered = d * v * act if fsdp > 1 else 0
  return rows * v * (4 + act) + d * v * 4 + gathered


def memory_terms(cfg, state: dict) -> dict:
  """Per-GPU bytes by term for one candidate config (module docstring). `state`: state_bytes of its mesh."""
  m, moe, t = cfg.model, cfg.moe, cfg.train
  mesh = state["mesh"]
  ep, fsdp = mesh["expert"], mesh["fsdp"]
  act = _bytes(m.dtype)
  tokens = t.per_device_batch_size * t.max_target_length // max(1, t.gradient_accumulation_steps)
  rows = routed_rows(moe, ep, tokens)
  layer = largest_layer_params(cfg, ep)
  return {
    "parameters": state["parameters"],
    "optimizer_state": state["optimizer_state"],
    "optimizer_offloaded": t.optimizer_memory_host_offload,
    "parameters_offloaded": t.parameter_memory_host_offload,
    # what the forward and backward passes hold of offloaded parameters: their compute-dtype copy
    "compute_parameters": state["parameters"] * act // _bytes(m.weight_dtype),
    "other_state": state["other_state"],
    # the gradients have the parameters' shardings, and their dtype; of offloaded parameters, the compute
    # dtype's until the update reads them (the step differentiates the cast copy; the 671B on 128 x H100,
    # 2026-12-07: the peak fell by 24.2 GiB for 21.4 GiB of fp32 weights)
    "gradients": state["parameters"] * act // _bytes(m.weight_dtype)
    if t.parameter_memory_host_offload
    else state["parameters"],
    "layer_weights": layer * (LAYER_WEIGHT_COPIES * act + 4),
    "moe_buffers": MOE_ROW_BUFFERS * rows * m.emb_dim * act,
    "head": head_bytes(cfg, tokens, fsdp),
    "activations": kept_activation_bytes(cfg, rows),
    "tokens": tokens,  # per GPU: what the calibration is indexed by (and expert parallelism, below)
    "expert": ep,
  }


WORKING = ("layer_weights", "moe_buffers", "head", "activations")


def working(terms: dict) -> float:
  return sum(terms[k] for k in WORKING)


def whole_state(terms: dict) -> float:
  """The state and gradients: what the device holds during the optimizer update."""
  return terms["parameters"] + terms["optimizer_state"] + terms["other_state"] + terms["gradients"]


def on_device_state(terms: dict) -> float:
  """What the device holds of the state and gradients beside the working set: offloaded optimizer state
  arrives only after the backward pass, when the working set is gone; offloaded parameters are there as
  their compute-dtype copy until then."""
  held = whole_state(terms) - (terms["optimizer_state"] if terms["optimizer_offloaded"] else 0)
  if terms["parameters_offloaded"]:
    held += terms["compute_parameters"] - terms["parameters"]
  return held


def serial_copy_bytes(terms: dict) -> float:
  """Offloaded state's host copies, not overlapped (predict.serial_state_copy_bytes)."""
  return predict.serial_state_copy_bytes(
    {
      "optimizer_state_offloaded": terms["optimizer_state"] if terms["optimizer_offloaded"] else 0,
      "parameters_offloaded": terms["parameters"] if terms["parameters_offloaded"] else 0,
    }
  )


def peak_estimate(terms: dict, scale: float) -> float:
  """The step's peak: state + gradients + the working set times its calibration factor, or the update's."""
  return max(on_device_state(terms) + scale * working(terms), whole_state(terms))


class Calibration:
  """The working set's factor as a function of tokens per GPU, from (tokens, analytic, compiled, expert)
  points. Where the candidate's expert parallelism has compiled points of its own, only those count: the
  terms miss by different factors at different expert widths (the 671B on 128 x H100, 2026-12-07: 0.80 at
  expert 8, ~1.2 at expert 16, ~0.86 at expert 4, all at 4,096 tokens per GPU)."""

  def __init__(self):
    self.points: list[tuple[int, float, float, int | None]] = []

  def add(self, tokens: int, analytic: float, compiled: float, expert: int | None = None) -> None:
    self.points.append((tokens, analytic, compiled, expert))

  def by_tokens(self, expert: int | None = None) -> dict[int, float]:
    """Factor per tokens-per-GPU value compiled, from the points of `expert` if it has any, else all."""
    points = [p for p in self.points if expert is not None and p[3] == expert] or self.points
    groups: dict[int, list] = {}
    for t, a, c, _ in points:
      groups.setdefault(t, []).append((a, c))
    return {t: fit_scale(groups[t]) for t in sorted(groups)}

  def scale(self, tokens: int, expert: int | None = None) -> float:
    known = self.by_tokens(expert)
    if not known:
      return 1.0
    ts = list(known)
    if tokens <= ts[0]:
      return known[ts[0]]
    if tokens >= ts[-1]:
      return known[ts[-1]]
    hi = next(t for t in ts if t >= tokens)
    lo = ts[ts.index(hi) - 1]
    return known[lo] + (known[hi] - known[lo]) * (tokens - lo) / (hi - lo)

  def describe(self) -> str:
    known = self.by_tokens()
    if not known:
      return "working set as the terms give it (nothing compiled)"
    experts = sorted({p[3] for p in self.points if p[3] is not None})
    return (
      "working set x "
      + ", ".join(f"{v:.3f} at {t:,} tokens/GPU" for t, v in known.items())
      + (" (linear between, the nearest beyond)" if len(known) > 1 else " (every batch)")
      + (
        "; by expert parallelism: "
        + "; ".join(f"{e}: " + ", ".join(f"{v:.3f} at {t:,}" for t, v in self.by_tokens(e).items()) for e in experts)
        if len(experts) > 1
        else ""
      )
    )


def fit_scale(points: list[tuple[float, float]]) -> float:
  """Least-squares factor s minimising sum (compiled_i - s x analytic_i)^2 over (analytic, compiled) working sets."""
  den = sum(a * a for a, _ in points)
  return sum(a * c for a, c in points) / den if den > 0 else 1.0


def time_estimate(cfg, cand: dict, terms: dict, spec, num_gpus: int, gpus_per_node: int, fab) -> dict:
  """Analytic step time of one candidate (no compile): compute at measured rates, fsdp/expert traffic."""
  m, moe = cfg.model, cfg.moe
  n_params = (
    flops.active_weights_per_token(m, moe)
    + m.num_moe_layers * (moe.num_experts - moe.num_experts_per_tok) * 3 * m.emb_dim * moe.base_moe_mlp_dim
  )
  tokens = cand["per_device_batch_size"] * cfg.train.max_target_length
  ep, fsdp, data = cand["ici_expert_parallelism"], cand["ici_fsdp_parallelism"], cand["ici_data_parallelism"]
  local_experts = max(1, moe.num_experts // ep)
  comp = predict.compute_time(
    cfg, spec, tokens, local_experts, {"parameters": terms["parameters"], "optimizer_state": terms["optimizer_state"]}
  )
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
  # Offloaded activations' host copies: in the compiled candidates' prediction; the offloaded state's, serial.
  s = predict.step(comp, comm, 0.0, serial_copy_bytes(terms))
  return {"est_step_s": s["step_s"], "est_tokens_per_s_per_gpu": tokens / s["step_s"]}


def _gib(n: float) -> str:
  return f"{n / 2**30:.1f} GiB"


def _offload(cand: dict) -> str:
  """The table's state-offload column: none, the optimizer state, or it and the master weights."""
  if cand["parameter_memory_host_offload"]:
    return "opt+wts" if cand["optimizer_memory_host_offload"] else "wts"
  return "opt" if cand["optimizer_memory_host_offload"] else "-"


def _describe(cand: dict) -> str:
  return " ".join(overrides_of(cand))


def _composition(terms: dict, scale: float) -> str:
  moments = (
    f" (optimizer state {_gib(terms['optimizer_state'])} in host memory)"
    if terms["optimizer_offloaded"]
    else f" + optimizer state {_gib(terms['optimizer_state'])}"
  )
  weights = (
    f"parameters {_gib(terms['compute_parameters'])} (their compute-dtype copy; {_gib(terms['parameters'])} in "
    "host memory)"
    if terms["parameters_offloaded"]
    else f"parameters {_gib(terms['parameters'])}"
  )
  return (
    f"{weights}{moments} + gradients {_gib(terms['gradients'])} + working set "
    f"{_gib(scale * working(terms))} (layer weights {_gib(scale * terms['layer_weights'])}, MoE buffers "
    f"{_gib(scale * terms['moe_buffers'])}, head {_gib(scale * terms['head'])}, activations "
    f"{_gib(scale * terms['activations'])})"
  )


class Search:
  """The candidates of one cluster, their estimates, and the compiles that check them."""

  def __init__(self, recipe: str, overrides: list[str], gpu: str, num_gpus: int, gpus_per_host: int, budget: int, fab):
    """budget: the allocator's limit on each GPU (compile_only.allocator_limit), which the compiles aim for."""
    from MaxText import compile_only

    self.recipe, self.overrides, self.gpu, self.num_gpus = recipe, list(overrides), gpu, num_gpus
    self.per_node = min(num_gpus, gpus_per_host)
    self.gpus_per_host, self.budget, self.fab = gpus_per_host, budget, fab
    self.spec = compile_only.GPUS[gpu]
    self.devices = {num_gpus: compile_only.devices(gpu, num_gpus, gpus_per_host, memory_limit=budget)}
    self._states: dict = {}
    self.cal = Calibration()
    self._base_model = None
    self._policy_cfgs: dict = {}

  def config(self, cand: dict):
    from MaxText import remat
    from MaxText.config import load_config

    extra = []
    if cand["remat_policy"] != "custom":  # the recipe's per-tensor remat keys act only under custom: back to base.yml's
      if self._base_model is None:
        self._base_model = load_config(None).model
      extra = [f"{k}={getattr(self._base_model, k)}" for k in remat.tensor_keys()]
    return load_config(self.recipe, [*self.overrides, *overrides_of(cand), *extra])

  def quick_config(self, cand: dict):
    """cand's config for the estimate: the recipe loaded once per remat policy (parsing the recipe's YAML
    costs ~0.1 s, hundreds of times over), the candidate's other keys replaced. The compile loads it whole."""
    import dataclasses

    from MaxText.config_schema import key_index

    policy = cand["remat_policy"]
    if policy not in self._policy_cfgs:
      self._policy_cfgs[policy] = self.config(cand)
    cfg = self._policy_cfgs[policy]
    index = key_index()
    sections: dict = {}
    for k in KEYS:
      sections.setdefault(index[k][0], {})[k] = cand[k]
    return dataclasses.replace(
      cfg, **{sec: dataclasses.replace(getattr(cfg, sec), **vals) for sec, vals in sections.items()}
    )

  def terms(self, cfg, cand: dict, num_gpus: int) -> dict:
    """memory_terms of cand's config `cfg` on num_gpus GPUs (the state's bytes cached per mesh)."""
    from MaxText import compile_only

    if num_gpus not in self.devices:
      self.devices[num_gpus] = compile_only.devices(self.gpu, num_gpus, self.gpus_per_host, memory_limit=self.budget)
    key = (num_gpus, cand["ici_expert_parallelism"], cand["ici_data_parallelism"], cand["ici_fsdp_parallelism"])
    if key not in self._states:
      self._states[key] = state_bytes(cfg, self.devices[num_gpus])
    return memory_terms(cfg, self._states[key])

  def score(self, row: dict) -> None:
    """(Re)computes a row's memory estimate under the current calibration."""
    scale = self.cal.scale(row["_terms"]["tokens"], row["_terms"]["expert"])
    row["est_peak_gib"] = peak_estimate(row["_terms"], scale) / 2**30
    row["est_fits"] = row["est_peak_gib"] * 2**30 <= self.budget


def _public(row: dict) -> dict:
  return {k: v for k, v in row.items() if not k.startswith("_")}


def main(cfg, args, overrides, plan, format_report) -> int:
  """Estimates every candidate, compiles the recipe's own configuration (calibration) and then the best
  `--search-budget` - 1 candidates the calibrated estimate says fit; prints the table."""
  from MaxText import compile_only

  fab = fabric_lib.load(args.gpu, args.fabric)
  spec_budget = compile_only.allocator_limit(args.gpu, args.memory_fraction)
  s = Search(args.recipe, overrides, args.gpu, args.num_gpus, args.gpus_per_host, spec_budget, fab)
  own_state = state_bytes(cfg, s.devices[args.num_gpus])
  own = own_candidate(cfg, own_state["mesh"])
  cands = candidates(cfg, args.num_gpus, s.per_node)
  if own not in cands:
    cands.insert(0, own)
  rows, refused = [], {}
  for cand in cands:
    try:
      c = s.quick_config(cand)
      terms = s.terms(c, cand, args.num_gpus)
    except (UserError, ValueError) as e:  # a combination the config refuses: counted, not ranked
      refused[str(e).splitlines()[0][:160]] = refused.get(str(e).splitlines()[0][:160], 0) + 1
      continue
    rows.append(
      {**cand, "_cfg": c, "_terms": terms, **time_estimate(c, cand, terms, s.spec, args.num_gpus, s.per_node, fab)}
    )
  own_row = next((r for r in rows if all(r[k] == own[k] for k in KEYS)), None)
  for r in rows:
    s.score(r)
  print(
    f"search: {len(rows)} candidates ({sum(refused.values())} refused by the config), "
    f"{sum(r['est_fits'] for r in rows)} fit by the uncalibrated estimate; compiling up to {args.search_budget}",
    flush=True,
  )
  for why, n in refused.items():
    print(f"search: refused {n}: {why}", flush=True)

  def compile_row(r: dict, why: str) -> None:
    before = r["est_peak_gib"]
    try:
      rep = plan(s.config(r), args.gpu, args.num_gpus, args.gpus_per_host, args.memory_fraction, args.fabric)
    except UserError as e:  # a candidate the compiler path refuses: say why, go on with the next
      print(f"search: {_describe(r)}: {e}", flush=True)
      r["compiled_fits"], r["peak_gib"] = False, None
      return
    m = rep["memory"]
    r["compiled"] = rep["compiled"]
    r["compiled_fits"] = rep["fits"]
    r["peak_gib"] = m["peak"] / 2**30
    r["est_before_compile_gib"] = before
    r["involuntary_rematerializations"] = len(rep.get("involuntary_rematerializations", []))
    if rep["compiled"]:
      t = r["_terms"]
      s.cal.add(t["tokens"], working(t), m["peak"] - on_device_state(t), t["expert"])
    if rep.get("prediction"):
      p = rep["prediction"]
      r["tokens_per_s_per_gpu"] = p["tokens_per_s_per_gpu"]
      r["model_tflops_per_gpu"] = p["model_tflops_per_gpu"]
      r["step_s"] = p["step_s"]
      r["exposed_communication_s"] = p["exposed_communication_s"]
    err = (before / r["peak_gib"] - 1) * 100 if r["peak_gib"] else 0.0
    print(
      f"search: compiled ({why}) {_describe(r)}: peak {r['peak_gib']:.1f} GiB, estimated {before:.1f} GiB before "
      f"the compile ({err:+.0f}%); {'fits' if r['compiled_fits'] else 'does NOT fit'}"
      + (f"; predicted {r['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU" if "tokens_per_s_per_gpu" in r else "")
      + (
        f"; {r['involuntary_rematerializations']} involuntary full rematerialization(s)"
        if r["involuntary_rematerializations"]
        else ""
      )
      + f"; calibration now: {s.cal.describe()}",
      flush=True,
    )
    for row in rows:
      s.score(row)

  compiles = 0
  if args.search_budget > 0 and own_row is not None:
    compile_row(own_row, "the recipe's own configuration: calibration")
    compiles += 1
  while compiles < args.search_budget:
    nxt = next_to_compile(rows, s.budget, set(s.cal.by_tokens()), worst_underestimate(rows))
    if nxt is None:
      break
    compile_row(nxt, f"best by estimate, {compiles + 1} of {args.search_budget}")
    compiles += 1

  def table_key(r):
    # compiled and fitting, then fitting by estimate (by tokens/s); then compiled and not fitting, then the
    # rest (by memory: what comes closest)
    if r.get("compiled_fits") or (r["est_fits"] and "compiled_fits" not in r):
      return (0 if r.get("compiled_fits") else 1, -r.get("tokens_per_s_per_gpu", r["est_tokens_per_s_per_gpu"]))
    return (2 if "compiled_fits" in r else 3, r.get("peak_gib") or r["est_peak_gib"])

  rows.sort(key=table_key)
  print(f"calibration ({len(s.cal.points)} compiled candidate(s)): {s.cal.describe()}")
  print(
    f"{'ep':>4} {'data':>4} {'fsdp':>4} {'remat':<20} {'chunk':>5} {'batch':>5} {'offload':>8} {'est GiB':>8} "
    f"{'est tok/s':>9} {'GiB':>7} {'tok/s':>8} {'TFLOP/s':>7}"
  )
  for r in rows[:20]:
    comp = ""
    if "compiled_fits" in r:
      if r["peak_gib"] is None:
        comp = "refused"
      else:
        comp = (
          f"{r['peak_gib']:>7.1f} {r.get('tokens_per_s_per_gpu', 0):>8,.0f} {r.get('model_tflops_per_gpu', 0):>7.0f}"
        )
        comp += " compiled: fits" if r["compiled_fits"] else " compiled: does NOT fit"
    print(
      f"{r['ici_expert_parallelism']:>4} {r['ici_data_parallelism']:>4} {r['ici_fsdp_parallelism']:>4} "
      f"{r['remat_policy']:<20} "
      f"{r['loss_chunk_tokens']:>5} {r['per_device_batch_size']:>5} "
      f"{_offload(r):>8} {r['est_peak_gib']:>8.1f} "
      f"{r['est_tokens_per_s_per_gpu']:>9,.0f} {comp}"
    )
  if args.json_out:
    Path(args.json_out).write_text(
      json.dumps(
        {
          "search": [_public(r) for r in rows],
          "calibration": {"by_tokens_per_gpu": s.cal.by_tokens(), "points": s.cal.points},
        },
        indent=1,
      )
    )
  best = [r for r in rows if r.get("compiled_fits")]
  if best:
    print("best (compiled, fits): " + _describe(best[0]))
    return 0
  if args.search_budget <= 0 and rows and rows[0]["est_fits"]:  # ranking only, nothing compiled
    print("best by estimate (not compiled): " + _describe(rows[0]))
    return 0
  print(why_nothing_fits(s, rows, args.num_gpus), file=sys.stderr)
  return 3


def worst_underestimate(rows: list[dict]) -> float:
  """How much the worst estimate made before a compile fell short (0.21: the compile 21% over it), 0 if none."""
  misses = [r["peak_gib"] / r["est_before_compile_gib"] - 1 for r in rows if r.get("peak_gib")]
  return max([0.0, *misses])


def next_to_compile(rows: list[dict], budget: int, calibrated: set, miss: float) -> dict | None:
  """The candidate to compile next: the fastest by estimate of those that fit by it and are not compiled yet.
  Until a compile has confirmed a fit, only those whose tokens per GPU are calibrated (while there are such),
  and of those only the ones that would still fit were their estimate as far under as the worst so far (while
  there are such): a compile spent at the budget's edge confirms nothing (the 671B on 128 x H100: compiles 21%
  over the estimate at expert 16 and 12% at expert 8 used the three compiles on candidates estimated at
  68.7-74.0 GiB of 75.2, while ones estimated at 58.6-63.8 GiB went untried; one of them compiles at 55.6)."""
  open_rows = [r for r in rows if r["est_fits"] and "compiled_fits" not in r]
  open_rows.sort(key=lambda r: -r["est_tokens_per_s_per_gpu"])
  if not any(r.get("compiled_fits") for r in rows):
    open_rows = [r for r in open_rows if r["_terms"]["tokens"] in calibrated] or open_rows
    open_rows = [r for r in open_rows if r["est_peak_gib"] * 2**30 * (1 + miss) <= budget] or open_rows
  return open_rows[0] if open_rows else None


def why_nothing_fits(s: Search, rows: list[dict], num_gpus: int) -> str:
  """One `error:` line: the compiles ran out before one fitted (the best estimate not compiled, and how to
  compile it), or nothing fits (the smallest candidate, what it holds, and what twice the GPUs would need)."""
  untried = [r for r in rows if r["est_fits"] and "compiled_fits" not in r]
  if untried:
    best = max(untried, key=lambda r: r["est_tokens_per_s_per_gpu"])
    compiled = sum("compiled_fits" in r for r in rows)
    return (
      f"error: search: none of the {compiled} compiled candidate(s) fits {s.budget / 2**30:.1f} GiB per GPU, and "
      f"{len(untried)} not compiled fit by the calibrated estimate; the best, {_describe(best)}, is estimated at "
      f"{best['est_peak_gib']:.1f} GiB and {best['est_tokens_per_s_per_gpu']:,.0f} tokens/s/GPU: compile it "
      f"(python -m MaxText.aot {s.recipe} --gpu {s.gpu} --num-gpus {num_gpus} "
      f"{' '.join([*s.overrides, _describe(best)])}) or search with "
      "a larger --search-budget"
    )
  small = min(rows, key=lambda r: r.get("peak_gib") or r["est_peak_gib"])
  line = (
    f"error: search: nothing fits {s.budget / 2**30:.1f} GiB per GPU; the smallest, {_describe(small)}, needs "
    f"{(small.get('peak_gib') or small['est_peak_gib']):.1f} GiB"
    + (" (compiled)" if small.get("peak_gib") else " (estimated)")
    + f": {_composition(small['_terms'], s.cal.scale(small['_terms']['tokens'], small['_terms']['expert']))}"
  )
  more = 2 * num_gpus
  try:
    cand = {**{k: small[k] for k in KEYS}, "ici_fsdp_parallelism": small["ici_fsdp_parallelism"] * 2}
    terms = s.terms(s.config(cand), cand, more)
    scale = s.cal.scale(terms["tokens"], terms["expert"])
    line += f"; on {more} GPUs it would need {peak_estimate(terms, scale) / 2**30:.1f} GiB (estimated)"
  except (UserError, ValueError):
    pass
  return line
