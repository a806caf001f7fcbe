"""The searches over parallel layouts, each ranking layouts by the cost model: `uniform` (every layer alike:
the space of tp, pp, cp, ep, micro-batch, schedule, recomputation and sharding, pruned, then enumerated or
searched by coordinate descent; plan, plan_job, PlanResult), `per_layer` (recomputation per layer and layers
per pipeline chunk, from the best uniform layouts) and `hetero` (uneven layers per stage or micro-batches
per replica on clusters of several device kinds). It may import llmtrain.config, llmtrain.planner.cluster,
llmtrain.planner.cost and the pure pipeline simulator; not the reports, validation or calibration.
"""
