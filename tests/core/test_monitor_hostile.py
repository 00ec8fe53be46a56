"""Metric sinks against what a careless install or a long run hands them: W&B missing or broken, metric values that
are not plain Python numbers."""

from __future__ import annotations

import sys

import pytest
from prime_core.config.shared import MonitorConfig
from prime_core.monitor import MonitorUnavailable, build_monitor


@pytest.mark.parametrize("broken", [None, "raises"])
def test_wandb_missing_or_broken_is_one_line_naming_the_setting(tmp_path, monkeypatch, broken):
    """``monitor.wandb.enabled`` without an importable wandb was an ImportError traceback, after the model was built;
    a wandb whose own import fails (a protobuf it does not support) was its traceback."""
    if broken is None:
        monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    else:
        monkeypatch.setattr("builtins.__import__", _import_raising("wandb", TypeError("Descriptors cannot be created")))
    config = MonitorConfig.model_validate({"wandb": {"enabled": True, "offline": True}})
    with pytest.raises(MonitorUnavailable) as e:
        build_monitor(config, output_dir=tmp_path, process="trainer")
    (line,) = str(e.value).splitlines()
    assert "monitor.wandb.enabled" in line and "wandb" in line


def _import_raising(name: str, error: Exception):
    real = __import__

    def fake(module, *args, **kwargs):
        if module == name:
            raise error
        return real(module, *args, **kwargs)

    return fake
