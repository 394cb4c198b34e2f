"""The apply job's Python pass alone, in one process: where a round's Python time goes.

    .venv/bin/python -m benchmarks.apply_python [--rows 100000] [--seed 7] [--runs 3]
        [--partitions 4] [--profile N]

Generates ``benchmarks.apply``'s workload, groups its events as ``apply_job.plan_partitions``
does for the job, and runs what each partition's Python worker runs (``explode_collapse``,
then ``write_finals``) on the driver, no Spark, into a private durable MariaDB; then checks
the tables against the expected final state. Prints the CPU seconds (``time.process_time``:
the machine is shared, wall time is not comparable) of explode + collapse and of the write,
per run; ``--profile N`` runs once under cProfile (CPU clock) and prints the top N functions
by own time and by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.apply import DATABASE, create_tables, expected_checksums, generate, target, verify
from contracts import REGISTRY
from contracts.events.rows import RowsChangedV2
from libs.localservers.mariadb import MariaDB
from services.sink_worker.round.apply_job import (
    ApplyPlan,
    SpanTargets,
    TargetPlan,
    explode_collapse,
    plan_partitions,
    write_finals,
)
from services.sink_worker.round.sort_job import BatchEvent


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=100_000, help="row changes to generate")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--runs", type=int, default=3, help="timed runs (each into fresh tables)")
    parser.add_argument("--partitions", type=int, default=4, help="the job's apply partitions")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="one run under cProfile instead, printing the top N functions")
    args = parser.parse_args(argv)

    work = generate(args.rows, args.seed)
    expected = expected_checksums(work)
    events: list[BatchEvent] = []
    for _, data, _ in work.messages:
        event = REGISTRY.decode(data).event
        assert isinstance(event, RowsChangedV2)
        span = f"bench/{work.source}/{DATABASE}/{event.table}"
        events.append((span, event.ts, event.seq, event.part, data, []))
    events.sort(key=lambda e: (e[0], e[1], e[2], e[3]))
    tmp = Path(tempfile.mkdtemp(prefix="sluice-bench-apply-python-"))
    db = MariaDB(tmp / "mariadb", durable=True,
                 extra_args=("--innodb-buffer-pool-size=2G", "--max-allowed-packet=64M")).start()
    try:
        spans = sorted({e[0] for e in events})
        plans = [TargetPlan(span.rsplit("/", 1)[1], db.url, target(span.rsplit("/", 1)[1], DATABASE))
                 for span in spans]
        span_targets: SpanTargets = {span: (i, plans[i].table.key, None) for i, span in enumerate(spans)}
        plan = ApplyPlan(span_targets=span_targets, plans=plans, local_owners=True)
        groups = plan_partitions(events, span_targets, args.partitions).local
        print(f"{work.rows:,} row changes, {len(events):,} events in {len(groups)} groups "
              f"({', '.join(str(len(g)) for g in groups)} events)")
        for run in range(1 if args.profile else args.runs):
            create_tables(db, DATABASE)
            profile = cProfile.Profile(time.process_time) if args.profile else None
            if profile is not None:
                profile.enable()
            started = time.process_time()
            finals = [list(explode_collapse(plan, group)) for group in groups]
            exploded = time.process_time()
            for group_finals in finals:
                for report in write_finals(plan, group_finals):
                    if report[4] is not None:
                        raise SystemExit(f"{report[0]} refused a change: {report[4]}")
            written = time.process_time()
            if profile is not None:
                profile.disable()
                for order in ("tottime", "cumulative"):
                    pstats.Stats(profile).sort_stats(order).print_stats(args.profile)
            verify(db, DATABASE, expected, "apply_python")
            print(f"run {run + 1}: CPU s explode + collapse {exploded - started:.2f}, "
                  f"write {written - exploded:.2f}, total {written - started:.2f} (verified)")
    finally:
        db.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
