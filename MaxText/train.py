"""Train from a recipe: `python -m MaxText.train RECIPE.yml [key=value ...]`.

config (validated, nothing written yet) -> mesh -> run directory -> state
-> compile the step (with progress) -> loop: data -> step -> metrics.
"""

import contextlib
import json
import platform
import sys
import threading
import time
from pathlib import Path

from MaxText.config import Config, load_config
from MaxText.errors import UserError, exit_on_user_error

USAGE = "usage: python -m MaxText.train RECIPE.yml [key=value ...]"


@contextlib.contextmanager
def progress(what: str, every_s: float):
  """Prints `what` now and then every `every_s` seconds until the block ends."""
  start = time.perf_counter()
  print(f"{what} ...", flush=True)
  done = threading.Event()

  def beat():
    while not done.wait(every_s):
      print(f"  still {what.lower()} ({time.perf_counter() - start:.0f} s)", flush=True)

  thread = threading.Thread(target=beat, daemon=True) if every_s > 0 else None
  if thread:
    thread.start()
  try:
    yield
  finally:
    done.set()
    print(f"{what}: done in {time.perf_counter() - start:.1f} s", flush=True)


def make_run_dir(cfg: Config) -> Path:
  name = cfg.train.run_name or f"{cfg.model.model_name}-{time.strftime('%Y%m%d-%H%M%S')}"
  run_dir = Path(cfg.train.base_output_directory) / name
  if (run_dir / "metrics.jsonl").exists():
    raise UserError(f"run directory {run_dir} already holds a run; choose another run_name or remove it")
  run_dir.mkdir(parents=True, exist_ok=True)
  return run_dir


def describe(cfg: Config, trainer, flops_per_token: float) -> str:
  import jax

  from MaxText import flops, params

  total = params.count(trainer.specs)
  active = flops.active_weights_per_token(cfg.model, cfg.moe) + cfg.model.vocab_size * cfg.model.emb_dim
  mesh = " x ".join(f"{a}={n}" for a, n in trainer.mesh.shape.items())
  d = jax.devices()[0]
  return (
      f"model {cfg.model.model_name}: {total / 1e9:.3f} B parameters, {active / 1e9:.3f} B active per token; "
      f"{flops_per_token / 1e9:.3f} GFLOP/token (training)\n"
      f"devices: {jax.device_count()} x {d.device_kind} ({d.platform}), {jax.process_count()} process(es); mesh {mesh}\n"
      f"batch: {trainer.global_batch} sequences x {cfg.train.max_target_length} tokens, "
      f"{cfg.train.gradient_accumulation_steps} microbatch(es); moe_dispatch={cfg.moe.moe_dispatch} "
      f"moe_gmm_backend={cfg.moe.moe_gmm_backend}; dtype={cfg.model.dtype} weights={cfg.model.weight_dtype}"
  )


def train(cfg: Config) -> list[dict]:
  """Runs the training loop; returns the per-step metrics."""
  import jax

  from MaxText import flops
  from MaxText.data import SyntheticData
  from MaxText.metrics import MetricsWriter
  from MaxText.sharding import make_mesh
  from MaxText.train_step import Trainer

  mesh = make_mesh(cfg.mesh)
  trainer = Trainer(cfg, mesh)
  seq = cfg.train.max_target_length
  flops_per_token = flops.training_flops_per_token(cfg.model, cfg.moe, seq)
  peak = flops.peak_tflops(jax.devices()[0].device_kind, cfg.train.peak_tflops_per_device)

  run_dir = make_run_dir(cfg)
  (run_dir / "config.yml").write_text(cfg.to_yaml())
  (run_dir / "environment.json").write_text(json.dumps(environment(), indent=1))
  print(f"run directory: {run_dir}")
  print(describe(cfg, trainer, flops_per_token), flush=True)

  data = SyntheticData(cfg.data, trainer.global_batch, seq, cfg.model.vocab_size)
  state = trainer.init_state()
  batch = trainer.device_batch(data.batch(0))
  compile_start = time.perf_counter()
  with progress("Compiling the training step", cfg.train.compile_heartbeat_seconds):
    step_fn = trainer.jit_step().lower(state, batch).compile()
  compile_s = time.perf_counter() - compile_start
  mem = step_fn.memory_analysis()
  if mem is not None:
    print(f"compiled step memory per device: arguments {mem.argument_size_in_bytes / 2**30:.2f} GiB, "
          f"temporaries {mem.temp_size_in_bytes / 2**30:.2f} GiB, outputs {mem.output_size_in_bytes / 2**30:.2f} GiB")

  tokens_per_step = trainer.global_batch * seq
  writer = MetricsWriter(run_dir, cfg.train.enable_tensorboard)
  history = []
  pending = None  # (step, metrics on device): fetched one step late so the device never waits for the host
  last_done = time.perf_counter()
  try:
    for step in range(cfg.train.steps + 1):
      if step < cfg.train.steps:
        state, metrics = step_fn(state, batch)
        if step + 1 < cfg.train.steps:
          batch = trainer.device_batch(data.batch(step + 1))
      if pending is not None:
        done_step, done_metrics = pending
        values = {k: v.item() for k, v in jax.device_get(done_metrics).items()}
        now = time.perf_counter()
        step_time, last_done = now - last_done, now
        values.update(rates(step_time, tokens_per_step, mesh.size, flops_per_token, peak))
        history.append({"step": done_step, **values})
        if done_step % cfg.train.log_period == 0 or done_step == cfg.train.steps - 1:
          writer.write(done_step, values)
          writer.flush()
      pending = (step, metrics) if step < cfg.train.steps else None
  finally:
    writer.close()
  jax.block_until_ready(state)
  summary = summarize(history, compile_s)
  (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
  print("summary: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()), flush=True)
  return history


def summarize(history: list[dict], compile_s: float) -> dict:
  """Medians over the steps after the first two (which include warm-up), and peak device memory."""
  import statistics

  import jax

  steady = history[2:] or history
  summary = {"steps": len(history), "compile_s": compile_s, "final_loss": history[-1]["loss"]}
  for key in ("step_time_s", "tokens_per_s_per_device", "tflops_per_device", "mfu"):
    values = [h[key] for h in steady if h.get(key) is not None]
    summary[f"median_{key}"] = statistics.median(values) if values else None
  stats = jax.local_devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    summary["peak_memory_gib"] = stats["peak_bytes_in_use"] / 2**30
  return summary


def rates(step_time: float, tokens: int, devices: int, flops_per_token: float, peak: float | None) -> dict:
  tflops = tokens * flops_per_token / step_time / devices / 1e12
  return {
      "step_time_s": step_time,
      "tokens_per_s_per_device": tokens / step_time / devices,
      "tflops_per_device": tflops,
      "mfu": tflops / peak if peak else None,
  }


def environment() -> dict:
  import jax
  import jaxlib

  return {
      "python": platform.python_version(),
      "jax": jax.__version__,
      "jaxlib": jaxlib.__version__,
      "devices": [str(d) for d in jax.devices()],
      "device_kind": jax.devices()[0].device_kind,
      "argv": sys.argv,
  }


@exit_on_user_error
def main(argv: list[str]) -> int:
  if not argv or argv[0] in ("-h", "--help"):
    print(USAGE)
    return 0 if argv else 2
  if "=" in argv[0] or not argv[0].endswith((".yml", ".yaml")):
    raise UserError(f"the first argument must be a recipe .yml file, got '{argv[0]}'; {USAGE}")
  cfg = load_config(argv[0], argv[1:])
  train(cfg)
  return 0


if __name__ == "__main__":
  sys.exit(main())
