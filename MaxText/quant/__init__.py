"""Block-scaled FP8 number formats (formats.py: MXFP8 and DeepSeek-V3's fp8_blockwise, in jnp) and the per-group
row alignment that keeps row blocks inside one expert (groups.py).

The quantised grouped GEMMs that use them are entries of the expert-GEMM registry (MaxText/gmm/): `mxfp8:*`
and `fp8_blockwise:*`, chosen by `quantization` with `moe_gmm_backend`.
"""
