"""The cost model against Megatron-LM's published A100 throughput (Narayanan et al. 2021, Table 1).

The table ships inside the package (llmtrain/planner/data/), so these tests need nothing outside the clone.
"""

import pytest

from llmtrain.config.errors import ConfigError
from llmtrain.planner.cluster.files import load_cluster, preset_names
from llmtrain.planner.cost.flops import num_parameters
from llmtrain.planner.validation.published import (
    CITES_TABLE,
    REFERENCE,
    format_results,
    gpt_model,
    load_reference,
    provenance,
    summary,
    validate_megatron,
)

A100_DENSE_PEAK_TFLOPS = 312.0


def test_the_packaged_table_names_its_source_and_has_every_row():
    header = REFERENCE.read_text().splitlines()[:5]
    assert any("Narayanan et al., SC21" in line and "Table 1" in line for line in header)
    rows = load_reference()
    assert [int(r["gpus"]) for r in rows] == [32, 64, 128, 256, 512, 1024, 1536, 1920, 2520, 3072]


def test_the_table_agrees_with_itself_column_by_column():
    # Three columns the paper computed independently of our transcription of the others. Each printed value
    # is rounded: parameters to 0.1B, TFLOP/s per GPU to 1, aggregate PFLOP/s to 0.1, % of peak to 1.
    for row in load_reference():
        assert round(num_parameters(gpt_model(row)) / 1e9, 1) == row["params_b"], row
        per_gpu = row["aggregate_pflops"] * 1e3 / row["gpus"]
        spread = 0.05e3 / row["gpus"]  # half a unit of the aggregate's last digit, per GPU
        assert abs(per_gpu - row["tflops_per_gpu"]) <= 0.5 + spread, row
        percent = 100 * per_gpu / A100_DENSE_PEAK_TFLOPS
        assert abs(percent - row["pct_of_peak"]) <= 0.5 + 100 * spread / A100_DENSE_PEAK_TFLOPS, row


def test_a_missing_or_malformed_reference_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="nope.csv does not exist; pass a CSV with the columns of"):
        load_reference(tmp_path / "nope.csv")
    bad = tmp_path / "bad.csv"
    bad.write_text("params_b,heads,hidden\n1.7,24,2304\n")
    with pytest.raises(ConfigError, match="lacks the column"):
        load_reference(bad)
    text = REFERENCE.read_text()
    bad.write_text(text.replace("1.7,24,2304", "1.7,twenty-four,2304"))
    with pytest.raises(ConfigError, match="data row 1 is not all numbers"):
        load_reference(bad)


@pytest.mark.slow
def test_published_megatron_runs_are_predicted_within_target():
    results = validate_megatron("a100-80gb")
    s = summary(results)
    assert len(results) == 10
    assert s["median_abs_error"] <= 0.05
    assert s["max_abs_error"] <= 0.10
    assert s["min_best_speedup"] >= 1.0  # the planner's own choice is never predicted slower


def test_a_stated_micro_batch_is_fixed_and_a_blank_one_left_to_the_planner(tmp_path):
    lines = [line for line in REFERENCE.read_text().splitlines() if not line.startswith("#")]
    table = tmp_path / "stated.csv"
    # The first row states micro-batch 2, the second leaves it blank; the other rows are dropped.
    table.write_text(f"{lines[0]},micro_batch\n{lines[1]},2\n{lines[2]},\n")
    rows = load_reference(table)
    assert rows[0]["micro_batch"] == 2 and "micro_batch" not in rows[1]
    results = validate_megatron("a100-80gb", table)
    assert results[0].published.layout.micro_batch == 2
    assert "fixed from the table in 1 of 2 rows" in format_results(results)


def test_no_shipped_constant_is_set_from_the_validation_table():
    for preset in preset_names():
        cluster = load_cluster(preset)
        assert cluster.unsourced() == [], preset
        assert not [k for k, v in cluster.sources.items() if any(c in v for c in CITES_TABLE)], preset
    assert "set from the validation table's rows: none" in provenance("a100-80gb")
