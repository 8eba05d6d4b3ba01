"""The distributed planner (DESIGN.md section 3): chunks, dispatch solvers, per-rank slices, transfer tables
and overlap stages, as a static hashable ``DistAttnPlan``. Pure numpy: no jax, no devices."""

from magi_jax.planner.plan import (DistAttnPlan, PlanCapacity, PlanStats, SliceSet, Stage, default_chunk_size,
                                   make_plan)
from magi_jax.planner.solvers import DEFAULT_SOLVER, SOLVERS
from magi_jax.planner.stages import CostModel
from magi_jax.planner.transfers import StageTransfers

__all__ = ["make_plan", "DistAttnPlan", "PlanCapacity", "PlanStats", "SliceSet", "Stage", "StageTransfers",
           "CostModel", "SOLVERS", "DEFAULT_SOLVER", "default_chunk_size"]
