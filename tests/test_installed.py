"""A package installed without its requirements: found by find_spec, yet its first import fails. The doctor reads
the missing requirement from the package's metadata (nothing imported); a chosen expert GEMM that needs the
package is imported before the run writes anything. The packages here are real distributions written into a
temporary site directory: a module and its dist-info METADATA."""

import importlib
import sys

import pytest

from MaxText import doctor, gmm, installed, validate
from MaxText.errors import UserError


def install(site, name: str, version: str, requires: list[str], code: str = "") -> None:
  """A distribution `name` as pip leaves it: the module and its dist-info with Requires-Dist lines."""
  (site / f"{name}.py").write_text(code)
  info = site / f"{name}-{version}.dist-info"
  info.mkdir()
  lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
  (info / "METADATA").write_text("\n".join(lines) + "\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
  """kernelpkg needs absentdep (never installed) and olddep>=1.0 (0.5 installed); its test extra is not needed."""
  install(tmp_path, "olddep", "0.5", [])
  install(
    tmp_path,
    "kernelpkg",
    "1.2",
    ["absentdep>=2.23", "olddep>=1.0", 'testonlydep; extra == "test"', 'otherosdep; sys_platform == "win32"'],
    code="import absentdep\n",
  )
  install(tmp_path, "completepkg", "3.0", ["olddep>=0.1"])
  monkeypatch.syspath_prepend(str(tmp_path))
  importlib.invalidate_caches()
  yield tmp_path
  for name in ("kernelpkg", "olddep", "completepkg", "absentdep"):
    sys.modules.pop(name, None)


def test_unmet_requirements_name_what_is_missing_or_too_old(site):
  assert installed.unmet_requirements("kernelpkg") == ["absentdep>=2.23 (not installed)", "olddep>=1.0 (have 0.5)"]
  assert installed.unmet_requirements("completepkg") == []
  assert installed.unmet_requirements("no-such-distribution") == []


def test_doctor_calls_a_package_without_its_requirements_unusable(site):
  check = doctor.check_optional("kernelpkg", "kernelpkg", ("kernelpkg",), "fast kernels", "pip install kernelpkg")
  assert check.status == doctor.UNUSABLE
  assert check.detail == (
    "1.2, installed without its requirements absentdep>=2.23 (not installed), olddep>=1.0 (have 0.5); "
    "pip install 'absentdep>=2.23' 'olddep>=1.0'"
  )
  assert "kernelpkg" not in sys.modules  # read from metadata, not imported
  ok = doctor.check_optional("completepkg", "completepkg", ("completepkg",), "x", "pip install completepkg")
  assert ok.status == doctor.OK and ok.detail == "3.0; x"


def test_an_expert_gemm_whose_package_does_not_import_is_stopped_before_the_run(site, monkeypatch, tiny_config):
  entry = gmm.Entry("tokamax", "", "tokamax", "MaxText.gmm.tokamax", "test", "kernelpkg", "pip install kp", "kernelpkg")
  monkeypatch.setitem(gmm.EXPERT_GEMMS, "tokamax", entry)
  assert gmm.unavailable("tokamax") == (
    "needs kernelpkg, installed without its requirements absentdep>=2.23 (not installed), olddep>=1.0 (have 0.5); "
    "pip install kp"
  )
  assert "kernelpkg" not in sys.modules
  assert gmm.unavailable("tokamax", imports=True) == (
    "needs kernelpkg, which is installed but does not import (ModuleNotFoundError: No module named 'absentdep'); "
    "pip install kp"
  )
  with pytest.raises(UserError, match=r"^moe_gmm_backend=tokamax: tokamax needs kernelpkg, which is installed but"):
    validate.backend(tiny_config("moe_gmm_backend=tokamax"), "cpu")
  (site / "absentdep.py").write_text("")  # the import works now, whatever the metadata says
  importlib.invalidate_caches()
  assert gmm.unavailable("tokamax", imports=True) is None
  validate.backend(tiny_config("moe_gmm_backend=tokamax"), "cpu")
