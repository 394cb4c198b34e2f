"""Schemathesis against the live OpenAPI spec of a running api (real nats-server, scheduler,
ddl-lock responder): generated requests, valid and invalid, never get a 5xx.

Bounded: a few examples per operation and mode, no shrinking, no example database. The event
feed is left out: it is a stream that ends only when the client leaves (tests/test_api.py
covers it)."""

from __future__ import annotations

import time

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.api_stack import TOKEN, ApiStack

pytestmark = pytest.mark.integration

EXAMPLES = {GenerationMode.POSITIVE: 12, GenerationMode.NEGATIVE: 6}
TIME_BOX_S = 120


def _fuzz(stack: ApiStack, op: schemathesis.APIOperation, mode: GenerationMode, examples: int,
          failures: list[str]) -> int:
    calls = 0

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def call(case: schemathesis.Case) -> None:
        nonlocal calls
        calls += 1
        resp = case.call(base_url=stack.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        if resp.status_code >= 500:
            failures.append(f"{op.label} [{mode.value}] -> {resp.status_code}: {resp.text[:300]}\n"
                            f"  {case.as_curl_command()}")

    try:
        call()
    except Unsatisfiable:
        pass  # nothing to make invalid (an operation without parameters or body)
    return calls


def test_no_server_errors_across_the_live_openapi_spec(api_stack: ApiStack) -> None:
    schema = schemathesis.openapi.from_url(f"{api_stack.url}/openapi.json")
    schema = schema.exclude(path="/api/v1/events")
    failures: list[str] = []
    calls = 0
    started = time.monotonic()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 25, [op.label for op in operations]
    for op in operations:
        for mode, examples in EXAMPLES.items():
            if time.monotonic() - started < TIME_BOX_S:
                calls += _fuzz(api_stack, op, mode, examples, failures)
    print(f"{calls} generated requests over {len(operations)} operations")
    assert calls >= len(operations) * 3
    assert not failures, "\n".join(failures[:20])
    assert api_stack.api.alive()
