"""Multi-process start-up: finds this process's place in the job and starts jax.distributed.

`python -m MaxText.train` calls `initialize()` before it touches a device. Where
the coordinator, process count and process id come from, first match wins:

  explicit    JAX_COORDINATOR_ADDRESS (host:port), JAX_NUM_PROCESSES, JAX_PROCESS_ID
              (all three; scripts/launch_local.sh sets them, so can any launcher)
  SLURM       an srun step of more than one task: SLURM_STEP_NUM_TASKS, SLURM_PROCID, the first node of
              SLURM_STEP_NODELIST/SLURM_JOB_NODELIST as coordinator, a port from SLURM_JOB_ID;
              one task per GPU (SLURM_NTASKS_PER_NODE > 1) pins each task to GPU SLURM_LOCALID
  Kubernetes  an indexed Job or a JobSet with one Job: JOB_COMPLETION_INDEX is the process id,
              JAX_NUM_PROCESSES (set in the manifest: the Job's completions) the count, and
              the pod of index 0 the coordinator: this pod's DNS name with its trailing index
              replaced by 0 (`<job>-<i>.<subdomain>`, or `<jobset>-<job>-0-<i>.<subdomain>`);
              JobSets with several Job replicas set the explicit variables instead
  single      none of these: one process, no coordinator

JAX_COORDINATOR_PORT overrides the SLURM/Kubernetes port (default 8476 on Kubernetes).
A half-set explicit configuration is an error, not a silent single-process run.
"""

import os
import re
import socket
from dataclasses import dataclass

from MaxText.errors import UserError

EXPLICIT = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
K8S_PORT = 8476


@dataclass(frozen=True)
class Launch:
  source: str  # explicit | slurm | kubernetes | single
  coordinator: str | None = None
  num_processes: int = 1
  process_id: int = 0
  local_device_ids: tuple[int, ...] | None = None

  def describe(self) -> str:
    if self.num_processes == 1 and self.source == "single":
      return "single process"
    local = f", local devices {list(self.local_device_ids)}" if self.local_device_ids is not None else ""
    return f"process {self.process_id} of {self.num_processes} ({self.source}), coordinator {self.coordinator}{local}"


def _int(env: dict, name: str) -> int:
  try:
    return int(env[name])
  except ValueError:
    raise UserError(f"{name}={env[name]!r} must be an integer") from None


def first_host(nodelist: str) -> str:
  """The first host of a SLURM node list: 'gpu[012-015,020],cpu1' -> 'gpu012'."""
  m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
  if not m or not m.group(1):
    raise UserError(f"cannot read the SLURM node list {nodelist!r}")
  prefix, ranges = m.group(1), m.group(2)
  if not ranges:
    return prefix
  return prefix + ranges.split(",")[0].split("-")[0]


def _port(env: dict, default: int) -> int:
  return _int(env, "JAX_COORDINATOR_PORT") if "JAX_COORDINATOR_PORT" in env else default


def _slurm(env: dict) -> Launch:
  ntasks = _int(env, "SLURM_STEP_NUM_TASKS")
  nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
  if not nodelist:
    raise UserError("srun step with several tasks but no SLURM_STEP_NODELIST/SLURM_JOB_NODELIST")
  # A port derived from the job id, so two jobs sharing a node do not collide.
  port = _port(env, 20000 + _int(env, "SLURM_JOB_ID") % 40000 if "SLURM_JOB_ID" in env else 20000)
  per_node = env.get("SLURM_NTASKS_PER_NODE", env.get("SLURM_STEP_TASKS_PER_NODE", "1")).split("(")[0]
  local = (_int(env, "SLURM_LOCALID"),) if per_node.isdigit() and int(per_node) > 1 and "SLURM_LOCALID" in env else None
  return Launch("slurm", f"{first_host(nodelist)}:{port}", ntasks, _int(env, "SLURM_PROCID"), local)


def _kubernetes(env: dict, fqdn: str) -> Launch:
  if "JAX_NUM_PROCESSES" not in env:
    raise UserError(
      "JOB_COMPLETION_INDEX is set (a Kubernetes indexed Job) but JAX_NUM_PROCESSES is not: "
      "set it in the manifest to the Job's completions"
    )
  index = _int(env, "JOB_COMPLETION_INDEX")
  n = _int(env, "JAX_NUM_PROCESSES")
  if "JAX_COORDINATOR_ADDRESS" in env:
    return Launch("kubernetes", env["JAX_COORDINATOR_ADDRESS"], n, index)
  host, _, domain = fqdn.partition(".")
  m = re.fullmatch(r"(.+)-(\d+)", host)
  if not m or int(m.group(2)) != index:
    raise UserError(
      f"pod hostname {host!r} does not end in -{index} (JOB_COMPLETION_INDEX): set JAX_COORDINATOR_ADDRESS"
    )
  leader = f"{m.group(1)}-0" + (f".{domain}" if domain else "")
  return Launch("kubernetes", f"{leader}:{_port(env, K8S_PORT)}", n, index)


def detect(env: dict | None = None, fqdn: str | None = None) -> Launch:
  """Where this process stands, from the environment (os.environ by default)."""
  env = dict(os.environ if env is None else env)
  given = [v for v in EXPLICIT if v in env]
  if given:
    missing = [v for v in EXPLICIT if v not in env]
    if missing and "JOB_COMPLETION_INDEX" not in env:
      raise UserError(f"{', '.join(given)} set but not {', '.join(missing)}: set all three, or none")
    if not missing:
      n, i = _int(env, "JAX_NUM_PROCESSES"), _int(env, "JAX_PROCESS_ID")
      if not 0 <= i < n:
        raise UserError(f"JAX_PROCESS_ID={i} must be in [0, JAX_NUM_PROCESSES={n})")
      return Launch("explicit", env["JAX_COORDINATOR_ADDRESS"], n, i)
  # An srun step (not the batch script itself, which also sees SLURM_NTASKS but runs once).
  if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env and _int(env, "SLURM_STEP_NUM_TASKS") > 1:
    return _slurm(env)
  if "JOB_COMPLETION_INDEX" in env:
    launch = _kubernetes(env, fqdn if fqdn is not None else socket.getfqdn())
    return launch if launch.num_processes > 1 else Launch("single")
  return Launch("single")


def initialize(env: dict | None = None) -> Launch:
  """Starts jax.distributed when the job has several processes; returns what was detected."""
  launch = detect(env)
  if launch.num_processes > 1:
    import jax

    jax.distributed.initialize(
      coordinator_address=launch.coordinator,
      num_processes=launch.num_processes,
      process_id=launch.process_id,
      local_device_ids=list(launch.local_device_ids) if launch.local_device_ids is not None else None,
    )
  return launch
