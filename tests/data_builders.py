"""Small datasets and tokenizers written on the fly for the data, checkpoint and fault tests (nothing downloaded).

Every builder writes under the directory it is given and returns the path to pass as config.
"""

import base64
import json
from pathlib import Path

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def corpus(n: int = 40) -> list[str]:
  """n distinct short documents (ASCII, 3 to 11 words after the 'document i:' prefix)."""
  return [f"document {i}: " + " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(3 + i % 9)) for i in range(n)]


# ---- files of each format ----
def write_jsonl(path: Path, docs: list[str], column: str = "text") -> Path:
  path.write_text("".join(json.dumps({column: d, "id": i}) + "\n" for i, d in enumerate(docs)))
  return path


def write_text(path: Path, docs: list[str]) -> Path:
  path.write_text("".join(d + "\n" for d in docs))
  return path


def write_parquet(path: Path, docs: list[str]) -> Path:
  import pyarrow as pa
  import pyarrow.parquet as pq

  pq.write_table(pa.table({"text": docs, "id": list(range(len(docs)))}), path, row_group_size=7)
  return path


def tf_example(text: str) -> bytes:
  from MaxText.data import tf_example as examples

  return examples.bytes_example("text", [text.encode()])


def write_arrayrecord(path: Path, docs: list[str]) -> Path:
  from array_record.python.array_record_module import ArrayRecordWriter

  writer = ArrayRecordWriter(str(path), "group_size:1")
  for d in docs:
    writer.write(tf_example(d))
  writer.close()
  return path


def write_tfds(data_dir: Path, docs: list[str]) -> str:
  """TFDS dataset tiny_docs (splits train, validation) prepared as ArrayRecord in data_dir, without TensorFlow."""
  import tensorflow_datasets as tfds

  class TinyDocs(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))

    def _split_generators(self, dl_manager):
      return {"train": self._generate_examples(docs), "validation": self._generate_examples(docs[:3])}

    def _generate_examples(self, items):
      for i, d in enumerate(items):
        yield i, {"text": d}

  TinyDocs(data_dir=str(data_dir), file_format="array_record").download_and_prepare()
  return "tiny_docs"


def write_hf_saved(path: Path, docs: list[str]) -> Path:
  import datasets

  datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(path))
  return path


# ---- tokenizers ----
def byte_tiktoken(path: Path) -> Path:
  """A tiktoken ranks file of the 256 single bytes: token id = byte value; BOS 256, EOS 257."""
  path.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
  return path


def word_tokenizer(path: Path, docs: list[str]) -> Path:
  """A Hugging Face word-level tokenizer.json trained on docs: <unk>=0, <s>=1 (BOS), </s>=2 (EOS)."""
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers

  tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.train_from_iterator(docs, trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
  tok.save(str(path))
  return path


def sentencepiece_model(path: Path, docs: list[str], vocab_size: int = 60) -> Path:
  import io

  import sentencepiece as spm

  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(docs * 4),
    model_writer=model,
    vocab_size=vocab_size,
    model_type="bpe",
    bos_id=1,
    eos_id=2,
    pad_id=-1,
    unk_id=0,
    minloglevel=2,
  )
  path.write_bytes(model.getvalue())
  return path
