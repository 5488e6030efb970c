"""Shared by the tests that run real gloo process groups."""

from __future__ import annotations


def shut_down() -> None:
    """Leave the group together: a rank tearing down gloo while its peer is still in a collective
    can abort the peer's process. Collect garbage first: a tensor still referenced from a finished
    gloo work object and freed during interpreter finalization aborts the process (SIGABRT,
    "terminate called without an active exception"; pytorch/pytorch#179291)."""
    import gc

    import torch.distributed as dist

    gc.collect()
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()
