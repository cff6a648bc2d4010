r"""DeepSeek-V3 (arXiv:2412.19437) as parameter specs and pure functions.

  tokens -> embed -> [dense layers] -> [MoE layers] -> final norm -> head -> logits
                                                   \-> MTP modules (optional) -> extra losses

A decoder layer is pre-norm: x + MLA(norm(x)), then h + FFN(norm(h)), where FFN
is a SwiGLU MLP in the first `first_num_dense_layers` layers and DeepSeekMoE
after. Layers of each kind are stacked on a leading axis and run with
`lax.scan` (scan_layers) under `jax.checkpoint` (remat_policy). Embedding and
output head are untied. Each MTP module k combines the normed hidden state of
depth k-1 with the normed embedding of token t+k, runs one MoE decoder layer,
and predicts token t+k+1 through its own final norm and the shared head.

The routing bias is state, passed beside the parameters: {"moe_layers":
[layers, experts], "mtp_layers": [modules, experts]}.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxText import remat
from MaxText.config_schema import ModelConfig, MoEConfig
from MaxText.layers.linear import dense_for
from MaxText.layers.loss_head import chunked_cross_entropy
from MaxText.layers.mla import mla, mla_specs
from MaxText.layers.mlp import mlp, mlp_specs
from MaxText.layers.norms import rms_norm, rms_norm_spec
from MaxText.layers.rope import rope_tables
from MaxText.moe.layer import MoEStats, moe, moe_specs
from MaxText.params import ParamSpec, stacked

# Parameters that stay in weight_dtype when the rest is cast to dtype.
KEEP_PRECISION = ("gate",)


class Batch(NamedTuple):
  inputs: jax.Array  # [batch, seq] int32 token ids
  targets: jax.Array  # [batch, seq] int32 next-token ids
  mask: jax.Array  # [batch, seq] float32 loss weights
  # Packed sequences (several documents per row): which document each token belongs to (1, 2, ...;
  # 0 = padding) and its position within that document. None = one document per row, positions 0..seq-1.
  segment_ids: jax.Array | None = None  # [batch, seq] int32
  positions: jax.Array | None = None  # [batch, seq] int32


class LossAux(NamedTuple):
  ce: jax.Array  # main next-token cross-entropy
  mtp: jax.Array  # mean MTP cross-entropy over modules (0 without MTP)
  balance: jax.Array  # sum over MoE layers of the sequence-wise balance loss
  load: dict  # like the bias state: token copies per expert per layer
  dropped: jax.Array  # token copies dropped by a capacity limit, all layers
  ep_overflow: jax.Array  # token copies that did not fit an expert-parallel buffer, all layers (must be 0)
  ep_sent_bytes: jax.Array  # [2] payload bytes between expert-parallel ranks: as sent, and without dedup


def layer_specs(m: ModelConfig, moe_cfg: MoEConfig, kind: str) -> dict:
  ffn = mlp_specs(m.emb_dim, m.base_mlp_dim) if kind == "dense" else moe_specs(m.emb_dim, moe_cfg)
  return {
    "attn_norm": rms_norm_spec(m.emb_dim),
    "mla": mla_specs(m),
    "ffn_norm": rms_norm_spec(m.emb_dim),
    "ffn": ffn,
  }


def model_specs(m: ModelConfig, moe_cfg: MoEConfig) -> dict:
  specs = {
    "embed": ParamSpec((m.vocab_size, m.emb_dim), ("vocab", "embed")),
    "final_norm": rms_norm_spec(m.emb_dim),
    "head": ParamSpec((m.emb_dim, m.vocab_size), ("embed", "vocab")),
  }
  if m.first_num_dense_layers:
    specs["dense_layers"] = stacked(layer_specs(m, moe_cfg, "dense"), m.first_num_dense_layers)
  if m.num_moe_layers:
    specs["moe_layers"] = stacked(layer_specs(m, moe_cfg, "moe"), m.num_moe_layers)
  if m.mtp_num_layers:
    module = {
      "embed_norm": rms_norm_spec(m.emb_dim),
      "hidden_norm": rms_norm_spec(m.emb_dim),
      "proj": ParamSpec((2 * m.emb_dim, m.emb_dim), (None, "embed")),
      "layer": layer_specs(m, moe_cfg, "moe"),
      "final_norm": rms_norm_spec(m.emb_dim),
    }
    specs["mtp_layers"] = stacked(module, m.mtp_num_layers)
  return specs


def bias_state(m: ModelConfig, moe_cfg: MoEConfig) -> dict:
  # Only stacks that exist get a bias: orbax cannot save zero-size arrays.
  sizes = {"moe_layers": m.num_moe_layers, "mtp_layers": m.mtp_num_layers}
  return {k: jnp.zeros((n, moe_cfg.num_experts), jnp.float32) for k, n in sizes.items() if n}


def cast_for_compute(params: dict, dtype) -> dict:
  def cast(path, p):
    name = getattr(path[-1], "key", None)
    return p if name in KEEP_PRECISION else p.astype(dtype)

  return jax.tree_util.tree_map_with_path(cast, params)


def embed_tokens(table: jax.Array, ids: jax.Array, shard) -> jax.Array:
  """The embedding table's rows for token ids [batch, seq] -> [batch, seq, embed].

  The table's embed dim is split over fsdp like every weight, and the tokens over the batch axes, fsdp
  among them. A lookup in the split table would give an output split over fsdp twice, which XLA's
  partitioner resolves by replicating the whole [batch, seq, embed] activation on every device
  ("Involuntary full rematerialization"). Gathering the table's embed dim first (the FSDP all-gather every
  layer's weights get) leaves only the vocab split, which XLA looks up locally and sums; the table's
  gradient leaves as a reduce-scatter."""
  table = shard(table, ("vocab", None))
  return shard(jnp.take(table, ids, axis=0), ("batch", "seq", "act_embed"))


def decoder_layer(p, x, bias, rope, m: ModelConfig, moe_cfg: MoEConfig, shard, segment_ids=None):
  eps = m.normalization_layer_epsilon
  # Every use reads the named copy, so an offloaded layer input leaves no device copy behind.
  x = checkpoint_name(shard(x, ("batch", "seq", "act_embed")), "decoder_layer_input")
  dense = dense_for(moe_cfg, getattr(shard, "mesh", None))  # the linear layers' GEMMs (quantize_layers)
  h = x + mla(p["mla"], rms_norm(x, p["attn_norm"], eps), rope, m, shard, segment_ids, dense)
  normed = rms_norm(h, p["ffn_norm"], eps)
  if bias is None:
    with jax.named_scope("mlp"):
      return h + mlp(p["ffn"], normed, shard, dense), None
  with jax.named_scope("moe"):
    y, stats = moe(p["ffn"], normed, bias, moe_cfg, shard, dense)
  return h + y, stats


def _run_stack(stack: dict, x, biases, rope, m: ModelConfig, moe_cfg: MoEConfig, shard, segment_ids=None):
  """Runs stacked layers over x; returns x and the per-layer MoEStats stacked (or None)."""

  def body(carry, xs):
    p, b = xs
    return decoder_layer(p, carry, b, rope, m, moe_cfg, shard, segment_ids)

  body = remat.remat(body, m, m.scan_layers)
  if m.scan_layers:
    return jax.lax.scan(body, x, (stack, biases))
  num = jax.tree.leaves(stack)[0].shape[0]
  all_stats = []
  for i in range(num):
    x, stats = body(x, jax.tree.map(lambda a: a[i], (stack, biases)))
    all_stats.append(stats)
  return x, None if biases is None else jax.tree.map(lambda *s: jnp.stack(s), *all_stats)


def _cross_entropy(h, head, targets, mask, m: ModelConfig, shard):
  """Mean token cross-entropy of logits = h @ head over the weighted tokens, chunked over tokens so that the
  float32 logits never exist whole (MaxText/layers/loss_head.py). loss_chunk_tokens counts rows per device."""
  dot_dtype = jnp.float32 if m.logits_dot_in_fp32 else h.dtype
  rows_split = shard.devices_along("batch") if getattr(shard, "mesh", None) is not None else 1
  total = chunked_cross_entropy(
    h, head, targets, mask, chunk_tokens=m.loss_chunk_tokens * rows_split, dot_dtype=dot_dtype, shard=shard
  )
  return total / jnp.maximum(jnp.sum(mask), 1.0)


def _logits(h, head, m: ModelConfig):
  """The whole float32 logits h @ head [batch, seq, vocab], for inspection and scoring (never in training)."""
  dot_dtype = jnp.float32 if m.logits_dot_in_fp32 else h.dtype
  return jnp.einsum("bsd,dv->bsv", h.astype(dot_dtype), head.astype(dot_dtype), preferred_element_type=jnp.float32)


def _shift_left(a, fill=0):
  return jnp.concatenate([a[:, 1:], jnp.full_like(a[:, :1], fill)], axis=1)


def loss_fn(
  params: dict, bias: dict, batch: Batch, m: ModelConfig, moe_cfg: MoEConfig, shard
) -> tuple[jax.Array, LossAux]:
  """Training loss: cross-entropy + MTP + balance terms; also returns the expert load."""
  loss, aux, _ = _forward(params, bias, batch, m, moe_cfg, shard, with_logits=False)
  return loss, aux


def forward(params: dict, bias: dict, batch: Batch, m: ModelConfig, moe_cfg: MoEConfig, shard):
  """(loss, LossAux, main logits [batch, seq, vocab] float32): loss_fn's values and the whole logits, for
  inspection and scoring. Training calls loss_fn, which never forms the whole logits."""
  return _forward(params, bias, batch, m, moe_cfg, shard, with_logits=True)


def _forward(params: dict, bias: dict, batch: Batch, m: ModelConfig, moe_cfg: MoEConfig, shard, with_logits: bool):
  p = cast_for_compute(params, jnp.dtype(m.dtype))
  eps = m.normalization_layer_epsilon
  positions = batch.positions
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(batch.inputs.shape[1]), batch.inputs.shape)
  rope = rope_tables(positions, m)
  seg = batch.segment_ids

  with jax.named_scope("embed"):
    x = embed_tokens(p["embed"], batch.inputs, shard)
  none_i, none_f = jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.float32)
  no_stats = MoEStats(jnp.zeros((0, moe_cfg.num_experts), jnp.int32), none_i, none_f, none_i, none_f, none_f)
  if "dense_layers" in p:
    x, _ = _run_stack(p["dense_layers"], x, None, rope, m, moe_cfg, shard, seg)
  moe_stats = no_stats
  if "moe_layers" in p:
    x, moe_stats = _run_stack(p["moe_layers"], x, bias["moe_layers"], rope, m, moe_cfg, shard, seg)

  with jax.named_scope("head"):
    normed = rms_norm(x, p["final_norm"], eps)
    ce = _cross_entropy(normed, p["head"], batch.targets, batch.mask, m, shard)
    logits = _logits(normed, p["head"], m) if with_logits else None

  mtp_ce, mtp_stats = jnp.zeros((), jnp.float32), no_stats
  if "mtp_layers" in p:
    mtp_ce, mtp_stats = _mtp(p, x, bias["mtp_layers"], batch, rope, m, moe_cfg, shard)

  balance = jnp.sum(moe_stats.balance_loss) + jnp.sum(mtp_stats.balance_loss)
  loss = ce + m.mtp_loss_scaling_factor * mtp_ce + moe_cfg.load_balance_loss_weight * balance
  aux = LossAux(
    ce=ce,
    mtp=mtp_ce,
    balance=balance,
    load={"moe_layers": moe_stats.load, "mtp_layers": mtp_stats.load},
    dropped=jnp.sum(moe_stats.dropped) + jnp.sum(mtp_stats.dropped),
    ep_overflow=jnp.sum(moe_stats.ep_overflow) + jnp.sum(mtp_stats.ep_overflow),
    ep_sent_bytes=jnp.stack(
      [
        jnp.sum(moe_stats.ep_sent_bytes) + jnp.sum(mtp_stats.ep_sent_bytes),
        jnp.sum(moe_stats.ep_sent_bytes_nodedup) + jnp.sum(mtp_stats.ep_sent_bytes_nodedup),
      ]
    ),
  )
  return loss, aux, logits


def _mtp(p, hidden, biases, batch: Batch, rope, m: ModelConfig, moe_cfg: MoEConfig, shard):
  """Runs the MTP modules in sequence; module k sees token t+k and predicts t+k+1.

  With packed rows, a position whose token t+k lies in another document gets no MTP loss, so no
  module learns to predict across a document boundary.
  """
  eps = m.normalization_layer_epsilon
  seg = batch.segment_ids

  def module(carry, xs):
    h, inputs, targets, mask, shifted_seg = carry
    mp, b = xs
    inputs, targets, mask = _shift_left(inputs), _shift_left(targets), _shift_left(mask, 0.0)
    loss_mask = mask
    if seg is not None:
      shifted_seg = _shift_left(shifted_seg)
      loss_mask = mask * (shifted_seg == seg).astype(mask.dtype)
    e = rms_norm(embed_tokens(p["embed"], inputs, shard), mp["embed_norm"], eps)
    merged = jnp.concatenate([e, rms_norm(h, mp["hidden_norm"], eps)], axis=-1)
    h = jnp.einsum("bsc,cd->bsd", merged, mp["proj"])
    h, stats = decoder_layer(mp["layer"], h, b, rope, m, moe_cfg, shard, seg)
    with jax.named_scope("head"):  # the shared output projection, attributed as the main one's (MaxText/profile.py)
      ce = _cross_entropy(rms_norm(h, mp["final_norm"], eps), p["head"], targets, loss_mask, m, shard)
    return (h, inputs, targets, mask, shifted_seg), (ce, stats)

  module = remat.remat(module, m, scanned=True)
  init = (hidden, batch.inputs, batch.targets, batch.mask, seg)
  with jax.named_scope("mtp"):
    _, (ces, stats) = jax.lax.scan(module, init, (p["mtp_layers"], biases))
  return jnp.mean(ces), stats
