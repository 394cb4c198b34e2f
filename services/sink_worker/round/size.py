"""How many events each span pulls per round: more while it is behind, fewer once caught up.

A span whose round came back full (as many events as it was allowed, or events past them that
it only counted) is behind: its allowance doubles, up to the ceiling, so a backlog drains in
fewer, larger rounds (each round's Spark job has a fixed cost). A span whose round brought
less than half its allowance is caught up: its allowance halves toward the floor, which keeps
the read-ahead of a quiet span small. Between the two it stays where it is.

The allowances of one round are bounded together, which bounds the driver's memory: their sum
stays at or below the ceiling (``SLUICE_SINK_MAX_EVENTS_PER_ROUND``, as before this adapted),
and their expected bytes (allowance x the span's mean event size) within the byte budget. Past
either bound every span's share shrinks in proportion, never below one event. A behind span
next to idle ones may so take most of a round's events, where a fixed split gave it 1/n.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

# Weight of the newest round in a span's mean event size (an exponential moving average).
_SIZE_WEIGHT = 0.3


@dataclass
class _SpanSize:
    wanted: int
    mean_bytes: float = 0.0


class RoundSize:
    """Per-span event allowances of the rounds of one worker (pure: no I/O)."""

    def __init__(self, floor: int, ceiling: int, byte_budget: int) -> None:
        if ceiling < 1 or floor < 1 or byte_budget < 1:
            raise ValueError("floor, ceiling and byte budget must be positive")
        self.ceiling = ceiling
        self.floor = min(floor, ceiling)
        self.byte_budget = byte_budget
        self._spans: dict[Hashable, _SpanSize] = {}

    def wanted(self, span: Hashable) -> int:
        """The span's own allowance before the round's bounds (its starting one when unknown)."""
        known = self._spans.get(span)
        return known.wanted if known is not None else self.floor

    def limits(self, spans: Iterable[Hashable]) -> dict[Hashable, int]:
        """Each span's allowance for the next round, the round's bounds applied. A span seen
        for the first time starts at an equal share of the ceiling (what a fixed split gave)."""
        keys = list(dict.fromkeys(spans))
        if len(self._spans) > len(keys) or any(k not in self._spans for k in keys):
            present = set(keys)
            for gone in [k for k in self._spans if k not in present]:
                del self._spans[gone]
        if not keys:
            return {}
        share = max(self.floor, self.ceiling // len(keys))
        for key in keys:
            self._spans.setdefault(key, _SpanSize(wanted=share))
        wanted = {k: self._spans[k].wanted for k in keys}
        scale = 1.0
        total = sum(wanted.values())
        if total > self.ceiling:
            scale = self.ceiling / total
        expected = sum(n * self._spans[k].mean_bytes for k, n in wanted.items())
        if expected * scale > self.byte_budget:
            scale = self.byte_budget / expected
        if scale >= 1.0:
            return wanted
        return {k: max(1, int(n * scale)) for k, n in wanted.items()}

    def observe(self, span: Hashable, limit: int, events: int, event_bytes: int, behind: bool) -> None:
        """What the span's pull brought with ``limit``: ``events`` events of ``event_bytes``
        bytes in all; ``behind``: it left events in the stream or counted ones it kept no
        body of."""
        state = self._spans.setdefault(span, _SpanSize(wanted=self.floor))
        if events > 0:
            size = event_bytes / events
            state.mean_bytes = size if state.mean_bytes == 0 else (
                _SIZE_WEIGHT * size + (1 - _SIZE_WEIGHT) * state.mean_bytes)
        if behind or events >= limit:
            # Grown from what it had, not from a share the round's bounds cut: a span that
            # keeps coming back full keeps asking for more, and gets it when the others idle.
            state.wanted = min(self.ceiling, max(state.wanted, limit) * 2)
        elif events < limit // 2:
            state.wanted = max(self.floor, state.wanted // 2)
