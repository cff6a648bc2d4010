"""Row gathers by a computed index, for the MoE permutation (moe/), expert parallelism (moe/ep/) and the
quantised GEMMs' per-group row alignment (quant/groups.py)."""

import jax
import jax.numpy as jnp


def gather_rows(a: jax.Array, index: jax.Array) -> jax.Array:
  """a[index] along axis 0, zero where index is out of range.

  The index is materialised first: otherwise XLA fuses the plan's whole index arithmetic (its sorts'
  outputs, group tables, divisions) into the row gather, and every element of every row recomputes
  it (on an H200 the 65,536-row gather ran at a quarter of the memory bandwidth that way). Every row
  gather by a computed index goes through here (EP dispatch, fp8's group alignment too)."""
  index = jax.lax.optimization_barrier(index)
  return jnp.take(a, index, axis=0, mode="fill", fill_value=0)
