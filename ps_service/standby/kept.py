"""The pair's term kept on disk (``PS_CHECKPOINT_DIR``/``pair-term.json``): what a PS that restarts knows of the terms
it served, so that it never serves an older one again (docs/guides/standby.md).

Contract: :meth:`KeptTerm.save` is called on every change of this PS's term or role, before the PS acts in it (the
file written whole, fsynced and renamed: a crash leaves the old term or the new one, never a torn file);
:meth:`KeptTerm.load` (at start) gives the term last saved, 0 if none (no file, or one that does not parse:
logged), and removes the temp files of a write cut short. No directory: the pair has no KeptTerm, nothing is kept and
a restart knows no term (the primary of term 1, as a first start).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from ps_service.checkpoint import atomic_write

log = logging.getLogger("ps_service")
NAME = "pair-term.json"


class KeptTerm:
    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory) / NAME

    def load(self) -> int:
        for stale in self.path.parent.glob(f".{NAME}.*.tmp"):  # a write cut short by a crash
            stale.unlink(missing_ok=True)
        try:
            term = json.loads(self.path.read_bytes())["term"]
        except FileNotFoundError:
            return 0
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("hot standby: %s does not hold a term (%s): none kept", self.path, exc)
            return 0
        return term if isinstance(term, int) and term >= 0 else 0

    def save(self, term: int, role: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, json.dumps({"term": term, "role": role}).encode())
