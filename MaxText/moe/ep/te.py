"""moe_dispatch=te: Transformer Engine's expert-parallel dispatch/combine, when it can run here.

TE's JAX EP API (`transformer_engine.jax.ep`: ep_bootstrap, ep_make_handle, ep_dispatch,
ep_combine; NCCL EP kernels, added to TE's main branch in 2026) has requirements this stack does
not meet yet: one GPU per process (it refuses jax.local_device_count() != 1, and we run one process
per host), a bootstrap with the mesh's EP axis registered in TE's global MeshResource before
tracing, and a distinct EpHandle per layer (our MoE layers run under one lax.scan body). So this
backend reports exactly what is missing at config time, and never falls back to another one.
"""

import importlib.util

INSTALL = "pip install 'transformer_engine[jax]' (a build with transformer_engine.jax.ep)"


def _find(name: str) -> bool:
  try:
    return importlib.util.find_spec(name) is not None
  except (ModuleNotFoundError, ValueError):
    return False


def unavailable() -> str:
  if not _find("transformer_engine"):
    return f"transformer_engine is not installed; {INSTALL}, or choose ragged_a2a | dense_a2a | allgather"
  if not _find("transformer_engine.jax"):
    return f"transformer_engine is installed without its JAX extension; {INSTALL}"
  if not _find("transformer_engine.jax.ep"):
    return "this transformer_engine has no JAX expert-parallel API (transformer_engine.jax.ep); upgrade it, or choose ragged_a2a | dense_a2a | allgather"
  return (
    "transformer_engine.jax.ep is installed but not integrated: it needs one GPU per process, a per-layer "
    "EpHandle (no scan over MoE layers) and ep_bootstrap before tracing; choose ragged_a2a | dense_a2a | allgather"
  )
