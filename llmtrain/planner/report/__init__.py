"""Presenting plans: `tables` (the ranked table, one layout's memory rows, JSON records), `explain` (why the
chosen layout won: its step time split and what ruled out the runners-up), `choices` (why a plan splits the
sequence or the experts), `plot` (the breakdown picture) and `files` (the winning config as YAML, written
atomically). It may import llmtrain.config, llmtrain.planner.cluster, llmtrain.planner.cost and
llmtrain.planner.search; only tools, validation and parallel.auto (its notes) import it.
"""
