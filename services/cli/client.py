"""A small HTTP client for the operator API: base URL and bearer token from the settings or
the command line; an error answer becomes ``ApiError`` with the API's message."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


def _message(resp: httpx.Response) -> str:
    try:
        detail = resp.json().get("detail")
    except (ValueError, AttributeError):
        return resp.text.strip() or resp.reason_phrase
    if isinstance(detail, list):  # field-level validation errors
        return "; ".join(f"{'.'.join(str(p) for p in e.get('loc', [])[1:])}: {e.get('msg')}"
                         if isinstance(e, dict) else str(e) for e in detail)
    return str(detail)


class ApiClient:
    def __init__(self, base_url: str, token: str | None = None, timeout: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/") + "/api/v1", headers=headers,
                                 timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def _request(self, method: str, path: str, body: Any = None,
                 params: dict[str, Any] | None = None) -> httpx.Response:
        try:
            resp = self.http.request(method, path, json=body, params=params)
        except httpx.HTTPError as exc:
            raise ApiError(0, f"cannot reach the api at {self.http.base_url}: {exc}") from None
        if resp.status_code >= 400:
            raise ApiError(resp.status_code, _message(resp))
        return resp

    def call(self, method: str, path: str, body: Any = None, params: dict[str, Any] | None = None) -> Any:
        resp = self._request(method, path, body, params)
        return resp.json() if resp.content else None

    def pages(self, path: str, **params: Any) -> list[Any]:
        """Every item of a paged list (``X-Next-After``: the cursor of the next page)."""
        items: list[Any] = []
        query = {k: v for k, v in params.items() if v is not None}
        while True:
            resp = self._request("GET", path, params=query)
            items.extend(resp.json())
            cursor = resp.headers.get("X-Next-After")
            if not cursor:
                return items
            query["after"] = cursor

    def get(self, path: str, **params: Any) -> Any:
        return self.call("GET", path, params={k: v for k, v in params.items() if v is not None})

    def post(self, path: str, body: Any = None) -> Any:
        return self.call("POST", path, body if body is not None else {})

    def events(self, params: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The event feed, one parsed server-sent event at a time (``id``, ``event``, ``data``)."""
        try:
            with self.http.stream("GET", "/events", params=params, timeout=None) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise ApiError(resp.status_code, _message(resp))
                frame: dict[str, Any] = {}
                for line in resp.iter_lines():
                    if not line:
                        if "data" in frame:
                            yield frame
                        frame = {}
                    elif line.startswith(":"):
                        continue
                    else:
                        key, _, value = line.partition(":")
                        value = value.removeprefix(" ")
                        frame[key] = json.loads(value) if key == "data" else value
        except httpx.HTTPError as exc:
            raise ApiError(0, f"event feed broke: {exc}") from None
