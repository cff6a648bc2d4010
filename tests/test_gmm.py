"""Grouped GEMM backends on CPU: the VJP rule against jax.grad of ragged_dot, padded, registry, auto, tiles."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import gmm
from MaxText.gmm import padded, vjp
from MaxText.moe.layer import moe, moe_specs
from MaxText import params
from MaxText.sharding import Sharder

REPO = Path(__file__).resolve().parents[1]

SIZES = {
  "balanced": [8, 8, 8, 8],
  "empty groups": [0, 20, 0, 12],
  "one group": [0, 0, 32, 0],
  "not tile multiples": [5, 13, 1, 11],
  "padding rows": [3, 7, 0, 10],  # sums to 20 of 32 rows
}


def _inputs(m=32, k=24, n=40, g=4, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  return jax.random.normal(ks[0], (m, k)), jax.random.normal(ks[1], (g, k, n)), jax.random.normal(ks[2], (m, n))


@pytest.mark.parametrize("case", SIZES)
def test_custom_vjp_matches_autodiff_of_ragged_dot(case):
  sizes = jnp.array(SIZES[case], jnp.int32)
  x, w, dy = _inputs()
  rule = vjp.grouped_gemm_with_vjp(vjp.xla_fwd, vjp.xla_dgrad, vjp.xla_wgrad)
  y, pullback = jax.vjp(lambda x, w: rule(x, w, sizes), x, w)
  y_ref, pullback_ref = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes), x, w)
  valid = int(sizes.sum())
  dy = dy.at[valid:].set(0.0)  # callers never read padding rows, so their cotangent is zero
  np.testing.assert_allclose(y[:valid], y_ref[:valid], rtol=1e-5, atol=1e-5)
  for got, want in zip(pullback(dy), pullback_ref(dy)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
  # and under jit + grad of a scalar loss, as training uses it
  loss = lambda f: lambda x, w: jnp.sum(f(x, w, sizes)[:valid] ** 2)  # noqa: E731
  for got, want in zip(
    jax.jit(jax.grad(loss(rule), argnums=(0, 1)))(x, w), jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(x, w)
  ):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_padded_matches_xla_on_the_capacity_layout():
  x, w, _ = _inputs(m=32, g=4)
  sizes = jnp.full((4,), 8, jnp.int32)
  np.testing.assert_allclose(padded.gmm(x, w, sizes), jax.lax.ragged_dot(x, w, sizes), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="use moe_dispatch=capacity"):
    padded.gmm(x[:30], w, sizes)


def test_moe_layer_with_padded_backend_equals_xla(tiny_config):
  xla_cfg = tiny_config("moe_dispatch=capacity", "capacity_factor=2.0")
  pad_cfg = tiny_config("moe_dispatch=capacity", "capacity_factor=2.0", "moe_gmm_backend=padded")
  p = params.initialize(moe_specs(64, xla_cfg.moe), jax.random.key(0), jnp.float32, 0.1)
  x = jax.random.normal(jax.random.key(1), (2, 16, 64))
  bias = jnp.zeros((8,))
  want, _ = moe(p, x, bias, xla_cfg.moe, Sharder())
  got, _ = moe(p, x, bias, pad_cfg.moe, Sharder())
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_registry_and_clear_errors(tiny_config):
  from MaxText.errors import UserError

  assert gmm.backends() == ("xla", "padded", "mosaic", "tokamax", "auto")
  assert gmm.quantizations() == ("", "mxfp8", "fp8_blockwise")
  with pytest.raises(
    ValueError, match="unknown expert GEMM 'cutlass'; choose one of: xla, padded, mosaic, tokamax, mxfp8:xla"
  ):
    gmm.build("cutlass")
  if gmm.unavailable("tokamax"):
    with pytest.raises(RuntimeError, match="tokamax needs tokamax, which is not installed; pip install tokamax"):
      gmm.build("tokamax")
  with pytest.raises(UserError, match="moe_gmm_backend='cutlass' .* choose one of: xla, padded, mosaic, tokamax, auto"):
    tiny_config("moe_gmm_backend=cutlass")
  with pytest.raises(UserError, match='quantization=.int4. .* choose one of: "" .off., mxfp8, fp8_blockwise'):
    tiny_config("quantization=int4")
  with pytest.raises(UserError, match="padded runs equal-capacity groups; set moe_dispatch=capacity"):
    tiny_config("moe_gmm_backend=padded")
  with pytest.raises(UserError, match="mosaic runs bf16/fp16 Hopper .sm_90. GPU kernels, not dtype=float32; set moe_"):
    tiny_config("moe_gmm_backend=mosaic")
  with pytest.raises(TypeError, match="set dtype=bfloat16"):
    gmm.build("mosaic").kernels[0](jnp.ones((8, 128)), jnp.ones((2, 128, 128)), jnp.array([4, 4]))
  # An option that does not apply to the combination is refused at config time, in one line
  with pytest.raises(UserError, match="mxfp8_impl=emulated applies only to quantization=mxfp8"):
    tiny_config("mxfp8_impl=emulated")
  with pytest.raises(UserError, match="quantization=fp8_blockwise runs on moe_gmm_backend=mosaic or xla .got padded."):
    tiny_config("quantization=fp8_blockwise", "moe_gmm_backend=padded", "moe_dispatch=capacity", "capacity_factor=2")
  # One object per entry and options; the fused entry points default to the plain composition
  assert gmm.build("xla") is gmm.build("xla") is not gmm.build("mosaic")
  assert gmm.build("xla").fuses == () and gmm.build("fp8_blockwise:xla").fuses == ("swiglu_down", "quantized_rows")
  assert gmm.build("fp8_blockwise:xla", gmm.Options(False, False)).fuses == ()
  assert gmm.build("mxfp8:xla").quantize_rows(jnp.ones((4, 128))) is None


def test_a_backend_registered_in_one_place_is_a_choice_everywhere(tiny_config, monkeypatch):
  """Registering an entry is the only edit: the config accepts it, the doctor lists it, the grouped-GEMM
  benchmark offers it, and the layer runs it."""
  from MaxText import doctor

  monkeypatch.setattr(gmm, "EXPERT_GEMMS", dict(gmm.EXPERT_GEMMS))
  gmm.register(gmm.Entry("einsum_loop", "", "einsum_loop", "MaxText.gmm.xla", "a test's backend"))
  try:
    assert "einsum_loop" in gmm.backends()
    cfg = tiny_config("moe_gmm_backend=einsum_loop")
    assert cfg.moe.moe_gmm_backend == "einsum_loop"
    line = next(c for c in doctor.check_moe_backends(jax.devices()) if c.name == "expert GEMM").detail
    assert "einsum_loop" in line.split("; not here")[0]
    spec = importlib.util.spec_from_file_location("grouped_gemm", REPO / "benchmarks" / "grouped_gemm.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert "einsum_loop" in bench.bf16_entries() and bench.runnable("einsum_loop", jax.devices()[0]) is None
    p = params.initialize(moe_specs(64, cfg.moe), jax.random.key(0), jnp.float32, 0.1)
    x = jax.random.normal(jax.random.key(1), (2, 16, 64))
    got, _ = moe(p, x, jnp.zeros((8,)), cfg.moe, Sharder())
    want, _ = moe(p, x, jnp.zeros((8,)), tiny_config().moe, Sharder())
    np.testing.assert_array_equal(got, want)  # same module underneath: the same numbers
  finally:
    gmm.build.cache_clear()


class FakeDevice:
  def __init__(self, platform, kind, capability=None):
    self.platform, self.device_kind, self.compute_capability = platform, kind, capability


def test_auto_resolves_by_device_and_says_why():
  name, why = gmm.resolve_backend("auto", jax.devices()[0], "float32")
  assert name == "xla" and "not an sm_90 GPU" in why
  name, why = gmm.resolve_backend("auto", FakeDevice("gpu", "NVIDIA H200", "9.0"), "bfloat16")
  assert name == ("mosaic" if gmm.unavailable("mosaic") is None else "xla")
  assert gmm.resolve_backend("auto", FakeDevice("gpu", "NVIDIA A100", "8.0"), "bfloat16")[0] == "xla"
  assert gmm.resolve_backend("auto", FakeDevice("gpu", "NVIDIA H200", "9.0"), "float32")[0] == "xla"
  h200 = FakeDevice("gpu", "NVIDIA H200", "9.0")
  assert gmm.resolve("", "xla", "auto", h200, "bfloat16") == ("xla", "xla", "emulated", "chosen in the config")
  assert gmm.resolve("fp8_blockwise", "mosaic", "auto", h200, "bfloat16").name == "fp8_blockwise:mosaic"
  assert gmm.resolve("mxfp8", "auto", "auto", FakeDevice("gpu", "NVIDIA B200", "10.0"), "bfloat16").name == (
    "mxfp8:block_scaled"
  )
  with pytest.raises(
    ValueError,
    match="mosaic runs Hopper .sm_90. wgmma kernels; NVIDIA B200 is sm_100: choose moe_gmm_backend=auto or xla",
  ):
    gmm.resolve("", "mosaic", "auto", FakeDevice("gpu", "NVIDIA B200", "10.0"), "bfloat16")


def test_hopper_kernels_on_a_blackwell_plan_are_one_line_and_exit_2():
  """A Hopper recipe (moe_gmm_backend=mosaic) planned for a B200: one line saying what to choose, not
  Mosaic's compile error."""

  site = REPO / ".venv" / "gpu-aot"
  if not (site / "jax_plugins").is_dir():
    pytest.skip(f"CUDA plugin not installed in {site}")
  env = {**os.environ, "PYTHONPATH": f"{site}:{REPO}", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "MaxText.aot",
      "recipes/deepseek_v3_tiny.yml",
      "--gpu",
      "b200",
      "--num-gpus",
      "1",
      "moe_gmm_backend=mosaic",
      "dtype=bfloat16",
    ],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert (
    proc.stderr.strip()
    .splitlines()[-1]
    .endswith("cannot run on NVIDIA B200 (gpu); here choose moe_gmm_backend=xla or moe_gmm_backend=auto")
  ), proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr


def test_mosaic_tiles_and_padding():
  from MaxText.kernels import mosaic_tiles as mt

  assert mt.tiles_for("fwd", 123456, 7) == dict(zip(mt.TILE_NAMES, mt.DEFAULT_TILES["fwd"]))
  tables = sorted(mt.TABLES_DIR.glob("mosaic_tiles_*.json"))
  assert mt.table_path("h200") in tables
  for path in tables:  # every shipped table: well-formed, and each entry is what its shapes get
    assert mt.table_name(json.loads(path.read_text())["device"]) == path.stem.removeprefix("mosaic_tiles_")
    mt.use_table(path)
    try:
      for key, tiles in mt.tuned_tiles().items():
        kernel, widths, *regime = key.split(":")
        k, n = map(int, widths.split("x"))
        assert kernel in mt.KERNELS and len(tiles) == 5
        assert k % mt.PAD == 0 and n % mt.PAD == 0
        if regime:  # a group-count regime ("g32") is what that many groups, or nearby counts, get
          groups = int(regime[0].removeprefix("g"))
          expect = dict(zip(mt.TILE_NAMES, tiles))
          assert mt.tiles_for(kernel, k, n, groups) == mt.tiles_for(kernel, k, n, groups + 1) == expect
        else:
          assert mt.tiles_for(kernel, k, n) == dict(zip(mt.TILE_NAMES, tiles))
    finally:
      mt.use_table(None)
  # a padded width that does not hold two halves of the split dimension gets 64-wide halves
  assert mt.tiles("fwd", 7168, 384, 8)["block_n"] == 64 and mt.tiles("wgrad", 384, 7168, 8)["block_m"] == 64


def test_mosaic_tile_schedule_skips_nothing_and_owns_every_row_once():
  """Our forward kernel's tile list (computed by XLA): every row is owned by exactly one live tile of
  its own group, live tiles come first, and no live tile is dead weight."""
  from MaxText.kernels import mosaic_pipeline

  block_m, m = 128, 1000
  for sizes in (
    [1000, 0, 0, 0],
    [0, 0, 0, 1000],
    [128, 128, 744, 0],
    [1, 127, 129, 743],
    [0, 500, 0, 500],
    [250, 250, 250, 250],
  ):
    group, block, first, owned = (
      np.asarray(a) for a in mosaic_pipeline.tile_schedule(jnp.asarray(sizes, jnp.int32), m, block_m)
    )
    assert len(group) == -(-m // block_m) + len(sizes) - 1
    live = owned > 0
    assert live[: live.sum()].all() and not live[live.sum() :].any(), "live tiles first"
    rows = np.concatenate([block[t] * block_m + first[t] + np.arange(owned[t]) for t in np.flatnonzero(live)])
    np.testing.assert_array_equal(np.sort(rows), np.arange(m))
    expected_group = np.repeat(np.arange(len(sizes)), sizes)
    for t in np.flatnonzero(live):
      r = block[t] * block_m + first[t]
      assert (expected_group[r : r + owned[t]] == group[t]).all()
      assert first[t] + owned[t] <= block_m
  from MaxText.kernels.padding import pad_rows, pad_to

  padded_a = pad_to(jnp.ones((3, 200)), 1, 128)
  assert padded_a.shape == (3, 256) and float(padded_a[:, 200:].sum()) == 0.0
  assert pad_to(jnp.ones((3, 256)), 1, 128).shape == (3, 256)
  assert pad_rows(jnp.ones((3, 8)), 64).shape == (64, 8) and pad_rows(jnp.ones((70, 8)), 64).shape == (70, 8)


def test_custom_vjp_inside_shard_map_types_results_and_sums_weight_gradients():
  """Under expert parallelism the grouped GEMM runs inside shard_map with rows split over devices and
  weights replicated: the weight gradient is the sum of every device's partial, as jax.grad of the
  unsharded computation says (a Pallas kernel's untyped output is typed by the same wrapper)."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = jax.make_mesh((2, 2), ("data", "expert"))
  rule = vjp.grouped_gemm_with_vjp(vjp.xla_fwd, vjp.xla_dgrad, vjp.xla_wgrad)
  sizes = jnp.array([10, 6], jnp.int32)
  x = jax.random.normal(jax.random.key(0), (64, 8))
  w = jax.random.normal(jax.random.key(1), (2, 8, 6))
  per_device = jax.shard_map(
    lambda x, w: rule(x, w, sizes), mesh=mesh, in_specs=(P(("data", "expert")), P()), out_specs=P(("data", "expert"))
  )
  xs, ws = jax.device_put(x, NamedSharding(mesh, P(("data", "expert")))), jax.device_put(w, NamedSharding(mesh, P()))
  got = jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.sin(per_device(x, w))), argnums=(0, 1)))(xs, ws)
  shards = lambda x, w: sum(jnp.sum(jnp.sin(vjp.xla_fwd(x[i * 16 : (i + 1) * 16], w, sizes))) for i in range(4))  # noqa: E731
  want = jax.grad(shards, argnums=(0, 1))(x, w)
  for g, r in zip(got, want):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["fwd", "dgrad", "wgrad"])
def test_mosaic_kernels_in_the_gpu_interpreter(kernel):
  """Our Hopper kernels run by Pallas' Mosaic GPU interpreter on CPU, with its race detector on (TMA copies
  and the overlapped output store have their own clocks; a barrier waited out of phase raises): group
  boundaries inside row blocks, an empty group and rows past the total, against float32. Unwritten memory
  is NaN in the interpreter, so a row the kernel should write and does not shows."""
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
  from jax.experimental.pallas import mosaic_gpu as plgpu

  from MaxText.kernels import mosaic_gmm

  m, k, n = 256, 128, 192
  sizes = np.array([70, 0, 130, 6], np.int32)  # 206 rows of 256
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((4, k, n)), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
  tiles = dict(block_m=64, block_n=64, block_k=64, max_concurrent_steps=2, grid_block_n=2)
  interpret = plgpu.InterpretGPUParams(detect_races=True)

  def f32(a):
    return np.asarray(a, np.float32)

  total, ends = int(sizes.sum()), np.cumsum(sizes)
  starts = ends - sizes
  # The kernels are warp-specialized (3 programs, a dozen tiles: the load ring carries on across tiles)
  # and split tiles in two, so their split width is 128 here.
  ragged = mosaic_gmm.ragged_dot
  if kernel.startswith("fwd"):
    w = w[:, :, :128]
    got = ragged(x, w, jnp.asarray(sizes), interpret=interpret, **tiles)[:total]
    want = np.concatenate([f32(x)[a:b] @ f32(w)[g] for g, (a, b) in enumerate(zip(starts, ends))])
  elif kernel.startswith("dgrad"):
    got = ragged(dy, w, jnp.asarray(sizes), transpose_rhs=True, interpret=interpret, **tiles)[:total]
    want = np.concatenate([f32(dy)[a:b] @ f32(w)[g].T for g, (a, b) in enumerate(zip(starts, ends))])
  else:
    got = mosaic_gmm.ragged_wgrad(x, dy, jnp.asarray(sizes), interpret=interpret, **tiles)
    want = np.stack([f32(x)[a:b].T @ f32(dy)[a:b] for a, b in zip(starts, ends)])
    assert not np.asarray(got[1]).any(), "an empty group's weight gradient is zero"
  assert not gpu_callbacks.get_races().races_found
  got = f32(got)
  assert np.isfinite(got).all()
  assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2  # bf16 output rounding


@pytest.fixture
def tile_tables(tmp_path, monkeypatch):
  """mosaic_tiles looking for its tables in an empty folder (caches cleared before and after)."""
  from MaxText.kernels import mosaic_tiles as mt

  monkeypatch.setattr(mt, "TABLES_DIR", tmp_path)
  mt.reload()
  yield mt
  mt.reload()


def test_mosaic_tile_table_chosen_by_device_kind(tile_tables):
  from types import SimpleNamespace

  mt = tile_tables

  def write(name, device, fwd):
    mt.table_path(name).write_text(json.dumps({"device": device, "tiles": {"fwd:256x256:g8": fwd}}))
    mt.reload()

  h100, h200, b200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA B200"
  assert mt.table_note(h100) == f"no Mosaic tile table for {h100}: default tiles"
  assert mt.tiles_for("fwd", 256, 256, 8, h100) == dict(zip(mt.TILE_NAMES, mt.DEFAULT_TILES["fwd"]))

  write("h200", h200, [128, 128, 64, 3, 8])
  for kind in (h200, "NVIDIA GH200 480GB"):  # the H200's table, as its own
    assert mt.tiles_for("fwd", 256, 256, 8, kind)["grid_block_n"] == 8
    assert mt.table_note(kind) == f"Mosaic tile table mosaic_tiles_h200.json (tuned on this GPU's chip, {kind})"
  # an H100 without its own table takes the nearest and says so
  assert mt.tiles_for("fwd", 256, 256, 8, h100)["grid_block_n"] == 8
  assert mt.table_note(h100) == (
    f"no Mosaic tile table for {h100}: using the nearest, mosaic_tiles_h200.json (tuned on NVIDIA H200)"
  )

  write("h100", h100, [128, 128, 64, 2, 4])
  for kind in (h100, "NVIDIA H100 PCIe", "NVIDIA H800"):  # one chip, one table
    assert mt.tiles_for("fwd", 256, 256, 8, kind)["max_concurrent_steps"] == 2
    assert mt.table_note(kind).startswith("Mosaic tile table mosaic_tiles_h100.json")
  assert mt.tiles_for("fwd", 256, 256, 8, h200)["max_concurrent_steps"] == 3
  assert "using the nearest, mosaic_tiles_h200.json" in mt.table_note(b200)

  # the start-up log line of the bf16 Mosaic GEMMs names the table; the fp8 kernels take no tiles from it
  gpu = SimpleNamespace(device_kind=h100, platform="gpu")
  assert gmm.describe("mosaic", device=gpu).endswith(mt.table_note(h100))
  assert "tile table" not in gmm.describe("fp8_blockwise:mosaic", device=gpu)


def test_tokamax_backend_parses_absl_flags_at_their_defaults_not_the_programs_options(monkeypatch):
  """tokamax reads absl flags and parses sys.argv itself when nobody has: a benchmark's own --out then stopped
  it with UnrecognizedFlagError (H100, 2026-12-07). The backend parses no arguments first."""
  from absl import flags

  from MaxText.gmm import tokamax as tokamax_backend

  fresh = flags.FlagValues()
  flags.DEFINE_string("tokamax_like_setting", "default", "a library's flag", flag_values=fresh)
  monkeypatch.setattr(flags, "FLAGS", fresh)
  monkeypatch.setattr(sys, "argv", ["benchmark.py", "--out", "results"])
  with pytest.raises(flags.UnrecognizedFlagError):
    fresh(sys.argv)  # what tokamax would do: the check can fail
  fresh.unparse_flags()
  tokamax_backend._absl_flags_at_defaults()
  assert fresh.is_parsed() and fresh.tokamax_like_setting == "default"
