"""Driver-side planner (numpy only, no torch): block pool, step plans, cascade and local decisions."""

from .block_pool import BlockPool
from .builder import DEFAULT_NUM_SMS, Planner
from .cascade import (
    cascade_verdict,
    common_prefix_blocks,
    find_prefix_groups,
    measured_cascade_verdict,
    multi_group_cascade_verdict,
    use_cascade_attention,
)
from .errors import (
    DoubleFreeError,
    InvalidRequestError,
    OutOfBlocksError,
    PlannerConfigError,
    PlannerError,
    UnknownRequestError,
)
from .local import make_local_attention_virtual_batches
from .plan import ScheduledRequest, StepPlan

__all__ = [
    "BlockPool", "DEFAULT_NUM_SMS", "Planner", "ScheduledRequest", "StepPlan",
    "cascade_verdict", "common_prefix_blocks", "find_prefix_groups", "multi_group_cascade_verdict", "measured_cascade_verdict",
    "use_cascade_attention", "make_local_attention_virtual_batches",
    "PlannerError", "PlannerConfigError", "InvalidRequestError", "UnknownRequestError",
    "DoubleFreeError", "OutOfBlocksError",
]
