"""Harmony-style planning: from a profile, the configuration (schedule, D, W, B, N, recomputation, partition)
with the least simulated step time that fits the memory limit."""

from chimera.plan.costs import simulator_costs, stage_costs
from chimera.plan.memory import WorkerMemory, worker_memory
from chimera.plan.partition import PartitionResult, plan_partition
from chimera.plan.planfile import PlanError, PlanFile
from chimera.plan.search import Candidate, Evaluated, PlanResult, plan

__all__ = ["Candidate", "Evaluated", "PartitionResult", "PlanError", "PlanFile", "PlanResult", "WorkerMemory",
           "plan", "plan_partition", "simulator_costs", "stage_costs", "worker_memory"]
