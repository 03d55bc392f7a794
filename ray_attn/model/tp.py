"""The tensor-parallel group one model shard reduces over."""

from __future__ import annotations

import torch
import torch.distributed as dist


class TPGroup:
    """Rank, size and the torch.distributed group of one model replica's TP ranks.

    ``group=None`` with ``size > 1`` means the default (WORLD) group, which must then be exactly
    the TP ranks: a shard that silently skipped its reduction would compute wrong numbers.
    """

    def __init__(self, rank: int = 0, size: int = 1, group=None):
        if not 0 <= rank < size:
            raise ValueError(f"tp_rank={rank} must be in [0, tp_size={size})")
        if size > 1 and group is None:
            if not dist.is_initialized():
                raise RuntimeError(f"tp_size={size} needs torch.distributed initialised or a tp_group")
            if dist.get_world_size() != size:
                raise RuntimeError(f"tp_size={size} but the default process group has "
                                   f"{dist.get_world_size()} ranks; pass tp_group")
        self.rank, self.size, self.group = rank, size, group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` in place over the group (a no-op for one rank)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x
