"""MaxText/data/tf_example.py against tensorflow_datasets.proto: the same bytes, read both ways, one process."""

import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO

from MaxText.data import tf_example as ours

INT64S = [0, 1, -1, 127, 128, -(2**31), 2**32, 2**32 + 7, -(2**40) - 3, 2**63 - 1, -(2**63)]
FLOATS = [0.0, -0.0, 1.5, -2.25, 3.0e38, 1.0e-30, float("inf"), float("-inf")]
BYTES = [b"", b"a", "ünïcode".encode(), bytes(range(256))]


@pytest.fixture(scope="module")
def tfds_pb():
  from tensorflow_datasets.proto import tf_example_pb2, tf_feature_pb2

  return tf_example_pb2, tf_feature_pb2


def _example(example_cls, pb, features: dict):
  """An Example of {name: (kind, values)} built with one module's classes; kind None: a Feature with nothing set."""
  lists = {"int64_list": pb.Int64List, "float_list": pb.FloatList, "bytes_list": pb.BytesList}
  built = {}
  for name, (kind, values) in features.items():
    built[name] = pb.Feature(**{kind: lists[kind](value=values)}) if kind else pb.Feature()
  return example_cls(features=pb.Features(feature=built))


def _both(tfds_pb, features: dict) -> tuple[bytes, bytes]:
  example_pb2, feature_pb2 = tfds_pb
  theirs = _example(example_pb2.Example, feature_pb2, features).SerializeToString(deterministic=True)
  return _example(ours.Example, ours, features).SerializeToString(deterministic=True), theirs


CASES = {
  "int64": {"ids": ("int64_list", INT64S)},
  "int64-tokens": {"tokens": ("int64_list", list(range(0, 130_000, 37)))},
  "float": {"x": ("float_list", FLOATS)},
  "bytes": {"text": ("bytes_list", BYTES)},
  "one-bytes": {"text": ("bytes_list", [b"hello"])},
  "empty-lists": {"a": ("int64_list", []), "b": ("float_list", []), "c": ("bytes_list", [])},
  "no-kind": {"nothing": (None, None)},
  "several": {
    "tokens": ("int64_list", INT64S),
    "weights": ("float_list", FLOATS),
    "text": ("bytes_list", BYTES),
    "id": ("bytes_list", [b"doc-7"]),
    "length": ("int64_list", [4096]),
  },
}


@pytest.mark.parametrize("case", CASES)
def test_same_bytes_as_tfds(tfds_pb, case):
  mine, theirs = _both(tfds_pb, CASES[case])
  assert mine == theirs
  # and each side reads the other's bytes back as the same message
  example_pb2, _ = tfds_pb
  assert example_pb2.Example.FromString(mine).SerializeToString(deterministic=True) == theirs
  assert ours.Example.FromString(theirs).SerializeToString(deterministic=True) == mine


def test_helpers_match_tfds(tfds_pb):
  example_pb2, pb = tfds_pb
  ids = [2, 31_999, 2**32 + 1, -5, 1]
  expected = example_pb2.Example(
    features=pb.Features(feature={"tokens": pb.Feature(int64_list=pb.Int64List(value=ids))})
  ).SerializeToString()
  assert ours.int64_example("tokens", ids) == expected
  assert ours.int64_example("tokens", np.array(ids, np.int64)) == expected
  expected = example_pb2.Example(
    features=pb.Features(feature={"text": pb.Feature(bytes_list=pb.BytesList(value=[b"doc one"]))})
  ).SerializeToString()
  assert ours.bytes_example("text", [b"doc one"]) == expected


def test_parse_reads_tfds_records(tfds_pb):
  _, theirs = _both(tfds_pb, CASES["several"] | CASES["empty-lists"] | CASES["no-kind"])
  parsed = ours.parse(theirs)
  assert set(parsed) == {"tokens", "weights", "text", "id", "length", "a", "b", "c", "nothing"}
  assert parsed["tokens"].dtype == np.int64 and parsed["tokens"].tolist() == INT64S
  assert parsed["length"].dtype == np.int64 and parsed["length"].tolist() == [4096]
  assert parsed["weights"].dtype == np.float32
  np.testing.assert_array_equal(parsed["weights"], np.array(FLOATS, np.float32))
  assert np.signbit(parsed["weights"][1])  # -0.0 kept
  assert parsed["text"] == BYTES
  assert parsed["id"] == b"doc-7"  # a single bytes value is unwrapped
  assert parsed["a"].dtype == np.int64 and parsed["a"].size == 0
  assert parsed["b"].dtype == np.float32 and parsed["b"].size == 0
  assert parsed["c"] == [] and parsed["nothing"] == []


def test_sources_parse_is_ours(tfds_pb):
  from MaxText.data.sources import _parse_example

  record = ours.int64_example("tokens", [5, 6, 7])
  out = _parse_example(record)
  assert list(out) == ["tokens"] and out["tokens"].dtype == np.int64 and out["tokens"].tolist() == [5, 6, 7]
  assert _parse_example(ours.bytes_example("text", [b"abc"])) == {"text": b"abc"}


def test_private_pool():
  from google.protobuf import descriptor_pool

  assert ours.Example.DESCRIPTOR.file.pool is not descriptor_pool.Default()
  assert ours.Example.DESCRIPTOR.full_name == "tensorflow.Example"
  assert [f.number for f in ours.Feature.DESCRIPTOR.fields] == [1, 2, 3]
  assert ours.Int64List.DESCRIPTOR.fields[0].is_packed and ours.FloatList.DESCRIPTOR.fields[0].is_packed


IMPORT_ORDERS = {
  "ours-first": "from MaxText.data import tf_example as a\nfrom tensorflow_datasets.proto import tf_example_pb2 as b\n",
  "tfds-first": "from tensorflow_datasets.proto import tf_example_pb2 as b\nfrom MaxText.data import tf_example as a\n",
}


@pytest.mark.parametrize("order", IMPORT_ORDERS)
def test_one_process_with_tfds(order):
  """Both sets of `tensorflow.Example` classes in one fresh interpreter, imported in either order."""
  code = IMPORT_ORDERS[order] + (
    "record = a.int64_example('t', [1, 2])\n"
    "assert list(b.Example.FromString(record).features.feature['t'].int64_list.value) == [1, 2]\n"
    "assert a.parse(b.Example.FromString(record).SerializeToString())['t'].tolist() == [1, 2]\n"
    "print('ok')\n"
  )
  run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


def test_no_tensorflow_datasets_import():
  code = (
    "import sys\nfrom MaxText.data import tf_example, pretokenize, sources\n"
    "sources._parse_example(pretokenize.example_bytes('t', [1]))\n"
    "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'tensorflow_datasets')))\n"
  )
  run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert run.returncode == 0, run.stderr
  assert run.stdout.strip() == "[]"
