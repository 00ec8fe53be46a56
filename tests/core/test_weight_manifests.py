"""What a ``weights/step_N`` announces: one typed manifest per transport, read only through prime-core."""

from __future__ import annotations

import json

import pytest
from prime_core.schemas.adapters import ADAPTER_CONFIG, ADAPTER_INFO, ADAPTER_WEIGHTS, AdapterInfo
from prime_core.schemas.weights import (
    BROADCAST_FILE,
    MAX_MANIFEST_BYTES,
    BroadcastManifest,
    FilesystemManifest,
    WeightUpdateRequest,
    parse_manifest,
    read_manifest,
    write_manifest,
)

BROADCAST = BroadcastManifest(step=3, host="127.0.0.1", port=29501, world_size=2, backend="gloo", timeout_s=5)


def test_each_transport_is_read_from_its_own_file(tmp_path):
    assert read_manifest(tmp_path) == FilesystemManifest()  # plain HF files, or a directory elsewhere
    write_manifest(tmp_path, BROADCAST)
    assert read_manifest(tmp_path) == BROADCAST
    # On disk the manifest keeps its pre-seam form: the file's name says the transport.
    assert "type" not in json.loads((tmp_path / BROADCAST_FILE).read_text())
    adapter_dir = tmp_path / "adapter"
    adapter_dir.mkdir()
    (adapter_dir / ADAPTER_INFO).write_text(json.dumps({"name": "tenant-a", "step": 2}))
    assert read_manifest(adapter_dir) == AdapterInfo(name="tenant-a", step=2)
    assert parse_manifest(BROADCAST.model_dump()) == BROADCAST  # across an RPC boundary


def test_retry_semantics_follow_the_manifest(tmp_path):
    """A one-time transfer is never re-asked for; ``source=filesystem`` falls back to the directory's own files."""
    write_manifest(tmp_path, BROADCAST)
    assert not read_manifest(tmp_path).repeatable
    assert read_manifest(tmp_path, "filesystem") == FilesystemManifest() and FilesystemManifest.repeatable
    assert AdapterInfo.repeatable
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / ADAPTER_INFO).write_text(json.dumps({"name": "a"}))
    assert read_manifest(tmp_path / "adapter", "filesystem").type == "adapter"  # an adapter is its directory


@pytest.mark.parametrize(
    "files,source,message",
    [
        ({BROADCAST_FILE: '{"step": 1, "port": 0}'}, "auto", "broadcast.json is not a valid broadcast manifest: host"),
        ({BROADCAST_FILE: "{"}, "auto", "is not a valid broadcast manifest: file: Invalid JSON"),
        ({BROADCAST_FILE: BROADCAST.model_dump_json(), ADAPTER_INFO: '{"name": "a"}'}, "auto", "several transports"),
        ({ADAPTER_CONFIG: "{}", ADAPTER_WEIGHTS: ""}, "auto", "without prime_adapter.json naming it"),
        ({}, "broadcast", "announces filesystem weights, not broadcast"),
        ({ADAPTER_INFO: '{"name": "bad name"}'}, "auto", "prime_adapter.json is not a valid adapter manifest: name"),
    ],
)
def test_bad_directories_are_one_line_errors_naming_the_file(tmp_path, files, source, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=message) as e:
        read_manifest(tmp_path, source)
    assert "\n" not in str(e.value)


def test_an_oversized_manifest_is_refused_before_parsing(tmp_path):
    with open(tmp_path / BROADCAST_FILE, "wb") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)
    with pytest.raises(ValueError, match=f"over {MAX_MANIFEST_BYTES} bytes, too large for a weight manifest"):
        read_manifest(tmp_path)


def test_update_request_source_names_a_transport():
    assert WeightUpdateRequest(weight_dir="/w", source="adapter").source == "adapter"
    with pytest.raises(ValueError, match="source must be auto or one of filesystem, broadcast, adapter"):
        WeightUpdateRequest(weight_dir="/w", source="nixl")
