"""How long a collective takes on a GPU cluster's fabric: NCCL's ring model with bandwidths per GPU kind.

time = latency + bytes on the slowest link / that link's bandwidth, where

- bytes follow nccl-tests' bus-bandwidth factors (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md): a ring
  all-gather or reduce-scatter moves (n-1)/n of the buffer through each GPU, an all-reduce 2(n-1)/n, an
  all-to-all (n-1)/n, a permute the whole buffer;
- a group that spans nodes is limited by its inter-node share: of an all-gather's (n-1)/n, the (n-m)/n that
  comes from other nodes enters through the NICs of the m group members in the node (rail-optimised:
  one NIC per GPU), so each NIC carries (n-m)/(n m) of the buffer; an all-to-all sends its (n-m)/n
  off-node share through the GPU's own NIC; NVLink carries the rest in parallel;
- latency is NCCL's own tuning model (src/graph/tuning.cc, Ring/Simple): a base of 8.4 us plus 3.4 us per
  NVLink step and 14 us per network step; a ring all-gather has n-1 steps, an all-reduce 2(n-1), of which
  N-1 (resp. 2(N-1)) cross nodes.

Bandwidths are what NCCL achieves ("bus bandwidth"), not line rates. Override any of them with a JSON or
YAML file of your own measurements (`--fabric FILE`): {"nvlink_busbw_GBps": 370, "net_busbw_GBps": 44, ...}.
"""

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from MaxText.errors import UserError
from MaxText.plan.collectives import Collective, Placement


@dataclass(frozen=True)
class Fabric:
  name: str
  nvlink_busbw_GBps: float  # NCCL ring bus bandwidth inside a node (NVLink/NVSwitch), per GPU, GB/s
  net_busbw_GBps: float  # NCCL bus bandwidth of one GPU's NIC across nodes (InfiniBand/RoCE), GB/s
  a2a_nvlink_GBps: float  # all-to-all through NVLink, per GPU, GB/s
  a2a_net_GBps: float  # all-to-all through one GPU's NIC, GB/s
  base_latency_us: float = 8.4  # NCCL tuning.cc baseLat, Ring/Simple
  nvlink_step_us: float = 3.4  # NCCL tuning.cc hwLat NVLink, Ring/Simple
  net_step_us: float = 14.0  # NCCL tuning.cc hwLat NET, Ring/Simple
  source: str = ""


# Sources of the defaults:
# - NVLink 4 (H100/H200 SXM, NVSwitch): 900 GB/s bidirectional, 450 GB/s per direction (NVIDIA H100/H200
#   datasheets). nccl-tests on 8 x H100 SXM measure all_reduce bus bandwidth of ~450-480 GB/s with NVLink SHARP
#   (NVLS) and ~360-370 GB/s with rings (all_gather/reduce_scatter); we take 360 GB/s, rings being what
#   XLA's all-gathers and reduce-scatters run.
# - Network: one ConnectX-7 NDR 400 Gb/s (50 GB/s) NIC per GPU (DGX/HGX H100 and H200 reference
#   architecture). nccl-tests across nodes reach ~45 GB/s bus bandwidth per NIC; DeepSeek's DeepEP reports
#   43-47 GB/s per NIC for its internode all-to-all dispatch/combine on H800 with the same NIC
#   (github.com/deepseek-ai/DeepEP README); we take 45 GB/s for rings and 40 GB/s for NCCL's all-to-all
#   (many small messages, no per-rank aggregation). Intra-node NCCL all-to-all: ~300 GB/s on NVSwitch
#   (DeepEP's intranode kernels reach 153-158 GB/s of NVLink on H800, whose NVLink is 400 GB/s; NCCL's
#   all-to-all on full-bandwidth NVLink 4 is taken at 2/3 of the per-direction 450 GB/s).
_HOPPER = dict(nvlink_busbw_GBps=360.0, net_busbw_GBps=45.0, a2a_nvlink_GBps=300.0, a2a_net_GBps=40.0)
FABRICS = {
  "h100": Fabric("H100 SXM, NVLink 4 + 8 x 400G NDR InfiniBand", **_HOPPER, source="defaults (module docstring)"),
  "h200": Fabric("H200 SXM, NVLink 4 + 8 x 400G NDR InfiniBand", **_HOPPER, source="defaults (module docstring)"),
  # B200: NVLink 5, 1.8 TB/s bidirectional (900 GB/s per direction), ConnectX-7/8 400G per GPU.
  "b200": Fabric(
    "B200 SXM, NVLink 5 + 8 x 400G NDR InfiniBand", 720.0, 45.0, 600.0, 40.0, source="NVLink 5 at 2x NVLink 4"
  ),
}


def load(gpu: str, path: str | None = None) -> Fabric:
  """The fabric of `gpu`, with the fields of a user's JSON/YAML file (their own measurements) replacing ours."""
  fabric = FABRICS.get(gpu, FABRICS["h100"])
  if not path:
    return fabric
  p = Path(path)
  if not p.is_file():
    raise UserError(f"--fabric {path}: no such file")
  text = p.read_text()
  try:
    if p.suffix in (".yml", ".yaml"):
      import yaml

      data = yaml.safe_load(text) or {}
    else:
      data = json.loads(text)
  except Exception as e:  # noqa: BLE001  any parse error is bad input
    raise UserError(f"--fabric {path}: cannot parse: {str(e).splitlines()[0]}") from None
  known = {f.name for f in fields(Fabric)} - {"name", "source"}
  if not isinstance(data, dict) or set(data) - known:
    raise UserError(f"--fabric {path}: unknown key(s) {sorted(set(data) - known)}; known: {', '.join(sorted(known))}")
  for k, v in data.items():
    if not isinstance(v, (int, float)) or v <= 0:
      raise UserError(f"--fabric {path}: {k}={v!r} must be a positive number")
  return replace(fabric, **{k: float(v) for k, v in data.items()}, source=f"{fabric.source}; overridden by {path}")


def as_dict(f: Fabric) -> dict:
  return asdict(f)


def collective_time(kind: str, size: float, place: Placement, f: Fabric) -> float:
  """Seconds for one collective of `size` bytes (nccl-tests' buffer) over groups placed as `place`."""
  n, nodes, m = place.group_size, place.nodes, place.per_node
  if n <= 1 or size <= 0:
    return 0.0
  nvl, net = f.nvlink_busbw_GBps * 1e9, f.net_busbw_GBps * 1e9
  if kind == "collective-permute":
    bw = net if place.crosses_nodes else nvl
    return (f.base_latency_us + (f.net_step_us if place.crosses_nodes else f.nvlink_step_us)) * 1e-6 + size / bw
  if kind in ("all-to-all", "ragged-all-to-all"):
    t_nvl = size * (m - 1) / n / (f.a2a_nvlink_GBps * 1e9)
    t_net = size * (n - m) / n / (f.a2a_net_GBps * 1e9) if nodes > 1 else 0.0
    lat = f.base_latency_us + (f.net_step_us if nodes > 1 else f.nvlink_step_us)
    return lat * 1e-6 + max(t_nvl, t_net)
  passes = 2 if kind == "all-reduce" else 1  # reduce-scatter then all-gather
  steps = passes * (n - 1)
  inter_steps = passes * (nodes - 1)
  lat = f.base_latency_us + (steps - inter_steps) * f.nvlink_step_us + inter_steps * f.net_step_us
  t_nvl = passes * size * (n - 1) / n / nvl
  t_net = passes * size * (n - m) / (n * m) / net if nodes > 1 else 0.0
  return lat * 1e-6 + max(t_nvl, t_net)


def time_of(c: Collective, place: Placement, f: Fabric) -> float:
  return collective_time(c.kind, c.size, place, f)
