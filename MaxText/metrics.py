"""The per-step log: one printed line, one JSON line in metrics.jsonl, TensorBoard scalars."""

import json
import math
import sys
import time
from pathlib import Path


def format_line(step: int, m: dict) -> str:
  mfu = f"{100 * m['mfu']:.1f}%" if m.get("mfu") is not None else "-"
  parts = [
    f"step {step:>5d}",
    f"loss {m['loss']:.4f}",
    f"lr {m['learning_rate']:.3e}",
    f"gnorm {m['grad_norm']:.3f}",
    f"{m['step_time_s'] * 1000:.1f} ms",
    f"{m['tokens_per_s_per_device']:,.0f} tok/s/dev",
    f"{m['tflops_per_device']:.2f} TFLOP/s/dev",
    f"MFU {mfu}",
    f"experts max/mean {m['expert_load_max']:.0f}/{m['expert_load_mean']:.1f}",
  ]
  if m.get("data_wait_s") is not None:  # the loop blocked this long on the data iterator for this step's batch
    parts.insert(5, f"data {m['data_wait_s'] * 1000:.1f} ms")
  if m.get("batch_size"):
    parts.insert(1, f"batch {m['batch_size']}")
  if m.get("mtp_loss"):
    parts.append(f"mtp {m['mtp_loss']:.4f}")
  if m.get("dropped_tokens"):
    parts.append(f"dropped {m['dropped_tokens']}")
  if m.get("ep_sent_bytes_nodedup"):
    parts.append(f"ep sent {m['ep_sent_bytes'] / 2**20:,.1f} MiB (no dedup {m['ep_sent_bytes_nodedup'] / 2**20:,.1f})")
  if m.get("ep_overflow"):
    parts.append(f"EP OVERFLOW {m['ep_overflow']}")
  if m.get("gmm_ms") is not None:  # metrics_trace_period: device time from a trace of this step
    parts.append(f"gmm {m['gmm_ms']:.1f} ms")
    parts.append(f"dispatch {m['dispatch_ms']:.1f} ms")
  if m.get("profiled"):
    parts.append("profiling (time not representative)")
  if m.get("traced"):
    parts.append("traced (time not representative)")
  if m.get("compiled"):
    parts.append("compiled first (time not representative)")
  return " | ".join(parts)


class StepClock:
  """When each training step finished, as the host sees it, for the per-step time.

  The loop fetches a step's metrics one step late, after dispatching the next, so the device never waits
  for the host; the fetch is usually when the host learns that the step is done. But when dispatching a
  step blocks until the step has run (XLA reads a loop's trip count on the host, as in mxfp8 block_scaled's
  row windows), the step is done when its dispatch returns, and timing it at its fetch would charge it the
  following step's time and leave the last step nearly none. So a step whose metrics are ready as its
  dispatch returns is timed there."""

  def __init__(self):
    self.last = time.perf_counter()
    self.finished: dict[int, float] = {}

  def dispatched(self, step: int, metrics) -> None:
    if all(leaf.is_ready() for leaf in metrics.values()):
      self.finished[step] = time.perf_counter()

  def step_time(self, step: int) -> float:
    """Seconds from the previous step's end to this one's; call once this step's metrics have been fetched."""
    end = self.finished.pop(step) if step in self.finished else time.perf_counter()
    elapsed, self.last = end - self.last, end
    return elapsed


class MetricsWriter:
  """Prints each logged step; with `files` (process 0 of a multi-process run) also writes metrics.jsonl and
  TensorBoard."""

  def __init__(self, run_dir: Path, tensorboard: bool, files: bool = True):
    self.jsonl = open(run_dir / "metrics.jsonl", "a") if files else None
    self.tb = None
    if tensorboard and files:
      from tensorboardX import SummaryWriter

      self.tb = SummaryWriter(str(run_dir / "tensorboard"))

  def write(self, step: int, m: dict) -> None:
    print(format_line(step, m), flush=True)
    if self.jsonl is not None:
      self.jsonl.write(json.dumps({"step": step, **m}) + "\n")
    if self.tb is not None:
      for key, value in m.items():
        if isinstance(value, (int, float)) and value is not None and math.isfinite(value):
          self.tb.add_scalar(key, value, step)

  def flush(self) -> None:
    if self.jsonl is not None:
      self.jsonl.flush()
    if self.tb is not None:
      self.tb.flush()
    sys.stdout.flush()

  def close(self) -> None:
    self.flush()
    if self.jsonl is not None:
      self.jsonl.close()
    if self.tb is not None:
      self.tb.close()
