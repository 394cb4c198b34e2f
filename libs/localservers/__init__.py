"""Private instances of the servers Sluice talks to, for tests, the benchmarks and the demo.

Each starts on a free port with its own data directory and never touches a system service.
It lives in ``libs/`` rather than ``tests/`` because the demo (``infra/demo.py``) and the
benchmarks start whole local systems with it; no service imports it.
"""
