"""SFT inputs: read dataset files, check each row's shape before it reaches the chat template, load the template.

A bad row is a ``ConfigError`` naming its file, its line (JSON Lines) or row (other formats) and the field, e.g.
``data.jsonl line 7: messages[1].content is a number (expected a string or a list of parts)``.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from prime_core.config import ConfigError

logger = logging.getLogger("prime.sft")

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
TRAINABLE_ROLES = ("system", "user", "assistant", "tool")


class Rows(list):
    """Dataset rows that remember where each came from (``where(i)``), for error messages."""

    def __init__(self, rows=(), origins: list[tuple[str, str, int]] | None = None):
        super().__init__(rows)
        self._origins = origins if origins is not None else []
        """Per row: (file, "line" or "row", number)."""

    def add(self, row: Any, file: str, unit: str, number: int) -> None:
        self.append(row)
        self._origins.append((file, unit, number))

    def where(self, i: int) -> str:
        if i < len(self._origins):
            file, unit, number = self._origins[i]
            return f"{file} {unit} {number}"
        return f"row {i}"

    def subset(self, indices) -> Rows:
        indices = [int(i) for i in indices]
        return Rows([self[i] for i in indices], [self._origins[i] for i in indices] if self._origins else None)


def where_of(rows: list, i: int) -> str:
    return rows.where(i) if isinstance(rows, Rows) else f"row {i}"


def load_rows(path: str, split: str = "train") -> Rows:
    """Rows of a .jsonl/.json/.parquet file, a directory of such files, or a ``datasets`` save_to_disk directory."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"dataset {path!r} does not exist")
    if p.is_dir() and ((p / "dataset_info.json").is_file() or (p / "dataset_dict.json").is_file()):
        return _load_hf_disk(p, split)
    files = sorted(f for f in p.iterdir() if f.suffix in FILE_SUFFIXES) if p.is_dir() else [p]
    if not files:
        raise ConfigError(f"no {'/'.join(FILE_SUFFIXES)} files in {path!r}")
    if p.is_dir():
        files = _files_of_split(files, split, path)
        skipped = sorted(f.name for f in p.iterdir() if f.is_file() and f not in files and not f.name.startswith("."))
        if skipped:
            logger.warning("%s: reading %d data files; skipping %s", path, len(files), ", ".join(skipped[:5]))
    for f in files:  # a FIFO blocked the trainer in open for good, a link to a device was read without end
        if not f.is_file():
            raise ConfigError(f"{f}: not a regular file (a data file is one)")
    rows = Rows()
    for f in files:
        start = len(rows)
        if f.suffix == ".parquet":
            _read_parquet(f, rows)
        elif f.suffix == ".jsonl":
            _read_jsonl(f, rows)
        elif f.suffix == ".json":
            _read_json(f, rows)
        else:
            raise ConfigError(f"{f}: unsupported dataset file type (use {', '.join(FILE_SUFFIXES)})")
        if len(rows) == start:
            raise ConfigError(f"{f}: no rows (the file is empty)")
    return rows


_SPLIT_NAME = re.compile(r"^(train|test|validation|valid|val|eval|dev)(?:$|[-._ 0-9])", re.IGNORECASE)


def _files_of_split(files: list[Path], split: str, path: str) -> list[Path]:
    """A directory holding files of several splits by name (``train.jsonl``, ``test-00000.parquet``, as Hugging Face
    names them) gives only ``split``'s files: reading them all would train on the test set."""
    names = {f: m.group(1).lower() if (m := _SPLIT_NAME.match(f.stem)) else None for f in files}
    splits = {n for n in names.values() if n is not None}
    if len(splits) < 2:
        return files
    mine = [f for f in files if names[f] == split.lower()]
    if not mine:
        raise ConfigError(
            f"{path}: no files of split {split!r} (data.split; files of splits: {', '.join(sorted(splits))})"
        )
    return mine


def _read_jsonl(f: Path, rows: Rows) -> None:
    name = str(f)
    # Line by line, so a file is never held twice in memory; utf-8-sig accepts a leading byte-order mark.
    with open(f, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{f} line {number}: not UTF-8 (byte {e.start} of the line)") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except RecursionError:
                raise ConfigError(f"{f} line {number}: JSON nested too deep") from None
            except json.JSONDecodeError as e:
                end = "" if raw.endswith(b"\n") else " (the last line is cut short: is the file complete?)"
                raise ConfigError(f"{f} line {number}: invalid JSON at column {e.colno}: {e.msg}{end}") from None
            _check_object(row, f"{f} line {number}")
            rows.add(row, name, "line", number)


def _read_json(f: Path, rows: Rows) -> None:
    name = str(f)
    try:
        data = json.loads(f.read_bytes().decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{f}: not UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{f}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise ConfigError(f"{f}: JSON nested too deep") from None
    for number, row in enumerate(data if isinstance(data, list) else [data]):
        _check_object(row, f"{f} row {number}")
        rows.add(row, name, "row", number)


def _read_parquet(f: Path, rows: Rows) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    name = str(f)
    try:
        table = pq.read_table(f)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"{f}: not a readable parquet file ({str(e).splitlines()[0]})") from None
    for number, row in enumerate(table.to_pylist()):
        rows.add(row, name, "row", number)


def _check_object(row: Any, where: str) -> None:
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: a row must be a JSON object, got {_kind(row)}")


def _load_hf_disk(path: Path, split: str) -> Rows:
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"{path} is a `datasets` save_to_disk directory: reading it needs the `datasets` package "
            "(pip install datasets), or export it to .jsonl/.parquet"
        ) from None
    ds = datasets.load_from_disk(str(path))
    label = str(path)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ConfigError(f"{path}: no split {split!r} (data.split; splits: {', '.join(ds)})")
        ds, label = ds[split], f"{path}[{split}]"
    elif ds.split is not None and str(ds.split) != split:
        # A single split saved alone still records which it was: reading `test` as `train` trains on the test set.
        raise ConfigError(f"{path}: holds only split {str(ds.split)!r}, not data.split={split!r}")
    rows = Rows()
    for number, row in enumerate(ds.to_list()):
        rows.add(row, label, "row", number)
    return rows


# ---------------------------------------------------------------- row shape


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def to_messages(row: Any, index: int | str) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """A row's conversation and tools; ``index`` (a row number or where the row came from) names a bad row."""
    where = f"row {index}" if isinstance(index, int) else index
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: a row must be an object, got {_kind(row)}")
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: tools is a string but not JSON ({e.msg} at column {e.colno})") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ConfigError(f"{where}: tools must be a list of objects, got {_kind(tools)}")
    if row.get("messages") is not None:
        messages = _message_list(row["messages"], "messages", where)
    elif row.get("prompt") is not None and row.get("completion") is not None:
        prompt, completion = row["prompt"], row["completion"]
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        completion = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
        messages = _message_list(prompt, "prompt", where) + _message_list(completion, "completion", where)
    else:
        has = sorted(k for k, v in row.items() if v is not None)
        raise ConfigError(f"{where}: needs `messages`, or `prompt` and `completion` (has non-null {has})")
    messages = [_clean_message(m, name, where) for name, m in messages]
    return messages, tools or None


def _message_list(value: Any, field: str, where: str) -> list[tuple[str, Any]]:
    if not isinstance(value, list | tuple):
        expected = "a list of messages" if field == "messages" else "a string or a list of messages"
        raise ConfigError(f"{where}: {field} is {_kind(value)} (expected {expected})")
    return [(f"{field}[{j}]", m) for j, m in enumerate(value)]


def _clean_message(message: Any, field: str, where: str) -> dict[str, Any]:
    """Drop null fields (columnar formats fill absent keys with None), parse JSON-string tool-call arguments, and refuse
    what a chat template would render silently wrong (a number as content, a missing role, arguments that are not
    JSON)."""
    if not isinstance(message, dict):
        raise ConfigError(f"{where}: {field} is {_kind(message)} (expected an object with role and content)")
    out = {k: v for k, v in message.items() if v is not None}
    role = out.get("role")
    if not isinstance(role, str) or not role:
        raise ConfigError(f"{where}: {field}.role is {'missing' if role is None else _kind(role)} (expected a string)")
    if "weight" in out and (isinstance(out["weight"], bool) or out["weight"] not in (0, 1)):
        raise ConfigError(f"{where}: {field}.weight is {out['weight']!r} (expected 0 or 1)")
    calls = out.get("tool_calls")
    if calls is not None and not isinstance(calls, list | tuple):
        raise ConfigError(f"{where}: {field}.tool_calls is {_kind(calls)} (expected a list)")
    content = out.get("content")
    if content is None and not calls:
        raise ConfigError(f"{where}: {field}.content is missing (only an assistant turn with tool_calls may omit it)")
    if content is not None and not isinstance(content, str):
        if not isinstance(content, list | tuple):
            raise ConfigError(f"{where}: {field}.content is {_kind(content)} (expected a string or a list of parts)")
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ConfigError(f"{where}: {field}.content[{j}] is not a part (an object with a string `type`)")
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise ConfigError(
                    f"{where}: {field}.content[{j}].text is {_kind(part.get('text'))} (expected a string)"
                )
    for j, call in enumerate(calls or []):
        name = f"{field}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ConfigError(f"{where}: {name} needs a `function` object with a string `name`")
        arguments = fn.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                raise ConfigError(
                    f"{where}: {name}.function.arguments is not JSON ({e.msg} at column {e.colno}): training on it "
                    "teaches malformed tool calls"
                ) from None
            fn["arguments"] = arguments
        if arguments is not None and not isinstance(arguments, dict):
            raise ConfigError(f"{where}: {name}.function.arguments is {_kind(arguments)} (expected a JSON object)")
    return out


# ---------------------------------------------------------------- chat template


def load_tokenizer(name: str, chat_template: str | None):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name)
    if chat_template is not None:
        path = Path(chat_template).expanduser()
        if path.is_file():
            chat_template = path.read_text()
        elif "{{" not in chat_template and "{%" not in chat_template:
            # No Jinja markup: a path, and a mistyped one would otherwise be a template printing the path itself.
            raise ConfigError(f"data.chat_template: no such file {str(path)!r} (and no Jinja markup in it)")
        tokenizer.chat_template = chat_template
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"tokenizer {name!r} has no chat template: set --data.chat-template")
    if isinstance(tokenizer.chat_template, str):
        _check_template_syntax(tokenizer.chat_template, "data.chat_template" if chat_template else name)
    return tokenizer


def _check_template_syntax(template: str, what: str) -> None:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"{what}: the chat template does not parse (line {e.lineno}: {e.message})") from None
