"""The transformers side of tests/test_hf_conversion.py; runs in the Python 3.11 venv (.venv-hf) with torch.

  python reference.py build PLAN.json   make each tiny DeepseekV3ForCausalLM, save it, write its logits
  python reference.py check PLAN.json   compare exported checkpoints with the originals, tensor by tensor

build: every parameter is random (seeded), the norms around 1, the routing bias
e_score_correction_bias uniform in [-0.5, 0.5] (so some biased scores are
negative); saved with save_pretrained, then rewritten as two shards and an
index. The reference logits are what transformers computes from those files,
in float32. Optional extras per case:
  mtp: one multi-token-prediction module appended as HF layer num_hidden_layers
       (the release's names, experts one tensor each), and its cross-entropy
       computed here from transformers' own modules (DeepSeek-V3 section 2.2):
       h' = layer(eh_proj([enorm(embed(t + 1)); hnorm(h)])), logits = head(shared_head.norm(h')).
  fp8_block: linear weights stored as float8_e4m3fn with `weight_scale_inv` block scales,
       as the release; the reference logits and `<dir>-dequantised` use the dequantised weights.
check: for each (original, exported) pair, the tensors must be bit-identical (names,
dtypes, bytes), and transformers must load the exported directory and give the same logits.
Prints one JSON object (case -> findings) on stdout.
"""

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.masking_utils import create_causal_mask
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

FP8_MAX = 448.0  # largest float8_e4m3fn


def randomize(module: torch.nn.Module, gen: torch.Generator) -> None:
  with torch.no_grad():
    for name, p in module.named_parameters():
      if p.ndim == 1:
        p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
      elif "embed_tokens" in name:
        p.copy_(torch.randn(p.shape, generator=gen))
      else:  # [out, in] or fused experts [E, out, in]: unit-variance outputs
        p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    for name, b in module.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.copy_(torch.rand(b.shape, generator=gen) - 0.5)


def layer_tensors(layer: torch.nn.Module, prefix: str) -> dict:
  """A decoder layer's tensors under the release's names: one tensor per expert, not transformers' fused ones."""
  out = {}
  for name, t in layer.state_dict().items():
    if name.endswith("experts.gate_up_proj"):
      half = t.shape[1] // 2
      for e in range(t.shape[0]):
        out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = t[e, :half]
        out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = t[e, half:]
    elif name.endswith("experts.down_proj"):
      for e in range(t.shape[0]):
        out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = t[e]
    else:
      out[prefix + name] = t
  return {k: v.contiguous().clone() for k, v in out.items()}


def read_dir(d: Path) -> dict:
  tensors = {}
  for f in sorted(d.glob("*.safetensors")):
    tensors.update(load_file(f))
  return tensors


def write_dir(d: Path, tensors: dict, config: dict) -> None:
  """Writes a checkpoint directory as two shards plus an index (so the converter reads several shards)."""
  d.mkdir(parents=True, exist_ok=True)
  for f in list(d.glob("*.safetensors")) + list(d.glob("*.index.json")):
    f.unlink()
  names = sorted(tensors)
  halves = [names[: len(names) // 2], names[len(names) // 2 :]]
  weight_map = {}
  for i, part in enumerate(halves):
    file = f"model-{i + 1:05d}-of-00002.safetensors"
    save_file({n: tensors[n] for n in part}, str(d / file), metadata={"format": "pt"})
    weight_map.update({n: file for n in part})
  (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
  (d / "config.json").write_text(json.dumps(config, indent=2))


def positions_and_mask(config, embeds):
  pos = torch.arange(embeds.shape[1]).unsqueeze(0)
  mask = create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=pos)
  return pos, mask


def hidden_states(model, ids):
  """The last decoder layer's output (before the final norm), as transformers' forward computes it."""
  inner = model.model
  h = inner.embed_tokens(ids)
  pos, mask = positions_and_mask(model.config, h)
  rope = inner.rotary_emb(h, pos)
  for layer in inner.layers:
    h = layer(h, position_embeddings=rope, attention_mask=mask, position_ids=pos)
  return h


def mtp_module(config, index: int, gen):
  m = torch.nn.Module()
  d = config.hidden_size
  m.enorm, m.hnorm = DeepseekV3RMSNorm(d, eps=config.rms_norm_eps), DeepseekV3RMSNorm(d, eps=config.rms_norm_eps)
  m.eh_proj = torch.nn.Linear(2 * d, d, bias=False)
  m.layer = DeepseekV3DecoderLayer(config, layer_idx=index)
  m.final_norm = DeepseekV3RMSNorm(d, eps=config.rms_norm_eps)
  randomize(m, gen)
  return m


def mtp_cross_entropy(model, mtp, ids):
  """Module 1's mean cross-entropy for inputs ids[:, :-1] (the convention of MaxText's Batch: targets = next token)."""
  inputs, targets = ids[:, :-1], ids[:, 1:]
  shift = lambda a: torch.cat([a[:, 1:], torch.zeros_like(a[:, :1])], dim=1)  # noqa: E731
  h = hidden_states(model, inputs)
  inputs_k, targets_k = shift(inputs), shift(targets)
  mask = shift(torch.ones(inputs.shape))
  merged = torch.cat([mtp.enorm(model.model.embed_tokens(inputs_k)), mtp.hnorm(h)], dim=-1)
  x = mtp.eh_proj(merged)
  pos, attn_mask = positions_and_mask(model.config, x)
  x = mtp.layer(x, position_embeddings=model.model.rotary_emb(x, pos), attention_mask=attn_mask, position_ids=pos)
  logits = model.lm_head(mtp.final_norm(x)).float()
  nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets_k.reshape(-1), reduction="none")
  return float((nll * mask.reshape(-1)).sum() / mask.sum())


def quantize_fp8(tensors: dict, block) -> tuple[dict, dict]:
  """(release-style fp8 tensors with block scales, the dequantised weights) for every linear weight in a layer."""
  b0, b1 = block
  stored, dequantised = dict(tensors), {}
  for name, w in tensors.items():
    kept = (
      name.endswith("mlp.gate.weight") or "embed_tokens" in name or "shared_head.head" in name
    )  # bf16 in the release too
    if not name.startswith("model.layers.") or w.ndim != 2 or kept:
      continue
    rows, cols = w.shape
    nb0, nb1 = math.ceil(rows / b0), math.ceil(cols / b1)
    padded = torch.zeros(nb0 * b0, nb1 * b1)
    padded[:rows, :cols] = w.float()
    amax = padded.reshape(nb0, b0, nb1, b1).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = scale.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[:rows, :cols]
    q = (w.float() / full).to(torch.float8_e4m3fn)
    stored[name], stored[name + "_scale_inv"] = q, scale.float().contiguous()
    dequantised[name] = (q.float() * full).to(w.dtype)
  return stored, dequantised


def build(case: dict) -> dict:
  out = Path(case["dir"])
  gen = torch.Generator().manual_seed(case["seed"])
  config = DeepseekV3Config(**case["config"])
  model = DeepseekV3ForCausalLM(config).eval()
  randomize(model, gen)
  dtype = getattr(torch, case.get("dtype", "float32"))
  if dtype != torch.float32:
    model.to(dtype)
    for layer in model.model.layers:  # as the release: router weight and bias stay float32
      if hasattr(layer.mlp, "gate"):
        layer.mlp.gate.float()
  model.save_pretrained(out)
  tensors, hf_config = read_dir(out), json.loads((out / "config.json").read_text())
  result = {}
  mtp = None
  if case.get("mtp"):
    mtp = mtp_module(config, config.num_hidden_layers, gen).to(dtype)
    prefix = f"model.layers.{config.num_hidden_layers}."
    tensors.update(layer_tensors(mtp.layer, prefix))
    for ours, theirs in (
      ("enorm", "enorm"),
      ("hnorm", "hnorm"),
      ("eh_proj", "eh_proj"),
      ("final_norm", "shared_head.norm"),
    ):
      tensors[f"{prefix}{theirs}.weight"] = getattr(mtp, ours).weight.detach().clone()
    tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    hf_config["num_nextn_predict_layers"] = 1
  if case.get("fp8_block"):
    # The reference model is the dequantised one, loaded the way transformers loads the release's layout.
    plain = dict(tensors)
    tensors, dequantised = quantize_fp8(tensors, case["fp8_block"])
    plain.update(dequantised)
    write_dir(Path(str(out) + "-dequantised"), plain, hf_config)
    hf_config = {
      **hf_config,
      "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": case["fp8_block"],
      },
    }
  write_dir(out, tensors, hf_config)
  # The reference is what transformers computes from the files (float32), not the model in memory: .to(bfloat16)
  # also rounded its rotary inv_freq buffer. FP8: from the dequantised weights, as transformers would load them.
  model = DeepseekV3ForCausalLM.from_pretrained(
    str(out) + ("-dequantised" if case.get("fp8_block") else ""), dtype=torch.float32
  ).eval()
  ids = torch.from_numpy(np.load(case["ids"]).astype(np.int64))
  with torch.no_grad():
    np.save(case["logits"], model(ids).logits.float().numpy())
    if mtp is not None:
      mtp.float()
      result["mtp_ce"] = mtp_cross_entropy(model, mtp, ids)
  return result


def check(case: dict) -> dict:
  original, exported = read_dir(Path(case["original"])), read_dir(Path(case["exported"]))
  findings = {
    "missing": sorted(set(original) - set(exported))[:5],
    "extra": sorted(set(exported) - set(original))[:5],
    "differ": [],
  }
  for name in sorted(set(original) & set(exported)):
    a, b = original[name], exported[name]
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
      findings["differ"].append(f"{name}: {a.dtype} {list(a.shape)} vs {b.dtype} {list(b.shape)}")
  model = DeepseekV3ForCausalLM.from_pretrained(case["exported"], dtype=torch.float32).eval()
  ids = torch.from_numpy(np.load(case["ids"]).astype(np.int64))
  with torch.no_grad():
    np.save(case["logits"], model(ids).logits.float().numpy())
  return findings


def main(argv: list[str]) -> int:
  command, plan = argv[0], json.loads(Path(argv[1]).read_text())
  torch.set_grad_enabled(False)
  run = {"build": build, "check": check}[command]
  print(json.dumps({case["name"]: run(case) for case in plan}))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
