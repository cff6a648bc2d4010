"""The output head's loss (projection + cross-entropy), forward and backward: XLA's einsum against our chunked head.

  python benchmarks/loss_head.py --out DIR [--tokens 16384] [--hidden 7168] [--vocab 129280] [--iters 10]

Rows, each timed as loss and gradients w.r.t. the hidden states and the head (CUPTI device time, median):
  einsum_fp32      logits = h @ head with float32 operands, log_softmax by XLA's autodiff (logits_dot_in_fp32)
  einsum_bf16      the same with bf16 operands; the logits' gradient is float32, so XLA's backward GEMMs
                   take float32 operands (what model.py ran before layers/loss_head.py)
  chunked[N]       layers/loss_head.py with loss_chunk_tokens=N (0 = one chunk): bf16 GEMMs with float32
                   accumulation in a custom VJP, float32 softmax, N tokens at a time
  TAG:chunked[N]   with --compare DIR (another checkout, e.g. `git worktree add DIR COMMIT`): that checkout's
                   layers/loss_head.py at the same chunk sizes, in the same process (an A/B of two versions)

Each row also gives the compiled temporary memory (XLA's memory analysis) and its error against a float32
reference (float32 GEMMs at full precision) from the same inputs (loss relative error, gradients' max abs
error over max abs value). Inputs are random (never zeros); outputs are read back and checked finite.
Writes DIR/loss_head.json and DIR/loss_head.md.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import machine  # noqa: E402
from grouped_gemm import jax_time_ms  # noqa: E402


def einsum_loss(dot_dtype):
  import jax
  import jax.numpy as jnp

  def loss(h, head, targets, mask):
    logits = jnp.einsum("td,dv->tv", h.astype(dot_dtype), head.astype(dot_dtype), preferred_element_type=jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
    return jnp.sum(nll * mask)

  return loss


def chunked_loss(chunk_tokens: int, module=None):
  import jax.numpy as jnp

  from MaxText.layers import loss_head

  chunked_cross_entropy = (module or loss_head).chunked_cross_entropy

  def loss(h, head, targets, mask):
    return chunked_cross_entropy(h, head, targets, mask, chunk_tokens=chunk_tokens, dot_dtype=jnp.bfloat16)

  return loss


def other_loss_head(checkout: Path):
  """MaxText/layers/loss_head.py of another checkout, loaded under its own name (it imports only jax)."""
  import importlib.util

  path = checkout / "MaxText" / "layers" / "loss_head.py"
  spec = importlib.util.spec_from_file_location(f"loss_head_of_{checkout.name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def reference(h, head, targets, mask):
  """Loss and gradients in float32 with float32 GEMMs at full precision (no TF32), from the bf16 inputs as given."""
  import jax
  import jax.numpy as jnp

  def loss(h, head):
    logits = jnp.einsum("td,dv->tv", h, head, precision=jax.lax.Precision.HIGHEST)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[:, None], axis=-1)[:, 0]
    return jnp.sum(nll * mask)

  value, (dh, dhead) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(
    h.astype(jnp.float32), head.astype(jnp.float32)
  )
  return float(value), dh, dhead


def max_rel_err(got, want) -> float:
  """max |got - want| / max |want|, on the device: the head's gradient has ~10^9 entries, too many to compare on
  the host in float64 within a benchmark's time."""
  import jax.numpy as jnp

  return float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", type=Path, required=True)
  ap.add_argument("--tokens", type=int, default=16384)
  ap.add_argument("--hidden", type=int, default=7168)
  ap.add_argument("--vocab", type=int, default=129280)
  ap.add_argument("--chunks", default="0,2048,4096,8192", help="loss_chunk_tokens values to time")
  ap.add_argument("--iters", type=int, default=10)
  ap.add_argument("--compare", type=Path, help="another checkout whose loss head to time beside this one's")
  args = ap.parse_args()
  chunks = [int(c) for c in args.chunks.split(",") if c]
  if args.compare and not (args.compare / "MaxText" / "layers" / "loss_head.py").is_file():
    ap.error(f"--compare {args.compare}: no MaxText/layers/loss_head.py there; give the root of another checkout")

  import jax
  import jax.numpy as jnp
  import numpy as np

  t, d, v = args.tokens, args.hidden, args.vocab
  keys = jax.random.split(jax.random.key(0), 4)
  # A trained model's hidden states after the final norm are O(1); head entries ~ 1/sqrt(d) keep logits O(1).
  h = jax.random.normal(keys[0], (t, d), jnp.float32).astype(jnp.bfloat16)
  head = (jax.random.normal(keys[1], (d, v), jnp.float32) * d**-0.5).astype(jnp.bfloat16)
  targets = jax.random.randint(keys[2], (t,), 0, v, jnp.int32)
  mask = (jax.random.uniform(keys[3], (t,)) > 0.05).astype(jnp.float32)  # some tokens masked, as padding is

  start = time.perf_counter()
  want = reference(h, head, targets, mask)
  print(f"float32 reference: compiled and ran in {time.perf_counter() - start:.1f} s", flush=True)
  flops = 3 * 2.0 * t * d * v  # model FLOPs: forward GEMM, two backward GEMMs (recomputation not counted)
  variants = {"einsum_fp32": einsum_loss(jnp.float32), "einsum_bf16": einsum_loss(jnp.bfloat16)}
  variants.update({f"chunked[{c}]": chunked_loss(c) for c in chunks})
  if args.compare:
    other = other_loss_head(args.compare)
    variants.update({f"{args.compare.name}:chunked[{c}]": chunked_loss(c, other) for c in chunks})
  rows = []
  for name, loss in variants.items():
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    row = {"variant": name}
    print(f"{name}: compiling", flush=True)  # each row compiles and autotunes for tens of seconds on a GPU
    try:
      compiled = fn.lower(h, head, targets, mask).compile()
      mem = compiled.memory_analysis()
      row["temp_gib"] = mem.temp_size_in_bytes / 2**30 if mem is not None else None
      value, (dh, dhead) = fn(h, head, targets, mask)
      row["finite"] = bool(np.isfinite(float(value)) and jnp.isfinite(dh).all() and jnp.isfinite(dhead).all())
      row["loss_rel_err"] = abs(float(value) - want[0]) / abs(want[0])
      row["dh_err"] = max_rel_err(dh, want[1])
      row["dhead_err"] = max_rel_err(dhead, want[2])
      row["ms"], row["timer"] = jax_time_ms(fn, (h, head, targets, mask), args.iters)
      row["model_tflops"] = flops / row["ms"] / 1e9
    except Exception as e:  # e.g. out of memory for the whole float32 logits: a row that says so
      row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(json.dumps(row), flush=True)
    rows.append(row)

  args.out.mkdir(parents=True, exist_ok=True)
  shape = {"tokens": t, "hidden": d, "vocab": v}
  (args.out / "loss_head.json").write_text(
    json.dumps({"machine": machine.describe(), "shape": shape, "rows": rows}, indent=1)
  )
  lines = [
    f"loss head fwd+bwd, tokens {t}, hidden {d}, vocab {v} (model FLOPs 3 x 2TDV = {flops / 1e12:.2f} TFLOP)",
    "",
    "| variant | ms | model TFLOP/s | temp GiB | loss rel err | dh err | dhead err |",
    "|---|---|---|---|---|---|---|",
  ]

  def fmt(x, spec):
    return "-" if x is None else format(x, spec)

  for r in rows:
    if "error" in r:
      lines.append(f"| {r['variant']} | {r['error'][:80]} | | | | | |")
      continue
    lines.append(
      f"| {r['variant']} | {r['ms']:.2f} | {r['model_tflops']:.0f} | {fmt(r.get('temp_gib'), '.2f')} "
      f"| {fmt(r.get('loss_rel_err'), '.1e')} | {fmt(r.get('dh_err'), '.1e')} | {fmt(r.get('dhead_err'), '.1e')} |"
    )
  (args.out / "loss_head.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
