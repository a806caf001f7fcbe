"""The cluster description: devices, node groups and links (`hardware`), what one job sees of them
(`ClusterView`, with the alpha-beta cost of every collective and send), the YAML files that describe them and
the shipped presets (`files`; the presets themselves are package data in llmtrain/planner/clusters/), and the
interpolation of calibrated tables (`interpolate`). It may import llmtrain.config only: the rest of the
planner builds on it, and it knows nothing of models, layouts or searches.
"""
