"""GPU lowering, checked on a CPU machine: the training step and the Mosaic grouped GEMM compile for
compile-only H200 devices (MaxText/compile_only.py). The CUDA plugin lives outside the main
environment (`make` installs requirements-gpu-aot.txt into .venv/gpu-aot), so each check runs in a
subprocess with it on PYTHONPATH."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, TINY_RECIPE

PLUGIN_SITE = Path(os.environ.get("MAXTEXT_GPU_AOT_SITE", REPO / ".venv" / "gpu-aot"))
SCRIPT = REPO / "tests" / "compile_only" / "lower_for_gpu.py"

if not (PLUGIN_SITE / "jax_plugins").is_dir():
  pytest.skip(
    f"CUDA plugin not installed in {PLUGIN_SITE}: run `make install` "
    f"(pip install --no-deps --target {PLUGIN_SITE} -r requirements-gpu-aot.txt)",
    allow_module_level=True,
  )


def lower(*args: str) -> dict:
  env = {**os.environ, "PYTHONPATH": f"{PLUGIN_SITE}:{REPO}", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  proc = subprocess.run(
    [sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
  )
  lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
  assert proc.returncode == 0 and lines, proc.stderr[-3000:]
  return json.loads(lines[-1].removeprefix("RESULT "))


def test_train_step_compiles_for_eight_h200s_with_fsdp_and_tensor_parallelism():
  # attention=cudnn_flash needs the cuDNN library at trace time, so it is checked on the GPU (tests/gpu/).
  result = lower(
    "train_step",
    str(TINY_RECIPE),
    "dtype=bfloat16",
    "ici_fsdp_parallelism=4",
    "ici_tensor_parallelism=2",
    "per_device_batch_size=2",
  )
  assert result["device_kind"] == "NVIDIA H200"
  assert result["mesh"] == {"data": 1, "fsdp": 4, "expert": 1, "tensor": 2}
  assert {"all-gather", "reduce-scatter"} <= set(result["collectives"])  # FSDP gathers weights, scatters grads
  assert result["temp_bytes"] > 0


def test_mosaic_grouped_gemm_lowers_for_h200():
  # One Mosaic GPU kernel for the forward (kernels/mosaic_gmm.py's ragged_dot); the backward adds the dgrad
  # (ragged_dot with transpose_rhs) and the wgrad (ragged_wgrad): three in all.
  result = lower("mosaic_gmm")
  assert result == {
    "device_kind": "NVIDIA H200",
    "tile_table": "mosaic_tiles_h200.json",
    "fwd_mosaic_kernels": 1,
    "fwd_bwd_mosaic_kernels": 3,
  }


def test_mosaic_grouped_gemm_lowers_for_h100_with_its_own_tiles():
  # The tiles follow the GPU the kernels are lowered for (the planner's compile-only H100), not this CPU.
  result = lower("mosaic_gmm", "h100")
  assert result == {
    "device_kind": "NVIDIA H100 80GB HBM3",
    "tile_table": "mosaic_tiles_h100.json",
    "fwd_mosaic_kernels": 1,
    "fwd_bwd_mosaic_kernels": 3,
  }


def test_permute_row_gather_reads_a_materialised_index_on_h200():
  # 2026-12-03 on an H200: with the plan's index arithmetic fused into it, the 65,536-row gather ran at
  # about a quarter of the memory bandwidth (benchmarks/results/2026-12-03-h200-moe-layer).
  result = lower("permute_gather")
  assert result["permute"] == 1
  assert result["unmaterialised"] > 1  # the check can fail: XLA does fuse the index lookups into the gather


def test_ragged_all_to_all_expert_parallelism_compiles_for_eight_h200s():
  # XLA:CPU has no ragged all-to-all, so this path is checked by compiling the MoE layer's forward
  # and backward for 8 compile-only H200s (EP=8, dedup on).
  result = lower(
    "ep_layer",
    str(TINY_RECIPE),
    "dtype=bfloat16",
    "ici_expert_parallelism=8",
    "moe_dispatch=ragged_a2a",
    "moe_dedup=true",
    "num_experts=16",
    "per_device_batch_size=2",
  )
  assert result["device_kind"] == "NVIDIA H200" and result["mesh"]["expert"] == 8
  assert "ragged-all-to-all" in result["collectives"]


def test_offloaded_activations_live_in_host_memory_on_h200(tiny_config):
  """remat_policy=custom with offload: XLA places the saved layer inputs and routed-expert gate/up rows in
  host memory (S(5)), exactly their bytes for the two scanned MoE layers."""
  from MaxText import remat

  overrides = (
    "dtype=bfloat16",
    "per_device_batch_size=2",
    "max_target_length=16",
    "mtp_num_layers=0",
    "base_num_decoder_layers=4",
    "first_num_dense_layers=2",
    "remat_policy=custom",
    "decoder_layer_input=offload",
    "moe_mlpwi_0=offload",
    "moe_mlpwi_1=offload",
  )
  result = lower("memory", str(TINY_RECIPE), *overrides)
  cfg = tiny_config(*overrides)
  dense, moe = (remat.tensor_bytes(cfg.model, cfg.moe, 2, 16, kind) for kind in ("dense", "moe"))
  expected = 2 * dense["decoder_layer_input"] + 2 * sum(moe[n] for n in remat.offloaded(cfg.model))
  assert result["host_temp_bytes"] == expected
  assert result["host_shapes"] > 0
