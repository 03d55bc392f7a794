"""Where the batch job's results go: in input order once complete, or line by line as they finish.

* :class:`OrderedOutput` (one engine, no ``--resume``): lines in input order, written to
  ``OUTPUT.partial`` and renamed to ``OUTPUT`` once every line is in.
* :class:`AppendOutput` (several engines, or ``--resume``): each record is appended and flushed the
  moment it finishes, so a crashed job keeps every finished record; lines are in completion order
  and carry their input ``index``.  With ``resume`` the records already in the file are kept and
  their keys skipped; a torn last line (the crash hit mid-write) is cut off and redone.

A record's key is its ``id`` when the input line has one, else ``#<index>`` (its position among the
input's non-blank lines): give ids when the input may change between a run and its resume.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

FSYNC_EVERY_S = 1.0


def record_key(index: int, record_id: Optional[str]) -> str:
    return record_id if record_id is not None else f"#{index}"


class OrderedOutput:
    """Buffers finished records and writes them in input order."""

    def __init__(self, path: Path):
        self.path = path
        self.partial = path.with_name(path.name + ".partial")
        self.done_keys: set[str] = set()
        self._file = open(self.partial, "w")
        self._waiting: dict[int, dict] = {}
        self._next = 0

    @property
    def waiting(self) -> int:
        """Finished records held back until the records before them finish."""
        return len(self._waiting)

    def write(self, record: dict) -> None:
        self._waiting[record["index"]] = record
        while self._next in self._waiting:
            self._file.write(json.dumps(self._waiting.pop(self._next)) + "\n")
            self._next += 1

    def close(self, complete: bool) -> None:
        self._file.close()
        if complete:
            os.replace(self.partial, self.path)


class AppendOutput:
    """Appends each record at once; with ``resume``, keeps what an earlier run wrote."""

    waiting = 0  # nothing is held back

    def __init__(self, path: Path, resume: bool):
        self.path = path
        self.done_keys = self.existing_keys(path) if resume else set()
        if resume and path.exists():
            data = path.read_bytes()
            keep = data.rfind(b"\n") + 1  # a last line without its newline was cut short by a crash
            if keep < len(data):
                with open(path, "r+b") as f:
                    f.truncate(keep)
        self._file = open(path, "a" if resume else "w")
        self._synced = time.monotonic()

    @staticmethod
    def existing_keys(path: Path) -> set[str]:
        """Keys of the complete lines in ``path`` (none if it does not exist); read only."""
        if not path.exists():
            return set()
        data = path.read_bytes()
        keys = set()
        for lineno, line in enumerate(data[:data.rfind(b"\n") + 1].splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                keys.add(record_key(int(rec["index"]), rec.get("id")))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a result line of this script "
                                 f"({type(e).__name__}: {e}); refusing to resume into it") from None
        return keys

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        # Flushed per record: a killed process loses nothing.  fsync (the machine itself going
        # down) at most once a second, so that it does not cap the records per second.
        self._file.flush()
        now = time.monotonic()
        if now - self._synced >= FSYNC_EVERY_S:
            os.fsync(self._file.fileno())
            self._synced = now

    def close(self, complete: bool) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()


__all__ = ["AppendOutput", "OrderedOutput", "record_key"]
