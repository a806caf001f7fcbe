"""The tensor- and pipeline-parallel rules live in one place (llmtrain.config.validate); every consumer obeys.

References: megatron-core's own checks (TransformerConfig for heads and kv heads, its partition arithmetic
for the vocabulary, MLP and sequence splits) for which layouts are splittable at all; partition_layers'
actual split for the layer rule. Consumers checked against the one function, message for message: config
loading, check_tp (apply_tp, checkpoint conversion), partition_layers, the planner's search and cost model.
"""

import itertools
import re
import subprocess
import sys
from dataclasses import replace

import pytest

from llmtrain.config import ConfigError, load
from llmtrain.config.schema import ModelConfig
from llmtrain.config.validate import pipeline_problem, tensor_parallel_problem
from llmtrain.parallel.tensor_parallel import check_tp
from llmtrain.pipeline.stages import partition_layers
from llmtrain.planner import CostModel, Workload, load_cluster
from llmtrain.planner.cost.layout import SCHEDULES, Layout
from llmtrain.planner.search.uniform import build_space

A100 = load_cluster("a100-80gb")
TPS = (1, 2, 3, 4, 6, 8)


def models() -> list[ModelConfig]:
    """Small LLaMA shapes that pass every non-parallel check, each failing some tp for some reason."""
    out = []
    for heads, kv, vocab, ffn, seq in itertools.product((8, 12), (1, 2, 4), (96, 100), (96, 128), (24, 32)):
        out.append(
            ModelConfig(arch="llama", num_layers=4, hidden_size=8 * heads, num_attention_heads=heads,
                        num_kv_heads=kv, vocab_size=vocab, ffn_hidden_size=ffn, seq_length=seq)
        )  # fmt: skip
    return out


def overrides(model: ModelConfig) -> list[str]:
    keys = ("arch", "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "vocab_size",
            "ffn_hidden_size", "seq_length")  # fmt: skip
    return [f"model.{k}={'null' if getattr(model, k) is None else getattr(model, k)}" for k in keys]


def named_field(problem: str) -> str:
    """The first model field a message names ("" for no problem)."""
    found = re.search(r"model\.(\w+)=", problem)
    return found.group(1) if found else problem


def test_the_grid_exercises_every_branch_of_the_rule():
    verdicts = {
        named_field(tensor_parallel_problem(m, tp, sp)) for m in models() for tp in TPS for sp in (0, 1)
    }
    assert verdicts == {
        "",
        "num_attention_heads",
        "num_kv_heads",
        "vocab_size",
        "ffn_hidden_size",
        "seq_length",
    }


@pytest.mark.parametrize("model", models(), ids=lambda m: f"h{m.num_attention_heads}kv{m.kv_heads}"
                         f"v{m.vocab_size}f{m.ffn_size}s{m.seq_length}")  # fmt: skip
def test_config_check_tp_and_cost_model_report_the_rule_word_for_word(model):
    for tp, sp in itertools.product(TPS, (False, True)):
        problem = tensor_parallel_problem(model, tp, sp)
        args = [*overrides(model), f"parallel.tp={tp}", f"parallel.sequence_parallel={str(sp).lower()}"]
        layout = Layout(tp=tp, micro_batch=1, sequence_parallel=sp)
        planner_reason = CostModel(Workload(model, 1, "bf16"), A100.view(tp)).invalid_reason(layout)
        if problem:
            with pytest.raises(ConfigError) as from_config:
                load(None, args)
            with pytest.raises(ConfigError) as from_check_tp:
                check_tp(model, tp, sp)
            assert str(from_config.value) == str(from_check_tp.value) == planner_reason == problem
        else:
            assert load(None, args).parallel.tp == tp
            check_tp(model, tp, sp)
            # The planner adds one rule of its own: sequence parallelism at tp=1 only duplicates a layout.
            assert (planner_reason == "") == (tp > 1 or not sp), planner_reason


def test_search_prunes_exactly_the_tp_degrees_the_rule_rejects():
    for model in models():
        # 24 GPUs: tp 1..8 fit a node of 8 and divide 24; pp=1 always leaves a valid dp for batch 24.
        space = build_space(CostModel(Workload(model, 24, "bf16"), A100.view(24)))
        kept = {tp for tp, _ in space.tp_pp}
        for tp in TPS:
            problem = tensor_parallel_problem(model, tp)
            assert (tp not in kept and space.pruned[problem] == 1) if problem else tp in kept


def test_a_fixed_tp_the_rule_rejects_is_refused_with_its_reason():
    model = models()[0]
    problem = tensor_parallel_problem(model, 3)
    assert "model.num_attention_heads=8" in problem
    with pytest.raises(ConfigError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        build_space(CostModel(Workload(model, 24, "bf16"), A100.view(24)), {"tp": 3})


@pytest.mark.parametrize("num_layers", (1, 2, 3, 4, 6))
def test_pipeline_rule_is_the_layer_split_and_every_consumer_reports_it(num_layers):
    model = ModelConfig(arch="llama", num_layers=num_layers, hidden_size=64, num_attention_heads=8,
                        vocab_size=96, seq_length=32)  # fmt: skip
    for pp, v, schedule in itertools.product((1, 2, 3, 4), (1, 2, 3), SCHEDULES):
        problem = pipeline_problem(num_layers, pp, v, schedule)
        split_problem = pipeline_problem(num_layers, pp * v)
        # The layer rule is exactly "partition_layers finds a non-empty contiguous range per chunk".
        if split_problem:
            with pytest.raises(ConfigError) as from_split:
                partition_layers(num_layers, pp * v)
            assert str(from_split.value) == split_problem
        else:
            ranges = partition_layers(num_layers, pp * v)
            assert all(len(r) for r in ranges) and [i for r in ranges for i in r] == list(range(num_layers))
        assert bool(split_problem) == (pp * v > num_layers) and (
            not split_problem or problem == split_problem
        )
        args = [*overrides(model), f"parallel.pp={pp}", f"parallel.virtual_stages={v}",
                f"parallel.schedule={schedule}"]  # fmt: skip
        cost = CostModel(Workload(model, 4 * pp, "bf16"), A100.view(pp))
        planner_reason = cost.invalid_reason(
            Layout(pp=pp, micro_batch=1, virtual_stages=v, schedule=schedule)
        )
        if problem:
            with pytest.raises(ConfigError) as from_config:
                load(None, args)
            assert str(from_config.value) == planner_reason == problem
        else:
            assert load(None, args).parallel.pp == pp
            assert planner_reason in ("", "pp=1 runs no pipeline schedule (use 1f1b)")


@pytest.mark.parametrize(
    "changes,tp,sp,field,fix",
    [
        ({"hidden_size": 96, "num_attention_heads": 12, "num_kv_heads": 4}, 5, False,
         "model.num_attention_heads=12", "choose a tp among its divisors"),
        ({"hidden_size": 96, "num_attention_heads": 12, "num_kv_heads": 4}, 6, False,
         "model.num_kv_heads=4", "change tp or num_kv_heads"),
        ({"vocab_size": 98}, 4, False, "model.vocab_size=98", "pad the vocabulary to a multiple of tp"),
        ({"ffn_hidden_size": 90}, 4, False, "model.ffn_hidden_size=90", "make it a multiple of tp"),
        ({"seq_length": 30}, 4, True, "model.seq_length=30", "set parallel.sequence_parallel=false"),
    ],
)  # fmt: skip
def test_messages_name_the_field_and_the_fix(changes, tp, sp, field, fix):
    model = replace(ModelConfig(arch="llama", hidden_size=64, num_attention_heads=8, vocab_size=96,
                                ffn_hidden_size=128, seq_length=32), **changes)  # fmt: skip
    problem = tensor_parallel_problem(model, tp, sp)
    assert field in problem and fix in problem and f"parallel.tp={tp}" in problem
    assert tensor_parallel_problem(model, 1, sp) == ""


def test_pipeline_messages_name_the_field_and_the_fix():
    assert "every model chunk needs at least one layer" in pipeline_problem(4, 4, 2)
    assert "set virtual_stages=1 or change the schedule" in pipeline_problem(8, 2, 2, "1f1b")
    assert "needs parallel.pp > 1" in pipeline_problem(8, 1, 1, "interleaved_1f1b")
    assert pipeline_problem(8, 0) == "parallel.pp must be at least 1; got 0"
    assert tensor_parallel_problem(ModelConfig(), 0) == "parallel.tp must be at least 1; got 0"


def test_the_rules_module_needs_no_torch():
    code = "import sys, llmtrain.config.validate; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.slow  # importing megatron-core takes seconds
def test_rule_agrees_with_megatron_core():
    from megatron.core.tensor_parallel.utils import VocabUtility
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.utils import divide

    def megatron_accepts(model: ModelConfig, tp: int, sp: bool) -> bool:
        try:
            TransformerConfig(num_layers=model.num_layers, hidden_size=model.hidden_size,
                              num_attention_heads=model.num_attention_heads, num_query_groups=model.kv_heads,
                              ffn_hidden_size=model.ffn_size, tensor_model_parallel_size=tp)  # fmt: skip
            VocabUtility.vocab_range_from_global_vocab_size(model.vocab_size, 0, tp)  # VocabParallelEmbedding
            divide(model.ffn_size, tp)  # ColumnParallelLinear's output partition
            if sp:
                divide(model.seq_length, tp)  # scatter_to_sequence_parallel_region's split
        except (ValueError, AssertionError) as err:
            assert "tensor_model_parallel_size" in str(err) or "is not divisible by" in str(err), err
            return False
        return True

    for model in models():
        for tp, sp in itertools.product((1, 2, 3, 4, 6, 8, 12, 16), (False, True)):
            ours = tensor_parallel_problem(model, tp, sp)
            assert (ours == "") == megatron_accepts(model, tp, sp), f"{model} tp={tp} sp={sp}: {ours!r}"
