"""The grain pipeline every real dataset runs through, from documents to this process's batches.

  documents (sources.py)
    -> this process's share: every process_count-th document, from process_index
    -> shuffled (a new permutation each epoch, from data_shuffle_seed), repeated forever
    -> token ids: tokenizer (tokenizers.py) + optional BOS/EOS, or the column's ids as they are
       (a corpus pre-tokenized by pretokenize.py); read, parsed and tokenized ahead by threads
       (read_options)
    -> pieces of at most max_target_length + 1 tokens (a long document becomes several)
    -> optionally shuffled in windows of piece_shuffle_window pieces (a long document's pieces spread over
       many batches instead of filling consecutive rows)
    -> each piece as (inputs = piece[:-1], targets = piece[1:])
    -> packing: first-fit into rows with segment ids (1, 2, ... per piece, 0 = padding)
       and positions restarting at 0 in each piece; or one piece per row, zero-padded
    -> local_batch rows -> model.Batch (loss mask 1 on real tokens, 0 on padding)

The processes' shares are disjoint and together cover the dataset. Everything
is deterministic given the config, and the iterator state (grain's, JSON-able)
pins the exact position, so a restored iterator yields the same batches as the
original would have.
"""

import os

import numpy as np

from MaxText.config_schema import DataConfig
from MaxText.data import sources
from MaxText.data.tokenizers import DocumentEncoder, load_tokenizer
from MaxText.errors import UserError
from MaxText.model import Batch


class Tokenize:
  """A document (text or token ids) -> int32 token ids, with BOS/EOS as configured."""

  def __init__(self, cfg: DataConfig, vocab_size: int):
    self.vocab_size = vocab_size
    self.encoder = None
    if cfg.tokenize_train_data:
      tok = load_tokenizer(cfg.tokenizer_type, cfg.tokenizer_path)
      if tok.vocab_size > vocab_size:
        raise UserError(
          f"tokenizer {cfg.tokenizer_path} has {tok.vocab_size} tokens but vocab_size={vocab_size}; raise vocab_size"
        )
      self.encoder = DocumentEncoder(
        tok, cfg.tokenizer_path, cfg.add_bos, cfg.add_eos, switch_off=lambda name: f"set add_{name}=false"
      )

  def __call__(self, document) -> np.ndarray:
    if self.encoder is None:
      ids = np.asarray(document, np.int64).reshape(-1)
      if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
        bad = ids.max() if ids.max() >= self.vocab_size else ids.min()
        fix = (
          "the pre-tokenized data was made for a larger vocabulary; raise vocab_size to the tokenizer's, or re-tokenize"
          if bad >= 0
          else "a negative id: train_data_columns does not name a column of token ids"
        )
        raise UserError(f"token id {bad} is outside vocab_size={self.vocab_size}: {fix}")
      return ids.astype(np.int32)
    return np.asarray(self.encoder.ids(document), np.int32)


def pieces(ids: np.ndarray, seq_len: int) -> list[dict]:
  """Consecutive pieces of seq_len + 1 tokens overlapping by one, as inputs/targets of <= seq_len."""
  out = []
  for start in range(0, max(len(ids) - 1, 0), seq_len):
    piece = ids[start : start + seq_len + 1]
    out.append({"inputs": piece[:-1], "targets": piece[1:]})
  return out


def pad_row(piece: dict, seq_len: int) -> dict:
  n = len(piece["inputs"])
  pad = lambda a: np.pad(a, (0, seq_len - n))  # noqa: E731
  return {
    "inputs": pad(piece["inputs"]),
    "targets": pad(piece["targets"]),
    "targets_segment_ids": pad(np.ones(n, np.int32)),
  }


class BatchIterator:
  """Wraps grain's iterator: yields model.Batch, and passes its state through."""

  def __init__(self, it, packing: bool):
    self.it, self.packing = it, packing

  def __iter__(self):
    return self

  def __next__(self) -> Batch:
    rows = next(self.it)
    mask = (rows["targets_segment_ids"] > 0).astype(np.float32)
    if not self.packing:
      return Batch(rows["inputs"], rows["targets"], mask)
    return Batch(rows["inputs"], rows["targets"], mask, rows["inputs_segment_ids"], rows["inputs_positions"])

  def get_state(self) -> dict:
    return self.it.get_state()

  def set_state(self, state: dict) -> None:
    self.it.set_state(state)


MAX_READ_THREADS = 16
READ_BUFFER_PER_THREAD = 4


def read_options(threads: int | None = None):
  """Threads that read, parse and tokenize documents ahead of packing, and how many documents they keep ready.

  The threads do not change what the iterator yields (grain keeps the order), only how fast. The tokenizer
  libraries release the GIL while encoding, so on-the-fly tokenization scales with them. grain's default
  buffer (500 documents) costs more than it saves: every element scans it (pre-tokenized ArrayRecord at the
  proxy's batch shape, 2 CPU cores: 0.47M tokens/s with it, 1.9M with 4 documents a thread).
  """
  import grain

  threads = threads if threads is not None else min(MAX_READ_THREADS, os.cpu_count() or 1)
  return grain.ReadOptions(num_threads=threads, prefetch_buffer_size=READ_BUFFER_PER_THREAD * max(threads, 1))


def make_iterator(
  cfg: DataConfig,
  *,
  local_batch: int,
  seq_len: int,
  vocab_size: int,
  process_index: int = 0,
  process_count: int = 1,
  read_threads: int | None = None,
):
  """`read_threads`: see read_options (None = one a CPU core, at most MAX_READ_THREADS)."""
  import grain
  from grain.experimental import FirstFitPackIterDataset, FlatMapIterDataset, FlatMapTransform, WindowShuffleIterDataset

  tokenize = Tokenize(cfg, vocab_size)  # the tokenizer first: it is cheaper to check than the data
  source = sources.open_source(cfg)
  if len(source) < process_count:
    raise UserError(
      f"{sources.describe(cfg)} has {len(source)} documents, fewer than the {process_count} processes reading it"
    )
  if not cfg.tokenize_train_data:
    # Token ids beyond the model's vocabulary, found before anything is written: from the manifest that
    # pretokenize wrote beside the files (covers every document), else from this process's first document.
    declared = getattr(source, "declared_vocab", None)  # ArrayRecord sources carry it; in-memory ones are lists
    if declared and declared[0] > vocab_size:
      raise UserError(
        f"{declared[1]} says the data was tokenized with a {declared[0]}-token tokenizer, but vocab_size="
        f"{vocab_size}; set vocab_size>={declared[0]}"
      )
    tokenize(source[process_index])

  class Pieces(FlatMapTransform):
    max_fan_out = 1 << 30  # bounded by the longest document, not a fixed number

    def flat_map(self, ids):
      return pieces(ids, seq_len)

  ds = grain.MapDataset.source(source)[process_index::process_count]
  if cfg.enable_data_shuffling:
    ds = ds.shuffle(seed=cfg.data_shuffle_seed)
  ds = ds.repeat(None).map(tokenize).to_iter_dataset(read_options(read_threads))
  ds = FlatMapIterDataset(ds, Pieces())
  if cfg.piece_shuffle_window:
    # A window is filled, shuffled and drained; its iterator state is the parent's at the window's start plus
    # the position in it, so a restored iterator yields exactly what the original would have.
    ds = WindowShuffleIterDataset(ds, window_size=cfg.piece_shuffle_window, seed=cfg.data_shuffle_seed)
  if cfg.packing:
    lengths = {"inputs": seq_len, "targets": seq_len}
    ds = FirstFitPackIterDataset(ds, length_struct=lengths, num_packing_bins=local_batch, shuffle_bins=False)
  else:
    ds = ds.map(lambda piece: pad_row(piece, seq_len))
  ds = ds.batch(local_batch, drop_remainder=True)
  return BatchIterator(iter(ds), cfg.packing)
