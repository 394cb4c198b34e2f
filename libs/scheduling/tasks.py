"""Schedule tasks (scheduler -> replication manager) and dispatches (manager -> member)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from libs.scheduling.model import MemberId, Span


@dataclass(frozen=True, slots=True)
class AddTable:
    """Start replicating an Absent span on ``member`` from ``checkpoint_ts``."""

    span: Span
    member: MemberId
    checkpoint_ts: int


@dataclass(frozen=True, slots=True)
class MoveTable:
    """Move a Replicating span to ``dest`` with two-phase scheduling.

    ``reason`` is for operators and metrics only ("balance", "drain", "operator", ...).
    """

    span: Span
    dest: MemberId
    reason: str = ""


@dataclass(frozen=True, slots=True)
class RemoveTable:
    """Stop replicating a span everywhere and forget it."""

    span: Span


ScheduleTask = AddTable | MoveTable | RemoveTable


class DispatchAction(StrEnum):
    ADD_PREPARE = "add-prepare"
    """First phase: load the span (pull and sort from the checkpoint) but write nothing."""
    ADD_COMMIT = "add-commit"
    """Second phase (promote): start writing downstream from the checkpoint."""
    REMOVE = "remove"
    """Stop the span and release it; reply Stopped with the final checkpoint."""


@dataclass(frozen=True, slots=True)
class Dispatch:
    """One command to one member. ``epoch`` fences it: a member that has seen a newer leader
    rejects it (No Double Write across leader changes)."""

    member: MemberId
    span: Span
    action: DispatchAction
    checkpoint_ts: int
    epoch: int
