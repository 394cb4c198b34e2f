"""The changefeeds domain folded: each changefeed's spec and state, the tables stopped by their
downstream and the sources registry. The api, the scheduler, ddl-lock and standalone
sink-workers all follow the changefeeds stream with this one fold (``changefeeds_fold``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel

from contracts.events.changefeeds import (
    ChangefeedCheckV1,
    ChangefeedCreatedV2,
    ChangefeedCreatedV3,
    ChangefeedCreatedV4,
    ChangefeedCreatedV5,
    ChangefeedCreatedV6,
    ChangefeedCreatedV7,
    ChangefeedSpec,
    ChangefeedStateChangedV1,
    ChangefeedUpdatedV2,
    ChangefeedUpdatedV3,
    ChangefeedUpdatedV4,
    ChangefeedUpdatedV5,
    ChangefeedUpdatedV6,
    ChangefeedUpdatedV7,
    current_spec,
)
from contracts.events.sources import SourceMovedV1, SourceRegisteredV1, SourceRemovedV1
from contracts.events.table_incidents import TableActionRequestedV1, TableStoppedV2
from libs.eventstore import StoredEvent

TableKey = tuple[str, str, str, str]
"""``(changefeed, source, database, table)``."""


@dataclass
class ChangefeedView:
    """The changefeeds as their event log says they are now."""

    specs: dict[str, ChangefeedSpec] = field(default_factory=dict)
    states: dict[str, str] = field(default_factory=dict)
    failed_checks: dict[str, list[ChangefeedCheckV1]] = field(default_factory=dict)
    """Checks that failed at the last create/update, accepted with skip_checks."""

    stopped: dict[TableKey, TableStoppedV2] = field(default_factory=dict)
    """Each table's open incident (none once an operator acted on it)."""
    skipped: dict[TableKey, dict[str, int]] = field(default_factory=dict)
    """Each table's skipped keys (key JSON -> the ts the skip covers up to)."""
    sources: dict[str, str] = field(default_factory=dict)
    """The sources registry (libs/sources.py): source id -> URL (passwords as references)."""

    def _fold_incident(self, event: TableStoppedV2 | TableActionRequestedV1) -> None:
        ref = event.table
        key = (ref.changefeed, ref.source, ref.database, ref.table)
        if isinstance(event, TableStoppedV2):
            self.stopped[key] = event
            return
        open_ = self.stopped.get(key)
        if open_ is None or open_.incident != event.incident:
            return  # late, repeated or for an older incident: nothing to do
        del self.stopped[key]
        if event.action == "skip" and open_.key is not None:
            keys = self.skipped.setdefault(key, {})
            keys[open_.key] = max(open_.upto_ts, keys.get(open_.key, 0))

    def apply(self, event: BaseModel) -> bool:
        """Fold one event; True when it changed anything the worker acts on."""
        if isinstance(event, TableStoppedV2 | TableActionRequestedV1):
            self._fold_incident(event)
            return False
        # Changefeeds hold the URL they were recorded with, so the registry alone changes
        # nothing a worker runs.
        if isinstance(event, SourceRegisteredV1):
            self.sources[event.id] = event.url
            return False
        if isinstance(event, SourceRemovedV1):
            self.sources.pop(event.id, None)
            return False
        if isinstance(event, SourceMovedV1):
            return self._move_source(event)
        if isinstance(event, ChangefeedCreatedV2 | ChangefeedCreatedV3 | ChangefeedCreatedV4
                      | ChangefeedCreatedV5 | ChangefeedCreatedV6 | ChangefeedCreatedV7):
            cf = event.spec.id
            spec = current_spec(event.spec)
            changed = self.specs.get(cf) != spec or self.states.get(cf) != "running"
            self.specs[cf] = spec
            self.states[cf] = "running"
            self._checks(cf, event)
            return changed
        if isinstance(event, ChangefeedUpdatedV2 | ChangefeedUpdatedV3 | ChangefeedUpdatedV4
                      | ChangefeedUpdatedV5 | ChangefeedUpdatedV6 | ChangefeedUpdatedV7):
            cf = event.spec.id
            spec = current_spec(event.spec)
            changed = self.specs.get(cf) != spec
            self.specs[cf] = spec
            self.states.setdefault(cf, "running")  # an update does not resume a paused feed
            self._checks(cf, event)
            return changed
        if isinstance(event, ChangefeedStateChangedV1):
            changed = self.states.get(event.id) != event.state
            self.states[event.id] = event.state
            if event.state == "deleted":
                self.specs.pop(event.id, None)
                self.failed_checks.pop(event.id, None)
            return changed
        return False  # leader.elected, snapshots and other housekeeping

    def _move_source(self, event: SourceMovedV1) -> bool:
        """The registry and every changefeed reading the source take the new server's URL at
        this point of the log: whatever connects to the source (initial loads, validation)
        goes to the new server from here on."""
        if event.id in self.sources:
            self.sources[event.id] = event.url
        changed = False
        for cf, spec in list(self.specs.items()):
            if not any(ref.id == event.id and ref.url != event.url for ref in spec.sources):
                continue
            sources = [ref.model_copy(update={"url": event.url}) if ref.id == event.id else ref
                       for ref in spec.sources]
            self.specs[cf] = spec.model_copy(update={"sources": sources})
            changed = True
        return changed

    def _checks(self, cf: str, event: BaseModel) -> None:
        failed = getattr(event, "failed_checks", None) or []
        if failed:
            self.failed_checks[cf] = list(failed)
        else:
            self.failed_checks.pop(cf, None)

    def running(self) -> list[ChangefeedSpec]:
        return [spec for cf, spec in sorted(self.specs.items()) if self.states.get(cf) == "running"]


def changefeeds_fold(view: ChangefeedView, stored: StoredEvent) -> ChangefeedView:
    view.apply(stored.event)
    return view
