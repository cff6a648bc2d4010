import json
import os
import statistics
import jax
import jax.numpy as jnp
from MaxText.quant import quantize_kernels as qk, fp8_blockwise


def device_ms(fn, args):
  from jax.experimental.mosaic.gpu import profiler

  jax.block_until_ready(fn(*args))
  _, timings = profiler.measure(fn, aggregate=False, iterations=10)(*args)
  return statistics.median(sum(ms for _, ms in it) for it in timings)


ROWS, f, out = 32768, 2048, {}
gate_up = (jax.random.normal(jax.random.key(0), (ROWS, 2 * f), jnp.float32) * 3).astype(jnp.bfloat16)
sizes = jnp.full((8,), ROWS // 8, jnp.int32)
for w in (2, 4, 8, 16):
  fn = jax.jit(
    lambda a, s, w=w: qk.quantize_rows_and_columns(
      a, fp8_blockwise.align_all_rows(s, ROWS), swiglu_of=True, num_warps=w
    )
  )
  out[f"fused_w{w}"] = device_ms(fn, (gate_up, sizes))
out["written"] = device_ms(
  jax.jit(
    lambda a, s: qk.quantize_rows_and_columns(jax.nn.silu(a[:, :f]) * a[:, f:], fp8_blockwise.align_all_rows(s, ROWS))
  ),
  (gate_up, sizes),
)
out["silu_only_xla"] = device_ms(jax.jit(lambda a: jax.nn.silu(a[:, :f]) * a[:, f:]), (gate_up,))
print(json.dumps(out))
json.dump(out, open(os.path.join(os.environ["OUT"], "swiglu_warps.json"), "w"), indent=1)
