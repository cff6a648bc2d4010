"""DeepSeek-V3 model: shapes, parameter counts of the real config, causality, RoPE/YaRN."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import flops, model, params
from MaxText.config import load_config
from MaxText.layers import rope
from MaxText.sharding import Sharder

from conftest import REPO


def _init(cfg, seed=0):
  specs = model.model_specs(cfg.model, cfg.moe)
  return params.initialize(specs, jax.random.key(seed), jnp.float32, cfg.model.param_init_std), model.bias_state(
    cfg.model, cfg.moe
  )


def _batch(cfg, batch=2, seq=16, seed=0):
  tokens = jax.random.randint(jax.random.key(seed), (batch, seq + 1), 0, cfg.model.vocab_size)
  return model.Batch(tokens[:, :-1], tokens[:, 1:], jnp.ones((batch, seq), jnp.float32))


def test_forward_shapes_and_loss_near_uniform(tiny_config):
  cfg = tiny_config()
  p, bias = _init(cfg)
  b = _batch(cfg)
  loss, aux, logits = model.forward(p, bias, b, cfg.model, cfg.moe, Sharder())
  assert logits.shape == (2, 16, cfg.model.vocab_size) and logits.dtype == jnp.float32
  assert aux.load["moe_layers"].shape == (cfg.model.num_moe_layers, cfg.moe.num_experts)
  assert aux.load["mtp_layers"].shape == (cfg.model.mtp_num_layers, cfg.moe.num_experts)
  # every token's k copies are counted once per MoE layer
  assert np.all(np.asarray(aux.load["moe_layers"]).sum(-1) == 2 * 16 * cfg.moe.num_experts_per_tok)
  assert abs(float(aux.ce) - math.log(cfg.model.vocab_size)) < 0.1  # small init: near-uniform predictions
  assert int(aux.dropped) == 0


@pytest.mark.parametrize("scan_layers", [True, False])
def test_causal_future_tokens_do_not_change_past_logits(tiny_config, scan_layers):
  cfg = tiny_config(f"scan_layers={str(scan_layers).lower()}", "n_routing_groups=1", "topk_routing_group=1")
  p, bias = _init(cfg)
  b = _batch(cfg, batch=1, seq=12)
  changed = b.inputs.at[0, 8:].set((b.inputs[0, 8:] + 1) % cfg.model.vocab_size)
  _, _, logits = model.forward(p, bias, b, cfg.model, cfg.moe, Sharder())
  _, _, logits2 = model.forward(p, bias, b._replace(inputs=changed), cfg.model, cfg.moe, Sharder())
  np.testing.assert_allclose(logits[0, :8], logits2[0, :8], rtol=1e-5, atol=1e-5)
  assert not np.allclose(logits[0, 8:], logits2[0, 8:], atol=1e-4)


def test_scan_and_loop_give_the_same_loss(tiny_config):
  b = None
  losses = []
  for scan in ("true", "false"):
    cfg = tiny_config(f"scan_layers={scan}")
    p, bias = _init(cfg)
    b = b or _batch(cfg)
    losses.append(float(model.forward(p, bias, b, cfg.model, cfg.moe, Sharder())[0]))
  assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_671b_parameter_counts(tmp_path):
  recipe = tmp_path / "r.yml"
  recipe.write_text(f"model_config: {REPO / 'configs/deepseek_v3/671b.yml'}\n")
  cfg = load_config(recipe)
  specs = model.model_specs(cfg.model, cfg.moe)
  total = params.count(specs)
  mtp = params.count(specs["mtp_layers"])
  assert (total - mtp) / 1e9 == pytest.approx(671.0, rel=1e-3)  # the paper's 671B, MTP excluded
  m = cfg.model
  mtp_active = flops.active_weights_per_token(m, cfg.moe) - flops.active_weights_per_token(
    m.__class__(**{**m.__dict__, "mtp_num_layers": 0}), cfg.moe
  )
  main_active = flops.active_weights_per_token(m, cfg.moe) - mtp_active + m.vocab_size * m.emb_dim
  assert 36.5e9 < main_active < 38.5e9  # "37B activated for each token"
  assert specs["moe_layers"]["ffn"]["wi_0"].shape == (58, 256, 7168, 2048)
  assert specs["dense_layers"]["mla"]["wkv_b"].shape == (3, 512, 128, 256)


def test_yarn_frequencies(tiny_config):
  plain = tiny_config("rope_type=default").model
  yarn = tiny_config("rope_factor=40", "original_max_position_embeddings=4096", "qk_rope_head_dim=64").model
  base = 1.0 / (yarn.rope_max_timescale ** (np.arange(0, 64, 2) / 64))
  inv = np.asarray(rope.inverse_frequencies(yarn))
  # the highest frequencies rotate many times within the original context: kept as they are
  np.testing.assert_allclose(inv[:8], base[:8], rtol=1e-6)
  # the lowest rotate less than beta_slow times: divided by the factor
  np.testing.assert_allclose(inv[-4:], base[-4:] / 40, rtol=1e-6)
  assert np.all(np.diff(inv) < 0)
  np.testing.assert_allclose(
    np.asarray(rope.inverse_frequencies(plain)),
    1.0 / (plain.rope_max_timescale ** (np.arange(0, plain.qk_rope_head_dim, 2) / plain.qk_rope_head_dim)),
    rtol=1e-6,
  )
  assert rope.yarn_mscale(40, 1.0) == pytest.approx(0.1 * math.log(40) + 1)


def test_rope_scores_depend_only_on_relative_position(tiny_config):
  m = tiny_config().model
  q = jax.random.normal(jax.random.key(1), (1, 1, 1, m.qk_rope_head_dim))
  k = jax.random.normal(jax.random.key(2), (1, 1, 1, m.qk_rope_head_dim))

  def score(i, j):
    cq, sq = rope.rope_tables(jnp.array([[i]]), m)
    ck, sk = rope.rope_tables(jnp.array([[j]]), m)
    return float(jnp.sum(rope.apply_rope(q, cq, sq) * rope.apply_rope(k, ck, sk)))

  assert score(5, 2) == pytest.approx(score(13, 10), rel=1e-5)
  assert score(5, 2) != pytest.approx(score(5, 4), rel=1e-3)
  cq, sq = rope.rope_tables(jnp.array([[7]]), m)
  assert float(jnp.linalg.norm(rope.apply_rope(q, cq, sq))) == pytest.approx(float(jnp.linalg.norm(q)), rel=1e-5)
