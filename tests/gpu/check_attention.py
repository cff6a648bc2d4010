"""GPU check: cuDNN flash attention (attention=cudnn_flash) against plain attention and a float32 reference.

  python tests/gpu/check_attention.py OUT.json

MLA shapes (q/k head 192, v head 128, 128 heads), bf16 inputs, fresh random data each run,
outputs checked finite, gradients compared too; cudnn_flash (v at its own head size where cuDNN
takes it) and cudnn_flash_padded (v zero-padded to 192) both. Then both are timed, forward and
forward+backward, at the proxy recipe's shape (2 x 4096 tokens; device time, medians).
Exit code 1 when an error bound is exceeded.
"""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.layers import mla
from MaxText.layers.mla import cudnn_flash_attention, cudnn_flash_attention_padded, dot_product_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from grouped_gemm import jax_time_ms  # noqa: E402

FLASH = {"cudnn_flash": cudnn_flash_attention, "cudnn_flash_padded": cudnn_flash_attention_padded}


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def timing(h: int, dqk: int, dv: int, scale: float, b: int = 2, s: int = 4096) -> dict:
  """fwd and fwd+bwd device ms of each flash variant, and its causal TFLOP/s (q.k and p.v at their own sizes)."""
  q, k = (jax.random.normal(jax.random.key(i), (b, s, h, dqk), jnp.bfloat16) for i in (1, 2))
  v = jax.random.normal(jax.random.key(3), (b, s, h, dv), jnp.bfloat16)
  flops = 2 * b * h * s * s / 2 * (dqk + dv)  # causal: half the score matrix
  out = {"shape": {"batch": b, "seq": s}}
  for name, fn in FLASH.items():
    fwd = jax.jit(lambda q, k, v, fn=fn: fn(q, k, v, scale))
    fwd_bwd = jax.jit(
      jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v, scale).astype(jnp.float32)), argnums=(0, 1, 2))
    )
    ms_f, timer = jax_time_ms(fwd, (q, k, v), 10)
    ms_fb, _ = jax_time_ms(fwd_bwd, (q, k, v), 10)
    out[name] = {
      "fwd_ms": ms_f,
      "fwd_bwd_ms": ms_fb,
      "fwd_tflops": flops / ms_f / 1e9,
      "fwd_bwd_tflops": 3.5 * flops / ms_fb / 1e9,
      "timer": timer,
    }
    print(name, out[name], flush=True)
  return out


def main(out: str) -> int:
  key = jax.random.key(int.from_bytes(np.random.bytes(4), "little"))
  b, s, h, dqk, dv = 2, 2048, 128, 192, 128
  kq, kk, kv, kg = jax.random.split(key, 4)
  q = jax.random.normal(kq, (b, s, h, dqk), jnp.bfloat16)
  k = jax.random.normal(kk, (b, s, h, dqk), jnp.bfloat16)
  v = jax.random.normal(kv, (b, s, h, dv), jnp.bfloat16)
  g = jax.random.normal(kg, (b, s, h, dv), jnp.float32)
  scale = dqk**-0.5

  def loss(fn, q, k, v):
    return jnp.sum(fn(q, k, v, scale).astype(jnp.float32) * g)

  results = {}
  ref = jax.jit(
    lambda q, k, v: dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), scale)
  )(q, k, v)
  ref_grads = jax.jit(
    jax.grad(
      lambda q, k, v: loss(dot_product_attention, q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)),
      argnums=(0, 1, 2),
    )
  )(q, k, v)
  ok = True
  for name, fn in (("dot_product", dot_product_attention), *FLASH.items()):
    out_arr = jax.jit(lambda q, k, v: fn(q, k, v, scale))(q, k, v)
    grads = jax.jit(jax.grad(lambda q, k, v: loss(fn, q, k, v), argnums=(0, 1, 2)))(q, k, v)
    errs = {"out": rel_err(out_arr, ref), **{f"d{n}": rel_err(gr, rg) for n, gr, rg in zip("qkv", grads, ref_grads)}}
    finite = bool(jnp.all(jnp.isfinite(out_arr.astype(jnp.float32))))
    passed = finite and all(e < 2e-2 for e in errs.values())  # bf16 inputs/outputs: ~1e-2 relative
    ok &= passed
    results[name] = {"relative_error_vs_fp32": errs, "finite": finite, "pass": passed}
  results["device"] = jax.devices()[0].device_kind
  results["shapes"] = {"batch": b, "seq": s, "heads": h, "qk_head": dqk, "v_head": dv}
  results["cudnn_takes_mla_head_sizes"] = mla._cudnn_takes_mla()
  results["timing"] = timing(h, dqk, dv, scale)
  print(json.dumps(results, indent=1))
  with open(out, "w") as f:
    json.dump(results, f, indent=1)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1]))
