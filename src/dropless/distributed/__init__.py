"""dropless.distributed: expert parallelism and FSDP2 on torch.distributed (design: docs/ep.md)."""

from .ep import EPDispatcher, build_ep_dispatcher, link_capacity, local_expert_count, must_invalidate
from .ep_exchange import EPMeta
from .mesh import Meshes, build_meshes, init_distributed
from .parallelize import dp_all_reduce, exact_dispatch, finish_grads_, parallelize_model, worst_case_dispatch
from .parallelize_ep import shard_moe_layer

__all__ = ["EPDispatcher", "EPMeta", "Meshes", "build_ep_dispatcher", "build_meshes", "dp_all_reduce",
           "exact_dispatch", "finish_grads_", "init_distributed", "link_capacity", "local_expert_count",
           "must_invalidate", "parallelize_model", "shard_moe_layer", "worst_case_dispatch"]
