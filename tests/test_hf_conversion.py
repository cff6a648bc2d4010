"""Hugging Face DeepSeek-V3 checkpoints in and out (MaxText.convert, MaxText.score), against transformers.

The transformers side runs in its own Python 3.11 venv (scripts/hf_reference_venv.sh runs
tests/hf_reference/reference.py there): torch and transformers are test-only, and the CPU torch this
machine and CI have is built for Python 3.11. Tests that need it are skipped, with the reason, only
when that venv cannot be made. The error cases, FP8 arithmetic and streaming memory need no torch.

Parity: max |ours - transformers| / max |transformers| over all logits, float32, below 1e-4.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import yaml

from MaxText import model, params, score
from MaxText.config import load_config
from MaxText.convert import checkpoint, fp8, hf_config, hf_to_orbax, layout, orbax_to_hf, safetensors_io
from MaxText.errors import exit_on_user_error
from MaxText.sharding import Sharder

from conftest import REPO

REFERENCE = REPO / "tests" / "hf_reference" / "reference.py"
BATCH, SEQ, VOCAB = 2, 20, 96
YARN = {
  "rope_type": "yarn",
  "rope_theta": 10000.0,
  "factor": 4.0,
  "original_max_position_embeddings": 16,
  "beta_fast": 32.0,
  "beta_slow": 1.0,
  "mscale": 1.0,
  "mscale_all_dim": 1.0,
}
COMMON = dict(
  vocab_size=VOCAB,
  hidden_size=32,
  intermediate_size=64,
  moe_intermediate_size=16,
  num_attention_heads=2,
  num_key_value_heads=2,
  kv_lora_rank=16,
  q_lora_rank=24,
  qk_rope_head_dim=8,
  qk_nope_head_dim=8,
  v_head_dim=12,
  n_routed_experts=8,
  max_position_embeddings=64,
  rms_norm_eps=1e-6,
)
# Between them: group-limited routing on and off, 1 and 2 shared experts, with and without dense first
# layers, norm_topk_prob on and off, routed_scaling_factor 2.5 / 1 / 1.5, YaRN (two mscales) and plain RoPE,
# both rotary layouts, low-rank and full-rank queries, float32 / bfloat16 / FP8 weights, an MTP module.
CASES = {
  "groups_yarn_mtp": {
    "config": dict(
      COMMON,
      num_hidden_layers=3,
      first_k_dense_replace=1,
      n_group=4,
      topk_group=2,
      num_experts_per_tok=3,
      n_shared_experts=1,
      norm_topk_prob=True,
      routed_scaling_factor=2.5,
      rope_parameters=YARN,
    ),
    "mtp": True,
  },
  "plain": {
    "config": dict(
      COMMON,
      num_hidden_layers=2,
      first_k_dense_replace=0,
      n_group=1,
      topk_group=1,
      num_experts_per_tok=2,
      n_shared_experts=2,
      norm_topk_prob=False,
      routed_scaling_factor=1.0,
      q_lora_rank=None,
      rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
  },
  "halves_bf16": {
    "config": dict(
      COMMON,
      num_hidden_layers=3,
      first_k_dense_replace=2,
      n_group=2,
      topk_group=1,
      num_experts_per_tok=2,
      n_shared_experts=1,
      norm_topk_prob=True,
      routed_scaling_factor=1.5,
      rope_interleave=False,
      rope_parameters=dict(YARN, factor=2.0, original_max_position_embeddings=32, mscale=0.707, mscale_all_dim=0.707),
    ),
    "dtype": "bfloat16",
  },
  "fp8": {
    "config": dict(
      COMMON,
      num_hidden_layers=2,
      first_k_dense_replace=1,
      n_group=4,
      topk_group=2,
      num_experts_per_tok=3,
      n_shared_experts=1,
      norm_topk_prob=True,
      routed_scaling_factor=2.5,
      rope_parameters=YARN,
    ),
    "dtype": "bfloat16",
    "fp8_block": [16, 12],  # blocks that do not divide the weights: the edge blocks are cut
  },
}


def relative_error(ours, reference) -> float:
  return float(np.max(np.abs(ours - reference)) / np.max(np.abs(reference)))


def run_cli(main, argv, capsys):
  """(exit code, stdout, stderr) of a CLI main run in-process, as `python -m` would run it."""
  capsys.readouterr()
  rc = exit_on_user_error(main)([str(a) for a in argv])
  out = capsys.readouterr()
  return rc, out.out, out.err


# ---- the transformers reference ----


@pytest.fixture(scope="session")
def reference_python():
  done = subprocess.run([str(REPO / "scripts" / "hf_reference_venv.sh")], capture_output=True, text=True)
  if done.returncode != 0:
    pytest.skip(f"the transformers reference venv could not be made: {done.stderr.strip()}")
  return done.stdout.strip()


def run_reference(python: str, command: str, plan: list[dict], where: Path) -> dict:
  plan_file = where / f"{command}.json"
  plan_file.write_text(json.dumps(plan))
  done = subprocess.run([python, str(REFERENCE), command, str(plan_file)], capture_output=True, text=True)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def hf_models(reference_python, tmp_path_factory):
  """Each case saved by transformers (tiny, random, seeded) with its reference logits."""
  root = tmp_path_factory.mktemp("hf")
  rng = np.random.default_rng(0)
  plan = []
  for i, (name, case) in enumerate(CASES.items()):
    ids = root / f"{name}-ids.npy"
    np.save(ids, rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32))
    plan.append(
      {
        "name": name,
        "dir": str(root / name),
        "seed": i,
        "ids": str(ids),
        "logits": str(root / f"{name}-logits.npy"),
        **case,
      }
    )
  results = run_reference(reference_python, "build", plan, root)
  return {p["name"]: {**p, **results[p["name"]]} for p in plan}


@pytest.fixture(scope="module")
def converted(hf_models, tmp_path_factory):
  root = tmp_path_factory.mktemp("converted")
  out = {}
  for name, case in hf_models.items():
    out[name] = root / name
    rc = exit_on_user_error(hf_to_orbax.main)(["--hf-dir", case["dir"], "--out", str(out[name])])
    assert rc == 0
  return out


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(name, hf_models, converted, tmp_path, capsys):
  case = hf_models[name]
  argv = ["--checkpoint", converted[name], "--input-ids", case["ids"], "--output", tmp_path / "logits.npy"]
  rc, _, err = run_cli(score.main, argv, capsys)
  assert rc == 0, err
  ours, reference = np.load(tmp_path / "logits.npy"), np.load(case["logits"])
  assert ours.dtype == np.float32 and ours.shape == (BATCH, SEQ, VOCAB)
  assert relative_error(ours, reference) < 1e-4


def test_model_config_carries_the_hf_config(converted):
  cfg = load_config(converted["groups_yarn_mtp"] / checkpoint.MODEL_CONFIG)
  m, moe = cfg.model, cfg.moe
  assert (m.base_num_decoder_layers, m.first_num_dense_layers, m.mtp_num_layers) == (3, 1, 1)
  assert (moe.n_routing_groups, moe.topk_routing_group, moe.num_experts_per_tok, moe.shared_experts) == (4, 2, 3, 1)
  assert (m.rope_type, m.rope_factor, m.original_max_position_embeddings, m.mscale) == ("yarn", 4.0, 16, 1.0)
  assert moe.routed_scaling_factor == 2.5 and moe.norm_topk_prob and moe.routed_bias
  plain = load_config(converted["plain"] / checkpoint.MODEL_CONFIG)
  assert (plain.model.q_lora_rank, plain.model.rope_type, plain.moe.n_routing_groups, plain.moe.shared_experts) == (
    0,
    "default",
    1,
    2,
  )
  assert not plain.moe.norm_topk_prob


def test_routing_bias_and_mtp_module_match_the_reference(hf_models, converted):
  """The MTP module (mapped from HF layer num_hidden_layers) gives the reference's MTP cross-entropy."""
  case, out = hf_models["groups_yarn_mtp"], converted["groups_yarn_mtp"]
  cfg = load_config(out / checkpoint.MODEL_CONFIG, list(score.FLOAT32_INFERENCE))
  p = checkpoint.load_params(out, params.abstract(model.model_specs(cfg.model, cfg.moe), jnp.float32))
  bias = checkpoint.load_bias(out, jax.eval_shape(lambda: model.bias_state(cfg.model, cfg.moe)))
  assert np.all(np.asarray(bias["moe_layers"]) != 0) and np.all(np.asarray(bias["mtp_layers"]) != 0)
  ids = np.load(case["ids"])
  batch = model.Batch(jnp.asarray(ids[:, :-1]), jnp.asarray(ids[:, 1:]), jnp.ones((BATCH, SEQ - 1), jnp.float32))
  _, aux, _ = jax.jit(lambda p, b, x: model.forward(p, b, x, cfg.model, cfg.moe, Sharder()))(p, bias, batch)
  logp = jax.nn.log_softmax(np.load(case["logits"])[:, :-1], axis=-1)
  reference_ce = -np.mean(np.take_along_axis(np.asarray(logp), ids[:, 1:, None], axis=-1))
  assert abs(float(aux.ce) - reference_ce) < 1e-4 * reference_ce
  assert abs(float(aux.mtp) - case["mtp_ce"]) < 1e-4 * case["mtp_ce"]


def test_round_trip_gives_identical_tensors_that_transformers_loads(
  reference_python, hf_models, converted, tmp_path, capsys
):
  plan = []
  for name, case in hf_models.items():
    exported = tmp_path / name
    shard = ["--max-shard-size", "40KB"] if name == "plain" else []  # several shards and an index
    rc, _, err = run_cli(orbax_to_hf.main, ["--checkpoint", converted[name], "--out", exported, *shard], capsys)
    assert rc == 0, err
    # FP8 comes back dequantised: it must equal, bit for bit, the reference's own dequantisation.
    original = case["dir"] + ("-dequantised" if case.get("fp8_block") else "")
    logits = str(tmp_path / f"{name}.npy")
    plan.append({"name": name, "original": original, "exported": str(exported), "ids": case["ids"], "logits": logits})
  assert len(list((tmp_path / "plain").glob("*.safetensors"))) > 1
  findings = run_reference(reference_python, "check", plan, tmp_path)
  for item in plan:
    assert findings[item["name"]] == {"missing": [], "extra": [], "differ": []}, item["name"]
    np.testing.assert_array_equal(np.load(item["logits"]), np.load(hf_models[item["name"]]["logits"]))


def test_converted_model_trains_from_its_weights(hf_models, converted):
  """A few AdamW steps from the converted weights: the first step's loss is transformers' cross-entropy."""
  from MaxText.checkpointing import with_shardings
  from MaxText.sharding import make_mesh
  from MaxText.train_step import TrainState, Trainer

  case, out = hf_models["plain"], converted["plain"]
  cfg = load_config(
    out / checkpoint.MODEL_CONFIG,
    [
      f"per_device_batch_size={BATCH}",
      f"max_target_length={SEQ - 1}",
      "steps=4",
      "learning_rate=1e-2",
      "warmup_steps_fraction=0",
      "remat_policy=none",
    ],
  )
  trainer = Trainer(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))  # one device: this is about the weights, not sharding
  abstract = with_shardings(trainer.abstract_state(), trainer.state_shardings)
  p = checkpoint.load_params(out, abstract.params)
  state = TrainState(p, trainer.optimizer.init(p), checkpoint.load_bias(out, abstract.bias), jnp.zeros((), jnp.int32))
  ids = np.load(case["ids"])
  batch = trainer.device_batch(model.Batch(ids[:, :-1], ids[:, 1:], np.ones((BATCH, SEQ - 1), np.float32)))
  step = trainer.jit_step()
  losses = []
  for _ in range(4):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  logp = jax.nn.log_softmax(np.load(case["logits"])[:, :-1], axis=-1)
  reference_ce = -float(np.mean(np.take_along_axis(np.asarray(logp), ids[:, 1:, None], axis=-1)))
  assert abs(losses[0] - reference_ce) < 1e-4 * reference_ce
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_commands_run_as_modules(hf_models, tmp_path):
  """The three `python -m` entry points, end to end in their own processes."""
  case = hf_models["plain"]
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  steps = [
    ["MaxText.convert.hf_to_orbax", "--hf-dir", case["dir"], "--out", tmp_path / "ours"],
    [
      "MaxText.score",
      "--checkpoint",
      tmp_path / "ours",
      "--input-ids",
      case["ids"],
      "--output",
      tmp_path / "logits.npy",
    ],
    ["MaxText.convert.orbax_to_hf", "--checkpoint", tmp_path / "ours", "--out", tmp_path / "back"],
  ]
  for argv in steps:
    done = subprocess.run([sys.executable, "-m", *map(str, argv)], capture_output=True, text=True, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
  assert relative_error(np.load(tmp_path / "logits.npy"), np.load(case["logits"])) < 1e-4
  assert (tmp_path / "back" / "config.json").is_file() and (tmp_path / "back" / "model.safetensors").is_file()


# ---- without torch: checkpoints written here, error cases, FP8 arithmetic, streaming memory ----

SMALL_HF = {
  "architectures": ["DeepseekV3ForCausalLM"],
  "model_type": "deepseek_v3",
  **COMMON,
  "num_hidden_layers": 2,
  "first_k_dense_replace": 1,
  "n_group": 2,
  "topk_group": 1,
  "num_experts_per_tok": 2,
  "n_shared_experts": 1,
  "norm_topk_prob": True,
  "routed_scaling_factor": 1.0,
  "rope_theta": 10000.0,
  "num_nextn_predict_layers": 0,
  "dtype": "float32",
}


def write_hf(directory: Path, config: dict = SMALL_HF, seed: int = 0) -> Path:
  """A DeepSeek-V3 checkpoint in the release's layout with random float32 tensors (names and shapes from layout.py)."""
  directory.mkdir(parents=True)
  (directory / "config.json").write_text(json.dumps(config))
  keys = hf_config.to_model_keys(config, model_name="written", mtp_layers=0)
  (directory.parent / f"{directory.name}.yml").write_text(yaml.safe_dump(keys))
  cfg = load_config(directory.parent / f"{directory.name}.yml")
  shapes = layout.leaf_shapes(cfg.model, cfg.moe)
  tensors = {e.hf_name: layout.hf_shape(e, shapes) for e in layout.entries(cfg.model, cfg.moe) if not e.alias}
  rng = np.random.default_rng(seed)
  safetensors_io.write_file(
    directory / "model.safetensors",
    [(n, np.dtype(np.float32), s) for n, s in tensors.items()],
    lambda n: rng.standard_normal(tensors[n], np.float32),
  )
  return directory


def rewrite(directory: Path, change) -> None:
  """Rewrites model.safetensors with `change(tensors dict)` applied."""
  shards = safetensors_io.ShardedCheckpoint(directory)
  tensors = {n: shards.read(n) for n in shards.tensors}
  change(tensors)
  safetensors_io.write_file(
    directory / "model.safetensors", [(n, a.dtype, a.shape) for n, a in tensors.items()], tensors.__getitem__
  )


def assert_one_line_error(rc, out, err, contains):
  assert rc == 2
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ") and contains in lines[0], err


def _edit_config(**changes):
  def edit(d):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))

  return edit


def _fp8_without_scales(d):
  name = "model.layers.1.self_attn.o_proj.weight"
  rewrite(d, lambda t: t.update({name: t[name].astype(ml_dtypes.float8_e4m3fn)}))


HF_TO_ORBAX_ERRORS = {
  "no config.json": (lambda d: (d / "config.json").unlink(), "config.json does not exist"),
  "no shards": (lambda d: (d / "model.safetensors").unlink(), "holds no *.safetensors shards"),
  "a shard the index names is missing": (
    lambda d: (d / "model.safetensors.index.json").write_text(
      json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})
    ),
    "model-00002-of-00002.safetensors named in",
  ),
  "unsupported architecture": (
    _edit_config(architectures=["LlamaForCausalLM"]),
    "unsupported architecture LlamaForCausalLM",
  ),
  "shape does not match config": (
    _edit_config(moe_intermediate_size=24),
    "has shape [16, 32], but config.json implies [24, 32]",
  ),
  "missing tensor": (
    lambda d: rewrite(d, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight")),
    "tensor model.layers.1.mlp.experts.3.up_proj.weight is missing",
  ),
  "unexpected tensor": (
    lambda d: rewrite(d, lambda t: t.update({"model.layers.1.self_attn.q_proj.bias": np.zeros(4, np.float32)})),
    "unexpected tensor model.layers.1.self_attn.q_proj.bias",
  ),
  "fp8 weight without scales": (
    _fp8_without_scales,
    "its block scales model.layers.1.self_attn.o_proj.weight_scale_inv are missing",
  ),
  "unsupported rope": (
    _edit_config(rope_scaling={"type": "linear", "factor": 2.0}),
    "rope type 'linear' is not supported",
  ),
  "yarn attention factor": (
    _edit_config(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    "attention_factor 1.13863",
  ),
  "not a safetensors file": (lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 4), "is not a safetensors file"),
}


@pytest.mark.parametrize("case", list(HF_TO_ORBAX_ERRORS))
def test_hf_to_orbax_errors_are_one_line_and_leave_no_output(case, tmp_path, capsys):
  hf = write_hf(tmp_path / "hf")
  damage, message = HF_TO_ORBAX_ERRORS[case]
  damage(hf)
  rc, out, err = run_cli(hf_to_orbax.main, ["--hf-dir", hf, "--out", tmp_path / "out"], capsys)
  assert_one_line_error(rc, out, err, message)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "hf.yml"]  # no OUT, no temporary sibling


@pytest.fixture(scope="module")
def small_converted(tmp_path_factory):
  root = tmp_path_factory.mktemp("small")
  hf = write_hf(root / "hf")
  assert exit_on_user_error(hf_to_orbax.main)(["--hf-dir", str(hf), "--out", str(root / "ours")]) == 0
  return root / "ours"


def test_cli_errors_are_one_line_and_leave_no_output(small_converted, tmp_path, capsys):
  ids = tmp_path / "ids.npy"
  np.save(ids, np.zeros((2, 4), np.int32))
  (tmp_path / "taken").mkdir()
  (tmp_path / "taken" / "keep.txt").write_text("mine")
  cases = [
    (hf_to_orbax.main, ["--hf-dir", small_converted.parent / "hf", "--out", tmp_path / "taken"], "already exists"),
    (
      hf_to_orbax.main,
      ["--hf-dir", small_converted.parent / "hf", "--out", tmp_path / "x", "--dtype", "int8"],
      "invalid choice: 'int8'",
    ),
    (hf_to_orbax.main, ["--out", tmp_path / "x"], "the following arguments are required: --hf-dir"),
    (orbax_to_hf.main, ["--checkpoint", tmp_path / "nowhere", "--out", tmp_path / "x"], "does not exist"),
    (orbax_to_hf.main, ["--checkpoint", small_converted, "--out", tmp_path / "taken"], "already exists"),
    (
      orbax_to_hf.main,
      ["--checkpoint", small_converted, "--out", tmp_path / "x", "--max-shard-size", "lots"],
      "--max-shard-size",
    ),
    (
      score.main,
      ["--checkpoint", tmp_path / "nowhere", "--input-ids", ids, "--output", tmp_path / "x.npy"],
      "does not exist",
    ),
    (
      score.main,
      ["--checkpoint", small_converted, "--input-ids", tmp_path / "no.npy", "--output", tmp_path / "x.npy"],
      "does not exist",
    ),
    (
      score.main,
      ["--checkpoint", small_converted, "--input-ids", ids, "--output", tmp_path / "no" / "x.npy"],
      "parent directory",
    ),
  ]
  bad_ids = {
    "float": (np.zeros((2, 4), np.float32), "must be integers"),
    "range": (np.full((2, 4), VOCAB), "outside the vocabulary"),
    "rank": (np.zeros(4, np.int32), "[batch, seq]"),
  }
  for name, (bad, message) in bad_ids.items():
    np.save(tmp_path / f"{name}.npy", bad)
    argv = ["--checkpoint", small_converted, "--input-ids", tmp_path / f"{name}.npy", "--output", tmp_path / "x.npy"]
    cases.append((score.main, argv, message))
  for main, argv, message in cases:
    rc, out, err = run_cli(main, argv, capsys)
    assert_one_line_error(rc, out, err, message)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["float.npy", "ids.npy", "range.npy", "rank.npy", "taken"]
  assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"


def test_error_exit_from_python_dash_m(tmp_path):
  done = subprocess.run(
    [sys.executable, "-m", "MaxText.convert.hf_to_orbax", "--hf-dir", str(tmp_path), "--out", str(tmp_path / "out")],
    capture_output=True,
    text=True,
    cwd=REPO,
    env={**os.environ, "PYTHONPATH": str(REPO)},
  )
  assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and done.stderr.startswith("error: "), (
    done.stderr
  )
  assert not (tmp_path / "out").exists()


def test_fp8_dequantisation_scales_each_block_and_cuts_the_edges():
  rng = np.random.default_rng(0)
  weight = rng.standard_normal((20, 30)).astype(ml_dtypes.float8_e4m3fn)
  scales = rng.uniform(0.5, 2.0, fp8.scale_shape(weight.shape, (8, 16))).astype(
    np.float32
  )  # 3 x 2 blocks, the last cut
  got = fp8.dequantize(weight, scales, (8, 16), np.float32)
  want = np.array([[float(weight[i, j]) * scales[i // 8, j // 16] for j in range(30)] for i in range(20)], np.float32)
  np.testing.assert_array_equal(got, want)
  assert fp8.dequantize(weight, scales, (8, 16), ml_dtypes.bfloat16).dtype == ml_dtypes.bfloat16


# config.json of the DeepSeek-V3 release (deepseek-ai/DeepSeek-V3), the fields that matter here.
RELEASE_CONFIG = {
  "architectures": ["DeepseekV3ForCausalLM"],
  "model_type": "deepseek_v3",
  "vocab_size": 129280,
  "hidden_size": 7168,
  "intermediate_size": 18432,
  "moe_intermediate_size": 2048,
  "num_hidden_layers": 61,
  "num_nextn_predict_layers": 1,
  "num_attention_heads": 128,
  "num_key_value_heads": 128,
  "n_shared_experts": 1,
  "n_routed_experts": 256,
  "ep_size": 1,
  "routed_scaling_factor": 2.5,
  "kv_lora_rank": 512,
  "q_lora_rank": 1536,
  "qk_rope_head_dim": 64,
  "v_head_dim": 128,
  "qk_nope_head_dim": 128,
  "topk_method": "noaux_tc",
  "n_group": 8,
  "topk_group": 4,
  "num_experts_per_tok": 8,
  "moe_layer_freq": 1,
  "first_k_dense_replace": 3,
  "norm_topk_prob": True,
  "scoring_func": "sigmoid",
  "hidden_act": "silu",
  "max_position_embeddings": 163840,
  "rms_norm_eps": 1e-06,
  "tie_word_embeddings": False,
  "rope_theta": 10000,
  "attention_bias": False,
  "torch_dtype": "bfloat16",
  "rope_scaling": {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn",
  },
  "quantization_config": {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
  },
}


def test_release_config_maps_to_our_671b_config():
  keys = hf_config.to_model_keys(RELEASE_CONFIG, model_name="deepseek_v3-671b", mtp_layers=1)
  ours = load_config(REPO / "configs" / "deepseek_v3" / "671b.yml").to_flat_dict()
  assert {k: ours[k] for k in keys} == keys
  assert fp8.block_size(RELEASE_CONFIG) == (128, 128)


def test_rope_pairs_reorder_halves_into_adjacent_pairs():
  halves = np.array([10, 11, 12, 20, 21, 22])  # transformers' layout: x[i] pairs with x[i + 3]
  assert list(halves[layout.rope_pairs(6)]) == [10, 20, 11, 21, 12, 22]


def _peak_rss_mb(module: str, argv: list) -> float:
  code = (
    "import resource, sys, runpy; sys.argv = ['x', *sys.argv[1:]]\n"
    f"try:\n  runpy.run_module('{module}', run_name='__main__')\nexcept SystemExit as e:\n  assert not e.code, e.code\n"
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
  )
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  done = subprocess.run(
    [sys.executable, "-c", code, *map(str, argv)], capture_output=True, text=True, cwd=REPO, env=env
  )
  assert done.returncode == 0, done.stderr
  return float(done.stdout.strip().splitlines()[-1])


def test_conversion_streams_in_memory_near_one_tensor(tmp_path):
  """Converting a ~200 MB model both ways takes about the memory of converting a 1 MB one: tensor by tensor."""
  big = dict(
    SMALL_HF,
    hidden_size=256,
    moe_intermediate_size=256,
    n_routed_experts=32,
    n_group=1,
    num_hidden_layers=8,
    first_k_dense_replace=0,
  )
  peaks = {}
  for name, config in (("small", SMALL_HF), ("big", big)):
    hf = write_hf(tmp_path / name, config)
    ours, back = tmp_path / f"{name}-ours", tmp_path / f"{name}-back"
    peaks[name] = (
      _peak_rss_mb("MaxText.convert.hf_to_orbax", ["--hf-dir", hf, "--out", ours]),
      _peak_rss_mb("MaxText.convert.orbax_to_hf", ["--checkpoint", ours, "--out", back]),
    )
  size_mb = (tmp_path / "big" / "model.safetensors").stat().st_size / 2**20
  assert size_mb > 190
  assert peaks["big"][0] - peaks["small"][0] < 50 and peaks["big"][1] - peaks["small"][1] < 50, (peaks, size_mb)
  assert (tmp_path / "big-back" / "model.safetensors").read_bytes() == (
    tmp_path / "big" / "model.safetensors"
  ).read_bytes()
