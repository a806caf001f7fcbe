"""Auto-config planner: which parallel layout to train a model with on a cluster, and why.

The map (each subpackage's docstring says what it owns and what it may import; the arrows are the only
direction imports run):

    cluster/      devices, nodes, links and their collective costs; cluster files and shipped presets
      -> cost/        the analytical model of one layout: layout (what is evaluated), flops, collectives,
                      host_ops, memory, pipeline_time, and CostModel (model) from its parts: layer_time,
                      step_collectives, data_parallel (over base)
      -> search/      uniform (plan, plan_job), per_layer and hetero searches over layouts
      -> report/      tables, explain, choices, plot, files: presenting plans
      -> auto.py      `parallel.auto`: the layout the trainer runs for its world size
      -> validation/  predictions against published and locally measured step times; per-layer search
                      against enumeration
    calibration/  measures this machine into a cluster file (torch, lazily): timing, compute, links,
                  measure, measurements, profile
    clusters/, data/  package data: the cluster presets (YAML) and the published tables (CSV)

Pure Python (no torch, no processes) except `llmtrain.planner.calibration`, which measures this machine.
The public entry points are re-exported here.
"""

from llmtrain.planner.auto import layout_overrides, plan_for_world
from llmtrain.planner.cluster.files import cluster_from_dict, load_cluster
from llmtrain.planner.cluster.hardware import Cluster, ClusterView, Device, Link
from llmtrain.planner.cost.flops import model_flops_per_token, num_parameters, training_flops_per_token
from llmtrain.planner.cost.layout import Layout, Software, Workload, with_layout
from llmtrain.planner.cost.model import CostModel, Estimate
from llmtrain.planner.search.uniform import PlanResult, parse_fixed, plan, plan_job

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
