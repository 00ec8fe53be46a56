"""Two environments of one name are refused in one line naming the field, in every list of them: two eval
environments of one name shared one pool (``Orchestrator.eval_pools``, keyed by name: the second replaced the first)
and one set of ``eval/<name>/...`` metrics. Training environments were checked already."""

from __future__ import annotations

import pytest
from prime_core.config.orchestrator import EvalConfig, OrchestratorConfig
from pydantic import ValidationError

TWICE = "environment names must be unique, 'reverse-text' is given twice (set `name` on one of them)"


@pytest.mark.parametrize(
    ("model", "data", "field"),
    [
        (OrchestratorConfig, {"env": [{"id": "a"}], "eval": {"envs": [{"id": "reverse-text"}] * 2}}, "eval.envs"),
        (EvalConfig, {"env": [{"id": "reverse-text"}, {"id": "reverse-text"}]}, "env"),
    ],
)
def test_an_environment_name_given_twice_is_refused_naming_the_field(model, data, field):
    with pytest.raises(ValidationError) as e:
        model.model_validate(data)
    (error,) = e.value.errors()
    assert ".".join(map(str, error["loc"])) == field and TWICE in error["msg"]


def test_the_same_environment_under_two_names_is_two_environments():
    config = OrchestratorConfig.model_validate(
        {"env": [{"id": "a"}], "eval": {"envs": [{"id": "reverse-text"}, {"id": "reverse-text", "name": "rt-hard"}]}}
    )
    assert [e.resolved_name for e in config.eval.envs] == ["reverse-text", "rt-hard"]
