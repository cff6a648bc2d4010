"""Reading and writing safetensors files (the Hugging Face weight format) one tensor at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}
and then the tensors' raw little-endian bytes, back to back. We read and write
it here rather than through the `safetensors` package because that package's
NumPy backend knows neither bfloat16 nor float8, the dtypes of the DeepSeek-V3
release; reading a tensor is a seek and one read of its bytes, so converting a
700 GB checkpoint needs host memory near its largest tensor, not the model.
"""

import json
import math
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from MaxText.errors import UserError

DTYPES = {
  "F64": np.dtype(np.float64),
  "F32": np.dtype(np.float32),
  "F16": np.dtype(np.float16),
  "BF16": np.dtype(ml_dtypes.bfloat16),
  "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
  "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
  "I64": np.dtype(np.int64),
  "I32": np.dtype(np.int32),
  "I16": np.dtype(np.int16),
  "I8": np.dtype(np.int8),
  "U8": np.dtype(np.uint8),
  "BOOL": np.dtype(np.bool_),
}
NAMES = {v: k for k, v in DTYPES.items()}
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
  name: str
  file: Path
  dtype: np.dtype
  shape: tuple[int, ...]
  offset: int  # absolute byte offset of the data in `file`

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * self.dtype.itemsize


def dtype_name(dtype) -> str:
  return NAMES[np.dtype(dtype)]


def read_header(path: Path) -> dict[str, TensorInfo]:
  """The tensors of one file, by name; a malformed file is a UserError naming it."""
  size = path.stat().st_size
  with open(path, "rb") as f:
    head = f.read(8)
    length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
    if length <= 0 or 8 + length > size:
      raise UserError(f"{path} is not a safetensors file (bad header length)")
    try:
      header = json.loads(f.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError):
      raise UserError(f"{path} is not a safetensors file (its header is not JSON)") from None
  tensors = {}
  for name, entry in header.items():
    if name == "__metadata__":
      continue
    if entry.get("dtype") not in DTYPES:
      raise UserError(f"{path}: tensor {name} has dtype {entry.get('dtype')!r}, which we cannot read")
    begin, end = entry["data_offsets"]
    info = TensorInfo(name, path, DTYPES[entry["dtype"]], tuple(entry["shape"]), 8 + length + begin)
    if end - begin != info.nbytes or info.offset + info.nbytes > size:
      raise UserError(
        f"{path}: tensor {name} does not fit its shape {list(info.shape)} (the file is truncated or corrupt)"
      )
    tensors[name] = info
  return tensors


class ShardedCheckpoint:
  """Every tensor of a directory of `*.safetensors` shards, located by name; nothing is read until asked."""

  def __init__(self, directory: Path):
    self.directory = directory
    files = sorted(directory.glob("*.safetensors"))
    index = directory / INDEX_FILE
    if index.is_file():
      try:
        weight_map = json.loads(index.read_text())["weight_map"]
      except (json.JSONDecodeError, KeyError, TypeError):
        raise UserError(f"{index} is not a safetensors index (no weight_map)") from None
      missing = sorted({f for f in weight_map.values() if not (directory / f).is_file()})
      if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UserError(f"shard {directory / missing[0]} named in {index} is missing{more}")
    if not files:
      raise UserError(f"{directory} holds no *.safetensors shards")
    self.tensors: dict[str, TensorInfo] = {}
    for path in files:
      for name, info in read_header(path).items():
        if name in self.tensors:
          raise UserError(f"tensor {name} is in both {self.tensors[name].file.name} and {path.name}")
        self.tensors[name] = info

  def __contains__(self, name: str) -> bool:
    return name in self.tensors

  def read(self, name: str) -> np.ndarray:
    """One tensor, as a NumPy array of its stored dtype."""
    info = self.tensors[name]
    out = np.empty(info.shape, info.dtype)
    with open(info.file, "rb") as f:
      f.seek(info.offset)
      if f.readinto(memoryview(out.reshape(-1).view(np.uint8))) != info.nbytes:
        raise UserError(f"{info.file} ended inside tensor {name}")
    return out

  def read_rows(self, name: str, rows: int) -> Iterable[np.ndarray]:
    """A 2-D-or-more tensor in blocks of `rows` leading rows (for comparing big tensors in little memory)."""
    info = self.tensors[name]
    data = np.memmap(info.file, info.dtype, mode="r", offset=info.offset, shape=info.shape)
    for start in range(0, info.shape[0], rows):
      yield np.array(data[start : start + rows])


def write_file(
  path: Path, tensors: list[tuple[str, np.dtype, tuple[int, ...]]], produce: Callable[[str], np.ndarray]
) -> None:
  """Writes `tensors` (name, dtype, shape) into one safetensors file, asking `produce(name)` for each in turn."""
  header, offset = {}, 0
  for name, dtype, shape in tensors:
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    header[name] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  header["__metadata__"] = {"format": "pt"}  # transformers checks that the file was written for PyTorch layouts
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the reference writer does
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for name, dtype, shape in tensors:
      array = np.ascontiguousarray(produce(name))
      assert array.dtype == np.dtype(dtype) and array.shape == tuple(shape), (
        name,
        array.dtype,
        array.shape,
        dtype,
        shape,
      )
      f.write(memoryview(array.reshape(-1).view(np.uint8)))
