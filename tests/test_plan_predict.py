"""The planner's compute prediction (MaxText/plan/predict.py) against the 1-GPU proxy measured on an H200
(benchmarks/results/2026-12-03-h200-proxy-b4, 2026-12-02-h200-foundation): within 10% of each step time."""

import pytest

from MaxText import compile_only
from MaxText.config import load_config
from MaxText.plan import predict

# The proxy's train state per GPU as the planner reports it (fp32 weights; bf16 moments in optimized.yml).
PARAMETERS = 15_855_173_632
PROXY = "recipes/deepseek_v3_proxy_1gpu/"


@pytest.mark.parametrize(
  "recipe, batch, measured_s, moments_bytes",
  [("optimized.yml", 2, 0.3627, 2), ("optimized.yml", 4, 0.6925, 2), ("optimized.yml", 5, 0.8570, 2),
   ("baseline.yml", 2, 1.867, 4)],
)  # fmt: skip
def test_proxy_step_within_10_percent_of_the_h200(recipe, batch, measured_s, moments_bytes):
  cfg = load_config(PROXY + recipe, [f"per_device_batch_size={batch}"])
  state = {"parameters": PARAMETERS, "optimizer_state": PARAMETERS * moments_bytes // 2}
  c = predict.compute_time(cfg, compile_only.GPUS["h200"], batch * 4096, 16, state)
  assert abs(c.total / measured_s - 1) < 0.10, (c.total, c.seconds)
  assert set(c.seconds) == {"attention", "expert_gemms", "dense_gemms", "heads", "other", "optimizer"}


def test_moe_dispatch_and_combine_are_the_exchanges_not_the_expert_weights():
  """Per MoE layer: the all-to-alls and the allgather dispatch's gathers (ep_dispatch / ep_combine scopes),
  forward and backward apart; the experts' weight gathers inside the same shard_map are not counted."""
  body = "jit(step)/jvp()/while/body/eval_jaxpr/moe/shard_map"
  comm = [
    {"kind": "ragged-all-to-all", "op_name": f"{body}/ep_dispatch/ragged_all_to_all", "seconds": 0.004},
    {"kind": "ragged-all-to-all", "op_name": f"jit(step)/transpose(jvp())/{body[16:]}/ep_combine/x", "seconds": 0.006},
    {"kind": "all-gather", "op_name": f"{body}/ep_dispatch/ep_units/all_gather", "seconds": 0.002},
    {"kind": "all-gather", "op_name": f"{body}/all_gather", "seconds": 1.0},  # the experts' weights
    {"kind": "reduce-scatter", "op_name": f"jit(step)/transpose(jvp())/{body[16:]}/reduce_scatter", "seconds": 1.0},
  ]
  got = predict.moe_latency(comm, moe_layers=2)
  assert got == pytest.approx({"forward_s": 0.003, "backward_s": 0.003, "per_layer_s": 0.006})
