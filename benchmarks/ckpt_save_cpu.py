"""What one trainer checkpoint save costs on this host, and how much of it is the checksums.

A stack of wide linear layers (no decoder: only the bytes matter) with AdamW state, saved by the trainer's own
``CheckpointManager`` on a one-rank gloo group, ``--saves`` times into a run directory under ``--dir`` (keep 1). The
checksum part is timed alone too: a CRC-32 of every file the rank wrote, read back as the save did before checksums
were taken from the bytes on their way to ``write()``.

    uv run python benchmarks/ckpt_save_cpu.py [--width 2048] [--layers 8] [--saves 3] [--async] [--label NAME]

Adds a record to ``benchmarks/results/ckpt_save_cpu.json``: checkpoint bytes, every save's wall time and its median,
and the median time to read the files back for a CRC. With ``--async`` (``ckpt.save_async``) a save's time is what
the training thread spends on it: ``save()`` (staging the copy) plus ``wait()`` once the background write is done
(finalizing: checksums, index, rename).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from provenance import add_record, tree_commit

ROOT = Path(__file__).resolve().parents[1]


def read_back_crc(root: Path) -> float:
    """Seconds to read every file of a checkpoint and CRC it (what each save cost before)."""
    start = time.perf_counter()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        crc = 0
        with open(f, "rb") as stream:
            while chunk := stream.read(1 << 24):
                crc = zlib.crc32(chunk, crc)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--async", dest="save_async", action="store_true")
    p.add_argument("--dir", type=Path, default=None, help="parent of the run directory (default: the temp dir)")
    p.add_argument("--label", default=None)
    p.add_argument("--commit", default=os.environ.get("PRIME_COMMIT"), help="the commit measured (default: HEAD)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "ckpt_save_cpu.json")
    args = p.parse_args()

    from prime_core.config.shared import CheckpointConfig
    from prime_core.run_dir import RunDir
    from prime_trainer.ckpt import CheckpointManager
    from prime_trainer.world import World

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, args.width)).sum().backward()
    optimizer.step()
    world = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        config = CheckpointConfig(interval=1, keep=1, save_async=args.save_async)
        manager = CheckpointManager(config, RunDir(Path(tmp)), world)
        walls, reads, size = [], [], 0
        for step in range(1, args.saves + 1):
            start = time.perf_counter()
            manager.save(step, model, optimizer, {"data_step": step})
            wall = time.perf_counter() - start
            if args.save_async:
                while not manager._pending[0].done():
                    time.sleep(0.01)
                start = time.perf_counter()
                manager.wait()
                wall += time.perf_counter() - start
            walls.append(wall)
            ckpt = manager.run_dir.trainer_checkpoint(step)
            size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
            reads.append(read_back_crc(ckpt))
    dist.destroy_process_group()

    record = {"benchmark": "ckpt_save_cpu", "commit": tree_commit(args.commit), "host": platform.node(),
              "torch": torch.__version__, "save_async": args.save_async, "width": args.width, "layers": args.layers,
              "checkpoint_mb": round(size / 2**20, 1), "save_s": [round(w, 3) for w in walls],
              "save_median_s": round(statistics.median(walls), 3),
              "read_back_crc_median_s": round(statistics.median(reads), 3)}  # fmt: skip
    print(json.dumps(record))
    add_record(args.out, args.label, record)


if __name__ == "__main__":
    main()
