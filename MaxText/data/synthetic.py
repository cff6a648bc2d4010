"""Synthetic data: each step's global batch is a pure function of (seed, step).

  random      uniform token ids; the default for benchmarks (nothing to learn)
  arithmetic  each sequence is (start + stride * i) mod vocab with a random start
              and stride: learnable from two tokens of context, so the loss of a
              working model falls well below log(vocab); used by tests and demos

`SyntheticIterator` walks the steps and hands each process its rows; its
checkpointed state is just the next step.
"""

import numpy as np

from MaxText.config_schema import DataConfig
from MaxText.model import Batch

MAX_STRIDE = 7


class SyntheticData:
  def __init__(self, cfg: DataConfig, global_batch: int, seq_len: int, vocab_size: int):
    self.cfg, self.global_batch, self.seq_len, self.vocab = cfg, global_batch, seq_len, vocab_size

  def batch(self, step: int) -> Batch:
    """The global batch for `step` as host numpy arrays."""
    rng = np.random.default_rng([self.cfg.data_shuffle_seed, step])
    shape = (self.global_batch, self.seq_len + 1)
    if self.cfg.synthetic_data == "random":
      tokens = rng.integers(0, self.vocab, size=shape, dtype=np.int64)
    else:
      start = rng.integers(0, self.vocab, size=(self.global_batch, 1))
      stride = rng.integers(1, MAX_STRIDE + 1, size=(self.global_batch, 1))
      tokens = (start + stride * np.arange(self.seq_len + 1)) % self.vocab
    tokens = tokens.astype(np.int32)
    return Batch(tokens[:, :-1], tokens[:, 1:], np.ones((self.global_batch, self.seq_len), np.float32))


class SyntheticIterator:
  """This process's rows of SyntheticData, step after step (processes own contiguous row blocks)."""

  def __init__(self, data: SyntheticData, process_index: int = 0, process_count: int = 1):
    self.data, self.step = data, 0
    rows = data.global_batch // process_count
    self.rows = slice(process_index * rows, (process_index + 1) * rows)

  def __next__(self) -> Batch:
    batch = self.data.batch(self.step)
    self.step += 1
    return Batch(*(None if a is None else a[self.rows] for a in batch))

  def __iter__(self):
    return self

  def get_state(self) -> dict:
    return {"step": self.step}

  def set_state(self, state: dict) -> None:
    self.step = int(state["step"])
