"""Table name patterns and the table filter: which upstream tables a changefeed replicates.

Patterns: a glob (``fnmatch`` syntax, case-sensitive like MySQL names on Linux), or a regular
expression when the text starts with ``~`` (DM's convention), which must match the whole name.
Filter patterns match ``schema.table`` as a whole. Routing (``libs.routing``) and table rules
(``libs.table_rules``) both build on this module, which depends on neither.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

from contracts.events.changefeeds import TableFilterV1


class RoutingConfigError(ValueError):
    """A rule or filter that cannot even be read (bad regex, empty target)."""



# -- patterns -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class NamePattern:
    """A glob, or a regex when written with a leading ``~``. Compiled once."""

    spec: str
    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.spec.startswith("~"):
            body = self.spec[1:]
            try:
                compiled = re.compile(body)
            except re.error as exc:
                raise RoutingConfigError(f"pattern {self.spec!r} is not a valid regular expression: {exc}"
                                         ) from None
        else:
            # fnmatch.translate gives an anchored regex; compiling it once keeps route() cheap
            # when it runs for every span of a big changefeed.
            compiled = re.compile(fnmatch.translate(self.spec))
        object.__setattr__(self, "_regex", compiled)

    @property
    def is_regex(self) -> bool:
        return self.spec.startswith("~")

    @property
    def is_literal(self) -> bool:
        """Matches exactly one name (no glob metacharacters, not a regex)."""
        return not self.is_regex and not any(ch in self.spec for ch in "*?[")

    def matches(self, name: str) -> bool:
        return self._regex.fullmatch(name) is not None


# -- filter ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TableFilter:
    """A table is in when ``schema.table`` matches an include pattern and no exclude pattern."""

    include: tuple[str, ...] = ("*.*",)
    exclude: tuple[str, ...] = ()
    _include: tuple[NamePattern, ...] = field(init=False, repr=False, compare=False)
    _exclude: tuple[NamePattern, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_include", tuple(NamePattern(p) for p in self.include))
        object.__setattr__(self, "_exclude", tuple(NamePattern(p) for p in self.exclude))

    @classmethod
    def from_contract(cls, flt: TableFilterV1) -> TableFilter:
        return cls(tuple(flt.include), tuple(flt.exclude))

    def selected(self, schema: str, table: str) -> bool:
        name = f"{schema}.{table}"
        if not any(p.matches(name) for p in self._include):
            return False
        return not any(p.matches(name) for p in self._exclude)
