"""What an installed package needs that is not installed, read from its metadata without importing it.

A package installed without its requirements (pip's --no-deps, a copied site-packages) is found by find_spec and
still fails when it is first imported: tokamax 0.0.17 imports xprof as it starts. Its metadata lists what it
needs, so the doctor can say so without running the package's code.
"""

from importlib import metadata

from packaging.requirements import InvalidRequirement, Requirement


def unmet_requirements(dist: str) -> list[str]:
  """The requirements of installed distribution `dist` (optional extras left out) that are not installed, or
  whose installed version falls outside the requirement: "xprof>=2.23.1 (not installed)", "x>=2 (have 1.0)".
  [] when `dist` itself is not installed."""
  try:
    requires = metadata.requires(dist) or []
  except metadata.PackageNotFoundError:
    return []
  unmet = []
  for line in requires:
    try:
      req = Requirement(line)
    except InvalidRequirement:
      continue  # not ours to judge: pip would have refused it
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
      continue  # an extra, or another platform's requirement
    try:
      have = metadata.version(req.name)
    except metadata.PackageNotFoundError:
      unmet.append(f"{req.name}{req.specifier} (not installed)")
      continue
    if req.specifier and not req.specifier.contains(have, prereleases=True):
      unmet.append(f"{req.name}{req.specifier} (have {have})")
  return unmet
