"""Checks of the world a resolved config points at, run before anything loads: a mistake costs one line
and milliseconds instead of a traceback after a model load or a minute of network retries.

- ``model.name``: a name that looks like a path must exist (a directory must hold ``config.json``); a hub id
  must be in the local HF cache or downloadable (not with ``HF_HUB_OFFLINE=1``, and huggingface.co must accept
  a connection).
- environment ids: an installed package (or a verifiers built-in taskset) must provide each one.
- ports: a server's port must be free before the server loads its model.
- the output directory of a process that writes one must take files (not read-only, not full, permitted).

Nothing here imports torch, transformers or verifiers.
"""

from __future__ import annotations

import difflib
import errno
import importlib.util
import os
import re
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pydantic import BaseModel

# huggingface_hub's repo id rule: ``name`` or ``namespace/name`` of these characters.
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
_TRUE = ("1", "true", "yes", "on")
_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
# A model directory: Hugging Face's config.json, or Mistral's params.json (vLLM reads that format too).
_MODEL_FILES = ("config.json", "params.json")


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


def check_model_name(name: str, *, network: bool = True, environ: dict[str, str] | None = None) -> str | None:
    """Why ``name`` cannot be loaded, or None. ``network``: also check that a hub id not yet downloaded can be."""
    env = dict(os.environ if environ is None else environ)
    path = Path(name).expanduser()
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
