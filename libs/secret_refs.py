"""Secrets as references: a changefeed's URLs name a secret (``secret:NAME`` in the password
place, ``mysql://repl:secret:src1-pw@db:3306/``) instead of holding the password, so the
changefeeds stream, the read models and every api answer carry only the name.

Each service that connects resolves the name itself, from ``SLUICE_SECRETS_DIR/NAME`` (a file,
as compose and Kubernetes mount secrets) or else the environment variable
``SLUICE_SECRET_<NAME>`` (upper case, ``-`` and ``.`` as ``_``). The resolved value lives only
in the process that connects; it is never logged."""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

PREFIX = "secret:"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


class SecretError(ValueError):
    """A reference that cannot be resolved or is malformed, with where it was looked for."""


def is_reference(password: str) -> bool:
    return password.startswith(PREFIX)


def env_name(name: str) -> str:
    return "SLUICE_SECRET_" + re.sub(r"[^A-Za-z0-9]", "_", name).upper()


def reference_name(password: str) -> str:
    name = password.removeprefix(PREFIX)
    if not NAME_PATTERN.match(name):
        raise SecretError(f"secret reference {name!r} is not a name (letters, digits, '_', '-', '.')")
    return name


def resolve_secret(name: str, secrets_dir: str | None = None,
                   environ: dict[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    directory = secrets_dir if secrets_dir is not None else env.get("SLUICE_SECRETS_DIR")
    if directory:
        path = Path(directory) / name
        if path.is_file():
            # Files written by editors and `echo` end with a newline that is not the secret's.
            return path.read_text().rstrip("\r\n")
    value = env.get(env_name(name))
    if value is not None:
        return value
    where = f"file {Path(directory) / name} or " if directory else ""
    raise SecretError(f"secret {name!r} is not set: put it in {where}environment variable "
                      f"{env_name(name)} of this service")


def resolve_password(password: str, secrets_dir: str | None = None,
                     environ: dict[str, str] | None = None) -> str:
    """A URL's password as given, or the secret it references."""
    if not is_reference(password):
        return password
    return resolve_secret(reference_name(password), secrets_dir, environ)


def literal_password(url: str) -> bool:
    """True when ``url`` holds a password that is not a secret reference."""
    try:
        password = urlsplit(url).password
    except ValueError:
        return False
    return bool(password) and not is_reference(unquote(password or ""))
