"""The user's own corpora as training-data records (the same records train/sources.py yields).

A path is a `.jsonl` file (one object per line: {"prompt": str}, {"text": str}, {"messages":
[{"role", "content"}, ...]} or EAGLE {"turns": [str, ...]}), a text file (`.txt`, `.md`: cut at
blank lines into chunks of about `max_chars`), or a directory of such files (recursively, in
sorted order). A chat of one user message is a prompt (the self-distillation step answers it);
longer chats are conversations. Every record then goes through the same decontamination against
the evaluation sets as the built-in sources (train/decontaminate.py).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".md")
SUFFIXES = (".jsonl",) + TEXT_SUFFIXES


def chunk_paragraphs(text: str, max_chars: int = 4000) -> list[str]:
    """Paragraphs (blank-line separated) packed into chunks of about `max_chars`; no text is lost."""
    chunks, current, size = [], [], 0
    for para in text.split("\n\n"):
        if current and size + len(para) > max_chars:
            chunks.append("\n\n".join(current))
            current, size = [], 0
        current.append(para)
        size += len(para) + 2
    if current:
        chunks.append("\n\n".join(current))
    return [c.strip() for c in chunks if c.strip()]


def _jsonl_record(obj, where: str) -> dict:
    """kind + text or messages of one jsonl line (ValueError naming the line)."""
    if isinstance(obj, dict):
        if isinstance(obj.get("messages"), list):
            messages = obj["messages"]
            ok = all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                     for m in messages)
            if not ok or not messages:
                raise ValueError(f"{where}: 'messages' must be a list of {{\"role\": str, \"content\": str}}")
            if len(messages) == 1 and messages[0]["role"] == "user":
                return {"kind": "prompt", "text": messages[0]["content"]}
            return {"kind": "conversation", "messages": messages}
        if isinstance(obj.get("turns"), list) and obj["turns"] and isinstance(obj["turns"][0], str):
            return {"kind": "prompt", "text": obj["turns"][0]}
        for key, kind in (("prompt", "prompt"), ("text", "text")):
            if isinstance(obj.get(key), str):
                return {"kind": kind, "text": obj[key]}
    raise ValueError(f"{where}: expected an object with 'prompt', 'text', 'messages' or 'turns'")


def _file_records(path: Path, max_chars: int) -> Iterator[dict]:
    text = path.read_text(encoding="utf-8")
    if path.suffix in TEXT_SUFFIXES:
        for chunk in chunk_paragraphs(text, max_chars):
            yield {"kind": "text", "text": chunk}
        return
    for i, line in enumerate(text.splitlines()):
        if line.strip():
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{i + 1}: not JSON: {err}") from None
            rec = _jsonl_record(obj, f"{path}:{i + 1}")
            if rec.get("text", "x").strip():
                yield rec


def user_files(path: Path) -> list[Path]:
    path = Path(path)
    if path.is_file():
        if path.suffix not in SUFFIXES:
            raise ValueError(f"{path}: a corpus file must be one of {', '.join(SUFFIXES)}")
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
        if not files:
            raise ValueError(f"{path}: no {', '.join(SUFFIXES)} files in it")
        return files
    raise ValueError(f"corpus input not found: {path}")


def user_records(path: str | Path, licence: str = "user-supplied", max_chars: int = 4000) -> Iterator[dict]:
    """Records of one user corpus (a file or a directory); source name `user:<name>`."""
    path = Path(path)
    source = f"user:{path.name}"
    for f in user_files(path):
        subset = f.relative_to(path).as_posix() if path.is_dir() else f.name
        for rec in _file_records(f, max_chars):
            yield {"source": source, "licence": licence, "subset": subset, **rec}
