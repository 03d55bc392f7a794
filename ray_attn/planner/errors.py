"""Typed errors of the planner.

Each one subclasses the builtin an engine would naturally catch (ValueError for bad input, KeyError
for ids), and every raise happens before any state is touched, so catching one leaves the planner
exactly as it was.
"""

from __future__ import annotations


class PlannerError(Exception):
    """Base class of every error the planner raises on purpose."""


class PlannerConfigError(PlannerError, ValueError):
    """A constructor knob is invalid (e.g. a chunk size that is not a multiple of the block size)."""


class InvalidRequestError(PlannerError, ValueError):
    """A scheduled request is malformed: negative or inconsistent lengths, a duplicated id, more new
    tokens than the request holds."""


class UnknownRequestError(PlannerError, KeyError):
    """An id that the planner does not hold."""

    def __str__(self) -> str:  # KeyError would repr() the message; keep it readable
        return str(self.args[0]) if self.args else ""


class DoubleFreeError(UnknownRequestError):
    """Freeing a request (or block) that is already free."""


class OutOfBlocksError(PlannerError, RuntimeError):
    """Not enough free or evictable blocks.  Nothing was allocated; the engine should preempt."""

    def __init__(self, num_needed: int, num_available: int, what: str = ""):
        self.num_needed = int(num_needed)
        self.num_available = int(num_available)
        msg = f"need {self.num_needed} blocks but only {self.num_available} are free or evictable"
        super().__init__(f"{msg} ({what})" if what else msg)
