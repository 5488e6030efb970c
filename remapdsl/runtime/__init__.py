"""Executors that run plans, the only torch.distributed caller, and the load / save / convert drivers."""
