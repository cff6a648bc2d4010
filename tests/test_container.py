"""The container recipe (Dockerfile, .dockerignore, scripts/build_container.sh), checked against the project
without building it (no registry here): the base image is a build ARG, everything COPY'd exists and is
in the build context, our requirements are installed under the image's own pins (jax/TE never
replaced), the project goes in with --no-deps, and the command's module exists. hadolint runs if installed."""

import fnmatch
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO

KEPT_FROM_IMAGE = re.compile(r"^(jax|jaxlib|jax[-_]cuda\d+[-_].*|transformer[-_]engine.*|nvidia[-_].*)$", re.IGNORECASE)


def instructions(path: Path) -> list[tuple[str, str]]:
  """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
  out, pending = [], ""
  for raw in path.read_text().splitlines():
    line = raw.strip()
    if not pending and (not line or line.startswith("#")):
      continue
    if line.startswith("#"):  # a comment inside a continued instruction
      continue
    if line.endswith("\\"):
      pending += line[:-1] + " "
      continue
    text = pending + line
    pending = ""
    keyword, _, args = text.partition(" ")
    out.append((keyword.upper(), args.strip()))
  assert not pending, "the Dockerfile ends inside a continued line"
  return out


def ignored(rel: str, patterns: list[str]) -> bool:
  parts = rel.split("/")
  for p in patterns:
    p = p.lstrip("/")
    for i in range(1, len(parts) + 1):
      if fnmatch.fnmatch("/".join(parts[:i]), p) or fnmatch.fnmatch("/".join(parts[:i]), p.removeprefix("**/")):
        return True
  return False


@pytest.fixture(scope="module")
def dockerfile():
  return instructions(REPO / "Dockerfile")


@pytest.fixture(scope="module")
def ignore_patterns():
  lines = (REPO / ".dockerignore").read_text().splitlines()
  return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def pip_installs(dockerfile) -> list[list[str]]:
  """The argument lists of every `pip install` in RUN instructions."""
  found = []
  for kw, args in dockerfile:
    if kw == "RUN":
      for cmd in re.split(r"&&|;|\|", args):
        words = cmd.split()
        if "pip" in words and "install" in words:
          found.append(words[words.index("install") + 1 :])
  return found


def test_base_image_is_a_build_arg_defaulting_to_the_jax_maxtext_image(dockerfile):
  assert dockerfile[0][0] == "ARG" and dockerfile[1][0] == "FROM"
  name, _, default = dockerfile[0][1].partition("=")
  assert name == "BASE_IMAGE"
  m = re.fullmatch(r"ghcr\.io/nvidia/jax:maxtext-(\d{4}-\d{2}-\d{2})", default)
  assert m and m.group(1) >= "2026-09-09", default
  assert dockerfile[1][1] in ("${BASE_IMAGE}", "$BASE_IMAGE")
  assert [kw for kw, _ in dockerfile].count("FROM") == 1


def test_everything_copied_exists_and_is_in_the_build_context(dockerfile, ignore_patterns):
  copies = [args.split() for kw, args in dockerfile if kw in ("COPY", "ADD")]
  assert copies
  for words in copies:
    assert not any(w.startswith("--from") for w in words)
    for src in words[:-1]:
      assert (REPO / src).exists(), f"COPY {src}: not in the repository"
      assert not ignored(src, ignore_patterns), f"COPY {src}: excluded by .dockerignore"
  copied = {src.rstrip("/") for words in copies for src in words[:-1]}
  # what a run needs: the package, model configs, recipes, launch scripts
  assert {"MaxText", "configs", "recipes", "scripts", "pyproject.toml", "requirements.txt"} <= copied


def test_dockerignore_keeps_environments_and_runs_out(ignore_patterns):
  for path in (
    ".venv/bin/python",
    ".git/HEAD",
    "runs/x/metrics.jsonl",
    "MaxText/__pycache__/a.pyc",
    "benchmarks/results/x.json",
  ):
    assert ignored(path, ignore_patterns), path
  for path in ("MaxText/train.py", "recipes/deepseek_v3_671b/optimized.yml", "scripts/slurm/deepseek_v3_671b.sbatch"):
    assert not ignored(path, ignore_patterns), path


def test_requirements_installed_under_the_image_pins_and_jax_te_never_replaced(dockerfile):
  runs = [args for kw, args in dockerfile if kw == "RUN"]
  installs = pip_installs(dockerfile)
  # the requirements: every one of requirements.txt, constrained by a pins file frozen from the image
  req = [a for a in installs if "-r" in a and a[a.index("-r") + 1] == "requirements.txt"]
  assert len(req) == 1, installs
  pins = req[0][req[0].index("-c") + 1]
  frozen = next(r for r in runs if "requirements.txt" in r)
  assert re.search(rf"pip list --format=freeze .*> {re.escape(pins)}", frozen), frozen
  assert frozen.index(pins) < frozen.index("-r requirements.txt")
  copy_req = next(i for i, (kw, a) in enumerate(dockerfile) if kw == "COPY" and "requirements.txt" in a.split()[:-1])
  run_req = next(i for i, (kw, a) in enumerate(dockerfile) if kw == "RUN" and "requirements.txt" in a)
  assert copy_req < run_req
  for args in installs:
    assert not {"-U", "--upgrade", "--force-reinstall", "--ignore-installed", "-I"} & set(args), args
    named = [
      a for i, a in enumerate(args) if not a.startswith("-") and args[i - 1] not in ("-r", "-c", "-e") and a != "."
    ]
    for pkg in named:
      name = re.split(r"[<>=!~\[ ]", pkg)[0]
      assert not KEPT_FROM_IMAGE.match(name), f"pip install {pkg} would replace the image's {name}"


def test_project_installed_without_dependencies_after_its_sources(dockerfile):
  installs = pip_installs(dockerfile)
  project = [a for a in installs if "-e" in a and a[a.index("-e") + 1] == "."]
  assert len(project) == 1 and "--no-deps" in project[0], installs
  run_at = next(i for i, (kw, a) in enumerate(dockerfile) if kw == "RUN" and "--no-deps -e ." in a)
  copied_before = {s.rstrip("/") for kw, a in dockerfile[:run_at] if kw == "COPY" for s in a.split()[:-1]}
  assert {"pyproject.toml", "MaxText"} <= copied_before


def test_command_module_exists(dockerfile):
  cmd = [args for kw, args in dockerfile if kw in ("CMD", "ENTRYPOINT")]
  assert cmd
  modules = re.findall(r'"-m",\s*"([A-Za-z_.]+)"', cmd[-1])
  assert modules, cmd[-1]
  for module in modules:
    assert (REPO / (module.replace(".", "/") + ".py")).is_file(), module


def test_build_script_dry_run_prints_build_and_enroot_import(tmp_path):
  r = subprocess.run(
    [
      "scripts/build_container.sh",
      "--dry-run",
      "--engine",
      "podman",
      "--tag",
      "t:1",
      "--squashfs",
      str(tmp_path / "i.sqsh"),
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert r.returncode == 0, r.stderr
  assert "+ podman build -t t:1 ." in r.stdout
  assert f"+ enroot import -o {tmp_path / 'i.sqsh'} podman://t:1" in r.stdout
  bad = subprocess.run(
    ["scripts/build_container.sh", "--engine", "lxc"], cwd=REPO, capture_output=True, text=True, timeout=60
  )
  assert bad.returncode == 2 and bad.stderr.startswith("error:")


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint not installed")
def test_hadolint():
  r = subprocess.run(
    ["hadolint", "--failure-threshold", "error", "Dockerfile"], cwd=REPO, capture_output=True, text=True, timeout=60
  )
  assert r.returncode == 0, r.stdout + r.stderr
