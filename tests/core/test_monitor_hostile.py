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


def test_numpy_and_tensor_scalars_reach_wandb_as_they_reach_metrics_jsonl(tmp_path):
    """metrics.jsonl took a NumPy or torch scalar (``.item()``); W&B's filter (``int | float``) dropped them silently:
    a metric such as ``np.float32`` loss or an ``np.int64`` count was in the file and missing from the dashboard."""
    import numpy as np
    import torch
    from prime_core.monitor import JsonlMonitor, WandbMonitor, read_metrics

    logged = []

    class Run:
        def log(self, values, step):
            logged.append((step, values))

    wandb = object.__new__(WandbMonitor)
    wandb._run, wandb._failed = Run(), False
    values = {"a": np.float32(0.5), "b": np.int64(3), "c": torch.tensor(2.0), "d": 1.5, "e": "text", "f": True}
    wandb.log(7, values)
    jsonl = JsonlMonitor(tmp_path / "metrics.jsonl", "trainer")
    jsonl.log(7, values)
    assert logged == [(7, {"a": 0.5, "b": 3, "c": 2.0, "d": 1.5, "f": True})]
    numeric = {k: v for k, v in read_metrics(tmp_path / "metrics.jsonl")[0].values.items() if k != "e"}
    assert numeric == logged[0][1]
