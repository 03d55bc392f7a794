"""How the ranks of one tensor-parallel group find each other.

Ray starts each rank in its own actor process, on a node it picks, so the torch.distributed
process group can only be formed once they all run: rank 0 names an address on its node, and
every rank joins there.  This module is the only place that forms or names that group; the
model's collectives and the worker's token broadcast run on it.
"""

from __future__ import annotations

import datetime

import torch

from ray_attn.ports import free_port

# Bounded, so that a rank whose peer died errors out instead of hanging forever.
JOIN_TIMEOUT = datetime.timedelta(seconds=120)


def group_address() -> tuple[str, int]:
    """An address on this node for the group's rendezvous (rank 0 calls it, inside its actor)."""
    import ray

    return ray.util.get_node_ip_address(), free_port()


def join_group(host: str, port: int, rank: int, world_size: int, device: torch.device) -> None:
    """Join the group served at ``host:port``.  A group this process already joined is left
    first, so that a second call re-forms the group instead of failing."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank,
                            world_size=world_size, timeout=JOIN_TIMEOUT)


def tp_group(world_size: int):
    """The group the model's collectives run on: the whole world ``join_group`` formed, or None
    for a single rank, which joins none."""
    if world_size <= 1:
        return None
    import torch.distributed as dist

    return dist.group.WORLD
