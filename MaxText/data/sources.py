"""Where documents come from: random-access sources (len + getitem) for each dataset_type.

  tfds   tfds.data_source over a TFDS dataset prepared as ArrayRecord: random access to
         its records without TensorFlow (dataset_path = data_dir, dataset_name, train_split)
  grain  local files, grain_train_files (comma-separated globs) of one grain_file_type:
           arrayrecord  records are serialized tf.train.Example (what TFDS, MaxText's
                        ArrayRecord conversions and pretokenize.py write), read lazily
                        with protobuf alone (data/tf_example.py); an int64 feature
                        (token ids) comes as a numpy array
           parquet      Apache Parquet, the column read with pyarrow
           jsonl        one JSON object a line, read with pyarrow
           text         one document a line
  hf     Hugging Face `datasets`: load_dataset(hf_path, data_dir, data_files, split) for local
         files (hf_path = json | parquet | text | csv | arrow), or load_from_disk(hf_path) for a
         directory written by Dataset.save_to_disk

Parquet, JSON lines and text are read into memory (Arrow) when the run starts: fine
up to a few GB; larger corpora should be ArrayRecord. Each source is checked when
opened (files there, the column present) so a bad path is a one-line UserError
before anything is written.
"""

import glob
import json
import os
from pathlib import Path

from MaxText.config_schema import DataConfig
from MaxText.errors import UserError

HF_BUILDERS = ("json", "parquet", "text", "csv", "arrow")


def open_source(cfg: DataConfig):
  """The documents of `cfg` as a sequence whose items are the column's values (str, bytes or token ids)."""
  source = {"tfds": _tfds, "grain": _files, "hf": _hf}[cfg.dataset_type](cfg)
  if len(source) == 0:
    raise UserError(f"{describe(cfg)} holds no documents")
  source[0]  # reads one record, so a missing column fails now and not mid-training  # noqa: B018
  return source


def describe(cfg: DataConfig) -> str:
  if cfg.dataset_type == "tfds":
    return f"tfds dataset {cfg.dataset_name} (split {cfg.train_split}) in {cfg.dataset_path or 'the default data_dir'}"
  if cfg.dataset_type == "grain":
    return f"grain_train_files={cfg.grain_train_files} ({cfg.grain_file_type})"
  return f"hf dataset {cfg.hf_path} (split {cfg.train_split})"


class Column:
  """A random-access view of one column of records (dicts or tf.train.Example bytes)."""

  def __init__(self, records, column: str, where: str, parse=None, declared_vocab=None):
    self.records, self.column, self.where, self.parse = records, column, where, parse
    self.declared_vocab = declared_vocab  # (vocabulary size, manifest) from pretokenize's manifest.json, or None

  def __len__(self) -> int:
    return len(self.records)

  def __getitem__(self, i):
    record = self.records[i]
    if self.parse is not None:
      record = self.parse(record)
    if self.column not in record:
      raise UserError(
        f"{self.where} has no column '{self.column}' (train_data_columns); it has: {', '.join(sorted(record))}"
      )
    return record[self.column]


def _tfds(cfg: DataConfig):
  import tensorflow_datasets as tfds

  data_dir = cfg.dataset_path or None
  if data_dir and not Path(data_dir).is_dir():
    raise UserError(f"dataset_path {data_dir} is not a directory")
  try:
    records = tfds.data_source(cfg.dataset_name, split=cfg.train_split, data_dir=data_dir, download=False)
  except Exception as e:  # noqa: BLE001 - tfds raises many kinds (not found, bad split, not array_record)
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise UserError(f"cannot open {describe(cfg)}: {first}") from None
  return Column(records, cfg.train_data_columns, describe(cfg))


def manifest_vocab(files: list[str]) -> tuple[int, Path] | None:
  """(vocabulary size, manifest) of the largest tokenizer that the manifest.json of `python -m
  MaxText.data.pretokenize` beside `files` declares; None where there is none."""
  found = []
  for manifest in sorted({Path(f).parent / "manifest.json" for f in files}):
    try:
      found.append((int(json.loads(manifest.read_text())["tokenizer"]["vocab_size"]), manifest))
    except (OSError, ValueError, KeyError, TypeError):
      continue  # no manifest, or not pretokenize's: the documents are checked as they are read
  return max(found, default=None)


def _files(cfg: DataConfig):
  files = []
  for pattern in (p.strip() for p in cfg.grain_train_files.split(",") if p.strip()):
    matched = sorted(glob.glob(os.path.expanduser(pattern)))
    if not matched:
      raise UserError(f"grain_train_files: {pattern} matches no files")
    files += matched
  where, column = describe(cfg), cfg.train_data_columns
  if cfg.grain_file_type == "arrayrecord":
    import grain

    try:
      records = grain.sources.ArrayRecordDataSource(files)
    except Exception as e:  # noqa: BLE001 - array_record reports unreadable files in several ways
      raise UserError(f"{where}: cannot read as ArrayRecord: {str(e).strip().splitlines()[0]}") from None
    return Column(records, column, where, parse=_parse_example, declared_vocab=manifest_vocab(files))
  if cfg.grain_file_type == "text":
    if column != "text":
      raise UserError(f"{where}: text files have one column, 'text'; set train_data_columns=text")
    lines = []
    for f in files:
      lines += [line for line in Path(f).read_text().splitlines() if line.strip()]
    return lines
  return _arrow_column(_read_arrow(files, cfg.grain_file_type, where), column, where)


def _read_arrow(files: list[str], kind: str, where: str):
  import pyarrow as pa
  import pyarrow.json as pj
  import pyarrow.parquet as pq

  tables = []
  for f in files:
    try:
      tables.append(pq.read_table(f) if kind == "parquet" else pj.read_json(f))
    except (pa.ArrowInvalid, OSError) as e:
      raise UserError(f"{where}: cannot read {f} as {kind}: {str(e).strip().splitlines()[0]}") from None
  try:
    return pa.concat_tables(tables, promote_options="default")
  except pa.ArrowInvalid as e:
    raise UserError(f"{where}: the files do not share one schema: {e}") from None


def _arrow_column(table, column: str, where: str):
  if column not in table.column_names:
    raise UserError(
      f"{where} has no column '{column}' (train_data_columns); it has: {', '.join(sorted(table.column_names))}"
    )
  return table.column(column).combine_chunks().to_pylist()


def _parse_example(record: bytes) -> dict:
  """tf.train.Example bytes -> {feature: bytes | list of bytes | int64 array | float32 array}, with protobuf alone.

  Numeric features become numpy arrays straight from protobuf's buffer: for a document of token ids that is
  ~25x faster than a list of Python ints, and grain's per-element statistics walk a list item by item.
  """
  from MaxText.data import tf_example

  return tf_example.parse(record)


def _hf(cfg: DataConfig):
  import datasets

  datasets.logging.set_verbosity_error()
  datasets.disable_progress_bars()
  where = describe(cfg)
  path = Path(cfg.hf_path).expanduser()
  try:
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
      loaded = datasets.load_from_disk(str(path))
      if isinstance(loaded, datasets.DatasetDict):
        if cfg.train_split not in loaded:
          raise UserError(f"{where}: no split '{cfg.train_split}'; it has: {', '.join(loaded)}")
        loaded = loaded[cfg.train_split]
    else:
      files = [f.strip() for f in cfg.hf_train_files.split(",") if f.strip()]
      for pattern in files:
        if not glob.glob(os.path.expanduser(pattern)):
          raise UserError(f"hf_train_files: {pattern} matches no files")
      if cfg.hf_path not in HF_BUILDERS and not path.exists():
        builders = ", ".join(HF_BUILDERS)
        raise UserError(
          f"hf_path {cfg.hf_path} is neither a local directory nor a builder ({builders}); hub datasets are not fetched"
        )
      data_files = {cfg.train_split: files} if files else None
      loaded = datasets.load_dataset(
        cfg.hf_path, data_dir=cfg.hf_data_dir or None, data_files=data_files, split=cfg.train_split
      )
  except UserError:
    raise
  except Exception as e:  # noqa: BLE001 - datasets raises many kinds for a bad path or split
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise UserError(f"cannot open {where}: {first}") from None
  if cfg.train_data_columns not in loaded.column_names:
    has = ", ".join(sorted(loaded.column_names))
    raise UserError(f"{where} has no column '{cfg.train_data_columns}' (train_data_columns); it has: {has}")
  return Column(loaded.select_columns([cfg.train_data_columns]), cfg.train_data_columns, where)
