"""Counting collectives (all-reduce, all-gather, ...) in compiled HLO.

:func:`count_collectives` reads the optimized HLO of a compiled step and counts collective
instructions by opcode. It is how the "one all-reduce per accumulation window" property of
:func:`accumjax.make_train_step` is checked, in the tests and in the benchmarks. It reads
text only: nothing is run.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from accumjax.collectives import count_collectives
  >>> hlo = '''HloModule m
  ... %add (a: f32[], b: f32[]) -> f32[] {
  ...   %a = f32[] parameter(0)
  ...   %b = f32[] parameter(1)
  ...   ROOT %s = f32[] add(%a, %b)
  ... }
  ... ENTRY %main (x: f32[4]) -> f32[4] {
  ...   %x = f32[4]{0} parameter(0)
  ...   ROOT %r = f32[4]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add
  ... }'''
  >>> count_collectives(hlo)["all-reduce"]
  1
  >>> count_collectives(jax.jit(jnp.sin).lower(jnp.ones(4)))["all-reduce"]  # a Lowered
  0
"""

from __future__ import annotations

import re
from typing import Any

import jax

__all__ = ["COLLECTIVE_OPS", "count_collectives"]

#: The opcodes counted (an async ``<op>-start``/``<op>-done`` pair counts once as ``<op>``).
#: The first five are always keys of :func:`count_collectives`' result.
COLLECTIVE_OPS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
    "collective-broadcast",
    "ragged-all-to-all",
)

_COMPUTATION_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*)$")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_CALLED = re.compile(
    r"\b(body|condition|calls|to_apply|branch_computations|true_computation|false_computation)"
    r"=(\{[^}]*\}|%?[\w.\-]+)"
)


def _hlo_text(x: Any) -> str:
    text: str | None
    if isinstance(x, str):
        text = x
    elif isinstance(x, jax.stages.Lowered):
        text = x.compile().as_text()
    elif isinstance(x, jax.stages.Compiled):
        text = x.as_text()
    else:
        raise TypeError(
            "count_collectives expects HLO text, a jax.stages.Compiled or a jax.stages.Lowered "
            f"(e.g. jax.jit(f).lower(*args)), got {type(x).__name__}."
        )
    if not text or "HloModule" not in text:
        raise ValueError(
            "count_collectives needs optimized HLO text (Compiled.as_text()); got text without "
            "an 'HloModule' header (StableHLO from Lowered.as_text() is not supported: pass the "
            "Lowered object itself)."
        )
    return text


def _opcode(rhs: str) -> str:
    """The opcode of an instruction's right-hand side ``<shape> <opcode>(...)``."""
    rhs = rhs.lstrip()
    if rhs.startswith("("):  # tuple shape: skip the balanced parentheses
        depth = 0
        for i, char in enumerate(rhs):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                rhs = rhs[i + 1 :]
                break
    else:
        rhs = rhs.split(" ", 1)[1] if " " in rhs else ""
    return rhs.lstrip().split("(", 1)[0].strip()


_ARRAY = re.compile(r"\b(pred|[sufc]\d+|bf16|f8e\w+)\[([\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16}


def _result_bytes(rhs: str) -> int:
    """Bytes of an instruction's result shape (every array of a tuple shape)."""
    depth, end = 0, len(rhs)
    for i, char in enumerate(rhs.lstrip()):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and char in " )":
            end = i + 1
            break
    total = 0
    for dtype, dims in _ARRAY.findall(rhs.lstrip()[:end]):
        bits = _BITS.get(dtype) or int(re.sub(r"\D", "", dtype) or 8)
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        total += size * bits // 8
    return total


def _collective(opcode: str) -> str | None:
    if opcode.endswith("-done"):
        return None
    base = opcode.removesuffix("-start")
    return base if base in COLLECTIVE_OPS else None


def _parse(text: str) -> tuple[dict[str, list[str]], str | None]:
    """Splits HLO text into ``{computation: [instruction right-hand sides]}`` and the entry."""
    computations: dict[str, list[str]] = {}
    entry, current = None, None
    for line in text.splitlines():
        header = _COMPUTATION_HEADER.match(line)
        if header and " = " not in line.split("(", 1)[0]:
            current = header.group(1)
            computations[current] = []
            if line.startswith("ENTRY"):
                entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        instruction = _INSTRUCTION.match(line)
        if current is not None and instruction:
            computations[current].append(instruction.group(1))
    return computations, entry


def _counted(rhs: str, min_bytes: int) -> str | None:
    """The collective an instruction is, if it moves at least ``min_bytes``."""
    kind = _collective(_opcode(rhs))
    return kind if kind and (min_bytes <= 0 or _result_bytes(rhs) >= min_bytes) else None


def _executed_counts(
    computations: dict[str, list[str]],
    entry: str,
    default_trip_count: int | None,
    min_bytes: int,
) -> dict[str, int]:
    memo: dict[str, dict[str, int]] = {}

    def visit(name: str) -> dict[str, int]:
        if name in memo:
            return memo[name]
        counts: dict[str, int] = {}
        for rhs in computations.get(name, []):
            op = _opcode(rhs)
            kind = _counted(rhs, min_bytes)
            if kind:
                counts[kind] = counts.get(kind, 0) + 1
            called = dict(_CALLED.findall(rhs))
            if op == "while":
                body = visit(called["body"].lstrip("%"))
                if body:
                    trip = _TRIP_COUNT.search(rhs)
                    if trip is None and default_trip_count is None:
                        raise ValueError(
                            f"A while loop contains collectives {body} but has no known trip "
                            "count; pass default_trip_count (e.g. 1 for a loop that runs at "
                            "most once) or use per_execution=False."
                        )
                    n = int(trip.group(1)) if trip else default_trip_count
                    for k, v in body.items():
                        counts[k] = counts.get(k, 0) + v * int(n or 0)
                continue
            if op == "conditional":  # one branch runs: count the most expensive one
                branch_counts = [
                    visit(b.strip().lstrip("%"))
                    for key in ("branch_computations", "true_computation", "false_computation")
                    if key in called
                    for b in called[key].strip("{}").split(",")
                ]
                for k in {k for c in branch_counts for k in c}:
                    counts[k] = counts.get(k, 0) + max(c.get(k, 0) for c in branch_counts)
                continue
            if "calls" in called:  # fusions, calls and async wrappers run once
                for callee in called["calls"].strip("{}").split(","):
                    for k, v in visit(callee.strip().lstrip("%")).items():
                        counts[k] = counts.get(k, 0) + v
        memo[name] = counts
        return counts

    return visit(entry)


def count_collectives(
    x: Any,
    *,
    per_execution: bool = False,
    default_trip_count: int | None = None,
    min_bytes: int = 0,
) -> dict[str, int]:
    """Counts collective instructions in optimized HLO, by opcode.

    Instructions are recognised by their opcode (not their name or metadata); an
    asynchronous pair ``all-reduce-start``/``all-reduce-done`` counts once, as
    ``"all-reduce"``. A variadic all-reduce of several arrays (one group) counts once.

    Args:
      x: HLO text (``Compiled.as_text()``), a ``jax.stages.Compiled`` or a
        ``jax.stages.Lowered`` (compiled here).
      per_execution: if False, count instructions as they appear in the program
        (an all-reduce inside a loop body counts once). If True, count how many
        run per execution: loop bodies are multiplied by their known trip count
        (``ValueError`` if unknown) and a conditional counts its most expensive branch.
      default_trip_count: with ``per_execution``, the trip count assumed for loops
        whose count XLA does not know (e.g. ``1`` for a run-at-most-once loop, giving an
        upper bound); ``None`` raises instead.
      min_bytes: count only collectives whose result holds at least this many bytes (all
        arrays of a variadic one together), e.g. to tell a gradient's reduction from a
        few scalars of metrics; 0 counts every one.

    Returns:
      A dict from op name (``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"``,
      ``"collective-permute"``, ``"all-to-all"``, plus any other collective found)
      to its count; the first five are always present.

    Example:
      >>> import jax, jax.numpy as jnp, accumjax
      >>> f = jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")
      >>> from accumjax.collectives import count_collectives
      >>> counts = count_collectives(f.lower(jnp.ones((jax.device_count(), 2))))
      >>> counts["all-reduce"] <= 1  # 0 on a single device: XLA removes it
      True
    """
    computations, entry = _parse(_hlo_text(x))
    counts: dict[str, int] = {op: 0 for op in COLLECTIVE_OPS[:5]}
    if per_execution:
        if entry is None:
            raise ValueError("HLO text has no ENTRY computation.")
        counts.update(_executed_counts(computations, entry, default_trip_count, min_bytes))
        return counts
    for body in computations.values():
        for rhs in body:
            kind = _counted(rhs, min_bytes)
            if kind:
                counts[kind] = counts.get(kind, 0) + 1
    return counts
