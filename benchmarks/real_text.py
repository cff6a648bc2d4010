"""A real-text corpus from Debian packages, its tokenizer, and the loss curves of runs trained on it.

  python3 benchmarks/real_text.py corpus --debs DIR --out DIR [--doc-kib 256] [--vocab 32768]
  python3 benchmarks/real_text.py curves --out DIR --stats DIR/corpus_stats.json [--metric ce_loss] NAME=RUN_DIR ...

corpus: the English text of three Debian packages, all of it prose written by people, none of it generated:
  dict-gcide      the GNU Collaborative International Dictionary of English (Webster's 1913 and additions)
  python3.11-doc  the Python 3.11 documentation's reStructuredText sources
  linux-doc-6.1   the Linux 6.1 kernel's Documentation/ tree (reStructuredText and plain text)
(fetch them with `apt-get download dict-gcide python3.11-doc linux-doc-6.1` on Debian 12). Each package's files are
read in sorted order and joined into documents of at least --doc-kib KiB, so that training with packing=false (one
document per row, long documents cut into full rows) pads little. Writes DIR/corpus.jsonl (one {"text": ...} a
line), a byte-level BPE tokenizer trained on it (DIR/tokenizer.json, <s> and </s> as BOS and EOS) and
DIR/corpus_stats.json: documents, bytes and tokens per package, and the unigram entropy of the token stream in nats
(BOS and EOS included, as training sees them), which a model has learnt nothing beyond token frequencies at.

curves: each run directory's metrics.jsonl (a run resumed in parts logs into the same file) -> DIR/curves.json (the
--metric of every step per run, default the next-token cross-entropy `ce_loss` (the logged `loss` adds the MTP and
balance terms); the mean of the last 20 and 50 steps and their gaps to the first run's) and, with matplotlib,
DIR/curves.png: each step and a 20-step moving mean, the unigram entropy drawn across.
"""

import argparse
import gzip
import json
import math
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from MaxText.errors import UserError, exit_on_user_error  # noqa: E402

# package -> (the folder its text lives in, the file suffixes read there)
SOURCES = {
  "dict-gcide": ("usr/share/dictd", (".dict.dz",)),
  "python3.11-doc": ("usr/share/doc/python3.11/html/_sources", (".rst.txt", ".txt")),
  "linux-doc-6.1": ("usr/share/doc/linux-doc-6.1/Documentation", (".rst.gz", ".txt.gz", ".rst", ".txt")),
}
BOS, EOS = "<s>", "</s>"
LAST = (20, 50)  # steps averaged for the end-of-run comparisons
SMOOTH = 20  # steps of the plotted moving mean


def _read(path: Path) -> str:
  raw = path.read_bytes()
  if path.suffix in (".gz", ".dz"):  # dictd's .dz is gzip with a random-access index
    raw = gzip.decompress(raw)
  return raw.decode("utf-8", errors="replace").replace("\x00", "")


def package_texts(deb: Path, root: Path) -> list[str]:
  """The text files of one package, in sorted path order."""
  package = deb.name.split("_")[0]
  folder, suffixes = SOURCES[package]
  subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
  files = sorted(p for p in (root / folder).rglob("*") if p.is_file() and p.name.endswith(suffixes))
  if not files:
    raise UserError(f"{deb} holds no {'/'.join(suffixes)} files under /{folder}; is it the right package?")
  return [_read(p) for p in files]


def documents(texts: list[str], min_bytes: int) -> list[str]:
  """Texts joined (a blank line between) into documents of at least min_bytes; one big text is cut at blank lines."""
  pieces = []
  for text in texts:
    if len(text) <= min_bytes:
      pieces.append(text)
      continue
    cut = 0
    while cut < len(text):  # a dictionary is one file: cut it at the first blank line after min_bytes
      end = text.find("\n\n", cut + min_bytes)
      end = len(text) if end < 0 else end + 2
      pieces.append(text[cut:end])
      cut = end
  docs, current, size = [], [], 0
  for piece in pieces:
    current.append(piece.strip("\n"))
    size += len(piece)
    if size >= min_bytes:
      docs.append("\n\n".join(current))
      current, size = [], 0
  if current:
    docs.append("\n\n".join(current))
  return docs


def train_tokenizer(docs: list[str], vocab: int, path: Path):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab, special_tokens=[BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
  tok.save(str(path))
  return tok


def corpus(args) -> None:
  debs = {p.name.split("_")[0]: p for p in sorted(args.debs.glob("*.deb"))}
  missing = sorted(set(SOURCES) - set(debs))
  if missing:
    fetch = f"apt-get download {' '.join(missing)}"
    raise UserError(f"no {', '.join(missing)} .deb in {args.debs}; fetch them with: {fetch}")
  if shutil.which("dpkg-deb") is None:
    raise UserError("dpkg-deb is not installed here (it unpacks the .deb files); run this on Debian or Ubuntu")
  per_package, all_docs = {}, []
  with tempfile.TemporaryDirectory() as tmp:
    for package in SOURCES:
      docs = documents(package_texts(debs[package], Path(tmp) / package), args.doc_kib << 10)
      per_package[package] = {"deb": debs[package].name, "documents": len(docs), "bytes": sum(map(len, docs))}
      all_docs += docs
      print(f"{package}: {len(docs)} documents, {per_package[package]['bytes'] / 1e6:.1f} MB", flush=True)
  args.out.mkdir(parents=True, exist_ok=True)  # only once every package has been read
  with open(args.out / "corpus.jsonl", "w") as f:
    for doc in all_docs:
      f.write(json.dumps({"text": doc}) + "\n")
  tok = train_tokenizer(all_docs, args.vocab, args.out / "tokenizer.json")
  bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
  counts, start = Counter(), 0
  for package, info in per_package.items():
    n = info["documents"]
    encoded = tok.encode_batch(all_docs[start : start + n])
    start += n
    info["tokens"] = sum(len(e.ids) + 2 for e in encoded)
    for e in encoded:
      counts.update(e.ids)
    counts[bos] += n
    counts[eos] += n
  total = sum(counts.values())
  entropy = -sum(c / total * math.log(c / total) for c in counts.values())
  stats = {
    "packages": per_package,
    "documents": len(all_docs),
    "tokens": total,
    "vocab_size": tok.get_vocab_size(),
    "unigram_entropy_nats": entropy,
  }
  (args.out / "corpus_stats.json").write_text(json.dumps(stats, indent=1))
  print(f"{total / 1e6:.1f}M tokens in {len(all_docs)} documents; unigram entropy {entropy:.3f} nats", flush=True)


def read_losses(run_dir: Path, metric: str) -> dict[int, float]:
  """step -> metric; a step logged again after a resume keeps its last value."""
  path = run_dir / "metrics.jsonl"
  if not path.is_file():
    raise UserError(f"{path} does not exist: give NAME=RUN_DIR with a run directory that holds metrics.jsonl")
  rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  if not any(metric in r for r in rows):
    raise UserError(f"{path} has no {metric!r}; choose another --metric")
  return {r["step"]: r[metric] for r in rows if metric in r}


def unigram_entropy(stats: Path) -> float:
  try:
    return json.loads(stats.read_text())["unigram_entropy_nats"]
  except (OSError, ValueError, KeyError) as e:
    raise UserError(f"--stats {stats}: not a corpus_stats.json from `real_text.py corpus` ({e})") from None


def curves(args) -> None:
  runs = {}
  for spec in args.runs:
    name, _, path = spec.partition("=")
    if not path:
      raise UserError(f"{spec!r} is not NAME=RUN_DIR")
    losses = read_losses(Path(path), args.metric)
    runs[name] = {"steps": sorted(losses), "losses": [losses[s] for s in sorted(losses)]}
  first = next(iter(runs.values()))
  for n in LAST:
    base = sum(first["losses"][-n:]) / len(first["losses"][-n:])
    for run in runs.values():
      last = run["losses"][-n:]
      run[f"last_{n}_mean"] = sum(last) / len(last)
      run[f"last_{n}_gap_to_first"] = run[f"last_{n}_mean"] / base - 1
  entropy = unigram_entropy(args.stats) if args.stats else None
  out = {"metric": args.metric, "unigram_entropy_nats": entropy, "runs": runs}
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "curves.json").write_text(json.dumps(out, indent=1))
  for name, run in runs.items():
    ends = ", ".join(f"last {n}: {run[f'last_{n}_mean']:.4f} ({run[f'last_{n}_gap_to_first']:+.2%})" for n in LAST)
    print(f"{name}: {len(run['steps'])} steps of {args.metric}; {ends}")
  try:
    import matplotlib
  except ImportError:
    print("matplotlib is not installed: no curves.png", file=sys.stderr)
    return
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(9, 5))
  for i, (name, run) in enumerate(runs.items()):
    color = f"C{i}"
    ax.plot(run["steps"], run["losses"], color=color, linewidth=0.5, alpha=0.35)
    ys = run["losses"]
    mean = [sum(ys[max(0, j - SMOOTH + 1) : j + 1]) / len(ys[max(0, j - SMOOTH + 1) : j + 1]) for j in range(len(ys))]
    ax.plot(run["steps"], mean, color=color, linewidth=1.5, label=f"{name} ({SMOOTH}-step mean)")
  if entropy is not None:
    ax.axhline(entropy, color="grey", linestyle="--", label=f"unigram entropy {entropy:.2f}")
  ax.set_xlabel("step")
  ax.set_ylabel(f"{args.metric} (nats)")
  ax.set_ylim(0, max(max(r["losses"][5:] or r["losses"]) for r in runs.values()) * 1.05)
  ax.legend()
  fig.tight_layout()
  fig.savefig(args.out / "curves.png", dpi=120)


@exit_on_user_error
def main(argv: list[str]) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = ap.add_subparsers(dest="command", required=True)
  c = sub.add_parser("corpus")
  c.add_argument("--debs", type=Path, required=True)
  c.add_argument("--out", type=Path, required=True)
  c.add_argument("--doc-kib", type=int, default=256)
  c.add_argument("--vocab", type=int, default=32768)
  v = sub.add_parser("curves")
  v.add_argument("--out", type=Path, required=True)
  v.add_argument("--stats", type=Path)
  v.add_argument("--metric", default="ce_loss")
  v.add_argument("runs", nargs="+")
  args = ap.parse_args(argv)
  corpus(args) if args.command == "corpus" else curves(args)
  return 0


if __name__ == "__main__":
  sys.exit(main())
