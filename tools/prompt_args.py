"""Prompt sources shared by `spd generate` and `spd bench`: --prompt, --prompts-file (lines or
jsonl), --messages-file (chats) and --eval-prompts K (the shipped evaluation sets)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_request_arguments(g) -> None:
    """Prompt sources shared by generate and bench."""
    g.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    g.add_argument("--prompts-file", help="one prompt per line, or jsonl ('prompt', 'messages' or EAGLE 'turns')")
    g.add_argument("--messages-file", help="JSON: one chat [{\"role\": ..., \"content\": ...}, ...], a list of "
                                           "chats, or jsonl of {\"messages\": [...]}; always through the chat template")
    g.add_argument("--eval-prompts", type=int, default=None, metavar="K",
                   help="also the first K prompts of each shipped evaluation set (MT-Bench, HumanEval, GSM8K "
                        "first turns; the dev prompts with K=2)")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt at most")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template to text prompts")


def eval_prompts(k: int) -> list[str]:
    """The first k prompts of each shipped evaluation set, set by set (train/evalsets)."""
    from spd_engine.train.evaluate import DATASETS, default_data_dir, load_dataset

    if k < 1:
        raise ValueError(f"--eval-prompts must be >= 1, got {k}")
    data_dir = default_data_dir()
    if data_dir is None:
        raise ValueError("--eval-prompts: this installation lacks the evaluation sets (train/evalsets)")
    return [p.text for name in DATASETS for p in load_dataset(data_dir, name, k)]


def _jsonl_prompt(rec, where: str):
    """A prompt of a jsonl line: 'prompt' (text), 'messages' (a chat) or EAGLE 'turns' (first turn)."""
    if isinstance(rec, dict):
        if "messages" in rec:
            return rec["messages"]
        if "turns" in rec:
            return rec["turns"][0]
        if isinstance(rec.get("prompt"), str):
            return rec["prompt"]
    raise ValueError(f"{where}: expected an object with 'prompt', 'messages' or 'turns'")


def load_messages_file(path: str) -> list[list[dict]]:
    """Chats from a JSON file: one chat [{"role", "content"}, ...], a list of chats, or jsonl {"messages": [...]}."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"messages file not found: {p}")
    text = p.read_text()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        try:
            doc = [json.loads(line)["messages"] for line in text.splitlines() if line.strip()]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{p}: neither JSON nor jsonl of {{\"messages\": [...]}} lines ({err})") from None
    chats = [doc] if isinstance(doc, list) and doc and isinstance(doc[0], dict) else doc
    if not isinstance(chats, list) or not chats or not all(isinstance(c, list) for c in chats):
        raise ValueError(f"{p}: expected a chat (a list of messages) or a list of chats")
    return chats


def load_prompts(args: argparse.Namespace) -> list:
    """--prompt (repeatable), --prompts-file (plain lines, or jsonl with 'prompt', 'messages' or EAGLE
    'turns') and --messages-file: text prompts (str) and chats (lists of messages)."""
    prompts: list = list(getattr(args, "prompt", None) or [])
    if getattr(args, "prompts_file", None):
        path = Path(args.prompts_file)
        if not path.is_file():
            raise ValueError(f"prompts file not found: {path}")
        for i, line in enumerate(path.read_text().splitlines()):
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{i + 1}: not JSON: {err}") from None
                prompts.append(_jsonl_prompt(rec, f"{path}:{i + 1}"))
            else:
                prompts.append(line)
    if getattr(args, "messages_file", None):
        prompts += load_messages_file(args.messages_file)
    if getattr(args, "eval_prompts", None) is not None:
        prompts += eval_prompts(args.eval_prompts)
    if not prompts:
        raise ValueError("no prompt given: use --prompt TEXT, --prompts-file FILE, --messages-file FILE or "
                         "--eval-prompts K")
    empty = [i + 1 for i, p in enumerate(prompts) if isinstance(p, str) and not p]
    if empty:
        raise ValueError(f"prompt {empty[0]} is empty (give it some text)")
    return prompts
