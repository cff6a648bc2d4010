"""Device profiles: where a compiled program's device time goes, by the model's named scopes.

`profiler: xplane` (train.py) records `profiler_steps` training steps after `skip_first_n_steps_for_profiler`
with jax.profiler into <run dir>/profile (open it in TensorBoard's profile plugin, XProf or Perfetto) and
writes profile_summary.md/.json there: device time per step by scope (forward and backward apart), the
longest HLO ops, and how busy the device was. `python -m MaxText.profile PROFILE_DIR` writes it again.

Attribution: every device kernel event of the trace carries the HLO instruction it ran for (stat
`hlo_op`); the compiled HLO gives that instruction's op_name, e.g.
`jit(step)/transpose(jvp(decoder))/moe/gmm/dot_general`, whose innermost known scope names the part of
the model, and `transpose(` marks the backward pass. A fusion without its own op_name takes the scope
most of its body's instructions have. Device activity without an HLO op (memcpy, ...) is "unattributed".
Times are per device: the mean over the trace's GPUs (on CPU, the host's XLA threads for all its devices).

`metrics_trace_period: N` (MetricsTracer) traces one training step in every N into a temporary directory
of the run, reads gmm_ms, dispatch_ms, device_busy_ms and graphs_ms from it (`trace_metrics`) for that
step's log line, and deletes it.
"""

import contextlib
import gzip
import json
import re
import shutil
import sys
import tempfile
import time
import weakref
from collections import defaultdict
from pathlib import Path
from typing import Callable, Mapping

# The model's named scopes (model.py, layers/, moe/, train_step.py), innermost first when they nest.
SCOPES = (
  "router",
  "permute",
  "gmm",
  "combine",
  "shared_experts",
  "ep_dispatch",
  "ep_combine",
  "mla_q",
  "mla_kv",
  "attention",
  "attention_out",
  "mlp",
  "moe",
  "embed",
  "head",
  "mtp",
  "optimizer",
)
GMM_SCOPES = ("gmm",)  # the grouped (expert) GEMM: trace_metrics' gmm_ms
DISPATCH_SCOPES = ("permute", "combine", "ep_dispatch", "ep_combine")  # moving tokens to and from experts: dispatch_ms
# A CUDA graph (XLA command buffer) is one event in a GPU trace: its kernels cannot be told apart by scope. Above
# this share of the kernel time, the summary and the step log say so.
GRAPHS_NOTE_SHARE = 0.05
HLO_FILE = "step_hlo.txt.gz"
STEPS_FILE = "profiled_steps.json"
SUMMARY = "profile_summary"


def hlo_labels(hlo_text: str, label_of: Callable[[str], str | None]) -> tuple[str, dict[str, str]]:
  """Module name and {HLO instruction: label_of(its op_name)} from compiled HLO text; an instruction
  without a label of its own (a fusion) takes the label most instructions of the computation it calls have."""
  module = re.search(r"^HloModule\s+([\w.\-]+)", hlo_text, re.M).group(1)
  own, calls, votes, current = {}, {}, defaultdict(lambda: defaultdict(int)), None
  for line in hlo_text.splitlines():
    head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if head and "=" not in line.split("{")[0]:
      current = head.group(1)
      continue
    inst = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)
    if not inst:
      continue
    name = inst.group(1)
    op_name = re.search(r'op_name="([^"]*)"', line)
    label = label_of(op_name.group(1)) if op_name else None
    if label:
      own[name] = label
      votes[current][label] += 1
    called = re.search(r"(?:calls|to_apply|body)=%?([\w.\-]+)", line)
    if called:
      calls[name] = called.group(1)
  labels = dict(own)
  for name, comp in calls.items():
    if name not in labels and votes.get(comp):
      labels[name] = max(votes[comp], key=votes[comp].get)
  return module, labels


def scope_label(op_name: str) -> str | None:
  """'fwd gmm', 'bwd attention', ...: the innermost known scope of an op_name and the pass it is in
  (the optimizer update is in neither)."""
  parts = op_name.split("/")
  for part in reversed(parts):
    name = re.sub(r"^.*\(|\)+$", "", part)  # transpose(jvp(moe)) -> moe
    if name == "optimizer":
      return name
    if name in SCOPES:
      return ("bwd " if "transpose(" in op_name else "fwd ") + name
  return None


def _hlo_op(event) -> str | None:
  stats = dict(event.stats)
  if "hlo_op" in stats:
    return str(stats["hlo_op"])
  for text in [event.name, *map(str, stats.values())]:
    found = re.search(r"hlo_op=([^,#]+)", text)
    if found:
      return found.group(1)
  return None


def device_planes(xplane_file: str, module: str) -> dict[str, list[tuple[int, int, str | None]]]:
  """{plane: (start_ns, end_ns, HLO op or None) of every device kernel of `module` on it} from a jax.profiler
  xplane file: one plane per GPU. Without GPU planes (CPU runs), XLA's op events on the host threads."""
  from jax.profiler import ProfileData

  data = ProfileData.from_file(xplane_file)
  gpu = [pl for pl in data.planes if pl.name.startswith("/device:GPU")]
  planes = gpu or [pl for pl in data.planes if pl.name.startswith("/host:CPU")]
  found = {}
  for plane in planes:
    events = found.setdefault(plane.name, [])
    lines = list(plane.lines)
    if gpu and any(line.name.startswith("Stream") for line in lines):
      lines = [line for line in lines if line.name.startswith("Stream")]  # kernels, not derived summary lines
    for line in lines:
      last_end = -1.0
      for event in sorted(line.events, key=lambda e: e.start_ns):
        op, stats = _hlo_op(event), dict(event.stats)
        if event.start_ns < last_end or str(stats.get("hlo_module", module)) != module:
          continue  # nested in an event already counted (CPU thunks nest), or another program
        if op is None and not gpu:
          continue  # host threads: only XLA's op events
        last_end = event.start_ns + event.duration_ns
        events.append((int(event.start_ns), int(last_end), op))
  found = {name: events for name, events in found.items() if events}
  if not found:
    raise RuntimeError(f"no device events of {module} in {xplane_file} (planes: {[p.name for p in data.planes]})")
  return found


def device_events(xplane_file: str, module: str) -> tuple[list[tuple[int, int, str | None]], str]:
  """(start_ns, end_ns, HLO op or None) of every device kernel of `module` in a jax.profiler xplane file, all
  planes together, and the first plane they came from (device_planes)."""
  planes = device_planes(xplane_file, module)
  return [e for events in planes.values() for e in events], next(iter(planes))


def busy_ns(events) -> int:
  """Time at least one kernel was running (streams overlap: the union of the intervals)."""
  total, end = 0, -1
  for s, e, _ in sorted(events):
    if e > end:
      total += e - max(s, end)
      end = e
  return total


def by_label(events, labels: Mapping[str, str]) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
  """Kernel nanoseconds per label and per (HLO op, label): an op without a label is "other", an event without
  an HLO op "unattributed"."""
  per_label, per_op = defaultdict(int), defaultdict(int)
  for s, e, op in events:
    label = labels.get(op, "other") if op else "unattributed"
    per_label[label] += e - s
    per_op[(op or "?", label)] += e - s
  return per_label, per_op


def is_graph(op: str) -> bool:
  """An XLA command buffer (a CUDA graph): one event for all its kernels."""
  return op.startswith("command_buffer")


def trace_metrics(planes: Mapping[str, list], labels: Mapping[str, str]) -> dict:
  """Device milliseconds in a trace, per device (the mean over `planes`, {plane: device_planes' events}):
  gmm_ms (kernels of the gmm scope), dispatch_ms (permute, combine, ep_dispatch and ep_combine), both forward
  and backward; device_busy_ms (time at least one kernel ran); kernel_ms (all kernels); graphs_ms (inside
  CUDA graphs, which gmm_ms and dispatch_ms miss)."""
  totals = defaultdict(float)
  for events in planes.values():
    per_label, per_op = by_label(events, labels)
    for label, ns in per_label.items():
      scope = label.split(" ")[-1]  # "bwd gmm" -> gmm
      totals["gmm_ms"] += ns * (scope in GMM_SCOPES)
      totals["dispatch_ms"] += ns * (scope in DISPATCH_SCOPES)
    totals["device_busy_ms"] += busy_ns(events)
    totals["kernel_ms"] += sum(per_label.values())
    totals["graphs_ms"] += sum(ns for (op, _), ns in per_op.items() if is_graph(op))
  devices = max(len(planes), 1)
  return {
    key: totals[key] / 1e6 / devices for key in ("gmm_ms", "dispatch_ms", "device_busy_ms", "kernel_ms", "graphs_ms")
  }


def graphs_hide_scopes(metrics: dict) -> bool:
  """Whether CUDA graphs took enough of trace_metrics' kernel time to say so."""
  return metrics["graphs_ms"] > GRAPHS_NOTE_SHARE * metrics["kernel_ms"]


def summarize(profile_dir: Path) -> dict:
  """Writes profile_summary.json/.md into `profile_dir` (the trace, HLO_FILE and STEPS_FILE of a StepProfiler)."""
  meta = json.loads((profile_dir / STEPS_FILE).read_text())
  steps = meta["count"]
  hlo_text = gzip.decompress((profile_dir / HLO_FILE).read_bytes()).decode()
  module, labels = hlo_labels(hlo_text, scope_label)
  files = sorted(profile_dir.rglob("*.xplane.pb"))
  if not files:
    raise FileNotFoundError(f"no *.xplane.pb under {profile_dir}")
  planes = device_planes(str(files[-1]), module)
  per_device = len(planes) * steps
  per_label, per_op = by_label([e for events in planes.values() for e in events], labels)
  per_label = {label: ns / 1e6 / per_device for label, ns in per_label.items()}
  per_op = {key: ns / 1e6 / per_device for key, ns in per_op.items()}
  metrics = trace_metrics(planes, labels)
  summary = {
    "module": module,
    "plane": next(iter(planes)),
    "devices": len(planes),
    "steps": steps,
    "device_busy_ms_per_step": metrics["device_busy_ms"] / steps,
    "kernel_ms_per_step": metrics["kernel_ms"] / steps,
    "gmm_ms_per_step": metrics["gmm_ms"] / steps,
    "dispatch_ms_per_step": metrics["dispatch_ms"] / steps,
    # A CUDA graph (XLA command buffer) is one event in the trace: its kernels cannot be told apart.
    "command_buffer_ms_per_step": metrics["graphs_ms"] / steps,
    "step_ms_measured": 1e3 * meta["seconds_per_step"] if meta.get("seconds_per_step") else None,
    "by_scope_ms": dict(sorted(per_label.items(), key=lambda kv: -kv[1])),
    "top_ops": [[op, label, ms] for (op, label), ms in sorted(per_op.items(), key=lambda kv: -kv[1])[:25]],
  }
  (profile_dir / f"{SUMMARY}.json").write_text(json.dumps(summary, indent=1))
  (profile_dir / f"{SUMMARY}.md").write_text(render(summary))
  return summary


def render(summary: dict) -> str:
  kernel_ms = summary["kernel_ms_per_step"] or 1.0
  measured = f", measured step {summary['step_ms_measured']:.1f} ms" if summary["step_ms_measured"] else ""
  devices = summary.get("devices", 1)
  where = summary["plane"] if devices == 1 else f"per device, the mean over {devices} devices"
  lines = [
    f"# Device time per step ({summary['steps']} steps of {summary['module']}, {where})",
    "",
    f"Kernels {summary['kernel_ms_per_step']:.2f} ms, "
    f"device busy {summary['device_busy_ms_per_step']:.2f} ms{measured}; "
    f"grouped GEMM {summary.get('gmm_ms_per_step', 0):.2f} ms, "
    f"dispatch/combine {summary.get('dispatch_ms_per_step', 0):.2f} ms.",
    "",
    "| scope | ms/step | share of kernel time |",
    "|---|---|---|",
  ]
  if summary.get("command_buffer_ms_per_step", 0) > GRAPHS_NOTE_SHARE * kernel_ms:
    lines[3:3] = [
      f"{summary['command_buffer_ms_per_step']:.1f} ms/step ran inside CUDA graphs (XLA command buffers) and count as "
      "'other': add no_command_buffers to xla_flag_presets to see them by scope.",
      "",
    ]
  lines += [f"| {label} | {ms:.2f} | {100 * ms / kernel_ms:.1f}% |" for label, ms in summary["by_scope_ms"].items()]
  lines += ["", "Longest HLO ops:", "", "| op | scope | ms/step |", "|---|---|---|"]
  lines += [f"| {op} | {label} | {ms:.3f} |" for op, label, ms in summary["top_ops"]]
  return "\n".join(lines) + "\n"


class StepProfiler:
  """Traces steps [first, first + count) of a training loop into `directory`, then summarises them."""

  def __init__(self, directory: Path, first: int, count: int, hlo_text: str):
    self.directory, self.first, self.count, self.started_at = directory, first, count, None
    directory.mkdir(parents=True, exist_ok=True)
    (directory / HLO_FILE).write_bytes(gzip.compress(hlo_text.encode()))
    self._meta = {"first": first, "count": count}
    (directory / STEPS_FILE).write_text(json.dumps(self._meta))

  def before(self, step: int, state) -> None:
    import jax

    if step == self.first:
      jax.block_until_ready(state)  # the trace holds these steps only
      jax.profiler.start_trace(str(self.directory))
      self.started_at = time.perf_counter()

  def after(self, step: int, state) -> dict | None:
    """The summary once the last profiled step is done, else None."""
    import jax

    if self.started_at is None or step != self.first + self.count - 1:
      return None
    jax.block_until_ready(state)
    self._meta["seconds_per_step"] = (
      time.perf_counter() - self.started_at
    ) / self.count  # with the profiler's overhead
    self.started_at = None
    jax.profiler.stop_trace()
    (self.directory / STEPS_FILE).write_text(json.dumps(self._meta))
    summary = summarize(self.directory)
    print(f"profile of steps {self.first}-{step}: {self.directory / (SUMMARY + '.md')}", flush=True)
    if summary["command_buffer_ms_per_step"] > GRAPHS_NOTE_SHARE * summary["kernel_ms_per_step"]:
      print(
        f"  {summary['command_buffer_ms_per_step']:.1f} ms/step inside CUDA graphs cannot be split by scope: "
        "add no_command_buffers to xla_flag_presets",
        flush=True,
      )
    for label, ms in list(summary["by_scope_ms"].items())[:12]:
      print(f"  {label:24s} {ms:9.2f} ms/step", flush=True)
    return summary


class MetricsTracer:
  """metrics_trace_period: traces one training step in every `period` (the steps where (step - start) % period
  is period - 1, not among the session's first two, which compile and warm up, and not in `avoid`: the
  profiler=xplane window and the step after it, as jax.profiler traces one thing at a time) into a temporary
  directory under `run_dir`, and turns it into that step's trace_metrics, then deletes it.

  Only an `active` tracer (process 0) traces; every process knows which steps are traced (`wants`)."""

  def __init__(self, run_dir: Path, period: int, start: int, avoid: range = range(0), active: bool = True):
    self.run_dir, self.period, self.start, self.avoid, self.active = run_dir, period, start, avoid, active
    self.directory: Path | None = None  # the trace in progress
    self.cost_s = 0.0  # host seconds of the trace in progress so far
    self.noted = False  # the CUDA graphs note is printed once per run
    self._labels = weakref.WeakKeyDictionary()  # compiled step -> (HLO module, hlo_labels), computed once each

  def wants(self, step: int) -> bool:
    offset = step - self.start
    return self.period > 0 and offset >= 2 and offset % self.period == self.period - 1 and step not in self.avoid

  def before(self, step: int, state) -> None:
    """Starts the trace of a step it wants (after the step before has run)."""
    import jax

    if not (self.active and self.wants(step)):
      return
    jax.block_until_ready(state)
    began = time.perf_counter()
    self.directory = Path(tempfile.mkdtemp(prefix=".metrics_trace-", dir=self.run_dir))
    jax.profiler.start_trace(str(self.directory))
    self.cost_s = time.perf_counter() - began

  def after(self, step: int, state, compiled) -> dict | None:
    """Once the traced step has run: its trace_metrics (none if the trace could not be read), `metrics_trace_s`
    (host seconds spent starting, stopping and reading the trace) and `traced`: 1; None for a step not traced."""
    import jax

    if self.directory is None:
      return None
    jax.block_until_ready(state)
    began = time.perf_counter()
    try:
      jax.profiler.stop_trace()
      if compiled not in self._labels:
        self._labels[compiled] = hlo_labels(compiled.as_text(), scope_label)
      module, labels = self._labels[compiled]
      files = sorted(self.directory.rglob("*.xplane.pb"))
      if not files:
        raise FileNotFoundError(f"no *.xplane.pb under {self.directory}")
      metrics = trace_metrics(device_planes(str(files[-1]), module), labels)
    except (RuntimeError, OSError) as e:  # no device events (no CUPTI, say): training goes on without them
      self.active = False
      print(
        f"note: metrics_trace_period: the trace of step {step} could not be read ({e}); tracing stopped", flush=True
      )
      metrics = {}
    finally:
      shutil.rmtree(self.directory, ignore_errors=True)
      self.directory = None
    metrics["metrics_trace_s"] = self.cost_s + time.perf_counter() - began
    if metrics and graphs_hide_scopes(metrics) and not self.noted:
      self.noted = True
      print(
        f"note: step {step}: {metrics['graphs_ms']:.1f} of {metrics['kernel_ms']:.1f} ms of kernels ran inside CUDA "
        "graphs (XLA command buffers), which gmm and dispatch exclude; add no_command_buffers to xla_flag_presets "
        "for exact numbers",
        flush=True,
      )
    return {**metrics, "traced": 1}

  def close(self) -> None:
    """Ends a trace left running (the loop stopped inside a traced step) and deletes it."""
    import jax

    if self.directory is None:
      return
    with contextlib.suppress(Exception):
      jax.profiler.stop_trace()
    shutil.rmtree(self.directory, ignore_errors=True)
    self.directory = None


def main(argv: list[str]) -> int:
  if len(argv) != 1 or not all((Path(argv[0]) / f).exists() for f in (HLO_FILE, STEPS_FILE)):
    print(
      f"usage: python -m MaxText.profile PROFILE_DIR  (a run's profile directory, written by profiler=xplane: "
      f"it holds {HLO_FILE}, {STEPS_FILE} and the trace)",
      file=sys.stderr,
    )
    return 2
  print(render(summarize(Path(argv[0]))))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
