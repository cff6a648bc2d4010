"""MoE: routing rules, dropless dispatch vs a per-token loop, capacity drops, bias update."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import params
from MaxText.moe import router
from MaxText.moe.dispatch import get_dispatcher
from MaxText.moe.layer import moe, moe_specs
from MaxText.moe.reference import moe_loop
from MaxText.sharding import Sharder


def _moe_params(cfg, emb=64, seed=0):
  return params.initialize(moe_specs(emb, cfg.moe), jax.random.key(seed), jnp.float32, 0.1)


def _x(batch=2, seq=24, emb=64, seed=1):
  return jax.random.normal(jax.random.key(seed), (batch, seq, emb))


@pytest.mark.parametrize(
  "overrides",
  [
    (),
    ("shared_experts=0", "n_routing_groups=1", "topk_routing_group=1"),
    ("routed_score_func=softmax", "num_experts_per_tok=3"),
  ],
)
def test_dropless_equals_per_token_loop(tiny_config, overrides):
  cfg = tiny_config(*overrides)
  p, x = _moe_params(cfg), _x()
  bias = jax.random.normal(jax.random.key(3), (cfg.moe.num_experts,)) * 0.05
  out, stats = moe(p, x, bias, cfg.moe, Sharder())
  np.testing.assert_allclose(out, moe_loop(p, x, bias, cfg.moe), rtol=1e-5, atol=1e-5)
  assert int(stats.dropped) == 0 and int(stats.load.sum()) == x.shape[0] * x.shape[1] * cfg.moe.num_experts_per_tok


def test_capacity_equals_dropless_when_nothing_overflows(tiny_config):
  dropless = tiny_config()
  capacity = tiny_config("moe_dispatch=capacity", f"capacity_factor={dropless.moe.num_experts}")  # room for every copy
  p, x, bias = _moe_params(dropless), _x(), jnp.zeros((8,))
  out, _ = moe(p, x, bias, dropless.moe, Sharder())
  out_c, stats = moe(p, x, bias, capacity.moe, Sharder())
  assert int(stats.dropped) == 0
  np.testing.assert_allclose(out_c, out, rtol=1e-6, atol=1e-6)


def test_capacity_counts_and_drops_the_overflow(tiny_config):
  cfg = tiny_config("moe_dispatch=capacity", "capacity_factor=0.5")
  tokens, k, e = 40, cfg.moe.num_experts_per_tok, cfg.moe.num_experts
  ids = jax.random.randint(jax.random.key(0), (tokens, k), 0, e)
  ids = ids.at[:, 0].set(0)  # expert 0 is oversubscribed
  x = jax.random.normal(jax.random.key(1), (tokens, 16))
  weights = jnp.ones((tokens, k))
  d = get_dispatcher("capacity", 0.5)
  cap = d.capacity(tokens, k, e)
  dispatched = d.dispatch(x, ids, e)
  y = d.combine(dispatched.rows * 2.0, weights, dispatched)  # "expert" = doubling

  # numpy reference: earlier tokens (then earlier k-slots) claim an expert's slots first
  seen = np.zeros(e, int)
  expected = np.zeros((tokens, 16), np.float32)
  dropped = 0
  for t in range(tokens):
    for j in range(k):
      ex = int(ids[t, j])
      if seen[ex] < cap:
        expected[t] += 2.0 * np.asarray(x[t])
      else:
        dropped += 1
      seen[ex] += 1
  assert dropped > 0 and int(dispatched.dropped) == dropped
  np.testing.assert_allclose(y, expected, rtol=1e-6)
  assert dispatched.rows.shape == (e * cap, 16) and np.all(np.asarray(dispatched.group_sizes) == cap)


def test_sort_dispatch_groups_rows_by_expert():
  ids = jnp.array([[3, 1], [1, 0], [3, 2]])
  x = jnp.arange(3.0)[:, None] * jnp.ones((3, 4))
  d = get_dispatcher("sort", -1)
  out = d.dispatch(x, ids, 4)
  np.testing.assert_array_equal(out.group_sizes, [1, 2, 1, 2])
  np.testing.assert_array_equal(out.rows[:, 0], [1, 0, 1, 2, 0, 2])  # token of each row, by expert
  w = jnp.array([[0.5, 0.25], [1.0, 2.0], [3.0, 0.0]])
  np.testing.assert_allclose(d.combine(out.rows, w, out)[:, 0], [0.0, 3.0, 6.0])


def test_group_limited_routing_matches_numpy(tiny_config):
  cfg = tiny_config("num_experts=16", "n_routing_groups=4", "topk_routing_group=2", "num_experts_per_tok=4").moe
  x = jax.random.normal(jax.random.key(0), (32, 64))
  gate = jax.random.normal(jax.random.key(1), (64, 16)) * 0.2
  bias = jax.random.normal(jax.random.key(2), (16,)) * 0.1
  r = router.route(x, gate, bias, cfg)

  scores = 1 / (1 + np.exp(-(np.asarray(x, np.float64) @ np.asarray(gate, np.float64))))
  choice = scores + np.asarray(bias)
  for t in range(32):
    groups = choice[t].reshape(4, 4)
    group_score = np.sort(groups, axis=1)[:, -2:].sum(1)
    keep = np.argsort(-group_score)[:2]
    allowed = np.concatenate([np.arange(g * 4, g * 4 + 4) for g in keep])
    top = allowed[np.argsort(-choice[t, allowed])[:4]]
    assert set(np.asarray(r.expert_ids[t])) == set(top)
    w = scores[t, np.asarray(r.expert_ids[t])]  # weights from the unbiased scores
    np.testing.assert_allclose(r.weights[t], w / w.sum() * cfg.routed_scaling_factor, rtol=1e-4)


def test_bias_changes_selection_not_weights(tiny_config):
  cfg = tiny_config("n_routing_groups=1", "topk_routing_group=1").moe
  x = jax.random.normal(jax.random.key(0), (64, 64))
  gate = jax.random.normal(jax.random.key(1), (64, 8)) * 0.2
  big = jnp.zeros((8,)).at[5].set(10.0)
  r = router.route(x, gate, big, cfg)
  assert np.all(np.any(np.asarray(r.expert_ids) == 5, axis=1))  # everyone picks expert 5
  unbiased = router.route(x, gate, jnp.zeros((8,)), cfg)
  np.testing.assert_allclose(r.scores, unbiased.scores)


def test_bias_update_moves_against_the_load():
  bias = jnp.zeros((2, 4))
  load = jnp.array([[10, 2, 2, 2], [4, 4, 4, 4]])
  new = router.update_bias(bias, load, 0.01)
  np.testing.assert_allclose(new, [[-0.01, 0.01, 0.01, 0.01], [0, 0, 0, 0]])


def test_sequence_balance_loss_is_one_when_uniform(tiny_config):
  cfg = tiny_config(
    "num_experts=4", "num_experts_per_tok=1", "n_routing_groups=1", "topk_routing_group=1", "routed_score_func=softmax"
  ).moe
  ids = jnp.array([[0], [1], [2], [3]])
  r = router.Routing(ids, jnp.ones((4, 1)), jnp.full((4, 4), 0.25))
  assert float(router.sequence_balance_loss(r, 1, cfg)) == pytest.approx(1.0)
  skewed = router.Routing(
    jnp.zeros((4, 1), jnp.int32), jnp.ones((4, 1)), jnp.tile(jnp.array([[0.7, 0.1, 0.1, 0.1]]), (4, 1))
  )
  assert float(router.sequence_balance_loss(skewed, 1, cfg)) == pytest.approx(4 * 0.7)
