r"""The output head's cross-entropy, chunked over tokens so that the float32 logits never exist whole.

`chunked_cross_entropy(h, head, targets, weights)` is sum_t weights[t] * -log softmax(h[t] @ head)[targets[t]]
as one `jax.custom_vjp`:

- GEMMs take their operands in `dot_dtype` (the compute dtype: bf16 in the GPU recipes; float32 when
  logits_dot_in_fp32) with float32 accumulation; logsumexp, softmax and the nll are float32.
- Tokens are processed `chunk_tokens` rows at a time (a `lax.map` forward, a `lax.scan` backward), so
  only one chunk's [rows, vocab] float32 logits are live. The forward keeps the per-token logsumexp
  (float32 [tokens]) as its only new residual; the backward recomputes each chunk's logits and forms
  dlogits = (softmax - onehot) * weight * g in float32, casts it once to `dot_dtype`, and runs the two
  backward GEMMs at tensor-core rate: dh = dlogits @ head^T, dhead += h^T @ dlogits (dhead accumulated
  in float32 across chunks, cast to head's dtype at the end). Before this, the logits' gradient was a
  whole float32 [batch, seq, vocab] array and both backward GEMMs ran with float32 operands (on an H200
  at vocab 129,280: 110 ms of a 350 ms step).
- Chunk i holds tokens i, i + n, i + 2n, ... (n chunks of equal size, at most `chunk_tokens` rows, the
  token count padded by fewer than n zero-weight rows). Interleaving keeps a batch-sharded token axis
  sharded inside every chunk: each device works on each chunk's rows of its own, instead of the loop
  running over the sharded axis. `chunk_tokens` counts global rows (all devices together).

Memory, 1-GPU proxy recipe (recipes/deepseek_v3_proxy_1gpu/optimized.yml: 4 x 4096 = 16,384 tokens,
hidden 7168) at DeepSeek-V3's vocabulary of 129,280 (the proxy's own 32,768 is 3.9x smaller):
whole float32 logits 16,384 x 129,280 x 4 B = 8.47 GB (7.89 GiB), their float32 gradient as much again:
16.9 GB (15.8 GiB) together, plus log_softmax's float32 output kept for the backward. One chunk of
4096 rows (the default, loss_chunk_tokens): float32 logits 2.12 GB (1.97 GiB) and bf16 dlogits
1.06 GB (0.99 GiB), 3.18 GB (2.96 GiB) live at once; beside it the float32 dhead accumulator,
7168 x 129,280 x 4 B = 3.71 GB (3.45 GiB), the size of head's float32 gradient. 4096 rows keep each
GEMM (M = 4096, N = 129,280, K = 7168) large enough for full tensor-core rate.
"""

import functools

import jax
import jax.numpy as jnp


def chunked_cross_entropy(h, head, targets, weights, *, chunk_tokens: int = 4096, dot_dtype=None) -> jax.Array:
  """Sum over tokens of weights * (-log softmax(h @ head)[targets]), float32 scalar.

  h: [..., D] hidden states; head: [D, V]; targets: [...] int token ids; weights: [...] loss weights
  (0 = masked token). chunk_tokens: rows per chunk (0 = one chunk). dot_dtype: the GEMM operand dtype
  (default h's dtype); accumulation and the softmax are float32 whatever it is.
  """
  dot_dtype = jnp.dtype(h.dtype if dot_dtype is None else dot_dtype)
  flat_h, flat_t, flat_w = h.reshape(-1, h.shape[-1]), targets.reshape(-1).astype(jnp.int32), weights.reshape(-1)
  return _loss(flat_h, head, flat_t, flat_w, int(chunk_tokens), dot_dtype)  # named_scope("loss_head") inside


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _loss(h, head, targets, weights, chunk_tokens, dot_dtype):
  return _forward(h, head, targets, weights, chunk_tokens, dot_dtype)[0]


def _forward(h, head, targets, weights, chunk_tokens, dot_dtype):
  with jax.named_scope("loss_head"):
    tokens, vocab = h.shape[0], head.shape[1]
    n, rows = _layout(tokens, chunk_tokens)
    w = head.astype(dot_dtype)

    def one(xs):
      h_c, t_c = xs
      logits = _chunk_logits(h_c, w)
      lse = jax.nn.logsumexp(logits, axis=-1)
      target_logit = jnp.sum(jnp.where(_is_target(t_c, vocab), logits, 0.0), axis=-1)
      return lse, lse - target_logit

    lse, nll = jax.lax.map(one, (_to_chunks(h.astype(dot_dtype), n, rows), _to_chunks(targets, n, rows)))
    nll = _from_chunks(nll, tokens)
    total = jnp.sum(nll * weights.astype(jnp.float32))
    return total, (h, head, targets, weights, lse, nll)


def _backward(chunk_tokens, dot_dtype, res, g):
  h, head, targets, weights, lse, nll = res
  with jax.named_scope("loss_head"):
    tokens, vocab = h.shape[0], head.shape[1]
    n, rows = _layout(tokens, chunk_tokens)
    w = head.astype(dot_dtype)
    scale = weights.astype(jnp.float32) * g  # d total / d logits = (softmax - onehot) * weight * g

    def body(dhead, xs):
      h_c, t_c, s_c, lse_c = xs
      logits = _chunk_logits(h_c, w)
      dlogits = (jnp.exp(logits - lse_c[:, None]) - _is_target(t_c, vocab)) * s_c[:, None]
      dlogits = dlogits.astype(dot_dtype)
      dh = jnp.einsum("cv,dv->cd", dlogits, w, preferred_element_type=jnp.float32)
      dhead = dhead + jnp.einsum("cd,cv->dv", h_c, dlogits, preferred_element_type=jnp.float32)
      return dhead, dh.astype(h.dtype)

    xs = (
      _to_chunks(h.astype(dot_dtype), n, rows),
      _to_chunks(targets, n, rows),
      _to_chunks(scale, n, rows),  # padded rows: weight 0, so no gradient
      lse,
    )
    dhead, dh = jax.lax.scan(body, jnp.zeros(head.shape, jnp.float32), xs)
    dweights = (nll * g).astype(weights.dtype) if jnp.issubdtype(weights.dtype, jnp.floating) else None
    return _from_chunks(dh, tokens), dhead.astype(head.dtype), None, dweights


_loss.defvjp(_forward, _backward)
