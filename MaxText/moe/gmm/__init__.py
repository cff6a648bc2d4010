"""Grouped GEMM backends behind one interface, chosen by `moe_gmm_backend`.

  gmm(x [rows, K], w [groups, K, N], group_sizes [groups]) -> [rows, N]

Rows are grouped contiguously by group; row r of group g is multiplied by w[g].
Rows past sum(group_sizes) are padding and come out as zeros.
"""

from collections.abc import Callable

import jax

Gmm = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def get_gmm(name: str) -> Gmm:
  from MaxText.moe.gmm import xla

  backends = {"xla": xla.gmm}
  if name not in backends:
    raise ValueError(f"unknown moe_gmm_backend '{name}'; choose one of: {', '.join(backends)}")
  return backends[name]
