"""Shared by the tests that run real gloo process groups."""

from __future__ import annotations


def shut_down() -> None:
    """Leave the group together: a rank tearing down gloo while its peer is still in a collective
    can abort the peer's process."""
    import torch.distributed as dist

    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()
