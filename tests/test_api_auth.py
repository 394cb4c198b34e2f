"""API tokens: principal:role:token entries from every source, and refusals that do not echo a
token."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr

from libs.config import Settings
from services.api.auth import TokenConfigError, TokenTable, parse_token_entries


def test_api_tokens_parse_with_principal_and_role(tmp_path: Path) -> None:
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text("# who:role:token\nbob:viewer:bob-t\n\nci:operator:ci-t  # the deploy job\n")
    table = TokenTable.from_settings(Settings(api_token=SecretStr("op-t"),
                                              api_tokens=SecretStr("vic:viewer:vic-t, al:operator:a:b"),
                                              api_tokens_file=str(tokens_file)))
    assert table.enabled
    found = {t: (p.name, p.role) for t, p in table.by_token.items()}
    assert found == {"op-t": ("operator", "operator"), "vic-t": ("vic", "viewer"), "a:b": ("al", "operator"),
                     "bob-t": ("bob", "viewer"), "ci-t": ("ci", "operator")}
    assert table.lookup("vic-t") is not None and table.lookup("vic") is None
    with pytest.raises(TokenConfigError, match="viewer or operator"):
        parse_token_entries("eve:admin:x", "SLUICE_API_TOKENS")
    with pytest.raises(TokenConfigError, match="principal:role:token") as err:
        parse_token_entries("just-a-token-value", "SLUICE_API_TOKENS")
    assert "just-a-token-value" not in str(err.value)


@pytest.mark.integration
def test_an_api_without_tokens_refuses_everything_unless_auth_is_turned_off(
        service_env: dict[str, str], tmp_path: Path) -> None:
    import httpx

    from libs.localservers.service_process import ServiceProcess

    closed = ServiceProcess("services.api", service_env, tmp_path / "logs", instance_id="api-closed").start()
    opened = ServiceProcess("services.api", {**service_env, "SLUICE_API_AUTH": "false",
                                             "SLUICE_STATE_DB_URL": f"sqlite:///{tmp_path / 'open.db'}"},
                            tmp_path / "logs", instance_id="api-open").start()
    try:
        closed.wait_ready(60)
        opened.wait_ready(60)
        r = httpx.get(closed.base_url + "/api/v1/changefeeds", timeout=10)
        assert r.status_code == 401 and "no tokens configured" in r.json()["detail"]
        assert httpx.get(closed.base_url + "/readyz", timeout=10).status_code == 200
        assert "every request is refused" in closed.log_path.read_text()
        assert httpx.get(opened.base_url + "/api/v1/changefeeds", timeout=10).status_code == 200
        assert "open to anyone" in opened.log_path.read_text()
    finally:
        closed.terminate()
        opened.terminate()
