"""The linear layers' GEMMs (MaxText/layers/linear.py): quantize_layers, the quantised dense GEMM as the grouped
GEMM's one-group case, against float32, on one device and under a mesh."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from MaxText import gmm, model, params
from MaxText.errors import UserError
from MaxText.layers import linear
from MaxText.sharding import Sharder

FP8 = gmm.build("fp8_blockwise:xla", gmm.Options(False, False))
# e4m3 keeps 3 mantissa bits: each operand element is off by up to 2^-4 relative, so a product's error relative
# to the output's largest entry stays a few percent (measured 3-5% below); the bounds leave room, no more.
FWD_BOUND, GRAD_BOUND = 0.08, 0.08


def rel_err(got, want):
  return float(jnp.abs(got - want).max() / jnp.abs(want).max())


def test_quantize_layers_names_groups_and_refuses_unknown_ones(tiny_config):
  assert linear.parse_groups("deepseek_v3") == ("attention", "dense_mlp", "shared_experts", "experts")
  assert linear.parse_groups("experts") == ("experts",)
  assert linear.parse_groups("attention, experts") == ("attention", "experts")
  with pytest.raises(ValueError, match="unknown group router; choose deepseek_v3 or experts"):
    linear.parse_groups("attention,router")
  with pytest.raises(UserError, match="quantize_layers: unknown group head; choose deepseek_v3 or experts, or a"):
    tiny_config("quantization=fp8_blockwise", "quantize_layers=head")
  with pytest.raises(UserError, match="quantize_layers: names no group"):
    tiny_config("quantize_layers=,")


@pytest.mark.parametrize("spec", ["bsd,dr->bsr", "bsr,rhk->bshk", "bshk,hkd->bsd"])
def test_plain_groups_are_the_einsum_itself(spec):
  """A group not quantised runs jnp.einsum as written: the same numbers, bit for bit."""
  shapes = {"b": 2, "s": 8, "d": 64, "r": 32, "h": 4, "k": 16}
  lhs, rhs = spec.split("->")[0].split(",")
  x = jax.random.normal(jax.random.key(0), [shapes[c] for c in lhs])
  w = jax.random.normal(jax.random.key(1), [shapes[c] for c in rhs])
  dense = linear.Dense(FP8, ("experts",))
  np.testing.assert_array_equal(dense(spec, x, w, "attention"), jnp.einsum(spec, x, w))
  np.testing.assert_array_equal(linear.PLAIN(spec, x, w, "attention"), jnp.einsum(spec, x, w))


@pytest.mark.parametrize(
  "spec,shapes",
  [
    ("bsd,dr->bsr", {"b": 2, "s": 96, "d": 256, "r": 576}),  # wkv_a: N = 512 + 64 is no multiple of 128
    ("bsr,rhk->bshk", {"b": 2, "s": 64, "r": 128, "h": 4, "k": 96}),
    ("bshk,hkd->bsd", {"b": 1, "s": 200, "h": 2, "k": 128, "d": 256}),
  ],
)
def test_quantised_dense_gemm_against_float32(spec, shapes):
  """Forward, dgrad and wgrad of a quantised group within the fp8 bounds of float32 (and not equal to it)."""
  lhs, rhs = spec.split("->")[0].split(",")
  x = jax.random.normal(jax.random.key(0), [shapes[c] for c in lhs])
  w = jax.random.normal(jax.random.key(1), [shapes[c] for c in rhs]) / np.sqrt(np.prod(x.shape[len(x.shape) - 2 :]))
  dy = jax.random.normal(jax.random.key(2), jnp.einsum(spec, x, w).shape)
  dense = linear.Dense(FP8, ("attention",))

  def run(f):
    y, vjp = jax.vjp(lambda x, w: f(spec, x, w), x, w)
    return (y, *vjp(dy))

  got = run(lambda s, x, w: dense(s, x, w, "attention"))
  want = run(lambda s, x, w: jnp.einsum(s, x, w, precision=jax.lax.Precision.HIGHEST))
  errs = [rel_err(g, w_) for g, w_ in zip(got, want)]
  assert errs[0] < FWD_BOUND and max(errs[1:]) < GRAD_BOUND, errs
  assert min(errs) > 1e-3, errs  # really quantised


def test_under_a_mesh_rows_split_like_the_batch():
  """Under an 8-device mesh the quantised GEMM runs per row shard (shard_map): the forward matches the
  one-device result to float32 rounding (1x128 activation tiles and 128x128 weight blocks do not cross
  rows, so the fp8 operands are the same; only XLA's per-shard accumulation order may differ); gradients
  stay within the fp8 bounds (the wgrad's 128x1 tiles along rows follow the shards)."""
  devices = np.array(jax.devices()[:8])
  if devices.size < 8:
    pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  mesh = Mesh(devices.reshape(1, 8, 1, 1), ("data", "fsdp", "expert", "tensor"))
  spec = "bsd,df->bsf"
  x = jax.random.normal(jax.random.key(0), (8, 32, 256))
  w = jax.random.normal(jax.random.key(1), (256, 384)) / 16
  dy = jax.random.normal(jax.random.key(2), (8, 32, 384))
  single = linear.Dense(FP8, ("dense_mlp",))
  sharded = linear.Dense(FP8, ("dense_mlp",), mesh, ("data", "fsdp", "expert"))

  def run(dense):
    y, vjp = jax.vjp(lambda x, w: dense(spec, x, w, "dense_mlp"), x, w)
    return (y, *vjp(dy))

  one, many = jax.jit(lambda: run(single))(), jax.jit(lambda: run(sharded))()
  np.testing.assert_allclose(many[0], one[0], rtol=1e-5, atol=1e-6)
  want = jax.vjp(lambda x, w: jnp.einsum(spec, x, w, precision=jax.lax.Precision.HIGHEST), x, w)[1](dy)
  assert max(rel_err(g, w_) for g, w_ in zip(many[1:], want)) < GRAD_BOUND


@pytest.mark.parametrize("spec,axes", [("bsd,df->bsf", ("embed", "mlp")), ("bsf,fd->bsd", ("mlp", "embed"))])
def test_under_a_mesh_the_weights_fsdp_dim_is_gathered_inside_and_its_gradient_reduce_scattered(spec, axes):
  """Told its weight's axes, the quantised GEMM keeps the weight split over fsdp into the shard_map (K's or N's
  leading dim) and gathers it inside: the gradient leaves as one reduce-scatter over fsdp (float32 here:
  every value equals the whole-weight path's to float32 rounding; bfloat16 by default)."""
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 2, 4, 1), ("data", "fsdp", "expert", "tensor"))
  sizes = {"b": 8, "s": 32, "d": 256, "f": 384}
  lhs, rhs = spec.split("->")[0].split(",")
  x = jax.random.normal(jax.random.key(0), [sizes[c] for c in lhs])
  w = jax.random.normal(jax.random.key(1), [sizes[c] for c in rhs]) / 16
  dy = jax.random.normal(jax.random.key(2), [sizes[c] for c in spec.split("->")[1]])
  dense = linear.Dense(FP8, ("dense_mlp",), mesh, ("data", "fsdp", "expert"), "float32")

  def run(weight_axes):
    y, vjp = jax.vjp(lambda x, w: dense(spec, x, w, "dense_mlp", weight_axes), x, w)
    return (y, *vjp(dy))

  split, whole = jax.jit(lambda: run(axes))(), jax.jit(lambda: run(()))()
  for a, b in zip(split, whole):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  jaxpr = jax.make_jaxpr(lambda: run(axes))()
  scattered = [e for e in _equations(jaxpr.jaxpr) if e.primitive.name == "reduce_scatter"]
  assert [(e.invars[0].aval.dtype, e.params["axis_name"]) for e in scattered] == [(jnp.float32, ("fsdp",))]
  in_compute = linear.Dense(FP8, ("dense_mlp",), mesh, ("data", "fsdp", "expert"))  # the default: w's own dtype
  w16 = w.astype(jnp.bfloat16)
  bf16 = jax.make_jaxpr(lambda: jax.vjp(lambda w: in_compute(spec, x, w, "dense_mlp", axes), w16)[1](dy))()
  assert [e.invars[0].aval.dtype for e in _equations(bf16.jaxpr) if e.primitive.name == "reduce_scatter"] == [
    jnp.bfloat16
  ]
  assert tuple(scattered[0].invars[0].aval.shape) == w.shape  # the whole weight's gradient, scattered
  assert not [e for e in _equations(jax.make_jaxpr(lambda: run(()))().jaxpr) if e.primitive.name == "reduce_scatter"]


def _equations(jaxpr):
  for e in jaxpr.eqns:
    yield e
    for sub in jax.extend.core.jaxprs_in_params(e.params):
      yield from _equations(sub)


def _fp8_casts(cfg, p, bias, batch) -> int:
  jaxpr = jax.make_jaxpr(lambda p: model.loss_fn(p, bias, batch, cfg.model, cfg.moe, Sharder())[0])(p)
  return str(jaxpr).count("f8_e4m3fn")


def test_deepseek_v3_set_quantises_every_linear_layer_and_trains_close_to_bf16(tiny_config):
  """quantization=fp8_blockwise with quantize_layers=deepseek_v3 (the default) puts fp8 casts in the
  attention and MLP GEMMs besides the experts'; the loss stays within 2% of the unquantised model's."""
  base = ("moe_gmm_backend=xla", "base_emb_dim=256")
  plain = tiny_config(*base)
  experts = tiny_config(*base, "quantization=fp8_blockwise", "quantize_layers=experts")
  every = tiny_config(*base, "quantization=fp8_blockwise")
  assert every.moe.quantize_layers == "deepseek_v3"
  p = params.initialize(model.model_specs(plain.model, plain.moe), jax.random.key(0), jnp.float32, 0.02)
  bias = model.bias_state(plain.model, plain.moe)
  tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, plain.model.vocab_size)
  batch = model.Batch(tokens[:, :-1], tokens[:, 1:], jnp.ones((2, 16), jnp.float32))
  assert _fp8_casts(every, p, bias, batch) > _fp8_casts(experts, p, bias, batch) > 0
  assert _fp8_casts(plain, p, bias, batch) == 0

  def loss(cfg):
    return float(jax.jit(lambda p: model.loss_fn(p, bias, batch, cfg.model, cfg.moe, Sharder())[0])(p))

  assert abs(loss(every) / loss(plain) - 1) < 0.02, (loss(every), loss(plain))
