"""tf.train.Example records read and written with protobuf alone: no TensorFlow, no tensorflow_datasets.

ArrayRecord corpora (TFDS's, MaxText's conversions, data/pretokenize.py's shards) hold serialized
tf.train.Example messages. The message classes usually come from TensorFlow or from
tensorflow_datasets.proto; the loader needs neither, so the six messages are declared here, in code,
with the package name (`tensorflow`), field numbers and packing of TensorFlow's example.proto and
feature.proto. The bytes are the same both ways: records written here read with TensorFlow's classes
and the other way round (tests/test_tf_example.py checks it against tensorflow_datasets.proto).

The descriptors live in a private DescriptorPool, not protobuf's default one, so that importing this
module next to TensorFlow or tensorflow_datasets (which register `tensorflow.Example` themselves) never
clashes.
"""

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_PACKAGE = "tensorflow"
_F = descriptor_pb2.FieldDescriptorProto


def _field(message, name: str, number: int, kind: int, *, repeated=False, type_name=None, oneof=None, packed=False):
  field = message.field.add(name=name, number=number, type=kind)
  field.label = _F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL
  if type_name:
    field.type_name = f".{_PACKAGE}.{type_name}"
  if oneof is not None:
    field.oneof_index = oneof
  if packed:
    field.options.packed = True
  return field


def _file() -> descriptor_pb2.FileDescriptorProto:
  # proto3, as TensorFlow's files are: repeated numbers are packed on the wire.
  f = descriptor_pb2.FileDescriptorProto(name="maxtext/tf_example.proto", package=_PACKAGE, syntax="proto3")
  for name, kind in (("BytesList", _F.TYPE_BYTES), ("FloatList", _F.TYPE_FLOAT), ("Int64List", _F.TYPE_INT64)):
    _field(f.message_type.add(name=name), "value", 1, kind, repeated=True, packed=kind != _F.TYPE_BYTES)

  feature = f.message_type.add(name="Feature")
  feature.oneof_decl.add(name="kind")
  for number, (name, type_name) in enumerate(
    (("bytes_list", "BytesList"), ("float_list", "FloatList"), ("int64_list", "Int64List")), start=1
  ):
    _field(feature, name, number, _F.TYPE_MESSAGE, type_name=type_name, oneof=0)

  features = f.message_type.add(name="Features")
  entry = features.nested_type.add(name="FeatureEntry")  # map<string, Feature> is a repeated map entry
  entry.options.map_entry = True
  _field(entry, "key", 1, _F.TYPE_STRING)
  _field(entry, "value", 2, _F.TYPE_MESSAGE, type_name="Feature")
  _field(features, "feature", 1, _F.TYPE_MESSAGE, repeated=True, type_name="Features.FeatureEntry")

  _field(f.message_type.add(name="Example"), "features", 1, _F.TYPE_MESSAGE, type_name="Features")
  return f


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_file())


def _class(name: str):
  return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{_PACKAGE}.{name}"))


Example, Features, Feature = _class("Example"), _class("Features"), _class("Feature")
BytesList, FloatList, Int64List = _class("BytesList"), _class("FloatList"), _class("Int64List")

# The numeric kinds and the numpy dtype parse() gives them.
NUMERIC_FEATURES = {"int64_list": np.int64, "float_list": np.float32}


def int64_example(name: str, ids) -> bytes:
  """A serialized Example with one int64 feature `name` (token ids, say)."""
  feature = Feature(int64_list=Int64List(value=ids))
  return Example(features=Features(feature={name: feature})).SerializeToString()


def bytes_example(name: str, values) -> bytes:
  """A serialized Example with one bytes feature `name`; `values` a list of bytes."""
  feature = Feature(bytes_list=BytesList(value=values))
  return Example(features=Features(feature={name: feature})).SerializeToString()


def parse(record: bytes) -> dict:
  """Serialized Example -> {feature: bytes | list of bytes | int64 array | float32 array}.

  Numeric features become numpy arrays straight from protobuf's repeated field (for a document of token
  ids ~25x faster than a list of Python ints). A bytes feature with one value is that value, otherwise a
  list; a feature with no kind set is [].
  """
  out = {}
  for name, feature in Example.FromString(record).features.feature.items():
    kind = feature.WhichOneof("kind")
    if kind in NUMERIC_FEATURES:
      out[name] = np.array(getattr(feature, kind).value, NUMERIC_FEATURES[kind])
      continue
    values = list(feature.bytes_list.value) if kind else []
    out[name] = values[0] if len(values) == 1 else values
  return out
