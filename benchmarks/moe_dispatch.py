"""Expert-parallel dispatch/combine on every local GPU (EP = N), DeepSeek-V3 widths, every backend.

  python3 benchmarks/moe_dispatch.py --out DIR                   # N GPUs of this host, EP=N
  python3 benchmarks/moe_dispatch.py --out DIR --cpu-dry-run     # 8 host CPU devices, tiny shapes

Shapes: hidden 7168 bf16, 256 experts (256/N per GPU), top-8, 4096 and 8192 tokens per GPU. Routing:
`balanced` (each token draws 8 distinct experts uniformly) and `skewed` (expert popularity from
Dirichlet(0.3), seed 0, 8 distinct experts per token drawn by Gumbel top-k). For each expert-parallel
backend of MaxText/moe/ep/ (ragged_a2a, dense_a2a, allgather, ...; where it can run) with dedup off and on:

  dispatch / combine ms   median over --iters of the jitted step alone, after warm-up (host wall
                          time around block_until_ready: collectives include their waiting)
  bytes                   per GPU, sent to other GPUs: the wire bytes (dense_a2a ships its whole
                          buffers; the others only what they hold) and the payload (rows that carry
                          a copy); dedup's reduction beside the routing's duplicate fraction
                          (1 - units / copies, measured from the actual routing)
  GB/s                    wire bytes / time, per GPU, beside a plain jax.lax.all_to_all of the same
                          bytes (the ceiling) and the ratio to it

Before timing, each backend's dispatch -> "experts" (row * (expert id + 1)) -> combine is checked
against a float32 host reference of the same routing (bf16 tolerance): a wrong offset, a lost or
doubled copy fails the row (`check` in the JSON), and nothing else of that row is reported as good.
Then the whole MoE layer (router, shared expert, dispatch, grouped GEMMs, combine) forward+backward
with EP=N for each backend (dedup off/on), from MaxText/moe/layer.py with `--gmm` (a moe_gmm_backend of
MaxText/gmm/; default auto, decided for the device).
Writes DIR/moe_dispatch.json and DIR/moe_dispatch.md (with `nvidia-smi topo -m`).
On one GPU (EP=1) every "collective" stays on the GPU: the rows record the local permute costs.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "benchmarks"))

import machine  # noqa: E402

FULL = {"hidden": 7168, "experts": 256, "k": 8, "tokens": (4096, 8192), "moe_mlp": 2048, "dtype": "bfloat16"}
DRY = {"hidden": 64, "experts": 32, "k": 4, "tokens": (32,), "moe_mlp": 32, "dtype": "float32"}


def ep_backends() -> tuple[str, ...]:
  """The expert-parallel dispatch backends (moe_dispatch values), as MaxText/moe/ep/ registers them."""
  from MaxText.moe import ep

  return tuple(ep.BACKENDS)


def routing(kind: str, tokens: int, experts: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(seed)
  if kind == "balanced":
    logp = np.zeros(experts)
  else:
    logp = np.log(np.random.default_rng(seed).dirichlet(np.full(experts, 0.3)) + 1e-12)
  scores = logp[None, :] + rng.gumbel(size=(tokens, experts))
  ids = np.argpartition(-scores, k - 1, axis=1)[:, :k].astype(np.int32)
  w = rng.uniform(0.05, 1.0, (tokens, k)).astype(np.float32)
  return ids, w / w.sum(1, keepdims=True)


def duplicate_fraction(ids: np.ndarray, ranks: int, local: int) -> tuple[float, float]:
  """(1 - units/copies) over copies that leave their rank, and over all copies."""
  tokens = ids.shape[0]
  home = np.arange(tokens) // (tokens // ranks)
  dest = ids // local
  remote = dest != home[:, None]
  units_remote = sum(len(set(dest[t][remote[t]])) for t in range(tokens))
  units_all = sum(len(set(dest[t])) for t in range(tokens))
  return 1 - units_remote / max(1, remote.sum()), 1 - units_all / ids.size


def time_ms(fn, args, iters: int) -> float:
  import jax

  jax.block_until_ready(fn(*args))
  jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append((time.perf_counter() - start) * 1e3)
  return statistics.median(samples)


def wire_bytes(backend: str, plan, received, row_bytes: int) -> tuple[float, float]:
  """(dispatch, combine) bytes one GPU sends to the others."""
  r = plan.ranks
  if backend == "dense_a2a":
    from MaxText.moe.ep import dense_a2a

    c = dense_a2a.capacity(plan)
    return (r - 1) * c * (row_bytes + 8 * plan.slots), (r - 1) * c * row_bytes
  sent = float(np.mean(np.asarray(received.sent_bytes)))  # both ways, payload: row + 8*S out, row back
  if backend == "allgather":
    return (r - 1) * plan.tokens * (row_bytes + 8 * plan.k), (r - 1) * plan.tokens * row_bytes
  back = sent * row_bytes / (2 * row_bytes + 8 * plan.slots)
  return sent - back, back


def transport_rows(shape: dict, tokens: int, kind: str, iters: int, ceiling) -> list[dict]:
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  from MaxText.moe import ep

  devices = jax.devices()
  ranks, e, k, d = len(devices), shape["experts"], shape["k"], shape["hidden"]
  local = e // ranks
  dtype = jnp.dtype(shape["dtype"])
  mesh = Mesh(np.asarray(devices), ("expert",))
  spec = NamedSharding(mesh, P("expert"))
  ids_np, w_np = routing(kind, tokens * ranks, e, k)
  x_np = np.random.default_rng(1).standard_normal((tokens * ranks, d)).astype(np.float32)
  x, ids, w = (jax.device_put(a, spec) for a in (x_np.astype(dtype), ids_np, w_np))
  want = x_np.astype(dtype).astype(np.float32) * np.sum(w_np * (ids_np + 1), axis=1, keepdims=True)
  dup_remote, dup_all = duplicate_fraction(ids_np, ranks, local)
  row_bytes = d * dtype.itemsize
  rows = []
  for backend in ep_backends():
    for dedup in (False, True):
      row = {
        "backend": backend,
        "dedup": dedup,
        "tokens_per_gpu": tokens,
        "routing": kind,
        "ranks": ranks,
        "duplicate_fraction_remote": dup_remote,
        "duplicate_fraction_all": dup_all,
      }
      rows.append(row)
      if problem := ep.unavailable(backend, devices[0].platform):
        row["skipped"] = problem
        print(row, flush=True)
        break
      try:
        row.update(_one_backend(backend, dedup, ranks, e, k, tokens, mesh, x, ids, w, want, row_bytes, iters, ceiling))
      except (
        Exception
      ) as err:  # one backend failing (e.g. out of memory at worst-case buffers) must not hide the others
        row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
      print(row, flush=True)
  return rows


def _one_backend(backend, dedup, ranks, e, k, tokens, mesh, x, ids, w, want, row_bytes, iters, ceiling) -> dict:
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  from MaxText.moe import ep

  module = ep.get_backend(backend)
  plan = ep.EpPlan("expert", ranks, e, k, tokens, dedup, BUFFER_FACTOR)
  lead = lambda tree: jax.tree.map(lambda a: a[None], tree)  # noqa: E731  one block per GPU
  strip = lambda tree: jax.tree.map(lambda a: a[0], tree)  # noqa: E731

  def dispatch(x, ids, w):
    return lead(module.dispatch(x, ids, w, plan))

  def experts(received):  # row * (global expert id + 1): checks that every copy reached its expert
    r = strip(received)
    ends = jnp.cumsum(r.group_sizes)
    e_local = jnp.searchsorted(ends, jnp.arange(r.rows.shape[0]), side="right")
    scale = (jax.lax.axis_index("expert") * plan.local_experts + e_local + 1).astype(jnp.float32)
    return (r.rows.astype(jnp.float32) * scale[:, None]).astype(r.rows.dtype)[None]

  def combine(y, received):
    return module.combine(y[0], strip(received), plan)

  sm = lambda f, n: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("expert"),) * n, out_specs=P("expert")))  # noqa: E731
  d_fn, e_fn, c_fn = sm(dispatch, 3), sm(lambda r: experts(r), 1), sm(combine, 2)
  received = d_fn(x, ids, w)
  out = np.asarray(c_fn(e_fn(received), received), np.float32)
  overflow = int(np.sum(np.asarray(received.overflow)))
  err = float(np.max(np.abs(out - want)) / (np.max(np.abs(want)) + 1e-30))
  ok = overflow == 0 and np.isfinite(out).all() and err < (2e-2 if x.dtype == jnp.bfloat16 else 1e-5)
  result = {"check": "ok" if ok else f"FAILED: max rel err {err:.3g}, overflow {overflow}", "overflow": overflow}
  dispatch_ms = time_ms(d_fn, (x, ids, w), iters)
  y = received.rows
  combine_ms = time_ms(c_fn, (y, received), iters)
  out_b, back_b = wire_bytes(backend, plan, received, row_bytes)
  payload = float(np.mean(np.asarray(received.sent_bytes)))
  nodedup = float(np.mean(np.asarray(received.sent_bytes_nodedup)))
  result.update(
    {
      "dispatch_ms": dispatch_ms,
      "combine_ms": combine_ms,
      "dispatch_bytes_per_gpu": out_b,
      "combine_bytes_per_gpu": back_b,
      "payload_bytes_per_gpu": payload,
      "payload_bytes_per_gpu_without_dedup": nodedup,
      "dedup_byte_reduction": 1 - payload / nodedup if nodedup else 0.0,
      "dispatch_GBps": out_b / dispatch_ms / 1e6,
      "combine_GBps": back_b / combine_ms / 1e6,
    }
  )
  for what, nbytes in (("dispatch", out_b), ("combine", back_b)):
    ceil_ms = ceiling(nbytes)
    result[f"{what}_ceiling_GBps"] = nbytes / ceil_ms / 1e6 if ceil_ms else None
    result[f"{what}_of_ceiling"] = (ceil_ms / result[f"{what}_ms"]) if ceil_ms else None
  return result


def make_ceiling(iters: int, row_bytes: int, dtype):
  """ms of a plain jax.lax.all_to_all moving `nbytes` per GPU to the others (cached by size)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  devices = jax.devices()
  ranks = len(devices)
  mesh = Mesh(np.asarray(devices), ("expert",))
  fn = jax.jit(
    jax.shard_map(
      lambda a: jax.lax.all_to_all(a, "expert", 1, 1, tiled=True),
      mesh=mesh,
      in_specs=P("expert"),
      out_specs=P("expert"),
    )
  )
  cache = {}

  def ceiling(nbytes: float) -> float | None:
    if ranks == 1 or nbytes <= 0:
      return None
    per_peer = max(1, int(np.ceil(nbytes / (ranks - 1) / row_bytes)))
    if per_peer not in cache:
      a = jax.device_put(
        jnp.zeros((ranks, ranks * per_peer, row_bytes // jnp.dtype(dtype).itemsize), dtype),
        NamedSharding(mesh, P("expert")),
      )
      cache[per_peer] = time_ms(fn, (a,), iters) * nbytes / ((ranks - 1) * per_peer * row_bytes)
      del a
    return cache[per_peer]

  return ceiling


def layer_rows(shape: dict, tokens: int, iters: int, gmm: str) -> list[dict]:
  """The whole MoE layer, forward+backward, EP=N, each backend and dedup setting."""
  import jax
  import jax.numpy as jnp

  from MaxText import params
  from MaxText.config import load_config
  from MaxText import gmm as registry
  from MaxText.moe import ep
  from MaxText.moe.layer import moe, moe_specs
  from MaxText.sharding import Sharder, make_mesh, param_shardings

  devices = jax.devices()
  resolved = registry.resolve("", gmm, "auto", devices[0], shape["dtype"])
  backend_gmm, why = resolved.backend, resolved.why
  rows = []
  for backend in ("sort", *ep_backends()):
    for dedup in (False, True):
      row = {
        "backend": backend,
        "dedup": dedup,
        "tokens_per_gpu": tokens,
        "gmm": backend_gmm,
        "gmm_why": why,
        "ranks": len(devices),
      }
      rows.append(row)
      if backend == "sort" and len(devices) > 1:
        row["skipped"] = "the single-device path (EP=1 only)"
        break
      if backend == "sort" and dedup:
        break
      if problem := ep.unavailable(backend, devices[0].platform) if ep.is_ep(backend) else None:
        row["skipped"] = problem
        break
      try:
        cfg = load_config(
          REPO / "recipes" / "deepseek_v3_tiny.yml",
          [
            f"base_emb_dim={shape['hidden']}",
            f"num_experts={shape['experts']}",
            f"num_experts_per_tok={shape['k']}",
            f"base_moe_mlp_dim={shape['moe_mlp']}",
            "shared_experts=1",
            f"moe_dispatch={backend}",
            f"moe_dedup={str(dedup).lower()}",
            f"moe_ep_buffer_factor={BUFFER_FACTOR}",
            f"moe_gmm_backend={backend_gmm}",
            f"dtype={shape['dtype']}",
            "n_routing_groups=8" if shape["experts"] % 8 == 0 else "n_routing_groups=1",
            "topk_routing_group=4" if shape["experts"] % 8 == 0 else "topk_routing_group=1",
            "ici_fsdp_parallelism=1",
            "ici_expert_parallelism=-1",
            "load_balance_loss_weight=0",
          ],
        )
        mesh = make_mesh(cfg.mesh)
        shard = Sharder(mesh)
        specs = moe_specs(shape["hidden"], cfg.moe)
        dtype = jnp.dtype(shape["dtype"])
        p = jax.jit(
          lambda: params.initialize(specs, jax.random.key(0), dtype, 0.02), out_shardings=param_shardings(specs, mesh)
        )()
        x = jax.device_put(
          jax.random.normal(jax.random.key(1), (len(devices), tokens, shape["hidden"]), dtype),
          shard.named(("batch", "seq", "act_embed")),
        )
        bias = jnp.zeros((shape["experts"],), jnp.float32)

        def loss(p, x):
          out, stats = moe(p, x, bias, cfg.moe, shard)
          return jnp.mean(out.astype(jnp.float32) ** 2), stats.ep_overflow

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        (value, overflow), _ = step(p, x)
        row.update(
          {
            "fwd_bwd_ms": time_ms(step, (p, x), iters),
            "loss_finite": bool(np.isfinite(float(value))),
            "overflow": int(overflow),
          }
        )
        del p, x
      except Exception as err:
        row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
      print(row, flush=True)
  return rows


def markdown(results: dict) -> str:
  m = results["machine"]
  fmt = lambda v, f="{:.2f}": "-" if v is None else f.format(v)  # noqa: E731
  why = lambda r: str(r.get("skipped") or r.get("error")).replace("|", "/")  # noqa: E731  (a '|' would split the cell)
  lines = [
    f"# Expert-parallel dispatch/combine, EP={m['devices']} ({m['device']}; jax {m['jax']}, {m['date']})",
    "",
    f"hidden {results['shape']['hidden']} {results['shape']['dtype']}, {results['shape']['experts']} experts, "
    f"top-{results['shape']['k']}, moe_ep_buffer_factor={results['buffer_factor']}. Bytes per GPU sent to other GPUs; "
    "GB/s = wire bytes / median time; 'of ceiling' = a plain all_to_all of the same bytes / this.",
    "",
    "| tokens/GPU | routing | backend | dedup | check | dispatch ms | combine ms | dispatch MB | combine MB "
    "| payload MB | dedup saves | dup fraction | dispatch GB/s (of ceiling) | combine GB/s (of ceiling) |",
    "|---" * 15 + "|",
  ]
  for r in results["transport"]:
    if "dispatch_ms" not in r:
      lines.append(
        f"| {r['tokens_per_gpu']} | {r['routing']} | {r['backend']} | {r['dedup']} | {why(r)} |" + " - |" * 10
      )
      continue
    lines.append(
      f"| {r['tokens_per_gpu']} | {r['routing']} | {r['backend']} | {r['dedup']} | {r['check']} "
      f"| {r['dispatch_ms']:.3f} | {r['combine_ms']:.3f} | {r['dispatch_bytes_per_gpu'] / 1e6:.1f} "
      f"| {r['combine_bytes_per_gpu'] / 1e6:.1f} | {r['payload_bytes_per_gpu'] / 1e6:.1f} | "
      f"{100 * r['dedup_byte_reduction']:.1f}% | {100 * r['duplicate_fraction_remote']:.1f}% | "
      f"{r['dispatch_GBps']:.1f} ({fmt(r['dispatch_of_ceiling'])}) "
      f"| {r['combine_GBps']:.1f} ({fmt(r['combine_of_ceiling'])}) |"
    )
  lines += [
    "",
    "## Whole MoE layer, forward+backward",
    "",
    "| tokens/GPU | backend | dedup | gmm | ms | overflow |",
    "|---" * 6 + "|",
  ]
  for r in results["layer"]:
    lines.append(
      f"| {r['tokens_per_gpu']} | {r['backend']} | {r['dedup']} | {r['gmm']} "
      f"| {fmt(r.get('fwd_bwd_ms'), '{:.2f}') if 'fwd_bwd_ms' in r else why(r)} | {r.get('overflow', '-')} |"
    )
  lines += ["", "## GPU topology (nvidia-smi topo -m)", "", "```", str(m.get("topology")), "```"]
  return "\n".join(lines) + "\n"


BUFFER_FACTOR = -1.0


def main(argv=None) -> int:
  global BUFFER_FACTOR
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", type=Path, required=True)
  ap.add_argument(
    "--cpu-dry-run", action="store_true", help="8 host CPU devices, tiny shapes, float32; skips ragged_a2a"
  )
  ap.add_argument("--tokens", default=None, help="tokens per GPU, comma-separated (default 4096,8192)")
  ap.add_argument("--routings", default="balanced,skewed")
  ap.add_argument("--iters", type=int, default=None)
  ap.add_argument(
    "--buffer-factor", type=float, default=-1.0, help="moe_ep_buffer_factor for every backend (-1: worst case)"
  )
  ap.add_argument("--gmm", default="auto", help="moe_gmm_backend of the layer rows (MaxText/gmm/; auto: decided here)")
  ap.add_argument("--no-layer", action="store_true", help="skip the whole-layer forward+backward rows")
  args = ap.parse_args(argv)
  if args.cpu_dry_run:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
  import jax.numpy as jnp

  from MaxText import gmm

  if args.gmm not in gmm.backends():
    ap.error(f"--gmm {args.gmm}: choose a moe_gmm_backend: {', '.join(gmm.backends())}")
  BUFFER_FACTOR = args.buffer_factor
  shape = dict(DRY if args.cpu_dry_run else FULL)
  if args.tokens:
    shape["tokens"] = tuple(int(t) for t in args.tokens.split(","))
  iters = args.iters or (2 if args.cpu_dry_run else 20)
  results = {
    "machine": machine.describe(topology=True),
    "shape": {k: v for k, v in shape.items() if k != "tokens"},
    "buffer_factor": BUFFER_FACTOR,
    "transport": [],
    "layer": [],
  }
  dtype = jnp.dtype(shape["dtype"])
  ceiling = make_ceiling(iters, shape["hidden"] * dtype.itemsize, dtype)
  for tokens in shape["tokens"]:
    for kind in args.routings.split(","):
      results["transport"] += transport_rows(shape, tokens, kind, iters, ceiling)
    if not args.no_layer:
      results["layer"] += layer_rows(shape, tokens, iters, args.gmm)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "moe_dispatch.json").write_text(json.dumps(results, indent=1))
  (args.out / "moe_dispatch.md").write_text(markdown(results))
  print(markdown(results))
  failed = [r for r in results["transport"] if str(r.get("check", "ok")) != "ok" or "error" in r] + [
    r for r in results["layer"] if "error" in r
  ]
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
