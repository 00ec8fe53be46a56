"""Harness programs without a download: the packages a pool offers them, and the check that a PEP 723 script needs
nothing else.

verifiers runs a harness program (its ``bash`` agent, the ``null`` chat loop) as a PEP 723 script that ``uv sync
--script`` installs into a fresh environment: from PyPI, which an offline host and the sandbox (no network) do not
reach. The pool instead binds, read-only, the packages of its own interpreter's environment that
``SandboxPoolConfig.program_packages`` names (and everything they require) into every zygote, hidden until a program
execution binds them on its ``sys.path`` (see ``zygote.bind_programs``). A script is run only when each dependency it
declares is among them, at a version its specifier accepts; otherwise it is refused in one line naming the
dependency, never installed.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import re
import sys
import tomllib
from functools import cache

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name

from prime_orchestrator.sandbox.supervisor import PROGRAM_SITE

# PEP 723's reference regular expression for a metadata block.
_BLOCK = re.compile(r"(?m)^# /// (?P<type>[a-zA-Z0-9-]+)$\s(?P<content>(^#(| .*)$\s)+)^# ///$")
# Runs the script as ``__main__`` with the offered packages importable; isolated (-I): neither the working folder
# (the code's) nor PYTHON* variables shape what it imports; without ``site`` (-S): the interpreter's own
# site-packages (bound with its ``lib``) held older copies (a typing_extensions without ``sentinel``) that shadowed
# the offered ones. The script lies in the workspace, which the model's commands write: it runs only if the bytes
# read are those its name's sha256 names, and it runs those bytes (``runpy.run_path`` read the file again). A file
# the code replaced ran as the next segment's harness, with the interception secret in its argv. The program is PID 1
# of its namespace, which the kernel sends from inside only the signals it handles: Python's SIGINT handler let the
# model's command `kill -INT 1` end it (exit 130, a failed rollout, which trains nothing, where the episode should
# score). A handler that does nothing, not SIG_IGN: execve resets it, so the commands the program starts keep SIGINT.
_BOOT = (
    f"import hashlib, os, signal, site, sys, types; site.addsitedir({PROGRAM_SITE!r}); sys.argv = sys.argv[1:]; "
    "signal.signal(signal.SIGINT, lambda *_: None); "
    "path = sys.argv[0]; source = open(path, 'rb').read(); "
    "hashlib.sha256(source).hexdigest() == os.path.basename(path)[:-3] or "
    "sys.exit(f'{path}: the harness script was changed after the runtime wrote it'); "
    "main = sys.modules['__main__'] = types.ModuleType('__main__'); main.__file__ = path; "
    "exec(compile(source, path, 'exec'), main.__dict__)"
)


def _environment() -> dict[str, str]:
    from packaging.markers import default_environment

    return {**default_environment(), "extra": ""}


@cache
def offered(names: tuple[str, ...]) -> tuple[dict[str, str], dict[str, str]]:
    """The distributions ``names`` and what they require (markers evaluated for this interpreter, with the extras
    each requirement names),
    as found in this interpreter's environment: ({canonical name: version}, {entry name: host path}), where the
    entries are each distribution's top-level files and directories in its site-packages (its dist-info included,
    so ``importlib.metadata`` works inside). A name not installed is left out (a script needing it is refused)."""
    env, versions, entries, done = _environment(), {}, {}, set()
    todo = [Requirement(n) for n in names]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        extras = ("", *sorted(req.extras))
        if {(name, e) for e in extras} <= done:
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            continue
        for spec in dist.requires or []:
            sub = Requirement(spec)
            if sub.marker is None or any(sub.marker.evaluate({**env, "extra": e}) for e in extras):
                todo.append(sub)
        done |= {(name, e) for e in extras}
        if name in versions:
            continue
        versions[name] = dist.version
        for file in dist.files or []:
            top = file.parts[0]
            path = os.path.normpath(dist.locate_file(top))
            if top not in ("..", "__pycache__") and top not in entries and os.path.lexists(path):
                entries[top] = path
    return versions, entries


def script_dependencies(script: str) -> tuple[list[str], str | None]:
    """The ``dependencies`` and ``requires-python`` of a PEP 723 script's ``script`` block (none: ``[]``, None)."""
    blocks = [m for m in _BLOCK.finditer(script) if m.group("type") == "script"]
    if len(blocks) > 1:
        raise ValueError("the script has more than one `# /// script` block")
    if not blocks:
        return [], None
    lines = blocks[0].group("content").splitlines(keepends=True)
    meta = tomllib.loads("".join(line[2:] if line.startswith("# ") else line[1:] for line in lines))
    return list(meta.get("dependencies", [])), meta.get("requires-python")


def unmet(script: str, versions: dict[str, str]) -> str:
    """Why ``script`` cannot run with the offered ``versions`` (one line naming the dependency), or ''."""
    try:
        deps, requires_python = script_dependencies(script)
    except (ValueError, tomllib.TOMLDecodeError) as e:
        return f"its PEP 723 metadata does not parse: {e}"
    python = platform.python_version()
    try:
        if requires_python and not SpecifierSet(requires_python).contains(python, prereleases=True):
            return f"it requires Python {requires_python}, the sandbox's is {python}"
    except InvalidSpecifier:
        return f"its requires-python {requires_python!r} is not a version specifier"
    env = _environment()
    for dep in deps:
        try:
            req = Requirement(dep)
        except InvalidRequirement:
            return f"dependency {dep!r} is not a requirement"
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        have = versions.get(canonicalize_name(req.name))
        if have is None:
            return f"dependency {dep!r} is not among the packages the pool offers programs (pool.program_packages)"
        if not req.specifier.contains(have, prereleases=True):
            return f"dependency {dep!r} is offered at version {have} only"
    return ""


def program_argv(python: str, path: str) -> list[str]:
    """The argv that runs the script at ``path`` (inside the box) with the offered packages."""
    return [python, "-I", "-S", "-c", _BOOT, path]


def pool_python(configured: str | None) -> str | None:
    """The interpreter a pool runs programs with, when the offered packages fit it (it is this process's): its
    path, else None."""
    own = os.path.realpath(sys.executable)
    return own if configured is None or os.path.realpath(configured) == own else None
