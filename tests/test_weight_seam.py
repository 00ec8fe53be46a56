"""The weight-transport seam holds: every transport is one module per side, chosen in one table per side, and no
code outside the transports (and prime-core's manifest schema) names a transport's files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prime_core.schemas.weights import ANNOUNCED, MANIFESTS, TRANSPORTS

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = (
    "prime-core/src/prime_core/schemas/weights.py",
    "prime-core/src/prime_core/schemas/adapters.py",
    "prime-trainer/src/prime_trainer/weights/",
    "prime-inference/src/prime_inference/weights/",
)


def test_every_transport_is_one_module_per_side():
    from prime_inference.weights import RECEIVERS
    from prime_trainer.weights import PUBLISHERS

    assert set(TRANSPORTS) == set(PUBLISHERS) == set(RECEIVERS)
    assert len(TRANSPORTS) == len(MANIFESTS)
    for name in TRANSPORTS:
        assert PUBLISHERS[name].__module__ == f"prime_trainer.weights.{name}"
        assert RECEIVERS[name].__module__ == f"prime_inference.weights.{name}"


def test_nothing_outside_the_transports_names_their_files():
    names = [m.file for m in ANNOUNCED] + ["BROADCAST_FILE", "ADAPTER_INFO"]
    pattern = re.compile("|".join(re.escape(n) for n in names))
    offenders = []
    for path in sorted((ROOT / "packages").glob("*/src/**/*.py")):
        rel = path.relative_to(ROOT / "packages").as_posix()
        if rel.startswith(ALLOWED):
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{rel}:{lineno}: {line.strip()}")
    assert not offenders, "read a weight_dir through prime_core.schemas.weights.read_manifest:\n" + "\n".join(offenders)


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda m: m.__name__)
def test_every_manifest_declares_its_file_and_retry_semantics(manifest):
    assert isinstance(manifest.repeatable, bool)
    assert manifest.file is None or manifest.file.endswith(".json")
    assert manifest.model_fields["type"].default in TRANSPORTS
