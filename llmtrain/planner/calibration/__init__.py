"""Measuring this machine to describe it as a cluster (tools/calibrate.py, tools/plan.py --profile-local,
parallel.auto without a cluster file): `timing` (how a measurement is repeated and summarised), `compute`
(one device: matmuls, attention, memory-bound operators, launch and host costs), `links` (collectives between
local processes), `measure` (one calibration run of both), `measurements` (what a run measured and the
cluster YAML made of it) and `profile` (the quick description of this machine, and the local process
launcher). The only part of the planner that uses torch (and torch.distributed, to time collectives;
llmtrain.models and llmtrain.precision, to time a real block), always imported inside the functions that
measure; it may import llmtrain.planner.cluster and llmtrain.planner.cost, and nothing imports it but
tools, benchmarks and parallel.auto's fallback.
"""
