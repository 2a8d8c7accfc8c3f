"""The weight broadcast of the split placement: training rank 0 sends, every rollout rank receives.

A process group of its own (not the training ranks' default group), built from a TCP store that
training rank 0 hosts on its node's routable address: gloo on CPU, NCCL on GPU, where the tensors
go GPU to GPU. The training ranks gather the policy one tensor at a time (FSDP all-gathers among
themselves) and rank 0 broadcasts each, so no rank ever holds more than one full tensor extra, and
nothing goes through Ray's object store.
"""

from __future__ import annotations

from datetime import timedelta
from urllib.parse import urlparse

import torch


class WeightBroadcast:
    """Member ``rank`` of ``world`` of the broadcast group rendezvousing at ``address`` (tcp://host:port)."""

    def __init__(
        self, address: str, rank: int, world: int, *, device: torch.device, timeout_s: float
    ) -> None:
        import torch.distributed as dist

        where = urlparse(address)
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(where.hostname, where.port, world, rank == 0, timeout)
        prefixed = dist.PrefixStore("tearless-weights", store)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(prefixed, rank, world, options)
        else:
            self.group = dist.ProcessGroupGloo(prefixed, rank, world, timeout)
        self.store = store  # the group reads the store as long as it lives

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` into every member's ``tensor`` (in place); returns it."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        self.group.broadcast([tensor], opts).wait()
        return tensor
