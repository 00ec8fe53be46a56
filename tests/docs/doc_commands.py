"""Shell commands of the docs (README.md, docs/*.md), as the doc tests run them.

- Fenced ``bash``/``sh``/``shell`` blocks hold commands; a ``console`` block holds a transcript: ``$ command``
  lines, each followed by the exact output it prints (stdout, then stderr).
- ``<!-- doc-test: skip (reason) -->`` on the line before a fence leaves the block out (GPU, other hosts,
  network, long runs, templates); a command whose line ends in ``# doc-test: skip`` is left out alone.
- A command with a placeholder (``<dir>``, ``...``) is a template, never run.
- Lines ending in ``\\`` continue; ``a && b`` is two commands; ``export A=1`` and ``A=1`` set shell variables
  for the rest of the block; a trailing ``&`` runs in the background.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SKIP_MARKER = re.compile(r"<!--\s*doc-test:\s*skip\b(.*?)-->")
PLACEHOLDER = re.compile(r"<[^<>\s][^<>]*>|\.\.\.")
_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_SHELL_LANGS = ("bash", "sh", "shell")


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@dataclass
class Command:
    """One shell command of a doc block."""

    text: str
    """The command as written (continuations joined, trailing comment removed)."""
    line: int
    """Line in the doc file where it starts."""
    background: bool = False
    expected: list[str] | None = None
    """console transcripts: the output lines the doc shows."""
    skip: str | None = None

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text)


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    commands: list[Command] = field(default_factory=list)
    skip: str | None = None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def _strip_comment(text: str) -> tuple[str, str]:
    """Split a shell line into command and trailing ``# comment`` (quotes respected)."""
    quote = None
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i].rstrip(), text[i + 1 :].strip()
    return text.rstrip(), ""


def _split_and(text: str) -> list[str]:
    """``a && b`` -> [a, b] (outside quotes)."""
    parts, quote, start = [], None, 0
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif text.startswith("&&", i) and quote is None:
            parts.append(text[start:i].strip())
            start = i + 2
    parts.append(text[start:].strip())
    return [p for p in parts if p]


def _shell_commands(lines: list[tuple[int, str]]) -> list[Command]:
    commands: list[Command] = []
    pending, start = "", 0
    for number, raw in lines:
        body, comment = _strip_comment(raw)
        if not pending:
            start = number
        if body.endswith("\\"):
            pending += body[:-1] + " "
            continue
        text, pending = (pending + body).strip(), ""
        if not text:
            continue
        skip = "marked in the doc" if "doc-test: skip" in comment else None
        for part in _split_and(text):
            background = part.endswith("&")
            part = part.removesuffix("&").strip()
            commands.append(Command(part, start, background=background, skip=skip))
    return commands


def _console_commands(lines: list[tuple[int, str]]) -> list[Command]:
    commands: list[Command] = []
    for number, raw in lines:
        if raw.startswith("$ "):
            commands.append(Command(raw[2:].strip(), number, expected=[]))
        elif commands:
            commands[-1].expected.append(raw)
    return commands


def parse_doc(path: Path) -> list[Block]:
    """The shell and console blocks of one markdown file."""
    blocks: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\w+)?\s*$", lines[i])
        if not fence:
            i += 1
            continue
        lang = fence.group(1) or ""
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
        body = [(n + 1, lines[n]) for n in range(i + 1, end)]
        if lang in (*_SHELL_LANGS, "console"):
            previous = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            marker = SKIP_MARKER.search(previous)
            block = Block(path, i + 1, lang, skip=(marker.group(1).strip(" ():") or "marked") if marker else None)
            block.commands = _console_commands(body) if lang == "console" else _shell_commands(body)
            for command in block.commands:
                if command.skip is None and PLACEHOLDER.search(command.text):
                    command.skip = "a template (placeholder)"
            blocks.append(block)
        i = end + 1
    return blocks


def all_blocks() -> list[Block]:
    return [block for path in doc_files() for block in parse_doc(path)]


# ---------------------------------------------------------------- entry points


def console_scripts() -> dict[str, str]:
    """Entry point name -> ``module:function`` of this workspace's packages."""
    return {ep.name: ep.value for ep in entry_points(group="console_scripts") if ep.value.startswith("prime_")}


def entry_invocation(argv: list[str], scripts: dict[str, str]) -> tuple[dict[str, str], str, list[str]] | None:
    """``(env assignments, entry point, its arguments)`` when ``argv`` runs one of ours (directly, with
    ``uv run``, ``python -m prime_x.entrypoints.y`` or ``torchrun ... -m``/``--no-python``); else None."""
    env: dict[str, str] = {}
    while argv and _ASSIGN.match(argv[0]):
        key, _, value = argv[0].partition("=")
        env[key] = value
        argv = argv[1:]
    if argv[:2] == ["uv", "run"]:
        argv = argv[2:]
    if not argv:
        return None
    modules = {value.split(":")[0]: name for name, value in scripts.items()}
    if argv[0] in scripts:
        return env, argv[0], argv[1:]
    if argv[0] in ("python", "python3", "torchrun") and ("-m" in argv or "--no-python" in argv):
        if "-m" in argv:
            i = argv.index("-m") + 1
            name = modules.get(argv[i]) if i < len(argv) else None
        else:
            i = argv.index("--no-python") + 1
            name = argv[i] if i < len(argv) and argv[i] in scripts else None
        return (env, name, argv[i + 1 :]) if name else None
    return None
