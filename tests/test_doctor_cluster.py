"""The doctor's cluster checks: NCCL version, pinned host memory, and which moe_dispatch /
moe_gmm_backend choices can run (from their registries), on this CPU machine."""

import jax

from MaxText import doctor


def test_nccl_version_codes_decode_like_nccl_h():
  assert doctor.nccl_version_string(22803) == "2.28.3"
  assert doctor.nccl_version_string(21903) == "2.19.3"
  assert doctor.nccl_version_string(2708) == "2.7.8"  # before 2.9: major*1000 + minor*100 + patch


def test_nccl_found_by_library_or_reported_missing(monkeypatch):
  monkeypatch.delenv("NCCL_VERSION", raising=False)
  check = doctor.check_nccl()
  if doctor.nccl_libraries() or doctor.dist_version(*doctor.NCCL_DISTS):
    assert check.status == "ok" and check.detail[0].isdigit()
  else:
    assert check.status == "missing" and "nvidia-nccl-cu13" in check.detail and not check.required
  # An NGC container without a loadable library still says which NCCL it was built with.
  monkeypatch.setattr(doctor, "nccl_libraries", lambda: [])
  monkeypatch.setattr(doctor, "NCCL_DISTS", ("no-such-distribution",))
  monkeypatch.setenv("NCCL_VERSION", "2.28.3-1")
  assert doctor.check_nccl().detail.startswith("2.28.3-1 (from NCCL_VERSION")


def test_pinned_host_memory_on_cpu_devices():
  check = doctor.check_host_memory(jax.devices())
  assert check.status == "ok" and "pinned_host" in check.detail
  assert doctor.check_host_memory([]).status == "unusable"


def test_moe_backends_usable_here():
  dispatch, gemm = doctor.check_moe_backends(jax.devices())
  usable_dispatch = dispatch.detail.split(";")[0]
  assert dispatch.status == "ok" and "sort" in usable_dispatch and "dense_a2a" in usable_dispatch
  assert "ragged_a2a (jax.lax.ragged_all_to_all runs on GPUs" in dispatch.detail  # CPU: not here, and why
  assert gemm.status == "ok" and "xla" in gemm.detail.split(";")[0]
  assert "mosaic (needs sm_90 GPUs)" in gemm.detail
