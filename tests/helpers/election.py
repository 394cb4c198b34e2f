"""Leader election test pieces: candidate processes, a raw log of their claims, leader fixtures."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

REPO = Path(__file__).resolve().parents[2]


CANDIDATE = REPO / "tests" / "helpers" / "candidate.py"


TTL = 1.0


async def eventually(check: Callable[[], Awaitable[bool]], within: float, what: str,
                     interval: float = 0.02) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {within}s waiting for {what}")


@dataclass(frozen=True)
class Entry:
    """One domain-log message read raw: the test process does not know the test.tick contract."""

    seq: int
    type: str
    epoch: int
    data: dict[str, Any]
    time: datetime


class RawLog:
    """Reads a domain stream message by message, without decoding through the registry."""

    def __init__(self, js: JetStreamContext, stream: str) -> None:
        self.js = js
        self.stream = stream
        self.entries: list[Entry] = []
        self._next = 1

    async def refresh(self) -> list[Entry]:
        try:
            last = (await self.js.stream_info(self.stream)).state.last_seq
        except NotFoundError:
            return self.entries
        while self._next <= last:
            try:
                raw = await self.js.get_msg(self.stream, seq=self._next)
            except NotFoundError:  # a snapshot rolled up
                raw = None
            if raw is not None and raw.data:
                env = json.loads(raw.data)
                self.entries.append(Entry(self._next, env["type"], env["epoch"], env["data"],
                                          datetime.fromisoformat(env["time"])))
            self._next += 1
        return self.entries

    def elected(self) -> list[Entry]:
        return [e for e in self.entries if e.type == "leader.elected"]

    def ticks(self, epoch: int | None = None) -> list[Entry]:
        return [e for e in self.entries if e.type == "test.tick" and (epoch is None or e.epoch == epoch)]


class Candidate:
    def __init__(self, name: str, url: str, bucket: str, domain: str, out_dir: Path) -> None:
        self.name = name
        self.out = out_dir / f"{name}.out"
        self.err = out_dir / f"{name}.err"
        env = {**os.environ, "SLUICE_NATS_URL": url}
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(CANDIDATE), "--url", url, "--bucket", bucket, "--domain", domain,
                 "--service", "svc", "--candidate", name, "--ttl", str(TTL)],
                stdout=out, stderr=err, env=env, cwd=REPO)

    def lines(self) -> list[dict[str, Any]]:
        try:
            return [json.loads(line) for line in self.out.read_text().splitlines() if line.strip()]
        except FileNotFoundError:
            return []

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                return self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        return int(self.proc.returncode)

    def diagnostics(self) -> str:
        return f"--- {self.name} stdout\n{self.out.read_text()}\n--- stderr\n{self.err.read_text()[-3000:]}"


async def leader_with_ticks(rlog: RawLog, after_epoch: int = 0, ticks: int = 3) -> Entry:
    """Wait for a LeaderElected newer than ``after_epoch`` followed by some of its ticks."""
    found: list[Entry] = []

    async def check() -> bool:
        await rlog.refresh()
        newer = [e for e in rlog.elected() if e.epoch > after_epoch]
        if newer and len([t for t in rlog.ticks(newer[-1].epoch) if t.seq > newer[-1].seq]) >= ticks:
            found[:] = [newer[-1]]
            return True
        return False

    await eventually(check, 15, f"a leader newer than epoch {after_epoch} that ticks")
    return found[0]


C = TypeVar("C", bound="Candidate")


async def leader_and_follower(rlog: RawLog, candidates: list[C]) -> tuple[Entry, C, C]:
    """The first leader that ticks, its candidate and the other one (of two)."""
    first = await leader_with_ticks(rlog)
    leader = next(c for c in candidates if c.name == first.data["candidate"])
    return first, leader, next(c for c in candidates if c is not leader)


async def resumed_leader_stays_fenced(rlog: RawLog, old: Candidate, first: Entry, second: Entry,
                                      within: float) -> None:
    """A leader that was stopped past its lease and resumed steps down, its successor keeps
    leading, and nothing of the old epoch lands after the successor's LeaderElected."""

    async def old_stepped_down() -> bool:
        return any(line["event"] == "stepdown" and line["epoch"] == first.epoch for line in old.lines())

    await eventually(old_stepped_down, within, "the resumed leader to step down")
    seen = len(rlog.ticks(second.epoch))

    async def more_ticks() -> bool:
        await rlog.refresh()
        return len(rlog.ticks(second.epoch)) >= seen + 5

    await eventually(more_ticks, within, "the new leader to keep ticking")
    late = [t for t in rlog.ticks(first.epoch) if t.seq > second.seq]
    assert late == [], f"the old epoch wrote after its successor's LeaderElected: {late}"
    # A follower now: it never claimed the lease again.
    assert [line["epoch"] for line in old.lines() if line["event"] == "leader"] == [first.epoch]
