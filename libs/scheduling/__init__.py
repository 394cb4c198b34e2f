"""Table scheduling domain logic (TiCDC scheduler v3 style): replication sets, schedulers,
checkpoints, the member agent's dispatch state. Plain Python: no NATS, no I/O, no asyncio.

Modules: ``model`` (ids, states, reports, errors), ``tasks`` (schedule tasks and dispatches),
``replication_set`` (the per-span state machine and its indexes), ``manager`` (all sets of one
leader term, rebuild, task bookkeeping), ``schedulers`` (basic, drain, operator move, rebalance,
balance, coordinator), ``checkpoint`` (changefeed checkpoint), ``agent`` (member side).
"""

from libs.scheduling.agent import AgentOutcome, AgentTable, AgentVerdict, MemberAgentState, Transition
from libs.scheduling.checkpoint import (
    ChangefeedCheckpoint,
    CheckpointTracker,
    CheckpointUpdate,
    compute_checkpoint,
    spans_by_changefeed,
)
from libs.scheduling.manager import ReplicationManager, TaskOutcome, TaskRejection
from libs.scheduling.model import (
    ChangefeedId,
    InconsistentSetError,
    InvalidTaskError,
    MemberId,
    MemberInfo,
    MemberReport,
    MultiplePrimaryError,
    SchedulingError,
    Span,
    TableState,
    TableStatus,
)
from libs.scheduling.replication_set import ReplicationSet, Role, SetIndex, SetLike, SetState
from libs.scheduling.schedulers import (
    DEFAULT_MAX_ADDS_PER_MEMBER,
    DEFAULT_OPERATOR_PIN_S,
    BalanceScheduler,
    BasicScheduler,
    Coordinator,
    DrainScheduler,
    OperatorMoveScheduler,
    RebalanceScheduler,
    SchedulingView,
    WantedSpans,
    validate_move,
)
from libs.scheduling.tasks import AddTable, Dispatch, DispatchAction, MoveTable, RemoveTable, ScheduleTask

__all__ = [
    "DEFAULT_MAX_ADDS_PER_MEMBER",
    "DEFAULT_OPERATOR_PIN_S",
    "AddTable",
    "AgentOutcome",
    "AgentTable",
    "AgentVerdict",
    "BalanceScheduler",
    "BasicScheduler",
    "ChangefeedCheckpoint",
    "ChangefeedId",
    "CheckpointTracker",
    "CheckpointUpdate",
    "Coordinator",
    "Dispatch",
    "DispatchAction",
    "DrainScheduler",
    "InconsistentSetError",
    "InvalidTaskError",
    "MemberAgentState",
    "MemberId",
    "MemberInfo",
    "MemberReport",
    "MoveTable",
    "MultiplePrimaryError",
    "OperatorMoveScheduler",
    "RebalanceScheduler",
    "RemoveTable",
    "ReplicationManager",
    "ReplicationSet",
    "Role",
    "ScheduleTask",
    "SchedulingError",
    "SchedulingView",
    "SetIndex",
    "SetLike",
    "SetState",
    "Span",
    "TableState",
    "TableStatus",
    "TaskOutcome",
    "TaskRejection",
    "Transition",
    "WantedSpans",
    "compute_checkpoint",
    "spans_by_changefeed",
    "validate_move",
]
