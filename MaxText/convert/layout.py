"""Which Hugging Face tensor is which slice of our parameters, and how each is laid out.

Our parameters (MaxText/model.py model_specs) stack layers of a kind on a
leading axis ('dense_layers', 'moe_layers', 'mtp_layers') and experts on the
next; the routing bias is separate state (model.bias_state). Each HF tensor
fills one slice of one of our leaves:

  model.embed_tokens.weight [vocab, d]                 -> params/embed [vocab, d]
  lm_head.weight [vocab, d]                            -> params/head [d, vocab] (transposed)
  model.layers.{i}.self_attn.q_b_proj.weight [h*k, r]  -> params/<stack>/mla/wq_b[l] [r, h, k]
  model.layers.{i}.self_attn.o_proj.weight [d, h*v]    -> params/<stack>/mla/wo[l] [h, v, d]
  model.layers.{i}.mlp.experts.{e}.gate_proj [f, d]    -> params/moe_layers/ffn/wi_0[l, e] [d, f]
  model.layers.{i}.mlp.gate.e_score_correction_bias    -> bias/moe_layers[l]
  model.layers.{L+k}.*  (MTP module k, after the L main layers) -> params/mtp_layers[k]

torch Linear weights are [out, in]; ours are [in, out]. Rotary dims: we rotate
adjacent pairs (x[2i], x[2i+1]), the layout of the release (config
rope_interleave=true), so those weights copy as they are; with
rope_interleave=false transformers rotates (x[i], x[i + d/2]) and the rotary
columns of q and k are permuted into pairs on the way in, and back on the way out.
An MTP module's `embed_tokens` and `shared_head.head` are copies of the main
ones in the release; ours shares them, so they are checked on the way in and
written out again on the way back ("alias" entries).
"""

from dataclasses import dataclass

import jax
import numpy as np

from MaxText import model
from MaxText.config_schema import ModelConfig, MoEConfig
from MaxText.params import is_spec


class Copy:
  def to_ours(self, x):
    return x

  def to_hf(self, x):
    return x

  def hf_shape(self, shape):
    return shape


class Linear:
  """torch [out, in] <-> ours [in, out], with `cols` (a permutation of out) applied on our side."""

  def __init__(self, cols: np.ndarray | None = None):
    self.cols = cols

  def to_ours(self, x):
    y = x.T
    return y if self.cols is None else y[:, self.cols]

  def to_hf(self, x):
    y = x if self.cols is None else x[:, np.argsort(self.cols)]
    return y.T

  def hf_shape(self, shape):
    return shape[::-1]


class HeadsIn(Linear):
  """torch [heads * k, in] <-> ours [in, heads, k] (q projections, kv_b)."""

  def __init__(self, k: int, cols: np.ndarray | None = None):
    super().__init__(cols)
    self.k = k

  def to_ours(self, x):
    in_dim = x.shape[1]
    y = super().to_ours(x)  # [in, heads * k], rotary columns already in pair order
    return y.reshape(in_dim, -1, self.k)

  def to_hf(self, x):
    return super().to_hf(x.reshape(x.shape[0], -1))

  def hf_shape(self, shape):
    return (shape[1] * shape[2], shape[0])


class HeadsOut:
  """torch o_proj [d, heads * v] <-> ours wo [heads, v, d]."""

  def __init__(self, v: int):
    self.v = v

  def to_ours(self, x):
    return x.T.reshape(-1, self.v, x.shape[0])

  def to_hf(self, x):
    return x.reshape(-1, x.shape[-1]).T

  def hf_shape(self, shape):
    return (shape[2], shape[0] * shape[1])


@dataclass(frozen=True)
class Entry:
  hf_name: str
  leaf: tuple[str, ...]  # ("params", ...) or ("bias", ...)
  index: tuple[int, ...]  # the slice of the leaf: (layer,) or (layer, expert) or ()
  transform: object
  alias: bool = False  # a copy of another entry's tensor (MTP embed/head): checked in, written out


def leaf_shapes(m: ModelConfig, moe_cfg: MoEConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
  """Every leaf of {"params": model_specs, "bias": bias_state} -> its shape."""
  specs = jax.tree_util.tree_flatten_with_path(model.model_specs(m, moe_cfg), is_leaf=is_spec)[0]
  shapes = {("params", *(k.key for k in path)): s.shape for path, s in specs}
  shapes[("bias", "moe_layers")] = (m.num_moe_layers, moe_cfg.num_experts)
  shapes[("bias", "mtp_layers")] = (m.mtp_num_layers, moe_cfg.num_experts)
  return shapes


def hf_shape(e: Entry, shapes: dict) -> tuple[int, ...]:
  """The shape the HF tensor of `e` has, given our leaf shapes."""
  return tuple(e.transform.hf_shape(shapes[e.leaf][len(e.index) :]))


def rope_pairs(dim: int) -> np.ndarray:
  """Our pair layout from transformers' halves layout: ours[2i] = hf[i], ours[2i+1] = hf[i + dim/2]."""
  half = np.arange(dim // 2)
  return np.stack([half, half + dim // 2], axis=-1).reshape(-1)


def _columns(total: int, rope_start: int, rope_dim: int, interleaved: bool, repeat: int = 1) -> np.ndarray | None:
  """Column permutation of a [.., repeat * total] output whose last `rope_dim` of each `total` are rotary."""
  if interleaved:
    return None
  one = np.arange(total)
  one[rope_start:] = rope_start + rope_pairs(rope_dim)
  return (np.arange(repeat)[:, None] * total + one[None, :]).reshape(-1)


def _layer(
  prefix: str, leaf: tuple, i: tuple, m: ModelConfig, moe_cfg: MoEConfig | None, bias_leaf, interleaved: bool
) -> list[Entry]:
  """The tensors of HF decoder layer `prefix` -> slice `i` of our stack `leaf` (moe_cfg None: a dense layer)."""
  h, nope, rope, kv = m.base_num_query_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
  q_cols = _columns(m.qk_head_dim, nope, rope, interleaved, repeat=h)
  a = prefix + "self_attn."
  mla = leaf + ("mla",)
  out = [
    Entry(prefix + "input_layernorm.weight", leaf + ("attn_norm",), i, Copy()),
    Entry(prefix + "post_attention_layernorm.weight", leaf + ("ffn_norm",), i, Copy()),
    Entry(a + "kv_a_proj_with_mqa.weight", mla + ("wkv_a",), i, Linear(_columns(kv + rope, kv, rope, interleaved))),
    Entry(a + "kv_a_layernorm.weight", mla + ("kv_norm",), i, Copy()),
    Entry(a + "kv_b_proj.weight", mla + ("wkv_b",), i, HeadsIn(nope + m.v_head_dim)),
    Entry(a + "o_proj.weight", mla + ("wo",), i, HeadsOut(m.v_head_dim)),
  ]
  if m.q_lora_rank > 0:
    out += [
      Entry(a + "q_a_proj.weight", mla + ("wq_a",), i, Linear()),
      Entry(a + "q_a_layernorm.weight", mla + ("q_norm",), i, Copy()),
      Entry(a + "q_b_proj.weight", mla + ("wq_b",), i, HeadsIn(m.qk_head_dim, q_cols)),
    ]
  else:
    out.append(Entry(a + "q_proj.weight", mla + ("wq",), i, HeadsIn(m.qk_head_dim, q_cols)))
  ffn, mlp = leaf + ("ffn",), prefix + "mlp."
  swiglu = (("gate", "wi_0"), ("up", "wi_1"), ("down", "wo"))  # torch gate/up/down_proj -> our wi_0/wi_1/wo
  if moe_cfg is None:
    return out + [Entry(mlp + f"{hf}_proj.weight", ffn + (ours,), i, Linear()) for hf, ours in swiglu]
  out += [
    Entry(mlp + "gate.weight", ffn + ("gate",), i, Linear()),
    Entry(mlp + "gate.e_score_correction_bias", bias_leaf, i, Copy()),
  ]
  for e in range(moe_cfg.num_experts):
    out += [Entry(mlp + f"experts.{e}.{hf}_proj.weight", ffn + (ours,), i + (e,), Linear()) for hf, ours in swiglu]
  if moe_cfg.shared_experts:
    out += [Entry(mlp + f"shared_experts.{hf}_proj.weight", ffn + ("shared", ours), i, Linear()) for hf, ours in swiglu]
  return out


def entries(m: ModelConfig, moe_cfg: MoEConfig, interleaved: bool = True) -> list[Entry]:
  """Every HF tensor of a DeepSeek-V3 checkpoint with this config (MTP modules: m.mtp_num_layers), in HF order."""
  out = [
    Entry("model.embed_tokens.weight", ("params", "embed"), (), Copy()),
    Entry("model.norm.weight", ("params", "final_norm"), (), Copy()),
    Entry("lm_head.weight", ("params", "head"), (), Linear()),
  ]
  dense = m.first_num_dense_layers
  for i in range(m.base_num_decoder_layers):
    prefix = f"model.layers.{i}."
    if i < dense:
      out += _layer(prefix, ("params", "dense_layers"), (i,), m, None, None, interleaved)
    else:
      out += _layer(prefix, ("params", "moe_layers"), (i - dense,), m, moe_cfg, ("bias", "moe_layers"), interleaved)
  for k in range(m.mtp_num_layers):
    prefix, leaf, i = f"model.layers.{m.base_num_decoder_layers + k}.", ("params", "mtp_layers"), (k,)
    out += [
      Entry(prefix + "enorm.weight", leaf + ("embed_norm",), i, Copy()),
      Entry(prefix + "hnorm.weight", leaf + ("hidden_norm",), i, Copy()),
      Entry(prefix + "eh_proj.weight", leaf + ("proj",), i, Linear()),
      Entry(prefix + "shared_head.norm.weight", leaf + ("final_norm",), i, Copy()),
      Entry(prefix + "embed_tokens.weight", ("params", "embed"), (), Copy(), alias=True),
      Entry(prefix + "shared_head.head.weight", ("params", "head"), (), Linear(), alias=True),
    ]
    out += _layer(prefix, leaf + ("layer",), i, m, moe_cfg, ("bias", "mtp_layers"), interleaved)
  return out


def mtp_layer_index(name: str, num_layers: int) -> int | None:
  """k for a tensor of MTP module k (HF layer num_layers + k), else None."""
  parts = name.split(".")
  if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= num_layers:
    return int(parts[2]) - num_layers
  return None
