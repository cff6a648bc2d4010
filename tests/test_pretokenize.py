"""python -m MaxText.data.pretokenize: text -> ArrayRecord shards of token ids that training reads as they are.

Round trip (the shards feed the pipeline exactly the batches on-the-fly tokenization feeds it), every input
type, byte-identical output whatever the workers and scan granularity, progress and summary, and bad input:
one `error:` line, exit 2, nothing written.
"""

import glob
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import data_builders as build
from conftest import REPO, TINY_RECIPE
from MaxText.config import load_config
from MaxText.data import make_iterator, pretokenize
from MaxText.data.sources import _parse_example
from MaxText.data.tokenizers import load_tokenizer
from MaxText.errors import UserError

BOS, EOS = 256, 257  # of the byte-level tiktoken file: token id = byte value
# JSON lines documents with what a naive reader gets wrong: newlines, quotes, non-ASCII, a long one.
DOCS = build.corpus(37) + ['with "quotes",\nnewlines\tand tabs', "héllo wörld ✓ 日本語", "long " * 300]
# Text lines with every separator str.splitlines() knows, blank lines and surrounding spaces.
TEXT = "first line\r\nsecond\rthird\x0cfourth\u2028fifth\n\n   \n  indented  \nlast without newline"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
  d = tmp_path_factory.mktemp("inputs")
  (d / "json").mkdir()
  build.write_jsonl(d / "json" / "a.jsonl", DOCS[:20])
  build.write_jsonl(d / "json" / "b.jsonl", DOCS[20:])
  (d / "lines.txt").write_text(TEXT, newline="")
  return {
    "jsonl": str(d / "json" / "*.jsonl"),
    "parquet": str(build.write_parquet(d / "docs.parquet", DOCS)),  # 7 rows a row group: several groups
    "text": str(d / "lines.txt"),
    "tiktoken": str(build.byte_tiktoken(d / "bytes.tiktoken")),
  }


def run(*argv) -> int:
  return pretokenize.main([str(a) for a in argv])


def pretok(inputs, out: Path, kind="jsonl", *extra) -> Path:
  rc = run(
    "--input", inputs[kind], "--tokenizer", inputs["tiktoken"], "--tokenizer-type", "tiktoken", "--output", out, *extra
  )
  assert rc == 0
  return out


def records(out: Path) -> list[np.ndarray]:
  import grain

  source = grain.sources.ArrayRecordDataSource(sorted(glob.glob(str(out / "*.array_record"))))
  return [_parse_example(source[i])["tokens"] for i in range(len(source))]


def iterator(keys: list[str], seq=64, local_batch=4):
  cfg = load_config(TINY_RECIPE, [*keys, "vocab_size=320"])
  return make_iterator(cfg.data, local_batch=local_batch, global_batch=local_batch, seq_len=seq, vocab_size=320)


def source_keys(inputs, kind: str) -> list[str]:
  return ["dataset_type=grain", f"grain_file_type={kind}", f"grain_train_files={inputs[kind]}"]


def shard_keys(out: Path) -> list[str]:
  return [
    "dataset_type=grain",
    "grain_file_type=arrayrecord",
    f"grain_train_files={out}/*.array_record",
    "train_data_columns=tokens",
    "tokenize_train_data=false",
  ]


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "text"])
def test_shards_hold_each_document_tokenized_in_input_order(inputs, tmp_path, kind):
  out = pretok(inputs, tmp_path / "out", kind, "--shards", "3", "--workers", "1")
  tok = load_tokenizer("tiktoken", inputs["tiktoken"])
  texts = DOCS if kind != "text" else [line for line in TEXT.splitlines() if line.strip()]
  got = records(out)
  assert len(got) == len(texts)
  for ids, text in zip(got, texts):
    np.testing.assert_array_equal(ids, [BOS, *tok.encode(text), EOS])
  manifest = json.loads((out / "manifest.json").read_text())
  assert manifest["documents"] == len(texts) and manifest["tokens"] == sum(len(r) for r in got)
  assert [s["documents"] for s in manifest["shards"]] == [
    len(texts) * (i + 1) // 3 - len(texts) * i // 3 for i in range(3)
  ]
  assert sorted(p.name for p in out.iterdir()) == ["manifest.json"] + [
    f"tokens-0000{i}-of-00003.array_record" for i in range(3)
  ]


@pytest.mark.parametrize("kind, packing", [("jsonl", "true"), ("text", "false")])
def test_training_on_shards_sees_exactly_what_on_the_fly_tokenization_gives(inputs, tmp_path, kind, packing):
  """The same shuffle, packing and batches, id for id, over more than one epoch."""
  out = pretok(inputs, tmp_path / "out", kind, "--shards", "4", "--workers", "1")
  tokenizer = ["tokenizer_type=tiktoken", f"tokenizer_path={inputs['tiktoken']}"]
  fly = iterator([*source_keys(inputs, kind), *tokenizer, f"packing={packing}"])
  pre = iterator([*shard_keys(out), f"packing={packing}"])
  total = sum(len(r) for r in records(out))
  seen = 0
  while seen < 2 * total:  # two epochs of tokens at least
    a, b = next(fly), next(pre)
    for x, y in zip(a, b):
      np.testing.assert_array_equal(x, y)
    seen += int(a.mask.sum())


def test_output_is_the_same_whatever_the_workers_and_scan_pieces(inputs, tmp_path, monkeypatch):
  base = pretok(inputs, tmp_path / "one", "jsonl", "--shards", "5", "--workers", "1")
  parallel = pretok(inputs, tmp_path / "three", "jsonl", "--shards", "5", "--workers", "3")
  # Scanned in pieces of 300 bytes with an offset kept every 2 documents: shards start by seeking mid-file.
  monkeypatch.setattr(pretokenize, "PIECE_BYTES", 300)
  monkeypatch.setattr(pretokenize, "CHECKPOINT_EVERY", 2)
  assert len(pretokenize.pieces_of(pretokenize.find_inputs([inputs["jsonl"]], "auto"))) > 10
  seeking = pretok(inputs, tmp_path / "seeking", "jsonl", "--shards", "5", "--workers", "1")
  names = sorted(p.name for p in base.iterdir())
  assert len(names) == 6
  for other in (parallel, seeking):
    assert sorted(p.name for p in other.iterdir()) == names
    for name in names:
      assert (other / name).read_bytes() == (base / name).read_bytes(), name


def test_progress_summary_and_overwrite(inputs, tmp_path, capsys):
  out = pretok(inputs, tmp_path / "out", "jsonl", "--shards", "2", "--workers", "1", "--progress-seconds", "0")
  lines = capsys.readouterr().out.splitlines()
  assert any(line.startswith("progress: 1/2 shards") for line in lines)
  total = sum(len(r) for r in records(out))
  summary = next(line for line in lines if line.startswith("pretokenized "))
  assert summary.startswith(f"pretokenized {len(DOCS)} documents into 2 shards in {out}: {total:,} tokens")
  assert "tokens/s" in summary
  train_with = next(line for line in lines if line.startswith("train with: "))
  assert f"grain_train_files={out}/tokens-*-of-00002.array_record" in train_with
  # --overwrite replaces the earlier output: no shard of the 2-shard run is left beside the 3 new ones.
  pretok(inputs, out, "jsonl", "--shards", "3", "--workers", "1", "--overwrite")
  assert sorted(p.name for p in out.glob("*.array_record")) == [
    f"tokens-0000{i}-of-00003.array_record" for i in range(3)
  ]
  assert json.loads((out / "manifest.json").read_text())["documents"] == len(DOCS)


def test_no_bos_no_eos_and_other_columns(inputs, tmp_path):
  d = tmp_path / "in"
  d.mkdir()
  build.write_jsonl(d / "x.jsonl", ["abc", "de"], column="body")
  out = tmp_path / "out"
  rc = run(
    "--input", d / "x.jsonl", "--tokenizer", inputs["tiktoken"], "--tokenizer-type", "tiktoken", "--output", out,
    "--column", "body", "--output-column", "ids", "--no-add-bos", "--workers", "1",
  )  # fmt: skip
  assert rc == 0
  import grain

  source = grain.sources.ArrayRecordDataSource([str(out / "ids-00000-of-00001.array_record")])
  assert [list(_parse_example(source[i])["ids"]) for i in range(2)] == [[97, 98, 99, EOS], [100, 101, EOS]]


def _bad_inputs(tmp: Path, inputs: dict) -> dict:
  """Name -> (argv without --output, the error line's expected start)."""
  tmp.mkdir(exist_ok=True)
  bad_json = tmp / "bad.jsonl"
  bad_json.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(5)) + "{not json\n")
  no_column = tmp / "nocol.jsonl"
  no_column.write_text(json.dumps({"body": "x"}) + "\n")
  not_string = tmp / "number.jsonl"
  not_string.write_text(json.dumps({"text": "fine"}) + "\n\n" + json.dumps({"text": 5}) + "\n")
  not_utf8 = tmp / "latin1.txt"
  not_utf8.write_bytes(b"ok\ncaf\xe9\n")
  empty = tmp / "empty.txt"
  empty.write_text("\n  \n")
  unknown = tmp / "docs.csv"
  unknown.write_text("a,b\n")
  garbage = tmp / "garbage.model"
  garbage.write_bytes(b"\x00\x01 not a tokenizer \xff" * 10)
  tiktoken = ["--tokenizer", inputs["tiktoken"], "--tokenizer-type", "tiktoken"]
  jsonl, parquet = inputs["jsonl"], inputs["parquet"]
  missing, nothing = tmp / "nope.model", tmp / "nothing-*.jsonl"
  return {
    "no match": (["--input", nothing, *tiktoken], f"error: --input {nothing} matches no files"),
    "missing tokenizer": (["--input", jsonl, "--tokenizer", missing], f"error: --tokenizer {missing} does not exist"),
    "unreadable tokenizer": (
      ["--input", jsonl, "--tokenizer", garbage],
      f"error: --tokenizer {garbage} is not a readable sentencepiece tokenizer: ",
    ),
    "bad json": (["--input", bad_json, *tiktoken], f"error: --input {bad_json} line 6: not JSON (Expecting property"),
    "no column": (
      ["--input", no_column, *tiktoken],
      f"error: --input {no_column} line 1: no field 'text' (--column); it has: body",
    ),
    "not a string": (
      ["--input", not_string, *tiktoken],
      f"error: --input {not_string} line 3: field 'text' is 5, not a string",
    ),
    "not utf-8": (["--input", not_utf8, *tiktoken], f"error: --input {not_utf8} line 2: not UTF-8"),
    "parquet column": (
      ["--input", parquet, "--column", "body", *tiktoken],
      f"error: --input {parquet}: no column 'body' (--column); it has: id, text",
    ),
    "parquet not string": (
      ["--input", parquet, "--column", "id", *tiktoken],
      f"error: --input {parquet}: column 'id' is int64, not a string",
    ),
    "no documents": (["--input", empty, *tiktoken], f"error: --input {empty} holds no documents"),
    "unknown type": (["--input", unknown, *tiktoken], f"error: cannot tell the type of {unknown} from its extension"),
    "too many shards": (
      ["--input", jsonl, "--shards", "41", *tiktoken],
      "error: --shards 41 is more than the 40 documents; every shard needs one",
    ),
    "zero shards": (["--input", jsonl, "--shards", "0", *tiktoken], "error: --shards must be at least 1, got 0"),
    "bad flag": (["--input", jsonl, "--shardz", "2", *tiktoken], "error: unrecognized arguments: --shardz 2"),
  }


@pytest.mark.parametrize(
  "case",
  [
    "no match",
    "missing tokenizer",
    "unreadable tokenizer",
    "bad json",
    "no column",
    "not a string",
    "not utf-8",
    "parquet column",
    "parquet not string",
    "no documents",
    "unknown type",
    "too many shards",
    "zero shards",
    "bad flag",
  ],
)
def test_bad_input_is_one_error_line_exit_2_and_nothing_written(inputs, tmp_path, capsys, case):
  argv, expected = _bad_inputs(tmp_path / "bad", inputs)[case]
  out = tmp_path / "out"
  assert run(*argv, "--output", out, "--workers", "1") == 2
  err = capsys.readouterr().err.splitlines()
  assert len(err) == 1 and err[0].startswith(expected), err
  assert not out.exists()


def test_existing_output_is_kept_without_overwrite_and_foreign_files_always(inputs, tmp_path, capsys):
  out = pretok(inputs, tmp_path / "out", "jsonl", "--shards", "2", "--workers", "1")
  before = {p.name: p.read_bytes() for p in out.iterdir()}
  argv = [
    "--input",
    inputs["jsonl"],
    "--tokenizer",
    inputs["tiktoken"],
    "--tokenizer-type",
    "tiktoken",
    "--output",
    out,
  ]
  capsys.readouterr()
  assert run(*argv, "--shards", "3") == 2
  assert capsys.readouterr().err.splitlines() == [
    f"error: --output {out} exists and is not empty; pass --overwrite to replace what is in it"
  ]
  (out / "notes.txt").write_text("mine")
  assert run(*argv, "--shards", "3", "--overwrite") == 2
  assert capsys.readouterr().err.splitlines()[0].startswith(f"error: --output {out} holds notes.txt, which pretokenize")
  (out / "notes.txt").unlink()
  assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # untouched by both refusals


def test_command_line_exit_code_and_single_error_line(inputs, tmp_path):
  out = tmp_path / "out"
  proc = subprocess.run(
    [sys.executable, "-m", "MaxText.data.pretokenize", "--input", str(tmp_path / "none*.txt"), "--tokenizer",
     inputs["tiktoken"], "--tokenizer-type", "tiktoken", "--output", str(out)],
    cwd=REPO, capture_output=True, text=True, timeout=120,
  )  # fmt: skip
  assert proc.returncode == 2
  assert proc.stderr.splitlines() == [f"error: --input {tmp_path}/none*.txt matches no files"]
  assert not out.exists()


def test_input_changed_after_the_scan_removes_what_was_written(inputs, tmp_path, monkeypatch, capsys):
  (tmp_path / "in").mkdir()
  doc_file = build.write_jsonl(tmp_path / "in" / "docs.jsonl", DOCS)
  plan = pretokenize.plan_shards

  def plan_then_truncate(*args):
    planned = plan(*args)
    doc_file.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:30]))  # 10 documents fewer
    return planned

  monkeypatch.setattr(pretokenize, "plan_shards", plan_then_truncate)
  out = tmp_path / "out"
  argv = ["--input", doc_file, "--tokenizer", inputs["tiktoken"], "--tokenizer-type", "tiktoken", "--output", out]
  assert run(*argv, "--shards", "2", "--workers", "1") == 2
  err = capsys.readouterr().err.splitlines()
  assert err == [
    f"error: {out}/tokens-00001-of-00002.array_record: expected 20 documents, read 10; did an input change?"
  ]
  assert not out.exists()  # shard 0 was complete, and is gone with the rest


def test_a_model_vocabulary_smaller_than_the_manifests_tokenizer_is_an_error_before_reading(inputs, tmp_path):
  out = pretok(inputs, tmp_path / "shards")
  n = json.loads((out / "manifest.json").read_text())["tokenizer"]["vocab_size"]
  cfg = load_config(TINY_RECIPE, [*shard_keys(out), f"vocab_size={n}"])
  says = rf"manifest.json says .* {n}-token tokenizer, but vocab_size={n - 1}; set vocab_size>={n}$"
  with pytest.raises(UserError, match=says):
    make_iterator(cfg.data, local_batch=2, global_batch=2, seq_len=16, vocab_size=n - 1)
  assert next(make_iterator(cfg.data, local_batch=2, global_batch=2, seq_len=16, vocab_size=n)).inputs.shape == (2, 16)
