"""`load_model`: HF directory or config -> our model, with real or random weights."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from prime_core.config import ConfigError
from prime_core.io import LARGE_JSON_BYTES, UnreadableFile, read_json
from torch.overrides import TorchFunctionMode

from prime_models import kernels
from prime_models.layers import flash_attn4
from prime_models.models.common_converting import EMBED, LM_HEAD
from prime_models.models.transformer import CausalLM
from prime_models.registry import get_model_spec
from prime_models.tensor_files import read_safetensors

logger = logging.getLogger(__name__)

ATTN_CHOICES = ("sdpa", "flash_attn", "flash_attn4", "auto")
INDEX_FILE = "model.safetensors.index.json"
GIB = 1024**3


class ModelTooLarge(ConfigError):
    """A config whose weights alone exceed the memory of the device they are built on (``vocab_size: 10**12`` in a
    downloaded config.json): refused before anything is allocated, not an allocator's traceback or the host's OOM
    killer once the pages are touched."""


_INITIALIZERS = frozenset(
    getattr(torch.nn.init, name)
    for name in (
        "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
        "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
    )
    if hasattr(torch.nn.init, name)
)  # fmt: skip


class _SkipInitializers(TorchFunctionMode):
    """Skips `torch.nn.init` initializers while a model is built on the meta device, where they compute nothing. The
    random ones (`normal_`) run a Python meta kernel whose first call imports dynamo and sympy: seconds of start-up in
    every trainer and inference process. The weights are loaded or initialized after `to_empty`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INITIALIZERS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


FA4_AUTO_MIN_ROW = 32768
"""``auto`` picks FlashAttention-4 (where installed, on Hopper or newer) for rows at least this long. Measured on an
H200 (docs/benchmarks.md, trainer_gpu_h200_capped.json): one 64k row trains 8-9% faster than with SDPA's cuDNN
kernel (19.3k against 17.8k tok/s under a 16 GiB cap, 20.1k against 18.5k on the whole GPU), one 32k row 7% faster
(34.3k against 31.9k), one 16k row even, and 2048-token rows one a forward 24% slower (FA4's Python launch costs
~0.1-0.3 ms a call, which short rows do not hide)."""


def resolve_attn(attn: str, device: torch.device, row_len: int | None = None) -> str:
    """Map the user's choice to a backend. "auto" on CUDA: FlashAttention-4 for rows of `FA4_AUTO_MIN_ROW` tokens or
    more where it is installed and the GPU is Hopper or newer; else flash-attn (FlashAttention-2) when installed; else
    SDPA, saying so. ``row_len`` is the longest row a forward sees (unknown: never FA4)."""
    if attn not in ATTN_CHOICES:
        raise ValueError(f"unknown attn {attn!r}; choose one of {ATTN_CHOICES}")
    if attn == "sdpa":
        return "sdpa"
    installed = {"flash_attn": kernels.HAS_FLASH_ATTN, "flash_attn4": kernels.HAS_FLASH_ATTN4}
    hints = {"flash_attn": kernels.FLASH_ATTN_INSTALL_HINT, "flash_attn4": kernels.FLASH_ATTN4_INSTALL_HINT}
    if attn in installed:
        if not installed[attn]:
            raise ValueError(f"attn={attn!r} needs a package that is not installed: {hints[attn]}")
        if device.type != "cuda":
            raise ValueError(f"attn={attn!r} needs a CUDA device, got {device}")
        if attn == "flash_attn4" and (broken := _flash_attn4_import_error()):
            raise ValueError(f"attn='flash_attn4': flash-attn-4 is installed but does not import ({broken})")
        return attn
    long_rows = (row_len or 0) >= FA4_AUTO_MIN_ROW
    if (
        device.type == "cuda"
        and kernels.HAS_FLASH_ATTN4
        and long_rows
        and torch.cuda.get_device_capability(device)[0] >= 9
    ):
        # Installed is not importable (its CuTe-DSL runtime is a separate wheel): a broken install costs speed here,
        # not the run, which would otherwise fail at its first forward.
        if (broken := _flash_attn4_import_error()) is None:
            logger.info("attn='auto': FlashAttention-4 for rows of %d tokens", row_len)
            return "flash_attn4"
        logger.warning("attn='auto': flash-attn-4 is installed but does not import (%s); not using it", broken)
    if device.type != "cuda":  # SDPA is the only kernel off a GPU: nothing to install, nothing to warn about
        return "sdpa"
    if kernels.HAS_FLASH_ATTN:
        return "flash_attn"
    reason = "not installed"
    logger.warning("attn='auto': flash-attn %s, falling back to SDPA (%s)", reason, kernels.FLASH_ATTN_INSTALL_HINT)
    return "sdpa"


def _flash_attn4_import_error() -> str | None:
    """None when FlashAttention-4's interface imports (cached: once a process), else why not, in one line."""
    try:
        flash_attn4.interface()
    except Exception as e:  # ImportError, or whatever its own import raises (a CUDA or DSL version it rejects)
        return f"{type(e).__name__}: {next(iter(str(e).splitlines()), '')}"
    return None


def resolve_config(path_or_config: Any) -> tuple[Any, Path | None]:
    """Return (HF config object, checkpoint dir or None) for a dir, a config.json path, a dict or an HF config."""
    ckpt_dir = None
    if isinstance(path_or_config, str | Path):
        path = Path(path_or_config)
        if path.is_dir():
            ckpt_dir, path = path, path / "config.json"
        if not path.is_file():
            raise ValueError(f"no config.json at {path}")
        config_dict = read_json(path, "a model config")
        if not isinstance(config_dict, dict):
            raise UnreadableFile(f"{path}: not a model config (a JSON object)")
    elif isinstance(path_or_config, dict):
        config_dict = dict(path_or_config)
    elif hasattr(path_or_config, "model_type") and hasattr(path_or_config, "to_dict"):
        get_model_spec(path_or_config.model_type)
        return path_or_config, None
    else:
        raise ValueError(f"expected a directory, config.json path, dict or HF config, got {type(path_or_config)}")
    if "model_type" not in config_dict:
        raise ValueError("config has no 'model_type'")
    spec = get_model_spec(config_dict["model_type"])
    return spec.config_class.from_dict(config_dict), ckpt_dir


def checkpoint_files(ckpt_dir: Path) -> list[Path]:
    """Safetensors files of an HF dir: the index's shards, else model.safetensors, else every *.safetensors.

    A downloaded or shared directory is someone else's: the index may only name files beside it (a name such as
    ``../../other/model.safetensors`` would load weights from outside the directory), and each must be a regular
    file (a FIFO or device under a shard's name would block the loader for ever, or feed it without end)."""
    index = ckpt_dir / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index, "a checkpoint index", LARGE_JSON_BYTES)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise UnreadableFile(f"{index}: weight_map is not an object of tensor name -> file name")
        for name in sorted(set(weight_map.values())):
            if Path(name).name != name or name in ("", ".", ".."):
                raise UnreadableFile(f"{index}: weight_map names {name!r}, not a file in {ckpt_dir}")
        files = [ckpt_dir / name for name in sorted(set(weight_map.values()))]
    elif (ckpt_dir / "model.safetensors").exists():
        files = [ckpt_dir / "model.safetensors"]
    else:
        files = sorted(ckpt_dir.glob("*.safetensors"))
    for f in files:
        if not f.is_file():  # follows a symlink (a hub cache's snapshot links to its blobs): its target must be a file
            why = "missing" if not f.exists() else "not a regular file"
            raise UnreadableFile(f"{f}: {why}")
    return files


def read_checkpoint(files: list[Path], device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of ``files``; a name held by two of them is refused: which copy won would depend on the order the
    files are read in, and a shard added to a downloaded model could silently replace any weight."""
    state: dict[str, torch.Tensor] = {}
    owner: dict[str, Path] = {}
    for f in files:
        for name, tensor in read_safetensors(f, device).items():
            if name in owner:
                raise UnreadableFile(f"{f}: holds {name}, which {owner[name].name} holds too")
            state[name], owner[name] = tensor, f
    return state


def load_model(
    path_or_config: Any,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    attn: str = "sdpa",
    seed: int | None = None,
) -> CausalLM:
    """Build a model from an HF directory (config.json + safetensors, sharded or not) or from a config.

    Args:
        path_or_config: HF model dir, path to a config.json, a config dict with `model_type`, or an HF config object.
            Without safetensors files the weights are random (HF-style init).
        dtype: parameter dtype; default float32 (training master weights).
        device: target device; default CPU. "meta" returns an uninitialized model (e.g. to shard before loading).
        attn: "sdpa", "flash_attn" (needs the flash-attn extra and CUDA), "flash_attn4" (needs flash-attn-4 and
            CUDA) or "auto".
        seed: seeds the random init (ignored when weights are loaded).
    """
    hf_config, ckpt_dir = resolve_config(path_or_config)
    spec = get_model_spec(hf_config.model_type)
    device = torch.device(device) if device is not None else torch.device("cpu")
    dtype = dtype or torch.float32
    backend = resolve_attn(attn, device) if device.type != "meta" else ("sdpa" if attn == "auto" else attn)

    with torch.device("meta"), _SkipInitializers():
        model = spec.model_cls.from_config(hf_config, attn=backend)
    model.to(dtype=dtype)
    if device.type == "meta":
        return model
    check_fits(model, hf_config, device, str(ckpt_dir / "config.json") if ckpt_dir is not None else "model config")
    model.to_empty(device=device)
    # to_empty allocates per module, which unties a shared embedding/lm_head parameter.
    model.tie_weights()

    files = checkpoint_files(ckpt_dir) if ckpt_dir is not None else []
    if files:
        load_hf_state(model, read_checkpoint(files, device), source=str(ckpt_dir))
        gen_cfg = ckpt_dir / "generation_config.json"
        if gen_cfg.is_file():
            model.generation_config_dict = read_json(gen_cfg, "a generation config")
    else:
        generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        model.init_weights(generator)
    return model


def device_memory(device: torch.device) -> int:
    """Bytes of memory ``device`` has in all (a CUDA device's total, the host's physical memory for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(model: torch.nn.Module, hf_config: Any, device: torch.device, where: str) -> None:
    """Refuse a model (still on the meta device) whose parameters and buffers alone exceed ``device``'s memory."""
    tensors = [*model.parameters(), *model.buffers()]
    need = sum(t.numel() * t.element_size() for t in tensors)
    have = device_memory(device)
    if need > have:
        text = getattr(hf_config, "text_config", None) or hf_config
        sizes = ", ".join(
            f"{k}={getattr(text, k)}"
            for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
            if getattr(text, k, None) is not None
        )
        raise ModelTooLarge(
            f"{where}: the weights need {need / GIB:,.1f} GiB, more than the {have / GIB:,.1f} GiB of {device.type} "
            f"memory ({sizes})"
        )


def load_hf_state(model: CausalLM, hf_state: dict[str, torch.Tensor], *, source: str = "state dict") -> None:
    """Copy an HF-named state dict (every tensor of the model) into ``model``, converting names and layouts."""
    spec = get_model_spec(model.config.model_type)
    state = spec.from_hf(hf_state, model.args)
    if model.args.tie_word_embeddings and EMBED in state:
        state[LM_HEAD] = state[EMBED]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{source} does not match {spec.model_type}: missing={missing} unexpected={unexpected}")
    for module in model.modules():
        if hasattr(module, "inv_freq"):
            module.reset_parameters()
