"""The train state, its shardings, and the jitted training step.

  TrainState = params (weight_dtype master weights) + optimizer state
               + routing bias (not trained by gradient) + step

One step: split the batch into microbatches (gradient_accumulation_steps),
sum their gradients in float32, clip and apply AdamW, then move the routing
bias against the observed expert load. A step whose loss or gradient norm is
not finite leaves params, optimizer state and bias as they were (the step
counter still advances past the bad batch); the loop then stops or goes on by
nan_policy.

Under batch_size_schedule a step runs only the first n of those microbatches
(n from the step, known on the host): the batch argument keeps its full shape
(the rows of microbatches not run are zeros that are never read), so every
per-device shape stays that of the full step; one step is compiled per
distinct n (`jit_step(n)`), each with a static trip count, so that XLA, the
planner and the profile see the loop they run.

With gradient_accumulation_host_offload the float32 sum over microbatches
waits in pinned host memory while each microbatch runs and comes to the
device only to have that microbatch's gradient added: the same additions in
the same order, with a parameter-sized buffer off the device for the forward
and backward passes.
"""

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText import host_offload, model, params
from MaxText.config import Config
from MaxText.errors import UserError
from MaxText import gmm, schedules
from MaxText.moe import router
from MaxText.optimizer import learning_rate_schedule, make_optimizer
from MaxText.sharding import Sharder, param_shardings


class TrainState(NamedTuple):
  params: dict
  opt_state: Any
  bias: dict
  step: jax.Array


def _check_pinned_host(mesh, key: str) -> None:
  device = mesh.devices.flat[0]
  try:
    kinds = {m.kind for m in device.addressable_memories()}
  except Exception:  # noqa: BLE001 - a device type without memory spaces in its API
    return
  if kinds and host_offload.HOST not in kinds:  # compile-only devices list none: the compiler checks them
    raise UserError(
      f"{key} needs a {host_offload.HOST} memory space, which {device.platform} devices ({device.device_kind}) "
      f"do not have (they have: {', '.join(sorted(kinds))})"
    )


class Trainer:
  """Builds the state and step for one config on one mesh."""

  def __init__(self, cfg: Config, mesh: Mesh):
    device = mesh.devices.flat[0]
    moe = cfg.moe
    try:
      chosen = gmm.resolve(moe.quantization, moe.moe_gmm_backend, moe.mxfp8_impl, device, cfg.model.dtype)
    except ValueError as e:
      raise UserError(str(e)) from None
    if chosen.backend != moe.moe_gmm_backend:
      print(f"moe_gmm_backend={moe.moe_gmm_backend} -> {chosen.backend}: {chosen.why}", flush=True)
    # The layers build the expert GEMM from the resolved keys (MaxText/moe/layer.py).
    cfg = dataclasses.replace(
      cfg, moe=dataclasses.replace(moe, moe_gmm_backend=chosen.backend, mxfp8_impl=chosen.mxfp8_impl)
    )
    self.expert_gemm = chosen.name
    options = gmm.Options(moe.quantize_with_activation, moe.quantize_before_permute)
    print(gmm.describe(chosen.name, options, device), flush=True)
    self.cfg, self.mesh = cfg, mesh
    self.specs = model.model_specs(cfg.model, cfg.moe)
    t = cfg.train
    # Schedules in tokens count global batch x sequence length per step (MaxText/schedules.py); under
    # batch_size_schedule, each step's own batch.
    self.tokens_per_step = t.per_device_batch_size * mesh.size * t.max_target_length  # of a whole step
    self.batch_sizes = (
      schedules.BatchSizes(
        "batch_size_schedule",
        t.batch_size_schedule,
        microbatch_sequences=self.global_batch // t.gradient_accumulation_steps,
        max_microbatches=t.gradient_accumulation_steps,
        seq_len=t.max_target_length,
      )
      if t.batch_size_schedule
      else None
    )
    self.tokens = self.batch_sizes.tokens if self.batch_sizes else schedules.Tokens.constant(self.tokens_per_step)
    self.optimizer = make_optimizer(cfg.optimizer, t.steps, self.specs, self.tokens)
    self.schedule = learning_rate_schedule(cfg.optimizer, t.steps, self.tokens)
    self.mtp_weight = (
      schedules.Schedule("mtp_loss_scaling_factor", t.mtp_loss_scaling_factor_schedule, self.tokens)
      if t.mtp_loss_scaling_factor_schedule
      else None
    )
    self.bias_rate = (
      schedules.Schedule("routed_bias_update_rate", t.routed_bias_update_rate_schedule, self.tokens)
      if t.routed_bias_update_rate_schedule
      else None
    )
    # The schedules the log follows (train.py prints each change).
    self.schedules = [s for s in (self.schedule, self.mtp_weight, self.bias_rate) if isinstance(s, schedules.Schedule)]
    if self.batch_sizes:
      self.schedules.append(self.batch_sizes)
    if t.gradient_accumulation_host_offload:
      _check_pinned_host(mesh, "gradient_accumulation_host_offload")
    self.shard = Sharder(mesh)
    self.batch_sharding = self.shard.named(("batch", "seq"))
    self.device_state_shardings = self._state_shardings()
    # optimizer_/parameter_memory_host_offload: those parts of the state live in pinned host memory
    # between steps; the step moves them to the device first (MaxText/host_offload.py).
    self.state_shardings = host_offload.state_shardings(self.device_state_shardings, cfg.train, mesh)

  @property
  def global_batch(self) -> int:
    return self.cfg.train.per_device_batch_size * self.mesh.size

  @property
  def data_batch(self) -> int:
    """Sequences per batch of the data iterator: a step's, or under batch_size_schedule a microbatch's."""
    return self.global_batch // self.cfg.train.gradient_accumulation_steps if self.batch_sizes else self.global_batch

  def microbatches(self, step: int) -> int:
    """The microbatches step `step` runs."""
    return self.batch_sizes.microbatches(step) if self.batch_sizes else self.cfg.train.gradient_accumulation_steps

  # ---- state ----
  def abstract_state(self) -> TrainState:
    p = params.abstract(self.specs, jnp.dtype(self.cfg.model.weight_dtype))
    return TrainState(
      p,
      jax.eval_shape(self.optimizer.init, p),
      jax.eval_shape(lambda: model.bias_state(self.cfg.model, self.cfg.moe)),
      jax.ShapeDtypeStruct((), jnp.int32),
    )

  def _state_shardings(self) -> TrainState:
    replicated = NamedSharding(self.mesh, PartitionSpec())
    p_shard = param_shardings(self.specs, self.mesh)
    by_path = {tuple(path): s for path, s in jax.tree_util.tree_leaves_with_path(p_shard)}
    abstract = self.abstract_state()
    shapes = {tuple(path): a.shape for path, a in jax.tree_util.tree_leaves_with_path(abstract.params)}

    def like_param(path, leaf):
      # Optimizer moments mirror the parameter tree: shard each like its parameter.
      for i in range(len(path)):
        if shapes.get(tuple(path[i:])) == leaf.shape:
          return by_path[tuple(path[i:])]
      return replicated

    opt = jax.tree_util.tree_map_with_path(like_param, abstract.opt_state)
    bias = jax.tree.map(lambda _: replicated, abstract.bias)
    return TrainState(p_shard, opt, bias, replicated)

  def init_state(self) -> TrainState:
    dtype = jnp.dtype(self.cfg.model.weight_dtype)

    def init():
      key = jax.random.key(self.cfg.train.init_weights_seed)
      p = params.initialize(self.specs, key, dtype, self.cfg.model.param_init_std)
      return TrainState(
        p, self.optimizer.init(p), model.bias_state(self.cfg.model, self.cfg.moe), jnp.zeros((), jnp.int32)
      )

    return jax.jit(init, out_shardings=self.state_shardings)()

  # ---- step ----
  def _grads(self, p, bias, batch: model.Batch, m=None, microbatches: int | None = None):
    """Loss, aux and gradients of the first `microbatches` microbatches (all gradient_accumulation_steps by
    default), averaged over them."""
    m, moe_cfg = self.cfg.model if m is None else m, self.cfg.moe
    grad_fn = jax.value_and_grad(model.loss_fn, has_aux=True)
    accum = self.cfg.train.gradient_accumulation_steps
    runs = accum if microbatches is None else microbatches
    if accum == 1:
      return grad_fn(p, bias, batch, m, moe_cfg, self.shard)

    # Microbatch i takes rows i, i+accum, ... so that every device keeps its rows.
    def split(a):
      return a.reshape(a.shape[0] // accum, accum, *a.shape[1:]).swapaxes(0, 1)

    micro = jax.tree.map(split, batch)
    if runs != accum:  # batch_size_schedule: the first `runs` microbatches; the zero rows after them stay unread
      micro = jax.tree.map(lambda a: a[:runs], micro)

    offload = self.cfg.train.gradient_accumulation_host_offload
    to_host = lambda t: jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host), t)  # noqa: E731
    to_device = lambda t: jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), t)  # noqa: E731

    def body(acc, mb):
      (loss, aux), g = grad_fn(p, bias, model.Batch(*mb), m, moe_cfg, self.shard)
      acc_g, acc_loss, acc_aux = acc
      if offload:
        # The sum comes back from host memory only once this microbatch's gradient exists: without the
        # barrier XLA may start the copy as the body starts and hold the sum on the device through the
        # forward and backward passes, which is the memory the offload is for.
        g, acc_g = jax.lax.optimization_barrier((g, acc_g))
        acc_g = to_device(acc_g)
      acc_g = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc_g, g)
      if offload:
        acc_g = to_host(acc_g)
      acc_aux = jax.tree.map(jnp.add, acc_aux, aux)
      return (acc_g, acc_loss + loss, acc_aux), None

    zero_g = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), p)
    if offload:
      zero_g = to_host(zero_g)
    aux_shape = jax.eval_shape(
      lambda mb: grad_fn(p, bias, model.Batch(*mb), m, moe_cfg, self.shard)[0][1], jax.tree.map(lambda a: a[0], micro)
    )
    zero_aux = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), aux_shape)
    (g, loss, aux), _ = jax.lax.scan(body, (zero_g, jnp.zeros((), jnp.float32), zero_aux), micro)
    if offload:
      g = to_device(g)
    mean = lambda x: x / runs  # noqa: E731
    # Loads and dropped counts are totals over the step; losses are means over microbatches.
    aux = aux._replace(ce=mean(aux.ce), mtp=mean(aux.mtp), balance=mean(aux.balance))
    return (loss / runs, aux), jax.tree.map(lambda a: mean(a).astype(self.cfg.model.weight_dtype), g)

  def host_offload_description(self) -> str:
    return host_offload.describe(self.cfg.train)

  def step(self, state: TrainState, batch: model.Batch, microbatches: int | None = None) -> tuple[TrainState, dict]:
    """One training step over the first `microbatches` microbatches of `batch` (all by default)."""
    m, extra = self.cfg.model, {}
    p = host_offload.params_for_compute(state.params, state.step, self.device_state_shardings, self.cfg.train)
    if self.cfg.train.parameter_memory_host_offload:
      # Differentiated in the compute dtype: the fp32 copy is dead once cast (model.loss_fn's cast is then a
      # no-op), and the gradients are those of the cast's cotangents as without offload.
      p = model.cast_for_compute(p, jnp.dtype(m.dtype))
    # Scheduled values are traced functions of the step: one compiled step for all of them.
    if self.mtp_weight is not None:
      extra["mtp_loss_scaling_factor"] = self.mtp_weight(state.step)
      m = dataclasses.replace(m, mtp_loss_scaling_factor=extra["mtp_loss_scaling_factor"])
    (loss, aux), grads = self._grads(p, state.bias, batch, m, microbatches)
    grads = jax.tree.map(lambda g: g.astype(self.cfg.model.weight_dtype), grads)
    if self.batch_sizes:  # sequences this step ran
      runs = self.cfg.train.gradient_accumulation_steps if microbatches is None else microbatches
      extra["batch_size"] = jnp.int32(runs * self.batch_sizes.micro)
    with jax.named_scope("optimizer"):
      grad_norm = optax.tree.norm(grads)
      state = host_offload.state_for_update(state, grad_norm, self.device_state_shardings, self.cfg.train)
      updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
      new_params = optax.apply_updates(state.params, updates)
    bias = state.bias
    if self.cfg.moe.routed_bias and self.bias_rate is not None:
      extra["routed_bias_update_rate"] = self.bias_rate(state.step)
      bias = {k: router.update_bias(bias[k], aux.load[k], extra["routed_bias_update_rate"]) for k in bias}
    elif self.cfg.moe.routed_bias and self.cfg.moe.routed_bias_update_rate > 0:
      bias = {k: router.update_bias(bias[k], aux.load[k], self.cfg.moe.routed_bias_update_rate) for k in bias}
    loads = jnp.concatenate([aux.load["moe_layers"], aux.load["mtp_layers"]], axis=0)
    metrics = {
      "loss": loss,
      "ce_loss": aux.ce,
      "mtp_loss": aux.mtp,
      "balance_loss": aux.balance,
      "grad_norm": grad_norm,
      "learning_rate": self.schedule(state.step),
      "expert_load_max": jnp.max(loads, initial=0).astype(jnp.float32),
      "expert_load_mean": jnp.mean(loads).astype(jnp.float32) if loads.size else jnp.zeros((), jnp.float32),
      "dropped_tokens": aux.dropped,
      "ep_overflow": aux.ep_overflow,
      "ep_sent_bytes": aux.ep_sent_bytes[0],
      "ep_sent_bytes_nodedup": aux.ep_sent_bytes[1],
      **extra,  # the scheduled values of this step, when scheduled
    }
    # A non-finite loss or gradient never reaches the state, decided on device (the select fuses into the
    # update): nan_policy=skip goes on from the unchanged state, nan_policy=stop stops with no NaN ever saved.
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    # Copies that overflowed an expert-parallel buffer (moe_ep_buffer_factor > 0) were not computed:
    # that update is never applied either, and the loop stops with an error (train.py).
    apply = ok & (aux.ep_overflow == 0)
    new_params, opt_state, bias = jax.tree.map(
      lambda new, old: jnp.where(apply, new, old),
      (new_params, opt_state, bias),
      (state.params, state.opt_state, state.bias),
    )
    metrics["nonfinite"] = (~ok).astype(jnp.int32)
    return TrainState(new_params, opt_state, bias, state.step + 1), metrics

  def jit_step(self, microbatches: int | None = None):
    """The jitted step; `microbatches` (batch_size_schedule) runs only the first that many microbatches."""
    return jax.jit(
      self.step if microbatches is None else functools.partial(self.step, microbatches=microbatches),
      in_shardings=(self.state_shardings, self.batch_sharding),
      out_shardings=(self.state_shardings, None),
      donate_argnums=(0,),
    )

  def host_batch(self, microbatches: list[model.Batch]) -> model.Batch:
    """This process's rows of the step from its rows of each microbatch run (batch_size_schedule): microbatch
    i at local rows i, i+accum, ... (where _grads reads it; a process's rows are a contiguous block of the
    global batch, a whole number of accum-row groups), zeros where no microbatch runs this step."""
    accum = self.cfg.train.gradient_accumulation_steps

    def rows(parts):
      if parts[0] is None:
        return None
      out = np.zeros((parts[0].shape[0], accum, *parts[0].shape[1:]), parts[0].dtype)
      for i, part in enumerate(parts):
        out[:, i] = part
      return out.reshape(-1, *parts[0].shape[1:])

    return model.Batch(*(rows([mb[f] for mb in microbatches]) for f in range(len(model.Batch._fields))))

  def device_batch(self, host_batch: model.Batch) -> model.Batch:
    """This process's rows (numpy) -> global arrays; optional fields left None stay None."""
    return model.Batch(
      *(None if a is None else jax.make_array_from_process_local_data(self.batch_sharding, a) for a in host_batch)
    )
