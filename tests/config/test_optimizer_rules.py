"""train.optimizer and the train.muon_* fields: each impossible value refused in one line naming the field."""

import pytest

from llmtrain.config import ConfigError, load


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.muon_ns_steps=100"], "train.muon_ns_steps must be 1 to 99"),
        (["train.muon_ns_steps=0"], "train.muon_ns_steps must be 1 to 99"),
        (["train.muon_ns_coefficients=[3.4,-4.7]"], "train.muon_ns_coefficients must be three numbers"),
        (["train.muon_momentum=1.0"], "train.muon_momentum must be in [0, 1)"),
        (["train.muon_lr=0"], "train.muon_lr must be positive or null"),
        (["train.muon_adjust_lr=rms"], "train.muon_adjust_lr must be one of match_rms_adamw, original"),
        (
            ["parallel.engine=deepspeed", "parallel.zero_stage=1"],
            "train.optimizer=muon runs on parallel.engine=llmtrain",
        ),
    ],
)
def test_bad_muon_fields_name_the_field(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(None, ["train.optimizer=muon", *overrides])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_negative_ns_coefficients_are_allowed() -> None:
    job = load(None, ["train.optimizer=muon", "train.muon_ns_coefficients=[3.4445,-4.775,2.0315]"])
    assert job.train.muon_ns_coefficients[1] < 0
