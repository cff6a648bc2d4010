"""Dequantising the block-scaled FP8 weights of the official DeepSeek-V3 release.

The release stores most linear weights as float8 (e4m3) with one float32 scale
per block of `weight_block_size` (128 x 128) entries, in a tensor named
`<weight name>_scale_inv` of shape [ceil(rows / 128), ceil(cols / 128)]; the
weight is `fp8 value * scale` of its block, the edge blocks cut to the shape
(DeepSeek-V3 `inference/kernel.py: weight_dequant`).
"""

import math

import numpy as np

from MaxText.errors import UserError

FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
DEFAULT_BLOCK = (128, 128)


def is_fp8(dtype) -> bool:
  return np.dtype(dtype).name in FP8_DTYPES


def scale_name(weight_name: str) -> str:
  return weight_name + "_scale_inv"


def scale_shape(weight_shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
  rows, cols = weight_shape
  return math.ceil(rows / block[0]), math.ceil(cols / block[1])


def block_size(hf_config: dict) -> tuple[int, int]:
  q = hf_config.get("quantization_config") or {}
  block = q.get("weight_block_size") or DEFAULT_BLOCK
  if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
    raise UserError(f"quantization_config.weight_block_size={block!r} in config.json must be two positive integers")
  return tuple(block)


def dequantize(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], dtype) -> np.ndarray:
  """weight [rows, cols] float8 * its block scales -> [rows, cols] `dtype`, computed in float32 one block row at a
  time."""
  b0, b1 = block
  cols = weight.shape[1]
  out = np.empty(weight.shape, dtype)
  scales = scale_inv.astype(np.float32)
  for i in range(scales.shape[0]):
    row_scale = np.repeat(scales[i], b1)[:cols]
    out[i * b0 : (i + 1) * b0] = (weight[i * b0 : (i + 1) * b0].astype(np.float32) * row_scale).astype(dtype)
  return out
