"""The grain pipeline's throughput on this host's CPUs against what one GPU host's training consumes.

  python benchmarks/data_loader.py --out DIR [--documents 20000] [--batches 15] [--warmup 3]
  python benchmarks/data_loader.py --out DIR --tiny    # seconds: tiny shapes and corpus (the test's mode)

Everything is made here, deterministically, nothing downloaded:
  corpus     --documents synthetic English-like documents (corpus_documents): a 30k-word lexicon of
             pronounceable words whose frequencies follow Zipf's law (short words frequent), sentences of
             geometric length, documents of log-normal length (median ~350 words), written as JSON lines
  tokenizer  a byte-level BPE (Hugging Face `tokenizers`) trained on the corpus's first documents, with
             the recipe's vocab_size (32768 for the proxy), <s>/</s> as BOS/EOS
  shards     the corpus pre-tokenized by the real command (python -m MaxText.data.pretokenize); its
             wall time and tokens/s are recorded too

Then the training pipeline (MaxText/data/pipeline.py, as train.py builds it) delivers batches of the
recipe's shape for one host: per_device_batch_size x --gpus-per-host rows of max_target_length tokens
(the optimized proxy recipe: 32 x 4096), packed, shuffled, in two modes:
  pretokenized  the shards: grain_file_type=arrayrecord tokenize_train_data=false
  on_the_fly    the JSON lines, tokenized as they are read
Each mode: --warmup batches untimed (threads started, buffers filled), then --batches timed one by one;
tokens/s = rows x seq_len / the median batch time (what the GPUs consume: padding included), also the
mean over all timed batches and the real (non-padding) tokens/s.

The GPU side: --gpu-result's variant (default: the optimized 1-GPU proxy on an H200,
benchmarks/results/2026-12-03-h200-proxy-b4, b4m: 23,661 tokens/s per GPU, 692 ms a step) times
--gpus-per-host = what one 8-GPU host consumes. The JSON says how many times faster the loader is, and
its median batch time against the GPU step time.

Writes DIR/data_loader.json (machine, versions, corpus, pretokenize, per-mode timings, comparison)
and keeps the corpus, tokenizer and shards in DIR/work (--keep-work; removed by default).
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from datetime import date
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from MaxText.config import load_config  # noqa: E402
from MaxText.data import pipeline  # noqa: E402

DEFAULT_RECIPE = REPO / "recipes" / "deepseek_v3_proxy_1gpu" / "optimized.yml"
DEFAULT_GPU_RESULT = REPO / "benchmarks" / "results" / "2026-12-03-h200-proxy-b4" / "proxy_fused.json"
TINY = dict(documents=120, batches=3, warmup=1, rows_per_gpu=2, gpus=2, seq_len=256, vocab=600, files=2)

# ---- the corpus ----
ONSETS = "b c d f g h j k l m n p r s t v w y z br ch cl cr dr fl gr pl pr sh sl st th tr wh".split() + [""] * 6
VOWELS = "a e i o u a e i o u ai ea ee ie oo ou".split()
CODAS = [""] * 8 + "n r s t l d nd st ng ck rt m".split()
LEXICON_WORDS = 30000
ZIPF_EXPONENT = 1.07  # English word frequencies: rank^-1.07 or so
MEDIAN_DOCUMENT_WORDS = 350
MEAN_SENTENCE_WORDS = 14


def lexicon(rng: np.random.Generator, n: int) -> list[str]:
  """n distinct pronounceable words of 1-4 syllables, shortest first (so that frequent words are short)."""
  words, seen = [], set()
  while len(words) < n:
    m = 2 * n
    syllables = np.minimum(rng.geometric(0.5, m), 4)
    onset = rng.integers(0, len(ONSETS), (m, 4))
    vowel = rng.integers(0, len(VOWELS), (m, 4))
    coda = rng.integers(0, len(CODAS), m)
    for i in range(m):
      w = "".join(ONSETS[onset[i, j]] + VOWELS[vowel[i, j]] for j in range(syllables[i])) + CODAS[coda[i]]
      if w not in seen:
        seen.add(w)
        words.append(w)
        if len(words) == n:
          break
  return sorted(words, key=len)


def corpus_documents(seed: int, n: int) -> list[str]:
  """n synthetic English-like documents, a pure function of (seed, n)."""
  rng = np.random.default_rng(seed)
  words = lexicon(rng, LEXICON_WORDS)
  cdf = np.cumsum(1.0 / np.arange(1, LEXICON_WORDS + 1) ** ZIPF_EXPONENT)
  cdf /= cdf[-1]
  lengths = np.clip(rng.lognormal(np.log(MEDIAN_DOCUMENT_WORDS), 0.9, n).astype(int), 20, 20000)
  docs = []
  for length in lengths:
    picked = [words[i] for i in np.searchsorted(cdf, rng.random(length))]
    sentence_lengths = rng.geometric(1 / MEAN_SENTENCE_WORDS, length)
    sentences, at = [], 0
    for k in sentence_lengths:
      if at >= length:
        break
      sentence = picked[at : at + int(k)]
      at += int(k)
      comma = int(rng.integers(0, 2 * len(sentence)))  # about half the sentences get a comma
      if 0 < comma < len(sentence) - 1:
        sentence[comma] += ","
      sentences.append(" ".join(sentence).capitalize() + ("?" if rng.random() < 0.08 else "."))
    docs.append(" ".join(sentences))
  return docs


def train_tokenizer(docs: list[str], vocab_size: int, out_dir: Path) -> Path:
  """A byte-level BPE tokenizer.json (+ tokenizer_config.json naming BOS/EOS) trained on docs."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=["<unk>", "<s>", "</s>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(docs, trainer)
  out_dir.mkdir(parents=True, exist_ok=True)
  tok.save(str(out_dir / "tokenizer.json"))
  (out_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
  return out_dir / "tokenizer.json"


# ---- the measurement ----
def time_batches(it, warmup: int, batches: int) -> dict:
  for _ in range(warmup):
    next(it)
  seconds, real = [], 0
  shape = None
  for _ in range(batches):
    t = time.perf_counter()
    batch = next(it)
    seconds.append(time.perf_counter() - t)
    shape = batch.inputs.shape
    real += int(batch.mask.sum())
  rows, seq = shape
  per_batch = rows * seq
  median = statistics.median(seconds)
  return {
    "batch_shape": [rows, seq],
    "batches_timed": batches,
    "warmup_batches": warmup,
    "tokens": per_batch * batches,
    "real_tokens": real,
    "batch_seconds": seconds,
    "median_batch_s": median,
    "tokens_per_s": per_batch / median,
    "mean_tokens_per_s": per_batch * batches / sum(seconds),
    "real_tokens_per_s": real / sum(seconds),
    "padding_fraction": 1 - real / (per_batch * batches),
  }


def measure_mode(recipe: Path, overrides: list[str], local_batch: int, seq_len: int, vocab: int, args) -> dict:
  cfg = load_config(recipe, overrides)
  it = pipeline.make_iterator(
    cfg.data, local_batch=local_batch, seq_len=seq_len, vocab_size=vocab, read_threads=args.read_threads
  )
  threads = pipeline.read_options(args.read_threads).num_threads
  return {"overrides": overrides, "read_threads": threads, **time_batches(it, args.warmup, args.batches)}


def machine() -> dict:
  model = ""
  if Path("/proc/cpuinfo").exists():
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        model = line.split(":", 1)[1].strip()
        break
  versions = {}
  for pkg in ("grain", "array_record", "tokenizers", "numpy", "protobuf", "jax"):
    try:
      versions[pkg] = metadata.version(pkg)
    except metadata.PackageNotFoundError:
      versions[pkg] = None
  return {
    "date": date.today().isoformat(),
    "cpu_model": model,
    "cpu_count": os.cpu_count(),
    "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    "python": platform.python_version(),
    "platform": platform.platform(),
    "versions": versions,
  }


def gpu_consumption(path: Path, variant: str, gpus: int) -> dict:
  result = json.loads(path.read_text())
  summary = result["variants"][variant]["summary"]
  per_gpu = summary["median_tokens_per_s_per_device"]
  return {
    "source": str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path),
    "variant": variant,
    "device": result["machine"].get("device") or result["machine"].get("device_kind"),  # results/ has device_kind
    "tokens_per_s_per_gpu": per_gpu,
    "step_s": summary["median_step_time_s"],
    "gpus_per_host": gpus,
    "host_tokens_per_s": per_gpu * gpus,
  }


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True, type=Path)
  ap.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE)
  ap.add_argument("--gpu-result", type=Path, default=DEFAULT_GPU_RESULT)
  ap.add_argument("--gpu-variant", default="b4m")
  ap.add_argument("--gpus-per-host", type=int, default=8)
  ap.add_argument("--documents", type=int, default=20000)
  ap.add_argument("--corpus-files", type=int, default=8)
  ap.add_argument("--tokenizer-training-documents", type=int, default=4000)
  ap.add_argument("--batches", type=int, default=15)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--shards", type=int, default=16)
  ap.add_argument("--pretokenize-workers", type=int, default=os.cpu_count() or 1)
  ap.add_argument("--read-threads", type=int, default=None)  # None: the pipeline's default (one a core, <= 16)
  ap.add_argument("--modes", default="pretokenized,on_the_fly")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--tiny", action="store_true")
  ap.add_argument("--keep-work", action="store_true")
  args = ap.parse_args(argv)

  model_cfg = load_config(args.recipe, [])
  rows_per_gpu, seq_len, vocab = (
    model_cfg.train.per_device_batch_size,
    model_cfg.train.max_target_length,
    model_cfg.model.vocab_size,
  )
  gpus = args.gpus_per_host
  if args.tiny:
    args.documents, args.batches, args.warmup, args.corpus_files = (
      TINY[k] for k in ("documents", "batches", "warmup", "files")
    )
    args.tokenizer_training_documents, args.shards = TINY["documents"], 2
    rows_per_gpu, gpus, seq_len, vocab = TINY["rows_per_gpu"], TINY["gpus"], TINY["seq_len"], TINY["vocab"]
  local_batch = rows_per_gpu * gpus
  work = args.out / "work"
  if work.exists():
    shutil.rmtree(work)
  (work / "corpus").mkdir(parents=True)
  load_start = os.getloadavg()

  t = time.perf_counter()
  docs = corpus_documents(args.seed, args.documents)
  per_file = -(-len(docs) // args.corpus_files)
  for i in range(args.corpus_files):
    with open(work / "corpus" / f"part-{i:03d}.jsonl", "w") as f:
      f.writelines(json.dumps({"text": d}) + "\n" for d in docs[i * per_file : (i + 1) * per_file])
  corpus = {
    "documents": len(docs),
    "files": args.corpus_files,
    "bytes": sum(p.stat().st_size for p in (work / "corpus").iterdir()),
    "words": sum(d.count(" ") + 1 for d in docs),
    "seed": args.seed,
    "make_s": time.perf_counter() - t,
  }
  print(f"corpus: {corpus['documents']:,} documents, {corpus['bytes'] / 1e6:.1f} MB", flush=True)

  t = time.perf_counter()
  tokenizer = train_tokenizer(docs[: args.tokenizer_training_documents], vocab, work / "tokenizer")
  tokenizer_s = time.perf_counter() - t
  print(f"tokenizer: byte-level BPE, {vocab} tokens, trained in {tokenizer_s:.1f} s", flush=True)

  shards = work / "shards"
  cmd = [
    sys.executable,
    "-m",
    "MaxText.data.pretokenize",
    "--input",
    str(work / "corpus" / "*.jsonl"),
    "--tokenizer",
    str(tokenizer),
    "--tokenizer-type",
    "huggingface",
    "--output",
    str(shards),
    "--shards",
    str(args.shards),
    "--workers",
    str(args.pretokenize_workers),
    "--progress-seconds",
    "5",
  ]
  t = time.perf_counter()
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
  pretokenize_s = time.perf_counter() - t
  if proc.returncode != 0:
    sys.stderr.write(proc.stdout + proc.stderr)
    return 1
  manifest = json.loads((shards / "manifest.json").read_text())
  pretokenize = {
    "command": " ".join(cmd[1:]).replace(str(args.out), "OUT"),
    "workers": args.pretokenize_workers,
    "shards": args.shards,
    "documents": manifest["documents"],
    "tokens": manifest["tokens"],
    "wall_s": pretokenize_s,
    "tokens_per_s": manifest["tokens"] / pretokenize_s,
    "summary_line": next(line for line in proc.stdout.splitlines() if line.startswith("pretokenized")),
    "output": [line.replace(str(args.out), "OUT") for line in proc.stdout.splitlines()],
  }
  print(pretokenize["summary_line"], flush=True)

  common = [f"vocab_size={vocab}", "attention=dot_product", "packing=true", "enable_data_shuffling=true"]
  mode_keys = {
    "pretokenized": [
      "dataset_type=grain",
      "grain_file_type=arrayrecord",
      f"grain_train_files={shards}/*.array_record",
      "train_data_columns=tokens",
      "tokenize_train_data=false",
    ],
    "on_the_fly": [
      "dataset_type=grain",
      "grain_file_type=jsonl",
      f"grain_train_files={work / 'corpus'}/*.jsonl",
      "train_data_columns=text",
      "tokenizer_type=huggingface",
      f"tokenizer_path={tokenizer}",
    ],
  }
  modes = {}
  for mode in args.modes.split(","):
    result = measure_mode(args.recipe, [*mode_keys[mode], *common], local_batch, seq_len, vocab, args)
    result["overrides"] = [o.replace(str(args.out), "OUT") for o in result["overrides"]]
    modes[mode] = result
    print(
      f"{mode}: {result['tokens_per_s']:,.0f} tokens/s (median of {args.batches} batches of "
      f"{local_batch} x {seq_len}; mean {result['mean_tokens_per_s']:,.0f}; "
      f"real tokens {result['real_tokens_per_s']:,.0f}/s)",
      flush=True,
    )

  gpu = gpu_consumption(args.gpu_result, args.gpu_variant, gpus)
  comparison = {}
  for mode, r in modes.items():
    comparison[mode] = {
      "loader_over_host_consumption": r["tokens_per_s"] / gpu["host_tokens_per_s"],
      # At this batch shape the host's GPUs take one step per batch: the loader's batch time against the step's.
      "batch_s_over_step_s": r["median_batch_s"] / gpu["step_s"],
    }
  result = {
    "benchmark": "benchmarks/data_loader.py",
    "tiny": args.tiny,
    "recipe": str(args.recipe.relative_to(REPO)) if args.recipe.is_relative_to(REPO) else str(args.recipe),
    "batch": {"rows": local_batch, "seq_len": seq_len, "rows_per_gpu": rows_per_gpu, "gpus_per_host": gpus},
    "machine": {**machine(), "loadavg_start": load_start, "loadavg_end": os.getloadavg()},
    "corpus": corpus,
    "tokenizer": {"kind": "huggingface byte-level BPE", "vocab_size": vocab, "train_s": tokenizer_s},
    "pretokenize": pretokenize,
    "modes": modes,
    "gpu_host": gpu,
    "comparison": comparison,
  }
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "data_loader.json").write_text(json.dumps(result, indent=1) + "\n")
  for mode, c in comparison.items():
    print(
      f"{mode}: {c['loader_over_host_consumption']:.2f}x what {gpus} GPUs consume "
      f"({gpu['host_tokens_per_s']:,.0f} tokens/s)"
    )
  if not args.keep_work:
    shutil.rmtree(work)
  return 0


if __name__ == "__main__":
  sys.exit(main())
