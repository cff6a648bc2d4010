"""Every collective of a compiled step, read from its HLO text (`compiled.as_text()`).

For each all-gather, reduce-scatter, all-reduce, all-to-all, ragged all-to-all and collective-permute
(synchronous, or an asynchronous start/done pair, or an `async-start` wrapping one): its bytes, its replica
groups (partition ids), how many times a step runs it (the trip counts of the while loops around it), and,
for an asynchronous pair, how many compute ops the schedule puts between start and done (0: exposed).

Sizes follow nccl-tests' convention (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md): `size` is the
per-GPU buffer NCCL is timed on: the gathered output of an all-gather, the input of a reduce-scatter, the
buffer of an all-reduce, the send buffer of an all-to-all. A ragged all-to-all is sized by its send buffer
(operand 0: every row of it goes to some rank), not by its worst-case receive buffer.

`classify` places each group on the cluster: partition p runs on device `device_ids[p]` (the mesh's
devices in order), and device d sits in node d // gpus_per_node.
"""

import json
import re
from dataclasses import dataclass, field

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")
DTYPE_BYTES = {
  "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
  "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
  "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "f8e8m0fnu": 1, "f8e3m4": 1,
  "s4": 0.5, "u4": 0.5, "f4e2m1fn": 0.5, "s2": 0.25, "u2": 0.25, "s1": 0.125, "u1": 0.125,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->\s*.*\{\s*$")
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
# Ops that do work between an asynchronous start and its done (what a collective can hide behind).
COMPUTE_OPS = {"fusion", "custom-call", "dot", "convolution", "while", "call", "conditional", "fusion-start", "sort"}


def shape_bytes(shape: str) -> int:
  """Bytes of every array in a shape string, tuples summed (layouts and memory spaces ignored)."""
  total = 0.0
  for dtype, dims in _ARRAY.findall(shape):
    if dtype in DTYPE_BYTES:
      total += DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
  return int(total)


def _balanced(s: str, i: int) -> int:
  """Index just past the bracket group opening at s[i]."""
  pairs = {"(": ")", "{": "}", "[": "]"}
  depth, opener, closer = 0, s[i], pairs[s[i]]
  for j in range(i, len(s)):
    if s[j] == opener:
      depth += 1
    elif s[j] == closer:
      depth -= 1
      if depth == 0:
        return j + 1
  return len(s)


def _top_level(s: str) -> list[str]:
  """The comma-separated items of a bracketed list, nested brackets kept whole."""
  items, depth, cur = [], 0, ""
  for ch in s:
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    if ch == "," and depth == 0:
      items.append(cur.strip())
      cur = ""
    else:
      cur += ch
  if cur.strip():
    items.append(cur.strip())
  return items


@dataclass
class Instruction:
  name: str
  shape: str
  opcode: str
  operands: list[str]
  attrs: str  # everything after the operand list


def parse_instruction(line: str) -> Instruction | None:
  m = _NAME.match(line)
  if not m:
    return None
  rest = line[m.end() :]
  if rest.startswith("("):
    end = _balanced(rest, 0)
    shape, rest = rest[:end], rest[end:]
  else:
    sp = rest.find(" ")
    if sp < 0:
      return None
    shape, rest = rest[:sp], rest[sp:]
  om = re.match(r"\s*([\w\-]+)\(", rest)
  if not om:
    return None
  start = om.end() - 1
  end = _balanced(rest, start)
  operands = [
    re.sub(r"/\*.*?\*/", "", o).strip().split(" ")[-1].lstrip("%") for o in _top_level(rest[start + 1 : end - 1])
  ]
  return Instruction(m.group(1), shape, om.group(1), operands, rest[end:])


@dataclass
class Computation:
  name: str
  entry: bool
  params: dict[str, str]
  instructions: list[Instruction] = field(default_factory=list)


def parse_module(text: str) -> tuple[dict[str, Computation], int]:
  """The computations of an HLO module, instructions in (scheduled) order; and num_partitions."""
  comps: dict[str, Computation] = {}
  cur = None
  parts = re.search(r"num_partitions=(\d+)", text)
  for line in text.splitlines():
    h = _HEADER.match(line)
    if h and not line.startswith(" "):
      params = {}
      for item in _top_level(h.group(3)):
        if ":" in item:
          k, v = item.split(":", 1)
          params[k.strip().lstrip("%")] = v.strip()
      cur = comps[h.group(2)] = Computation(h.group(2), bool(h.group(1)), params)
      continue
    if cur is not None and line.startswith("  "):
      ins = parse_instruction(line)
      if ins:
        cur.instructions.append(ins)
  return comps, int(parts.group(1)) if parts else 1


def _attr(attrs: str, key: str) -> str | None:
  """The raw value of `key=` in an attribute string (a bracketed group kept whole)."""
  m = re.search(r"(?:^|[\s,])" + re.escape(key) + r"=", attrs)
  if not m:
    return None
  i = m.end()
  if i < len(attrs) and attrs[i] in "{[(":
    return attrs[i : _balanced(attrs, i)]
  j = i
  while j < len(attrs) and attrs[j] not in ", ":
    j += 1
  return attrs[i:j]


def _iota(dims: list[int], reshape: list[int], perm: list[int] | None) -> np.ndarray:
  ids = np.arange(int(np.prod(reshape))).reshape(reshape)
  if perm:
    ids = ids.transpose(perm)
  return ids.reshape(dims)


def replica_groups(attrs: str, num_partitions: int) -> list[list[int]]:
  """Groups of partition ids in any of XLA's three spellings: explicit `{{0,1},{2,3}}`, iota
  `[2,4]<=[4,2]T(1,0)`, and mesh axes `mesh['fsdp'=2,'expert'=8] {'expert'}`. No groups: all partitions."""
  m = re.search(r"replica_groups=", attrs)
  if not m:
    return [list(range(num_partitions))]
  s = attrs[m.end() :]
  if s.startswith("{"):
    groups = [[int(x) for x in g.strip("{} ").split(",") if x.strip()] for g in _top_level(s[1 : _balanced(s, 0) - 1])]
    return [g for g in groups if g] or [list(range(num_partitions))]
  it = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", s)
  if it:
    dims = [int(x) for x in it.group(1).split(",")]
    ids = _iota(
      dims, [int(x) for x in it.group(2).split(",")], [int(x) for x in it.group(3).split(",")] if it.group(3) else None
    )
    return ids.reshape(-1, dims[-1]).tolist()
  mm = re.match(r"mesh\[([^\]]*)\](?:<=\[([\d,]+)\](?:T\(([\d,]+)\))?)?\s*\{([^}]*)\}", s)
  if mm:
    axes = [(a.split("=")[0].strip().strip("'\""), int(a.split("=")[1])) for a in _top_level(mm.group(1)) if "=" in a]
    sizes = [n for _, n in axes]
    if mm.group(2):
      ids = _iota(
        sizes,
        [int(x) for x in mm.group(2).split(",")],
        [int(x) for x in mm.group(3).split(",")] if mm.group(3) else None,
      )
    else:
      ids = np.arange(int(np.prod(sizes))).reshape(sizes)
    chosen = [a.strip().strip("'\"") for a in mm.group(4).split(",") if a.strip()]
    names = [n for n, _ in axes]
    if not chosen or any(c not in names for c in chosen):
      return [list(range(num_partitions))]
    keep = [i for i, n in enumerate(names) if n not in chosen] + [names.index(c) for c in chosen]
    group = int(np.prod([sizes[names.index(c)] for c in chosen]))
    return ids.transpose(keep).reshape(-1, group).tolist()
  return [list(range(num_partitions))]


@dataclass
class Collective:
  name: str
  kind: str  # one of KINDS
  computation: str
  size: int  # bytes of the per-GPU buffer, nccl-tests' convention (module docstring)
  in_bytes: int
  out_bytes: int
  groups: list[list[int]]  # partition ids; for collective-permute, its (source, target) pairs
  count: int = 1  # runs per step (trip counts of enclosing loops)
  is_async: bool = False
  ops_between: int = 0  # compute ops scheduled between start and done
  op_name: str = ""  # jax's metadata: where in the program it came from

  @property
  def group_size(self) -> int:
    return 2 if self.kind == "collective-permute" else max(len(g) for g in self.groups)

  @property
  def overlapped(self) -> bool:
    return self.is_async and self.ops_between > 0

  def as_dict(self) -> dict:
    return {
      "name": self.name,
      "kind": self.kind,
      "size": self.size,
      "group_size": self.group_size,
      "num_groups": len(self.groups),
      "count": self.count,
      "overlapped": self.overlapped,
      "ops_between": self.ops_between,
      "op_name": self.op_name,
    }


def _base_kind(opcode: str) -> str | None:
  for suffix in ("-start", "-done", ""):
    if opcode.endswith(suffix) and opcode[: len(opcode) - len(suffix)] in KINDS:
      return opcode[: len(opcode) - len(suffix)]
  return None


def _multiplicities(comps: dict[str, Computation]) -> dict[str, int]:
  """How many times a step runs each computation: from ENTRY down, while bodies times their trip count."""
  calls: dict[str, list[tuple[str, int]]] = {c: [] for c in comps}
  for c in comps.values():
    for ins in c.instructions:
      trip = 1
      if ins.opcode == "while":
        t = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attrs)
        trip = int(t.group(1)) if t else 1
      for key in ("body", "condition", "calls", "to_apply", "true_computation", "false_computation"):
        v = _attr(ins.attrs, key)
        if v:
          for callee in v.strip("{}").split(","):
            callee = callee.strip().lstrip("%")
            if callee in comps:
              calls[c.name].append((callee, trip if key in ("body", "condition") else 1))
      v = _attr(ins.attrs, "branch_computations")
      if v:
        for callee in v.strip("{}").split(","):
          if callee.strip().lstrip("%") in comps:
            calls[c.name].append((callee.strip().lstrip("%"), 1))
  mult = dict.fromkeys(comps, 0)
  # The call graph is a DAG: add each caller's count to its callees in topological order.
  order, seen = [], set()

  def visit(n):
    if n in seen:
      return
    seen.add(n)
    for callee, _ in calls[n]:
      visit(callee)
    order.append(n)

  for n in comps:
    visit(n)
  for n in comps:
    if comps[n].entry:
      mult[n] = 1
  for n in reversed(order):
    for callee, k in calls[n]:
      mult[callee] += mult[n] * k
  return mult


def parse(text: str) -> list[Collective]:
  """Every collective of an HLO module's text, with its runs per step and overlap."""
  comps, num_partitions = parse_module(text)
  mult = _multiplicities(comps)
  shapes: dict[str, str] = {}
  for c in comps.values():
    shapes.update(c.params)
    shapes.update({i.name: i.shape for i in c.instructions})

  def wrapped_kind(ins: Instruction) -> tuple[str | None, Instruction | None]:
    """For `async-start(..., calls=%w)`: the collective that %w wraps."""
    callee = (_attr(ins.attrs, "calls") or "").lstrip("%")
    for inner in comps[callee].instructions if callee in comps else []:
      k = _base_kind(inner.opcode)
      if k and not inner.opcode.endswith(("-start", "-done")):
        return k, inner
    return None, None

  found = []
  for c in comps.values():
    if not mult.get(c.name):
      continue
    done_index = {}
    for idx, ins in enumerate(c.instructions):
      if ins.opcode.endswith("-done") and ins.operands:
        done_index[ins.operands[0]] = idx
    for idx, ins in enumerate(c.instructions):
      kind = _base_kind(ins.opcode)
      inner = ins
      if ins.opcode == "async-start":
        kind, inner = wrapped_kind(ins)
      if not kind or ins.opcode.endswith("-done"):
        continue
      is_async = ins.opcode.endswith("-start")
      if is_async and ins.name in done_index:
        done = c.instructions[done_index[ins.name]]
        out_bytes = shape_bytes(done.shape)
        between = c.instructions[idx + 1 : done_index[ins.name]]
        ops_between = sum(1 for b in between if b.opcode in COMPUTE_OPS)
      else:
        out_bytes, ops_between = shape_bytes(ins.shape), 0
        if is_async:  # a start without its done in this computation: count it as exposed
          is_async = False
      operands = ins.operands[:1] if kind == "ragged-all-to-all" else ins.operands
      in_bytes = sum(shape_bytes(shapes.get(o, "")) for o in operands)
      if kind == "collective-permute":
        pairs = _attr(inner.attrs, "source_target_pairs") or "{}"
        groups = [[int(x) for x in p.strip("{} ").split(",")] for p in _top_level(pairs[1:-1])]
      else:
        groups = replica_groups(inner.attrs, num_partitions)
      n = max(len(g) for g in groups) if groups else 1
      if not in_bytes:  # operand not found (should not happen): derive it from the output
        in_bytes = out_bytes // n if kind == "all-gather" else out_bytes * n if kind == "reduce-scatter" else out_bytes
      size = {"all-gather": out_bytes, "reduce-scatter": in_bytes, "ragged-all-to-all": in_bytes}.get(kind, out_bytes)
      op_name = re.search(r'op_name="([^"]*)"', ins.attrs)
      found.append(
        Collective(
          ins.name, kind, c.name, size, in_bytes, out_bytes, groups, mult[c.name], is_async, ops_between,
          op_name.group(1) if op_name else "",
        )
      )  # fmt: skip
  return found


@dataclass(frozen=True)
class Placement:
  nodes: int  # nodes one group spans
  per_node: int  # most members of one group in one node
  group_size: int

  @property
  def crosses_nodes(self) -> bool:
    return self.nodes > 1


def classify(c: Collective, device_ids: list[int] | None, gpus_per_node: int) -> Placement:
  """Where c's groups sit: the widest group's node count and members per node (the slowest group)."""
  worst = Placement(1, c.group_size, c.group_size)
  for g in c.groups:
    devs = [device_ids[p] if device_ids is not None and p < len(device_ids) else p for p in g]
    nodes: dict[int, int] = {}
    for d in devs:
      nodes[d // gpus_per_node] = nodes.get(d // gpus_per_node, 0) + 1
    size = c.group_size
    p = Placement(
      len(nodes), max(nodes.values()) if c.kind != "collective-permute" else 1 if len(nodes) > 1 else 2, size
    )
    if (p.nodes, -p.per_node) > (worst.nodes, -worst.per_node):
      worst = p
  return worst


def summary(collectives: list[Collective]) -> dict:
  """Bytes per step by kind (size x runs), and how many are asynchronous with work to hide behind."""
  out = {}
  for c in collectives:
    s = out.setdefault(c.kind, {"ops": 0, "runs": 0, "bytes": 0, "overlapped_runs": 0})
    s["ops"] += 1
    s["runs"] += c.count
    s["bytes"] += c.size * c.count
    s["overlapped_runs"] += c.count if c.overlapped else 0
  return out


if __name__ == "__main__":  # python -m MaxText.plan.collectives HLO.txt: the collectives as JSON lines
  import sys

  for col in parse(open(sys.argv[1]).read()):
    print(json.dumps(col.as_dict()))
