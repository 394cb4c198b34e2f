"""A leader candidate for the election process tests.

Runs ``run_leader_loop`` for one service; while leader it appends a ``test.tick`` event to the
domain log every ~100 ms. It prints one JSON line per leadership change on stdout, which the
tests read from the file stdout is redirected to:

    {"event": "leader", "epoch": 7}
    {"event": "stepdown", "epoch": 7, "reason": "lease-expired"}

Usage: python tests/helpers/candidate.py --url nats://... --bucket B --domain D --service S
       --candidate ID --ttl 1.0 [--probe]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import nats
from pydantic import BaseModel, ConfigDict

from contracts import REGISTRY
from libs.election import Leadership, run_leader_loop
from libs.eventstore import DomainLog, Fenced

TICK_INTERVAL = 0.1


# Registered here only, at runtime: the real contracts (and their checked-in schemas) stay clean.
@REGISTRY.register("test.tick", 1)
class TickV1(BaseModel):
    model_config = ConfigDict(extra="forbid")
    candidate: str
    epoch: int
    n: int


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


async def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("url", "bucket", "domain", "service", "candidate"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--ttl", type=float, required=True)
    parser.add_argument("--probe", action="store_true",
                        help="probe a lease holder and take over when it is gone (as services do)")
    args = parser.parse_args()

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)

    async def tick(leadership: Leadership, domain_log: DomainLog[Any]) -> None:
        say(event="leader", epoch=leadership.epoch)
        n = 0
        try:
            while True:
                n += 1
                await domain_log.append(TickV1(candidate=args.candidate, epoch=leadership.epoch, n=n))
                await asyncio.sleep(TICK_INTERVAL)
        except Fenced as exc:
            say(event="stepdown", epoch=leadership.epoch, reason=f"fenced: {type(exc).__name__}")
            raise
        except asyncio.CancelledError:
            say(event="stepdown", epoch=leadership.epoch,
                reason=leadership.lost_reason or ("shutdown" if stopping.is_set() else "cancelled"))
            raise

    nc = await nats.connect(args.url, name=args.candidate)
    try:
        await run_leader_loop(nc.jetstream(), service=args.service, candidate=args.candidate,
                              domain=args.domain, producer=f"{args.service}/{args.candidate}",
                              ttl=args.ttl, work=tick, stopping=stopping, bucket=args.bucket,
                              nc=nc if args.probe else None)
    finally:
        await nc.drain()
    say(event="exit")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(main())
