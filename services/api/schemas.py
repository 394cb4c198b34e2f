"""Request and response bodies of the operator API (the event contracts stay in contracts/)."""

from __future__ import annotations

import re
from typing import Any, Literal
from urllib.parse import unquote, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, computed_field

from contracts.events.changefeeds import ChangefeedSpecV2
from contracts.events.table_incidents import TableStoppedV2
from libs.progress_text import rows_progress
from libs.secret_refs import is_reference
from libs.ts import behind_text, duration_text
from libs.ts import lag_seconds as ts_lag_seconds

REDACTED = "***"
_CHECKPOINT_TIME = ("The checkpoint as a UTC time and how far it is behind the wall clock "
                    "(`2026-11-23 22:31:07.120 UTC, 0.8 s behind`); null before the first checkpoint. "
                    "checkpoint_ts and lag_s hold the raw values.")


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (everything else kept).

    Not SQLAlchemy's ``make_url`` (libs/dburl.py parses database URLs with it): the NATS sink's
    URLs list several ``host:port`` servers, which make_url reads as one bad port, and its
    rendering would percent-encode the ``***``."""
    try:
        parts = urlsplit(url)
        if not parts.password or is_reference(unquote(parts.password)):
            return url  # a secret's name is not the secret
        host = parts.netloc.rsplit("@", 1)[1]
        return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:{REDACTED}@{host}"))
    except ValueError:
        return "<unparseable URL>"


# user:password@ inside URLs anywhere in a text; a secret:NAME reference is left as it is.
_URL_PASSWORD = re.compile(r"(://[^:/@\s\"']*:)(?!secret:)([^@\s\"'/]+)(@)")


def redact_urls_in_text(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***`` (raw payloads)."""
    return _URL_PASSWORD.sub(lambda m: f"{m.group(1)}{REDACTED}{m.group(3)}", text)


def unredact_url(url: str, stored: str) -> str:
    """An update may send back a URL as the api showed it: keep the stored password then."""
    try:
        parts, old = urlsplit(url), urlsplit(stored)
        if parts.password != REDACTED or not old.password:
            return url
        if (parts.scheme, parts.username, parts.hostname, parts.port) != (
                old.scheme, old.username, old.hostname, old.port):
            return url
        return urlunsplit(parts._replace(netloc=old.netloc))
    except ValueError:
        return url


def redact_spec(spec: ChangefeedSpecV2) -> dict[str, Any]:
    body = spec.model_dump(mode="json")
    body["sink_url"] = redact_url(spec.sink_url)
    for src in body["sources"]:
        src["url"] = redact_url(src["url"])
    return body


def lag_seconds(ts: int, now: float | None = None) -> float | None:
    """Seconds between now and a ts, rounded for display; None before any ts (not 0: unknown)."""
    if ts <= 0:
        return None
    return round(ts_lag_seconds(ts, now), 3)


_NOT_YET_RUNNING = {"absent", "prepare", "commit"}


def waiting_for(state: str, members: tuple[str | None, ...], prepare: dict[str, Any] | None,
                snapshot: dict[str, Any] | None, now: float) -> str | None:
    """Why a span is not streaming yet, for people: its initial load's progress, or what its
    worker's prepare waits for (the prepare bucket); None once it streams."""
    if snapshot and snapshot.get("state") not in (None, "done"):
        done, estimate = int(snapshot.get("rows_copied") or 0), snapshot.get("rows_estimate")
        return f"initial load {snapshot['state']}: {rows_progress(done, int(estimate or 0))} copied"
    if state not in _NOT_YET_RUNNING:
        return None
    if prepare and prepare.get("member") in members:
        since = float(prepare.get("since") or now)
        return f"{prepare.get('waiting_for')} on {prepare['member']}, {duration_text(max(0.0, now - since))}"
    if state == "absent":
        return "the scheduler to place it on a worker (workers join once their Spark is warm)"
    return "its worker to start preparing it"


class Accepted(BaseModel):
    """A command was accepted; follow it at ``follow`` (and in the event feed from ``seq``)."""

    accepted: bool = True
    detail: str = ""
    seq: int | None = Field(None, description="Sequence of the recorded event in its domain stream.")
    follow: str = Field("", description="Where to watch the effect (a resource URL).")
    events: str = Field("", description="The event feed from just before this command.")
    warnings: list[str] = Field(default_factory=list,
                                description="Accepted, but worth a look (e.g. cross-shard unique conflicts, "
                                            "cascading foreign keys the binlog does not show).")


def stopped_text(stopped: TableStoppedV2) -> str:
    """A stopped table's error line: why it stopped (the api's ``error`` of the table)."""
    if stopped.kind == "unreplicable":
        return f"stopped: the table cannot be replicated: {stopped.error}"
    return (f"stopped: the downstream refused the {stopped.statement} of key {stopped.key} in "
            f"{stopped.target}: {stopped.error}")


class StoppedTableOut(BaseModel):
    """A table stopped by an incident: the changefeed's checkpoint does not cover it."""

    source: str
    database: str
    table: str
    incident: str
    kind: str = Field(description="refused (its downstream refused a change) or unreplicable.")
    reason: str
    checkpoint_ts: int | None = Field(
        description="Where it stopped: its own checkpoint (everything up to it is downstream).")

    @computed_field(description="Its checkpoint as a UTC time.")  # type: ignore[prop-decorator]
    @property
    def checkpoint_time(self) -> str | None:
        return behind_text(self.checkpoint_ts) if self.checkpoint_ts else None


class ChangefeedOut(BaseModel):
    id: str
    state: str
    spec: dict[str, Any] = Field(description="The changefeed spec with passwords redacted.")
    checkpoint_ts: int = Field(description="Every change up to it is downstream for every table "
                                           "it covers: all but the stopped_tables.")
    resolved_ts: int
    lag_s: float | None
    tables: int
    tables_by_state: dict[str, int]
    stopped_tables: list[StoppedTableOut] = Field(
        default_factory=list, description="Tables stopped by an incident, left out of the checkpoint "
                                          "until an operator resumes them and they catch up.")

    @computed_field(description=_CHECKPOINT_TIME)  # type: ignore[prop-decorator]
    @property
    def checkpoint_time(self) -> str | None:
        return behind_text(self.checkpoint_ts)
    failed_checks: list[dict[str, str]] = Field(
        default_factory=list, description="Creation checks that failed when it was accepted with "
                                          "skip_checks (check, target, message).")
    syncpoint: dict[str, Any] | None = Field(
        None, description="With syncpoint_interval: the last released syncpoint (last_ts, last_time, "
                          "last_commit_time), the pending one (cap_ts, holding, hold_until) and counts.")


class CheckpointOut(BaseModel):
    stream_seq: int
    ts: int


class TableOut(BaseModel):
    changefeed: str
    source: str
    database: str
    table: str
    key: str
    state: str
    primary: str | None
    secondary: str | None
    members: dict[str, str]
    error: str | None
    checkpoint_ts: int
    resolved_ts: int
    lag_s: float | None
    checkpoint: CheckpointOut | None = Field(None, description="The span's stored checkpoint.")
    snapshot: dict[str, Any] | None = Field(None, description="Initial-load progress, when any.")
    waiting_for: str | None = Field(
        None, description="Why the table does not stream yet (initial-load progress, or what its "
                          "worker's prepare waits for: its start, Spark warming up, the commit); "
                          "null once it streams.")
    incident: dict[str, Any] | None = Field(
        None, description="Why the table is stopped (state `stopped`): its downstream refused a change "
                          "for good (kind refused) or it cannot be replicated as the changefeed says "
                          "(kind unreplicable); it waits for an operator "
                          "(POST .../errors/{incident}/skip|retry|resume).")

    @computed_field(description=_CHECKPOINT_TIME)  # type: ignore[prop-decorator]
    @property
    def checkpoint_time(self) -> str | None:
        return behind_text(self.checkpoint_ts)


class MemberOut(BaseModel):
    member_id: str
    incarnation: str
    address: str
    draining: bool
    tables: int
    primary: int
    secondary: int


class SourceOut(BaseModel):
    id: str
    url: str
    changefeeds: list[str]
    registered: bool = Field(False, description="In the sources registry (`sluice source add`).")
    resolved_ts: int | None
    resolved_lag_s: float | None
    capture_leader: str | None
    problem_kind: str | None = Field(None, description=(
        "Why capture does not read the source: source_error (it cannot connect or log in), refused, "
        "binlog_purged; or the kind of capture's newest rejection of the source as a whole while no "
        "resolved mark followed it."))
    problem: str | None = Field(None, description="What stops capture of this source and the fix; null "
                                "while it reads.")
    problem_since: str | None = Field(None, description=(
        "Since when capture's sessions with the source fail (UTC), while they do."))

    @computed_field(description="The newest resolved mark as a UTC time and how far it is behind the "  # type: ignore[prop-decorator]
                                "wall clock; null before the capture published one.")
    @property
    def resolved_time(self) -> str | None:
        return behind_text(self.resolved_ts or 0)


class LeaderOut(BaseModel):
    service: str
    leader: str
    epoch: int
    revision: int


class DeadLetterOut(BaseModel):
    seq: int
    subject: str
    origin_stream: str
    original_subject: str
    original_seq: int | None
    kind: str
    reason: str
    time: str | None
    headers: dict[str, str]
    data: str = Field(description="The payload as text (bytes that are not UTF-8 are escaped).")
    size: int


class StatusOut(BaseModel):
    changefeeds: list[ChangefeedOut]
    members: list[MemberOut]
    ddl_locks: list[dict[str, Any]]
    ddl_locks_error: str | None = None


class MoveIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dest: str = Field(min_length=1, max_length=200, description="Member to move the table to.")


class ResignIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    epoch: int | None = Field(None, ge=1, description="Only resign if the leader is at this epoch.")
    reason: str = Field("", max_length=500)


class UnlockIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["exec", "skip"]
    owner: str | None = Field(None, min_length=1, max_length=1000,
                              description="exec: the shard (span) that executes the DDL.")
    reason: str = Field("", max_length=500)


class ReasonIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = Field("", max_length=500)
