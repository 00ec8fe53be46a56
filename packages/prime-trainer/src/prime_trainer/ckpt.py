"""DCP checkpoints: ``checkpoints/step_N/trainer/`` holds model + optimizer (sharded, loadable at another world
size), ``progress.json`` (step, schedule, data position), ``rng/rank_R.pt`` and ``checksums.json`` (CRC-32 of every
file, summed as it is written (``ckpt_sums``), checked against the disk before a resume loads anything).

Checkpoint N is the state after N optimizer steps (its model equals ``weights/step_N``); resuming from it trains
step N next. Frozen parameters are not saved: with LoRA a checkpoint holds the adapters and their optimizer state,
and resuming takes the base weights from ``model.name`` again, as the run that saved it did. The trainer part is
built under a temporary name and renamed into place, then ``trainer/STABLE`` and ``checkpoints/step_N/STABLE`` are
written (the orchestrator's part, ``step_N/orchestrator``, carries its own).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from prime_core.config import ConfigError
from prime_core.config.shared import CheckpointConfig
from prime_core.io import (
    LARGE_JSON_BYTES,
    SMALL_JSON_BYTES,
    STABLE_MARKER,
    UnreadableFile,
    atomic_write_json,
    file_crc32,
    first_line,
    is_stable,
    mark_stable,
    read_regular,
    remove_published,
    storage_error,
    writing,
)
from prime_core.run_dir import RunDir
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from prime_trainer.ckpt_safe import SafeLoadPlanner, SafeReader, load_rng_state, rng_state, set_rng_state
from prime_trainer.ckpt_sums import CrcFileSystemWriter
from prime_trainer.world import World

logger = logging.getLogger("prime.trainer")

PROGRESS_FILE = "progress.json"
CHECKSUMS_FILE = "checksums.json"
# Trainable parameters only. `dcp.load` still fails on any of them missing from a checkpoint; `strict=False` only lets
# `set_state_dict` accept a state without the frozen ones.
_TRAINABLE_OPTIONS = StateDictOptions(ignore_frozen_params=True)
_LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


class CheckpointManager:
    def __init__(self, config: CheckpointConfig, run_dir: RunDir, world: World, process: str = "trainer"):
        self.config = config
        self.process = process
        """``trainer`` or ``sft``: saved with each checkpoint, so that neither resumes the other's."""
        self.run_dir = run_dir
        self.world = world
        self._pending: tuple[Future, int, Path, dict, CrcFileSystemWriter] | None = None
        self.run_dirs: list[RunDir] = []
        """Multi-tenant runs' directories, whose orchestrators write their part of each checkpoint there."""
        # The background writer's collectives get a gloo group of their own: sharing one with the main thread's
        # collectives (training, poll, barriers) could interleave them differently on different ranks and hang.
        self._writer_pg = dist.new_group(backend="gloo") if config.save_async else None

    def due(self, step: int, max_steps: int) -> bool:
        """Save after ``step`` optimizer steps? Every ``interval`` steps and at the end, when an interval is set."""
        return self.config.interval is not None and (step % self.config.interval == 0 or step == max_steps)

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, progress: dict[str, Any]) -> None:
        self.wait()
        final = self.run_dir.trainer_checkpoint(step)
        tmp = final.parent / ".trainer.tmp"
        if self.world.is_master:
            # A link at the step's directory (planted, or copied with a run) would take the checkpoint outside the run.
            for link in (final.parent, tmp):
                if link.is_symlink():
                    link.unlink()
            shutil.rmtree(tmp, ignore_errors=True)
            with writing(f"checkpoint step {step}", final):
                tmp.mkdir(parents=True)
        dist.barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_TRAINABLE_OPTIONS)
        state = {"model": model_sd, "optim": optim_sd}
        # Every file goes through the writer, which sums the bytes as they are written: the save reads nothing back.
        writer = CrcFileSystemWriter(str(tmp))
        rng_file = self._rng_file(tmp, self.world.rank, mkdir=True)
        with writing(f"checkpoint step {step}", final), writer.fs.create_stream(rng_file, "wb") as stream:
            torch.save(rng_state(), stream)
        progress = {**progress, "step": step, "world_size": self.world.world_size, "process": self.process}
        if self.config.save_async:
            # The stager DCP picks without a writer given; the writer itself (a BlockingAsyncStager) would be picked.
            stager = DefaultStager(StagingOptions(False, False, False, False))
            future = dcp.async_save(
                state, checkpoint_id=str(tmp), storage_writer=writer, process_group=self._writer_pg, async_stager=stager
            )
            self._pending = (future, step, tmp, progress, writer)
        else:
            with writing(f"checkpoint step {step}", final):  # a full disk arrives in DCP's CheckpointException
                dcp.save(state, checkpoint_id=str(tmp), storage_writer=writer)
            self._finalize(step, tmp, progress, writer.checksums())

    def poll(self) -> None:
        """Finalize a background save once every rank's writer is done (one tiny collective per call)."""
        if self._pending is None:
            return
        done = torch.tensor([float(self._pending[0].done())], device=self.world.device)
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item() == 1.0:
            self.wait()

    def wait(self) -> None:
        if self._pending is None:
            return
        future, step, tmp, progress, writer = self._pending
        with writing(f"checkpoint step {step}", self.run_dir.trainer_checkpoint(step)):
            future.result()
        self._pending = None
        self._finalize(step, tmp, progress, writer.checksums())

    def _finalize(self, step: int, tmp: Path, progress: dict[str, Any], written: dict[str, str | None]) -> None:
        dist.barrier()
        # Each rank sums what it wrote, as it wrote it; a file the writer could not vouch for is read back (page
        # cache, mostly). Rank 0 keeps them all.
        sums = {}
        for f in self._own_files(tmp):
            name = str(f.relative_to(tmp))
            sums[name] = written.get(name) or file_crc32(f)
        every = [None] * self.world.world_size
        dist.all_gather_object(every, sums)
        if self.world.is_master:
            final = self.run_dir.trainer_checkpoint(step)
            with writing(f"checkpoint step {step}", final):
                atomic_write_json(tmp / CHECKSUMS_FILE, dict(sorted(kv for d in every for kv in d.items())))
                atomic_write_json(tmp / PROGRESS_FILE, progress)
                if final.exists():
                    remove_published(final)
                tmp.rename(final)
                mark_stable(final)
                mark_stable(final.parent)
            logger.info("saved checkpoint %s", final)
            self._cleanup()
        dist.barrier()

    def _cleanup(self) -> None:
        """Delete all but the newest ``keep`` checkpoints, the orchestrators' parts with the trainer's: a step that lost
        its trainer part can never be resumed, and each part left would add a directory per interval for ever."""
        if self.config.keep is None:
            return
        steps = self.saved_steps()
        for old in steps[: -self.config.keep]:
            step_dir = self.run_dir.checkpoint_step(old)
            # Markers first: a stop halfway leaves a step that reads as incomplete, never one that reads as resumable.
            # A linked step directory goes alone: its target is outside the run (remove_published).
            for marker in (step_dir / STABLE_MARKER, step_dir / "trainer" / STABLE_MARKER):
                if not step_dir.is_symlink():
                    marker.unlink(missing_ok=True)
            for run_dir in [self.run_dir, *self.run_dirs]:
                remove_published(run_dir.checkpoint_step(old))

    def protected_steps(self) -> list[int]:
        """Complete checkpoints plus one still being written in the background (weights they need are kept)."""
        return self.saved_steps() + ([self._pending[1]] if self._pending is not None else [])

    def saved_steps(self) -> list[int]:
        """Steps with a complete trainer checkpoint, ascending."""
        if not self.run_dir.checkpoints.is_dir():
            return []
        steps = []
        for child in self.run_dir.checkpoints.iterdir():
            if child.name.startswith("step_") and child.name[5:].isdigit() and is_stable(child / "trainer"):
                steps.append(int(child.name[5:]))
        return sorted(steps)

    def load(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Restore model, optimizer and this rank's RNG from checkpoint ``step``; return its progress dict."""
        path = self.run_dir.trainer_checkpoint(step)
        if not is_stable(path):
            have = ", ".join(map(str, self.saved_steps())) or "none"
            raise ValueError(f"no complete trainer checkpoint at {path} (complete checkpoints: {have})")
        with self._unreadable(step, path, PROGRESS_FILE):
            progress = json.loads(read_regular(path / PROGRESS_FILE, "a progress record", SMALL_JSON_BYTES))
            progress["step"], progress["world_size"] = int(progress["step"]), int(progress["world_size"])
            # A directory renamed or copied over another step's: resuming would train from a step no process expects.
            if progress["step"] != step:
                raise ValueError(f"records step {progress['step']}, not the step of its directory")
        with self._unreadable(step, path, ".metadata"):
            metadata = SafeReader(str(path)).read_metadata()
        self._check_sizes(step, path, metadata)
        self._check_sums(step, path)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_TRAINABLE_OPTIONS)
        if reason := _model_difference(metadata.state_dict_metadata, model_sd, lambda: get_model_state_dict(model)):
            raise ConfigError(f"checkpoint step {step} in {self.run_dir.root} {reason}")
        state = {"model": model_sd, "optim": optim_sd}
        with self._unreadable(step, path, "*.distcp"):
            dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner())
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_LOAD_OPTIONS
        )
        rng_file = self._rng_file(path, self.world.rank)
        if progress["world_size"] == self.world.world_size and rng_file.is_file():
            with self._unreadable(step, path, rng_file.relative_to(path)):
                set_rng_state(load_rng_state(rng_file))
        else:
            logger.warning("checkpoint %s was saved by %d ranks: RNG state not restored", path, progress["world_size"])
        logger.info("resumed from checkpoint %s (step %d)", path, step)
        return progress

    def _unreadable_line(self, step: int, path: Path, what: Any, why: str) -> str:
        earlier = [n for n in self.saved_steps() if n < step]
        hint = f"--ckpt.resume-step {earlier[-1]} resumes from the one before" if earlier else "no earlier checkpoint"
        return f"checkpoint step {step} does not load: {path}/{what}: {why} ({hint})"

    @contextmanager
    def _unreadable(self, step: int, path: Path, what: Any) -> Iterator[None]:
        """A file of a complete (STABLE) checkpoint that does not read back (cut short, corrupted, edited): one line
        naming it and the newest earlier checkpoint, never a resume from garbage. A failing disk stays an OSError."""
        try:
            yield
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            if storage_error(e) is not None:
                raise
            cause, named = _root_cause(e), f"{path}/{what}"
            # Errors that name the file themselves (`read_regular`'s, an OSError's filename): the line names it once.
            if isinstance(cause, UnreadableFile):
                why = str(cause).removeprefix(f"{named}: ")
            elif isinstance(cause, OSError) and cause.strerror and str(cause.filename) == named:
                why = cause.strerror
            else:
                why = first_line(cause)
            raise UnreadableFile(self._unreadable_line(step, path, what, why)) from e

    def _check_sizes(self, step: int, path: Path, metadata: Any) -> None:
        """Every data file the metadata points into must be at least as long as its last item: a file cut short
        names itself here (DCP would fail with a bare ``EOFError`` deep in unpickling)."""
        needed: dict[str, int] = {}
        for info in metadata.storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for name, size in sorted(needed.items()):
            have = (path / name).stat().st_size if (path / name).is_file() else None
            if have is None or have < size:
                why = "missing" if have is None else f"cut short: {have} bytes, its index needs {size}"
                raise UnreadableFile(self._unreadable_line(step, path, name, why))

    def _own_files(self, root: Path) -> list[Path]:
        """The files this rank wrote into a checkpoint: its DCP shards and RNG state (rank 0: also DCP's index)."""
        files = [*root.glob(f"__{self.world.rank}_*.distcp"), self._rng_file(root, self.world.rank)]
        if self.world.is_master:
            files.append(root / ".metadata")
        return sorted(f for f in files if f.is_file())

    def _check_sums(self, step: int, path: Path) -> None:
        """Every file of ``checksums.json`` (ranks share the reading) must hold what was saved: a changed byte would
        load as silently wrong weights. Checkpoints saved before checksums existed have none to check."""
        sums_file = path / CHECKSUMS_FILE
        if not sums_file.is_symlink() and not sums_file.exists():  # a FIFO there is not "none": it skipped the check
            return
        with self._unreadable(step, path, CHECKSUMS_FILE):
            sums = dict(json.loads(read_regular(sums_file, "a checkpoint's checksums", LARGE_JSON_BYTES)))
        mine = sorted(sums)[self.world.rank :: self.world.world_size]
        bad = [name for name in mine if not (path / name).is_file() or file_crc32(path / name) != sums[name]]
        every: list[Any] = [None] * self.world.world_size
        dist.all_gather_object(every, bad)
        bad = sorted(name for names in every for name in names)
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            why = f"not what was saved (its checksum differs){more}"
            raise UnreadableFile(self._unreadable_line(step, path, bad[0], why))

    @staticmethod
    def _rng_file(root: Path, rank: int, mkdir: bool = False) -> Path:
        if mkdir:
            (root / "rng").mkdir(parents=True, exist_ok=True)
        return root / "rng" / f"rank_{rank}.pt"


_ADAPTER = re.compile(r"\.(lora_[AB])\.([^.]+)\.")
"""An adapter weight's key names its adapter: ``...q_proj.lora_A.<name>.weight``."""


def _model_difference(
    saved: dict[str, Any], model_sd: dict[str, Any], every_weight: Callable[[], dict[str, Any]]
) -> str | None:
    """How the trainable weights a checkpoint holds differ from the model's, in words (a LoRA setting that changed
    since a checkpoint that predates its record in progress.json, a model with fewer layers), or None. DCP would say
    "Missing key" at the end, or nothing at all. ``every_weight()``: the model's state, frozen weights too."""
    # Non-tensor entries (a module's extra state) carry no shape: their keys still count.
    ckpt = {k.removeprefix("model."): tuple(getattr(v, "size", ())) for k, v in saved.items() if k.startswith("model.")}
    model = {k: tuple(getattr(t, "shape", ())) for k, t in model_sd.items()}
    in_ckpt, in_model = any(_ADAPTER.search(k) for k in ckpt), any(_ADAPTER.search(k) for k in model)
    if in_model and not in_ckpt:
        return "holds no LoRA adapters (trained without model.lora) but this run sets model.lora"
    if in_ckpt and not in_model:
        return "holds LoRA adapters (trained with model.lora) but this run sets none"

    def by_module(weights: dict[str, tuple]) -> tuple[dict[str, tuple], set[str]]:
        names = {m.group(2) for k in weights if (m := _ADAPTER.search(k))}
        return {_ADAPTER.sub(r".\1.", k, count=1): v for k, v in weights.items()}, names

    (ckpt_mods, ckpt_names), (model_mods, model_names) = by_module(ckpt), by_module(model)
    if missing := sorted(set(model_mods) - set(ckpt_mods)):
        why = "model.lora.target_modules changed?" if ".lora_" in missing[0] else "other trainable parameters?"
        return f"has no {missing[0]} ({len(missing)} such weights: {why})"
    # DCP loads the keys the model asks for: other weights of a checkpoint (a vision tower since frozen) are no error.
    if extra := sorted(k for k in set(ckpt_mods) - set(model_mods) if ".lora_" in k):
        return f"holds {extra[0]}, which this model has not ({len(extra)} such: model.lora.target_modules changed?)"
    # ...but a weight the model has not even frozen is another model: a deeper one's checkpoint loaded the layers both
    # have and dropped the rest without a word.
    if (others := set(ckpt_mods) - set(model_mods)) and (unknown := sorted(others - set(every_weight()))):
        return (f"holds {unknown[0]}, which this model has not ({len(unknown)} such weights: model.name or its "
                "config (num_hidden_layers?) changed since?)")  # fmt: skip
    for key, shape in model_mods.items():
        if ckpt_mods[key] != shape:
            what = " (model.lora.rank changed?)" if ".lora_" in key else ""
            return f"holds {key} of shape {list(ckpt_mods[key])}, this model {list(shape)}{what}"
    if model_names - ckpt_names:  # fewer (a tenant dropped) loads: DCP reads what the model asks for
        return (f"holds the adapters {sorted(ckpt_names)}, this run {sorted(model_names)} (model.lora.name, runs, or "
                "the default name r<rank>-a<alpha>)")  # fmt: skip
    return None


def _root_cause(e: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's ``CheckpointException`` (``failures``: rank -> exception)."""
    for failure in getattr(e, "failures", {}).values():
        return failure[0] if isinstance(failure, tuple) else failure
    return e
