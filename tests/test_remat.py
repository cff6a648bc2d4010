"""Remat policies (MaxText/remat.py): every per-tensor key names a tensor the model tags, and every
policy gives the loss and gradients of no remat (float32, tiny model, CPU). XLA:CPU has a pinned_host
memory space, so the custom policy's offload runs here too; that offloaded tensors really live in host
memory is checked for a GPU target in tests/test_gpu_lowering.py."""

import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import model, params, remat
from MaxText.errors import UserError
from MaxText.sharding import Sharder

# One dense and one MoE layer (shared experts, q low rank): every tagged tensor occurs. MTP modules run the
# same decoder layer under the same policy, so they are left out to keep the compiles short.
SMALL = ("base_num_decoder_layers=2", "first_num_dense_layers=1", "max_target_length=8", "mtp_num_layers=0")
MIX = (
  "remat_policy=custom",
  "decoder_layer_input=offload",
  "moe_mlpwi_0=offload",
  "moe_mlpwi_1=offload",
  "mla_kv=device",
  "query_proj=device",
  "value_proj=offload",
  "mlpwi=device",
  "out_proj=remat",
  "moe_mlpwo=device",
)


def _names_in(jaxpr) -> set[str]:
  """checkpoint_name tags in a jaxpr and all its sub-jaxprs (scan, remat, custom_vjp, ...)."""
  found = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "name":
      found.add(eqn.params["name"])
    for sub in _subjaxprs(eqn.params):
      found |= _names_in(sub)
  return found


def _subjaxprs(p):
  for v in p.values():
    for x in v if isinstance(v, (tuple, list)) else (v,):
      if isinstance(x, jax.extend.core.ClosedJaxpr):
        yield x.jaxpr
      elif isinstance(x, jax.extend.core.Jaxpr):
        yield x


def _setup(cfg):
  specs = model.model_specs(cfg.model, cfg.moe)
  p = params.initialize(specs, jax.random.key(0), jnp.float32, cfg.model.param_init_std)
  tokens = jax.random.randint(jax.random.key(1), (2, cfg.train.max_target_length + 1), 0, cfg.model.vocab_size)
  batch = model.Batch(tokens[:, :-1], tokens[:, 1:], jnp.ones((2, cfg.train.max_target_length), jnp.float32))
  return p, model.bias_state(cfg.model, cfg.moe), batch


_REFERENCE = {}  # remat_policy=none's (loss, grads), computed once for all policies


def _loss_and_grads(cfg, p, bias, batch):
  def f(p):
    return model.loss_fn(p, bias, batch, cfg.model, cfg.moe, Sharder())[0]

  return jax.jit(jax.value_and_grad(f))(p)


def test_every_tensor_key_is_tagged_by_the_model(tiny_config):
  cfg = tiny_config(*SMALL, "remat_policy=custom")
  p, bias, batch = _setup(cfg)
  jaxpr = jax.make_jaxpr(lambda p: model.loss_fn(p, bias, batch, cfg.model, cfg.moe, Sharder())[0])(p)
  tagged = _names_in(jaxpr.jaxpr)
  assert set(remat.tensor_keys()) <= tagged, f"config keys the model never tags: {set(remat.tensor_keys()) - tagged}"
  assert tagged <= set(remat.tensor_keys()), f"tags without a config key: {tagged - set(remat.tensor_keys())}"
  for preset, names in remat.NAMED_PRESETS.items():
    assert set(names) <= set(remat.tensor_keys()), preset


# save_qkv_proj and save_out_proj keep subsets of save_dot_except_mlp's tensors (the next test checks what each keeps).
@pytest.mark.parametrize("policy", ["full", "minimal", "save_dot_except_mlp", "save_dot_except_moe", "custom_mix"])
def test_policy_gives_the_loss_and_gradients_of_no_remat(tiny_config, policy):
  overrides = MIX if policy == "custom_mix" else (f"remat_policy={policy}",)
  cfg = tiny_config(*SMALL, *overrides)
  p, bias, batch = _setup(cfg)
  loss, grads = _loss_and_grads(cfg, p, bias, batch)
  if "none" not in _REFERENCE:
    _REFERENCE["none"] = _loss_and_grads(tiny_config(*SMALL, "remat_policy=none"), p, bias, batch)
  ref_loss, ref_grads = _REFERENCE["none"]
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    ref = dict(jax.tree_util.tree_leaves_with_path(ref_grads))[path]
    np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def _host_moves(cfg) -> int:
  """device_put-to-host equations in the training gradient's jaxpr (how jax offloads residuals)."""
  p, bias, batch = _setup(cfg)
  text = str(jax.make_jaxpr(jax.grad(lambda p: model.loss_fn(p, bias, batch, cfg.model, cfg.moe, Sharder())[0]))(p))
  return text.count("MemorySpace.Host")


def test_offload_moves_the_named_tensors_to_host_and_device_keeps_them(tiny_config):
  offload = tiny_config(*SMALL, "remat_policy=custom", "moe_mlpwi_0=offload")
  device = tiny_config(*SMALL, "remat_policy=custom", "moe_mlpwi_0=device")
  assert remat.offloaded(offload.model) == ("moe_mlpwi_0",)
  assert _host_moves(offload) > 0
  assert _host_moves(device) == 0


@pytest.mark.parametrize("policy", [*remat.NAMED_PRESETS, "custom_mix"])
def test_each_policy_keeps_exactly_its_named_tensors(tiny_config, policy, capsys):
  """What jax saves for the backward pass (print_saved_residuals) is the policy's set of names."""
  overrides = MIX if policy == "custom_mix" else (f"remat_policy={policy}",)
  cfg = tiny_config(*SMALL, *overrides, "scan_layers=false")
  p, bias, batch = _setup(cfg)
  capsys.readouterr()
  jax.ad_checkpoint.print_saved_residuals(lambda p: model.loss_fn(p, bias, batch, cfg.model, cfg.moe, Sharder())[0], p)
  kept = set(re.findall(r"named '(\w+)'", capsys.readouterr().out))
  if policy == "custom_mix":  # offloaded tensors are saved as their host copies (test_offload_... below)
    expected = {n for n, w in remat.custom_locations(cfg.model).items() if w == "device"}
  else:
    expected = set(remat.NAMED_PRESETS[policy])
  assert kept == expected


@pytest.mark.parametrize(
  "overrides, message",
  [
    (
      ("moe_mlpwi_0=offload",),
      "moe_mlpwi_0: per-tensor remat keys act only with remat_policy=custom (remat_policy is full)",
    ),
    (("remat_policy=custom", "q_lora_rank=0", "mla_q=device"), "mla_q: there is no low-rank query with q_lora_rank=0"),
    (
      ("remat_policy=custom", "out_proj=host"),
      "out_proj='host' (from the command line) is not allowed; choose one of: remat, device, offload",
    ),
  ],
)
def test_remat_config_errors(tiny_config, overrides, message):
  with pytest.raises(UserError, match="^" + re.escape(message)):
    tiny_config(*overrides)
