"""How a bench prints its results: a table for people by default, JSON lines with ``--json`` for scripts.

Contract:

- :func:`add_json_option` gives a parser ``--json``; ``SYNCPS_BENCH_JSON=1`` in the environment means the same
  (:mod:`bench.ab` sets it for the trees it runs: a tree from before ``--json`` existed prints JSON lines anyway and
  would refuse the option). Every bench that another script or a test reads is run with one of the two.
- :class:`Results`: ``add(line)`` prints the line at once as JSON with ``--json`` (one line, flushed: what
  ``json.loads`` of each line starting with ``{`` reads); else it keeps the line, says on stderr that it has it,
  and ``close()`` (or the end of a ``with``) prints one table of them all on stdout.
- :func:`table`: one row per result, one column per field (``columns``, or every field in order of first
  appearance; a nested map's fields as ``name.field``, lists left out); more than :data:`WIDE` of those, and the
  table is turned: one row per field, one column per result (a bench's chosen ``columns`` are never turned). Floats to 4 significant digits, a missing field ``-``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Iterable, Sequence

#: above this many fields a table of every field is printed turned (a row per field)
WIDE = 9
ENV = "SYNCPS_BENCH_JSON"


def add_json_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--json", action="store_true", default=os.environ.get(ENV) == "1",
                    help=f"print one JSON line per result instead of a table (also when {ENV}=1)")


def flat(line: dict[str, Any]) -> dict[str, Any]:
    """``line`` with a nested map's fields as ``name.field``, lists left out."""
    out: dict[str, Any] = {}
    for key, value in line.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items() if not isinstance(v, (dict, list))})
        elif not isinstance(value, list):
            out[key] = value
    return out


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def grid(rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns two spaces apart, a rule under the first row."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    text = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join([text[0], "  ".join("-" * w for w in widths), *text[1:]])


def table(lines: Iterable[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    rows = [flat(line) for line in lines]
    if not rows:
        return "(no results)"
    names = list(columns or dict.fromkeys(k for r in rows for k in r))
    if columns is None and len(names) > WIDE:
        return grid([["field", *(str(i + 1) for i in range(len(rows)))],
                     *([n, *(cell(r.get(n)) for r in rows)] for n in names)])
    return grid([names, *([cell(r.get(n)) for n in names] for r in rows)])


class Results:
    def __init__(self, as_json: bool, columns: Sequence[str] | None = None, prog: str = "bench") -> None:
        self.as_json, self.columns, self.prog = as_json, columns, prog
        self.lines: list[dict[str, Any]] = []

    def add(self, line: dict[str, Any]) -> None:
        self.lines.append(line)
        if self.as_json:
            print(json.dumps(line), flush=True)
        else:
            print(f"{self.prog}: result {len(self.lines)} in", file=sys.stderr, flush=True)

    def close(self) -> None:
        if not self.as_json:
            print(table(self.lines, self.columns), flush=True)

    def __enter__(self) -> "Results":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
