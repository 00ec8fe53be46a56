"""Weight transports, trainer side: how each step's weights reach inference.

`build_publisher` is the one place the configuration chooses a transport; `PUBLISHERS` maps the transport's name
(the ``type`` of its manifest in `prime_core.schemas.weights`) to its `WeightPublisher`, one module per transport
here, its inference side in ``prime_inference.weights``.
"""

from __future__ import annotations

from prime_core.config.trainer import SFTConfig, TrainerConfig
from prime_core.run_dir import RunDir

from prime_trainer.weights.adapter import AdapterPublisher
from prime_trainer.weights.base import WeightPublisher
from prime_trainer.weights.broadcast import BroadcastPublisher
from prime_trainer.weights.cuda_ipc import CudaIpcPublisher
from prime_trainer.weights.filesystem import FilesystemPublisher
from prime_trainer.world import World

PUBLISHERS: dict[str, type[WeightPublisher]] = {
    "filesystem": FilesystemPublisher,
    "broadcast": BroadcastPublisher,
    "adapter": AdapterPublisher,
    "cuda_ipc": CudaIpcPublisher,
}


def transport_name(config: TrainerConfig | SFTConfig, process: str, adapter: str | None) -> str:
    """The transport that publishes: the RL trainer's ``weights.broadcast.type``, else files; a LoRA run's adapter
    goes as files (``adapter``) unless through GPU memory (``cuda_ipc``)."""
    if process != "trainer":
        return "adapter" if adapter is not None else "filesystem"
    if adapter is not None:
        return "cuda_ipc" if config.weights.broadcast.type == "cuda_ipc" else "adapter"
    return {"filesystem": "filesystem", "nccl": "broadcast", "cuda_ipc": "cuda_ipc"}[config.weights.broadcast.type]


def build_publisher(
    config: TrainerConfig | SFTConfig,
    process: str,
    run_dir: RunDir,
    world: World,
    *,
    tokenizer: str,
    adapter: str | None = None,
) -> WeightPublisher:
    """The weight publisher of ``process`` ("trainer" or "sft") writing to ``run_dir``; ``adapter``: publish that
    LoRA adapter instead of full weights (default: ``model.lora``'s adapter in a LoRA run)."""
    if adapter is None and config.model.lora is not None:
        adapter = config.model.lora.adapter_name
    # SFT exports are few and each is a result; RL keeps only what the async window and checkpoints need.
    keep_all = config.weights.keep_all or process == "sft"
    publisher = PUBLISHERS[transport_name(config, process, adapter)]
    return publisher.build(run_dir, world, config, keep_all=keep_all, tokenizer=tokenizer, adapter=adapter)
