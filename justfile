# Shortcuts for people who have `just`; the README's commands do not need it.

# Start the whole system and run the demo.
demo *ARGS:
    bash infra/dev.sh demo {{ARGS}}

# Set everything up and run the whole test suite.
test *ARGS:
    bash infra/dev.sh test {{ARGS}}

# Install what is missing (venv, Java, MariaDB, PostgreSQL) without running anything.
setup:
    bash infra/dev.sh setup

lint:
    .venv/bin/ruff check .
    .venv/bin/mypy

# Regenerate contracts/schemas/ after changing an event model.
schemas:
    .venv/bin/python -m contracts.generate

# Every benchmark, and the release report at the top of BENCHMARKS.md (not part of the test
# suite; ~35 min; `just bench --quick` for a smoke run). Needs `.venv/bin/pip install -e '.[bench]'`;
# the OLTP benchmarks install sysbench with apt-get (root or sudo) when it is missing.
bench *ARGS:
    .venv/bin/python -m benchmarks.run_all {{ARGS}}

# One self-contained HTML page of the benchmark figures and the lag chart (what `just bench`
# left in benchmarks/results/ and benchmarks/lag_through_faults.png) -> .sluice/benchmarks.html.
report *ARGS:
    .venv/bin/python -m benchmarks.html_report {{ARGS}}
