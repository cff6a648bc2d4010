"""benchmarks/data_loader.py --tiny: the whole benchmark (corpus, tokenizer, the pretokenize command, both
loader modes, the comparison with the GPU host) at tiny shapes; checks what it counted, never how fast."""

import json
import os
import subprocess
import sys

import numpy as np

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import data_loader  # noqa: E402


def test_corpus_is_deterministic_and_natural_ish():
  a, b = data_loader.corpus_documents(3, 30), data_loader.corpus_documents(3, 30)
  assert a == b and a != data_loader.corpus_documents(4, 30)
  words = " ".join(a).replace(",", "").replace(".", "").replace("?", "").lower().split()
  counts = np.array(sorted(np.unique(words, return_counts=True)[1], reverse=True))
  assert counts[0] > 10 * counts[len(counts) // 2]  # Zipf: a few words are very frequent
  assert all(d[0].isupper() and d[-1] in ".?" for d in a)  # sentences


def test_data_loader_benchmark_tiny(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  proc = subprocess.run(
    [sys.executable, "benchmarks/data_loader.py", "--tiny", "--out", str(tmp_path), "--pretokenize-workers", "2"],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  r = json.loads((tmp_path / "data_loader.json").read_text())
  assert not (tmp_path / "work").exists()  # corpus, tokenizer and shards are removed unless --keep-work
  tiny = data_loader.TINY
  rows, seq = tiny["rows_per_gpu"] * tiny["gpus"], tiny["seq_len"]
  assert r["tiny"] and r["batch"] == {"rows": rows, "seq_len": seq, "rows_per_gpu": 2, "gpus_per_host": 2}
  assert r["corpus"]["documents"] == tiny["documents"] and r["corpus"]["bytes"] > 0
  assert r["pretokenize"]["documents"] == tiny["documents"] and r["pretokenize"]["tokens"] > tiny["documents"]
  assert r["pretokenize"]["summary_line"].startswith(f"pretokenized {tiny['documents']} documents into 2 shards")
  assert set(r["modes"]) == {"pretokenized", "on_the_fly"}
  for mode in r["modes"].values():
    assert mode["batch_shape"] == [rows, seq] and mode["batches_timed"] == tiny["batches"]
    assert mode["tokens"] == tiny["batches"] * rows * seq  # every delivered position counted
    assert 0 < mode["real_tokens"] <= mode["tokens"]
    assert len(mode["batch_seconds"]) == tiny["batches"] and all(s > 0 for s in mode["batch_seconds"])
    assert mode["tokens_per_s"] == rows * seq / mode["median_batch_s"]
    assert mode["read_threads"] >= 1
  gpu = r["gpu_host"]
  assert gpu["variant"] == "b4m" and gpu["gpus_per_host"] == 2
  assert gpu["host_tokens_per_s"] == 2 * gpu["tokens_per_s_per_gpu"] and gpu["tokens_per_s_per_gpu"] > 20000
  for name, c in r["comparison"].items():
    assert c["loader_over_host_consumption"] == r["modes"][name]["tokens_per_s"] / gpu["host_tokens_per_s"]
  m = r["machine"]
  assert m["cpu_count"] >= 1 and m["versions"]["grain"] and len(m["loadavg_start"]) == 3
