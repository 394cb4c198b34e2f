"""Running the sluice CLI against a test api."""

from __future__ import annotations

import json
from typing import Any

from typer.testing import CliRunner

from services.cli.app import app
from tests.api_stack import TOKEN, ApiStack


def sluice(stack: ApiStack, *args: str, token: str | None = TOKEN) -> tuple[int, str]:
    opts = ["--url", stack.url] + (["--token", token] if token else [])
    result = CliRunner().invoke(app, [*opts, *args], env={"COLUMNS": "320"})
    return result.exit_code, result.output


def sluice_json(stack: ApiStack, *args: str) -> Any:
    code, out = sluice(stack, "--json", *args)
    assert code == 0, out
    return json.loads(out)
