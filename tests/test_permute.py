"""Sort-based permute/unpermute (MaxText/moe/permute.py): the MoE layer against the per-token loop,
forward and gradients; empty experts, every token to the same experts, ignored copies; group
padding on/off identical; and the backward is gathers, with no scatter and no [tokens, experts]
array anywhere."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import params
from MaxText.moe import permute, router
from MaxText.moe.layer import moe, moe_specs
from MaxText.moe.reference import moe_loop
from MaxText.sharding import Sharder

EMB = 16


def _setup(cfg, bias_boost=None, seed=0):
  p = params.initialize(moe_specs(EMB, cfg.moe), jax.random.key(seed), jnp.float32, 0.2)
  x = jax.random.normal(jax.random.key(seed + 1), (2, 6, EMB))
  bias = jax.random.normal(jax.random.key(seed + 2), (cfg.moe.num_experts,)) * 0.05
  if bias_boost is not None:
    bias = bias.at[jnp.asarray(bias_boost)].add(10.0)
  return p, x, bias


def _loss(out, cot):
  return jnp.sum(out.astype(jnp.float32) * cot)


@pytest.mark.parametrize(
  "overrides, boost",
  [
    ((), None),  # random routing with shared experts
    (("moe_group_pad_multiple=8", "routed_score_func=softmax", "num_experts_per_tok=3"), None),
    (("n_routing_groups=1", "topk_routing_group=1"), (0, 1)),  # every token to experts 0 and 1; 6 experts empty
  ],
)
def test_layer_equals_per_token_loop_forward_and_gradients(tiny_config, overrides, boost):
  cfg = tiny_config(*overrides)
  p, x, bias = _setup(cfg, boost)
  ids = np.asarray(router.route(x.reshape(-1, EMB), p["gate"], bias, cfg.moe).expert_ids)
  if boost is not None:
    assert set(np.unique(ids)) == set(boost)
  cot = jax.random.normal(jax.random.key(9), x.shape)

  def fast(p, x):
    return _loss(moe(p, x, bias, cfg.moe, Sharder())[0], cot)

  def slow(p, x):
    return _loss(moe_loop(p, x, bias, cfg.moe, ids), cot)

  (v, g) = jax.value_and_grad(fast, argnums=(0, 1))(p, x)
  (v_ref, g_ref) = jax.value_and_grad(slow, argnums=(0, 1))(p, x)
  np.testing.assert_allclose(v, v_ref, rtol=1e-5)
  out, stats = moe(p, x, bias, cfg.moe, Sharder())
  np.testing.assert_allclose(out, moe_loop(p, x, bias, cfg.moe, ids), rtol=1e-5, atol=1e-6)
  assert int(stats.load.sum()) == ids.size
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  assert float(jnp.abs(g[0]["gate"]).max()) > 0  # the combine weights' gradient reaches the router


def test_group_padding_changes_nothing(tiny_config):
  plain, padded = tiny_config(), tiny_config("moe_group_pad_multiple=4")
  p, x, bias = _setup(plain, seed=3)
  cot = jax.random.normal(jax.random.key(9), x.shape)

  def grads(cfg):
    return jax.value_and_grad(lambda p, x: _loss(moe(p, x, bias, cfg.moe, Sharder())[0], cot), argnums=(0, 1))(p, x)

  for a, b in zip(jax.tree.leaves(grads(plain)), jax.tree.leaves(grads(padded))):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("pad", [0, 4])
def test_plan_layout_padding_rows_and_ignored_copies(pad):
  ids = jnp.array([[3, 1], [1, 0], [3, 2], [9, 1], [-1, 3]])  # 9 and -1: ignored (E = 5, expert 4 empty)
  x = jnp.arange(1.0, 6.0)[:, None] * jnp.ones((5, 3))
  plan = permute.plan(ids, 5, pad)
  rows = permute.permute(x, plan)
  real = [1, 3, 1, 3, 1]  # copies per expert
  expected_sizes = [-(-n // pad) * pad for n in real] if pad else real
  np.testing.assert_array_equal(plan.group_sizes, expected_sizes[:4] + [0])
  assert rows.shape[0] == permute.num_rows(10, 5, pad)
  starts = np.concatenate([[0], np.cumsum(expected_sizes)])
  tokens_by_expert = {0: [2], 1: [1, 2, 4], 2: [3], 3: [1, 3, 5]}  # 1-based token values, in token order
  for e, toks in tokens_by_expert.items():
    np.testing.assert_array_equal(rows[starts[e] : starts[e] + len(toks), 0], toks)
    np.testing.assert_array_equal(rows[starts[e] + len(toks) : starts[e + 1]], 0)  # group padding is zero
  np.testing.assert_array_equal(rows[starts[-1] :], 0)  # ignored copies and the tail are zero
  w = jnp.array([[0.5, 0.25], [1.0, 2.0], [3.0, 0.5], [7.0, 1.0], [5.0, 2.0]])
  out = permute.unpermute(rows * 2.0, w, plan)
  np.testing.assert_allclose(out[:, 0], 2.0 * np.array([1 * 0.75, 2 * 3.0, 3 * 3.5, 4 * 1.0, 5 * 2.0]))


@pytest.mark.parametrize("pad", [0, 8])
def test_every_token_to_one_expert(pad):
  ids = jnp.full((12, 1), 2)
  x = jax.random.normal(jax.random.key(0), (12, 4))
  plan = permute.plan(ids, 4, pad)
  np.testing.assert_array_equal(plan.group_sizes, [0, 0, 16 if pad else 12, 0])
  np.testing.assert_array_equal(permute.permute(x, plan)[:12], x)
  np.testing.assert_array_equal(permute.unpermute(permute.permute(x, plan), jnp.ones((12, 1)), plan), x)


def _fused(x, w, ids, num_experts, pad=0):
  plan = permute.plan(ids, num_experts, pad)
  return permute.unpermute(jnp.tanh(permute.permute(x, plan)), w, plan)


def _naive(x, w, ids):
  """jnp.take both ways: XLA transposes each gather into a scatter-add."""
  k = ids.shape[1]
  order = jnp.argsort(ids.reshape(-1), stable=True)
  y = jnp.tanh(jnp.take(x, order // k, axis=0))
  per_copy = jnp.take(y, jnp.argsort(order), axis=0).reshape(ids.shape[0], k, -1)
  return jnp.einsum("nkd,nk->nd", per_copy, w)


def test_matches_naive_gather_and_its_gradients():
  n, k, e, d = 40, 3, 11, 5
  ids = jax.random.randint(jax.random.key(0), (n, k), 0, e)
  x = jax.random.normal(jax.random.key(1), (n, d))
  w = jax.random.uniform(jax.random.key(2), (n, k))
  cot = jax.random.normal(jax.random.key(3), (n, d))
  for pad in (0, 8):
    got = jax.grad(lambda x, w: jnp.sum(_fused(x, w, ids, e, pad) * cot), argnums=(0, 1))(x, w)
    want = jax.grad(lambda x, w: jnp.sum(_naive(x, w, ids) * cot), argnums=(0, 1))(x, w)
    for a, b in zip(got, want):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_bf16_combine_accumulates_in_float32():
  n, k, d = 64, 8, 32
  ids = jax.random.randint(jax.random.key(0), (n, k), 0, 16)
  y_rows = jax.random.normal(jax.random.key(1), (n * k, d), jnp.bfloat16)
  w = jax.random.uniform(jax.random.key(2), (n, k))
  plan = permute.plan(ids, 16)
  out = permute.unpermute(y_rows, w, plan, out_dtype=jnp.float32)
  exact = np.einsum("nkd,nk->nd", np.asarray(y_rows.astype(jnp.float32))[np.asarray(plan.dest)], np.asarray(w))
  np.testing.assert_allclose(out, exact, rtol=1e-6, atol=1e-6)  # a bf16 sum would be off by ~1e-2


def _jaxpr_primitives(jaxpr) -> list:
  """(primitive name, output shapes) of every equation, nested jaxprs included."""
  found = []
  for eqn in jaxpr.eqns:
    found.append((eqn.primitive.name, [getattr(v.aval, "shape", ()) for v in eqn.outvars]))
    for value in eqn.params.values():
      for inner in value if isinstance(value, (list, tuple)) else [value]:
        inner = getattr(inner, "jaxpr", inner)  # ClosedJaxpr -> Jaxpr
        if hasattr(inner, "eqns"):
          found += _jaxpr_primitives(inner)
  return found


def test_gradient_is_gathers_with_no_scatter_and_no_token_expert_array():
  n, k, e, d = 40, 3, 11, 5  # distinct sizes, so a [tokens, experts] array would show in the shapes
  ids = jax.random.randint(jax.random.key(0), (n, k), 0, e)
  x = jax.random.normal(jax.random.key(1), (n, d))
  w = jax.random.uniform(jax.random.key(2), (n, k))

  def grad_fn(f):
    return jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) ** 2), argnums=(0, 1)))

  for pad in (0, 8):
    fused = grad_fn(lambda x, w: _fused(x, w, ids, e, pad))
    prims = _jaxpr_primitives(jax.make_jaxpr(fused)(x, w).jaxpr)
    names = {p for p, _ in prims}
    assert "gather" in names and not any("scatter" in p for p in names), names
    for _, shapes in prims:
      for s in shapes:
        assert not (e in s and (n in s or n * k in s)), f"[tokens, experts]-shaped array {s}"
    hlo = fused.lower(x, w).compile().as_text()
    assert not re.search(r"\sscatter\(", hlo) and re.search(r"\sgather\(", hlo)
  # The check can fail: XLA's own transpose of the same gathers is a scatter.
  naive = {p for p, _ in _jaxpr_primitives(jax.make_jaxpr(grad_fn(lambda x, w: _naive(x, w, ids)))(x, w).jaxpr)}
  assert any("scatter" in p for p in naive)


def test_plan_and_tile_schedule_compile_without_loops():
  """Index bookkeeping runs as straight-line kernels: a while loop costs a kernel launch and a host-visible
  condition per iteration on a GPU (a binary search over 65,536 sorted copies would be 17)."""
  from MaxText.kernels import mosaic_pipeline

  ids = jax.random.randint(jax.random.key(0), (512, 8), 0, 32)
  for pad in (0, 128):
    hlo = jax.jit(lambda i, pad=pad: permute.plan(i, 32, pad)).lower(ids).compile().as_text()
    assert not re.search(r"\swhile\(", hlo), f"pad={pad}"
  sizes = jnp.array([100, 0, 300, 7, 900] * 6 + [0, 1], jnp.int32)  # 7,843 of 8,192 rows
  hlo = jax.jit(lambda s: mosaic_pipeline.tile_schedule(s, 4096 * 2, 128)).lower(sizes).compile().as_text()
  assert not re.search(r"\swhile\(", hlo)
  # The check can fail: the default (looped) binary search does compile to a while loop.
  looped = jax.jit(lambda a, q: jnp.searchsorted(a, q)).lower(jnp.arange(33), jnp.arange(100)).compile().as_text()
  assert re.search(r"\swhile\(", looped)
