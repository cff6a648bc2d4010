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
step: with a constant batch step s has seen s * tokens_per_step tokens; under batch_size_schedule each step
adds its own batch (`Tokens`, built by `BatchSizes`). A boundary in tokens takes effect at the first step
that has seen at least that many (computed on the host in integers, so it never moves by rounding); inside
a linear or cosine segment measured in tokens the progress is (tokens seen - start) / length. On device a
schedule is a traced function of the int32 step (jnp.where over the segments): changing value never
recompiles the step, and a resumed run, whose step comes from the checkpoint, continues it exactly.

batch_size_schedule uses the same segments for the global batch in sequences, constant or linear only:

  batch_size_schedule: "3072 for 0 tokens; linear 15360 until 469B; 15360"

(a zero-length first segment sets where the linear ramp starts). A step runs a whole number of
microbatches of per_device_batch_size / gradient_accumulation_steps sequences per device, at most
gradient_accumulation_steps of them: inside a linear segment the batch is rounded down to whole
microbatches (at least one), so that it reaches each segment's value exactly, and the microbatch count of
every step and the tokens before it are integers computed on the host (`BatchSizes`).
"""

import bisect
import dataclasses
import math
import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

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


def phase_at(phases: "list[Phase]", step: int) -> Phase | None:
  """The segment of `phases` in force at `step` (None after the last one ended)."""
  for ph in phases:
    if ph.end_step is None or step < ph.end_step:
      return ph
  return None


def span(ph: Phase) -> str:
  """How long segment `ph` lasts, for the log."""
  if ph.end_step is None:
    return "to the end"
  if ph.segment.unit == "steps":
    return f"for {ph.length} steps (to step {ph.end_step})"
  return f"for {tokens_str(ph.length)} tokens (to step {ph.end_step})"


class Tokens:
  """The tokens consumed before each step, exact in Python integers: steps fall into runs of equal tokens
  per step, the last run lasting to the end (a constant batch is one run from step 0)."""

  def __init__(self, runs: list[tuple[int, int]]):
    """runs: (first step, tokens per step) in step order, the first at step 0."""
    if not runs or runs[0][0] != 0:
      raise ValueError(f"runs must start at step 0, are {runs}")
    self.starts = [first for first, _ in runs]
    self.per_step = [per for _, per in runs]
    if min(self.per_step) < 1:
      raise ValueError(f"tokens_per_step must be positive, is {min(self.per_step)}")
    self.before_run = [0]  # tokens consumed before each run's first step
    for i in range(1, len(runs)):
      self.before_run.append(self.before_run[-1] + (self.starts[i] - self.starts[i - 1]) * self.per_step[i - 1])

  @classmethod
  def constant(cls, tokens_per_step: int) -> "Tokens":
    return cls([(0, tokens_per_step)])

  def _run(self, step: int) -> int:
    return bisect.bisect_right(self.starts, step) - 1

  def at(self, step: int) -> int:
    """Tokens of step `step` itself."""
    return self.per_step[self._run(step)]

  def before(self, step: int) -> int:
    """Tokens consumed by steps 0 .. step-1."""
    r = self._run(step)
    return self.before_run[r] + (step - self.starts[r]) * self.per_step[r]

  def first_step_with(self, tokens: int) -> int:
    """The first step that has seen at least `tokens` tokens."""
    if tokens <= 0:
      return 0
    r = bisect.bisect_left(self.before_run, tokens) - 1  # the last run that starts below `tokens`
    return self.starts[r] + -(-(tokens - self.before_run[r]) // self.per_step[r])

  def progress(self, step, start: int, length: int):
    """(tokens before `step` - start) / length as float32 on device, for a traced int32 step.

    In the last run the tokens grow by the same amount every step: the progress is linear in the step from
    a reference step computed on the host (with one run, (step - start / tokens_per_step) *
    (tokens_per_step / length)). In the runs before it, each run's own offset and slope, also from the
    host's exact integers, are looked up by the step."""
    import jax.numpy as jnp

    s = jnp.asarray(step).astype(jnp.float32)
    per, last = self.per_step[-1], self.starts[-1]
    reference = last + (start - self.before_run[-1]) / per
    p = (s - reference) * (per / length)
    if last == 0 or start >= self.before_run[-1]:  # no step before the last run reaches the segment
      return p
    offsets = jnp.asarray([float(Fraction(b - start, length)) for b in self.before_run[:-1]], jnp.float32)
    slopes = jnp.asarray([per_r / length for per_r in self.per_step[:-1]], jnp.float32)
    firsts = jnp.asarray(self.starts[:-1], jnp.float32)
    r = jnp.sum(jnp.asarray(step) >= jnp.asarray(self.starts[1:-1], jnp.int32)) if len(self.starts) > 2 else 0
    early = offsets[r] + (s - firsts[r]) * slopes[r]
    return jnp.where(jnp.asarray(step) < min(last, INT32_MAX), early, p)


class Schedule:
  """One scheduled key: `schedule(step)` on device (traced int32 step -> float32), `at(step)` on the host.

  `tokens_per_step`: the tokens of every step (an int), or a `Tokens` when the batch changes over the run."""

  def __init__(self, key: str, text: str, tokens_per_step: "int | Tokens", initial: float = 0.0):
    tokens = tokens_per_step if isinstance(tokens_per_step, Tokens) else Tokens.constant(tokens_per_step)
    self.key, self.text, self.tokens = key, text, tokens
    self.phases: list[Phase] = []
    step, seen, value = 0, 0, initial
    for seg in parse(text, key):
      here = step if seg.unit == "steps" else seen
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
      end_step = end if seg.unit == "steps" else tokens.first_step_with(end)
      self.phases.append(Phase(seg, value, step, end_step, here, end - here))
      step, value = end_step, seg.value
      seen = tokens.before(end_step) if seg.unit == "steps" else end
    self.final = value

  # ---- on device ----
  def __call__(self, step):
    import jax.numpy as jnp

    step = jnp.asarray(step)
    s = step.astype(jnp.float32)
    out = jnp.asarray(self.final, jnp.float32)
    for ph in reversed(self.phases):
      v = self._phase_value(ph, step, s, jnp)
      out = v if ph.end_step is None else jnp.where(step < min(ph.end_step, INT32_MAX), v, out)
    return out

  def _phase_value(self, ph: Phase, step, s, xp):
    """The phase's value at `step` (s: the step as float32; a float32 array, or with xp=math and an int
    step a Python float)."""
    seg = ph.segment
    v0, v1 = ph.start_value, seg.value
    if seg.shape == "constant" or ph.length == 0:
      return xp.asarray(v1, xp.float32) if xp is not math else v1
    # Progress through the segment, in its unit.
    if seg.unit == "steps":
      p = (s - ph.start) * (1 / ph.length)
    elif xp is math:
      p = (self.tokens.before(step) - ph.start) / ph.length
    else:
      p = self.tokens.progress(step, ph.start, ph.length)
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
    return phase_at(self.phases, step)

  def at(self, step: int) -> float:
    """The value at `step` in float64 on the host (for the log; the step uses __call__)."""
    ph = self.phase_at(step)
    return self.final if ph is None else float(self._phase_value(ph, step, float(step), math))

  def describe(self, ph: Phase | None) -> str:
    if ph is None:
      return f"holds {_fmt(self.final)} to the end"
    seg = ph.segment
    what = _fmt(seg.value) if seg.shape == "constant" else f"{seg.shape} {_fmt(ph.start_value)} -> {_fmt(seg.value)}"
    return f"{what} {span(ph)}"

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
      f"({tokens_str(self.tokens.before(step))} tokens): {self.describe(self.phase_at(step))}"
    )

  def start_line(self, step: int) -> str:
    return (
      f"schedule: {self.key} = {_fmt(self.at(step))} at step {step} "
      f"({tokens_str(self.tokens.before(step))} tokens): {self.describe(self.phase_at(step))}"
    )


class BatchSizes:
  """batch_size_schedule: the global batch of every step in whole microbatches, and the tokens consumed
  before each step (`tokens`), computed in integers on the host.

  The microbatch count changes at a few hundred steps at most (once per microbatch a linear segment adds
  or removes), so the steps are walked run by run: each run's length is the steps until the count, or the
  segment, changes (a ceiling division in tokens), not one step at a time."""

  def __init__(self, key: str, text: str, microbatch_sequences: int, max_microbatches: int, seq_len: int):
    self.key, self.text, self.micro, self.seq_len = key, text, microbatch_sequences, seq_len
    segments = parse(text, key)
    check_batch_segments(segments, key)
    limit = microbatch_sequences * max_microbatches
    for seg in segments:
      if seg.value % microbatch_sequences or seg.value > limit:
        fail(
          key,
          f"{seg.value:.0f} sequences is not a whole number of microbatches of {microbatch_sequences} sequences "
          f"between {microbatch_sequences} and the step's {limit} (the global batch, "
          f"per_device_batch_size x devices, split into gradient_accumulation_steps={max_microbatches} microbatches)",
        )
    m, per_micro = microbatch_sequences, microbatch_sequences * seq_len
    self.runs: list[tuple[int, int]] = []  # (first step, microbatches per step), one entry per change
    self.phases: list[Phase] = []
    # `seen`: the tokens the steps so far consumed; `mark`: where a segment that follows counts its tokens
    # from (a segment in tokens ends at its amount, one in steps at the tokens its end step has seen).
    step, seen, mark, value = 0, 0, 0, 0

    def add(first: int, count: int):
      if not self.runs or self.runs[-1][1] != count:
        self.runs.append((first, count))

    for seg in segments:
      v0, v1 = int(value), int(seg.value)
      if seg.kind is None:
        self.phases.append(Phase(seg, v0, step, None, step if seg.unit == "steps" else mark, 0))
        value = v1
        break
      here = step if seg.unit == "steps" else mark
      end = here + seg.amount if seg.kind == "for" else seg.amount
      if end < here:
        fail(key, f"'{seg.kind} {seg.amount} {seg.unit}' ends before the segment starts (at {here} {seg.unit})")
      length, start_step = end - here, step
      while (pos := step if seg.unit == "steps" else seen) < end:
        if seg.shape == "constant" or length == 0 or v0 == v1:
          raw, change = v1 // m, end
        else:
          scaled = v0 * length + (v1 - v0) * (pos - here)  # the batch here x length, exactly
          raw = scaled // (length * m)
          if v1 > v0:  # the first position where one more microbatch fits
            change = here + -(-((raw + 1) * length * m - v0 * length) // (v1 - v0))
          else:  # the first position where the batch falls below `raw` microbatches
            change = here + (v0 * length - raw * length * m) // (v0 - v1) + 1
        count = max(1, raw)
        target = min(change, end)
        n = target - step if seg.unit == "steps" else -(-(target - seen) // (count * per_micro))
        add(step, count)
        step, seen = step + n, seen + n * count * per_micro
      self.phases.append(Phase(seg, v0, start_step, step, here, length))
      value, mark = v1, (end if seg.unit == "tokens" else seen)
    add(step, max(1, int(value) // m))
    self.final = int(value)
    if self.runs[-1][0] > INT32_MAX:
      fail(key, f"the batch changes after step {INT32_MAX}")
    self.tokens = Tokens([(first, count * per_micro) for first, count in self.runs])

  def microbatches(self, step: int) -> int:
    return self.runs[bisect.bisect_right([first for first, _ in self.runs], step) - 1][1]

  def sequences(self, step: int) -> int:
    return self.microbatches(step) * self.micro

  def counts_from(self, step: int) -> set[int]:
    """The microbatch counts of `step` and every step after it."""
    i = bisect.bisect_right([first for first, _ in self.runs], step) - 1
    return {count for _, count in self.runs[i:]}

  # ---- the log, as Schedule's ----
  def _describe(self, step: int) -> str:
    n = self.microbatches(step)
    ph = phase_at(self.phases, step)
    if ph is None:
      where = f"holds {self.final} to the end"
    else:
      seg = ph.segment
      what = f"{seg.value:.0f}" if seg.shape == "constant" else f"linear {ph.start_value} -> {seg.value:.0f}"
      where = f"{what} {span(ph)}"
    return f"{n} microbatch(es) of {self.micro}; {where}"

  def boundaries(self) -> list[int]:
    """Steps where the batch changes (and step 0)."""
    return [first for first, _ in self.runs]

  def change_line(self, step: int) -> str:
    old = self.sequences(step - 1) if step > 0 else 0
    return (
      f"schedule: batch_size {old} -> {self.sequences(step)} sequences at step {step} "
      f"({tokens_str(self.tokens.before(step))} tokens): {self._describe(step)}"
    )

  def start_line(self, step: int) -> str:
    return (
      f"schedule: batch_size = {self.sequences(step)} sequences at step {step} "
      f"({tokens_str(self.tokens.before(step))} tokens): {self._describe(step)}"
    )


def check_batch_segments(segments: tuple[Segment, ...], key: str) -> None:
  for seg in segments:
    if seg.shape not in ("constant", "linear"):
      fail(key, f"{seg.shape}: batch sizes are whole microbatches computed in integers; use constant or linear")
    if seg.value < 1 or seg.value != int(seg.value):
      fail(key, f"{seg.value:g} is not a whole, positive number of sequences")


def log_lines(schedules: "list[Schedule | BatchSizes]", start: int, end: int) -> dict[int, list[str]]:
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


def check_batch(text: str, key: str) -> None:
  """Config-time check of batch_size_schedule (the devices, hence the microbatch, are not known yet): it
  parses, its segments follow each other, and its values are whole sequences, constant or linear."""
  check_batch_segments(parse(text, key), key)
  Schedule(key, text, tokens_per_step=1)
