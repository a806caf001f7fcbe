"""Auto-config planner: cluster description, analytical cost model, layout search, `parallel.auto`.

Pure Python (no torch, no processes) except `llmtrain.planner.profile`, which measures this machine.
"""

from llmtrain.planner.auto import layout_overrides, plan_for_world
from llmtrain.planner.cluster import Cluster, ClusterView, Device, Link, cluster_from_dict, load_cluster
from llmtrain.planner.cost_model import CostModel, Estimate, Layout, Software, Workload, with_layout
from llmtrain.planner.flops import model_flops_per_token, num_parameters, training_flops_per_token
from llmtrain.planner.search import PlanResult, parse_fixed, plan, plan_job

__all__ = [
    "Cluster",
    "ClusterView",
    "CostModel",
    "Device",
    "Estimate",
    "Layout",
    "Link",
    "PlanResult",
    "Software",
    "Workload",
    "cluster_from_dict",
    "layout_overrides",
    "load_cluster",
    "model_flops_per_token",
    "num_parameters",
    "parse_fixed",
    "plan",
    "plan_for_world",
    "plan_job",
    "training_flops_per_token",
    "with_layout",
]
