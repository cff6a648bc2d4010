"""Synthetic data: each step's global batch is a pure function of (seed, step).

  random      uniform token ids; the default for benchmarks (nothing to learn)
  arithmetic  each sequence is (start + stride * i) mod vocab with a random start
              and stride: learnable from two tokens of context, so the loss of a
              working model falls well below log(vocab); used by tests and demos
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
