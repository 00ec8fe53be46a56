"""The shell commands of README.md and docs/*.md run as documented (see doc_commands.py for what counts as a
command and how a doc opts a block out).

- Default run (seconds): every command of one of our entry points resolves its config the way a user's would,
  with ``--dry-run`` appended unless it already has ``--help``/``--dry-run`` (nothing starts), in order, in a
  fresh-clone view of the repository, so a renamed flag, a missing example file or a bad value fails here.
  Commands reading ``outputs/...`` that an earlier, real command produces are left to the slow run. ``console``
  transcripts must print exactly what the doc shows.
- ``slow``: every command of each doc, run for real by bash in document order with small step counts
  (``--max-steps 2`` on rl/sft/trainer runs, and a doc's ``weights/step_N`` then names step 2).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.docs.doc_commands import REPO, Block, Command, all_blocks, console_scripts, doc_files, entry_invocation

SCRIPTS = console_scripts()
SMALL_STEPS = 2
_VAR = re.compile(r"\$(\w+)|\$\{(\w+)\}")


def fresh_clone(root: Path) -> Path:
    """A view of the repository as cloned: every tracked top-level entry linked, no ``outputs/``."""
    root.mkdir(parents=True, exist_ok=True)
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for top in sorted({line.split("/", 1)[0] for line in tracked.splitlines()} | {".venv"}):
        if top != "outputs" and (REPO / top).exists():
            (root / top).symlink_to(REPO / top)
    return root


def _expand(text: str, variables: dict[str, str]) -> str:
    return _VAR.sub(lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), text)


def _assignments(argv: list[str]) -> dict[str, str] | None:
    """``export A=1 B=2`` / ``A=1``: the variables it sets; None for any other command."""
    words = argv[1:] if argv[:1] == ["export"] else argv
    if not words or not all(re.match(r"^[A-Za-z_]\w*=", w) for w in words):
        return None
    return dict(w.split("=", 1) for w in words)


def _run_entry(name: str, args: list[str], env: dict[str, str], capsys, monkeypatch) -> tuple[int, str, str]:
    module, func = SCRIPTS[name].split(":")
    main = getattr(importlib.import_module(module), func)
    capsys.readouterr()
    with monkeypatch.context() as m:
        for key, value in env.items():
            m.setenv(key, value)
        try:
            code = main(args) or 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def _needs_earlier_run(args: list[str], sandbox: Path) -> bool:
    return any(a.startswith("outputs/") and not (sandbox / a).exists() for a in args)


def _resolve(command: Command, sandbox: Path, variables: dict[str, str], capsys, monkeypatch) -> str | None:
    """Resolve one command's config; the failure line, or None."""
    argv = shlex.split(_expand(command.text, variables))
    found = entry_invocation(argv, SCRIPTS)
    if found is None:
        return None
    env, name, args = found
    if _needs_earlier_run(args, sandbox):
        return None
    if command.expected is None and not {"--help", "-h", "--dry-run"} & set(args):
        args = [*args, "--dry-run"]
    elif command.expected is not None:  # a transcript: same output, and never start anything
        args = [*args, "--dry-run"] if "--help" not in args else args
    code, out, err = _run_entry(name, args, env, capsys, monkeypatch)
    if command.expected is not None:
        shown = (out + err).rstrip("\n").splitlines()
        if shown != command.expected:
            return f"printed {shown!r}, the doc shows {command.expected!r}"
        return None
    if code != 0:
        return f"exit {code}: {(err or out).strip().splitlines()[-1:] or ''}"
    return None


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: p.name)
def test_documented_commands_resolve(doc: Path, tmp_path, capsys, monkeypatch):
    from tests.docs.doc_commands import parse_doc

    sandbox = fresh_clone(tmp_path / "clone")
    monkeypatch.chdir(sandbox)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    failures = []
    for block in parse_doc(doc):
        if block.skip:
            continue
        variables: dict[str, str] = {}
        for command in block.commands:
            if command.skip:
                continue
            assigned = _assignments(shlex.split(command.text))
            if assigned is not None:
                variables.update({k: _expand(v, variables) for k, v in assigned.items()})
                continue
            failure = _resolve(command, sandbox, variables, capsys, monkeypatch)
            if failure:
                failures.append(f"{block.path.name}:{command.line}: {command.text}\n    {failure}")
    assert not failures, "documented commands that do not resolve:\n" + "\n".join(failures)


def test_every_shell_block_is_seen():
    """The extractor finds the blocks (a doc format change must not make the doc tests vacuous)."""
    blocks = all_blocks()
    assert any(b.path.name == "quickstart.md" and b.lang == "bash" for b in blocks)
    commands = [c for b in blocks if not b.skip for c in b.commands if not c.skip]
    assert any(entry_invocation(c.argv, SCRIPTS) for c in commands)


# ---------------------------------------------------------------- slow: run everything


def _small(command: Command) -> str:
    text = command.text
    found = entry_invocation(shlex.split(text), SCRIPTS)
    if found and found[1] in ("rl", "sft", "trainer") and not {"--help", "--dry-run"} & set(found[2]):
        text += f" --max-steps {SMALL_STEPS}"
    text = re.sub(r"(weights/step_)\d+", rf"\g<1>{SMALL_STEPS}", text)
    return text + (" &" if command.background else "")


# `uv run X` runs X from the test's (already synced) environment on PATH; `env` so that `eval` is ours, not bash's.
_UV_RUN = 'uv() { if [ "$1" = run ]; then shift; env "$@"; else command uv "$@"; fi; }'


def doc_script(blocks: list[Block]) -> str:
    lines = ["set -euo pipefail", "trap 'jobs -p | xargs -r kill' EXIT", _UV_RUN]
    for block in blocks:
        if block.skip or block.lang == "console":
            continue
        lines.append(f"echo '>>> {block.where}'")
        lines += [_small(c) for c in block.commands if not c.skip]
    return "\n".join(lines) + "\n"


@pytest.mark.slow
@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: p.name)
def test_documented_commands_run(doc: Path, tmp_path):
    from tests.docs.doc_commands import parse_doc

    script = doc_script(parse_doc(doc))
    if script.count("\n") <= 2:
        pytest.skip(f"{doc.name} has no runnable shell block")
    # The docs start servers on the default port 8000: one doc at a time across xdist workers.
    with open(Path(tempfile.gettempdir()) / "prime-documented-commands.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        sandbox = fresh_clone(tmp_path / "clone")
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": ""}
        log = tmp_path / "output.log"
        with open(log, "w") as out:
            # Its own session: background servers of a doc are killed with the group, and the output goes to a file
            # they may keep open after bash exits.
            proc = subprocess.Popen(
                ["bash", "-c", script],
                cwd=sandbox,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                proc.wait(timeout=1800)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    output = log.read_text(errors="replace")
    assert proc.returncode == 0, (
        f"{doc.name}: a documented command failed\n{script}\n---- output ----\n{output[-6000:]}"
    )
