"""Hopper (sm_90) grouped GEMM on our Pallas Mosaic GPU kernels, under one custom VJP.

Forward and dgrad are a ragged dot (dgrad reads w as it is, transposed in the kernel), wgrad a ragged dot
contracting the rows: kernels/mosaic_gmm.py, with widths padded and tiles chosen there. Group sizes stay on
the device: no host synchronisation. Any group sizes work, including empty groups and all rows in one.
"""

from MaxText.gmm.base import KernelGemm


def build(entry, options) -> KernelGemm:
  from MaxText.kernels import mosaic_gmm

  return KernelGemm(entry.name, mosaic_gmm.fwd, mosaic_gmm.dgrad, mosaic_gmm.wgrad)
