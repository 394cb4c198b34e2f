"""``sluice``: the operator API from a terminal. Human tables by default, ``--json`` for scripts.

The API URL and token come from ``--url``/``--token`` or ``SLUICE_API_URL``/``SLUICE_API_TOKEN``.
Exit codes: 0 done, 1 the API refused (its message is printed), 2 usage errors.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from libs.config import Settings
from libs.progress_text import progress_total
from services.cli import render
from services.cli.client import ApiClient, ApiError

app = typer.Typer(help="Operate Sluice through its API.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
changefeed_app = typer.Typer(help="Changefeeds: create, inspect, pause, delete.", no_args_is_help=True)
member_app = typer.Typer(help="Members (sink-workers): list, drain.", no_args_is_help=True)
ddl_app = typer.Typer(help="Shard DDL locks: list, show, unlock, force-remove.", no_args_is_help=True)
leader_app = typer.Typer(help="Leaders of the control services: list, resign.", no_args_is_help=True)
dl_app = typer.Typer(help="Dead letters: list, replay, discard.", no_args_is_help=True)
app.add_typer(changefeed_app, name="changefeed")
app.add_typer(member_app, name="member")
app.add_typer(ddl_app, name="ddl")
app.add_typer(leader_app, name="leader")
app.add_typer(dl_app, name="dead-letter")


class Cli:
    def __init__(self, client: ApiClient, as_json: bool) -> None:
        self.client = client
        self.json = as_json

    def run(self, method: str, path: str, body: Any = None, **params: Any) -> Any:
        try:
            if method == "GET":
                return self.client.get(path, **params)
            return self.client.call(method, path, body if body is not None or method != "POST" else {})
        except ApiError as exc:
            self._failed(exc)

    def pages(self, path: str, **params: Any) -> list[Any]:
        """Every item of a paged list, page after page."""
        try:
            return self.client.pages(path, **params)
        except ApiError as exc:
            self._failed(exc)

    @staticmethod
    def _failed(exc: ApiError) -> NoReturn:
        render.console.print(f"[red]error[/red] {exc.status or ''} {exc.message}".replace("  ", " "))
        raise typer.Exit(1) from None

    def show(self, value: Any, human: Any = None) -> None:
        if self.json or human is None:
            render.as_json(value)
        else:
            human(value)

    def accepted(self, answer: dict[str, Any]) -> None:
        if self.json:
            render.as_json(answer)
        else:
            follow = f" (follow: {answer['follow']})" if answer.get("follow") else ""
            render.console.print(f"accepted: {answer.get('detail', '')}{follow}")
            for warning in answer.get("warnings") or []:
                render.console.print(f"[yellow]warning[/yellow] {warning}")


def _cli(ctx: typer.Context) -> Cli:
    obj: Cli = ctx.obj
    return obj


@app.callback()
def main_options(ctx: typer.Context,
                 url: Annotated[str | None, typer.Option(help="API base URL (env SLUICE_API_URL).")] = None,
                 token: Annotated[str | None, typer.Option(
                     help="Bearer token (env SLUICE_API_TOKEN).", show_default=False)] = None,
                 as_json: Annotated[bool, typer.Option("--json", help="JSON output for scripts.")] = False,
                 ) -> None:
    # Each command measures the terminal (or COLUMNS) again: the width at import time may not
    # be the width of the terminal the command runs in.
    render.console = render.make_console()
    settings = Settings()
    secret = token or (settings.api_token.get_secret_value() if settings.api_token else None)
    client = ApiClient(url or settings.api_url, secret)
    ctx.obj = Cli(client, as_json)
    ctx.call_on_close(client.close)


# -- status ---------------------------------------------------------------------------------------

@app.command()
def status(ctx: typer.Context) -> None:
    """Every changefeed's lag, every member and every pending DDL lock."""
    cli = _cli(ctx)
    body = cli.run("GET", "/status")
    if cli.json:
        render.as_json(body)
        return
    render.changefeeds(body["changefeeds"])
    render.members(body["members"])
    if body.get("ddl_locks_error"):
        render.console.print(f"DDL locks: unknown ({body['ddl_locks_error']})")
    else:
        render.ddl_locks(body["ddl_locks"])


# -- changefeeds ----------------------------------------------------------------------------------

def spec_from_text(text: str) -> Any:
    """JSON, with whole-line ``//`` comments allowed (examples/changefeeds/*.jsonc). Only whole
    lines: ``//`` inside a value (every URL has one) stays."""
    return json.loads("\n".join("" if line.lstrip().startswith("//") else line
                                for line in text.splitlines()))


def _read_spec(path: Path) -> dict[str, Any]:
    try:
        spec = spec_from_text(path.read_text())
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(f"cannot read a JSON spec from {path}: {exc}") from None
    if not isinstance(spec, dict):
        raise typer.BadParameter(f"{path} must hold a JSON object (a changefeed spec)")
    return spec


@changefeed_app.command("list")
def changefeed_list(ctx: typer.Context) -> None:
    cli = _cli(ctx)
    cli.show(cli.run("GET", "/changefeeds"), render.changefeeds)


@changefeed_app.command("get")
def changefeed_get(ctx: typer.Context, changefeed: str) -> None:
    cli = _cli(ctx)
    cli.show(cli.run("GET", f"/changefeeds/{changefeed}"), render.changefeed)


@changefeed_app.command("syncpoint")
def changefeed_syncpoint(ctx: typer.Context, changefeed: str) -> None:
    """The last syncpoint (every table at one upstream ts, in the downstream's sluice_syncpoint)."""
    cli = _cli(ctx)
    cli.show(cli.run("GET", f"/changefeeds/{changefeed}/syncpoint"), render.syncpoint)


@changefeed_app.command("rules")
def changefeed_rules(ctx: typer.Context, changefeed: str) -> None:
    """The changefeed's table rules: events and rows left out, columns kept, dropped or computed."""
    cli = _cli(ctx)
    cli.show(cli.run("GET", f"/changefeeds/{changefeed}"),
             lambda body: render.table_rules(body["spec"].get("table_rules") or []))


SkipChecks = Annotated[bool, typer.Option(
    "--skip-checks", help="Accept even when the creation checks fail (shown as failed_checks).")]


def _skip(skip_checks: bool) -> str:
    return "?skip_checks=true" if skip_checks else ""


@changefeed_app.command("create")
def changefeed_create(ctx: typer.Context,
                      spec_file: Annotated[Path, typer.Argument(
                          help="JSON file with the changefeed spec (// comment lines allowed; "
                               "see examples/changefeeds/).")],
                      skip_checks: SkipChecks = False) -> None:
    """Create a changefeed from a spec (id, sources, filter, routes, table_rules, sink_url, start...)."""
    cli = _cli(ctx)
    cli.accepted(cli.run("POST", "/changefeeds" + _skip(skip_checks), _read_spec(spec_file)))


@changefeed_app.command("update")
def changefeed_update(ctx: typer.Context, changefeed: str, spec_file: Path,
                      skip_checks: SkipChecks = False) -> None:
    """Replace a changefeed's spec (passwords shown as *** keep their stored value)."""
    cli = _cli(ctx)
    cli.accepted(cli.run("PUT", f"/changefeeds/{changefeed}" + _skip(skip_checks), _read_spec(spec_file)))


@changefeed_app.command("pause")
def changefeed_pause(ctx: typer.Context, changefeed: str) -> None:
    cli = _cli(ctx)
    cli.accepted(cli.run("POST", f"/changefeeds/{changefeed}/pause"))


@changefeed_app.command("resume")
def changefeed_resume(ctx: typer.Context, changefeed: str) -> None:
    cli = _cli(ctx)
    cli.accepted(cli.run("POST", f"/changefeeds/{changefeed}/resume"))


@changefeed_app.command("delete")
def changefeed_delete(ctx: typer.Context, changefeed: str) -> None:
    cli = _cli(ctx)
    cli.accepted(cli.run("DELETE", f"/changefeeds/{changefeed}"))


@changefeed_app.command("tables")
def changefeed_tables(
        ctx: typer.Context, changefeed: str,
        page_size: Annotated[int, typer.Option(min=1, max=10_000, help="Tables per request.")] = 500,
) -> None:
    """Where each table runs, its state, checkpoint lag and initial-load progress (every table,
    read a page at a time)."""
    cli = _cli(ctx)
    cli.show(cli.pages(f"/changefeeds/{changefeed}/tables", limit=page_size), render.tables)


@changefeed_app.command("move")
def changefeed_move(ctx: typer.Context, changefeed: str, source: str, database: str, table: str,
                    to: Annotated[str, typer.Option("--to", help="Destination member.")]) -> None:
    """Move one table of a changefeed to another member."""
    cli = _cli(ctx)
    cli.accepted(cli.run("POST", f"/changefeeds/{changefeed}/tables/{source}/{database}/{table}/move",
                         {"dest": to}))


@changefeed_app.command("table-error")
def changefeed_table_error(
        ctx: typer.Context, changefeed: str, source: str, database: str, table: str,
        incident: Annotated[str, typer.Argument(help="The incident id `changefeed tables` shows.")],
        action: Annotated[str, typer.Argument(
            help="skip (dead-letter the refused change and go on), retry, or resume (after a fix).")],
) -> None:
    """Decide on a stopped table (a change its downstream refused for good, or a table that
    cannot be replicated as the changefeed says)."""
    cli = _cli(ctx)
    cli.accepted(cli.run(
        "POST", f"/changefeeds/{changefeed}/tables/{source}/{database}/{table}/errors/{incident}/{action}"))


def _snapshot_totals(tables: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for t in tables:
        snap = t.get("snapshot")
        if snap:
            name = f"{t['source']}/{t['database']}.{t['table']}"
            out[name] = {"rows_copied": int(snap.get("rows_copied") or 0),
                         "rows_estimate": int(snap.get("rows_estimate") or 0),
                         "state": str(snap.get("state", "")),
                         "rows_per_s": float(snap.get("rows_per_s") or 0.0), "eta_s": snap.get("eta_s")}
    return out


@changefeed_app.command("snapshot")
def changefeed_snapshot(ctx: typer.Context, changefeed: str,
                        wait: Annotated[bool, typer.Option(help="Follow until every copy is done.")] = False,
                        timeout: Annotated[float, typer.Option(help="Give up after this many s.")] = 3600,
                        ) -> None:
    """Initial-load progress of every table: rows copied of the estimate, speed and time left,
    with progress bars."""
    cli = _cli(ctx)
    totals = _snapshot_totals(cli.run("GET", f"/changefeeds/{changefeed}/tables"))
    if cli.json or not wait:
        if cli.json:
            render.as_json(totals)
        else:
            render.table("initial load", ["table", "state", "rows copied", "estimated rows (about)", "rows/s",
                                          "ETA"],
                         ([k, v["state"], v["rows_copied"], v["rows_estimate"] or None,
                           round(v["rows_per_s"]) or None,
                           render.duration(v["eta_s"]) if v["state"] != "done" else None]
                          for k, v in sorted(totals.items())))
        return
    deadline = time.monotonic() + timeout
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("{task.fields[speed]}"), console=render.console) as bars:
        ids = {}
        while True:
            for name, v in sorted(totals.items()):
                # Past the estimate the bar counts rows instead of showing more than 100%.
                est = progress_total(v["rows_copied"], v["rows_estimate"])
                if name not in ids:
                    ids[name] = bars.add_task(name, total=est, speed="")
                bars.update(ids[name], completed=v["rows_copied"], total=est,
                            description=f"{name} {v['state']}", speed=render.speed(v).strip())
            if all(v["state"] in ("done", "finished", "complete", "completed") for v in totals.values()):
                return
            if time.monotonic() > deadline:
                render.console.print("timed out waiting for the initial load")
                raise typer.Exit(1)
            time.sleep(1.0)
            totals = _snapshot_totals(cli.run("GET", f"/changefeeds/{changefeed}/tables"))


@app.command()
def rebalance(ctx: typer.Context) -> None:
    """Ask the scheduler to even out tables across members."""
    cli = _cli(ctx)
    cli.accepted(cli.run("POST", "/rebalance"))


def _problem(source: dict[str, Any]) -> str:
    """What stops capture of a source, and since when while its sessions fail."""
    problem = str(source.get("problem") or "")
    since = source.get("problem_since")
    return f"{problem} (since {since})" if problem and since else problem


@app.command()
def sources(ctx: typer.Context) -> None:
    """Sources of the changefeeds, with their newest resolved mark, capture leader and what stops
    capture (e.g. a purged binlog), with the fix."""
    cli = _cli(ctx)

    def human(items: list[dict[str, Any]]) -> None:
        render.table("sources", ["source", "url", "changefeeds", "resolved", "capture", "problem"],
                     ([s["id"], s["url"], ",".join(s["changefeeds"]), render.checkpoint(s, "resolved_time"),
                       s.get("capture_leader"), _problem(s)] for s in items))

    cli.show(cli.run("GET", "/sources"), human)


# -- members --------------------------------------------------------------------------------------

@member_app.command("list")
def member_list(ctx: typer.Context) -> None:
    cli = _cli(ctx)
    cli.show(cli.run("GET", "/members"), render.members)


@member_app.command("drain")
def member_drain(ctx: typer.Context, member: str,
                 wait: Annotated[bool, typer.Option(help="Show progress until the member is empty.")] = False,
                 timeout: Annotated[float, typer.Option(help="Give up after this many s.")] = 600,
                 ) -> None:
    """Move every table off a member (it keeps running, with nothing to do)."""
    cli = _cli(ctx)
    before = cli.run("GET", f"/members/{member}")
    cli.accepted(cli.run("POST", f"/members/{member}/drain"))
    if not wait:
        return
    total = int(before.get("tables") or 0)
    deadline = time.monotonic() + timeout
    with Progress(TextColumn("draining {task.fields[member]}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=render.console, disable=cli.json) as bars:
        task = bars.add_task("drain", total=max(total, 1), member=member)
        while True:
            try:
                left = int(cli.client.get(f"/members/{member}").get("tables") or 0)
            except ApiError as exc:
                if exc.status != 404:
                    raise
                left = 0  # the member left: nothing runs there any more
            total = max(total, left)
            bars.update(task, total=max(total, 1), completed=total - left)
            if left == 0:
                break
            if time.monotonic() > deadline:
                render.console.print(f"timed out with {left} table(s) still on {member}")
                raise typer.Exit(1)
            time.sleep(0.5)
    if cli.json:
        render.as_json({"member": member, "tables": 0, "drained": True})
    else:
        render.console.print(f"{member} is drained")


# -- DDL locks ------------------------------------------------------------------------------------

@ddl_app.command("list")
def ddl_list(ctx: typer.Context) -> None:
    cli = _cli(ctx)
    cli.show(cli.run("GET", "/ddl-locks"), render.ddl_locks)


@ddl_app.command("show")
def ddl_show(ctx: typer.Context, changefeed: str, target: str) -> None:
    cli = _cli(ctx)
    cli.show(cli.run("GET", f"/ddl-locks/{changefeed}/{target}"))


@ddl_app.command("unlock")
def ddl_unlock(ctx: typer.Context, changefeed: str, target: str,
               mode: Annotated[str, typer.Option(help="exec: the owner runs the DDL; skip: nobody does.")],
               owner: Annotated[str | None, typer.Option(help="exec: the shard (span) that runs it.")] = None,
               reason: str = "") -> None:
    if mode not in ("exec", "skip"):
        raise typer.BadParameter("--mode must be exec or skip")
    cli = _cli(ctx)
    cli.accepted(cli.run("POST", f"/ddl-locks/{changefeed}/{target}/unlock",
                         {"mode": mode, "owner": owner, "reason": reason}))


@ddl_app.command("force-remove")
def ddl_force_remove(ctx: typer.Context, changefeed: str, target: str, reason: str = "") -> None:
    cli = _cli(ctx)
    cli.accepted(cli.run("POST", f"/ddl-locks/{changefeed}/{target}/force-remove", {"reason": reason}))


# -- leaders --------------------------------------------------------------------------------------

@leader_app.command("list")
def leader_list(ctx: typer.Context) -> None:
    cli = _cli(ctx)
    cli.show(cli.run("GET", "/leaders"), lambda items: render.table(
        "leaders", ["service", "leader", "epoch"], ([x["service"], x["leader"], x["epoch"]] for x in items)))


@leader_app.command("resign")
def leader_resign(ctx: typer.Context, service: str,
                  epoch: Annotated[int | None, typer.Option(help="Only at this epoch.")] = None,
                  reason: str = "") -> None:
    """Ask a service's leader to step down; another replica takes over."""
    cli = _cli(ctx)
    cli.accepted(cli.run("POST", f"/leaders/{service}/resign", {"epoch": epoch, "reason": reason}))


# -- dead letters ---------------------------------------------------------------------------------

@dl_app.command("list")
def dl_list(ctx: typer.Context, after: int = 0, limit: int = 100) -> None:
    cli = _cli(ctx)
    cli.show(cli.run("GET", "/dead-letters", after=after, limit=limit), lambda items: render.table(
        "dead letters", ["seq", "from", "kind", "reason"],
        ([d["seq"], d["original_subject"], d["kind"], d["reason"][:80]] for d in items)))


@dl_app.command("replay")
def dl_replay(ctx: typer.Context, seq: int) -> None:
    """Republish a dead letter to its original subject and remove it."""
    cli = _cli(ctx)
    cli.accepted(cli.run("POST", f"/dead-letters/{seq}/replay"))


@dl_app.command("discard")
def dl_discard(ctx: typer.Context, seq: int) -> None:
    cli = _cli(ctx)
    cli.accepted(cli.run("DELETE", f"/dead-letters/{seq}"))


# -- events ---------------------------------------------------------------------------------------

@app.command()
def events(ctx: typer.Context,
           since: Annotated[str | None, typer.Option(help="Resume cursor (domain:seq,...).")] = None,
           domain: Annotated[list[str] | None, typer.Option(help="Domains to follow (repeat).")] = None,
           limit: Annotated[int | None, typer.Option(help="Stop after this many events.")] = None) -> None:
    """Follow the control-domain events; every line carries the cursor to resume from."""
    cli = _cli(ctx)
    params: dict[str, Any] = {"since": since, "domain": domain, "limit": limit}
    try:
        for frame in cli.client.events({k: v for k, v in params.items() if v is not None}):
            if frame.get("event") != "event":
                continue
            data = frame["data"]
            if cli.json:
                render.console.out(json.dumps({"cursor": frame.get("id"), **data}), highlight=False)
            else:
                render.console.out(f"{frame.get('id')}  {data.get('type')}  "
                                   f"{json.dumps(data.get('data'), sort_keys=True)[:200]}", highlight=False)
    except ApiError as exc:
        render.console.print(f"error {exc.status} {exc.message}")
        raise typer.Exit(1) from None


# -- sources registry -----------------------------------------------------------------------------

source_app = typer.Typer(help="The sources registry: add, list, set-url, remove (changefeeds and captures "
                              "read a source's URL from it by id).", no_args_is_help=True)
app.add_typer(source_app, name="source")


@source_app.command("add")
def source_add(ctx: typer.Context, source: str,
               url: Annotated[str, typer.Argument(help="mysql://user:secret:NAME@host:port/ (the "
                                                       "password as a named secret).")],
               changefeed: Annotated[list[str] | None, typer.Option(
                   "--changefeed", help="Also add the source to this changefeed (repeat).")] = None,
               skip_checks: SkipChecks = False) -> None:
    """Register a source once; with --changefeed a new shard is one command."""
    cli = _cli(ctx)
    cli.accepted(cli.run("POST", "/sources" + _skip(skip_checks), {"id": source, "url": url}))
    for cf in changefeed or []:
        spec = cli.run("GET", f"/changefeeds/{cf}")["spec"]
        if any(s.get("id") == source for s in spec["sources"]):
            render.console.print(f"changefeed {cf} reads {source} already")
            continue
        spec["sources"].append({"id": source})
        cli.accepted(cli.run("PUT", f"/changefeeds/{cf}" + _skip(skip_checks), spec))


@source_app.command("list")
def source_list(ctx: typer.Context) -> None:
    """Registered sources and the sources changefeeds read."""
    cli = _cli(ctx)

    def human(items: list[dict[str, Any]]) -> None:
        render.table("sources", ["source", "url", "registered", "changefeeds", "resolved", "capture",
                                 "problem"],
                     ([s["id"], s["url"], "yes" if s.get("registered") else "no", ",".join(s["changefeeds"]),
                       render.checkpoint(s, "resolved_time"), s.get("capture_leader"), _problem(s)]
                      for s in items))

    cli.show(cli.run("GET", "/sources"), human)


@source_app.command("set-url")
def source_set_url(ctx: typer.Context, source: str,
                   url: Annotated[str, typer.Argument(help="mysql://user:secret:NAME@host:port/ of the "
                                                           "server the source moves to.")]) -> None:
    """Move a source to another server of its replication topology (a promoted replica): refused
    when that server lacks transactions the stream holds, or has ones it cannot place."""
    cli = _cli(ctx)
    cli.accepted(cli.run("PUT", f"/sources/{source}/url", {"url": url}))


@source_app.command("remove")
def source_remove(ctx: typer.Context, source: str) -> None:
    """Remove a source from the registry (refused while a changefeed reads it)."""
    cli = _cli(ctx)
    cli.accepted(cli.run("DELETE", f"/sources/{source}"))


def main() -> None:
    app()


# validation: continuous validation status and on-demand compares
validation_app = typer.Typer(help="Validation: status of a changefeed's checks, full compares.",
                             no_args_is_help=True)
app.add_typer(validation_app, name="validation")


def _validation(value: dict[str, Any]) -> None:
    compare = value["compare"]
    render.console.print(
        f"{value['changefeed']}: mode {value['mode']}, {value['rows_checked']} rows checked, "
        f"{value['pending']} pending, {value['rechecking']} re-checking, "
        f"[{'red' if value['mismatches'] else 'green'}]{value['mismatches']} mismatched[/], "
        f"{value['repaired_total']} repaired")
    if compare["state"] != "none":
        render.console.print(f"compare {compare['request']['id']}: {compare['state']}, "
                             f"{compare['tables_done']}/{compare['tables']} tables, "
                             f"{compare['rows_checked']} of ~{compare['rows_estimate']} rows")
    render.table("tables", ["table", "mode", "checked", "pending", "re-checking", "mismatched", "compare",
                            "error"],
                 ([t["table"], t["mode"], t["rows_checked"], t["pending"], t["rechecking"], t["mismatches"],
                   (t["compare"] or {}).get("state"), t["error"]] for t in value["tables"]))
    if value["mismatched_rows"]:
        render.table("mismatched rows", ["table", "key", "kind", "columns"],
                     ([r["table"], json.dumps(r["key"]), r["kind"], ", ".join(r["columns"])]
                      for r in value["mismatched_rows"]))


@validation_app.command("status")
def validation_status(ctx: typer.Context, changefeed: str,
                      limit: Annotated[int, typer.Option(help="Mismatched rows to list.")] = 20) -> None:
    """Rows checked, waiting and mismatched per table, and the first mismatched rows."""
    cli = _cli(ctx)
    cli.show(cli.run("GET", f"/changefeeds/{changefeed}/validation", limit=limit), _validation)


@validation_app.command("compare")
def validation_compare(ctx: typer.Context, changefeed: str,
                       wait: Annotated[bool, typer.Option(help="Follow until all are compared.")] = False,
                       timeout: Annotated[float, typer.Option(help="Give up after this many s.")] = 3600,
                       ) -> None:
    """Compare every table of the changefeed with its sources, from its first key (resumable)."""
    cli = _cli(ctx)
    cli.accepted(cli.run("POST", f"/changefeeds/{changefeed}/validation/compare"))
    if not wait:
        return
    deadline = time.monotonic() + timeout
    while True:
        value = cli.run("GET", f"/changefeeds/{changefeed}/validation")
        compare = value["compare"]
        if not cli.json:
            render.console.print(f"{compare['state']}: {compare['tables_done']}/{compare['tables']} tables, "
                                 f"{compare['rows_checked']} rows, {value['mismatches']} mismatched")
        if compare["state"] in ("done", "failed"):
            cli.show(value, _validation)
            raise typer.Exit(1 if compare["state"] == "failed" or value["mismatches"] else 0)
        if time.monotonic() > deadline:
            render.console.print("timed out waiting for the compare")
            raise typer.Exit(1)
        time.sleep(1.0)
