"""Train from a recipe: `python -m MaxText.train RECIPE.yml [key=value ...]`.

config (validated, nothing written yet) -> mesh -> data (opened and checked)
-> latest checkpoint (checked against the config) -> run directory -> state
(restored, or initialised) -> compile the step (with progress) -> loop: data ->
step -> metrics (with device times from a short trace every metrics_trace_period
steps), a checkpoint every checkpoint_period steps, at the end (save_checkpoint_on_completion) and on SIGTERM.
Under batch_size_schedule each step reads its microbatches from the data
iterator one by one and runs the step compiled for their number.

Exit codes: 0 finished; 2 bad input (one `error:` line, nothing written);
1 the loss went NaN/Inf under nan_policy=stop (the last checkpoint is intact);
143 stopped by SIGTERM after saving a checkpoint (run the same command to resume).
"""

import contextlib
import dataclasses
import json
import math
import platform
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from MaxText.config import Config, load_config
from MaxText.errors import UserError, exit_on_user_error
from MaxText.progress import progress

USAGE = "usage: python -m MaxText.train RECIPE.yml [key=value ...]"
EXIT_NONFINITE = 1  # the loss went NaN/Inf (nan_policy=stop)
EXIT_PREEMPTED = 143  # 128 + SIGTERM: checkpoint saved, run again to resume (0 means finished)


def run_directory(cfg: Config) -> Path:
  name = cfg.train.run_name or f"{cfg.model.model_name}-{time.strftime('%Y%m%d-%H%M%S')}"
  return Path(cfg.train.base_output_directory) / name


def make_run_dir(run_dir: Path, resumable: bool) -> Path:
  """Creates the run directory; one that already holds a run is an error unless checkpointing may resume it."""
  if (run_dir / "metrics.jsonl").exists() and not resumable:
    raise UserError(f"run directory {run_dir} already holds a run; choose another run_name or remove it")
  missing = []  # the levels this call makes, deepest first: removed again if a deeper one fails
  try:
    missing = [d for d in (run_dir, *run_dir.parents) if not d.exists()]  # exists() too can be refused (EACCES)
    run_dir.mkdir(parents=True, exist_ok=True)
  except OSError as e:  # the run's first write: nothing is written before it, and nothing stays after it
    for d in missing:
      with contextlib.suppress(OSError):
        d.rmdir()
    raise UserError(
      f"cannot create the run directory {run_dir}: {e.strerror or e}; set base_output_directory to a writable directory"
    ) from None
  return run_dir


# XLA's autotuner runs each candidate kernel config while compiling; when none can allocate its buffers the
# compile fails with NOT_FOUND ("Failed to get configs ... All configs failed during profiling") and the
# allocator's RESOURCE_EXHAUSTED lines inside (an H100 at DeepSeek-V3's vocabulary, 2026-12-07).
_AUTOTUNE_OOM = re.compile(r"RESOURCE_EXHAUSTED: (Out of memory while trying to allocate [^\[\n]*?)\s*(?:\[|\n|$)")


def out_of_memory_message(error: str) -> str | None:
  """What ran out of memory, from a JaxRuntimeError's text: at a step or compile (RESOURCE_EXHAUSTED) or in
  XLA's autotuning while compiling; None for any other error."""
  if error.startswith("RESOURCE_EXHAUSTED"):
    return error.split("\n")[0].split(" [")[0].removeprefix("RESOURCE_EXHAUSTED: ")
  if error.startswith("NOT_FOUND: Failed to get configs") and (m := _AUTOTUNE_OOM.search(error)):
    return f"{m.group(1).rstrip('. ')}, while XLA autotuned the step's kernels"
  return None


@contextlib.contextmanager
def out_of_memory_is_a_user_error(run_dir: Path, fresh: bool):
  """Device out of memory (at compile or at a step) becomes one UserError line with what to change.

  If the run directory is this run's own and holds no logged step and no checkpoint yet, process 0 removes
  it again, so that the same run_name can be tried with smaller settings. Only process 0 writes the
  metrics: another process, on a host whose run directory is its own, cannot tell from it whether steps
  were logged, and leaves its copy (which does not stop a retry: only a logged step does).
  """
  import jax

  try:
    yield
  except jax.errors.JaxRuntimeError as e:
    what = out_of_memory_message(str(e))
    if what is None:
      raise
    metrics = run_dir / "metrics.jsonl"
    if (
      fresh
      and jax.process_index() == 0
      and not (metrics.exists() and metrics.stat().st_size)
      and not (run_dir / "checkpoints").exists()
    ):
      shutil.rmtree(run_dir, ignore_errors=True)
    raise UserError(
      f"the device ran out of memory ({what}); lower per_device_batch_size, recompute more "
      "(remat_policy=full) or offload activations, or let JAX use more of the GPU (env_presets=mem_fraction_95); "
      "python -m MaxText.aot RECIPE --gpu ... shows the memory plan before a run"
    ) from None


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
    f"{cfg.train.gradient_accumulation_steps} microbatch(es)"
    + (f" (at most: batch_size_schedule '{cfg.train.batch_size_schedule}')" if trainer.batch_sizes else "")
    + f"; moe_dispatch={cfg.moe.moe_dispatch} "
    f"expert GEMM {trainer.expert_gemm}" + f"; dtype={cfg.model.dtype} weights={cfg.model.weight_dtype}"
  )


class NonFiniteLoss(Exception):
  """The loss or gradient norm became NaN/Inf under nan_policy=stop; nothing after it was saved."""


class EpBufferOverflow(NonFiniteLoss):
  """Token copies overflowed the expert-parallel buffers (moe_ep_buffer_factor > 0): the update was
  refused on device like a non-finite one, and the run stops the same way (exit code 1)."""


class Preempted(Exception):
  """SIGTERM arrived: a checkpoint was saved (if enabled) and the loop stopped cleanly."""

  def __init__(self, message: str, history: list[dict]):
    super().__init__(message)
    self.history = history


class Preemption:
  """Turns the first SIGTERM into a request to save and stop after the current step; a second one kills at once.

  With several processes every one must stop at the same step: jax.distributed's preemption
  sync point (which catches SIGTERM itself) decides, through the coordination service, not the devices.
  """

  def __init__(self):
    import jax

    self.requested = False
    self.multi_process = jax.process_count() > 1

  def __enter__(self):
    if not self.multi_process:
      self.previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def _handle(self, signum, frame):
    self.requested = True
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

  def __exit__(self, *exc):
    if not self.multi_process:
      signal.signal(signal.SIGTERM, self.previous)

  def should_stop(self, step: int) -> bool:
    if not self.multi_process:
      return self.requested
    from jax.experimental import multihost_utils

    return multihost_utils.reached_preemption_sync_point(step)


@dataclasses.dataclass
class Run:
  """One run's parts, every one checked against the config before anything is written."""

  cfg: Config
  mesh: Any
  trainer: Any  # train_step.Trainer
  data: Any  # the data iterator, opened and checked
  run_dir: Path
  abstract: Any  # the train state's ShapeDtypeStructs with their shardings: the restore target
  ckpt: Any  # checkpointing.Checkpointer, or None with enable_checkpointing=false
  resume_step: int | None  # the checkpoint to continue from
  flops_per_token: float
  peak_tflops: float | None
  first_profiled: int


def prepare(cfg: Config) -> Run:
  """Builds the mesh, trainer, data iterator and checkpointer and checks them all: a UserError here has
  written nothing."""
  import jax

  from MaxText import checkpointing, flops
  from MaxText.data import make_iterator
  from MaxText.sharding import make_mesh
  from MaxText.train_step import Trainer

  t = cfg.train
  mesh = make_mesh(cfg.mesh)
  trainer = Trainer(cfg, mesh)
  # Under batch_size_schedule the iterator yields microbatches, as many per step as the step runs.
  data = make_iterator(
    cfg.data,
    local_batch=trainer.data_batch // jax.process_count(),
    global_batch=trainer.data_batch,
    seq_len=t.max_target_length,
    vocab_size=cfg.model.vocab_size,
    process_index=jax.process_index(),
    process_count=jax.process_count(),
  )
  run_dir = run_directory(cfg)
  abstract = checkpointing.with_shardings(trainer.abstract_state(), trainer.state_shardings)
  ckpt = (
    checkpointing.Checkpointer(run_dir / "checkpoints", cfg, abstract, trainer.global_batch, trainer.data_batch)
    if t.enable_checkpointing
    else None
  )
  start = ckpt.latest_step() if ckpt else None
  if start is not None:
    if start >= t.steps:
      raise UserError(
        f"run directory {run_dir} already holds a run finished at step {start} (steps={t.steps}); "
        "raise steps to train on, or choose another run_name"
      )
    ckpt.check_compatible(start)
  elif t.load_parameters_path:
    from MaxText import validate

    validate.parameters_match(t.load_parameters_path, abstract.params)
  first_profiled = (start or 0) + t.skip_first_n_steps_for_profiler
  if t.profiler and first_profiled + t.profiler_steps > t.steps:
    raise UserError(
      f"profiler={t.profiler}: steps {first_profiled}-{first_profiled + t.profiler_steps - 1} would be profiled "
      f"but the run ends "
      f"at step {t.steps - 1}; lower skip_first_n_steps_for_profiler or profiler_steps, or raise steps"
    )
  return Run(
    cfg,
    mesh,
    trainer,
    data,
    run_dir,
    abstract,
    ckpt,
    start,
    flops_per_token=flops.training_flops_per_token(cfg.model, cfg.moe, t.max_target_length),
    peak_tflops=flops.peak_tflops(jax.devices()[0].device_kind, t.peak_tflops_per_device),
    first_profiled=first_profiled,
  )


def initial_state(run: Run):
  """(state, first step): checkpoint run.resume_step restored with the data iterator, or a fresh state
  (optionally with the parameters of load_parameters_path)."""
  import jax

  from MaxText import checkpointing

  cfg, trainer = run.cfg, run.trainer
  if run.resume_step is not None:
    start = time.perf_counter()
    state, data_state = run.ckpt.restore(run.resume_step)
    jax.block_until_ready(state)
    run.data.set_state(data_state)
    where = run.ckpt.directory / str(run.resume_step)
    print(
      f"resumed from checkpoint {where} (step {run.resume_step}) in {time.perf_counter() - start:.1f} s", flush=True
    )
    return state, run.resume_step
  state = trainer.init_state()
  if cfg.train.load_parameters_path:
    state = state._replace(params=checkpointing.load_parameters(cfg.train.load_parameters_path, run.abstract.params))
    if cfg.moe.routed_bias:  # a converted or trained model routes with its learned balancing bias
      from MaxText.convert.checkpoint import load_bias

      state = state._replace(
        bias=jax.device_put(load_bias(cfg.train.load_parameters_path, run.abstract.bias), trainer.state_shardings.bias)
      )
    print(f"parameters loaded from {cfg.train.load_parameters_path}", flush=True)
  return state, 0


def compile_step(run: Run, state, batch, microbatches: int | None = None):
  """(the compiled step, seconds it took), with a heartbeat while XLA works and the memory it plans."""
  compile_start = time.perf_counter()
  with progress("Compiling the training step", run.cfg.train.compile_heartbeat_seconds):
    step_fn = run.trainer.jit_step(microbatches).lower(state, batch).compile()
  compile_s = time.perf_counter() - compile_start
  mem = step_fn.memory_analysis()
  if mem is not None:
    print(
      f"compiled step memory per device: arguments {mem.argument_size_in_bytes / 2**30:.2f} GiB, "
      f"temporaries {mem.temp_size_in_bytes / 2**30:.2f} GiB, outputs {mem.output_size_in_bytes / 2**30:.2f} GiB; "
      f"host: arguments {mem.host_argument_size_in_bytes / 2**30:.2f} GiB, "
      f"temporaries {mem.host_temp_size_in_bytes / 2**30:.2f} GiB"
    )
  return step_fn, compile_s


class StepFunctions:
  """The compiled step for each step of the run. Under batch_size_schedule: one per microbatch count, compiled
  at its first step (all take the same arguments, so any state and batch lower it) and dropped once no later
  step runs that count; otherwise the one compiled step."""

  def __init__(self, run: Run, first, first_step: int):
    self.run = run
    self.compiled = {self._count(first_step): first}
    self.compiled_at: set[int] = set()  # steps that compiled a step first (their time includes it)

  def _count(self, step: int) -> int | None:
    return self.run.trainer.microbatches(step) if self.run.trainer.batch_sizes else None

  def __call__(self, step: int, state, batch):
    n = self._count(step)
    if n not in self.compiled:
      trainer = self.run.trainer
      later = trainer.batch_sizes.counts_from(step)
      self.compiled = {k: fn for k, fn in self.compiled.items() if k in later}
      with progress(
        f"Compiling the training step for {n} microbatch(es) ({trainer.batch_sizes.sequences(step)} sequences)",
        self.run.cfg.train.compile_heartbeat_seconds,
      ):
        self.compiled[n] = trainer.jit_step(n).lower(state, batch).compile()
      self.compiled_at.add(step)
    return self.compiled[n]


def next_batch(trainer, data, step: int):
  """(step `step`'s batch on the devices, seconds the loop waited for it): the data iterator's next batch, or
  under batch_size_schedule its next microbatches, as many as the step runs."""
  start = time.perf_counter()
  if trainer.batch_sizes:
    host = trainer.host_batch([next(data) for _ in range(trainer.microbatches(step))])
  else:
    host = next(data)
  batch = trainer.device_batch(host)
  return batch, time.perf_counter() - start


class StepLog:
  """Each step's metrics, fetched one step late so that the device never waits for the host: logged every
  log_period steps (and at the last, a traced, a non-finite or an overflowing one), kept in `history`.

  Raises NonFiniteLoss (nan_policy=stop) or EpBufferOverflow at the fetch that finds one."""

  def __init__(self, run: Run, writer, profiler, start: int):
    from MaxText.metrics import StepClock

    self.run, self.writer, self.profiler, self.start = run, writer, profiler, start
    self.clock = StepClock()
    self.data_wait: dict[int, float] = {}  # step -> seconds the loop waited for its batch
    self.compiled_at: set[int] = set()  # steps whose time includes compiling the step (batch_size_schedule)
    self.history: list[dict] = []
    self.pending = None  # (step, metrics on device)
    self.traces: dict[int, dict] = {}  # step -> its metrics_trace_period values (profile.MetricsTracer)

  def dispatched(self, step: int, metrics) -> None:
    # The metrics' copies to the host are queued now, behind this step only: queued at the fetch, after the
    # next step's dispatch, a GPU ran them after that step too, and the fetch charged this step both steps'
    # time (H100, 3 steps: 1,908 ms logged for step 1, 2.8 ms for step 2).
    for value in metrics.values():
      value.copy_to_host_async()
    self.clock.dispatched(step, metrics)

  def traced(self, step: int, values: dict) -> None:
    """Step `step`'s trace values, logged with its metrics. The trace's cost counts in this step's time: a step
    timed as its dispatch returned (StepClock) ends only now."""
    self.traces[step] = values
    if step in self.clock.finished:
      self.clock.finished[step] = time.perf_counter()

  def defer(self, step: int, metrics) -> None:
    """Fetches the step before and keeps this one's metrics for the next fetch."""
    self.fetch()
    self.pending = (step, metrics)

  def fetch(self) -> None:
    import jax

    if self.pending is None:
      return
    (step, metrics), self.pending = self.pending, None
    run, t = self.run, self.run.cfg.train
    values = {k: v.item() for k, v in jax.device_get(metrics).items()}
    tokens = run.trainer.tokens.at(step)  # this step's own under batch_size_schedule
    values.update(rates(self.clock.step_time(step), tokens, run.mesh.size, run.flops_per_token, run.peak_tflops))
    values["data_wait_s"] = self.data_wait.pop(step)
    if self.profiler and self.profiler.first <= step <= self.profiler.first + self.profiler.count:
      values["profiled"] = 1  # tracing, and the wait that ends it (the next step's time too): out of the medians
    if step in self.compiled_at:
      values["compiled"] = 1  # a new microbatch count compiled first: out of the medians
    values.update(self.traces.pop(step, {}))  # metrics_trace_period: traced, out of the medians
    self.history.append({"step": step, **values})
    finite = math.isfinite(values["loss"]) and math.isfinite(values["grad_norm"])
    overflow = values.get("ep_overflow", 0)
    if step % t.log_period == 0 or step == t.steps - 1 or values.get("traced") or not finite or overflow:
      self.writer.write(step, values)
      self.writer.flush()
    if overflow:
      raise EpBufferOverflow(
        f"step {step}: {overflow} token copies did not fit the expert-parallel buffers "
        f"(moe_ep_buffer_factor={run.cfg.moe.moe_ep_buffer_factor}); the update was not applied and nothing was saved "
        "after it. Raise moe_ep_buffer_factor, or set it to -1 (worst-case buffers, never overflow)"
      )
    if not finite:
      what = f"step {step}: loss {values['loss']}, grad norm {values['grad_norm']}"
      if t.nan_policy == "skip":
        print(f"{what}: not finite; step skipped, state unchanged (nan_policy=skip)", flush=True)
        return
      ckpt = run.ckpt
      good = ckpt.last_saved if ckpt and ckpt.last_saved is not None else (self.start or None)
      last = f"the last checkpoint is step {good} in {ckpt.directory}" if ckpt and good else "there is no checkpoint"
      raise NonFiniteLoss(
        f"{what}: not finite; stopped (nan_policy=stop); {last}. "
        "Resume from it with a lower learning_rate, or set nan_policy=skip"
      )


def train(cfg: Config) -> list[dict]:
  """Runs (or resumes) the training loop; returns this session's per-step metrics.

  Raises NonFiniteLoss (nan_policy=stop) or Preempted (SIGTERM) after closing the files and
  finishing any checkpoint in flight.
  """
  run = prepare(cfg)
  with out_of_memory_is_a_user_error(run.run_dir, fresh=not run.run_dir.exists()):
    return execute(run)


def execute(run: Run) -> list[dict]:
  """train() once every check has passed: writes the run directory, compiles and loops."""
  import jax

  from MaxText import remat, runtime_env
  from MaxText.metrics import MetricsWriter

  cfg, trainer, ckpt, data, t = run.cfg, run.trainer, run.ckpt, run.data, run.cfg.train
  make_run_dir(run.run_dir, resumable=ckpt is not None)
  (run.run_dir / "config.yml").write_text(cfg.to_yaml())
  (run.run_dir / "environment.json").write_text(json.dumps(environment(), indent=1))
  print(f"run directory: {run.run_dir}")
  print(describe(cfg, trainer, run.flops_per_token), flush=True)
  print(f"{remat.describe(cfg.model)}; state in host memory: {trainer.host_offload_description()}")
  print(
    "environment in force: "
    + (" ".join(f"{k}={v!r}" for k, v in runtime_env.in_force().items()) or "no XLA_*/CUDA_*/NCCL_*/JAX_* variables"),
    flush=True,
  )

  state, start = initial_state(run)
  batch, data_wait = next_batch(trainer, data, start)
  step_fn, compile_s = compile_step(run, state, batch, trainer.microbatches(start) if trainer.batch_sizes else None)
  step_fns = StepFunctions(run, step_fn, start)
  profiler = None
  if t.profiler and jax.process_index() == 0:
    from MaxText.profile import StepProfiler

    profiler = StepProfiler(run.run_dir / "profile", run.first_profiled, t.profiler_steps, step_fn.as_text())
  tracer = None
  if t.metrics_trace_period:
    from MaxText.profile import MetricsTracer

    # Never in the profiler window nor the step after it (one jax.profiler trace at a time); every process knows
    # the traced steps, process 0 traces them.
    window = range(run.first_profiled, run.first_profiled + t.profiler_steps + 1) if t.profiler else range(0)
    tracer = MetricsTracer(run.run_dir, t.metrics_trace_period, start, window, active=jax.process_index() == 0)
  writer = MetricsWriter(run.run_dir, t.enable_tensorboard, files=jax.process_index() == 0)  # one writer per run
  log = StepLog(run, writer, profiler, start)
  log.data_wait[start] = data_wait
  log.compiled_at = step_fns.compiled_at
  from MaxText import schedules

  # Each scheduled value where the run starts, then one line as each changes (known on the host ahead of time).
  schedule_lines = schedules.log_lines(trainer.schedules, start, t.steps)
  stopped_at = None
  try:
    with Preemption() as preemption:
      for step in range(start, t.steps):
        for line in schedule_lines.get(step, ()):
          print(line, flush=True)
        compiled = step_fns(step, state, batch)  # compiles first for a new microbatch count
        traced = tracer is not None and tracer.wants(step)
        if traced:
          log.fetch()  # the step before is timed without the trace, which this step's time holds all of
          tracer.before(step, state)
        if profiler:
          profiler.before(step, state)
        state, metrics = compiled(state, batch)
        log.dispatched(step, metrics)
        if profiler:
          profiler.after(step, state)
        if traced and (values := tracer.after(step, state, compiled)):
          log.traced(step, values)
        done = step + 1  # state.step once this step has run
        stop = preemption.should_stop(done)
        at_end = done == t.steps and t.save_checkpoint_on_completion
        save = ckpt is not None and (done % t.checkpoint_period == 0 or at_end or stop)
        # A fresh executable's first step is fetched before the next is dispatched: on a GPU its metrics became
        # readable only once the next step had run too (H100: 1,105 ms logged for step 0, 11.5 ms for step 1),
        # which split two steps' time wrongly between them. The device waits for the host once.
        first_run = step == start or step in step_fns.compiled_at
        fetched = save or stop or first_run
        if fetched:
          # Only a state whose update was finite is saved: fetch this step's metrics first.
          log.defer(step, metrics)
          log.fetch()
          if save:
            start = time.perf_counter()
            ckpt.save(done, state, data.get_state())
            blocked = time.perf_counter() - start
            mode = "started in the background after" if t.async_checkpointing else "written in"
            print(f"checkpoint {done}: {mode} {blocked:.1f} s of the training loop's time", flush=True)
        if stop:
          stopped_at = done
          break
        if done < t.steps:
          batch, log.data_wait[done] = next_batch(trainer, data, done)
        if not fetched:
          log.defer(step, metrics)
      log.fetch()
  finally:
    if tracer is not None:
      tracer.close()
    writer.close()
    if ckpt is not None:
      start = time.perf_counter()
      ckpt.wait()
      ckpt.close()
      if ckpt.last_saved is not None:
        waited = time.perf_counter() - start
        print(f"checkpoints: the last one finished writing {waited:.1f} s after the loop", flush=True)
  jax.block_until_ready(state)
  history = log.history
  summary = summarize(history, compile_s) if history else {"steps": 0, "compile_s": compile_s}
  if stopped_at is not None:
    summary["stopped"] = f"SIGTERM at step {stopped_at}"
  (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
  print(
    "summary: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()),
    flush=True,
  )
  if stopped_at is not None:
    saved = (
      f"checkpoint saved at step {stopped_at} in {ckpt.directory}"
      if ckpt
      else "no checkpoint (enable_checkpointing=false)"
    )
    raise Preempted(f"SIGTERM: stopped after step {stopped_at - 1}; {saved}", history)
  return history


TRACE_KEYS = (
  "gmm_ms",
  "dispatch_ms",
  "device_busy_ms",
  "kernel_ms",
  "graphs_ms",
  "metrics_trace_s",
)  # metrics_trace_period


def summarize(history: list[dict], compile_s: float) -> dict:
  """Medians over the steps after the first two (which include warm-up), outside a profiled window and not
  traced (metrics_trace_period), the traced steps' medians of their trace values, and peak device memory."""
  import statistics

  import jax

  steady = [h for h in history[2:] if not (h.get("profiled") or h.get("compiled") or h.get("traced"))] or history
  summary = {"steps": len(history), "compile_s": compile_s, "final_loss": history[-1]["loss"]}
  for key in ("step_time_s", "tokens_per_s_per_device", "tflops_per_device", "mfu", "data_wait_s"):
    values = [h[key] for h in steady if h.get(key) is not None]
    summary[f"median_{key}"] = statistics.median(values) if values else None
  for key in TRACE_KEYS:
    values = [h[key] for h in history if h.get("traced") and h.get(key) is not None]
    if values:
      summary[f"median_{key}"] = statistics.median(values)
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

  from MaxText import runtime_env

  return {
    "python": platform.python_version(),
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "devices": [str(d) for d in jax.devices()],
    "device_kind": jax.devices()[0].device_kind,
    "argv": sys.argv,
    "environment_in_force": runtime_env.in_force(),  # XLA_FLAGS and the XLA_*/CUDA_*/NCCL_*/JAX_* variables
  }


@exit_on_user_error
def main(argv: list[str]) -> int:
  if not argv or any(a in ("-h", "--help") for a in argv):  # anywhere, as users type it after a recipe too
    print(USAGE)
    return 0 if argv else 2
  if "=" in argv[0] or not argv[0].endswith((".yml", ".yaml")):
    raise UserError(f"the first argument must be a recipe .yml file, got '{argv[0]}'; {USAGE}")
  # Validation (MaxText/validate.py): every check before a status line is printed or anything is written.
  cfg = load_config(argv[0], argv[1:])
  from MaxText import distributed, runtime_env, validate

  validate.before_start(cfg)  # paths, explicit mesh sizes against every tensor, the backend for JAX_PLATFORMS
  applied = runtime_env.apply(cfg.train)  # before anything starts a JAX backend; unknown XLA flags stop here
  launch = distributed.initialize()  # SLURM, Kubernetes or JAX_COORDINATOR_ADDRESS/...; single process otherwise
  import io

  import jax

  devices = jax.devices()
  slices = len({getattr(d, "slice_index", 0) for d in devices})
  validate.devices(cfg, len(devices), slices, devices[0].platform, devices[0].device_kind)
  held = io.StringIO()  # prepare's lines are printed once it has passed: an error there comes first
  with contextlib.redirect_stdout(held):
    run = prepare(cfg)
  for note in applied["notes"]:
    print(f"note: {note}", flush=True)
  print(f"launch: {launch.describe()}", flush=True)
  print(held.getvalue(), end="", flush=True)
  try:
    with out_of_memory_is_a_user_error(run.run_dir, fresh=not run.run_dir.exists()):
      execute(run)
  except NonFiniteLoss as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_NONFINITE
  except Preempted as e:
    print(str(e), flush=True)
    return EXIT_PREEMPTED
  return 0


if __name__ == "__main__":
  sys.exit(main())
