"""Publish HF weights under ``weights/step_N`` (safetensors + config + tokenizer files, then STABLE).

Every rank takes part (FSDP parameters are gathered collectively); rank 0 writes. Old steps are deleted once no
reader can need them: the orchestrator samples step s with weights >= s - async_level, and a resume from
checkpoint N needs weights N - async_level .. N.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from pathlib import Path

import torch
from prime_core.config.trainer import WeightBroadcastConfig
from prime_core.io import atomic_dir, atomic_write_text
from prime_core.run_dir import RunDir
from prime_core.schemas.weights import BROADCAST_FILE
from prime_models import save_hf
from torch import nn

from prime_trainer.world import World, broadcast_object

logger = logging.getLogger("prime.trainer")

_TOKENIZER_FILES = re.compile(
    r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)|merges\.txt|chat_template\..*"
    r"|(video_)?preprocessor_config\.json|processor_config\.json)$"
)


def copy_tokenizer_files(src: str, dst: Path) -> None:
    """Copy tokenizer files of ``src`` (a directory, or a hub id resolved through transformers) into ``dst``."""
    src_path = Path(src).expanduser()
    if src_path.is_dir():
        for f in src_path.iterdir():
            if f.is_file() and _TOKENIZER_FILES.match(f.name):
                shutil.copy2(f, dst / f.name)
        return
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(src).save_pretrained(str(dst))
    except Exception as e:  # a missing tokenizer must not stop training; inference then needs --tokenizer
        logger.warning("could not copy tokenizer %s into %s: %s", src, dst, e)


class WeightPublisher:
    def __init__(
        self,
        run_dir: RunDir,
        world: World,
        tokenizer: str,
        async_level: int,
        keep_all: bool = False,
        broadcast: WeightBroadcastConfig | None = None,
    ):
        self.run_dir = run_dir
        self.world = world
        self.tokenizer = tokenizer
        self.async_level = async_level
        self.keep_all = keep_all
        # Ship bf16 from GPU runs (what inference serves); keep exact fp32 from CPU runs.
        self.dtype = torch.bfloat16 if world.device.type == "cuda" else None
        self.broadcaster = None
        if broadcast is not None and broadcast.type == "nccl":
            from prime_trainer.broadcast import WeightBroadcaster

            self.broadcaster = WeightBroadcaster(broadcast, world)
        self.last_timings: dict[str, float] = {}

    def publish(
        self, step: int, model: nn.Module, checkpoint_steps: list[int] = (), *, files: bool = True, send: bool = True
    ) -> Path:
        """Announce ``weights/step_N`` (STABLE) and deliver the weights; collective over the trainer's ranks.

        Filesystem mode writes safetensors every time. Broadcast mode writes ``broadcast.json`` and, when ``files``
        (checkpoint steps, the final step), safetensors too, then sends the tensors once inference joins; with
        ``send=False`` (initial weights, which inference loads from disk) it only writes files.
        """
        broadcasting = self.broadcaster is not None and send
        write_files = files or not broadcasting
        final = self.run_dir.weight_step(step)
        t0 = time.perf_counter()
        if self.world.is_master:
            with atomic_dir(final) as tmp:
                broadcast_object(str(tmp))
                if write_files:
                    save_hf(model, tmp, dtype=self.dtype)
                    copy_tokenizer_files(self.tokenizer, tmp)
                if broadcasting:
                    manifest = self.broadcaster.manifest(step)
                    atomic_write_text(tmp / BROADCAST_FILE, manifest.model_dump_json(indent=2) + "\n")
            self._cleanup(step, checkpoint_steps)
        else:
            tmp = broadcast_object(None)
            if write_files:
                save_hf(model, tmp, dtype=self.dtype)
        broadcast_object(None)  # nobody moves on before STABLE is written
        self.last_timings = {"files_s": time.perf_counter() - t0}
        if broadcasting:
            self.last_timings.update(self.broadcaster.send(model, self.dtype))
        return final

    def needed(self, latest: int, checkpoint_steps: list[int]) -> set[int]:
        keep = set(range(max(latest - self.async_level, 0), latest + 1))
        for n in checkpoint_steps:
            keep.update(range(max(n - self.async_level, 0), n + 1))
        return keep

    def _cleanup(self, latest: int, checkpoint_steps: list[int]) -> None:
        if self.keep_all or not self.run_dir.weights.is_dir():
            return
        keep = self.needed(latest, checkpoint_steps)
        for child in self.run_dir.weights.iterdir():
            m = re.fullmatch(r"step_(\d+)", child.name)
            if m and int(m.group(1)) not in keep and int(m.group(1)) < latest:
                shutil.rmtree(child, ignore_errors=True)
