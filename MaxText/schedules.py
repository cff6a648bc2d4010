"""Values that change over a run, as functions of the step, in steps or in tokens (DeepSeek-V3 section 4.2).

A schedule is written as `;`-separated segments, each `[SHAPE] VALUE [for|until AMOUNT]`:

  learning_rate_phases: "linear 2.2e-4 for 2K steps; constant 2.2e-4 until 10T; cosine 2.2e-5 for 4.3T;
                         constant 2.2e-5 for 333B; constant 7.3e-6 for 167B"
  mtp_loss_scaling_factor_schedule: "0.3 until 10T; 0.1"

SHAPE is constant (the default: VALUE from the segment's first step), linear or cosine (from the value the
segment before ended at, 0 before the first, to VALUE at the segment's end). AMOUNT is a number with a unit:
`steps`, or tokens (`tokens`, or a K/M/B/T suffix alone: 10T = 10^13 tokens; 2K steps = 2000 steps); `for`
counts from the segment's start, `until` from the start of the run. The last segment may leave out its
amount (it lasts to the end); after a last segment that has one, its VALUE holds.

Tokens are counted as sequences x max_target_length per step (packing fills the rows), consumed before the
step: step s has seen s * tokens_per_step tokens. A boundary in tokens takes effect at the first step that
has seen at least that many (computed on the host in integers, so it never moves by rounding); inside a
linear or cosine segment measured in tokens the progress is (tokens seen - start) / length. On device a
schedule is a traced function of the int32 step (jnp.where over the segments): changing value never
recompiles the step, and a resumed run, whose step comes from the checkpoint, continues it exactly.
"""

import dataclasses
import math
import re
from decimal import Decimal, InvalidOperation

from MaxText.errors import UserError

SHAPES = ("constant", "linear", "cosine")
SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}
INT32_MAX = 2**31 - 1
_AMOUNT = re.compile(r"^([0-9][0-9_.]*(?:[eE][+-]?[0-9]+)?)\s*([KMBT]?)\s*(steps?|tokens?)?$")


@dataclasses.dataclass(frozen=True)
class Segment:
  shape: str  # constant | linear | cosine
  value: float
  kind: str | None  # "for" | "until" | None (lasts to the end)
  amount: int = 0  # in `unit`
  unit: str = "steps"  # steps | tokens


def _amount(text: str, key: str) -> tuple[int, str]:
  m = _AMOUNT.match(text.strip())
  if not m:
    raise UserError(
      f"{key}: cannot read the amount '{text}'; write e.g. '2000 steps', '2K steps', '4.3T' or '5e9 tokens'"
    )
  number, suffix, unit = m.groups()
  if not suffix and not unit:
    raise UserError(f"{key}: '{text}' needs a unit: steps, tokens, or a K/M/B/T suffix (tokens)")
  try:
    exact = Decimal(number.replace("_", "")) * SUFFIX[suffix]
  except InvalidOperation:
    raise UserError(f"{key}: '{number}' in '{text}' is not a number") from None
  if exact != exact.to_integral_value():
    raise UserError(f"{key}: '{text}' is not a whole number of {unit or 'tokens'}")
  return int(exact), "steps" if (unit or "").startswith("step") else "tokens"


def parse(text: str, key: str) -> tuple[Segment, ...]:
  """The segments of a schedule string (see the module docstring); a UserError names the key and the problem."""
  segments = []
  parts = [p.strip() for p in text.split(";")]
  if not text.strip() or any(not p for p in parts):
    raise UserError(
      f"{key}: an empty segment in '{text}'; segments are '[SHAPE] VALUE [for|until AMOUNT]', ';'-separated"
    )
  for i, part in enumerate(parts):
    words = part.split(None, 1)
    shape = "constant"
    if words[0] in SHAPES:
      shape, part = words[0], (words[1] if len(words) > 1 else "")
    head, kind, rest = part, None, ""
    for word in ("for", "until"):
      m = re.match(rf"^(.*?)\s+{word}\s+(.+)$", part)
      if m:
        head, kind, rest = m.group(1), word, m.group(2)
        break
    try:
      value = float(head)
    except ValueError:
      raise UserError(
        f"{key}: cannot read segment '{part}'; write '[constant|linear|cosine] VALUE [for|until AMOUNT]'"
      ) from None
    if not math.isfinite(value):
      raise UserError(f"{key}: value {head} in '{part}' is not finite")
    if kind is None:
      if i != len(parts) - 1:
        raise UserError(f"{key}: only the last segment may leave out 'for/until AMOUNT' (segment {i + 1}: '{part}')")
      segments.append(Segment(shape, value, None))
    else:
      amount, unit = _amount(rest, key)
      segments.append(Segment(shape, value, kind, amount, unit))
  return tuple(segments)


@dataclasses.dataclass(frozen=True)
class Phase:
  segment: Segment
  start_value: float
  start_step: int
  end_step: int | None  # None: to the end of the run
  start: int  # in segment.unit, from the start of the run
  length: int  # in segment.unit (0 for an open-ended segment)


def _fmt(x: float) -> str:
  return f"{x:.4g}"


def tokens_str(n: int) -> str:
  for suffix, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
    if n >= scale:
      return f"{n / scale:.4g}{suffix}"
  return str(n)


class Schedule:
  """One scheduled key: `schedule(step)` on device (traced int32 step -> float32), `at(step)` on the host."""

  def __init__(self, key: str, text: str, tokens_per_step: int, initial: float = 0.0):
    if tokens_per_step < 1:
      raise ValueError(f"tokens_per_step must be positive, is {tokens_per_step}")
    self.key, self.text, self.tokens_per_step = key, text, tokens_per_step
    self.phases: list[Phase] = []
    step, tokens, value = 0, 0, initial
    for seg in parse(text, key):
      here = step if seg.unit == "steps" else tokens
      if seg.kind is None:
        self.phases.append(Phase(seg, value, step, None, here, 0))
        value = seg.value
        break
      end = here + seg.amount if seg.kind == "for" else seg.amount
      if end < here:
        raise UserError(
          f"{key}: '{seg.kind} {seg.amount} {seg.unit}' ends before the segment starts "
          f"(at {here} {seg.unit}, step {step})"
        )
      end_step = end if seg.unit == "steps" else -(-end // tokens_per_step)
      self.phases.append(Phase(seg, value, step, end_step, here, end - here))
      step, value = end_step, seg.value
      tokens = end_step * tokens_per_step if seg.unit == "steps" else end
    self.final = value

  # ---- on device ----
  def __call__(self, step):
    import jax.numpy as jnp

    step = jnp.asarray(step)
    s = step.astype(jnp.float32)
    out = jnp.asarray(self.final, jnp.float32)
    for ph in reversed(self.phases):
      v = self._phase_value(ph, s, jnp)
      out = v if ph.end_step is None else jnp.where(step < min(ph.end_step, INT32_MAX), v, out)
    return out

  def _phase_value(self, ph: Phase, s, xp):
    """The phase's value at step s (float32 array, or a Python float with xp=math)."""
    seg = ph.segment
    v0, v1 = ph.start_value, seg.value
    if seg.shape == "constant" or ph.length == 0:
      return xp.asarray(v1, xp.float32) if xp is not math else v1
    per = 1 if seg.unit == "steps" else self.tokens_per_step
    p = (s - ph.start / per) * (per / ph.length)  # progress through the segment, in its unit
    if seg.shape == "linear":
      mid = v0 + (v1 - v0) * p
    else:
      mid = v1 + (v0 - v1) * 0.5 * (1 + xp.cos(math.pi * p))
    if xp is math:
      return v0 if p <= 0 else v1 if p >= 1 else mid
    # The segment's ends exactly (no rounding of v0 + (v1 - v0) * 1).
    return xp.where(p <= 0, xp.float32(v0), xp.where(p >= 1, xp.float32(v1), mid.astype(xp.float32)))

  # ---- on the host ----
  def phase_at(self, step: int) -> Phase | None:
    """The segment in force at `step` (None after the last one ended)."""
    for ph in self.phases:
      if ph.end_step is None or step < ph.end_step:
        return ph
    return None

  def at(self, step: int) -> float:
    """The value at `step` in float64 on the host (for the log; the step uses __call__)."""
    ph = self.phase_at(step)
    return self.final if ph is None else float(self._phase_value(ph, float(step), math))

  def describe(self, ph: Phase | None) -> str:
    if ph is None:
      return f"holds {_fmt(self.final)} to the end"
    seg = ph.segment
    if ph.end_step is None:
      span = "to the end"
    elif seg.unit == "steps":
      span = f"for {ph.length} steps (to step {ph.end_step})"
    else:
      span = f"for {tokens_str(ph.length)} tokens (to step {ph.end_step})"
    what = _fmt(seg.value) if seg.shape == "constant" else f"{seg.shape} {_fmt(ph.start_value)} -> {_fmt(seg.value)}"
    return f"{what} {span}"

  def boundaries(self) -> list[int]:
    """Steps where a segment starts or the last one ends, each once, in order."""
    steps = {ph.start_step for ph in self.phases}
    steps |= {ph.end_step for ph in self.phases if ph.end_step is not None}
    return sorted(s for s in steps if s <= INT32_MAX)

  def change_line(self, step: int) -> str:
    """One log line for a boundary step: key, old -> new value, where, and the segment now in force."""
    old = self.at(step - 1) if step > 0 else self.phases[0].start_value
    return (
      f"schedule: {self.key} {_fmt(old)} -> {_fmt(self.at(step))} at step {step} "
      f"({tokens_str(step * self.tokens_per_step)} tokens): {self.describe(self.phase_at(step))}"
    )

  def start_line(self, step: int) -> str:
    return (
      f"schedule: {self.key} = {_fmt(self.at(step))} at step {step} "
      f"({tokens_str(step * self.tokens_per_step)} tokens): {self.describe(self.phase_at(step))}"
    )


def log_lines(schedules: list[Schedule], start: int, end: int) -> dict[int, list[str]]:
  """step -> the lines to print before it: every schedule's value at `start`, then each change in (start, end)."""
  lines: dict[int, list[str]] = {}
  for sch in schedules:
    lines.setdefault(start, []).append(sch.start_line(start))
    for b in sch.boundaries():
      if start < b < end:
        lines.setdefault(b, []).append(sch.change_line(b))
  return lines


def fail(key: str, msg: str):
  raise UserError(f"{key}: {msg}")


def check(text: str, key: str) -> None:
  """Config-time check of a schedule string (the tokens per step are not known yet): it parses, its
  segments follow each other, and no value is negative."""
  for seg in Schedule(key, text, tokens_per_step=1).phases:
    if seg.segment.value < 0:
      fail(key, f"value {seg.segment.value} is negative")
