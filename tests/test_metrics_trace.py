"""metrics_trace_period: a short trace of one step in every N gives that step's grouped-GEMM, dispatch/combine and
device-busy time in the step log, metrics.jsonl and TensorBoard."""

import json
import statistics

from test_profile import SMALL

from MaxText import profile
from MaxText.metrics import format_line
from MaxText.train import TRACE_KEYS, train

MS = 1_000_000  # ns
ONE_MOE_LAYER = ("base_num_decoder_layers=2", "mtp_num_layers=0")  # a dense then a MoE layer: a quicker compile


def test_trace_metrics_of_known_events():
  labels = {"gmm.1": "fwd gmm", "gmm.2": "bwd gmm", "sort.3": "bwd permute", "a2a.4": "fwd ep_combine"}
  labels |= {"dot.5": "fwd attention", "gather.6": "fwd combine"}
  planes = {
    "/device:GPU:0": [
      (0, 2 * MS, "gmm.1"),
      (1 * MS, 4 * MS, "gmm.2"),  # on another stream, overlapping the first
      (4 * MS, 5 * MS, "sort.3"),
      (5 * MS, 5 * MS + MS // 2, "a2a.4"),
      (6 * MS, 7 * MS, "dot.5"),
      (8 * MS, 10 * MS, "command_buffer.7"),  # a CUDA graph: one event, no scope
      (10 * MS, 10 * MS + MS // 2, None),  # no HLO op (a memcpy)
    ],
    "/device:GPU:1": [(0, 1 * MS, "gmm.1"), (1 * MS, 2 * MS, "gather.6")],
  }
  # GPU 0: gmm 5, dispatch 1.5, kernels 10, busy 5.5 + 1 + 2.5 = 9, graphs 2; GPU 1: 1, 1, 2, 2, 0. Per device:
  metrics = profile.trace_metrics(planes, labels)
  assert metrics == {"gmm_ms": 3.0, "dispatch_ms": 1.25, "device_busy_ms": 5.5, "kernel_ms": 6.0, "graphs_ms": 1.0}
  assert profile.graphs_hide_scopes(metrics)
  assert not profile.graphs_hide_scopes(profile.trace_metrics({"cpu": planes["/device:GPU:1"]}, labels))


def test_traced_steps_of_a_session():
  def traced(period, start=0, avoid=range(0), steps=12):
    tracer = profile.MetricsTracer(None, period, start, avoid)
    return [s for s in range(start, start + steps) if tracer.wants(s)]

  assert traced(3) == [2, 5, 8, 11]
  assert traced(3, start=100) == [102, 105, 108, 111]  # a resumed session skips its own first two steps
  assert traced(1, steps=5) == [2, 3, 4]
  assert traced(3, avoid=range(4, 7)) == [2, 8, 11]  # not in the profiler window nor the step after it
  assert traced(0) == []


def test_step_line_shows_the_trace():
  m = {"loss": 1.0, "learning_rate": 1e-3, "grad_norm": 0.5, "step_time_s": 0.1, "tokens_per_s_per_device": 10.0}
  m |= {"tflops_per_device": 1.0, "mfu": None, "expert_load_max": 3, "expert_load_mean": 2.0}
  assert "gmm" not in format_line(3, m) and "traced" not in format_line(3, m)
  line = format_line(3, {**m, "gmm_ms": 12.34, "dispatch_ms": 5.67, "traced": 1})
  assert "| gmm 12.3 ms | dispatch 5.7 ms |" in line and line.endswith("| traced (time not representative)")


def test_traced_steps_carry_device_times(tiny_config, tmp_path, capsys):
  cfg = tiny_config(
    *SMALL,
    *ONE_MOE_LAYER,
    "steps=8",
    "metrics_trace_period=3",
    "log_period=100",
    f"base_output_directory={tmp_path}",
    "run_name=t",
  )
  history = train(cfg)
  assert [h["step"] for h in history if h.get("traced")] == [2, 5]
  for h in history:
    if h["step"] in (2, 5):
      assert h["gmm_ms"] > 0 and h["dispatch_ms"] > 0 and h["device_busy_ms"] > 0, h
      assert h["metrics_trace_s"] > 0 and h["graphs_ms"] == 0  # no CUDA graphs on the CPU
    else:
      assert not set(TRACE_KEYS) & set(h), h

  run = tmp_path / "t"
  assert not [p.name for p in run.iterdir() if p.name.startswith(".metrics_trace")]
  assert not list(run.rglob("*.xplane.pb")), "the trace is deleted once read"
  rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [0, 2, 5, 7]  # traced steps are logged whatever log_period says
  assert all(set(TRACE_KEYS) <= set(r) and r["traced"] == 1 for r in rows if r["step"] in (2, 5))
  summary = json.loads((run / "summary.json").read_text())
  steady = [h["step_time_s"] for h in history if h["step"] in (3, 4, 6, 7)]
  assert summary["median_step_time_s"] == statistics.median(steady)  # traced steps are left out
  assert summary["median_gmm_ms"] == statistics.median(h["gmm_ms"] for h in history if h.get("traced"))
  out = capsys.readouterr().out
  assert out.count("traced (time not representative)") == 2 and "CUDA graphs" not in out


def test_no_trace_by_default(tiny_config, tmp_path):
  cfg = tiny_config(
    *SMALL, *ONE_MOE_LAYER, "steps=3", "log_period=1", f"base_output_directory={tmp_path}", "run_name=t"
  )
  assert cfg.train.metrics_trace_period == 0
  history = train(cfg)
  rows = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
  assert len(rows) == 3
  for row in [*history, *rows]:
    assert not (set(TRACE_KEYS) | {"traced"}) & set(row), row
  assert not any(
    key.startswith(("median_gmm", "median_metrics_trace"))
    for key in json.loads((tmp_path / "t" / "summary.json").read_text())
  )
