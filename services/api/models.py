"""The api's read models: SQL tables (sqlmodel) written by the projections, read by the routes.

They hold what the domain streams add up to, nothing else: dropping them and replaying the
streams gives the same rows (the api does exactly that on every start)."""

from __future__ import annotations

from sqlmodel import Field, SQLModel


class ChangefeedRow(SQLModel, table=True):
    __tablename__ = "changefeeds"

    id: str = Field(primary_key=True)
    state: str
    spec_json: str = Field(description="ChangefeedSpec as JSON, passwords redacted (secret "
                                       "references are kept: they are names).")
    failed_checks_json: str = Field("[]", description="Checks that failed when it was accepted.")
    checkpoint_ts: int = 0
    resolved_ts: int = 0


class MemberRow(SQLModel, table=True):
    __tablename__ = "members"

    member_id: str = Field(primary_key=True)
    incarnation: str
    address: str = ""
    draining: bool = False


class SpanRow(SQLModel, table=True):
    """One span: its replication set as last recorded, or a wanted span without a set yet."""

    __tablename__ = "spans"

    key: str = Field(primary_key=True)
    changefeed: str = Field(index=True)
    source: str
    database: str
    table: str
    state: str = "absent"
    primary: str | None = None
    secondary: str | None = None
    members_json: str = "{}"
    error: str | None = None
    checkpoint_ts: int = 0
    resolved_ts: int = 0
    wanted: bool = False


class ProjectionPosition(SQLModel, table=True):
    """The newest stream sequence each domain's projection has folded."""

    __tablename__ = "projection_positions"

    domain: str = Field(primary_key=True)
    seq: int = 0
    events: int = 0
