"""libs.mysql_connection: one preferred-TLS context per process, explicit TLS options their own."""

from __future__ import annotations

import ssl

from libs.mysql_connection import MySQLConnection


def _ctx(sslp: object) -> object:
    # The method reads nothing of the instance, so no server is needed to build one.
    return MySQLConnection._create_ssl_ctx(MySQLConnection.__new__(MySQLConnection), sslp)


def test_the_preferred_context_is_built_once_and_shared() -> None:
    first, second = _ctx({}), _ctx({})
    assert isinstance(first, ssl.SSLContext)
    assert first is second
    # "preferred" verifies nothing: the same context pymysql builds for it every time
    assert first.verify_mode == ssl.CERT_NONE and not first.check_hostname


def test_explicit_tls_options_get_a_context_of_their_own() -> None:
    explicit = _ctx({"verify_mode": "required", "check_hostname": False})
    assert isinstance(explicit, ssl.SSLContext)
    assert explicit is not _ctx({})
    assert explicit.verify_mode == ssl.CERT_REQUIRED
    given = ssl.create_default_context()
    assert _ctx(given) is given
