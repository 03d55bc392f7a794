"""Ray: tensor-parallel attention workers and the driver's cluster handle."""

from ray_attn.runtime.cluster import AttentionCluster, InProcessExecutor, WorkerFailure, ensure_ray
from ray_attn.runtime.messages import StepInput, StepOutput
from ray_attn.runtime.worker import AttentionWorker

__all__ = ["AttentionCluster", "AttentionWorker", "InProcessExecutor", "StepInput", "StepOutput", "WorkerFailure",
           "ensure_ray"]
