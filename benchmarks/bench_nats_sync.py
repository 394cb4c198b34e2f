"""What JetStream's ``sync_interval: always`` costs a single node (README, "JetStream durability").

    .venv/bin/python -m benchmarks.bench_nats_sync [--messages 20000] [--in-flight 256]

For each interval (nats-server's default, about 2 minutes, and ``always``) a private
nats-server on disk gets a file stream, and ``--messages`` messages of 300 bytes are published
twice: one at a time (each waits for its acknowledgement, as a control event does) and with
``--in-flight`` unacknowledged (as capture publishes rows). Prints messages/s of each and the
load average, since the fsyncs compete with whatever else the disk does.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

import nats

from libs.localservers.nats_server import NatsServer

PAYLOAD = b"x" * 300


async def _publish(url: str, messages: int, in_flight: int) -> tuple[float, float]:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(name="SYNC", subjects=["sync.>"])
        sequential = max(1, messages // 10)
        began = time.perf_counter()
        for i in range(sequential):
            await js.publish(f"sync.one.{i % 16}", PAYLOAD)
        one_at_a_time = sequential / (time.perf_counter() - began)
        began = time.perf_counter()
        window: set[asyncio.Future[object]] = set()
        for i in range(messages):
            window.add(asyncio.ensure_future(js.publish(f"sync.many.{i % 16}", PAYLOAD)))
            if len(window) >= in_flight:
                done, window = await asyncio.wait(window, return_when=asyncio.FIRST_COMPLETED)
                for f in done:
                    f.result()
        await asyncio.gather(*window)
        pipelined = messages / (time.perf_counter() - began)
        return one_at_a_time, pipelined
    finally:
        await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--in-flight", type=int, default=256)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-nats-sync-"))
    try:
        for interval in (None, "always"):
            server = NatsServer(data_dir=base / (interval or "default"), sync_interval=interval).start()
            try:
                one, many = asyncio.run(_publish(server.url, args.messages, args.in_flight))
            finally:
                server.stop()
            load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
            print(f"sync_interval {interval or 'default (2m)':>14}: {one:8.0f} msg/s one at a time, "
                  f"{many:8.0f} msg/s with {args.in_flight} in flight   (load average {load})")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
