"""The XLA flag names the installed jaxlib (and CUDA plugin) know, read from their shared libraries.

XLA aborts the process on an unknown or renamed flag in XLA_FLAGS (when its backend starts,
with a long log). To fail early with one line instead, every flag is checked against the names
compiled into the libraries that will parse it: XLA registers each flag by its name as a string
literal (xla/debug_options_flags.cc), so scanning the binary's bytes for `xla_[a-z0-9_]+` finds
all of them. Some literals are packed back to back without a terminator
(`xla_gpu_ptx_filexla_gpu_...`); they are split where `xla_` follows a letter or digit. The
scan also finds strings that are not flags (proto file names, attribute names): harmless, since
only names that are missing matter. One scan takes about a second per library; the result is
cached under ~/.cache/maxtext keyed by the library's path, size, mtime and the jaxlib version.

Nothing here imports jax or jaxlib: this runs before JAX starts.
"""

import hashlib
import importlib.metadata
import importlib.util
import json
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

_NAME = re.compile(rb"xla_[a-z0-9_]+")
_PACKED = re.compile(r"(?<=[a-z0-9])(?=xla_)")
# CUDA plugins jax may load (their own copy of XLA parses XLA_FLAGS too).
GPU_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")


@dataclass(frozen=True)
class Library:
  label: str  # e.g. "jaxlib 0.11.2"
  path: Path
  names: frozenset[str]


def jaxlib_version() -> str:
  try:
    return importlib.metadata.version("jaxlib")
  except importlib.metadata.PackageNotFoundError:
    return "unknown"


def _package_dir(module: str) -> Path | None:
  try:
    spec = importlib.util.find_spec(module)
  except (ImportError, ValueError):
    return None
  if spec is None or not spec.submodule_search_locations:
    return None
  return Path(list(spec.submodule_search_locations)[0])


def jaxlib_binary() -> Path | None:
  """The jaxlib library that holds XLA (libjax_common.so since 0.5; xla_extension.so before)."""
  d = _package_dir("jaxlib")
  if d is None:
    return None
  for name in ("libjax_common.so", "xla_extension.so"):
    if (d / name).is_file():
      return d / name
  sos = sorted(d.glob("*.so"), key=lambda p: p.stat().st_size, reverse=True)
  return sos[0] if sos else None


def gpu_plugin_binaries() -> list[tuple[str, Path]]:
  """(label, path) of each installed CUDA PJRT plugin library."""
  found = []
  for module in GPU_PLUGINS:
    d = _package_dir(module)
    if d is None:
      continue
    for so in sorted(d.glob("*.so")):
      dist = "jax-cuda13-pjrt" if module.endswith("13") else "jax-cuda12-pjrt"
      try:
        version = importlib.metadata.version(dist)
      except importlib.metadata.PackageNotFoundError:
        version = "unknown"
      found.append((f"{module.rsplit('.', 1)[1]} plugin {version}", so))
  return found


def scan(path: Path) -> frozenset[str]:
  """Every `xla_*` identifier in the file's bytes, packed literals split apart."""
  names = set()
  with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
    for m in _NAME.finditer(data):
      names.update(n for n in _PACKED.split(m.group().decode()) if n.startswith("xla_"))
  return frozenset(names)


def cache_dir() -> Path:
  if os.environ.get("MAXTEXT_CACHE_DIR"):
    return Path(os.environ["MAXTEXT_CACHE_DIR"])
  return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "maxtext"


def names_in(path: Path, version: str) -> frozenset[str]:
  """scan(path), from the cache when the same file was scanned before."""
  st = path.stat()
  key = hashlib.sha1(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{version}".encode()).hexdigest()[:16]
  cached = cache_dir() / f"xla_flag_names-{key}.json"
  try:
    return frozenset(json.loads(cached.read_text())["names"])
  except (OSError, ValueError, KeyError):
    pass
  names = scan(path)
  try:
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"path": str(path), "jaxlib": version, "names": sorted(names)}))
    tmp.replace(cached)
  except OSError:
    pass  # a read-only home: scan again next time
  return names


def libraries() -> list[Library]:
  """The installed jaxlib and CUDA plugins, with the flag names each knows."""
  version = jaxlib_version()
  libs = []
  jaxlib = jaxlib_binary()
  if jaxlib is not None:
    libs.append(Library(f"jaxlib {version}", jaxlib, names_in(jaxlib, version)))
  for label, path in gpu_plugin_binaries():
    libs.append(Library(label, path, names_in(path, version)))
  return libs


def unknown(flag: str, libs: list[Library]) -> Library | None:
  """The first library that parses XLA_FLAGS but does not know `flag` (a name without --), or None.

  jaxlib parses every flag; a CUDA plugin carries its own XLA, which parses the GPU flags again.
  """
  for lib in libs:
    if lib.label.startswith("jaxlib") or flag.startswith("xla_gpu_"):
      if flag not in lib.names:
        return lib
  return None


# ---- the exact check: XLA's own verdict, from a short-lived process ----
# The name scan above finds every name jaxlib holds as text, including flags it no longer accepts (a removed
# flag's name can stay behind in a message). `probe` asks XLA itself: a subprocess starts the CPU backend with
# the flags in XLA_FLAGS and reports which ones XLA refused (its abort names them). The verdict is cached per
# jaxlib (version and library file) and flag set, so each set costs one start (about a second) once.
_PROBE_CODE = "import jax; jax.devices()"
_UNKNOWN_LINE = re.compile(r"Unknown flags? in XLA_FLAGS: (.*)")
_ILLEGAL = re.compile(r"Illegal value for --?(xla_[a-z0-9_]+)")
_UNREADABLE = re.compile(r"Couldn't interpret value .* for flag (xla_[a-z0-9_]+)")
PROBE_TIMEOUT_S = 120


def _probe_key(tokens: list[str], version: str) -> str:
  lib = jaxlib_binary()
  where = ""
  if lib is not None:
    st = lib.stat()
    where = f"{lib.resolve()}|{st.st_size}|{st.st_mtime_ns}"
  text = "\n".join([version, where, *tokens])
  return hashlib.sha1(text.encode()).hexdigest()[:20]


def _verdict(returncode: int, stderr: str) -> list[list[str]]:
  """[[flag name, why]] that XLA refused, from its log; [] when it started."""
  if returncode == 0:
    return []
  bad = []
  for line in stderr.splitlines():
    if m := _UNKNOWN_LINE.search(line):
      bad += [[tok.lstrip("-").split("=", 1)[0], "unknown"] for tok in m.group(1).split()]
    elif m := _ILLEGAL.search(line) or _UNREADABLE.search(line):
      bad.append([m.group(1), "value"])
  return bad


def probe(tokens: list[str], version: str | None = None) -> list[list[str]] | None:
  """The flags of `tokens` (--xla_name=value, as XLA_FLAGS holds them) that this jaxlib refuses: [[name, why]],
  why "unknown" (no such flag) or "value" (a value it cannot read); None when the probe could not tell."""
  import subprocess
  import sys

  version = version or jaxlib_version()
  tokens = list(tokens)
  cached = cache_dir() / f"xla_flag_probe-{_probe_key(tokens, version)}.json"
  try:
    return json.loads(cached.read_text())["refused"]
  except (OSError, ValueError, KeyError):
    pass
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "TPU_", "CUDA_VISIBLE"))}
  env.update(XLA_FLAGS=" ".join(tokens), JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="0")
  try:
    proc = subprocess.run(
      [sys.executable, "-c", _PROBE_CODE], env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
    )
  except (OSError, subprocess.TimeoutExpired):
    return None
  refused = _verdict(proc.returncode, proc.stderr)
  if proc.returncode != 0 and not refused:
    return None  # it failed for another reason (no verdict on the flags): the name check stands
  try:
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.{os.urandom(4).hex()}.tmp")
    tmp.write_text(json.dumps({"jaxlib": version, "flags": tokens, "refused": refused}))
    tmp.replace(cached)  # atomic: concurrent probes of the same set write the same verdict
  except OSError:
    pass
  return refused
