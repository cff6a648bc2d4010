"""The chunked output-head loss (MaxText/layers/loss_head.py) against an unchunked float32 log_softmax.

Bounds: float32 inputs match the reference to rtol 1e-5 (value and gradients; only summation order
differs). bf16 inputs are compared with the float32 reference on the same bf16 values: the value to
rtol 1e-5 (bf16 products are exact in float32 accumulation), the gradients to BF16_GRAD_TOL of the
gradient's largest entry (dlogits is rounded to bf16 once and dh, dhead once more: two roundings of
relative size 2^-9 each).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText import model, params
from MaxText.layers.loss_head import chunked_cross_entropy
from MaxText.sharding import MESH_AXES, Sharder

BF16_GRAD_TOL = 2**-7  # of max |gradient|, per entry


def _reference(h, head, targets, weights):
  """Today's formulation, all float32: log_softmax over the whole [tokens, vocab] logits."""
  logits = jnp.einsum("...d,dv->...v", h.astype(jnp.float32), head.astype(jnp.float32))
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.sum(jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0] * weights)


def _inputs(shape=(2, 50), d=32, vocab=200, dtype=jnp.float32, seed=0, masked=0.3):
  k = jax.random.split(jax.random.key(seed), 4)
  h = jax.random.normal(k[0], (*shape, d)).astype(dtype)
  head = (jax.random.normal(k[1], (d, vocab)) / np.sqrt(d) * 3).astype(dtype)
  targets = jax.random.randint(k[2], shape, 0, vocab)
  weights = (jax.random.uniform(k[3], shape) >= masked).astype(jnp.float32)
  return h, head, targets, weights


def _value_and_grads(fn, h, head, targets, weights):
  return jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 3)))(h, head, targets, weights)


def _chunked(chunk, dot_dtype=None):
  return lambda h, head, t, w: chunked_cross_entropy(h, head, t, w, chunk_tokens=chunk, dot_dtype=dot_dtype)


def _max_err(a, b):
  return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))


@pytest.mark.parametrize("chunk", [0, 20, 25, 30, 64, 100, 4096])  # 100 tokens: dividing, not dividing, one chunk
def test_float32_matches_the_unchunked_reference(chunk):
  args = _inputs()
  value, grads = _value_and_grads(_chunked(chunk), *args)
  ref_value, ref_grads = _value_and_grads(_reference, *args)
  assert value.dtype == jnp.float32
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  for g, r, name in zip(grads, ref_grads, ("dh", "dhead", "dweights")):
    assert g.shape == r.shape and g.dtype == r.dtype, name
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(r))), err_msg=name)


@pytest.mark.parametrize("chunk", [0, 32, 48])
def test_bfloat16_matches_the_float32_reference_to_bf16_precision(chunk):
  h, head, targets, weights = _inputs(shape=(4, 40), d=64, vocab=300, dtype=jnp.bfloat16)
  value, (dh, dhead, _) = _value_and_grads(_chunked(chunk), h, head, targets, weights)
  up = (h.astype(jnp.float32), head.astype(jnp.float32), targets, weights)
  ref_value, (ref_dh, ref_dhead, _) = _value_and_grads(_reference, *up)
  assert dh.dtype == jnp.bfloat16 and dhead.dtype == jnp.bfloat16
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  for g, r, name in ((dh, ref_dh, "dh"), (dhead, ref_dhead, "dhead")):
    assert _max_err(g, r) <= BF16_GRAD_TOL * float(jnp.max(jnp.abs(r))), name


def test_zero_weight_tokens_contribute_nothing():
  h, head, targets, weights = _inputs(masked=0.5)
  masked = weights == 0
  assert 0 < int(masked.sum()) < masked.size
  value, (dh, dhead, _) = _value_and_grads(_chunked(16), h, head, targets, weights)
  # other hidden states and targets on the masked tokens: the same value and dhead, zero dh there
  h2 = jnp.where(masked[..., None], h + 5.0, h)
  t2 = jnp.where(masked, (targets + 7) % head.shape[1], targets)
  value2, (dh2, dhead2, _) = _value_and_grads(_chunked(16), h2, head, t2, weights)
  assert float(value2) == pytest.approx(float(value), rel=1e-6)
  np.testing.assert_allclose(dhead2, dhead, rtol=1e-5, atol=1e-6)
  assert not np.any(np.asarray(dh)[np.asarray(masked)]) and not np.any(np.asarray(dh2)[np.asarray(masked)])
  # fractional weights scale each token's share
  value_half, _ = _value_and_grads(_chunked(16), h, head, targets, weights * 0.5)
  assert float(value_half) == pytest.approx(0.5 * float(value), rel=1e-6)


@pytest.mark.parametrize("dot_dtype, operand", [(None, "bf16"), (jnp.float32, "f32")])
def test_every_gemm_takes_dot_dtype_operands_and_accumulates_in_float32(dot_dtype, operand):
  h, head, targets, weights = _inputs(dtype=jnp.bfloat16)
  text = jax.jit(jax.value_and_grad(_chunked(32, dot_dtype), argnums=(0, 1))).lower(h, head, targets, weights).as_text()
  dots = re.findall(r"stablehlo\.dot_general.*:\s*\((tensor<[^>]*>), (tensor<[^>]*>)\)\s*->\s*(tensor<[^>]*>)", text)
  assert len(dots) == 3  # logits, dh, dhead: each chunk's logits are computed once, the gradients in the same pass
  loss_only = jax.jit(_chunked(32, dot_dtype)).lower(h, head, targets, weights).as_text()
  assert len(re.findall(r"stablehlo\.dot_general", loss_only)) == 1  # not differentiated: the logits only
  for a, b, out in dots:
    assert a.endswith(f"x{operand}>") and b.endswith(f"x{operand}>") and out.endswith("xf32>"), (a, b, out)


def test_the_float32_logits_never_exist_whole():
  tokens, vocab = 512, 1000
  h, head, targets, weights = _inputs(shape=(tokens,), d=64, vocab=vocab)
  whole = f"tensor<{tokens}x{vocab}xf32>"

  def lowered(fn):
    return jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(h, head, targets, weights)

  # the check can fail: the unchunked reference and a single chunk do have the whole logits
  assert whole in lowered(_reference).as_text()
  assert whole in lowered(_chunked(0)).as_text()
  chunked = lowered(_chunked(128))
  assert whole not in chunked.as_text()
  assert "tensor<128x1000xf32>" in chunked.as_text()
  assert f"f32[{tokens},{vocab}]" not in chunked.compile().as_text()


def test_sharded_jit_grad_matches_and_keeps_tokens_local():
  """Tokens sharded over 2 devices: chunks interleave tokens, so no device gathers another's rows."""
  mesh = Mesh(np.asarray(jax.devices()[:2]), ("data",))
  args = _inputs(shape=(256,), d=32, vocab=100)
  rows, rep = NamedSharding(mesh, PartitionSpec("data")), NamedSharding(mesh, PartitionSpec())
  sharded = [jax.device_put(a, s) for a, s in zip(args, (rows, rep, rows, rows))]
  fn = jax.jit(jax.value_and_grad(_chunked(64), argnums=(0, 1, 3)))
  value, grads = fn(*sharded)
  ref_value, ref_grads = _value_and_grads(_reference, *args)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(r))))
  assert grads[0].sharding.is_equivalent_to(rows, 2)
  assert "all-gather" not in fn.lower(*sharded).compile().as_text()


def test_model_loss_is_the_mean_nll_of_the_logits_for_any_chunking(tiny_config):
  """loss_fn (chunked, main head and MTP head) against forward's whole logits and against one chunk."""
  results = []
  for chunk in (0, 12):  # 2 x 16 = 32 tokens: 3 chunks of 11 rows, one padded
    cfg = tiny_config(f"loss_chunk_tokens={chunk}")
    p = params.initialize(model.model_specs(cfg.model, cfg.moe), jax.random.key(0), jnp.float32, 0.02)
    bias = model.bias_state(cfg.model, cfg.moe)
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, cfg.model.vocab_size)
    batch = model.Batch(tokens[:, :-1], tokens[:, 1:], jnp.ones((2, 16), jnp.float32).at[1, 10:].set(0.0))
    grad_fn = jax.jit(
      jax.value_and_grad(lambda p: model.loss_fn(p, bias, batch, cfg.model, cfg.moe, Sharder()), has_aux=True)
    )
    (loss, aux), grads = grad_fn(p)
    _, aux_f, logits = jax.jit(lambda p: model.forward(p, bias, batch, cfg.model, cfg.moe, Sharder()))(p)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), batch.targets[..., None], -1)[..., 0]
    assert float(aux.ce) == pytest.approx(float(jnp.sum(nll * batch.mask) / jnp.sum(batch.mask)), rel=1e-5)
    assert float(aux_f.ce) == pytest.approx(float(aux.ce), rel=1e-6) and float(aux.mtp) > 0
    results.append((loss, grads))
  (loss0, g0), (loss1, g1) = results
  assert float(loss1) == pytest.approx(float(loss0), rel=1e-5)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("gathered_once", [False, True])
def test_a_head_sharded_along_d_is_gathered_once_not_per_chunk(gathered_once):
  """FSDP: head [D, V] split along D over the devices that also split the tokens. Without the Sharder
  the partitioner gathers the head (and reduce-scatters its gradient) inside the chunk loop, once per
  chunk; with it, every collective runs once per step (MaxText/plan/collectives.py counts loop trips)."""
  from MaxText.plan import collectives

  mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(1, 4, 1, 1), MESH_AXES)
  args = _inputs(shape=(512,), d=64, vocab=96)
  rows, by_d = NamedSharding(mesh, PartitionSpec("fsdp")), NamedSharding(mesh, PartitionSpec("fsdp", None))
  sharded = [jax.device_put(a, s) for a, s in zip(args, (rows, by_d, rows, rows))]
  shard = Sharder(Mesh(np.asarray(jax.devices()[:4]).reshape(1, 4, 1, 1), MESH_AXES)) if gathered_once else None

  def loss(h, head, targets, weights):
    return chunked_cross_entropy(h, head, targets, weights, chunk_tokens=128, shard=shard)

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), out_shardings=(None, (rows, by_d)))
  found = collectives.parse(fn.lower(*sharded).compile().as_text())
  in_loop = [c.name for c in found if c.count > 1]
  assert found and (not in_loop if gathered_once else in_loop), [(c.name, c.kind, c.count) for c in found]
  value, grads = fn(*sharded)
  ref_value, ref_grads = _value_and_grads(_reference, *args)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(r))))


def test_loss_chunk_tokens_counts_rows_per_device(tiny_config):
  """loss_chunk_tokens=8 with 32 tokens: 4 chunks on one device, 1 chunk when the rows are split 4 ways."""
  cfg = tiny_config("loss_chunk_tokens=8")
  p = params.initialize(model.model_specs(cfg.model, cfg.moe), jax.random.key(0), jnp.float32, 0.02)
  bias = model.bias_state(cfg.model, cfg.moe)
  tokens = jax.random.randint(jax.random.key(1), (4, 9), 0, cfg.model.vocab_size)
  batch = model.Batch(tokens[:, :-1], tokens[:, 1:], jnp.ones((4, 8), jnp.float32))
  vocab = cfg.model.vocab_size

  def logits_shapes(shard):
    text = str(jax.make_jaxpr(lambda p: model.loss_fn(p, bias, batch, cfg.model, cfg.moe, shard)[0])(p))
    return set(re.findall(rf"f32\[(\d+),{vocab}\]", text)) - {str(cfg.model.base_emb_dim)}  # less dhead [D, V]

  assert logits_shapes(Sharder()) == {"8"}
  mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(1, 4, 1, 1), MESH_AXES)
  assert logits_shapes(Sharder(mesh)) == {"32"}
