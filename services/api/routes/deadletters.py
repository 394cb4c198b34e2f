"""/api/v1/dead-letters: what nobody could process, with the reason; replay republishes the
original payload and headers to the original subject (its stream stores it again) and removes
the dead letter; discard removes it."""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException, Path, Query
from nats.errors import Error as NatsError
from nats.js import api
from nats.js.errors import NoStreamResponseError, NotFoundError

from libs.eventstore.deadletter import H_KIND, H_REASON, H_SEQ, H_SUBJECT, RENAMED_PREFIX
from libs.nats_auth import may_publish_as
from libs.streams import DEADLETTER_STREAM
from services.api.auth import require_read, require_write
from services.api.context import ApiContext, get_ctx, js_of
from services.api.schemas import Accepted, DeadLetterOut, redact_urls_in_text

router = APIRouter(prefix="/dead-letters", tags=["dead letters"])
_SCAN_LIMIT = 10_000
_SEQ = Path(ge=1, le=2**63 - 1, description="The dead letter's sequence in the dead-letter stream.")


def _out(msg: api.RawStreamMsg) -> DeadLetterOut:
    headers = dict(msg.headers or {})
    data = bytes(msg.data or b"")
    seq_text = headers.get(H_SEQ, "")
    stamp = getattr(msg, "time", None)
    return DeadLetterOut(
        seq=int(msg.seq or 0), subject=msg.subject or "",
        origin_stream=(msg.subject or "").rsplit(".", 1)[-1],
        original_subject=headers.get(H_SUBJECT, ""),
        original_seq=int(seq_text) if seq_text.isdigit() else None,
        kind=headers.get(H_KIND, ""), reason=headers.get(H_REASON, ""),
        time=stamp.isoformat() if stamp is not None else None,
        # A parked changefeed event recorded before secrets were references may hold one.
        headers=headers, data=redact_urls_in_text(data.decode("utf-8", errors="backslashreplace")),
        size=len(data))


async def _get(ctx: ApiContext, seq: int) -> api.RawStreamMsg:
    try:
        return await js_of(ctx).get_msg(DEADLETTER_STREAM, seq=seq)
    except NotFoundError:
        raise HTTPException(404, f"no dead letter {seq}") from None


@router.get("", response_model=list[DeadLetterOut], dependencies=[Depends(require_read)])
async def list_dead_letters(after: int = Query(0, ge=0, le=2**63 - 1,
                                              description="Only dead letters after this seq."),
                            limit: int = Query(100, ge=1, le=1000),
                            ctx: ApiContext = Depends(get_ctx)) -> list[DeadLetterOut]:
    js = js_of(ctx)
    try:
        info = await js.stream_info(DEADLETTER_STREAM)
    except NotFoundError:
        return []
    out: list[DeadLetterOut] = []
    seq = max(after + 1, int(info.state.first_seq or 1))
    last = int(info.state.last_seq or 0)
    scanned = 0
    # Discarded ones leave gaps: step over them, but never scan without bound.
    while seq <= last and len(out) < limit and scanned < _SCAN_LIMIT:
        scanned += 1
        try:
            msg = await js.get_msg(DEADLETTER_STREAM, seq=seq)
        except NotFoundError:
            seq += 1
            continue
        out.append(_out(msg))
        seq += 1
    return out


@router.get("/{seq}", response_model=DeadLetterOut, dependencies=[Depends(require_read)],
            responses={404: {"description": "Unknown dead letter"}})
async def get_dead_letter(seq: int = _SEQ, ctx: ApiContext = Depends(get_ctx)) -> DeadLetterOut:
    return _out(await _get(ctx, seq))


@router.post("/{seq}/replay", status_code=202, response_model=Accepted,
             dependencies=[Depends(require_write)],
             responses={404: {"description": "Unknown dead letter"},
                        403: {"description": "The api's NATS user may not publish to the original "
                                              "subject (a row, DDL or resolved mark)"},
                        409: {"description": "The original subject has no stream"}})
async def replay_dead_letter(seq: int = _SEQ, ctx: ApiContext = Depends(get_ctx)) -> Accepted:
    msg = await _get(ctx, seq)
    headers = dict(msg.headers or {})
    subject = headers.get(H_SUBJECT, "")
    if not subject:
        raise HTTPException(409, f"dead letter {seq} does not say where it came from")
    if not may_publish_as(ctx.settings.nats_user, subject):
        # Only a source's capture publishes its rows; the server would drop the replay.
        raise HTTPException(403, f"the api's NATS user {ctx.settings.nats_user!r} may not publish to "
                                 f"{subject!r}; only the producer of that subject may")
    # The original's own headers go back; the dead-letter ones and the renamed server headers
    # (expected sequences, rollups, the old message id) stay behind. The new id makes a
    # repeated replay of the same dead letter store it once.
    out = {k: v for k, v in headers.items()
           if not k.startswith("Sluice-Dead-Letter-") and not k.startswith(RENAMED_PREFIX)
           and not k.lower().startswith("nats-")}
    out[api.Header.MSG_ID.value] = f"replay:{DEADLETTER_STREAM}:{seq}"
    out["Sluice-Replayed-By"] = ctx.requested_by
    js = js_of(ctx)
    try:
        ack = await js.publish(subject, bytes(msg.data or b""), headers=out)
    except NoStreamResponseError:
        raise HTTPException(409, f"no stream stores {subject!r} any more; nothing to replay into") from None
    except NatsError as exc:
        raise HTTPException(503, f"replay failed: {exc}") from None
    try:
        await js.delete_msg(DEADLETTER_STREAM, seq)
    except NotFoundError:
        pass  # a concurrent replay or discard removed it; the publish id kept it single
    return Accepted(detail=f"republished to {subject} in {ack.stream}", seq=int(ack.seq),
                    follow="/api/v1/dead-letters")


@router.delete("/{seq}", status_code=200, response_model=Accepted, dependencies=[Depends(require_write)],
               responses={404: {"description": "Unknown dead letter"}})
async def discard_dead_letter(seq: int = _SEQ, ctx: ApiContext = Depends(get_ctx)) -> Accepted:
    await _get(ctx, seq)
    try:
        await js_of(ctx).delete_msg(DEADLETTER_STREAM, seq)
    except NotFoundError:
        raise HTTPException(404, f"no dead letter {seq}") from None
    return Accepted(detail=f"dead letter {seq} discarded", seq=seq)
