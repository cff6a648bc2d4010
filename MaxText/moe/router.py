"""DeepSeek-V3 routing (DeepSeek-V3 section 2.1.2).

Scores are sigmoid (or softmax) of the router logits. Expert *selection* uses
the scores plus a per-expert bias (auxiliary-loss-free balancing); the combine
*weights* come from the unbiased scores of the selected experts, normalised to
sum to one and multiplied by routed_scaling_factor. Group-limited routing
first keeps the `topk_routing_group` groups whose two best biased scores sum
highest. Rank-limited routing (DeepSeek-V3 sends each token to at most 4 nodes)
then splits the experts into `moe_route_limit_groups` contiguous groups (the
expert-parallel ranks or nodes holding them) and keeps the
`moe_route_limit_topk_groups` groups whose best ceil(k / M) biased scores sum
highest, so a token's k experts live on at most M of them. The bias is state,
not a parameter: `update_bias` moves it after each step against the observed
load, outside the gradient.
"""

import math

from typing import NamedTuple

import jax
import jax.numpy as jnp

from MaxText.config_schema import MoEConfig


class Routing(NamedTuple):
  expert_ids: jax.Array  # [tokens, k] int32
  weights: jax.Array  # [tokens, k] float32 combine weights
  scores: jax.Array  # [tokens, experts] float32 unbiased scores


def route(x: jax.Array, gate: jax.Array, bias: jax.Array, cfg: MoEConfig) -> Routing:
  """x [tokens, embed], gate [embed, experts], bias [experts]."""
  logits = jnp.einsum("td,de->te", x.astype(jnp.float32), gate.astype(jnp.float32))
  scores = jax.nn.sigmoid(logits) if cfg.routed_score_func == "sigmoid" else jax.nn.softmax(logits, axis=-1)
  choice = scores + bias if cfg.routed_bias else scores
  if cfg.n_routing_groups > 1:
    choice = _keep_top_groups(choice, cfg.n_routing_groups, cfg.topk_routing_group)
  if cfg.moe_route_limit_groups > 0:
    per_group_topk = math.ceil(cfg.num_experts_per_tok / cfg.moe_route_limit_topk_groups)
    choice = _keep_top_rank_groups(choice, cfg.moe_route_limit_groups, cfg.moe_route_limit_topk_groups, per_group_topk)
  _, expert_ids = jax.lax.top_k(choice, cfg.num_experts_per_tok)
  weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
  if cfg.norm_topk_prob:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  return Routing(expert_ids.astype(jnp.int32), weights * cfg.routed_scaling_factor, scores)


def _keep_top_groups(choice: jax.Array, num_groups: int, keep: int) -> jax.Array:
  tokens, experts = choice.shape
  grouped = choice.reshape(tokens, num_groups, experts // num_groups)
  group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
  _, top_groups = jax.lax.top_k(group_scores, keep)
  return _mask_groups(grouped, top_groups).reshape(tokens, experts)


def _keep_top_rank_groups(choice: jax.Array, num_groups: int, keep: int, per_group_topk: int) -> jax.Array:
  """Keeps each token's `keep` best contiguous expert groups; the rest become -inf.

  A group scores the sum of its best `per_group_topk` choice scores. Experts already excluded
  (-inf, by group-limited routing) do not count: groups rank first by how many of their best
  `per_group_topk` are still allowed, then by the sum of those, then by index, so the kept groups
  always hold as many allowed experts as any `keep` groups could.
  """
  tokens, experts = choice.shape
  grouped = choice.reshape(tokens, num_groups, experts // num_groups)
  best = jax.lax.top_k(grouped, per_group_topk)[0]
  allowed = jnp.isfinite(best)
  count = jnp.sum(allowed, axis=-1, dtype=jnp.int32)
  total = jnp.sum(jnp.where(allowed, best, 0.0), axis=-1)
  index = jnp.broadcast_to(jnp.arange(num_groups, dtype=jnp.int32), count.shape)
  _, _, ranked = jax.lax.sort((-count, -total, index), dimension=-1, num_keys=2, is_stable=True)
  return _mask_groups(grouped, ranked[:, :keep]).reshape(tokens, experts)


def _mask_groups(grouped: jax.Array, kept: jax.Array) -> jax.Array:
  """grouped [tokens, groups, per_group], kept [tokens, keep] group ids -> others set to -inf."""
  keep_mask = jnp.any(kept[:, :, None] == jnp.arange(grouped.shape[1])[None, None, :], axis=1)
  return jnp.where(keep_mask[:, :, None], grouped, -jnp.inf)


def expert_load(expert_ids: jax.Array, num_experts: int) -> jax.Array:
  """Token copies routed to each expert, [experts] int32."""
  return jnp.zeros((num_experts,), jnp.int32).at[expert_ids.reshape(-1)].add(1)


def sequence_balance_loss(routing: Routing, batch: int, cfg: MoEConfig) -> jax.Array:
  """DeepSeek-V3 eq. 17-20: per sequence, sum_i f_i * P_i, averaged over sequences (unweighted)."""
  e, k = cfg.num_experts, cfg.num_experts_per_tok
  scores = routing.scores.reshape(batch, -1, e)
  seq = scores.shape[1]
  ids = routing.expert_ids.reshape(batch, seq * k) + e * jnp.arange(batch, dtype=jnp.int32)[:, None]
  picked = jnp.zeros((batch * e,), jnp.float32).at[ids.reshape(-1)].add(1.0).reshape(batch, e)  # per-sequence counts
  f = picked * e / (k * seq)
  p = jnp.mean(scores / jnp.sum(scores, axis=-1, keepdims=True), axis=1)
  return jnp.mean(jnp.sum(f * p, axis=-1))


def update_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
  """Raise the bias of under-loaded experts and lower it for over-loaded ones."""
  load = load.astype(jnp.float32)
  return bias + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
