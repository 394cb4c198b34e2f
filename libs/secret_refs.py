"""Secrets as references: a changefeed's URLs name a secret (``secret:NAME`` in the password
place, ``mysql://repl:secret:src1-pw@db:3306/``) instead of holding the password, so the
changefeeds stream, the read models and every api answer carry only the name.

Each service that connects resolves the name itself, from ``SLUICE_SECRETS_DIR/NAME`` (a file,
as compose and Kubernetes mount secrets) or else the environment variable
``SLUICE_SECRET_<NAME>`` (upper case, ``-`` and ``.`` as ``_``). The resolved value lives only
in the process that connects; it is never logged.

A secret is bound to the hosts it may be sent to: ``SLUICE_SECRETS_HOSTS`` (set by whoever
places the secrets, beside them; never by an api call) lists ``NAME=host:port,host2`` entries,
``;`` or newline separated. A secret is resolved only for a connection to one of its hosts (a
host without a port: any port of it), and a secret bound to no host is never resolved: a
changefeed naming ``secret:NAME`` with some other host cannot make the api, capture or a sink
send the password there."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

PREFIX = "secret:"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
HOSTS_ENV = "SLUICE_SECRETS_HOSTS"
_PORT = re.compile(r"^(?P<host>\[[^\]]+\]|[^:\s]+)(?::(?P<port>\d{1,5}))?$")


class SecretError(ValueError):
    """A reference that cannot be resolved or is malformed, with where it was looked for."""


class SecretBindingError(SecretError):
    """A secret asked for a host it is not bound to (or bound to none): never resolved."""


@dataclass(frozen=True)
class Endpoint:
    """A host and port a secret may be sent to; ``port`` None allows every port of ``host``."""

    host: str
    port: int | None = None

    def allows(self, host: str, port: int) -> bool:
        return self.host == normal_host(host) and (self.port is None or self.port == port)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port is None else f"{host}:{self.port}"


def normal_host(host: str) -> str:
    """A URL's host as bindings compare it: lower case, an IPv6 literal without brackets."""
    return host.strip().strip("[]").lower()


def parse_endpoint(text: str) -> Endpoint:
    m = _PORT.match(text.strip())
    if m is None:
        raise SecretError(f"{text!r} is not host or host:port")
    port = int(m.group("port")) if m.group("port") else None
    if port is not None and not 0 < port <= 65535:
        raise SecretError(f"{text!r}: port out of range 1-65535")
    return Endpoint(normal_host(m.group("host")), port)


def parse_bindings(text: str) -> dict[str, tuple[Endpoint, ...]]:
    """``NAME=host:port,host;NAME2=host:port`` (``;`` or newlines between entries, ``#``
    comments) as each secret's endpoints; a name given twice gets the endpoints of both."""
    out: dict[str, tuple[Endpoint, ...]] = {}
    for raw in re.split(r"[;\n]", text):
        entry = raw.split("#", 1)[0].strip()
        if not entry:
            continue
        name, sep, hosts = entry.partition("=")
        name = name.strip()
        if not sep or not NAME_PATTERN.match(name):
            raise SecretError(f"{HOSTS_ENV}: {entry!r} is not NAME=host:port[,host:port...]")
        endpoints = tuple(parse_endpoint(h) for h in hosts.split(",") if h.strip())
        if not endpoints:
            raise SecretError(f"{HOSTS_ENV}: secret {name!r} is given no host")
        out[name] = out.get(name, ()) + endpoints
    return out


def bindings(environ: Mapping[str, str] | None = None) -> dict[str, tuple[Endpoint, ...]]:
    env = os.environ if environ is None else environ
    return parse_bindings(env.get(HOSTS_ENV, ""))


def binding_problem(name: str, destinations: Sequence[tuple[str, int]],
                    environ: Mapping[str, str] | None = None) -> str | None:
    """Why secret ``name`` may not be sent to every one of ``destinations``; None when it may.
    Names the destination and the bound hosts, never the secret's value."""
    try:
        bound = bindings(environ).get(name, ())
    except SecretError as exc:
        return str(exc)
    if not destinations:
        return f"secret {name!r} is used without a host to bind it to"
    for host, port in destinations:
        if not any(e.allows(host, port) for e in bound):
            target = str(Endpoint(normal_host(host), port))
            if not bound:
                return (f"secret {name!r} is bound to no host, so it is sent nowhere (not to {target}): "
                        f"whoever places the secrets adds {name}={target} to {HOSTS_ENV} of the "
                        "services that use it")
            return (f"secret {name!r} may only be sent to {', '.join(map(str, bound))}, not to "
                    f"{target} ({HOSTS_ENV}): use the host the secret belongs to")
    return None


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


def resolve_password(password: str, destinations: Sequence[tuple[str, int]], *,
                     secrets_dir: str | None = None, environ: dict[str, str] | None = None) -> str:
    """A URL's password as given, or the secret it references when the secret is bound to every
    ``(host, port)`` the password will be sent to (SecretBindingError otherwise, before the
    secret is read)."""
    if not is_reference(password):
        return password
    name = reference_name(password)
    problem = binding_problem(name, destinations, environ)
    if problem is not None:
        raise SecretBindingError(problem)
    return resolve_secret(name, secrets_dir, environ)


def literal_password(url: str) -> bool:
    """True when ``url`` holds a password that is not a secret reference."""
    try:
        password = urlsplit(url).password
    except ValueError:
        return False
    return bool(password) and not is_reference(unquote(password or ""))
