"""What checksumming a published weights file costs on this CPU (``weights/step_N/checksums.json``), per GiB.

One safetensors file of random bf16 tensors (``--mib``, default 512), written and summed ``--repeats`` times under
``--dir`` (default: the temp dir). Publish side: ``save_file`` alone (what the trainer wrote before), then the CRC-32
``save_hf`` now takes from the tensors in memory (`prime_models.checkpoint._written_crc32`), and for comparison a
CRC-32 read back from the file just written (page cache). Load side: `verify_weights` (a read of the file and a
CRC-32; the page cache is warm, a cold read adds the disk's time). Hash alternatives over the same bytes in memory:
zlib's CRC-32 and Adler-32, hashlib's md5, sha1, sha256, blake2b, and xxhash's xxh3_64 where it is installed.

    uv run python benchmarks/weights_checksum.py [--mib 512] [--repeats 3] [--label NAME]

Adds a record to ``benchmarks/results/weights_checksum.json`` (medians, seconds per GiB).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import torch
from provenance import add_record, tree_commit

ROOT = Path(__file__).resolve().parents[1]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def hashes(buffer: memoryview) -> dict:
    found = {
        "zlib.crc32": lambda: zlib.crc32(buffer),
        "zlib.adler32": lambda: zlib.adler32(buffer),
        **{f"hashlib.{n}": (lambda n=n: hashlib.new(n, buffer).digest()) for n in ("md5", "sha1", "sha256", "blake2b")},
    }
    try:
        import xxhash

        found["xxhash.xxh3_64"] = lambda: xxhash.xxh3_64(buffer).digest()
    except ImportError:
        pass
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None, help="where the file is written (default: the temp dir)")
    p.add_argument("--label", default=None)
    p.add_argument("--commit", default=os.environ.get("PRIME_COMMIT"), help="the commit measured (default: HEAD)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "weights_checksum.json")
    args = p.parse_args()

    from prime_core.schemas.weights import file_crc32
    from prime_models.checkpoint import _written_crc32
    from safetensors.torch import save_file

    torch.manual_seed(0)
    rows = 4096
    num = max(1, args.mib * 2**20 // (rows * 4096 * 2))
    tensors = {f"layers.{i}.weight": torch.randn(rows, 4096).to(torch.bfloat16) for i in range(num)}
    gib = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**30
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "model.safetensors"
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()]).numpy()
        buffer = memoryview(flat)
        for _ in range(args.repeats):
            steps = {
                "publish/save_file": lambda: save_file(tensors, str(path), metadata={"format": "pt"}),
                "publish/crc32_from_memory": lambda: _written_crc32(path, tensors),
                "publish/crc32_read_back": lambda: file_crc32(path),
                "load/verify_weights_warm": lambda: file_crc32(path),
            }
            steps.update({f"memory/{k}": v for k, v in hashes(buffer).items()})
            for name, fn in steps.items():
                times.setdefault(name, []).append(timed(fn) / gib)
        assert _written_crc32(path, tensors) == file_crc32(path)

    per_gib = {name: round(statistics.median(ts), 3) for name, ts in times.items()}
    record = {"benchmark": "weights_checksum", "commit": tree_commit(args.commit), "host": platform.node(),
              "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "gib": round(gib, 3),
              "repeats": args.repeats, "s_per_gib": per_gib,
              "publish_overhead": round(per_gib["publish/crc32_from_memory"] / per_gib["publish/save_file"], 3)}  # fmt: skip
    print(json.dumps(record, indent=1))
    add_record(args.out, args.label, record)


if __name__ == "__main__":
    main()
