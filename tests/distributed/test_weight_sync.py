"""The weight broadcast's own lifecycle: a one-member group on CPU (gloo), opened, used and closed."""

from __future__ import annotations

import socket

import pytest
import torch

from tearless.distributed.weight_sync import WeightBroadcast


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_close_ends_the_group_once_and_a_closed_broadcast_says_so():
    # NCCL warned at exit about a group nobody destroyed; close() shuts the group down (idempotent).
    sync = WeightBroadcast(f"tcp://127.0.0.1:{free_port()}", 0, 1, device=torch.device("cpu"), timeout_s=10)
    assert sync.announce(3) == 1 and sync.version_of(1) == 3
    assert sync.broadcast(torch.arange(4.0)).tolist() == [0.0, 1.0, 2.0, 3.0]
    sync.close()
    sync.close()
    with pytest.raises(RuntimeError, match="the weight broadcast group is closed"):
        sync.broadcast(torch.zeros(2))
