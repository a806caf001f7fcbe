"""How far the planner's predictions are from measurements: `published` (Megatron-LM's Table 1, Narayanan et
al. 2021, shipped as llmtrain/planner/data/megatron_a100_2021.csv), `local` (measured gloo runs of a small
model on this machine) and `per_layer` (the per-layer search against exhaustive enumeration). Used by
benchmarks/validate_planner.py, benchmarks/bench_planner_search.py and the tests. It may import any other
part of the planner and llmtrain.config; nothing in the planner imports it.
"""
