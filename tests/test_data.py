"""Data: every dataset_type and file format (built on the fly), tokenizers, packing, sharding, exact resume, errors."""

import json
import os
import tempfile
from pathlib import Path

# Hugging Face datasets caches what it reads; keep that out of the home directory and off the network.
os.environ.setdefault("HF_DATASETS_CACHE", str(Path(tempfile.gettempdir()) / "maxtext-tests-hf-cache"))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import data_builders as build  # noqa: E402
from conftest import TINY_RECIPE, train_cli  # noqa: E402
from MaxText import model, params  # noqa: E402
from MaxText.config import load_config  # noqa: E402
from MaxText.data import make_iterator  # noqa: E402
from MaxText.data.pipeline import pieces  # noqa: E402
from MaxText.data.tokenizers import load_tokenizer  # noqa: E402
from MaxText.errors import UserError  # noqa: E402
from MaxText.sharding import Sharder  # noqa: E402

DOCS = build.corpus(40)
BOS, EOS = 256, 257  # of the byte-level tiktoken file: token id = byte value


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp("data")
  (d / "json").mkdir()
  half = len(DOCS) // 2
  build.write_jsonl(d / "json" / "a.jsonl", DOCS[:half])
  build.write_jsonl(d / "json" / "b.jsonl", DOCS[half:])
  return {
    "jsonl": str(d / "json" / "*.jsonl"),
    "parquet": str(build.write_parquet(d / "docs.parquet", DOCS)),
    "text": str(build.write_text(d / "docs.txt", DOCS)),
    "arrayrecord": str(build.write_arrayrecord(d / "docs.array_record", DOCS)),
    "tfds_dir": str(d / "tfds"),
    "tfds": build.write_tfds(d / "tfds", DOCS),
    "hf_saved": str(build.write_hf_saved(d / "hf_saved", DOCS)),
    "tiktoken": str(build.byte_tiktoken(d / "bytes.tiktoken")),
    "hf_tokenizer": str(build.word_tokenizer(d / "tokenizer.json", DOCS)),
    "sentencepiece": str(build.sentencepiece_model(d / "sp.model", DOCS)),
  }


def source_keys(files, kind: str) -> list[str]:
  return {
    "grain-jsonl": ["dataset_type=grain", "grain_file_type=jsonl", f"grain_train_files={files['jsonl']}"],
    "grain-parquet": ["dataset_type=grain", "grain_file_type=parquet", f"grain_train_files={files['parquet']}"],
    "grain-text": ["dataset_type=grain", "grain_file_type=text", f"grain_train_files={files['text']}"],
    "grain-arrayrecord": [
      "dataset_type=grain",
      "grain_file_type=arrayrecord",
      f"grain_train_files={files['arrayrecord']}",
    ],
    "tfds": ["dataset_type=tfds", f"dataset_name={files['tfds']}", f"dataset_path={files['tfds_dir']}"],
    "hf-json": ["dataset_type=hf", "hf_path=json", f"hf_train_files={files['jsonl']}"],
    "hf-saved": ["dataset_type=hf", f"hf_path={files['hf_saved']}"],
  }[kind]


def open_data(
  files, kind="grain-jsonl", *overrides, seq=128, local_batch=4, process_index=0, process_count=1, vocab=320
):
  keys = [*source_keys(files, kind), "tokenizer_type=tiktoken", f"tokenizer_path={files['tiktoken']}", *overrides]
  cfg = load_config(TINY_RECIPE, keys)
  return make_iterator(
    cfg.data,
    local_batch=local_batch,
    global_batch=local_batch * process_count,
    seq_len=seq,
    vocab_size=vocab,
    process_index=process_index,
    process_count=process_count,
  )


def documents(batch: model.Batch) -> list[str]:
  """The texts in a batch of byte-token rows: one per segment (packed) or per row, BOS/EOS stripped."""
  out = []
  for r in range(batch.inputs.shape[0]):
    seg = batch.segment_ids[r] if batch.segment_ids is not None else (batch.mask[r] > 0).astype(np.int32)
    for s in np.unique(seg[seg > 0]):
      idx = np.flatnonzero(seg == s)
      ids = [*batch.inputs[r, idx], batch.targets[r, idx[-1]]]
      assert ids[0] == BOS and ids[-1] == EOS
      out.append(bytes(ids[1:-1]).decode())
  return out


@pytest.mark.parametrize(
  "kind", ["grain-jsonl", "grain-parquet", "grain-text", "grain-arrayrecord", "tfds", "hf-json", "hf-saved"]
)
def test_every_source_yields_exactly_the_documents(files, kind):
  it = open_data(files, kind)
  seen = []
  while len(seen) < 2 * len(DOCS):
    seen += documents(next(it))
  assert set(seen) == set(DOCS)  # nothing lost, nothing invented, over two epochs


def test_shuffle_gives_a_new_order_each_epoch_and_off_keeps_file_order(files):
  rows = lambda it, n: [d for _ in range(n // 4) for d in documents(next(it))]  # noqa: E731
  shuffled = rows(open_data(files, "grain-jsonl", "packing=false"), 2 * len(DOCS))
  first, second = shuffled[: len(DOCS)], shuffled[len(DOCS) :]
  assert sorted(first) == sorted(DOCS) and sorted(second) == sorted(DOCS)
  assert first != DOCS and second != first
  assert rows(open_data(files, "grain-jsonl", "packing=false", "enable_data_shuffling=false"), len(DOCS)) == DOCS


def test_packing_segments_positions_and_targets(files):
  batch = next(open_data(files, "grain-jsonl", seq=64, local_batch=8))
  assert batch.inputs.shape == batch.segment_ids.shape == batch.positions.shape == (8, 64)
  assert max(len(np.unique(s[s > 0])) for s in batch.segment_ids) >= 2  # rows do hold several documents
  for inp, tgt, seg, pos, mask in zip(batch.inputs, batch.targets, batch.segment_ids, batch.positions, batch.mask):
    real = seg > 0
    np.testing.assert_array_equal(mask, real.astype(np.float32))
    assert not real[np.argmin(real) :].any() if not real.all() else True  # padding only at the end
    ids = seg[real]
    np.testing.assert_array_equal(np.unique(ids), np.arange(1, ids.max() + 1))  # segments 1..k in order
    assert np.all(np.diff(ids) >= 0)
    for s in np.unique(ids):
      np.testing.assert_array_equal(pos[seg == s], np.arange((seg == s).sum()))  # positions restart per document
    same = (seg[:-1] == seg[1:]) & real[:-1]
    np.testing.assert_array_equal(tgt[:-1][same], inp[1:][same])  # next-token targets within a document


def test_no_packing_is_one_document_per_row_padded(files):
  batch = next(open_data(files, "grain-jsonl", "packing=false"))
  assert batch.segment_ids is None and batch.positions is None
  assert len(documents(batch)) == 4
  for mask in batch.mask:
    n = int(mask.sum())
    assert mask[:n].all() and not mask[n:].any()


@pytest.mark.parametrize("n", [0, 1, 2, 5, 64, 65, 66, 130, 200])
def test_long_documents_become_pieces_that_lose_no_token(n):
  ids = np.arange(n, dtype=np.int32)
  out = pieces(ids, 64)
  assert all(1 <= len(p["inputs"]) <= 64 and len(p["inputs"]) == len(p["targets"]) for p in out)
  if n >= 2:
    np.testing.assert_array_equal(np.concatenate([p["inputs"] for p in out] + [out[-1]["targets"][-1:]]), ids)
    for p in out:
      np.testing.assert_array_equal(p["targets"], p["inputs"] + 1)
  else:
    assert out == []


def test_two_processes_read_disjoint_halves(files):
  halves = []
  for process in range(2):
    it = open_data(files, "grain-jsonl", "packing=false", process_index=process, process_count=2)
    halves.append([d for _ in range(len(DOCS) // 2 // 4) for d in documents(next(it))])
  assert len(halves[0]) == len(halves[1]) == len(DOCS) // 2
  assert not set(halves[0]) & set(halves[1])
  assert set(halves[0]) | set(halves[1]) == set(DOCS)


def test_piece_shuffle_window_reorders_pieces_within_each_window_only(files):
  def rows(*overrides, n=48):  # packing=false: one piece a row; 16-token rows cut the documents into pieces
    it = open_data(files, "grain-jsonl", "packing=false", *overrides, seq=16)
    out = []
    while len(out) < n:
      b = next(it)
      out += [(*b.inputs[r, b.mask[r] > 0].tolist(), int(b.targets[r, b.mask[r] > 0][-1])) for r in range(4)]
    return out

  plain, windowed = rows(), rows("piece_shuffle_window=12")
  assert windowed != plain
  for w in range(0, 48, 12):  # the same pieces in each window of 12, in another order
    assert sorted(windowed[w : w + 12]) == sorted(plain[w : w + 12])
  assert sum(row[-1] != EOS for row in plain) > 0  # documents do span several pieces here
  assert rows("piece_shuffle_window=12", "data_shuffle_seed=1") != windowed  # the seed sets the order


@pytest.mark.parametrize("kind", ["grain-jsonl", "grain-jsonl-piece-shuffle", "synthetic"])
def test_restored_iterator_yields_the_same_batches(files, kind):
  if kind == "synthetic":
    cfg = load_config(TINY_RECIPE, ["synthetic_data=random"])
    make = lambda: make_iterator(cfg.data, local_batch=4, global_batch=4, seq_len=16, vocab_size=256)  # noqa: E731
  elif kind == "grain-jsonl-piece-shuffle":  # the state taken and restored part-way through a window
    make = lambda: open_data(files, "grain-jsonl", "piece_shuffle_window=7", seq=48)  # noqa: E731
  else:
    make = lambda: open_data(files, kind, seq=48)  # noqa: E731
  it = make()
  for _ in range(7):  # past the end of the first epoch
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  expected = [next(it) for _ in range(5)]
  again = make()
  again.set_state(state)
  for want, got in zip(expected, [next(again) for _ in range(5)]):
    for a, b in zip(want, got):
      np.testing.assert_array_equal(a, b)


def test_tokenizers_of_each_kind(files):
  kinds = [
    ("sentencepiece", "sentencepiece", (1, 2)),
    ("huggingface", "hf_tokenizer", (1, 2)),
    ("tiktoken", "tiktoken", (BOS, EOS)),
  ]
  for kind, path, (bos, eos) in kinds:
    tok = load_tokenizer(kind, files[path])
    assert (tok.bos_id, tok.eos_id) == (bos, eos)
    ids = tok.encode(DOCS[5])
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
  assert load_tokenizer("tiktoken", files["tiktoken"]).encode("hé") == list("hé".encode())


@pytest.mark.parametrize("kind", ["sentencepiece", "tiktoken", "huggingface"])
def test_unreadable_tokenizer_is_one_line_error(tmp_path, kind):
  garbage = tmp_path / "garbage.bin"
  garbage.write_bytes(b"\x00\x01 not a tokenizer \xff" * 10)
  with pytest.raises(UserError, match=f"is not a readable {kind} tokenizer") as e:
    load_tokenizer(kind, str(garbage))
  assert "\n" not in str(e.value)
  with pytest.raises(UserError, match="does not exist"):
    load_tokenizer(kind, str(tmp_path / "missing"))


@pytest.mark.parametrize(
  "kind, overrides, message",
  [
    (
      "grain-jsonl",
      ["grain_train_files=/nonexistent/*.jsonl"],
      "grain_train_files: /nonexistent/*.jsonl matches no files",
    ),
    ("grain-jsonl", ["train_data_columns=body"], "has no column 'body' (train_data_columns); it has: id, text"),
    ("grain-arrayrecord", ["train_data_columns=body"], "has no column 'body' (train_data_columns); it has: text"),
    ("tfds", ["dataset_name=no_such_dataset"], "cannot open tfds dataset no_such_dataset"),
    ("hf-json", ["hf_train_files=/nonexistent/*.jsonl"], "hf_train_files: /nonexistent/*.jsonl matches no files"),
    ("hf-json", ["hf_path=/nonexistent/dir"], "hf_path /nonexistent/dir is neither a local directory nor a builder"),
    ("grain-jsonl", ["tokenizer_path=/nonexistent.model"], "tokenizer_path /nonexistent.model does not exist"),
  ],
)
def test_missing_data_is_one_line_error(files, kind, overrides, message):
  with pytest.raises(UserError) as e:
    open_data(files, kind, *overrides)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_tokenizer_larger_than_vocab_is_an_error(files):
  with pytest.raises(UserError, match="has 258 tokens but vocab_size=256; raise vocab_size"):
    open_data(files, "grain-jsonl", vocab=256)


@pytest.mark.parametrize(
  "overrides, message",
  [
    (["dataset_type=grain"], "grain_train_files: dataset_type=grain needs grain_train_files"),
    (["dataset_type=tfds", "tokenizer_path=t.model"], "dataset_name: dataset_type=tfds needs dataset_name"),
    (["dataset_type=hf", "hf_path=json"], "tokenizer_path: dataset_type=hf needs a tokenizer file"),
    (
      ["dataset_type=hf", "hf_path=json", "tokenizer_path=t", "attention=cudnn_flash"],
      "packing: packed rows need segment-aware attention: set attention=dot_product",
    ),
  ],
)
def test_config_checks_for_real_data(overrides, message):
  with pytest.raises(UserError, match=message.replace("(", r"\(")):
    load_config(TINY_RECIPE, overrides)


def test_cli_missing_dataset_exits_2_and_writes_nothing(tmp_path, files):
  out = tmp_path / "runs"
  args = [
    "dataset_type=grain",
    "grain_file_type=jsonl",
    "grain_train_files=/nonexistent/*.jsonl",
    "tokenizer_type=tiktoken",
    f"tokenizer_path={files['tiktoken']}",
    "vocab_size=320",
    f"base_output_directory={out}",
  ]
  proc = train_cli(str(TINY_RECIPE), *args)
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.strip().splitlines() == ["error: grain_train_files: /nonexistent/*.jsonl matches no files"]
  assert not out.exists()


def test_packed_documents_do_not_see_each_other(tiny_config):
  """Doc B packed after doc A gets the logits it gets alone in a row: attention and positions restart."""
  cfg = tiny_config("n_routing_groups=1", "topk_routing_group=1", "mtp_num_layers=0")
  p = params.initialize(model.model_specs(cfg.model, cfg.moe), jax.random.key(0), jnp.float32, cfg.model.param_init_std)
  bias = model.bias_state(cfg.model, cfg.moe)
  a, b = np.arange(3, 8), np.arange(40, 47)
  seq = 16

  def row(*docs):
    tokens, seg, pos = np.zeros(seq, np.int32), np.zeros(seq, np.int32), np.zeros(seq, np.int32)
    at = 0
    for i, d in enumerate(docs, 1):
      tokens[at : at + len(d)], seg[at : at + len(d)], pos[at : at + len(d)] = d, i, np.arange(len(d))
      at += len(d)
    return tokens, seg, pos

  rows = [row(a, b), row(b), row(a)]
  tokens, seg, pos = (np.stack(x) for x in zip(*rows))
  batch = model.Batch(tokens, tokens, (seg > 0).astype(np.float32), seg, pos)
  _, _, logits = model.forward(p, bias, batch, cfg.model, cfg.moe, Sharder())
  np.testing.assert_allclose(logits[0, 5:12], logits[1, :7], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(logits[0, :5], logits[2, :5], rtol=1e-5, atol=1e-5)
  # and without segment ids, doc B would see doc A: the check above is not vacuous
  _, _, unpacked = model.forward(
    p, bias, batch._replace(segment_ids=None, positions=None), cfg.model, cfg.moe, Sharder()
  )
  assert not np.allclose(unpacked[0, 5:12], logits[1, :7], atol=1e-4)


def test_pretokenized_column_is_used_as_is(tmp_path):
  rows = [{"ids": list(range(i, i + 3 + i % 5))} for i in range(10)]
  (tmp_path / "ids.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  keys = [
    "dataset_type=grain",
    "grain_file_type=jsonl",
    f"grain_train_files={tmp_path / 'ids.jsonl'}",
    "tokenize_train_data=false",
    "train_data_columns=ids",
    "packing=false",
    "enable_data_shuffling=false",
  ]
  cfg = load_config(TINY_RECIPE, keys)
  batch = next(make_iterator(cfg.data, local_batch=2, global_batch=2, seq_len=16, vocab_size=256))
  for r, row in enumerate(rows[:2]):
    n = len(row["ids"]) - 1
    np.testing.assert_array_equal(batch.inputs[r, :n], row["ids"][:-1])
    np.testing.assert_array_equal(batch.targets[r, :n], row["ids"][1:])
  # A token id beyond the vocabulary: in the first document, found when the data is opened (before anything is
  # written); in a later one, when it is read. One line either way.
  (tmp_path / "ids.jsonl").write_text(json.dumps({"ids": [1, 300, 2]}) + "\n")
  with pytest.raises(UserError, match="token id 300 is outside vocab_size=256: .*raise vocab_size"):
    make_iterator(cfg.data, local_batch=2, global_batch=2, seq_len=16, vocab_size=256)
  (tmp_path / "ids.jsonl").write_text("".join(json.dumps({"ids": ids}) + "\n" for ids in ([1, 2, 3], [4, -1, 5])))
  data = make_iterator(cfg.data, local_batch=2, global_batch=2, seq_len=16, vocab_size=256)
  with pytest.raises(UserError, match="token id -1 is outside vocab_size=256"):
    next(data)
