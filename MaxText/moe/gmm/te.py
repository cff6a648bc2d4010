"""Transformer Engine's grouped GEMM (transformer_engine.jax.dense.grouped_dense), when TE is installed.

TE brings its own VJP (cuBLAS grouped GEMMs). Imported only when this backend is chosen.
"""

import jax


def gmm(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
  from transformer_engine.jax.dense import grouped_dense

  return grouped_dense(x, w, group_sizes.astype("int32"), contracting_dims=((1,), (1,)))
