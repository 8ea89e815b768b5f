"""dropless.distributed: expert parallelism on torch.distributed (protocol: docs/ep.md)."""

from .ep import EPDispatcher, EPMeta, link_capacity, local_expert_count, must_invalidate
from .parallelize_ep import shard_moe_layer

__all__ = ["EPDispatcher", "EPMeta", "link_capacity", "local_expert_count", "must_invalidate",
           "shard_moe_layer"]
