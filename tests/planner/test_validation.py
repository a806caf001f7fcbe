"""The cost model against Megatron-LM's published A100 throughput (Narayanan et al. 2021, Table 1).

The table ships inside the package (llmtrain/planner/data/), so these tests need nothing outside the clone.
"""

import pytest

from llmtrain.config.errors import ConfigError
from llmtrain.planner.flops import num_parameters
from llmtrain.planner.validation import REFERENCE, gpt_model, load_reference, summary, validate_megatron

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
