"""Registry of event models keyed by ``(type, version)``, with upcasters between versions.

Consumers only ever see the newest version of a type: ``decode`` validates the stored version
and walks the upcaster chain vN -> vN+1 -> ... before validating against the newest model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError

from contracts.envelope import Envelope, new_event_id, utc_now

ErrorKind = Literal["malformed", "unknown_type", "unknown_version", "invalid_data"]
M = TypeVar("M", bound=BaseModel)
Upcaster = Callable[[dict[str, Any]], dict[str, Any]]


class ContractError(ValueError):
    """The one error a consumer gets for a message it cannot turn into a known event."""

    def __init__(self, kind: ErrorKind, message: str, *, type: str | None = None,
                 version: int | None = None) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind: ErrorKind = kind
        self.reason = message
        self.type = type
        self.version = version


@dataclass(frozen=True)
class Decoded:
    envelope: Envelope
    event: BaseModel
    original_version: int


_EMPTY_DATA = '"data":{}}'
"""How an envelope's JSON ends when its ``data`` is empty (``data`` is its last field)."""


class Registry:
    def __init__(self) -> None:
        self._models: dict[tuple[str, int], type[BaseModel]] = {}
        self._keys: dict[type[BaseModel], tuple[str, int]] = {}
        self._upcasters: dict[tuple[str, int], Upcaster] = {}
        # type -> newest registered version: every decode needs it, so not a scan of the models.
        self._latest: dict[str, int] = {}

    def register(self, type_: str, version: int) -> Callable[[type[M]], type[M]]:
        def wrap(model: type[M]) -> type[M]:
            key = (type_, version)
            if key in self._models and self._models[key] is not model:
                raise ValueError(f"contract {type_} v{version} registered twice")
            self._models[key] = model
            self._keys[model] = key
            self._latest[type_] = max(version, self._latest.get(type_, version))
            return model

        return wrap

    def upcaster(self, type_: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
        def wrap(fn: Upcaster) -> Upcaster:
            self._upcasters[(type_, from_version)] = fn
            return fn

        return wrap

    def key_of(self, model: type[BaseModel]) -> tuple[str, int]:
        try:
            return self._keys[model]
        except KeyError:
            raise ContractError("unknown_type", f"{model.__name__} is not a registered contract") from None

    def latest_version(self, type_: str) -> int:
        latest = self._latest.get(type_)
        if latest is None:
            raise ContractError("unknown_type", f"unknown event type {type_!r}", type=type_)
        return latest

    def contracts(self) -> list[tuple[str, int, type[BaseModel]]]:
        return sorted((t, v, m) for (t, v), m in self._models.items())

    def envelope(self, event: BaseModel, *, producer: str, epoch: int = 0,
                 event_id: str | None = None) -> Envelope:
        type_, version = self.key_of(type(event))
        return Envelope(type=type_, version=version, id=event_id or new_event_id(), time=utc_now(),
                        producer=producer, epoch=epoch, data=event.model_dump(mode="json"))

    def encode(self, event: BaseModel, *, producer: str, epoch: int = 0,
               event_id: str | None = None) -> bytes:
        """The envelope's JSON, with the event serialized once, straight to JSON, into its
        ``data``: going through ``envelope`` (the event dumped to a dict, the dict dumped
        again) was most of a sink-worker's heartbeat at thousands of spans."""
        type_, version = self.key_of(type(event))
        head = Envelope(type=type_, version=version, id=event_id or new_event_id(), time=utc_now(),
                        producer=producer, epoch=epoch, data={}).model_dump_json()
        if not head.endswith(_EMPTY_DATA):
            # Not the shape this relies on (a field after ``data``): the plain way.
            return self.envelope(event, producer=producer, epoch=epoch,
                                 event_id=event_id).model_dump_json().encode()
        body = event.model_dump_json().encode()
        return b"".join((head[:-len(_EMPTY_DATA)].encode(), b'"data":', body, b"}"))

    def decode(self, raw: bytes | str) -> Decoded:
        try:
            obj = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ContractError("malformed", f"payload is not JSON: {exc}") from None
        try:
            env = Envelope.model_validate(obj)
        except ValidationError as exc:
            raise ContractError("malformed", f"not a Sluice envelope: {_brief(exc)}") from None
        return self.decode_envelope(env)

    def decode_envelope(self, env: Envelope) -> Decoded:
        if env.type not in self._latest:
            raise ContractError("unknown_type", f"unknown event type {env.type!r}", type=env.type,
                                version=env.version)
        if (env.type, env.version) not in self._models:
            raise ContractError("unknown_version", f"{env.type} has no version {env.version}",
                                type=env.type, version=env.version)
        latest = self.latest_version(env.type)
        data = dict(env.data)
        version = env.version
        try:
            # Validate against the stored version first so bad old data is reported as such.
            stored = self._models[(env.type, version)].model_validate(data)
            if version == latest:
                # Nearly every message: one validation, and the envelope already carries the
                # newest shape. (Validating a 500-row event again and dumping it back to JSON
                # was two thirds of the sink-worker's decode time.)
                return Decoded(envelope=env, event=stored, original_version=version)
            while version < latest:
                step = self._upcasters.get((env.type, version))
                if step is None:
                    raise ContractError("unknown_version",
                                        f"no upcaster from {env.type} v{version} to v{version + 1}",
                                        type=env.type, version=env.version)
                data = step(data)
                version += 1
            event = self._models[(env.type, latest)].model_validate(data)
        except ValidationError as exc:
            raise ContractError("invalid_data", f"{env.type} v{env.version}: {_brief(exc)}",
                                type=env.type, version=env.version) from None
        upgraded = env.model_copy(update={"version": latest, "data": event.model_dump(mode="json")})
        return Decoded(envelope=upgraded, event=event, original_version=env.version)


def _brief(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


REGISTRY = Registry()
register = REGISTRY.register
upcaster = REGISTRY.upcaster
