"""magi_jax: flexible-mask (MagiAttention-style) attention for JAX, on one device and over many."""

# The custom calls' operands may change between versions: an exported step runs where the same version is imported.
__version__ = "0.1.0"

from magi_jax import masks
from magi_jax._ffi import EXPORT_DISABLED_CHECKS
from magi_jax.dist_attn import (MeshPlan, PlanTables, calc_attn, calc_attn_local, dispatch, plan, plan_tables,
                                position_ids, undispatch)
from magi_jax.ffa import CHECKPOINT_NAMES, flex_flash_attn, with_sinks
from magi_jax.mask import AttnMask, AttnMaskType
from magi_jax.nn import dot_product_attention
from magi_jax.planner import PlanCapacity

__all__ = ["AttnMask", "AttnMaskType", "flex_flash_attn", "masks", "MeshPlan", "plan", "dispatch", "undispatch",
           "position_ids", "calc_attn", "calc_attn_local", "PlanCapacity", "PlanTables", "plan_tables",
           "CHECKPOINT_NAMES", "dot_product_attention", "with_sinks", "EXPORT_DISABLED_CHECKS", "__version__"]
