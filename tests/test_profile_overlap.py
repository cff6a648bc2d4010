"""The offload benchmark's profile reading (benchmarks/remat_offload.py): copy/kernel overlap from a trace."""

import importlib.util

import pytest

from conftest import REPO

_spec = importlib.util.spec_from_file_location("remat_offload", REPO / "benchmarks" / "remat_offload.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _meta(pid, tid=None, name=""):
  if tid is None:
    return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
  return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def _x(pid, tid, name, ts, dur):
  return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}


@pytest.mark.parametrize(
  "name, kind",
  [
    ("MemcpyD2H", "d2h"),
    ("Memcpy DtoH (Device -> Pinned)", "d2h"),
    ("MemcpyH2D", "h2d"),
    ("Memcpy HtoD (Pinned -> Device)", "h2d"),
    ("MemcpyD2D", "other"),
    ("Memset", "other"),
    ("loop_multiply_fusion", None),
    ("ragged_dot_mgpu_kernel", None),
  ],
)
def test_copy_direction(name, kind):
  assert bench.copy_direction(name) == kind


def test_overlap_counts_only_stream_lines_and_the_time_under_kernels():
  events = [
    _meta(1, name="/device:GPU:0"),
    _meta(1, 10, "Stream #13(Compute)"),
    _meta(1, 11, "Stream #20(MemcpyD2H)"),
    _meta(1, 12, "XLA Modules"),
    _meta(2, name="/host:CPU"),
    _meta(2, 1, "python"),
    _x(1, 10, "fusion_a", 0, 100),
    _x(1, 10, "fusion_b", 150, 50),  # kernels cover [0,100) and [150,200)
    _x(1, 11, "MemcpyD2H", 50, 100),  # [50,150): 50 under kernels
    _x(1, 11, "MemcpyH2D", 210, 10),  # after all kernels: exposed
    _x(1, 12, "jit_step", 0, 1000),  # a derived line: ignored
    _x(2, 1, "MemcpyD2H", 0, 1000),  # host events: ignored
  ]
  s = bench.overlap_summary(events)
  d2h, h2d = s["/device:GPU:0 d2h"], s["/device:GPU:0 h2d"]
  assert d2h["copies"] == 1 and d2h["copy_ms"] == pytest.approx(0.1) and d2h["overlap_fraction"] == pytest.approx(0.5)
  assert h2d["overlap_fraction"] == 0 and h2d["exposed_ms"] == pytest.approx(0.01)
  assert s["/device:GPU:0 kernel_busy_ms"] == pytest.approx(0.15)
