"""The planner behind `train.py --dry-run --cluster configs/clusters/X.yaml`.

It sizes a run before anyone spends cluster hours: the real model built on the
meta device (planner/trace.py), the real engine's partition and collectives
(planner/comm.py, planner/memory.py), a stated time model (planner/timing.py)
and a cluster description (planner/cluster.py). No process group, no data, no
memory is allocated.
"""
from planner.cluster import Cluster, load_cluster
from planner.plan import Job, build_plan, format_plan, plan_config, print_plan

__all__ = ["Cluster", "Job", "build_plan", "format_plan", "load_cluster", "plan_config", "print_plan"]
