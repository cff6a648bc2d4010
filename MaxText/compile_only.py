"""Compile-only GPU devices: compile for H100/H200/B200 GPUs on a machine without them.

XLA's CUDA plugin can describe a GPU topology from a target config (the device
facts its compiler needs) instead of from attached GPUs; JAX's
`topologies.get_topology_desc` turns that into devices that jit can lower and
compile for, but not run on. Used by the GPU-lowering tests (and the planner).
The CUDA plugin must be importable (requirements-gpu-aot.txt, installed with
--no-deps); CUDA itself is not needed.
"""

from dataclasses import dataclass

from MaxText.errors import UserError


@dataclass(frozen=True)
class GpuSpec:
  name: str  # device_kind as the driver reports it
  memory_bytes: int  # nvidia-smi's memory.total
  cuda_total_bytes: int  # the total CUDA reports (less what the driver keeps): XLA's allocator takes its fraction of it
  memory_bandwidth: int  # bytes/s
  sms: int = 132
  l2_bytes: int = 50 * 2**20
  clock_ghz: float = 1.98
  capability: int = 9  # compute capability major: 9 Hopper, 10 Blackwell (sm_100)


# Hopper SXM parts: same SM count and clocks; they differ in HBM size and bandwidth. B200 (HGX): used to
# check what XLA compiles for Blackwell (mxfp8's block-scaled products); never run here.
# cuda_total_bytes, measured: H200 from the allocator's bytes_limit at XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
# (142,606,336,000; benchmarks/results/2026-12-02-h200-remat-offload); H100 from the rematerialisation limit XLA
# logged compiling on one (78,868,003,306 bytes, benchmarks/results/2026-12-07-h100-proxy-v129k) against the one
# it logs compiling the same step here for a known memory size (the docstring of `devices`). B200: not
# measured; nvidia-smi's total less the H200's 613 MiB.
GPUS = {
  "h100": GpuSpec("NVIDIA H100 80GB HBM3", 85_520_809_984, 85_018_438_602, 3_352_320_000_000),
  "h200": GpuSpec("NVIDIA H200", 150_754_820_096, 150_111_932_632, 4_800_000_000_000),
  "b200": GpuSpec(
    "NVIDIA B200",
    192_265_846_784,
    192_265_846_784 - 613 * 2**20,
    8_000_000_000_000,
    sms=148,
    l2_bytes=126 * 2**20,
    clock_ghz=1.965,
    capability=10,
  ),
}

# XLA's GPU compiler, given no memory size in the module's config (as when compiling for a topology), takes this
# share of the device description's memory as the base of its scheduler and rematerialisation limit.
XLA_TOPOLOGY_MEMORY_SHARE = 0.8


def allocator_limit(gpu: str, memory_fraction: float) -> int:
  """The bytes XLA's allocator may hold on `gpu` at XLA_PYTHON_CLIENT_MEM_FRACTION=memory_fraction."""
  return int(GPUS[gpu].cuda_total_bytes * memory_fraction)


def target_config(
  gpu: str, cuda_major: int = 13, cudnn: tuple[int, int] = (9, 12), device_memory_size: int | None = None
) -> str:
  """A stream_executor.GpuTargetConfigProto in text form for `gpu`. XLA reads the cuDNN version from
  gpu_device_info.dnn_version (without it, passes that need cuDNN, such as the block-scaled dot rewrite,
  are off); dnn_version_info is the older field. device_memory_size: the memory the description states (default
  nvidia-smi's total)."""
  s = GPUS[gpu]
  return f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {s.sms}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {s.memory_bandwidth}
  l2_cache_size: {s.l2_bytes}
  clock_rate_ghz: {s.clock_ghz}
  device_memory_size: {device_memory_size or s.memory_bytes}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: {s.capability} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  dnn_version: "{cudnn[0]}.{cudnn[1]}.0"
}}
runtime_version {{ major: {cuda_major} }}
platform_name: "CUDA"
dnn_version_info {{ major: {cudnn[0]} minor: {cudnn[1]} }}
device_description_str: "{s.name}"
"""


def devices(gpu: str, num_gpus: int, gpus_per_host: int = 8, memory_limit: int | None = None) -> list:
  """`num_gpus` compile-only devices of kind `gpu`, `gpus_per_host` to a host.

  memory_limit: the allocator's limit the run will have (`allocator_limit`). On a GPU, the PjRt client gives XLA
  that limit as the module's memory size, from which XLA derives the memory its scheduler and its
  rematerialisation under memory pressure aim for; a step that does not fit is rematerialised there until it does
  (or cannot be). Compiling for a topology, XLA takes 80% of the description's memory instead, so the description
  states memory_limit / 0.8 and the compile here aims for the same limit as the one on the GPU (checked on an H100:
  73.43 GiB here, 73.45 GiB there). Without it, the description states nvidia-smi's total."""
  if gpu not in GPUS:
    raise UserError(f"--gpu {gpu}: unknown GPU; choose one of: {', '.join(GPUS)}")
  per_host = min(num_gpus, gpus_per_host)
  if num_gpus % per_host:
    raise UserError(f"--num-gpus {num_gpus} is not a multiple of {per_host} GPUs per host")
  from jax.experimental import topologies

  try:
    config = target_config(gpu, device_memory_size=description_memory(memory_limit))
    topo = topologies.get_topology_desc(
      f"{gpu}x{num_gpus}", "cuda", target_config=config, topology=f"1x{num_gpus // per_host}x{per_host}"
    )
  except (NotImplementedError, RuntimeError) as e:
    raise UserError(
      "compile-only GPU devices need the CUDA plugin of this jaxlib "
      f"(pip install --no-deps -r requirements-gpu-aot.txt): {str(e).splitlines()[0]}"
    ) from None
  return list(topo.devices)


def description_memory(memory_limit: int | None) -> int | None:
  """The memory a topology's description states so that XLA's compile for it aims for `memory_limit`."""
  return None if memory_limit is None else int(memory_limit / XLA_TOPOLOGY_MEMORY_SHARE)


def lowering_for(devices: list):
  """A context to lower and compile for compile-only `devices` in: Pallas Triton kernels (fp8's
  quantisation, kernels/triton_quantize.py) take the GPU they compile for from JAX's default device,
  which is this machine's CPU otherwise."""
  import jax

  return jax.default_device(devices[0])
