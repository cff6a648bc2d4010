"""Training data: one iterator of this process's `Batch`es per run, whatever the source.

  dataset_type  module                     what
  synthetic     data/synthetic.py          generated tokens, a pure function of (seed, step)
  tfds          data/sources.py (tfds)     a TFDS dataset prepared as ArrayRecord, read by
                                           tfds.data_source (no TensorFlow)
  grain         data/sources.py (files)    local ArrayRecord / Parquet / JSON lines / text files
  hf            data/sources.py (hf)       Hugging Face `datasets` from local files or a saved dataset

`python -m MaxText.data.pretokenize` (data/pretokenize.py) turns a large text corpus into sharded
ArrayRecord files of token ids that dataset_type=grain reads with tokenize_train_data=false.

Real datasets all run through one grain pipeline (data/pipeline.py): this
process's share of the documents, shuffled per epoch, tokenized
(data/tokenizers.py), cut into pieces of at most max_target_length + 1 tokens,
packed with segment ids (or padded one per row), batched. Every iterator has
`next(it)`, `get_state()` (a JSON-able dict) and `set_state(state)`; the state
is saved with each checkpoint so a resumed run sees exactly the batches it
would have seen.
"""

from MaxText.config_schema import DataConfig

__all__ = ["SyntheticData", "SyntheticIterator", "make_iterator"]


def __getattr__(name: str):
  # synthetic.py imports the model (and so JAX); loaded on first use so that tools that only read files
  # (python -m MaxText.data.pretokenize and its worker processes) start without JAX.
  if name in ("SyntheticData", "SyntheticIterator"):
    from MaxText.data import synthetic

    return getattr(synthetic, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_iterator(
  cfg: DataConfig,
  *,
  local_batch: int,
  global_batch: int,
  seq_len: int,
  vocab_size: int,
  process_index: int = 0,
  process_count: int = 1,
):
  """The iterator of this process's batches (`local_batch` rows each) for `cfg.dataset_type`.

  Opening a real dataset checks that its files and tokenizer are there and readable (UserError
  otherwise) before anything is written.
  """
  if cfg.dataset_type == "synthetic":
    from MaxText.data.synthetic import SyntheticData, SyntheticIterator

    return SyntheticIterator(SyntheticData(cfg, global_batch, seq_len, vocab_size), process_index, process_count)
  from MaxText.data import pipeline

  return pipeline.make_iterator(
    cfg,
    local_batch=local_batch,
    seq_len=seq_len,
    vocab_size=vocab_size,
    process_index=process_index,
    process_count=process_count,
  )
