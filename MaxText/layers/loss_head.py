r"""The output head's cross-entropy, chunked over tokens so that the float32 logits never exist whole.

`chunked_cross_entropy(h, head, targets, weights)` is sum_t weights[t] * -log softmax(h[t] @ head)[targets[t]]
as one `jax.custom_vjp`:

- GEMMs take their operands in `dot_dtype` (the compute dtype: bf16 in the GPU recipes; float32 when
  logits_dot_in_fp32) with float32 accumulation; logsumexp, softmax and the nll are float32.
- Tokens are processed `chunk_tokens` rows at a time (one `lax.scan`), so only one chunk's [rows, vocab]
  float32 logits are live. Under differentiation each chunk's logits feed both the loss and
  dlogits = (softmax - onehot) * weight in float32, cast once to `dot_dtype`, and the two gradient GEMMs run
  in the same pass at tensor-core rate: dh = dlogits @ head^T, dhead += h^T @ dlogits (dhead accumulated in
  float32 across chunks). The residuals are these gradients up to the cotangent g, which the backward only
  multiplies in: no logits are recomputed (recomputing them cost a quarter of the head's GEMMs: 44 of 182 ms
  on an H100 at vocab 129,280, 2 x 4096 tokens). Not differentiated, the loss is one GEMM per chunk. Before
  the chunked head, the logits' gradient was a whole float32 [batch, seq, vocab] array and both backward
  GEMMs ran with float32 operands (on an H200 at vocab 129,280: 110 ms of a 350 ms step).
- Chunk i holds tokens i, i + n, i + 2n, ... (n chunks of equal size, at most `chunk_tokens` rows, the
  token count padded by fewer than n zero-weight rows). Interleaving keeps a batch-sharded token axis
  sharded inside every chunk: each device works on each chunk's rows of its own, instead of the loop
  running over the sharded axis. `chunk_tokens` counts rows per device: the caller multiplies it by the
  number of devices the rows are split over (model._cross_entropy), so the chunk count does not grow with
  the cluster. Counting global rows made the 671B plan at 128 GPUs loop over 128 chunks of 4096 rows (32
  per device) and gather the head, and reduce-scatter its gradient, once per chunk (MaxText/plan/: 44.5 s
  of a predicted 62.4 s step).
- Under a mesh with more than one chunk, the head is gathered along D once before the loop, and each
  device accumulates dhead over its own rows ([devices, D, V] split over the devices), so that no
  collective runs inside the loop: the devices' sums are added once, after it.

Memory, 1-GPU proxy recipe (recipes/deepseek_v3_proxy_1gpu/optimized.yml: 4 x 4096 = 16,384 tokens,
hidden 7168) at DeepSeek-V3's vocabulary of 129,280 (the proxy's own 32,768 is 3.9x smaller):
whole float32 logits 16,384 x 129,280 x 4 B = 8.47 GB (7.89 GiB), their float32 gradient as much again:
16.9 GB (15.8 GiB) together, plus log_softmax's float32 output kept for the backward. One chunk of
4096 rows (the default, loss_chunk_tokens): float32 logits 2.12 GB (1.97 GiB) and bf16 dlogits
1.06 GB (0.99 GiB), 3.18 GB (2.96 GiB) live at once; beside it the float32 dhead accumulator,
7168 x 129,280 x 4 B = 3.71 GB (3.45 GiB), the size of head's float32 gradient. 4096 rows keep each
GEMM (M = 4096, N = 129,280, K = 7168) large enough for full tensor-core rate.

The price of forming the gradients in the forward pass: each head's dhead (and its float32 dh, [tokens, D])
is held from the head's forward to its backward, so with MTP two dheads are live at once where the backward
used to hold one at a time. The planner puts it at +0.57 GiB for h100_optimized.yml (vocabulary 32,768: 71.87
against 71.30 GiB) and +1.26 GiB at vocabulary 129,280, 2 sequences, on an H100 (77.89 against 76.63 GiB after
XLA's rematerialisation; benchmarks/results/2026-12-07-cpu-plan-memory-limit).
"""

import functools

import jax
import jax.numpy as jnp


def chunked_cross_entropy(h, head, targets, weights, *, chunk_tokens: int = 4096, dot_dtype=None, shard=None):
  """Sum over tokens of weights * (-log softmax(h @ head)[targets]), float32 scalar.

  h: [..., D] hidden states; head: [D, V]; targets: [...] int token ids; weights: [...] loss weights
  (0 = masked token). chunk_tokens: rows per chunk, all devices together (0 = one chunk). dot_dtype: the
  GEMM operand dtype (default h's dtype); accumulation and the softmax are float32 whatever it is.
  shard: the model's Sharder (MaxText/sharding.py), with the mesh the rows are split over (None: no mesh).
  """
  dot_dtype = jnp.dtype(h.dtype if dot_dtype is None else dot_dtype)
  flat_h, flat_t, flat_w = h.reshape(-1, h.shape[-1]), targets.reshape(-1).astype(jnp.int32), weights.reshape(-1)
  mesh = None if shard is None else getattr(shard, "mesh", None)
  return _loss(flat_h, head, flat_t, flat_w, int(chunk_tokens), dot_dtype, None if mesh is None else shard)


def _layout(tokens: int, chunk_tokens: int) -> tuple[int, int]:
  """(chunks, rows per chunk): the fewest chunks of at most chunk_tokens rows, all of one size."""
  n = 1 if chunk_tokens <= 0 or tokens <= chunk_tokens else -(-tokens // chunk_tokens)
  return n, -(-tokens // n)


def _to_chunks(a, n: int, rows: int):
  """[T, ...] -> [n, rows, ...], chunk i holding tokens i, i + n, ...; padded with zeros to n * rows."""
  a = jnp.pad(a, [(0, n * rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1))
  return a.reshape(rows, n, *a.shape[1:]).swapaxes(0, 1)


def _from_chunks(a, tokens: int):
  """The inverse of _to_chunks: [n, rows, ...] -> [tokens, ...]."""
  return a.swapaxes(0, 1).reshape(-1, *a.shape[2:])[:tokens]


def _chunk_logits(h_chunk, head):
  return jnp.einsum("cd,dv->cv", h_chunk, head, preferred_element_type=jnp.float32)


def _is_target(targets, vocab: int):
  # A compare with an iota, not a gather: it fuses into the elementwise work and stays local when vocab is sharded.
  return jax.lax.broadcasted_iota(jnp.int32, (targets.shape[0], vocab), 1) == targets[:, None]


def _gathered(a, n: int, sharding):
  """a in `sharding` (whole along D) when the loop has more than one chunk: its collective runs once, outside."""
  return a if n == 1 or sharding is None else jax.lax.with_sharding_constraint(a, sharding)


def _row_groups(shard, tokens: int, n: int) -> int:
  """Devices the rows are split over, when the loop has more than one chunk and every chunk splits evenly."""
  if n == 1 or shard is None:
    return 1
  g = shard.devices_along("batch")
  return g if tokens % (n * g) == 0 else 1


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _loss(h, head, targets, weights, chunk_tokens, dot_dtype, shard):
  """The loss alone (not differentiated: evaluation, scoring): one GEMM per chunk."""
  with jax.named_scope("loss_head"):
    tokens, vocab = h.shape[0], head.shape[1]
    n, rows = _layout(tokens, chunk_tokens)
    w = head.astype(dot_dtype)
    if _row_groups(shard, tokens, n) > 1:
      w = shard(w, (None, "vocab"))  # gathered along D once, before the loop

    def one(xs):
      h_c, t_c = xs
      logits = _chunk_logits(h_c, w)
      return jax.nn.logsumexp(logits, axis=-1) - _target_logit(logits, t_c, vocab)

    nll = jax.lax.map(one, (_to_chunks(h.astype(dot_dtype), n, rows), _to_chunks(targets, n, rows)))
    return jnp.sum(_from_chunks(nll, tokens) * weights.astype(jnp.float32))


def _target_logit(logits, targets, vocab: int):
  return jnp.sum(jnp.where(_is_target(targets, vocab), logits, 0.0), axis=-1)


def _forward(h, head, targets, weights, chunk_tokens, dot_dtype, shard):
  """The loss and, in the same pass over the chunks, its gradients up to the cotangent g: each chunk's logits
  are computed once and feed both the loss and dlogits = (softmax - onehot) * weight. The backward only scales
  by g. Recomputing the logits in the backward instead cost a quarter of the head's GEMMs (on an H100 at vocab
  129,280, 2 x 4096 tokens: 44 of the head's 182 ms)."""
  with jax.named_scope("loss_head"):
    tokens, vocab = h.shape[0], head.shape[1]
    n, rows = _layout(tokens, chunk_tokens)
    groups = _row_groups(shard, tokens, n)
    w = head.astype(dot_dtype)
    # dhead sums over rows, and rows are split over `groups` devices: each device accumulates the sum of its
    # own rows, [groups, D, V] split along groups, and the devices' sums are added once, after the loop.
    # (Accumulating [D, V] directly would add the devices' partial sums in every chunk.)
    dhead0 = jnp.zeros((groups, *head.shape), jnp.float32)
    if groups > 1:
      w, dhead0 = shard(w, (None, "vocab")), shard(dhead0, ("batch", None, "vocab"))

    def body(dhead, xs):
      h_c, t_c, w_c = xs
      logits = _chunk_logits(h_c, w)
      lse = jax.nn.logsumexp(logits, axis=-1)
      nll = lse - _target_logit(logits, t_c, vocab)
      dlogits = (jnp.exp(logits - lse[:, None]) - _is_target(t_c, vocab)) * w_c[:, None]
      dlogits = dlogits.astype(dot_dtype)
      dh = jnp.einsum("cv,dv->cd", dlogits, w, preferred_element_type=jnp.float32)
      per_group = jnp.einsum(
        "gcd,gcv->gdv",
        h_c.reshape(groups, rows // groups, -1),
        dlogits.reshape(groups, rows // groups, vocab),
        preferred_element_type=jnp.float32,
      )
      return dhead + per_group, (nll, dh)

    xs = (
      _to_chunks(h.astype(dot_dtype), n, rows),
      _to_chunks(targets, n, rows),
      _to_chunks(weights.astype(jnp.float32), n, rows),  # padded rows: weight 0, so no gradient
    )
    dhead, (nll, dh) = jax.lax.scan(body, dhead0, xs)
    nll = _from_chunks(nll, tokens)
    total = jnp.sum(nll * weights.astype(jnp.float32))
    dtypes = tuple(jnp.zeros((0,), a.dtype) for a in (h, head, weights))  # empty: the gradients' dtypes
    return total, (_from_chunks(dh, tokens), jnp.sum(dhead, axis=0), nll, dtypes)


def _backward(chunk_tokens, dot_dtype, shard, res, g):
  dh, dhead, nll, (h_like, head_like, weights_like) = res
  with jax.named_scope("loss_head"):
    floating = jnp.issubdtype(weights_like.dtype, jnp.floating)
    dweights = (nll * g).astype(weights_like.dtype) if floating else None
    return (dh * g).astype(h_like.dtype), (dhead * g).astype(head_like.dtype), None, dweights


_loss.defvjp(_forward, _backward)
