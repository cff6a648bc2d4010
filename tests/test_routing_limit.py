"""Rank-limited routing (moe_route_limit_groups / moe_route_limit_topk_groups): each token's experts
lie in at most M contiguous groups, chosen as DeepSeek-V3 does (NumPy reference), composed with
group-limited routing; equal to plain routing when every group is allowed; bad settings are one
clear error."""

import math

import jax
import numpy as np
import pytest

from MaxText.errors import UserError
from MaxText.moe import router

E = 32


def _inputs(tokens=48, seed=0):
  x = jax.random.normal(jax.random.key(seed), (tokens, 16))
  gate = jax.random.normal(jax.random.key(seed + 1), (16, E)) * 0.3
  bias = jax.random.normal(jax.random.key(seed + 2), (E,)) * 0.1
  return x, gate, bias


def _numpy_route(x, gate, bias, k, limit=None, routing_groups=None):
  """limit = (groups, keep), routing_groups = (groups, keep): the DeepSeek-V3 rule, one token at a time."""
  scores = 1 / (1 + np.exp(-(np.asarray(x, np.float64) @ np.asarray(gate, np.float64))))
  choice = scores + np.asarray(bias, np.float64)
  picked = []
  for t in range(choice.shape[0]):
    allowed = np.ones(E, bool)
    if routing_groups:
      n, keep = routing_groups
      group_score = np.sort(choice[t].reshape(n, -1), axis=1)[:, -2:].sum(1)
      allowed = np.repeat(np.isin(np.arange(n), np.argsort(-group_score, kind="stable")[:keep]), E // n)
    if limit:
      g, keep = limit
      c = math.ceil(k / keep)
      masked = np.where(allowed, choice[t], -np.inf).reshape(g, -1)
      best = -np.sort(-masked, axis=1)[:, :c]
      count = np.isfinite(best).sum(1)
      total = np.where(np.isfinite(best), best, 0).sum(1)
      ranked = sorted(range(g), key=lambda i: (-count[i], -total[i], i))[:keep]
      allowed &= np.repeat(np.isin(np.arange(g), ranked), E // g)
    candidates = np.flatnonzero(allowed)
    picked.append(set(candidates[np.argsort(-choice[t, candidates], kind="stable")[:k]]))
  return picked


def _groups_used(ids, groups):
  return [len(set(int(e) // (E // groups) for e in row)) for row in np.asarray(ids)]


@pytest.mark.parametrize("groups, keep", [(8, 2), (4, 1), (16, 3)])
def test_limit_is_respected_and_matches_numpy(tiny_config, groups, keep):
  cfg = tiny_config(
    f"num_experts={E}",
    "num_experts_per_tok=6",
    "n_routing_groups=1",
    "topk_routing_group=1",
    f"moe_route_limit_groups={groups}",
    f"moe_route_limit_topk_groups={keep}",
  ).moe
  x, gate, bias = _inputs()
  r = router.route(x, gate, bias, cfg)
  assert max(_groups_used(r.expert_ids, groups)) <= keep
  assert [set(np.asarray(row).tolist()) for row in r.expert_ids] == _numpy_route(x, gate, bias, 6, limit=(groups, keep))
  plain = router.route(
    x,
    gate,
    bias,
    tiny_config(f"num_experts={E}", "num_experts_per_tok=6", "n_routing_groups=1", "topk_routing_group=1").moe,
  )
  assert max(_groups_used(plain.expert_ids, groups)) > keep  # the limit did something


def test_limit_allowing_every_group_is_plain_routing(tiny_config):
  base = (f"num_experts={E}", "num_experts_per_tok=8", "n_routing_groups=4", "topk_routing_group=2")
  x, gate, bias = _inputs(seed=5)
  plain = router.route(x, gate, bias, tiny_config(*base).moe)
  limited = router.route(
    x, gate, bias, tiny_config(*base, "moe_route_limit_groups=8", "moe_route_limit_topk_groups=8").moe
  )
  np.testing.assert_array_equal(limited.expert_ids, plain.expert_ids)
  np.testing.assert_array_equal(limited.weights, plain.weights)


@pytest.mark.parametrize("routing_groups, limit", [((4, 2), (8, 3)), ((8, 4), (4, 2)), ((8, 3), (2, 1))])
def test_composes_with_group_limited_routing(tiny_config, routing_groups, limit):
  (n, n_keep), (g, g_keep) = routing_groups, limit
  cfg = tiny_config(
    f"num_experts={E}",
    "num_experts_per_tok=4",
    f"n_routing_groups={n}",
    f"topk_routing_group={n_keep}",
    f"moe_route_limit_groups={g}",
    f"moe_route_limit_topk_groups={g_keep}",
  ).moe
  x, gate, bias = _inputs(seed=7)
  r = router.route(x, gate, bias, cfg)
  assert max(_groups_used(r.expert_ids, g)) <= g_keep
  assert max(_groups_used(r.expert_ids, n)) <= n_keep
  assert [set(np.asarray(row).tolist()) for row in r.expert_ids] == _numpy_route(
    x, gate, bias, 4, limit=limit, routing_groups=routing_groups
  )


@pytest.mark.parametrize(
  "overrides, message",
  [
    (("moe_route_limit_topk_groups=2",), "needs moe_route_limit_groups > 0"),
    (("moe_route_limit_groups=3", "moe_route_limit_topk_groups=1"), "not divisible by 3 groups"),
    (("moe_route_limit_groups=4", "moe_route_limit_topk_groups=5"), "between 1 and moe_route_limit_groups=4"),
    (("moe_route_limit_groups=4", "moe_route_limit_topk_groups=0"), "between 1 and moe_route_limit_groups=4"),
    (
      ("moe_route_limit_groups=8", "moe_route_limit_topk_groups=1", "num_experts_per_tok=2"),
      "cannot supply num_experts_per_tok=2",
    ),
    (
      (
        "n_routing_groups=4",
        "topk_routing_group=2",
        "moe_route_limit_groups=6",
        "moe_route_limit_topk_groups=3",
        "num_experts=24",
      ),
      "must nest",
    ),
    (
      (
        "num_experts=32",
        "n_routing_groups=8",
        "topk_routing_group=2",
        "moe_route_limit_groups=2",
        "moe_route_limit_topk_groups=1",
        "num_experts_per_tok=8",
      ),
      "may hold only 1",
    ),
    (("moe_group_pad_multiple=8", "moe_dispatch=capacity", "capacity_factor=1.5"), "moe_group_pad_multiple"),
  ],
)
def test_bad_settings_are_user_errors(tiny_config, overrides, message):
  with pytest.raises(UserError, match=message):
    tiny_config("num_experts_per_tok=2", "n_routing_groups=1", "topk_routing_group=1", *overrides)
