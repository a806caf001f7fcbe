"""The analytical cost model: what one parallel layout of one workload costs on one cluster view, per step
and per rank. `layout` holds what is evaluated (Layout, Software, Workload, and their mapping to and from a
job config); `flops` the FLOP and parameter counts; `collectives` the communication each layer and step
issues, and `host_ops` the operators the host dispatches; `memory` the bytes per rank; `pipeline_time` the
pipeline's step time (the pipeline simulator or its closed forms); and CostModel (`model`) puts them
together from its parts: `layer_time` (compute and the TP/CP/EP communication of a layer),
`step_collectives` (every collective of a step), `data_parallel` (gradient reduction, parameter gathers,
optimizer) over `base` (the per-rank shapes they share). It may import llmtrain.config, the pure pipeline
schedules, simulator and partition (llmtrain.pipeline.schedules, .simulator, .partition) and
llmtrain.planner.cluster; nothing here searches, reports or measures.
"""
