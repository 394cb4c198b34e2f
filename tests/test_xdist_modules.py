"""The suite's xdist scheduling (tests/helpers/xdist_modules.py) driven with stand-in workers:
modules stay whole, the longest go first, a worker gets its next module only at its last test,
and the exclusive modules run on one worker once every other has finished."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from tests.helpers.xdist_modules import EXCLUSIVE_MODULES, LONGEST_FIRST, ModuleScheduling


class Worker:
    """What the scheduler sees of an xdist worker: the indexes it was sent, and shutdown."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.gateway = SimpleNamespace(id=name)
        self.queue: list[int] = []
        self.shutting_down = False
        self.ahead: list[int] = []  # how many tests it still held each time it got more

    def send_runtest_some(self, indexes: list[int]) -> None:
        assert not self.shutting_down, f"{self.name} got work after its shutdown"
        self.ahead.append(len(self.queue))
        self.queue += indexes

    def shutdown(self) -> None:
        self.shutting_down = True


def _tests(module: str, n: int) -> list[str]:
    return [f"{module}::test_{i}" for i in range(n)]


def _run(collection: list[str], workers: int = 2) -> tuple[list[Worker], list[tuple[str, str, str]]]:
    """Run the collection to the end, one test at a time on the worker whose turn it is; the
    worker holds its last test until it gets more work or is shut down, as xdist's does."""
    config: Any = SimpleNamespace(getvalue=lambda name: [f"{workers}*popen"],
                                  option=SimpleNamespace(loadscopereorder=False))
    sched = ModuleScheduling(config)
    nodes = [Worker(f"gw{i}") for i in range(workers)]
    for node in nodes:
        sched.add_node(node)  # type: ignore[arg-type]
    for node in nodes:
        sched.add_node_collection(node, collection)  # type: ignore[arg-type]
    sched.schedule()
    ran: list[tuple[str, str, str]] = []  # (worker, test, what the other workers were running)
    turn = 0
    while any(n.queue for n in nodes):
        node = nodes[turn % workers]
        turn += 1
        if not node.queue or (len(node.queue) == 1 and not node.shutting_down):
            continue
        index = node.queue.pop(0)
        beside = ",".join(f"{n.name}:{collection[n.queue[0]]}" for n in nodes if n is not node and n.queue)
        ran.append((node.name, collection[index], beside))
        sched.mark_test_complete(node, index)  # type: ignore[arg-type]
    assert sched.tests_finished and not sched.workqueue
    return nodes, ran


EXCLUSIVE = sorted(EXCLUSIVE_MODULES)[:2]
COLLECTION = (_tests("tests/test_a.py", 3) + _tests(EXCLUSIVE[0], 2) + _tests("tests/test_b.py", 1)
              + _tests(LONGEST_FIRST[1], 2) + _tests("tests/test_c.py", 4) + _tests(EXCLUSIVE[1], 3)
              + _tests("tests/test_d.py", 2) + _tests(LONGEST_FIRST[0], 1))


def test_every_test_runs_once_and_each_module_on_one_worker() -> None:
    _, ran = _run(COLLECTION)
    assert sorted(t for _, t, _ in ran) == sorted(COLLECTION)
    workers_of: dict[str, set[str]] = {}
    for worker, test, _ in ran:
        workers_of.setdefault(test.split("::")[0], set()).add(worker)
    assert all(len(w) == 1 for w in workers_of.values()), workers_of


def test_the_longest_modules_start_first() -> None:
    _, ran = _run(COLLECTION)
    started = list(dict.fromkeys(t.split("::")[0] for _, t, _ in ran))
    assert set(started[:2]) == set(LONGEST_FIRST[:2]), started


def test_exclusive_modules_run_last_and_alone() -> None:
    _, ran = _run(COLLECTION)
    modules = [t.split("::")[0] for _, t, _ in ran]
    first_exclusive = min(i for i, m in enumerate(modules) if m in EXCLUSIVE_MODULES)
    assert all(m in EXCLUSIVE_MODULES for m in modules[first_exclusive:]), modules
    for _, test, beside in ran:
        if test.split("::")[0] in EXCLUSIVE_MODULES:
            assert not beside, f"{test} ran beside {beside}"


def test_a_worker_is_promised_its_next_module_only_at_its_last_test() -> None:
    workers, ran = _run(COLLECTION)
    assert len(ran) == len(COLLECTION)
    assert all(ahead <= 1 for w in workers for ahead in w.ahead), [w.ahead for w in workers]
