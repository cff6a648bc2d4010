"""Pre-tokenization: a text corpus -> sharded ArrayRecord files of token ids, read by training without a tokenizer.

  python -m MaxText.data.pretokenize --input 'corpus/*.jsonl' [more globs ...] --tokenizer tokenizer.json \\
      --tokenizer-type huggingface --output data/corpus-tokens --shards 256 --workers 16

and then train with

  dataset_type=grain grain_file_type=arrayrecord grain_train_files=data/corpus-tokens/*.array_record
  train_data_columns=tokens tokenize_train_data=false   (and vocab_size >= the tokenizer's)

Input: text files (one document a non-blank line, as grain_file_type=text reads them), JSON lines (one
object a line, the document in --column) or Parquet (the string column --column); the type from the
extension or --input-type. Files in the order of --input, each glob sorted, documents in file order.

Output, in --output: `tokens-00000-of-000NN.array_record`, ... and `manifest.json` (inputs, tokenizer,
per-shard counts; written last, so its presence marks a complete output). Each record is a
tf.train.Example with one int64 feature (--output-column, default `tokens`): BOS + the tokenizer's
ids + EOS (--add-bos/--add-eos, on by default like the config keys), made by the same code as the
pipeline's on-the-fly tokenization (tokenizers.DocumentEncoder), so training on the shards sees exactly
the ids it would see tokenizing the text as it trains.

Two passes, both spread over --workers processes:
  1. scan   files cut into pieces of ~64 MiB at line starts; every document is parsed and checked (UTF-8,
            JSON, the column, a string, no nulls) and counted, and the byte offset of every 4096th
            document is kept. Any bad input stops the command here with one `error:` line, exit 2,
            before anything is written.
  2. write  shard i holds documents [i*D/N, (i+1)*D/N) of the D documents in input order: the shards
            concatenated in name order are the corpus in order, and the bytes written depend only on
            the input, the tokenizer, the flags and --shards, never on --workers or scheduling. A
            worker seeks to its shard's first document through the kept offsets, writes `NAME.tmp` and
            renames it when complete. A progress line every --progress-seconds; a summary at the end.
"""

import argparse
import glob
import hashlib
import json
import multiprocessing
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from MaxText.data.tokenizers import TOKENIZERS, DocumentEncoder, load_tokenizer
from MaxText.errors import UserError, exit_on_user_error

SUFFIX_TYPES = {".txt": "text", ".text": "text", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl"}
SUFFIX_TYPES |= {".parquet": "parquet", ".pq": "parquet"}
PIECE_BYTES = 64 << 20  # scan work unit: big enough that per-piece overhead vanishes, small enough to spread
CHECKPOINT_EVERY = 4096  # documents between kept offsets: a shard's start is found by parsing < 4096 documents
# group_size:1 makes every record its own chunk, so grain reads any record without decoding its neighbours;
# zstd:3 costs ~20% of random-read speed (which is 2x+ above the whole pipeline's) for ~14% less disk.
RECORD_OPTIONS = "group_size:1,zstd:3"
REPORT_EVERY = 256  # documents a worker writes between updates of the shared progress counters
MANIFEST = "manifest.json"
USAGE = (
  "usage: python -m MaxText.data.pretokenize --input GLOB [GLOB ...] --tokenizer PATH "
  "[--tokenizer-type sentencepiece|tiktoken|huggingface] --output DIR [--shards N] [--workers W] "
  "[--input-type auto|text|jsonl|parquet] [--column text] [--output-column tokens] [--no-add-bos] "
  "[--no-add-eos] [--overwrite] [--progress-seconds S]"
)


# ---- the command line ----
class _Parser(argparse.ArgumentParser):
  def error(self, message):  # one `error:` line and exit code 2, like every other bad input
    raise UserError(f"{message}; {USAGE}")


def parse_args(argv: list[str]) -> argparse.Namespace:
  ap = _Parser(prog="python -m MaxText.data.pretokenize", add_help=False)
  ap.add_argument("--input", nargs="+", required=True)  # globs, each possibly comma-separated
  ap.add_argument("--tokenizer", required=True)
  ap.add_argument("--tokenizer-type", default="sentencepiece", choices=sorted(TOKENIZERS))
  ap.add_argument("--output", required=True)
  ap.add_argument("--shards", type=int, default=1)
  ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
  ap.add_argument("--input-type", default="auto", choices=["auto", "text", "jsonl", "parquet"])
  ap.add_argument("--column", default="text")  # jsonl/parquet: the document's field
  ap.add_argument("--output-column", default="tokens")  # the feature training reads (train_data_columns)
  ap.add_argument("--add-bos", action=argparse.BooleanOptionalAction, default=True)
  ap.add_argument("--add-eos", action=argparse.BooleanOptionalAction, default=True)
  ap.add_argument("--overwrite", action="store_true")
  ap.add_argument("--progress-seconds", type=float, default=10.0)
  args = ap.parse_args(argv)
  if args.shards < 1:
    raise UserError(f"--shards must be at least 1, got {args.shards}")
  if args.workers < 1:
    raise UserError(f"--workers must be at least 1, got {args.workers}")
  if not re.fullmatch(r"[A-Za-z0-9_]+", args.output_column):
    raise UserError(f"--output-column must be letters, digits and _ (it names the files too), got {args.output_column}")
  return args


# ---- inputs ----
@dataclass(frozen=True)
class InputFile:
  path: str
  kind: str  # text | jsonl | parquet
  size: int


@dataclass(frozen=True)
class Piece:
  """What one scan task reads: the lines starting in bytes [start, end) of a text/JSON lines file, or a Parquet file."""

  file: int
  start: int
  end: int


def find_inputs(patterns: list[str], input_type: str) -> list[InputFile]:
  files, seen = [], set()
  for pattern in (p.strip() for arg in patterns for p in arg.split(",") if p.strip()):
    matched = sorted(glob.glob(os.path.expanduser(pattern)))
    if not matched:
      raise UserError(f"--input {pattern} matches no files")
    for path in matched:
      if path in seen:  # one file named by two globs is read once
        continue
      seen.add(path)
      if not os.path.isfile(path):
        raise UserError(f"--input {path} is not a file")
      if not os.access(path, os.R_OK):
        raise UserError(f"--input {path} is not readable")
      kind = input_type if input_type != "auto" else SUFFIX_TYPES.get(Path(path).suffix.lower())
      if kind is None:
        known = ", ".join(sorted(SUFFIX_TYPES))
        raise UserError(f"cannot tell the type of {path} from its extension ({known}); pass --input-type")
      files.append(InputFile(path, kind, os.path.getsize(path)))
  return files


def pieces_of(files: list[InputFile]) -> list[Piece]:
  out = []
  for i, f in enumerate(files):
    if f.kind == "parquet":
      out.append(Piece(i, 0, f.size))
      continue
    for start in range(0, max(f.size, 1), PIECE_BYTES):
      out.append(Piece(i, start, min(start + PIECE_BYTES, f.size)))
  return out


def line_documents(line: bytes, kind: str, column: str) -> list[str]:
  """The documents on one line of a text or JSON lines file; ValueError says what is wrong with it.

  Text: each non-blank line of str.splitlines() (which also splits at \\r, \\x0c, \\u2028, ...), exactly as
  the pipeline's text source reads a file, so both see the same documents.
  """
  if kind == "text":
    return [d for d in line.decode("utf-8").splitlines() if d.strip()]
  if not line.strip():
    return []
  try:
    record = json.loads(line)
  except json.JSONDecodeError as e:
    raise ValueError(f"not JSON ({e.msg} at column {e.colno})") from None
  if not isinstance(record, dict):
    raise ValueError(f"a JSON {type(record).__name__}, not an object")
  if column not in record:
    raise ValueError(f"no field '{column}' (--column); it has: {', '.join(sorted(record)) or 'none'}")
  value = record[column]
  if not isinstance(value, str):
    raise ValueError(f"field '{column}' is {json.dumps(value)[:40]}, not a string")
  return [value]


def _open_lines(path: str, start: int):
  """The file opened at the first line that starts at or after byte `start`."""
  f = open(path, "rb")  # noqa: SIM115 - the caller closes it
  if start > 0:
    f.seek(start - 1)
    if f.read(1) != b"\n":
      f.readline()  # the rest of a line that started in the previous piece
  return f


@dataclass
class Scan:
  documents: int
  lines: int
  offsets: np.ndarray  # [k, 2]: (documents before it in this piece, position) of kept line starts / row groups
  error: str | None = None  # the first bad line: "line N (of this piece): what"
  error_line: int = 0


def scan_piece(args) -> Scan:
  """Pass 1: count and check every document of a piece; keep every CHECKPOINT_EVERY-th document's position."""
  f, piece, column = args
  if f.kind == "parquet":
    return _scan_parquet(f, column)
  documents = lines = 0
  offsets = []
  next_mark = 0
  with _open_lines(f.path, piece.start) as fh:
    pos = fh.tell()
    while pos < piece.end:
      line = fh.readline()
      if not line:
        break
      lines += 1
      if documents >= next_mark:
        offsets.append((documents, pos))
        next_mark = documents + CHECKPOINT_EVERY
      try:
        documents += len(line_documents(line, f.kind, column))
      except (ValueError, UnicodeDecodeError) as e:
        why = "not UTF-8" if isinstance(e, UnicodeDecodeError) else str(e)
        return Scan(documents, lines, np.zeros((0, 2), np.int64), why, lines)
      pos += len(line)
  return Scan(documents, lines, np.asarray(offsets, np.int64).reshape(-1, 2))


def _scan_parquet(f: InputFile, column: str) -> Scan:
  import pyarrow as pa
  import pyarrow.parquet as pq

  try:
    pf = pq.ParquetFile(f.path)
  except (pa.ArrowInvalid, OSError) as e:
    return Scan(0, 0, np.zeros((0, 2), np.int64), f"not Parquet: {str(e).strip().splitlines()[0]}")
  schema = pf.schema_arrow
  if column not in schema.names:
    has = ", ".join(sorted(schema.names))
    return Scan(0, 0, np.zeros((0, 2), np.int64), f"no column '{column}' (--column); it has: {has}")
  kind = schema.field(column).type
  if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
    return Scan(0, 0, np.zeros((0, 2), np.int64), f"column '{column}' is {kind}, not a string")
  offsets, documents = [], 0
  for g in range(pf.num_row_groups):
    offsets.append((documents, g))
    nulls = pf.read_row_group(g, columns=[column]).column(column).null_count
    if nulls:
      return Scan(documents, 0, np.zeros((0, 2), np.int64), f"row group {g} has {nulls} null documents")
    documents += pf.metadata.row_group(g).num_rows
  return Scan(documents, 0, np.asarray(offsets, np.int64).reshape(-1, 2))


def file_documents(f: InputFile, column: str, position: int):
  """The documents of a file from a kept position (a line start's byte offset, or a Parquet row group) on."""
  if f.kind == "parquet":
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(f.path)
    for g in range(position, pf.num_row_groups):
      yield from pf.read_row_group(g, columns=[column]).column(column).to_pylist()
    return
  with _open_lines(f.path, position) as fh:
    for line in fh:
      yield from line_documents(line, f.kind, column)


# ---- the plan: which documents go to which shard ----
@dataclass(frozen=True)
class Segment:
  """Documents [first, first + count) of one input file, read from a kept position before them."""

  file: int
  first: int
  count: int
  position: int
  skip: int  # documents between the position and `first`


@dataclass(frozen=True)
class ShardTask:
  index: int
  path: str
  first_document: int
  documents: int
  segments: tuple[Segment, ...]


def plan_shards(files, pieces, scans, shards: int, output: Path, output_column: str):
  """Shard i gets the documents [i*D//N, (i+1)*D//N) of the corpus in input order."""
  per_file = [0] * len(files)
  offsets = [[] for _ in files]
  for piece, scan in zip(pieces, scans):
    base = per_file[piece.file]  # documents in this file before the piece
    offsets[piece.file].append(scan.offsets + np.array([base, 0]))
    per_file[piece.file] += scan.documents
  offsets = [np.concatenate(o) if o else np.zeros((0, 2), np.int64) for o in offsets]
  file_start = np.concatenate([[0], np.cumsum(per_file)])
  total = int(file_start[-1])
  tasks = []
  for s in range(shards):
    lo, hi = s * total // shards, (s + 1) * total // shards
    segments = []
    for i in range(len(files)):
      a, b = max(lo, file_start[i]), min(hi, file_start[i + 1])
      if a >= b:
        continue
      first = int(a - file_start[i])
      k = int(np.searchsorted(offsets[i][:, 0], first, side="right")) - 1  # the last kept position <= first
      docs_before, position = (int(x) for x in offsets[i][k])
      segments.append(Segment(i, first, int(b - a), position, first - docs_before))
    name = f"{output_column}-{s:05d}-of-{shards:05d}.array_record"
    tasks.append(ShardTask(s, str(output / name), lo, hi - lo, tuple(segments)))
  return tasks, per_file, total


# ---- pass 2: the workers ----
_worker = {}  # per process: the encoder, the inputs and the shared progress counters


def _init_worker(kind, path, add_bos, add_eos, files, column, output_column, counters):
  tok = load_tokenizer(kind, path, what="--tokenizer")
  _worker.update(
    encoder=DocumentEncoder(tok, path, add_bos, add_eos, switch_off=lambda name: f"pass --no-add-{name}"),
    files=files,
    column=column,
    output_column=output_column,
    counters=counters,
  )


def example_bytes(feature: str, ids: list[int]) -> bytes:
  from MaxText.data import tf_example

  return tf_example.int64_example(feature, ids)


def write_shard(task: ShardTask) -> dict:
  """Tokenizes and writes one shard as task.path + '.tmp', renamed to task.path when complete."""
  from array_record.python.array_record_module import ArrayRecordWriter

  encoder, files, counters = _worker["encoder"], _worker["files"], _worker["counters"]
  tmp = task.path + ".tmp"
  writer = ArrayRecordWriter(tmp, RECORD_OPTIONS)
  documents = tokens = pending_docs = pending_tokens = 0
  try:
    for seg in task.segments:
      docs = file_documents(files[seg.file], _worker["column"], seg.position)
      for _ in range(seg.skip):
        next(docs)
      for _, text in zip(range(seg.count), docs):
        ids = encoder.ids(text)
        writer.write(example_bytes(_worker["output_column"], ids))
        documents += 1
        tokens += len(ids)
        pending_docs += 1
        pending_tokens += len(ids)
        if pending_docs == REPORT_EVERY:
          counters.add(pending_docs, pending_tokens, 0)
          pending_docs = pending_tokens = 0
          if _worker.get("on_report"):  # in-process: no main loop is free to print the progress line
            _worker["on_report"]()
  finally:
    writer.close()
  if documents != task.documents:  # the file changed since the scan
    raise UserError(f"{task.path}: expected {task.documents} documents, read {documents}; did an input change?")
  os.replace(tmp, task.path)
  counters.add(pending_docs, pending_tokens, 1)
  return {"file": Path(task.path).name, "first_document": task.first_document, "documents": documents, "tokens": tokens}


class Counters:
  """Documents, tokens and shards written so far, shared by the worker processes and the progress line."""

  def __init__(self, ctx):
    self.values = ctx.Array("q", 3)  # one lock for the three

  def add(self, documents: int, tokens: int, shards: int) -> None:
    with self.values.get_lock():
      self.values[0] += documents
      self.values[1] += tokens
      self.values[2] += shards

  def read(self) -> tuple[int, int, int]:
    with self.values.get_lock():
      return tuple(self.values[:])


class Progress:
  def __init__(self, counters: Counters, documents: int, shards: int, every_s: float):
    self.counters, self.documents, self.shards, self.every_s = counters, documents, shards, every_s
    self.start = self.last = time.monotonic()

  def maybe_print(self) -> None:
    now = time.monotonic()
    if now - self.last < self.every_s:
      return
    self.last = now
    docs, tokens, shards = self.counters.read()
    elapsed = now - self.start
    rate = tokens / elapsed if elapsed > 0 else 0.0
    done = docs / self.documents if self.documents else 1.0
    eta = f", about {_duration(elapsed * (1 - done) / done)} left" if done > 0 else ""
    print(
      f"progress: {shards}/{self.shards} shards, {docs:,}/{self.documents:,} documents ({100 * done:.1f}%), "
      f"{tokens:,} tokens, {_si(rate)} tokens/s{eta}",
      flush=True,
    )


def _si(x: float) -> str:
  for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
    if x >= scale:
      return f"{x / scale:.2f}{unit}"
  return f"{x:.0f}"


def _duration(s: float) -> str:
  s = int(round(s))
  return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


# ---- the output directory ----
def check_output(output: Path, overwrite: bool) -> list[Path]:
  """What is in the way in `output` (to delete once every check has passed); UserError if it may not be replaced."""
  if output.exists() and not output.is_dir():
    raise UserError(f"--output {output} exists and is not a directory")
  existing = sorted(output.iterdir()) if output.is_dir() else []
  if existing and not overwrite:
    raise UserError(f"--output {output} exists and is not empty; pass --overwrite to replace what is in it")
  ours = re.compile(r"(manifest\.json|[A-Za-z0-9_]+-\d{5}-of-\d{5}\.array_record(\.tmp)?)")
  foreign = [p.name for p in existing if not (p.is_file() and ours.fullmatch(p.name))]
  if foreign:
    raise UserError(
      f"--output {output} holds {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}, which pretokenize "
      "did not write; --overwrite only replaces pretokenize's own output: choose another directory"
    )
  ancestor = output
  while not ancestor.exists():
    ancestor = ancestor.parent
  if not os.access(ancestor, os.W_OK | os.X_OK):
    raise UserError(f"--output {output}: cannot write in {ancestor}")
  return existing


def _sha256(path: Path) -> str:
  paths = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
  h = hashlib.sha256()
  for p in paths:
    h.update(p.read_bytes())
  return h.hexdigest()


# ---- the command ----
@exit_on_user_error
def main(argv: list[str]) -> int:
  t0 = time.monotonic()
  args = parse_args(argv)
  # Every check before anything is written: the tokenizer (cheap), the output directory, then the inputs,
  # every document of them (pass 1).
  tok = load_tokenizer(args.tokenizer_type, args.tokenizer, what="--tokenizer")
  DocumentEncoder(tok, args.tokenizer, args.add_bos, args.add_eos, switch_off=lambda name: f"pass --no-add-{name}")
  output = Path(args.output).expanduser()
  in_the_way = check_output(output, args.overwrite)
  files = find_inputs(args.input, args.input_type)
  pieces = pieces_of(files)
  workers = min(args.workers, max(len(pieces), args.shards))
  ctx = multiprocessing.get_context("spawn")  # no fork: the tokenizer libraries hold threads and locks
  counters = Counters(ctx)
  init = (args.tokenizer_type, args.tokenizer, args.add_bos, args.add_eos, files, args.column, args.output_column)
  pool = ctx.Pool(workers, _init_worker, (*init, counters)) if workers > 1 else None
  try:
    scans = (pool.map if pool else map)(scan_piece, [(files[p.file], p, args.column) for p in pieces])
    scans = list(scans)
    lines_before = {}
    for piece, scan in zip(pieces, scans):
      if scan.error:
        line = lines_before.get(piece.file, 0) + scan.error_line
        raise UserError(f"--input {files[piece.file].path}" + (f" line {line}" if line else "") + f": {scan.error}")
      lines_before[piece.file] = lines_before.get(piece.file, 0) + scan.lines
    tasks, per_file, total = plan_shards(files, pieces, scans, args.shards, output, args.output_column)
    size = sum(f.size for f in files)
    print(f"scanned {len(files)} files ({size / 1e6:,.1f} MB): {total:,} documents ({time.monotonic() - t0:.1f} s)")
    if total == 0:
      raise UserError(f"--input {' '.join(args.input)} holds no documents")
    if args.shards > total:
      raise UserError(f"--shards {args.shards} is more than the {total} documents; every shard needs one")

    # Writing starts here.
    for p in in_the_way:
      p.unlink()
    created = not output.exists()
    output.mkdir(parents=True, exist_ok=True)
    print(f"writing {args.shards} shards to {output} with {workers} worker process(es)", flush=True)
    t1 = time.monotonic()
    progress = Progress(counters, total, args.shards, args.progress_seconds)
    try:
      if pool is None:
        _init_worker(*init, counters)
        _worker["on_report"] = progress.maybe_print
        shards = []
        for task in tasks:
          shards.append(write_shard(task))
          progress.maybe_print()
      else:
        pending = [pool.apply_async(write_shard, (task,)) for task in tasks]
        while not all(r.ready() for r in pending):
          time.sleep(min(0.2, args.progress_seconds))
          progress.maybe_print()
          for r in pending:
            if r.ready() and not r.successful():
              r.get()  # raises the worker's error now, not after every other shard
        shards = [r.get() for r in pending]
    except BaseException:
      if pool is not None:
        pool.terminate()
      for task in tasks:  # a partial output is no output
        for p in (Path(task.path), Path(task.path + ".tmp")):
          p.unlink(missing_ok=True)
      if created:
        output.rmdir()
      raise
  finally:
    if pool is not None:
      pool.terminate()
      pool.join()
  write_s = time.monotonic() - t1
  tokens = sum(s["tokens"] for s in shards)
  shard_glob = f"{args.output_column}-*-of-{args.shards:05d}.array_record"
  train_with = (
    "dataset_type=grain grain_file_type=arrayrecord grain_train_files={}/" + shard_glob + " "
    f"train_data_columns={args.output_column} tokenize_train_data=false vocab_size>={tok.vocab_size}"
  )
  manifest = {  # a function of the inputs and flags alone (no times, no output path): same input, same bytes
    "format": f"ArrayRecord ({RECORD_OPTIONS}) of tf.train.Example, int64 feature '{args.output_column}' per document",
    "train_with": train_with.format("<this directory>"),
    "inputs": [{**asdict(f), "documents": n} for f, n in zip(files, per_file)],
    "column": args.column,
    "tokenizer": {
      "type": args.tokenizer_type,
      "path": args.tokenizer,
      "sha256": _sha256(Path(args.tokenizer).expanduser()),
      "vocab_size": tok.vocab_size,
      "bos_id": tok.bos_id if args.add_bos else None,
      "eos_id": tok.eos_id if args.add_eos else None,
    },
    "documents": total,
    "tokens": tokens,
    "shards": shards,
  }
  (output / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
  print(
    f"pretokenized {total:,} documents into {args.shards} shards in {output}: {tokens:,} tokens "
    f"({tokens / total:,.1f} per document), {write_s:.1f} s, {_si(tokens / max(write_s, 1e-9))} tokens/s "
    f"with {workers} worker process(es); {time.monotonic() - t0:.1f} s in all"
  )
  print(f"train with: {train_with.format(output)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
