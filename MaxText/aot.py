"""Plan a GPU cluster without it: `python -m MaxText.aot RECIPE --gpu h200 --num-gpus 128 [key=value ...]`.

Compiles the recipe's training step for `--num-gpus` compile-only GPUs (XLA's
CUDA compiler fed a target config instead of attached GPUs, MaxText/compile_only.py)
on any machine, CPU included, and prints what one GPU would hold and do:

  memory per GPU   parameters, optimizer state (both from the state's shardings),
                   temporaries (activations, gathered weights, gradients: XLA's
                   buffer assignment), the compiled peak, host-offloaded bytes
  compute          FLOPs per step per GPU: the model FLOPs of MaxText/flops.py, and the
                   matmul FLOPs as traced, remat recompute included (MaxText/step_flops.py;
                   XLA's cost analysis is empty for compile-only GPU executables; ragged
                   GEMMs count their whole buffers, so this is an upper estimate); the
                   least HBM traffic (each argument read, each output and temporary
                   written once)
  lower bound      step time >= max(model FLOPs / peak FLOP/s, bytes / HBM bandwidth);
                   collectives, recompute and imperfect overlap only add to it
  prediction       compute at measured kernel rates + the compiled step's exposed collectives
                   (MaxText/plan/: bytes, groups, intra/inter-node, overlap; NCCL's ring model;
                   --gpus-per-node, --fabric FILE of measured bandwidths); TFLOP/s, MFU, MoE
                   dispatch/combine per layer, weak scaling 8-1,024 GPUs
  sharding         XLA's "Involuntary full rematerialization" warnings of the compile,
                   counted, with the operations (MaxText/xla_warnings.py): each one
                   replicates a whole tensor on every GPU; a recipe should have none

Options:
  --gpu {h100,h200,b200}     the GPU kind; --num-gpus N how many
  --gpus-per-host 8          GPUs per node (alias --gpus-per-node): NVLink inside, the network across
  --memory-fraction F        the share of GPU memory the run may use (default below)
  --fabric FILE              JSON/YAML of your own measured NCCL bandwidths and latencies
                             (MaxText/plan/fabric.py); default: published NDR InfiniBand / NVLink 4
  --search [--search-budget K]
                             rank mesh shapes (fsdp x expert, data), remat policies, the head's
                             chunk and batch by predicted tokens/s per GPU, with a
                             memory estimate calibrated on compiles; compile K of them (default 3: the
                             recipe's own, then the best that the estimate says fit; 0: rank only)
                             (MaxText/plan/search.py); exit 0 when a compiled one fits, else 3
  --json OUT                 the report (or the search's table) as JSON

optimizer_memory_host_offload=true: the step copies the moments to the device only after the backward
pass (MaxText/host_offload.py), so they are not part of its peak. Compile-only GPUs have no host memory
space, so the planner compiles the step without them and makes them on the device where the copies
land; their copies in and out (PCIe) count in the prediction, not overlapped.

attention=cudnn_flash cannot be compiled without a GPU (XLA builds the cuDNN graph while
compiling): it is replaced by a stand-in with flash attention's memory footprint
(MaxText/flash_stand_in.py); cuDNN's workspace is not counted.

Exit codes: 0 the step fits; 2 bad input (one `error:` line); 3 it does not fit in
the GPU's memory budget (the report, then one `error:` line naming the overshoot; a
train state alone over the budget is reported at once, without compiling). The
budget is XLA's allocator limit on the GPU: the memory CUDA reports times `--memory-fraction`,
by default what the run would get: XLA_PYTHON_CLIENT_MEM_FRACTION as the recipe's env_presets /
env_vars or the environment set it, else jax's default 0.75. The compile aims for the same
limit as on the GPU, where XLA rematerialises a step that would not fit until it does (or
cannot), so the peak reported is the rematerialised one. The recipe's XLA flags
(xla_flag_presets, xla_flags) are applied before compiling, as train.py does.

The CUDA plugin must be importable. On a GPU machine `jax[cuda13]` provides it; elsewhere
`make install` puts it in .venv/gpu-aot (found here automatically, or name a directory with
MAXTEXT_GPU_AOT_SITE): pip install --no-deps --target .venv/gpu-aot -r requirements-gpu-aot.txt
"""

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

from MaxText import xla_warnings
from MaxText.errors import UserError, exit_on_user_error
from MaxText.progress import progress

REPO = Path(__file__).resolve().parents[1]
EXIT_DOES_NOT_FIT = 3
DEFAULT_MEMORY_FRACTION = 0.75  # what the JAX GPU client preallocates unless told otherwise
DEFAULT_SEARCH_BUDGET = 3  # compiles per --search: the recipe's own configuration, then the two best estimates
USAGE = (
  "usage: python -m MaxText.aot RECIPE.yml --gpu {h100,h200,b200} --num-gpus N [--gpus-per-host 8 | "
  "--gpus-per-node 8] [--memory-fraction F] [--fabric FILE] [--search [--search-budget K]] [--json OUT] "
  "[key=value ...]"
)

# Train-state fields that host offload keeps in pinned host memory -> their memory report key.
UNPLACED = {"params": "parameters", "opt_state": "optimizer_state"}
# Dense tensor-core peaks per GPU (no sparsity), FLOP/s: Hopper SXM, bf16 and fp8.
PEAK_FLOPS = {"h100": {"bf16": 989e12, "fp8": 1979e12}, "h200": {"bf16": 989e12, "fp8": 1979e12}}


def plugin_site() -> Path | None:
  """Where the CUDA plugin is: None if already importable, else a directory to put on sys.path."""
  if importlib.util.find_spec("jax_plugins") is not None:
    try:
      if importlib.util.find_spec("jax_plugins.xla_cuda13") or importlib.util.find_spec("jax_plugins.xla_cuda12"):
        return None
    except ModuleNotFoundError:
      pass
  candidates = [os.environ.get("MAXTEXT_GPU_AOT_SITE"), Path(sys.prefix) / "gpu-aot", REPO / ".venv" / "gpu-aot"]
  for c in candidates:
    if c and (Path(c) / "jax_plugins").is_dir():
      return Path(c)
  raise UserError(
    "the planner needs the CUDA plugin of this jaxlib and it is not installed; "
    f"run `make install`, or: pip install --no-deps --target {REPO / '.venv' / 'gpu-aot'} "
    f"-r {REPO / 'requirements-gpu-aot.txt'}"
  )


def use_plugin() -> None:
  """Makes the CUDA plugin importable before jax starts; keeps jax itself on the CPU (nothing runs on a GPU)."""
  if "jax" in sys.modules:
    # Too late to add a plugin path: jax discovers plugins when its backends start.
    return
  site = plugin_site()
  if site is not None:
    sys.path.insert(0, str(site))
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


class _Parser(argparse.ArgumentParser):
  def error(self, message):  # one `error:` line and exit code 2, like every other bad input
    raise UserError(f"{message}; {USAGE}")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  ap = _Parser(prog="python -m MaxText.aot", add_help=False)
  ap.add_argument("recipe")
  ap.add_argument("--gpu", required=True)
  ap.add_argument("--num-gpus", type=int, required=True)
  ap.add_argument("--gpus-per-host", type=int, default=8)
  ap.add_argument("--memory-fraction", type=float)
  ap.add_argument("--json", dest="json_out")
  ap.add_argument("--gpus-per-node", dest="gpus_per_host", type=int)  # the same as --gpus-per-host
  ap.add_argument("--fabric")  # JSON/YAML of measured bandwidths and latencies (MaxText/plan/fabric.py)
  ap.add_argument("--search", action="store_true")  # rank mesh shapes, remat and batch (MaxText/plan/search.py)
  ap.add_argument("--search-budget", type=int)  # how many candidates to compile (default 3), the recipe's own first
  options = [a for a in argv if not ("=" in a and not a.startswith("-"))]
  overrides = [a for a in argv if "=" in a and not a.startswith("-")]
  args, unknown = ap.parse_known_args(options)
  if unknown:
    raise UserError(f"unknown argument(s) {' '.join(unknown)}; {USAGE}")
  if not args.recipe.endswith((".yml", ".yaml")):
    raise UserError(f"the first argument must be a recipe .yml file, got '{args.recipe}'; {USAGE}")
  if args.num_gpus < 1 or args.gpus_per_host < 1:
    raise UserError("--num-gpus and --gpus-per-host must be positive")
  if args.memory_fraction is not None and not 0 < args.memory_fraction <= 1:
    raise UserError(f"--memory-fraction {args.memory_fraction} must be in (0, 1]")
  if args.search_budget is not None and not args.search:
    raise UserError(f"--search-budget is an option of --search; {USAGE}")
  if args.search_budget is None:
    args.search_budget = DEFAULT_SEARCH_BUDGET
  if args.search_budget < 0:
    raise UserError(f"--search-budget {args.search_budget} must be >= 0 (0: rank by estimate, compile nothing)")
  return args, overrides


def memory_fraction_in_force() -> float:
  text = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
  try:
    fraction = float(text) if text else DEFAULT_MEMORY_FRACTION
  except ValueError:
    raise UserError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={text!r} must be a number") from None
  if not 0 < fraction <= 1:
    raise UserError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={text} must be in (0, 1]")
  return fraction


def uses_fp8(cfg) -> bool:
  q = getattr(cfg.model, "quantization", None) or getattr(cfg.moe, "quantization", None) or ""
  return "fp8" in q


def plan(cfg, gpu: str, num_gpus: int, gpus_per_host: int, memory_fraction: float, fabric_file=None) -> dict:
  """Compiles cfg's train step for num_gpus compile-only GPUs and returns the numbers of the report.

  When the train state alone (parameters, optimizer state: known from the shardings) is over the
  budget, nothing is compiled: the report says so at once (`compiled: false`).
  """
  import jax
  import jax.numpy as jnp

  from MaxText import compile_only, host_offload
  from MaxText.model import Batch
  from MaxText.sharding import host_bytes, make_mesh, per_device_bytes
  from MaxText.train_step import Trainer

  spec = compile_only.GPUS[gpu]
  budget = compile_only.allocator_limit(gpu, memory_fraction)
  devices = compile_only.devices(gpu, num_gpus, gpus_per_host, memory_limit=budget)
  mesh = make_mesh(cfg.mesh, devices)
  trainer = Trainer(cfg, mesh)
  b, s = trainer.global_batch, cfg.train.max_target_length
  batch = Batch(*(jax.ShapeDtypeStruct((b, s), dt) for dt in (jnp.int32, jnp.int32, jnp.float32)))
  state, shardings = trainer.abstract_state(), trainer.state_shardings
  offloaded_state = host_bytes(state, shardings)
  memory = {
    "parameters": per_device_bytes(state.params, shardings.params),
    "optimizer_state": per_device_bytes(state.opt_state, shardings.opt_state),
    "other_state": per_device_bytes((state.bias, state.step), (shardings.bias, shardings.step)),
    "gpu_total": spec.memory_bytes,
    "cuda_total": spec.cuda_total_bytes,
    "memory_fraction": memory_fraction,
    "budget": budget,
  }
  # Compile-only devices list no memory spaces, so jax would drop the pinned_host placement of offloaded
  # state and XLA hold it on the device through the step. The step is compiled without it instead
  # (host_offload.step_for_planning): what the GPU holds of it is its copies, where the step makes them.
  if not offloaded_state:
    for field, key in UNPLACED.items():
      if field in host_offload.offloaded_fields(cfg.train):
        memory[f"{key}_offloaded"] = memory[key]
  unplaced = sum(memory.get(f"{key}_offloaded", 0) for key in UNPLACED.values())
  state_on_gpu = memory["parameters"] + memory["optimizer_state"] + memory["other_state"] - offloaded_state - unplaced
  report = {
    "recipe_model": cfg.model.model_name,
    "gpu": gpu,
    "device_kind": devices[0].device_kind,
    "num_gpus": num_gpus,
    "hosts": num_gpus // min(num_gpus, gpus_per_host),
    "mesh": {a: int(n) for a, n in mesh.shape.items()},
    "global_batch": b,
    "seq_len": s,
    "tokens_per_step": b * s,
    "memory": memory,
  }
  if state_on_gpu > budget:
    memory.update(host_offloaded=offloaded_state + unplaced, peak=state_on_gpu)
    return {**report, "compiled": False, "fits": False}
  with compile_only.lowering_for(devices):
    measured = compile_and_measure(cfg, trainer, state, batch, gpu, num_gpus, memory, offloaded_state, fabric_file)
  return {**report, **measured, "compiled": True}


def compiled_peak_bytes(mem) -> int:
  """A compiled executable's peak device bytes from its memory_analysis()."""
  # Arguments are donated: the new state reuses their buffers (aliased), so peak = arguments + outputs
  # that are not aliased + temporaries + code; newer XLA also reports its own peak.
  peak = (
    mem.argument_size_in_bytes
    + mem.output_size_in_bytes
    - mem.alias_size_in_bytes
    + mem.temp_size_in_bytes
    + mem.generated_code_size_in_bytes
  )
  return max(peak, getattr(mem, "peak_memory_in_bytes", 0) or 0)


def compile_and_measure(
  cfg, trainer, state, batch, gpu: str, num_gpus: int, memory: dict, offloaded_state: int, fabric_file=None
) -> dict:
  import jax

  from MaxText import compile_only, flops, host_offload, step_flops

  spec = compile_only.GPUS[gpu]
  stand_in = cfg.model.attention == "cudnn_flash"
  if stand_in:  # cuDNN attention cannot be compiled without a GPU: a stand-in with flash attention's footprint
    from MaxText import flash_stand_in
    from MaxText.layers import mla

    mla.ATTENTION = {**mla.ATTENTION, "cudnn_flash": flash_stand_in.attention}
  # Compile-only devices cannot place offloaded state (plan()): the fields the planned step makes itself.
  unplaced_fields = [f for f, key in UNPLACED.items() if f"{key}_offloaded" in memory]
  unplaced = sum(memory[f"{UNPLACED[f]}_offloaded"] for f in unplaced_fields)
  start = time.perf_counter()
  with (
    xla_warnings.capture_stderr() as xla_log,
    progress(f"Compiling the training step for {num_gpus} x {gpu} (compile-only)", cfg.train.compile_heartbeat_seconds),
  ):
    if unplaced_fields:  # host_offload.step_for_planning: made on the device where the GPU's copies land
      none = dict.fromkeys(unplaced_fields)
      shardings = trainer.state_shardings._replace(**none)
      step = jax.jit(
        host_offload.step_for_planning(trainer.step, {f: getattr(state, f) for f in unplaced_fields}),
        in_shardings=(shardings, trainer.batch_sharding),
        out_shardings=(shardings, None),
        donate_argnums=(0,),
      )
      compiled = step.lower(state._replace(**none), batch).compile()
    else:
      compiled = trainer.jit_step().lower(state, batch).compile()
  compile_s = time.perf_counter() - start
  mem = compiled.memory_analysis()
  executed = step_flops.step_flops(trainer.step, state, batch)

  peak = compiled_peak_bytes(mem)
  memory.update(
    arguments=mem.argument_size_in_bytes,
    outputs=mem.output_size_in_bytes,
    aliased=mem.alias_size_in_bytes,
    temporaries=mem.temp_size_in_bytes,
    code=mem.generated_code_size_in_bytes,
    host_offloaded=max(mem.host_temp_size_in_bytes + mem.host_argument_size_in_bytes, offloaded_state - unplaced)
    + unplaced,
    peak=peak,
  )

  s = cfg.train.max_target_length
  tokens = trainer.global_batch * s
  model_flops = flops.training_flops_per_token(cfg.model, cfg.moe, s) * tokens / num_gpus
  executed_flops = executed.flops / num_gpus
  if stand_in:  # the stand-in does no matmuls: add causal attention's, forward + backward (x3), from the model formula
    layers = cfg.model.base_num_decoder_layers + cfg.model.mtp_num_layers
    executed_flops += 3 * layers * flops.attention_flops_per_token(cfg.model, s) * tokens / num_gpus
  # Least HBM traffic: every argument read once, every output and temporary written once.
  hbm_bytes = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
  precision = "fp8" if uses_fp8(cfg) else "bf16"
  peak_flops = PEAK_FLOPS[gpu][precision]
  # The bound uses the model FLOPs, work any implementation must do. The traced count is no lower bound: it
  # counts ragged GEMMs over their whole (worst-case) buffers, and misses kernels without a cost estimate.
  compute_s = model_flops / peak_flops
  memory_s = hbm_bytes / spec.memory_bandwidth
  return {
    "compile_s": round(compile_s, 1),
    "fits": peak <= memory["budget"],
    "flops_per_step_per_gpu": {"traced": executed_flops, "model": model_flops},
    "uncounted_kernels": executed.uncounted_kernels,
    "attention_stand_in": stand_in,
    "hbm_bytes_per_step_per_gpu": hbm_bytes,
    "precision_for_peak": precision,
    "peak_flops": peak_flops,
    "lower_bound_step_s": {"compute": compute_s, "memory": memory_s, "step": max(compute_s, memory_s)},
    "upper_bound_tokens_per_s_per_gpu": tokens / num_gpus / max(compute_s, memory_s, 1e-12),
    "prediction": predict_step(cfg, gpu, trainer.mesh, compiled.as_text(), memory, fabric_file),
    "involuntary_rematerializations": xla_log.involuntary_rematerializations(),
  }


def predict_step(cfg, gpu: str, mesh, hlo_text: str, memory: dict, fabric_file=None) -> dict:
  """The step-time prediction (MaxText/plan/predict.py) from the compiled step's collectives."""
  from MaxText import compile_only
  from MaxText.plan import collectives, predict

  devices = list(mesh.devices.flat)  # partition p of the HLO runs on devices[p]
  per_node = sum(1 for d in devices if d.process_index == devices[0].process_index)
  ids = [d.id for d in devices]  # compile-only devices: ids run host by host, per_node to a host
  return predict.predict(
    cfg, gpu, compile_only.GPUS[gpu], len(devices), per_node, {a: int(n) for a, n in mesh.shape.items()},
    collectives.parse(hlo_text), ids, memory, fabric_file,
  )  # fmt: skip


def gib(n: float) -> str:
  return f"{n / 2**30:8.2f} GiB"


def format_report(r: dict) -> str:
  m = r["memory"]
  mesh = " x ".join(f"{a}={n}" for a, n in r["mesh"].items() if n > 1) or "1 device"
  budget = f"of a budget of {gib(m['budget']).strip()} ({m['memory_fraction']:.2f} x {m['cuda_total'] / 2**30:.1f} GiB)"
  lines = [
    f"{r['recipe_model']} on {r['num_gpus']} x {r['device_kind']} ({r['hosts']} host(s)); mesh {mesh}",
    f"step: {r['global_batch']} sequences x {r['seq_len']} tokens = {r['tokens_per_step']:,} tokens"
    + (
      f"; compiled in {r['compile_s']:.1f} s"
      if r["compiled"]
      else "; not compiled: the train state alone is over the budget"
    ),
    "memory per GPU:",
    f"  parameters         {gib(m['parameters'])}",
    f"  optimizer state    {gib(m['optimizer_state'])}",
  ]
  if not r["compiled"]:
    lines += [
      f"  host offloaded     {gib(m['host_offloaded'])}   (state in pinned host memory)",
      f"  state on the GPU   {gib(m['peak'])}   {budget}",
      "does NOT fit",
    ]
    return "\n".join(lines)
  f, lb = r["flops_per_step_per_gpu"], r["lower_bound_step_s"]
  lines += [
    f"  temporaries        {gib(m['temporaries'])}   (activations, gathered weights, gradients)",
    f"  host offloaded     {gib(m['host_offloaded'])}   (pinned host memory, not counted in the peak)",
    *(
      [
        "  (offloaded state compiled as copied to the device where the step copies it: "
        + "; ".join(
          what
          for key, what in (
            (
              "parameters_offloaded",
              "fp32 weights as the step starts, cast to the compute dtype at once, and again after the backward pass",
            ),
            ("optimizer_state_offloaded", "optimizer state after the backward pass"),
          )
          if m.get(key)
        )
        + "; its host copies are in the prediction, not overlapped)"
      ]
      if m.get("optimizer_state_offloaded") or m.get("parameters_offloaded")
      else []
    ),
    f"  peak               {gib(m['peak'])}   {budget}",
    f"compute per GPU per step: {f['model'] / 1e12:,.2f} TFLOP model, {f['traced'] / 1e12:,.2f} TFLOP traced "
    "(matmuls incl. remat recompute, ragged GEMMs over whole buffers"
    + (f"; {r['uncounted_kernels']} kernel calls without a cost estimate not counted" if r["uncounted_kernels"] else "")
    + f"); >= {r['hbm_bytes_per_step_per_gpu'] / 1e9:,.1f} GB of HBM traffic",
    f"step time >= {lb['step']:.3f} s (model FLOPs {lb['compute']:.3f} s at "
    f"{r['peak_flops'] / 1e12:.0f} TFLOP/s {r['precision_for_peak']}, "
    f"HBM {lb['memory']:.3f} s); <= {r['upper_bound_tokens_per_s_per_gpu']:,.0f} tokens/s/GPU; "
    "collectives not included",
    *(
      ["attention: cuDNN flash attention planned with a same-footprint stand-in (MaxText/flash_stand_in.py)"]
      if r["attention_stand_in"]
      else []
    ),
    *(_prediction_lines(r) if r.get("prediction") else []),
    xla_warnings.describe(r.get("involuntary_rematerializations", [])),
    "fits" if r["fits"] else "does NOT fit",
  ]
  return "\n".join(lines)


def _prediction_lines(r: dict) -> list[str]:
  from MaxText.plan import predict

  return predict.format_prediction(r["prediction"], r["num_gpus"])


@exit_on_user_error
def main(argv: list[str]) -> int:
  if not argv or any(a in ("-h", "--help") for a in argv):  # anywhere, as users type it after a recipe too
    print(__doc__ + "\n" + USAGE)
    return 0 if argv else 2
  # Validation (MaxText/validate.py): every check before a status line is printed or anything is compiled.
  args, overrides = parse_args(argv)
  from MaxText import compile_only

  if args.gpu not in compile_only.GPUS:
    raise UserError(f"--gpu {args.gpu}: unknown GPU; choose one of: {', '.join(compile_only.GPUS)}")
  per_host = min(args.num_gpus, args.gpus_per_host)
  if args.num_gpus % per_host:
    raise UserError(f"--num-gpus {args.num_gpus} is not a multiple of {per_host} GPUs per host")
  if args.json_out:
    from MaxText.convert.cli import check_writable

    check_writable(Path(args.json_out), "--json")
  use_plugin()
  from MaxText import runtime_env, validate
  from MaxText.config import load_config

  cfg = load_config(args.recipe, overrides)
  gpu_kind = compile_only.GPUS[args.gpu].name
  validate.devices(cfg, args.num_gpus, 1, "gpu", gpu_kind, where=f" on {args.num_gpus} x {args.gpu}")
  notes = runtime_env.apply(cfg.train)["notes"]  # the recipe's XLA flags and environment, before jax starts
  if args.memory_fraction is None:
    args.memory_fraction = memory_fraction_in_force()
  for note in notes:
    print(f"note: {note}", flush=True)
  print(f"planning {args.recipe} on {args.num_gpus} x {args.gpu}", flush=True)
  if args.search:  # MaxText/plan/search.py: rank configurations, compile the best few
    from MaxText.plan import search

    return search.main(cfg, args, overrides, plan, format_report)
  report = plan(cfg, args.gpu, args.num_gpus, args.gpus_per_host, args.memory_fraction, args.fabric)
  report["recipe"], report["overrides"] = args.recipe, overrides
  print(format_report(report), flush=True)
  if args.json_out:
    Path(args.json_out).write_text(json.dumps(report, indent=1))
  if not report["fits"]:
    m = report["memory"]
    what = "the step needs" if report["compiled"] else "the train state alone needs"
    print(
      f"error: does not fit: {what} {m['peak'] / 2**30:.1f} GiB per GPU, "
      f"{(m['peak'] - m['budget']) / 2**30:.1f} GiB over the "
      f"budget of {m['budget'] / 2**30:.1f} GiB ({m['memory_fraction']:.2f} x {args.gpu}); "
      "use more GPUs, more offload or remat, or a smaller batch",
      file=sys.stderr,
    )
    return EXIT_DOES_NOT_FIT
  return 0


if __name__ == "__main__":
  sys.exit(main())
