"""Compiles the quantised expert GEMMs (forward + both backward GEMMs) for a compile-only GPU and prints
JSON; run by tests/test_quant.py in a subprocess whose PYTHONPATH holds the CUDA plugin.

  python tests/compile_only/lower_fp8_for_gpu.py [--gpu h200|b200] NAME [MxKxNxG ...]
  (default 4096x7168x4096x8, h200)

NAME is a quantised entry of the expert-GEMM registry (MaxText/gmm/: fp8_blockwise:mosaic, mxfp8:mosaic,
mxfp8:block_scaled, ...), or a bare quantization (fp8_blockwise, mxfp8): what quantization=NAME runs on the
GPU with moe_gmm_backend=mosaic and mxfp8_impl=auto. Where the GEMM fuses them (ExpertGemm.fuses), its
entries for rows quantised before the permute and for the down GEMM of swiglu(gate, up) are compiled too.
"""

import json
import re
import sys

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText import compile_only, gmm


def entry_for(name: str, device) -> str:
  """The registry entry NAME stands for on `device`."""
  if name in gmm.EXPERT_GEMMS:
    return name
  if name not in gmm.quantizations() or not name:
    quantised = [n for n, e in gmm.EXPERT_GEMMS.items() if e.quantization]
    raise SystemExit(f"{name}: choose a quantization or a quantised expert GEMM: {', '.join(quantised)}")
  return gmm.entry_name(name, "mosaic", gmm.resolve_mxfp8("auto", device))


def compile_one(gpu: str, name: str, m: int, k: int, n: int, g: int) -> dict:
  devices = compile_only.devices(gpu, 1)
  s = NamedSharding(Mesh(devices, ("x",)), PartitionSpec())
  f = gmm.build(entry_for(name, devices[0]))

  def fwd_bwd(x, w, sizes, dy):
    y, pullback = jax.vjp(lambda x, w: f(x, w, sizes), x, w)
    out = (y, *pullback(dy))
    if "quantized_rows" in f.fuses:  # quantize_before_permute's entry: x's rows quantised already
      y, pullback = jax.vjp(lambda x, w: f.from_quantized_rows(x, f.quantize_rows(x), w, sizes), x, w)
      out += (y, *pullback(dy))
    if "swiglu_down" in f.fuses:  # quantize_with_activation's entry: x is [gate | up], w's first half the down weight
      gate, up = jnp.split(x, 2, axis=1)
      y, pullback = jax.vjp(lambda gate, up, w: f.swiglu_down(gate, up, w, sizes), gate, up, w[:, : k // 2])
      out += (y, *pullback(dy))
    return out

  S = jax.ShapeDtypeStruct
  args = (S((m, k), jnp.bfloat16), S((g, k, n), jnp.bfloat16), S((g,), jnp.int32), S((m, n), jnp.bfloat16))
  with compile_only.lowering_for(devices):
    compiled = jax.jit(fwd_bwd, in_shardings=(s,) * 4).lower(*args).compile()
  text = compiled.as_text()
  return {
    "device_kind": devices[0].device_kind,
    "mosaic_kernels": text.count('custom_call_target="mosaic_gpu'),
    "triton_kernels": text.count('custom_call_target="__gpu$xla.gpu.triton'),
    "fp8_operands": "f8e4m3fn" in text,
    "scaled_dots": len(re.findall(r"= \S+ scaled-dot\(", text)),
    "triton_gemm_fusions": text.count('"kind":"__triton_nested_gemm_fusion"'),
    # [gate | up] split and concatenated again for the swiglu quantisation: XLA should fold it away
    "bf16_concatenates": len(re.findall(r"= bf16\[\d+,\d+\]\S* concatenate\(", text)),
  }


if __name__ == "__main__":
  args = sys.argv[1:]
  gpu = "h200"
  if args[:1] == ["--gpu"]:
    gpu, args = args[1], args[2:]
  shapes = args[1:] or ["4096x7168x4096x8"]
  print("RESULT " + json.dumps({shape: compile_one(gpu, args[0], *map(int, shape.split("x"))) for shape in shapes}))
