"""The planner, `python -m MaxText.aot` (compile-only GPUs on this CPU machine): the optimized 671B recipe
fits 128 x H200 (a shallow variant here; the full 61 layers with MAXTEXT_SLOW_TESTS=1), a too-small
cluster fails with one clear line and exit code 3, bad input exits 2; and the FLOP counter it uses."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from conftest import REPO
from MaxText import step_flops

PLUGIN_SITE = REPO / ".venv" / "gpu-aot"
OPTIMIZED = "recipes/deepseek_v3_671b/optimized.yml"
SHALLOW = [
  "base_num_decoder_layers=3",
  "first_num_dense_layers=1",
]  # 1 dense + 2 MoE layers (offload needs a stack of 2) + MTP
needs_plugin = pytest.mark.skipif(
  not (PLUGIN_SITE / "jax_plugins").is_dir() and "MAXTEXT_GPU_AOT_SITE" not in os.environ,
  reason=f"CUDA plugin not installed in {PLUGIN_SITE}: make install",
)
slow = pytest.mark.skipif(
  os.environ.get("MAXTEXT_SLOW_TESTS") != "1", reason="full-depth 671B compile: set MAXTEXT_SLOW_TESTS=1"
)


def aot(*args: str, out=None) -> tuple[subprocess.CompletedProcess, dict | None]:
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "PYTHONPATH": str(REPO)}
  env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
  cmd = [sys.executable, "-m", "MaxText.aot", *args] + (["--json", str(out)] if out else [])
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
  return proc, json.loads(out.read_text()) if out and out.exists() else None


@needs_plugin
def test_optimized_671b_shallow_fits_128_h200(tmp_path):
  proc, r = aot(OPTIMIZED, "--gpu", "h200", "--num-gpus", "128", *SHALLOW, out=tmp_path / "plan.json")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert r["device_kind"] == "NVIDIA H200" and r["hosts"] == 16 and r["compiled"] and r["fits"]
  assert r["mesh"] == {"data": 1, "fsdp": 16, "expert": 8, "tensor": 1}
  m = r["memory"]
  assert m["memory_fraction"] == 0.95  # the recipe's env_presets: mem_fraction_95
  assert 0 < m["parameters"] < m["optimizer_state"] <= 2 * m["parameters"] + 1024  # fp32 weights, AdamW mu + nu
  assert m["temporaries"] > 0 and m["peak"] <= m["budget"]
  assert m["host_offloaded"] > 0  # offload.yml keeps layer inputs and attention projections in host memory
  f = r["flops_per_step_per_gpu"]
  # The traced count misses Pallas kernels without a cost estimate (the fp8 Mosaic GEMMs): it is a floor
  # then, and only with every kernel counted does remat's recompute make it exceed the model FLOPs.
  assert f["traced"] > 0 and f["model"] > 0
  assert r["uncounted_kernels"] > 0 or f["traced"] >= f["model"]
  assert r["precision_for_peak"] == "fp8" and r["lower_bound_step_s"]["step"] > 0
  # The embedding lookup gathers its table first (model.embed_tokens): XLA replicates nothing.
  assert r["involuntary_rematerializations"] == [], r["involuntary_rematerializations"]
  assert "XLA partitioner: no involuntary full rematerialization" in proc.stdout
  assert "fits" in proc.stdout.splitlines()[-1]
  assert "Compiling the training step for 128 x h200 (compile-only) ..." in proc.stdout  # and a heartbeat while it runs
  assert "Compiling the training step for 128 x h200 (compile-only): done in" in proc.stdout


@slow
@needs_plugin
def test_optimized_671b_full_depth_fits_128_h200(tmp_path):
  proc, r = aot(OPTIMIZED, "--gpu", "h200", "--num-gpus", "128", out=tmp_path / "plan.json")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert r["fits"] and r["memory"]["peak"] <= r["memory"]["budget"]


@needs_plugin
def test_too_small_cluster_fails_with_one_clear_line(tmp_path):
  # The full 671B on one 8 x H100 host: its train state alone is ~1 TB per GPU, so nothing is compiled.
  proc, r = aot(OPTIMIZED, "--gpu", "h100", "--num-gpus", "8", out=tmp_path / "plan.json")
  assert proc.returncode == 3, proc.stdout + proc.stderr
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and errors[0].startswith("error: does not fit: the train state alone needs"), proc.stderr
  assert "over the budget" in errors[0] and "h100" in errors[0]
  assert r["fits"] is False and r["memory"]["peak"] > r["memory"]["budget"]
  assert "does NOT fit" in proc.stdout


@pytest.mark.parametrize(
  "args, message",
  [
    ((OPTIMIZED, "--gpu", "a100", "--num-gpus", "8"), "--gpu a100: unknown GPU; choose one of: h100, h200"),
    ((OPTIMIZED, "--gpu", "h200"), "the following arguments are required: --num-gpus"),
    ((OPTIMIZED, "--gpu", "h200", "--num-gpus", "12"), "--num-gpus 12 is not a multiple of 8 GPUs per host"),
    (("configs/none.yml", "--gpu", "h200", "--num-gpus", "8"), "does not exist"),
    ((OPTIMIZED, "--gpu", "h200", "--num-gpus", "8", "num_expert=3"), "did you mean 'num_experts'"),
    (
      (OPTIMIZED, "--gpu", "h200", "--num-gpus", "8", "--search-budget", "2"),
      "--search-budget is an option of --search",
    ),
    ((OPTIMIZED, "--gpu", "h200", "--num-gpus", "8", "--search", "--search-budget", "-1"), "must be >= 0"),
  ],
)
def test_bad_input_is_one_error_line_and_exit_2(args, message):
  proc, _ = aot(*args)
  assert proc.returncode == 2, proc.stdout + proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], proc.stderr


def test_help_names_every_option():
  proc, _ = aot("--help")
  assert proc.returncode == 0, proc.stderr
  usage = proc.stdout.strip().splitlines()[-1]
  for option in ("--gpus-per-host", "--gpus-per-node", "--memory-fraction", "--fabric", "--search", "--search-budget"):
    assert option in usage, usage
  assert "--search [--search-budget K]" in proc.stdout and "optimizer_memory_host_offload=true" in proc.stdout


def test_the_budget_is_the_allocators_limit_and_the_compile_aims_for_it():
  """The budget is what XLA's allocator may hold: CUDA's total memory (less than nvidia-smi's) times the memory
  fraction. The topology the planner compiles for states the memory from which XLA's compile derives the same
  rematerialisation limit as on a GPU, where the client passes the allocator's limit (XLA takes 80% of a
  description's memory when compiling for a topology)."""
  from MaxText import compile_only

  # The bytes_limit an H200 reported at XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 (2026-12-02-h200-remat-offload).
  assert compile_only.allocator_limit("h200", 0.95) == 142_606_336_000
  for gpu, spec in compile_only.GPUS.items():
    assert spec.cuda_total_bytes < spec.memory_bytes, gpu
  limit = compile_only.allocator_limit("h100", 0.95)
  stated = compile_only.description_memory(limit)
  assert abs(stated * compile_only.XLA_TOPOLOGY_MEMORY_SHARE - limit) <= 1
  assert f"device_memory_size: {stated}\n" in compile_only.target_config("h100", device_memory_size=stated)
  assert f"device_memory_size: {compile_only.GPUS['h100'].memory_bytes}\n" in compile_only.target_config("h100")
  assert compile_only.description_memory(None) is None


@needs_plugin
def test_offloaded_state_is_planned_where_the_gpu_holds_it(tmp_path):
  """Compile-only GPUs have no host memory: the planner compiles the step without the offloaded state and
  makes it on the device where the step copies it from the host (the moments after the backward pass, the
  master weights as the step starts and again then). With the moments offloaded, the peak is the one without
  offload less the moments (which the tiny model's backward pass outweighs); with the weights too, less half
  the weights. On several GPUs the programs schedule differently, so the comparison is on one
  (tests/test_host_offload.py checks the sharded case)."""
  plans = {}
  offloads = {
    "none": (),
    "opt": ("optimizer_memory_host_offload=true",),
    "all": ("optimizer_memory_host_offload=true", "parameter_memory_host_offload=true"),
  }
  for name, keys in offloads.items():
    out = tmp_path / f"{name}.json"
    proc, plans[name] = aot("recipes/deepseek_v3_tiny.yml", "--gpu", "h100", "--num-gpus", "1", *keys, out=out)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  on, off, all_off = (plans[k]["memory"] for k in offloads)
  assert off["optimizer_state_offloaded"] == off["host_offloaded"] == on["optimizer_state"] > 0
  assert on["arguments"] - off["arguments"] == on["optimizer_state"]  # not an argument of the planned step
  saved = on["peak"] - off["peak"]
  assert 0.95 * on["optimizer_state"] <= saved <= 1.05 * on["optimizer_state"], (saved, on["optimizer_state"])
  # The master weights too: the forward and backward passes hold their bfloat16 copy, half their fp32 bytes.
  assert all_off["parameters_offloaded"] == on["parameters"] > 0 and "parameters_offloaded" not in off
  assert all_off["host_offloaded"] == on["parameters"] + on["optimizer_state"]
  saved = off["peak"] - all_off["peak"]
  half = on["parameters"] / 2
  assert 0.9 * half <= saved <= 1.05 * half, (saved, half)
  assert "fp32 weights as the step starts, cast to the compute dtype" in proc.stdout


def test_flop_count_multiplies_scan_bodies_and_counts_the_backward():
  def f(w, x):
    return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0].sum()

  w, x = jnp.ones((5, 32, 32)), jnp.ones((16, 32))
  one_matmul = 2 * 16 * 32 * 32
  assert step_flops.step_flops(f, w, x).flops == 5 * one_matmul
  # backward: dx and dw per layer, so 3x the forward
  assert step_flops.step_flops(jax.grad(f, argnums=(0, 1)), w, x).flops == 3 * 5 * one_matmul
  # remat: the forward runs again in the backward pass
  g = jax.checkpoint(lambda w, x: f(w, x))
  assert step_flops.step_flops(jax.grad(g, argnums=(0, 1)), w, x).flops == 4 * 5 * one_matmul


def test_flop_count_of_ragged_dot_forward_and_gradients():
  x, w, sizes = jnp.ones((64, 32)), jnp.ones((4, 32, 24)), jnp.array([16, 16, 16, 16], jnp.int32)
  f = lambda x, w: jax.lax.ragged_dot(x, w, sizes).sum()  # noqa: E731
  forward = 2 * 64 * 32 * 24  # each row meets one group's matrix
  assert step_flops.step_flops(f, x, w).flops == forward
  assert step_flops.step_flops(jax.grad(f, argnums=(0, 1)), x, w).flops == 3 * forward  # dgrad + wgrad


def test_pallas_kernels_are_reported_not_counted():
  from MaxText import gmm  # traced only: Mosaic GPU kernels need no GPU to build a jaxpr

  x, w, sizes = (
    jnp.ones((256, 128), jnp.bfloat16),
    jnp.ones((2, 128, 128), jnp.bfloat16),
    jnp.array([128, 128], jnp.int32),
  )
  count = step_flops.step_flops(jax.grad(lambda x, w: gmm.build("mosaic")(x, w, sizes).sum(), argnums=(0, 1)), x, w)
  assert (
    count.uncounted_kernels == 3 and count.flops == 0
  )  # forward, dgrad, wgrad kernels; their insides are not matmuls we can count
