"""The suite's pytest-xdist scheduling (``--dist loadgroup``, as ``infra/dev.sh`` passes it):
one module per unit of work, the longest first, and some modules alone.

A module's tests stay on one worker, in file order, sharing what the module sets up (module
fixtures, a system the tests leave healthy for the next). xdist's own ``loadgroup`` would group by
``xdist_group`` marks, but with pytest 9 the group it appends to a test's node id is lost
(``Node.nodeid`` no longer reads ``_nodeid``), so every test became its own unit and the tests of
one module ran on both workers; the grouping here reads only the node id's module.

The modules of ``LONGEST_FIRST`` are handed out before the others, in that order, and a worker
gets its next module only when it is at its current one's last test: a long module that starts
late is what leaves one worker busy while the other has nothing left to do, so the shared part
ends evenly when the short modules come last and none is promised to a worker still busy.

The modules of ``EXCLUSIVE_MODULES`` run alone, at the end: once every other module has been
handed out, the other workers finish and stop, and the last one runs them one after another. Their
assertions are timing bounds (failover, takeover, stop) measured against the wall clock, and on
two cores a neighbour's Spark start would otherwise be what they measure. A module that only
loads the machine is not one of them: test_chaos (its assertions are invariants, its fault
schedule runs on its own clock, its waits have bounds of minutes) and test_e2e_large_rows (memory
and I/O, bounds of minutes) run first, beside the others; both pass with a load average above 20."""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling
from xdist.workermanage import WorkerController

EXCLUSIVE_MODULES = frozenset({
    "tests/test_control_plane.py", "tests/test_self_fence_process.py",
    "tests/test_prompt_stop.py", "tests/test_services.py", "tests/test_election.py",
    "tests/test_leader_probe.py", "tests/test_leader_resign.py",
    # A 1.5 s lease held under its own two busy processes: beside a neighbour it would measure
    # the neighbour, and its busy processes would be in the neighbours' timing bounds.
    "tests/test_capture_lease_under_load.py",
})
# The shared modules that take longest on two cores, longest first (measured with
# `--durations`); the rest follow in collection order. A module missing here is only
# scheduled later, never skipped.
LONGEST_FIRST = (
    "tests/test_e2e_large_rows.py", "tests/test_chaos.py", "tests/test_ddl_matrix.py",
    "tests/test_large_txn_process.py", "tests/test_initial_load.py", "tests/test_nats_cluster.py",
    "tests/test_shard_ddl_process.py", "tests/test_spark_cluster.py", "tests/test_source_failover.py",
    "tests/test_e2e_replication.py", "tests/test_observability.py", "tests/test_table_rules_process.py",
    "tests/test_type_matrix.py", "tests/test_capture_faults.py", "tests/test_fk_cascades_process.py",
    "tests/test_schema_at_position_process.py",
    "tests/test_xa_process.py", "tests/test_unreplicable_tables.py",
    "tests/test_syncpoints_process.py",
)
_EXCLUSIVE = "exclusive:"


class ModuleScheduling(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return _EXCLUSIVE + module if module in EXCLUSIVE_MODULES else module

    def _next_shared(self) -> str | None:
        first = next((m for m in LONGEST_FIRST if m in self.workqueue), None)
        return first or next((s for s in self.workqueue if not s.startswith(_EXCLUSIVE)), None)

    def _reschedule(self, node: WorkerController) -> None:
        # xdist gives a worker its next unit while two of its tests are still to run; here only at
        # its last one (which the worker holds until it knows what follows, so it never idles).
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) > 1:
            return
        self._assign_work_unit(node)

    def _assign_work_unit(self, node: WorkerController) -> None:
        shared = self._next_shared()
        if shared is None:
            # Only exclusive modules are left; the last worker runs them. An xdist worker keeps
            # its last test until it gets more work or is shut down, so one that is refused must
            # be shut down, never left waiting.
            others = [n for n in self.nodes if n is not node]
            if any(not n.shutting_down for n in others):
                node.shutdown()
                return
            if any(self._pending_of(self.assigned_work[n]) for n in others):
                return  # woken by their last completion (mark_test_complete)
        scope = shared if shared is not None else next(iter(self.workqueue))
        work_unit = self.workqueue.pop(scope)
        self.assigned_work.setdefault(node, {})[scope] = work_unit
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])

    def mark_test_complete(self, node: WorkerController, item_index: int, duration: float = 0) -> None:
        super().mark_test_complete(node, item_index, duration)
        # The last test of a worker that is shutting down may be what the worker left to run
        # the exclusive modules waits for.
        if node.shutting_down:
            for other in self.nodes:
                if other is not node and not other.shutting_down:
                    self._reschedule(other)
