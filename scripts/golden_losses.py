"""Golden losses: the tiny recipe's loss and grad norm per step, pinned bit for bit across commits.

  python scripts/golden_losses.py CASE            print this commit's values for CASE as JSON
  python scripts/golden_losses.py CASE --write    write this CPU's golden file for CASE and remove the
                                                  other CPUs' (after a deliberate numerical change)
  python scripts/golden_losses.py CASE --add      add this CPU's golden file beside the others (a new
                                                  kind of machine, no numerical change)

A refactor must leave these files unchanged (tests/test_golden_losses.py compares them bit for bit); a
deliberate numerical change rewrites them in a commit of its own that says why.

Each case runs in its own process with XLA_FLAGS set here, not inherited: the device count is part of
the case, and XLA:CPU's code generation is capped at AVX2 (--xla_cpu_max_isa) so that machines with
and without AVX-512 compile the same kernels. That is not enough for the same bits everywhere: XLA:CPU's
YNNPACK fusions pick their kernels by the CPU at run time, and an AMD EPYC machine rounded the last bits
of up to 10 of 30 steps differently (2.3e-7 relative at most) from the machine that wrote the first files. So
a golden file records the CPU it was written on (`cpu`, `tests/assets/losses/CASE@CPU.json`), and the
test compares bit for bit on that CPU and within a tolerance on others.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "tests" / "assets" / "losses"
RECIPE = REPO / "recipes" / "deepseek_v3_tiny.yml"
STEPS = 30
COMMON = (
  f"steps={STEPS}",
  "dtype=float32",
  "weight_dtype=float32",
  "init_weights_seed=0",
  "data_shuffle_seed=0",
  "log_period=1000",
  "enable_tensorboard=false",
  "enable_checkpointing=false",
)
# case -> (devices, overrides): one device, and the 8-device mesh (fsdp x expert x tensor) on the same global batch.
CASES = {
  "tiny_1dev": (1, ("per_device_batch_size=16",)),
  "tiny_8dev": (
    8,
    ("per_device_batch_size=2", "ici_fsdp_parallelism=2", "ici_expert_parallelism=2", "ici_tensor_parallelism=2"),
  ),
}
XLA_FLAGS = "--xla_force_host_platform_device_count={devices} --xla_cpu_max_isa=AVX2"


def cpu() -> str:
  """This machine's CPU as far as rounding goes: vendor, family/model, and whether it has AVX-512."""
  try:
    text = Path("/proc/cpuinfo").read_text()
  except OSError:
    import platform

    return platform.machine()
  fields = dict(line.split(":", 1) for line in text.split("\n\n")[0].splitlines() if ":" in line)
  fields = {k.strip(): v.strip() for k, v in fields.items()}
  isa = "avx512" if "avx512f" in fields.get("flags", "").split() else "avx2"
  return (
    f"{fields.get('vendor_id', '?')} family {fields.get('cpu family', '?')} model {fields.get('model', '?')} "
    f"({fields.get('model name', '?')}), {isa}"
  )


def file_for(case: str, cpu_name: str) -> Path:
  slug = "".join(c if c.isalnum() else "-" for c in cpu_name.lower()).strip("-")
  while "--" in slug:
    slug = slug.replace("--", "-")
  return ASSETS / f"{case}@{slug}.json"


def golden_files(case: str) -> list[Path]:
  """Every CPU's golden file for `case` (CASE.json: the first files, from a machine not recorded)."""
  return sorted(ASSETS.glob(f"{case}.json")) + sorted(ASSETS.glob(f"{case}@*.json"))


def run(case: str) -> dict:
  """The case's per-step values; call in a fresh process whose XLA_FLAGS came from `environment`."""
  import jax

  from MaxText.config import load_config
  from MaxText.train import train

  devices, overrides = CASES[case]
  assert jax.device_count() == devices, f"{case} needs {devices} devices; run it through main()"
  with tempfile.TemporaryDirectory() as tmp:
    cfg = load_config(RECIPE, [*COMMON, *overrides, f"base_output_directory={tmp}", "run_name=golden"])
    history = train(cfg)
  return {
    "case": case,
    "recipe": str(RECIPE.relative_to(REPO)),
    "overrides": [*COMMON, *overrides],
    "xla_flags": XLA_FLAGS.format(devices=devices),
    "jax": jax.__version__,
    "cpu": cpu(),
    # float.hex: exact; the decimal copy is for reading diffs.
    "loss": [float(h["loss"]).hex() for h in history],
    "grad_norm": [float(h["grad_norm"]).hex() for h in history],
    "loss_decimal": [round(float(h["loss"]), 6) for h in history],
  }


def environment(case: str) -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
  env.update(XLA_FLAGS=XLA_FLAGS.format(devices=CASES[case][0]), JAX_PLATFORMS="cpu")
  return env


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("case", choices=sorted(CASES))
  what = parser.add_mutually_exclusive_group()
  what.add_argument("--write", action="store_true", help="write this CPU's file, remove the other CPUs'")
  what.add_argument("--add", action="store_true", help="add this CPU's file beside the other CPUs'")
  parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)  # the child of main()
  args = parser.parse_args()
  if not args.in_process:
    import subprocess

    cmd = [sys.executable, __file__, args.case, "--in-process"]
    done = subprocess.run(cmd, env=environment(args.case), cwd=REPO, capture_output=True, text=True)
    if done.returncode:
      sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
      return done.returncode
    values = json.loads(done.stdout.strip().splitlines()[-1])
    text = json.dumps(values, indent=1) + "\n"
    if args.write or args.add:
      path = file_for(args.case, values["cpu"])
      stale = [f for f in golden_files(args.case) if f != path] if args.write else []
      path.write_text(text)
      for f in stale:
        f.unlink()
      print(f"wrote {path.relative_to(REPO)}" + "".join(f"; removed {f.name}" for f in stale))
    else:
      print(text, end="")
    return 0
  import contextlib
  import io

  with contextlib.redirect_stdout(io.StringIO()):  # the training log; stdout's last line is the JSON
    values = run(args.case)
  print(json.dumps(values))
  return 0


if __name__ == "__main__":
  sys.exit(main())
