"""A heartbeat for long silent phases (compiling a large step takes minutes; a silent terminal looks hung)."""

import contextlib
import threading
import time


@contextlib.contextmanager
def progress(what: str, every_s: float):
  """Prints `what` now and then every `every_s` seconds (0: never) until the block ends, then the time taken."""
  start = time.perf_counter()
  print(f"{what} ...", flush=True)
  done = threading.Event()

  def beat():
    while not done.wait(every_s):
      print(f"  still {what[0].lower() + what[1:]} ({time.perf_counter() - start:.0f} s)", flush=True)

  thread = threading.Thread(target=beat, daemon=True) if every_s > 0 else None
  if thread:
    thread.start()
  try:
    yield
  finally:
    done.set()
    print(f"{what}: done in {time.perf_counter() - start:.1f} s", flush=True)
