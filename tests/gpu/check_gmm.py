"""GPU check: every unquantised expert GEMM of the registry (MaxText/gmm/) that can run on this GPU against
a float32 reference, forward and gradients.

  python tests/gpu/check_gmm.py OUT.json

An entry on equal-capacity groups (padded: moe_dispatch=capacity's layout) runs on each case's rows moved
into that layout (every group padded to the largest, zero rows) and back. Quantised entries:
check_fp8_gmm.py.

Fresh random inputs every run (seeded from os.urandom, seed recorded). Cases: DeepSeek-V3 widths with
balanced and skewed groups, empty groups, all rows in one group, group sizes that are not tile
multiples, and widths that are not tile multiples (padded by the wrapper). Freed device memory is filled
with NaN before each run (the allocator reuses it for the outputs), outputs are checked finite, then
compared by relative Frobenius error: bf16 inputs with fp32 accumulation give ~2^-8 per element at most,
averaging to well under 1e-2.
Exit code 1 if any case fails.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from MaxText import gmm

BOUND = 1e-2
# (label, M, K, N, G, group sizes): DeepSeek-V3 widths, then the edge cases (check_fp8_gmm.py's too).
CASES = [
  ("gate_up", 8192, 7168, 4096, 8, "balanced"),
  ("gate_up", 8192, 7168, 4096, 32, "skewed"),
  ("down", 8192, 2048, 7168, 8, "skewed"),
  ("gate_up", 4096, 7168, 4096, 16, "empty_groups"),
  ("gate_up", 4096, 7168, 4096, 8, "one_group"),
  ("down", 3000, 2048, 7168, 8, "odd_sizes"),
  ("narrow", 4096, 2048, 1408, 8, "skewed"),  # DeepSeek-V2-Lite's expert width: whole 128-blocks, not 256-tiles
  ("unaligned", 2000, 1000, 600, 4, "odd_sizes"),
]


def group_sizes_for(kind: str, m: int, g: int, rng) -> np.ndarray:
  if kind == "balanced":
    sizes = np.full(g, m // g)
    sizes[: m % g] += 1
  elif kind == "skewed":
    sizes = np.floor(rng.dirichlet(np.full(g, 0.5)) * m).astype(int)
    sizes[0] += m - sizes.sum()
  elif kind == "empty_groups":
    sizes = np.zeros(g, int)
    sizes[1::3] = m // len(sizes[1::3])
    sizes[1] += m - sizes.sum()
  elif kind == "one_group":
    sizes = np.zeros(g, int)
    sizes[g // 2] = m
  elif kind == "odd_sizes":  # arbitrary sizes (not tile multiples), one group empty
    sizes = rng.multinomial(m, np.full(g - 1, 1.0 / (g - 1)))
    sizes = np.insert(sizes, g // 2, 0)
  return sizes.astype(np.int32)


def inputs(m: int, k: int, n: int, g: int, kind: str, rng, dtype=jnp.bfloat16) -> tuple:
  """One case's random inputs from `rng` (check_fp8_gmm.py's too): (host group sizes, x, w, dy, device group sizes)."""
  sizes_np = group_sizes_for(kind, m, g, rng)
  sizes = jnp.asarray(sizes_np)
  keys = jax.random.split(jax.random.key(int(rng.integers(1 << 31))), 3)
  x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(dtype)
  w = (jax.random.normal(keys[1], (g, k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
  dy = jax.random.normal(keys[2], (m, n), jnp.float32).astype(dtype)
  return sizes_np, x, w, dy, sizes


def rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def reference(x, w, dy, sizes: np.ndarray):
  """float32 y, dx, dw on the host, group by group (no per-shape GPU compiles)."""
  x, w, dy = (np.asarray(a.astype(jnp.float32)) for a in (x, w, dy))
  ends = np.cumsum(sizes)
  y, dx, dw = np.zeros((x.shape[0], w.shape[2]), np.float32), np.zeros_like(x), np.zeros_like(w)
  for g, (start, end) in enumerate(zip(ends - sizes, ends)):
    y[start:end] = x[start:end] @ w[g]
    dx[start:end] = dy[start:end] @ w[g].T
    dw[g] = x[start:end].T @ dy[start:end]
  return y, dx, dw


def poison_freed_memory(nbytes: int) -> None:
  """Fill soon-to-be-reused device memory with NaN, so outputs a kernel fails to write show up as NaN."""
  junk = jnp.full((nbytes // 2,), jnp.nan, jnp.bfloat16)
  junk.block_until_ready()
  del junk


def on_capacity_layout(f, sizes: np.ndarray):
  """f, a GEMM on equal-capacity groups, on contiguous groups of `sizes`: rows gathered into G slots of the
  largest group's size (zero rows after each group's), multiplied, and gathered back (gradients through both)."""
  g, cap = len(sizes), max(1, int(sizes.max()))
  starts = np.cumsum(sizes) - sizes
  index = np.full((g, cap), -1, np.int32)  # -1: the zero row appended to x
  position = np.zeros(int(sizes.sum()), np.int32)  # each row's place in the layout
  for e in range(g):
    index[e, : sizes[e]] = starts[e] + np.arange(sizes[e])
    position[starts[e] : starts[e] + sizes[e]] = e * cap + np.arange(sizes[e])

  def fn(x, w, group_sizes):
    rows = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[jnp.where(index < 0, x.shape[0], index).ravel()]
    y = f(rows, w, jnp.full((g,), cap, jnp.int32))[position]
    return jnp.concatenate([y, jnp.zeros((x.shape[0] - y.shape[0], y.shape[1]), y.dtype)])  # rows past the groups

  return fn


def gmm_for(name: str, sizes: np.ndarray):
  f = gmm.build(name)
  return on_capacity_layout(f, sizes) if gmm.EXPERT_GEMMS[name].backend == "padded" else f


def runnable(name: str, device) -> bool:
  """Whether entry `name` can run on `device`: its package installed, its kernels made for this GPU."""
  entry = gmm.EXPERT_GEMMS[name]
  if gmm.unavailable(name) or gmm.not_runnable_on(name, device):
    return False
  return not (entry.hopper_only and device.platform != "gpu")


def run(fn, x, w, sizes, dy):
  """fn's y, dx, dw (jitted) on device memory filled with NaN first (check_fp8_gmm.py's too)."""

  @jax.jit
  def go(x, w, sizes, dy):
    y, vjp = jax.vjp(lambda x, w: fn(x, w, sizes), x, w)
    return (y, *vjp(dy))

  poison_freed_memory(4 * (x.size + w.size + dy.size) * 2)
  return go(x, w, sizes, dy)


def outcome(fn, *where) -> dict:
  """fn()'s result, printed after `where`; a path that cannot run a case fails it, with the reason
  (check_fp8_gmm.py's too)."""
  try:
    result = fn()
  except Exception as e:
    result = {"pass": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
  print(*where, result, flush=True)
  return result


def check(name, fn, x, w, sizes, dy, ref):
  y, dx, dw = run(fn, x, w, sizes, dy)
  finite = all(bool(jnp.all(jnp.isfinite(a.astype(jnp.float32)))) for a in (y, dx, dw))
  errs = {"y": rel(y, ref[0]), "dx": rel(dx, ref[1]), "dw": rel(dw, ref[2])}
  return {"finite": finite, "rel_err": errs, "pass": finite and max(errs.values()) < BOUND}


def main(out_path: str) -> int:
  seed = int.from_bytes(os.urandom(4), "little")
  rng = np.random.default_rng(seed)
  device = jax.devices()[0]
  backends = [n for n, e in gmm.EXPERT_GEMMS.items() if not e.quantization and runnable(n, device)]
  skipped = {
    n: gmm.unavailable(n) or gmm.not_runnable_on(n, device) or f"{device.platform} is no GPU"
    for n, e in gmm.EXPERT_GEMMS.items()
    if not e.quantization and n not in backends
  }
  print("skipped:", skipped, flush=True)
  results = {
    "seed": seed,
    "device": jax.devices()[0].device_kind,
    "backends": backends,
    "skipped": skipped,
    "bound": BOUND,
    "cases": [],
  }
  ok = True
  for label, m, k, n, g, kind in CASES:
    sizes_np, x, w, dy, sizes = inputs(m, k, n, g, kind, rng)
    ref = reference(x, w, dy, sizes_np)
    entry = {"case": label, "m": m, "k": k, "n": n, "groups": g, "sizes": kind, "backends": {}}
    for b in backends:
      entry["backends"][b] = outcome(lambda: check(b, gmm_for(b, sizes_np), x, w, sizes, dy, ref), label, kind, g, b)
      ok &= entry["backends"][b]["pass"]
    results["cases"].append(entry)
  results["all_pass"] = ok
  with open(out_path, "w") as f:
    json.dump(results, f, indent=1)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1]))
