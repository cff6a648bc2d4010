"""Loss curves of the tiny recipe under several quantisation settings, against the unquantised run (CPU).

  python3 benchmarks/quant_convergence.py --out DIR [--steps 300] [--batch 128] \
      --variant NAME "key=value ..." [--variant NAME "key=value ..." ...]

Each variant trains recipes/deepseek_v3_tiny.yml at --batch sequences of 64 tokens a step on one device (128:
what tests/test_quant.py's opt-in 300-step test runs) with its overrides, after an unquantised run ("off") with
none. The same synthetic batches feed every run. Reported per variant: the mean loss over the last tenth of
the steps (at least 10) and over all of them, each as a relative gap to "off". Writes DIR/quant_convergence.json
(every loss), DIR/quant_convergence.md and, with matplotlib, DIR/quant_convergence.png.

Example, one group of DeepSeek-V3's fp8 layers at a time:

  python3 benchmarks/quant_convergence.py --out DIR \
      --variant attention "quantization=fp8_blockwise quantize_layers=attention" \
      --variant dense_mlp "quantization=fp8_blockwise quantize_layers=dense_mlp"
"""

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RECIPE = REPO / "recipes" / "deepseek_v3_tiny.yml"


def train(steps: int, batch: int, overrides: list[str]) -> dict:
  import jax

  from MaxText.config import load_config
  from MaxText.data import SyntheticData
  from MaxText.sharding import make_mesh
  from MaxText.train_step import Trainer

  cfg = load_config(str(RECIPE), [f"steps={steps}", f"per_device_batch_size={batch}", *overrides])
  trainer = Trainer(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))
  data = SyntheticData(cfg.data, trainer.global_batch, cfg.train.max_target_length, cfg.model.vocab_size)
  state, step = trainer.init_state(), trainer.jit_step()
  losses, start = [], time.perf_counter()
  for i in range(steps):
    state, metrics = step(state, trainer.device_batch(data.batch(i)))
    losses.append(float(metrics["loss"]))
  return {"overrides": overrides, "losses": losses, "seconds": time.perf_counter() - start}


def gaps(runs: dict, steps: int) -> dict:
  window = max(10, steps // 10)
  off = runs["off"]["losses"]
  base_last, base_mean = sum(off[-window:]) / window, sum(off) / len(off)
  out = {}
  for name, run in runs.items():
    last, mean = sum(run["losses"][-window:]) / window, sum(run["losses"]) / len(run["losses"])
    out[name] = {"last": last, "mean": mean, "gap_last": last / base_last - 1, "gap_mean": mean / base_mean - 1}
  return out


def markdown(runs: dict, table: dict, steps: int, batch: int) -> str:
  window = max(10, steps // 10)
  lines = [
    f"# Tiny recipe, {steps} steps, {batch} x 64 tokens a step, one device",
    "",
    f"| variant | overrides | mean loss, last {window} steps | gap to off | mean loss, all steps | gap to off |",
    "|---|---|---|---|---|---|",
  ]
  for name, r in table.items():
    over = " ".join(runs[name]["overrides"]) or "(none)"
    lines.append(
      f"| {name} | `{over}` | {r['last']:.4f} | {r['gap_last']:+.2%} | {r['mean']:.4f} | {r['gap_mean']:+.2%} |"
    )
  return "\n".join(lines) + "\n"


def plot(runs: dict, path: Path) -> None:
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not installed: no plot", flush=True)
    return
  fig, ax = plt.subplots(figsize=(8, 5))
  for name, run in runs.items():
    ax.plot(run["losses"], label=name, linewidth=1)
  ax.set_yscale("log")
  ax.set_xlabel("step")
  ax.set_ylabel("loss")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", type=Path, required=True)
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--batch", type=int, default=128, help="sequences per step")
  ap.add_argument("--variant", nargs=2, action="append", metavar=("NAME", "OVERRIDES"), required=True)
  args = ap.parse_args()
  names = [name for name, _ in args.variant]
  if "off" in names or len(set(names)) != len(names):
    ap.error("--variant names must be distinct and not 'off' (the unquantised run's name)")
  if args.steps < 10 or args.batch < 1:
    ap.error(f"--steps {args.steps} --batch {args.batch}: at least 10 steps and 1 sequence")
  args.out.mkdir(parents=True, exist_ok=True)
  runs = {}
  for name, overrides in [("off", "")] + [tuple(v) for v in args.variant]:
    runs[name] = train(args.steps, args.batch, overrides.split())
    print(f"{name}: last loss {runs[name]['losses'][-1]:.4f} ({runs[name]['seconds']:.0f} s)", flush=True)
    (args.out / "quant_convergence.json").write_text(
      json.dumps({"steps": args.steps, "batch": args.batch, "runs": runs}, indent=1)
    )
  table = gaps(runs, args.steps)
  text = markdown(runs, table, args.steps, args.batch)
  (args.out / "quant_convergence.md").write_text(text)
  plot(runs, args.out / "quant_convergence.png")
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
