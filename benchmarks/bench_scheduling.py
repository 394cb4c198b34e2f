"""Scheduling at scale, in process: 10,000 and 100,000 spans over 10 simulated members, all the
way to Replicating, through the real Coordinator, ReplicationManager and MemberAgentState (no NATS,
no Spark). Members prepare and stop instantly, so the figure is the cost of the scheduling
logic itself plus one dispatch round trip per phase.

    .venv/bin/python -m benchmarks.bench_scheduling [--spans 10000 100000] [--members 10]

Also times draining one member (moves capped at max_task_concurrency) and one checkpoint
computation over every span. The wanted spans are a ``WantedSpans`` (fixed), so the basic
scheduler keeps the spans still to add across rounds; the baseline in the same run is a plain
dict of as many ``ReplicationSet`` objects. The CPU time is printed beside the wall time: the
machine is shared.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections import deque

from benchmarks.output import Figures, add_json_option
from libs.scheduling import (
    ChangefeedCheckpoint,
    Coordinator,
    Dispatch,
    MemberAgentState,
    MemberInfo,
    ReplicationManager,
    ReplicationSet,
    SetState,
    Span,
    TableState,
    WantedSpans,
)

EPOCH = 7
START_TS = 1_000


class Cluster:
    def __init__(self, members: int, spans: int, changefeeds: int, seed: int) -> None:
        self.agents = {f"m{i:02d}": MemberAgentState(f"m{i:02d}", min_epoch=EPOCH) for i in range(members)}
        self.infos = {m: MemberInfo(m) for m in self.agents}
        self.manager = ReplicationManager(EPOCH, live_members=self.agents)
        for agent in self.agents.values():
            self.manager.handle_report(agent.collect_report())
        self.wanted = WantedSpans(
            (Span(f"cf{i % changefeeds}", f"src{i % 4}", f"db{i % 16}", f"t{i}"), START_TS)
            for i in range(spans))
        self.coordinator = Coordinator(rng=random.Random(seed))
        self.rounds = 0
        self.dispatches = 0

    def deliver(self, dispatches: list[Dispatch]) -> None:
        queue = deque(dispatches)
        manager, agents = self.manager, self.agents
        while queue:
            d = queue.popleft()
            self.dispatches += 1
            agent = agents[d.member]
            outcome = agent.handle_dispatch(d)
            # Instant pipelines: preparing and stopping finish right away.
            state = agent.state_of(d.span)
            if state is TableState.PREPARING:
                agent.prepared(d.span)
            elif state is TableState.STOPPING:
                agent.stopped(d.span)
            status = agent.status(d.span) if outcome.transitions else outcome.status
            reply = agent.reply(type(outcome)(outcome.verdict, outcome.transitions, status))
            queue.extend(manager.handle_report(reply))

    def round(self) -> None:
        self.rounds += 1
        view = self.manager.view(self.infos, self.wanted)
        tasks = self.coordinator.schedule(view, now=float(self.rounds))
        outcome = self.manager.handle_tasks(tasks)
        self.deliver(outcome.dispatches)

    def all_replicating(self) -> bool:
        index = self.manager.index
        return index.replicating == len(self.wanted) == len(self.manager.sets)


def run(out: Figures, spans: int, args: argparse.Namespace) -> None:
    # Baseline in the same run: a plain dict of as many sets, no scheduling at all.
    t0 = time.perf_counter()
    plain = {Span("cf", "src", "db", f"t{i}"): ReplicationSet(Span("cf", "src", "db", f"t{i}"), epoch=EPOCH)
             for i in range(spans)}
    baseline_s = time.perf_counter() - t0
    assert len(plain) == spans
    del plain

    cluster = Cluster(args.members, spans, args.changefeeds, args.seed)
    started, cpu = time.perf_counter(), time.process_time()
    while not cluster.all_replicating():
        cluster.round()
        if cluster.rounds > 100_000:
            raise SystemExit("did not converge")
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    loads = sorted(cluster.manager.index.load(m) for m in cluster.agents)
    print(f"schedule {spans} spans over {args.members} members to Replicating: "
          f"{elapsed:.3f} s, CPU {cpu:.3f} s ({cluster.rounds} rounds, {cluster.dispatches} dispatches, "
          f"{spans / elapsed:,.0f} spans/s; per-member load {loads[0]}..{loads[-1]}); "
          f"baseline: a dict of {spans} ReplicationSets {baseline_s:.3f} s; load average {_load()}")
    schedule_s, schedule_dispatches = elapsed, cluster.dispatches

    checkpoint = ChangefeedCheckpoint("all", START_TS)
    started = time.perf_counter()
    update = checkpoint.advance(cluster.wanted, cluster.manager.sets)
    checkpoint_ms = (time.perf_counter() - started) * 1000
    print(f"checkpoint over {spans} spans: {checkpoint_ms:.1f} ms (checkpoint_ts={update.checkpoint_ts})")

    drained = "m00"
    cluster.infos[drained] = MemberInfo(drained, draining=True)
    before = cluster.rounds
    started = time.perf_counter()
    while cluster.manager.index.load(drained) or cluster.manager.index.unstable:
        cluster.round()
    elapsed = time.perf_counter() - started
    moved = sum(1 for rs in cluster.manager.sets.values()
                if rs.state is SetState.REPLICATING and rs.primary != drained)
    print(f"drain {drained} ({spans // args.members} spans, max "
          f"{cluster.coordinator.max_task_concurrency} moves in flight): {elapsed:.3f} s "
          f"({cluster.rounds - before} rounds; {moved} spans replicating elsewhere)")
    out.add(f"{spans:,} spans over {args.members} members scheduled to Replicating "
            f"({schedule_dispatches:,} dispatches; CPU {cpu:.1f} s)", schedule_s, "s",
            baseline=f"a dict of {spans:,} ReplicationSets {baseline_s:.2f} s", target="< 30 s",
            met=schedule_s < 30)
    out.add(f"one changefeed checkpoint computed over {spans:,} spans", checkpoint_ms, "ms")
    out.add(f"drain one member ({spans // args.members:,} spans moved, at most "
            f"{cluster.coordinator.max_task_concurrency} moves in flight)", elapsed, "s")


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--members", type=int, default=10)
    parser.add_argument("--changefeeds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1)
    add_json_option(parser)
    args = parser.parse_args()
    out = Figures("bench_scheduling")
    for spans in args.spans:
        run(out, spans, args)
    out.write(args.json)


if __name__ == "__main__":
    main()
