"""GPU check: cuDNN flash attention (attention=cudnn_flash) against plain attention and a float32 reference.

  python tests/gpu/check_attention.py OUT.json

MLA shapes (q/k head 192, v head 128, 128 heads), bf16 inputs, fresh random data each run,
outputs checked finite, gradients compared too.
Exit code 1 when an error bound is exceeded.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.layers.mla import cudnn_flash_attention, dot_product_attention


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


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
  ref = jax.jit(lambda q, k, v: dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), scale))(q, k, v)
  ref_grads = jax.jit(jax.grad(lambda q, k, v: loss(dot_product_attention, q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)), argnums=(0, 1, 2)))(q, k, v)
  ok = True
  for name, fn in (("dot_product", dot_product_attention), ("cudnn_flash", cudnn_flash_attention)):
    out_arr = jax.jit(lambda q, k, v: fn(q, k, v, scale))(q, k, v)
    grads = jax.jit(jax.grad(lambda q, k, v: loss(fn, q, k, v), argnums=(0, 1, 2)))(q, k, v)
    errs = {"out": rel_err(out_arr, ref), **{f"d{n}": rel_err(gr, rg) for n, gr, rg in zip("qkv", grads, ref_grads)}}
    finite = bool(jnp.all(jnp.isfinite(out_arr.astype(jnp.float32))))
    passed = finite and all(e < 2e-2 for e in errs.values())  # bf16 inputs/outputs: ~1e-2 relative
    ok &= passed
    results[name] = {"relative_error_vs_fp32": errs, "finite": finite, "pass": passed}
  results["device"] = jax.devices()[0].device_kind
  results["shapes"] = {"batch": b, "seq": s, "heads": h, "qk_head": dqk, "v_head": dv}
  print(json.dumps(results, indent=1))
  with open(out, "w") as f:
    json.dump(results, f, indent=1)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1]))
