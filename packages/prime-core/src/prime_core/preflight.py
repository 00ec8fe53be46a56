"""Checks of the world a resolved config points at, run before anything loads: a mistake costs one line
and milliseconds instead of a traceback after a model load or a minute of network retries.

- ``model.name``: a name that looks like a path must exist (a directory must hold ``config.json``); a hub id
  must be in the local HF cache or downloadable (not with ``HF_HUB_OFFLINE=1``, and huggingface.co must accept
  a connection).
- environment ids: an installed package (or a verifiers built-in taskset) must provide each one.
- ports: a server's port must be free before the server loads its model.
- the output directory of a process that writes one must take files (not read-only, not full, permitted).
- local files: a model directory's config.json must parse (and it and the JSON files transformers reads whole be
  regular files within a bound), a tokenizer path, an SFT dataset and the checkpoint
  ``ckpt.resume_step`` names must exist, and ``output_dir`` must not be a file.

Nothing here imports torch, transformers or verifiers.
"""

from __future__ import annotations

import difflib
import errno
import functools
import importlib.util
import json
import os
import re
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pydantic import BaseModel

from prime_core.config.base import clipped_repr, path_length_error

# huggingface_hub's repo id rule: ``name`` or ``namespace/name`` of these characters.
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
_TRUE = ("1", "true", "yes", "on")
_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
# A model directory: Hugging Face's config.json, or Mistral's params.json (vLLM reads that format too).
_MODEL_FILES = ("config.json", "params.json")
_TOKENIZER_FILES = ("vocab.json", "tekken.json", "spiece.model")


class PreflightError(ValueError):
    """A config value names something that is not there; the message is one line."""


# ---------------------------------------------------------------- model names


def hf_cache_dir(environ: dict[str, str] | None = None) -> Path:
    """The hub cache huggingface_hub uses (same variables, same order)."""
    env = os.environ if environ is None else environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    xdg = env.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def in_hf_cache(repo_id: str, environ: dict[str, str] | None = None) -> bool:
    """Whether some revision of the model ``repo_id`` has been downloaded."""
    snapshots = hf_cache_dir(environ) / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    return snapshots.is_dir() and any(snapshots.iterdir())


def _is_model_dir(path: Path) -> bool:
    return any((path / f).is_file() for f in _MODEL_FILES)


def _bad_model_config(path: Path) -> str | None:
    """Why an HF config.json cannot configure a model (transformers and our loader need ``model_type``), or None."""
    from prime_core.io import SMALL_JSON_BYTES, UnreadableFile, read_regular

    try:  # bounded, a regular file only: a config.json of gigabytes was read whole by each process before
        data = read_regular(path, "a model config", SMALL_JSON_BYTES)
    except UnreadableFile as e:
        return str(e)
    try:
        config = json.loads(data)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        return f"{str(path)!r} is not valid JSON ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        return f"{str(path)!r} has no model_type: not a Hugging Face model config"
    return None


# A model directory's JSON files that transformers and vLLM read whole, unbounded, in every process (the trainer's
# ranks, the orchestrator, the servers): checked here first. name -> what it is.
_READ_WHOLE = {
    "generation_config.json": "a generation config",
    "tokenizer_config.json": "a tokenizer config",
    "special_tokens_map.json": "a special tokens map",
    "preprocessor_config.json": "a preprocessor config",
    "tokenizer.json": "a tokenizer",
}


def _bad_model_file(path: Path) -> str | None:
    """Why a file of `_READ_WHOLE` in model directory ``path`` would hang or exhaust its readers (not a regular
    file: a FIFO blocks ``open``; over its bound: a 10 GiB file is read whole by each), or None."""
    from prime_core.io import LARGE_JSON_BYTES, SMALL_JSON_BYTES

    for name, what in _READ_WHOLE.items():
        try:
            st = os.stat(path / name)
        except OSError:  # missing (optional), or a broken link: the readers treat it as missing too
            continue
        limit = LARGE_JSON_BYTES if name == "tokenizer.json" else SMALL_JSON_BYTES
        if not stat.S_ISREG(st.st_mode):
            return f"{str(path / name)!r} is not a regular file: not {what}"
        if st.st_size > limit:
            return f"{path / name}: over {limit} bytes, too large for {what}"
    return None


def looks_like_path(name: str) -> bool:
    """A model name meant as a local directory: it starts with ``/``, ``.`` or ``~``, has more than one ``/``,
    is not a valid hub id, or its first part is a directory here (``examples/modle``). ``org/name`` and
    ``name`` are hub ids otherwise."""
    if name.startswith(("/", ".", "~")) or name.count("/") > 1 or not _HUB_ID.match(name):
        return True
    return "/" in name and Path(name.split("/", 1)[0]).is_dir()


def _hub_unreachable(environ: dict[str, str]) -> str | None:
    """Why the hub cannot be reached (a 3 s TCP connect), or None. Behind a proxy we cannot tell: None."""
    if any(environ.get(v) for v in _PROXY_VARS):
        return None
    url = urlparse(environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as e:
        return f"{host}:{port} is unreachable ({e.strerror or e})"
    return None


def _too_long_refused(check):
    """``check(text, ...)``, or why ``text`` cannot name a file at all: ``Path.exists`` raises on a name longer than
    the filesystem takes (ENAMETOOLONG) instead of answering, so the user got a traceback for a mistyped name."""

    @functools.wraps(check)
    def guarded(text: str, *args: Any, **kwargs: Any) -> str | None:
        if isinstance(text, str) and (why := path_length_error(text)):
            return f"{clipped_repr(text)} {why}"
        return check(text, *args, **kwargs)

    return guarded


@_too_long_refused
def check_model_name(name: str, *, network: bool = True, environ: dict[str, str] | None = None) -> str | None:
    """Why ``name`` cannot be loaded, or None. ``network``: also check that a hub id not yet downloaded can be."""
    env = dict(os.environ if environ is None else environ)
    path = Path(name).expanduser()
    if path.is_file():
        return f"{name!r} is a file, not a model directory (one holding config.json)"
    if (path / "config.json").is_file():
        return _bad_model_config(path / "config.json") or _bad_model_file(path)
    if (path / "config.json").exists():  # a FIFO or device: the launcher, trainer and servers would wait on it
        return f"{str(path / 'config.json')!r} is not a regular file: not a Hugging Face model config"
    if path.is_dir() and not _is_model_dir(path):
        inside = sorted(p.name for p in path.iterdir() if p.is_dir() and _is_model_dir(p))
        inside.sort(key=lambda sub: sub != "model")  # examples/<task>/model before the others
        hint = f" (did you mean {str(Path(name) / inside[0])!r}?)" if inside else ""
        return f"{name!r} holds no config.json: not a model directory{hint}"
    if path.exists():
        return None
    if looks_like_path(name):
        return f"no such directory {name!r} (hub ids look like org/name)"
    if not network or in_hf_cache(name, env):
        return None
    offline = [v for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") if env.get(v, "").lower() in _TRUE]
    reason = f"{offline[0]}={env[offline[0]]}" if offline else _hub_unreachable(env)
    if reason:
        return f"{name!r} is not a local directory and not in the HF cache ({hf_cache_dir(env)}), and {reason}"
    return None


# ---------------------------------------------------------------- environment ids


def env_module(env_id: str) -> str:
    """The module verifiers imports for a taskset id (``owner/name@version`` -> ``name``, dashes to underscores)."""
    return env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def _verifiers_tasksets() -> Path | None:
    spec = importlib.util.find_spec("verifiers")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "v1" / "tasksets"


def installed_env_ids() -> list[str]:
    """Ids of installed distributions that depend on verifiers (candidates for a suggestion)."""
    from importlib.metadata import distributions

    ids = set()
    for dist in distributions():
        requires = dist.requires or []
        if any(re.match(r"verifiers\b", r) for r in requires) and dist.metadata["Name"]:
            ids.add(dist.metadata["Name"].lower().replace("_", "-"))
    return sorted(ids)


@_too_long_refused
def check_env_id(env_id: str) -> str | None:
    """Why environment ``env_id`` cannot be loaded, or None (also None where verifiers is not installed: the
    processes that load environments run elsewhere, e.g. a SLURM job submitted from a login node)."""
    tasksets = _verifiers_tasksets()
    if tasksets is None:
        return None
    module = env_module(env_id)
    if not module.isidentifier():
        return f"environment id {env_id!r} is not a package name"
    if (tasksets / module).is_dir() or (tasksets / f"{module}.py").is_file():
        return None
    try:
        if importlib.util.find_spec(module) is not None:
            return None
    except (ImportError, ValueError):
        pass
    close = difflib.get_close_matches(env_id.lower(), installed_env_ids(), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else " (install it into this environment: uv pip install ...)"
    return f"environment {env_id!r}: no installed package provides module {module!r}{hint}"


# ---------------------------------------------------------------- ports


def port_in_use(host: str, port: int) -> str | None:
    """Why a server cannot listen on ``host:port``, or None. Binds the way uvicorn does (SO_REUSEADDR), so a
    port left in TIME_WAIT by a stopped server counts as free."""
    if port == 0:
        return None
    bind_host = host or "0.0.0.0"
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((bind_host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"port {port} on {bind_host} is already in use (another server is listening there)"
            return f"cannot listen on {bind_host}:{port}: {e.strerror or e}"
    return None


# ---------------------------------------------------------------- output directory


def check_writable(directory: str | os.PathLike) -> str | None:
    """Why files cannot be written under ``directory`` (a read-only mount, no permission, a full disk), or None.
    Creates the directory, as the run would, and a probe file that it removes again."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=directory)
        try:
            os.write(fd, bytes(4096))  # a full disk still lets an empty file be created
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        code = errno.errorcode.get(e.errno or 0, "?")
        return f"cannot write under {directory}: {e.strerror or e} (errno {e.errno} {code})"
    return None


# ---------------------------------------------------------------- local files


@_too_long_refused
def check_local_path(text: str, what: str) -> str | None:
    """Why ``text``, meant as a local file or directory (a tokenizer, a dataset), is not there, or None."""
    if not text.strip():
        return f"empty {what} path"
    if Path(text).expanduser().exists():
        return None
    return f"no such file or directory {text!r} ({what})"


@_too_long_refused
def check_dataset(text: str) -> str | None:
    """Why an SFT dataset path cannot be read (see prime_trainer.sft.data.load_rows), or None."""
    path = Path(text).expanduser()
    if not path.exists() or not text.strip():
        return check_local_path(text, "dataset")
    if not path.is_dir() or any((path / f).is_file() for f in ("dataset_info.json", "dataset_dict.json")):
        return None
    if not any(f.suffix in (".jsonl", ".json", ".parquet") for f in path.iterdir()):
        return f"directory {text!r} holds no .jsonl/.json/.parquet file and no datasets save_to_disk data"
    return None


@_too_long_refused
def check_tokenizer_dir(name: str) -> str | None:
    """Why a local model directory has no tokenizer (inference, the orchestrator, eval and SFT tokenize with it), or
    None; a hub id or a missing directory is ``check_model_name``'s to judge."""
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        return None
    found = [f for f in path.iterdir() if f.name.startswith("tokenizer") or f.name in _TOKENIZER_FILES]
    if found or any(f.suffix == ".tiktoken" for f in path.iterdir()):
        return None
    return f"{name!r} holds no tokenizer (tokenizer.json or tokenizer_config.json): copy the tokenizer files there"


def check_output_dir(path: Path) -> str | None:
    """Why a run directory cannot be (or be created at) ``path`` because it, or the nearest part of it that exists,
    is a file; or None. Whether files can be written there is ``check_writable``'s (a probe write names the errno:
    a read-only mount, no permission, a full disk)."""
    path = path.expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if existing == path and not path.is_dir():
        return f"{str(path)!r} is a file; the run directory must be a directory"
    if not existing.is_dir():
        return f"{str(path)!r} cannot be created: {str(existing)!r} is a file"
    return None


def lora_record(lora: Any) -> dict[str, Any] | None:
    """What a trainer checkpoint records of ``model.lora`` (a ``LoRAConfig`` or None): the settings its adapter
    weights and their optimizer state were made with."""
    if lora is None:
        return None
    return {"rank": lora.rank, "alpha": lora.alpha, "target_modules": sorted(lora.target_modules)}


def lora_difference(saved: dict[str, Any] | None, lora: Any) -> str | None:
    """The ``model.lora`` setting of this run that differs from a checkpoint's record, and what the checkpoint has,
    in words; None when they agree."""
    now = lora_record(lora)
    if saved == now:
        return None
    if saved is None:
        return "was trained without model.lora (full weights, no adapters) but this run sets model.lora"
    if not isinstance(saved, dict):  # an edited or foreign progress.json
        return f"records model.lora as {saved!r}, which is not a LoRA record (progress.json edited, or not prime's?)"
    if now is None:
        settings = ", ".join(f"{k} = {saved.get(k)!r}" for k in ("rank", "alpha", "target_modules"))
        return f"was trained with model.lora ({settings}) but this run sets none"
    key = next((k for k in ("rank", "alpha", "target_modules") if saved.get(k) != now[k]), None)
    if key is None:  # equal settings, other keys: a record this version does not write
        return f"records model.lora as {saved!r}, this run {now!r}"
    return f"was trained with model.lora.{key} = {saved.get(key)!r} but this run sets {now[key]!r}"


def check_resume_step(output_dir: Path, step: int, process: str = "trainer", lora: Any = None) -> str | None:
    """Why ``process`` (``trainer`` or ``sft``) with ``model.lora`` = ``lora`` cannot resume from checkpoint ``step``
    of ``output_dir``, or None."""
    from prime_core.io import SMALL_JSON_BYTES, UnreadableFile, is_stable, read_regular
    from prime_core.run_dir import RunDir

    run_dir = RunDir(output_dir)
    path = run_dir.trainer_checkpoint(step)
    if is_stable(path):
        try:  # checkpoints saved before the process (or LoRA) was recorded name none
            progress = json.loads(read_regular(path / "progress.json", "a progress record", SMALL_JSON_BYTES))
            saved = progress.get("process", process)
        except (OSError, ValueError, AttributeError, UnreadableFile):
            return None  # an unreadable progress file is the trainer's to name, with the checkpoint to use instead
        if saved != process:
            return (
                f"checkpoint step {step} in {output_dir} was written by {saved}, and {process} does not resume another "
                f"kind of run: start afresh in another --output-dir from its weights (--model.name "
                f"{run_dir.weight_step(step)})"
            )
        # The adapters' keys and shapes would only fail DCP's load, after the model is built (~17 s on the tiny one).
        if "lora" in progress and (diff := lora_difference(progress["lora"], lora)):
            return (
                f"checkpoint step {step} in {output_dir} {diff}: resume with the checkpoint's LoRA settings, or start "
                f"afresh in another --output-dir"
            )
        return None
    have = ", ".join(map(str, run_dir.checkpoint_steps())) or "none"
    return f"no complete checkpoint {run_dir.trainer_checkpoint(step)} (complete checkpoint steps: {have})"


def check_previous_run(output_dir: Path, *, overwrite_flag: bool) -> str | None:
    """Why a trainer must not start afresh in ``output_dir``: it holds another run's checkpoints or weights, which
    step by step it would replace, leaving a mix of two runs. None when there are none."""
    from prime_core.run_dir import RunDir, trainer_outputs

    run_dir = RunDir(output_dir)
    if (found := trainer_outputs(run_dir)) is None:
        return None
    steps = run_dir.checkpoint_steps()
    resume = f"resume it with --ckpt.resume-step {steps[-1]}, " if steps else ""
    overwrite = "delete them with --overwrite" if overwrite_flag else "delete them"
    return (
        f"{str(output_dir)!r} holds another run's {found}, which this run would overwrite: {resume}{overwrite}, or "
        + ("choose another --output-dir")
    )


# ---------------------------------------------------------------- whole configs


def _walk(value: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], BaseModel]]:
    if isinstance(value, BaseModel):
        yield path, value
        for name in type(value).model_fields:
            yield from _walk(getattr(value, name), (*path, name))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _walk(item, (*path, str(i)))


def find_problems(config: BaseModel, *, network: bool = True) -> list[tuple[tuple[str, ...], str]]:
    """Every (field path, reason) of the config's model names and environment ids that cannot load; each
    distinct name is checked once (``rl`` copies the shared ``model`` into three sections)."""
    from prime_core.config.orchestrator import EnvConfig
    from prime_core.config.shared import ModelConfig

    problems, seen = [], set()
    for path, section in _walk(config, ()):
        problems.extend(_file_problems(path, section))
        if isinstance(section, ModelConfig):
            key, reason = (*path, "name"), None
            if section.name not in seen:
                reason = check_model_name(section.name, network=network)
            seen.add(section.name)
        elif isinstance(section, EnvConfig):
            key, reason = (*path, "id"), None
            if ("env", section.id) not in seen:
                reason = check_env_id(section.id)
            seen.add(("env", section.id))
        else:  # eval's plain id list
            for i, env_id in enumerate(getattr(section, "environment_ids", None) or []):
                if isinstance(env_id, str) and ("env", env_id) not in seen and (reason := check_env_id(env_id)):
                    problems.append(((*path, "environment_ids", str(i)), reason))
                seen.add(("env", env_id))
            continue
        if reason:
            problems.append((key, reason))
    return problems


def _file_problems(path: tuple[str, ...], section: BaseModel) -> Iterator[tuple[tuple[str, ...], str]]:
    """The local files a section names that are not there (by field name, so every command's config is covered)."""
    from prime_core.config.inference import InferenceConfig
    from prime_core.config.orchestrator import EvalConfig, OrchestratorConfig
    from prime_core.config.rl import RLConfig
    from prime_core.config.trainer import ModelInitConfig, SFTConfig, SFTDataConfig, SFTValConfig
    from prime_core.run_dir import RunDir, foreign_artifacts

    output_dir = getattr(section, "output_dir", None)
    if isinstance(output_dir, Path) and (reason := check_output_dir(output_dir)):
        yield (*path, "output_dir"), reason
    tokenizes = isinstance(section, (RLConfig, OrchestratorConfig, EvalConfig, InferenceConfig))
    # SFT on fake data (benchmarks, tests) reads no text.
    sft_reads_text = isinstance(section, SFTConfig) and section.data.fake is None
    tokenizes = tokenizes or (sft_reads_text and section.init.tokenizer is None)
    model = getattr(section, "model", None)  # rl's shared model is optional
    if tokenizes and model is not None and (reason := check_tokenizer_dir(model.name)):
        yield (*path, "model", "name"), reason
    tokenizer = section.tokenizer if isinstance(section, ModelInitConfig) else None
    if tokenizer is not None and looks_like_path(tokenizer) and (reason := check_local_path(tokenizer, "tokenizer")):
        yield (*path, "tokenizer"), reason
    data_path = section.path if isinstance(section, (SFTDataConfig, SFTValConfig)) else None
    if data_path is not None and (reason := check_dataset(data_path)):
        yield (*path, "path"), reason
    # A trainer section (it has ``init``) resumes from its own run directory's checkpoint.
    resume_step = getattr(getattr(section, "ckpt", None), "resume_step", None)
    trainer = isinstance(getattr(section, "init", None), ModelInitConfig) and isinstance(output_dir, Path)
    process = "sft" if isinstance(section, SFTConfig) else "trainer"
    lora = section.model.lora if trainer else None
    if trainer and resume_step is not None and (reason := check_resume_step(output_dir, resume_step, process, lora)):
        yield (*path, "ckpt", "resume_step"), reason
    # Only a trainer started on its own: rl checks (or clears, with --overwrite) the run directory itself.
    fresh = trainer and not path and resume_step is None and not section.bench and not getattr(section, "overwrite", 0)
    if fresh and (reason := check_previous_run(output_dir, overwrite_flag=hasattr(section, "overwrite"))):
        yield ("output_dir",), reason
    overwrite = trainer and not path and getattr(section, "overwrite", False)
    if overwrite and (foreign := foreign_artifacts(RunDir(output_dir))):
        why = "no configs/<process>.toml, no step_N directories, no metrics"
        reason = f"{str(output_dir)!r} holds {', '.join(foreign)} that no run wrote ({why}), which --overwrite would "
        yield ("output_dir",), reason + "delete; choose another --output-dir"
