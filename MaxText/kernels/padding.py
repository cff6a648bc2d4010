"""Zero padding to the multiples the kernels need (exact for products: zeros add nothing), sliced back by callers."""

import jax
import jax.numpy as jnp


def pad_to(a: jax.Array, axis: int, multiple: int) -> jax.Array:
  """`a` zero-padded along `axis` to a multiple of `multiple`."""
  extra = -a.shape[axis] % multiple
  if not extra:
    return a
  widths = [(0, 0)] * a.ndim
  widths[axis] = (0, extra)
  return jnp.pad(a, widths)


def pad_rows(a: jax.Array, rows: int) -> jax.Array:
  """At least `rows` rows: the kernels read whole row tiles, so tiny inputs (tests, decode) get zero rows."""
  return a if a.shape[0] >= rows else jnp.pad(a, ((0, rows - a.shape[0]), (0, 0)))
