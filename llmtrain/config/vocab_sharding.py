"""Which jobs run the input embedding and the output layer vocabulary-parallel over the ZeRO shard group
(llmtrain.parallel.vocab_sharded); here, without torch, so the planner's memory model applies the same
rule."""

from __future__ import annotations


def vocab_sharded_edges(
    zero_stage: int, tp: int, pp: int, cp: int, dp: int, dp_shard: int | None, vocab_size: int, tied: bool
) -> bool:
    """Whether the embedding and output layer stay sharded (never gathered) in the step: at ZeRO-2/3 on
    more than one data-parallel rank, one model chunk (pp=1), no TP (whose own vocabulary split they would
    meet) or CP (whose ranks share a sequence's loss), plain sharding (not hybrid: replicas would also need
    their gradients all-reduced), separate weights (a tied one serves both ends in one FSDP unit), and a
    vocabulary that divides evenly over the ranks (the loss assumes equal slices)."""
    return (
        zero_stage >= 2
        and dp > 1
        and tp == 1
        and pp == 1
        and cp == 1
        and (dp_shard is None or dp_shard == dp)
        and not tied
        and vocab_size % dp == 0
    )
