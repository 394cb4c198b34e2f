"""Memory and CPU of process trees, read from /proc: the one sampler the benchmarks share.

``MemorySampler`` samples, every ``interval`` seconds in a thread, the summed RSS of each
named process tree (a root pid and all its descendants), split into parts by the caller's
``classify`` (e.g. the Spark JVM, its Python workers, the service process), and keeps each
tree's peak. It also keeps each counted process' CPU seconds and, for the part named
``jvm_part``, the CPU seconds of the JVM's threads by name.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from libs.localservers.service_process import ServiceProcess

PAGE = os.sysconf("SC_PAGE_SIZE")
TICK = os.sysconf("SC_CLK_TCK")

Classify = Callable[[int, int, list[bytes]], str]
"""``(pid, root pid, argv) -> part``."""


def children_by_parent() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        out.setdefault(int(stat[stat.rindex(b")") + 2:].split()[1]), []).append(int(entry))
    return out


def descendants(root: int, children: dict[int, list[int]] | None = None) -> list[int]:
    """``root`` and every process below it."""
    children = children_by_parent() if children is None else children
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def rss(pid: int) -> tuple[list[bytes], int]:
    """The process' argv and resident set in bytes; ``([], 0)`` when it is gone or has no argv
    (a kernel thread, a zombie)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            pages = int(f.read().split()[1])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return [], 0
    if not argv or not argv[0]:
        return [], 0
    return argv, pages * PAGE


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(b")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def tree_cpu(root: int, children: dict[int, list[int]] | None = None) -> float:
    """CPU seconds of ``root``'s process tree so far (a process that has exited counts 0)."""
    return sum(cpu_seconds(pid) for pid in descendants(root, children))


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of a process' threads, by thread name with digits dropped ("GC Thread#")."""
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index(b"(") + 1:stat.rindex(b")")].decode(errors="replace")
        name = "".join("#" if ch.isdigit() else ch for ch in name)
        fields = stat[stat.rindex(b")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
    return out


class MemorySampler(threading.Thread):
    """Peak summed RSS per named process tree, by part; CPU seconds per counted process."""

    def __init__(self, roots: Callable[[], dict[str, int]], classify: Classify, *, interval: float = 0.5,
                 only: frozenset[str] | None = None, jvm_part: str | None = None,
                 on_error: Callable[[Exception], None] | None = None) -> None:
        super().__init__(daemon=True, name="rss-sampler")
        self.roots = roots
        self.classify = classify
        self.interval = interval
        self.only = only
        """Parts to count (None: all)."""
        self.jvm_part = jvm_part
        self.on_error = on_error
        self.peaks: dict[str, int] = {}
        self.peak_parts: dict[str, dict[str, int]] = {}
        self.samples = 0
        self.cpu: dict[int, tuple[str, float]] = {}  # pid -> (part, CPU seconds at the last sample)
        self.cpu_base: dict[int, float] = {}
        self.jvm_threads: dict[str, float] = {}
        self.jvm_threads_base: dict[str, float] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                self.sample()
            except Exception as exc:  # a process that exits mid-sample; the next sample counts
                if self.on_error is not None:
                    self.on_error(exc)
            self.done.wait(self.interval)

    def start_clock(self) -> None:
        """CPU from here on counts (start-up does not)."""
        children = children_by_parent()
        for root in self.roots().values():
            for pid in descendants(root, children):
                self.cpu_base[pid] = cpu_seconds(pid)
                argv, _ = rss(pid)
                if argv and self.jvm_part is not None and self.classify(pid, root, argv) == self.jvm_part:
                    self.jvm_threads_base = thread_cpu(pid)

    def cpu_by_part(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for pid, (part, seconds) in self.cpu.items():
            out[part] = out.get(part, 0.0) + seconds - self.cpu_base.get(pid, 0.0)
        return out

    def jvm_thread_cpu(self) -> dict[str, float]:
        return {k: v - self.jvm_threads_base.get(k, 0.0) for k, v in self.jvm_threads.items()}

    def sample(self) -> None:
        children = children_by_parent()
        for name, root in self.roots().items():
            parts: dict[str, int] = {}
            for pid in descendants(root, children):
                argv, size = rss(pid)
                if not size:
                    continue
                part = self.classify(pid, root, argv)
                if self.only is not None and part not in self.only:
                    continue
                parts[part] = parts.get(part, 0) + size
                self.cpu[pid] = (part, cpu_seconds(pid))
                if part == self.jvm_part:
                    self.jvm_threads = thread_cpu(pid)
            total = sum(parts.values())
            if total > self.peaks.get(name, 0):
                self.peaks[name], self.peak_parts[name] = total, parts
        self.samples += 1


def smaps_rollup(pid: int) -> dict[str, int]:
    """A process' resident memory in bytes: ``rss``, ``pss`` (shared pages divided among the
    processes sharing them, so a tree's PSS sums to what it really holds) and ``private`` (pages
    only this process maps; what ending it would free). Empty when it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            text = f.read()
    except OSError:
        return {}
    fields: dict[str, int] = {}
    for line in text.splitlines()[1:]:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[key] = int(parts[0]) * 1024
    return {"rss": fields.get("Rss", 0), "pss": fields.get("Pss", 0),
            "private": fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)}


def jvm_native_memory(pid: int, jcmd: str = "jcmd") -> dict[str, int]:
    """Committed bytes of a JVM by Native Memory Tracking category ("Java Heap", "Class",
    "Thread", "Code", "GC", "Internal", "Other", ...; "Total" too), from ``jcmd <pid>
    VM.native_memory summary``. The JVM must run with ``-XX:NativeMemoryTracking=summary``;
    empty otherwise (or when jcmd cannot attach)."""
    import subprocess

    try:
        done = subprocess.run([jcmd, str(pid), "VM.native_memory", "summary"], capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return parse_native_memory(done.stdout)


def parse_native_memory(text: str) -> dict[str, int]:
    """``{category: committed bytes}`` of a ``VM.native_memory summary`` report."""
    import re

    out: dict[str, int] = {}
    total = re.search(r"^Total: reserved=(\d+)KB, committed=(\d+)KB", text, re.MULTILINE)
    if total:
        out["Total"] = int(total.group(2)) * 1024
    category = re.compile(r"^-\s+(.+?) \(reserved=\d+KB, committed=(\d+)KB\)", re.MULTILINE)
    for name, committed in category.findall(text):
        out[name.strip()] = int(committed) * 1024
    return out


def rss_by_mapping(pid: int, top: int = 6) -> dict[str, int]:
    """A process' resident bytes by what is mapped: ``[heap]`` (glibc's main arena), ``anon``
    (other anonymous mappings: other malloc arenas, mmap'd allocator segments, JVM heap and
    thread stacks) and the ``top`` files by their resident bytes (a shared library, the JVM's
    class archive); empty when the process is gone."""
    out: dict[str, int] = {}
    name = "anon"
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                first = line.split(maxsplit=1)[0]
                if "-" in first and not first.endswith(":"):
                    fields = line.split()
                    name = fields[5].rsplit("/", 1)[-1] if len(fields) > 5 else "anon"
                elif first == "Rss:":
                    out[name] = out.get(name, 0) + int(line.split()[1]) * 1024
    except OSError:
        return {}
    files = sorted(((k, v) for k, v in out.items() if k not in ("anon", "[heap]")), key=lambda kv: -kv[1])
    kept = {k: v for k, v in out.items() if k in ("anon", "[heap]")} | dict(files[:top])
    kept["other files"] = sum(v for _, v in files[top:])
    return kept


def worker_tree_part(pid: int, root: int, argv: list[bytes]) -> str:
    """A sink-worker tree's parts for ``MemorySampler``: the service, its JVM, its Python children."""
    if pid == root:
        return "service"
    return "jvm" if argv and argv[0].endswith(b"java") else "python children"


def wait_while_alive(check: Callable[[], bool], within: float, what: str,
                     procs: list[ServiceProcess]) -> float:
    """Seconds until ``check()`` holds (an exception counts as not yet: downstream tables appear
    with the initial load); raises if one of ``procs`` dies or ``within`` passes first."""
    started = time.monotonic()
    while time.monotonic() - started < within:
        for p in procs:
            if not p.alive():
                raise RuntimeError(f"{p.instance_id} died:\n{p.tail_log(30)}")
        try:
            if check():
                return time.monotonic() - started
        except Exception:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{what} not reached within {within:.0f}s:\n"
                       + "\n".join(f"--- {p.instance_id}\n{p.tail_log(20)}" for p in procs))
