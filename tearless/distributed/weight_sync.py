"""The weight broadcast of the split placement: training rank 0 sends, every rollout rank receives.

A process group of its own (not the training ranks' default group), built from a TCP store that
training rank 0 hosts on its node's routable address: gloo on CPU, NCCL on GPU, where the tensors
go GPU to GPU. The training ranks gather the policy one tensor at a time (FSDP all-gathers among
themselves) and rank 0 broadcasts each, so no rank ever holds more than one full tensor extra, and
nothing goes through Ray's object store.

Every broadcast is announced first, on the same store: broadcast k (counting from 1) sets
``version/<k>`` to the policy version it carries, then the ``announced`` counter to k. A rollout rank
generating with partial rollouts polls that counter between two tokens and, when it is ahead of the
broadcasts it has received, joins them there (:meth:`Rank.take_new_weights`).
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
        self.sent = 0  # broadcasts announced by this member (the sender)

    def announce(self, version: int | None) -> int:
        """Sender: publish that the next broadcast carries policy ``version`` (None: unknown, the
        first load); returns its number k."""
        k = self.sent + 1
        self.store.set(f"version/{k}", str(-1 if version is None else version))
        self.store.add("announced", 1)
        self.sent = k
        return k

    def announced(self) -> int:
        """The number of broadcasts announced so far (a non-blocking read of the counter)."""
        return int(self.store.add("announced", 0))

    def version_of(self, k: int) -> int | None:
        """The policy version broadcast ``k`` carries (None when unknown)."""
        version = int(self.store.get(f"version/{k}"))
        return None if version < 0 else version

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` into every member's ``tensor`` (in place); returns it."""
        import torch.distributed as dist

        if self.group is None:
            raise RuntimeError("the weight broadcast group is closed")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        self.group.broadcast([tensor], opts).wait()
        return tensor

    def close(self) -> None:
        """Shut the group down and drop the store (idempotent). Left to the interpreter's exit, NCCL
        warns that a process group was never destroyed, and its communicators outlive the run's end."""
        if self.group is not None:
            self.group.shutdown()
            self.group = None
        self.store = None
