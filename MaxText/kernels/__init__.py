"""GPU kernel bodies, apart from the model: nothing here imports from MaxText's other packages.

  mosaic_pipeline.py   the row-tile schedule and warp-specialized pipeline the Mosaic GPU GEMMs share
  mosaic_gmm.py        bf16 grouped GEMMs for Hopper (forward/dgrad and wgrad), with padding to tile multiples
  mosaic_fp8_gmm.py    fp8 blockwise grouped GEMMs for Hopper, scales applied in the kernel
  mosaic_tiles.py      their tile tables, one per GPU (mosaic_tiles_h200.json, ...), chosen by device kind
  triton_quantize.py   fp8_blockwise's single-pass quantisation kernels (Pallas Triton)
  fp8_scale.py         fp8_blockwise's scale rule, shared with quant/formats.py
  gpu.py, padding.py   SM count and compute capability; zero padding to tile multiples

The GEMMs built from these (their VJPs, quantisation around them, the registry) are in MaxText/gmm/.
"""
