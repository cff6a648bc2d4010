"""One-off (stop 20): the swiglu quantisation kernel on the GPU against the written activation's path."""

import json
import os
import statistics
import jax
import jax.numpy as jnp
import numpy as np
from MaxText.quant import quantize_kernels as qk, fp8_blockwise


def device_ms(fn, args):
  from jax.experimental.mosaic.gpu import profiler

  jax.block_until_ready(fn(*args))
  _, timings = profiler.measure(fn, aggregate=False, iterations=10)(*args)
  return statistics.median(sum(ms for _, ms in it) for it in timings)


ROWS, out = 32768, {}
for f in (2048, 1024):
  gate_up = (jax.random.normal(jax.random.key(f), (ROWS, 2 * f), jnp.float32) * 3).astype(jnp.bfloat16)
  gate_up = gate_up.at[5, 7].set(jnp.nan).at[300, f + 9].set(jnp.inf)
  sizes = jnp.full((8,), ROWS // 8, jnp.int32)
  fused = jax.jit(lambda a, s: qk.quantize_rows_and_columns(a, fp8_blockwise.align_all_rows(s, ROWS), swiglu_of=True))
  written = jax.jit(
    lambda a, s: qk.quantize_rows_and_columns(qk.swiglu(a[:, :f], a[:, f:]), fp8_blockwise.align_all_rows(s, ROWS))
  )
  xla_silu = jax.jit(
    lambda a, s: qk.quantize_rows_and_columns(jax.nn.silu(a[:, :f]) * a[:, f:], fp8_blockwise.align_all_rows(s, ROWS))
  )
  got, want = fused(gate_up, sizes), written(gate_up, sizes)
  res = {
    "fused_ms": device_ms(fused, (gate_up, sizes)),
    "swiglu_written_then_quantised_ms": device_ms(written, (gate_up, sizes)),
    "jax_nn_silu_written_then_quantised_ms": device_ms(xla_silu, (gate_up, sizes)),
  }
  for name, a, b in zip(
    ("rows_q", "rows_scale", "cols_q", "cols_scale"),
    (got[0].q, got[0].scale, got[1].q, got[1].scale),
    (want[0].q, want[0].scale, want[1].q, want[1].scale),
  ):
    a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
    diff = ~((a == b) | (np.isnan(a) & np.isnan(b)))
    res[f"{name}_differing"] = int(diff.sum())
    res[f"{name}_elements"] = int(a.size)
    if "q" in name and diff.any():  # how far apart: in units of the e4m3 step at the larger value
      fa, fb = a[diff], b[diff]
      res[f"{name}_max_rel_diff"] = float(np.max(np.abs(fa - fb) / np.maximum(np.abs(fa), np.abs(fb))))
  res["nan_rows_scale"] = bool(np.isnan(np.asarray(got[0].scale)[5, 0])) and bool(
    np.isnan(np.asarray(got[0].scale)[300, 0])
  )
  out[f"{ROWS}x{2 * f}"] = res
  print(f, json.dumps(res), flush=True)
json.dump(out, open(os.path.join(os.environ["OUT"], "swiglu_check.json"), "w"), indent=1)
