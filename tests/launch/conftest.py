import os
import stat
import sys
from pathlib import Path

import pytest

from tests.launch.launch_fakes import HERE


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    """A directory with fake trainer/orchestrator/inference executables (see fake_process.py)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    source = (HERE / "fake_process.py").read_text()
    for name in ("trainer", "orchestrator", "inference"):
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{source}")
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return bin_dir


@pytest.fixture
def fake_hf_cache(tmp_path: Path) -> Path:
    """A hub cache holding a snapshot of ``tiny-model`` (the fakes never read it; the config check wants it)."""
    cache = tmp_path / "hf-cache"
    (cache / "models--tiny-model" / "snapshots" / "0").mkdir(parents=True)
    return cache


@pytest.fixture
def rl_env(fake_bin: Path, fake_hf_cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_")}
    env["PRIME_LAUNCH_BIN_DIR"] = str(fake_bin)
    env["HF_HUB_CACHE"] = str(fake_hf_cache)
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env
