"""The PDM training corpus: build it from source records, read it back as prompts or packed sequences.

On disk (one directory):
    manifest.json                 sources, licences, counts, tokenizer fingerprint, decontamination
    <shard>.tokens.npy            all documents' token ids, concatenated: [N] uint16 (vocab <= 65536) or uint32
    <shard>.offsets.npy           document boundaries: [D+1] int64, document d is tokens[off[d]:off[d+1]]
    <shard>.docs.npy              per document: [D, 3] int32 = (source index, kind code, prompt length)
Shards: `train` and `holdout` (a seeded split of the shuffled documents) and `generated-NNN`,
written later by `Corpus.add_generated` when the target answers the corpus prompts.

Documents: a prompt is chat-formatted with a generation prompt (what the target sees before
answering); a conversation is chat-formatted whole; a text is its ids followed by a document
separator (the first EOS id).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Protocol, Sequence

import numpy as np

from spd_engine.engine.runtime.progress import Progress
from spd_engine.train.decontaminate import Decontaminator

FORMAT = 1
KINDS = ("prompt", "conversation", "text", "generated")
KIND_CODE = {k: i for i, k in enumerate(KINDS)}


class CorpusTokenizer(Protocol):
    """What the corpus needs from the target tokenizer."""

    vocab_size: int
    eos_ids: list[int]
    special_ids: list[int]  # the chat template's special tokens (always in a draft vocabulary)
    fingerprint: str

    def encode(self, text: str) -> list[int]: ...
    def chat_ids(self, text: str) -> list[int]: ...  # one user turn + generation prompt
    def conversation_ids(self, messages: list[dict]) -> list[int]: ...


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def record_ids(record: dict, tok: CorpusTokenizer) -> tuple[list[int], list[str]]:
    """Token ids of one source record and its raw texts (the latter for decontamination)."""
    kind = record["kind"]
    if kind == "prompt":
        return tok.chat_ids(record["text"]), [record["text"]]
    if kind == "conversation":
        return tok.conversation_ids(record["messages"]), [m["content"] for m in record["messages"]]
    if kind == "text":
        return tok.encode(record["text"]) + [tok.eos_ids[0]], [record["text"]]
    raise ValueError(f"record from {record.get('source')!r} has unknown kind {kind!r}")


def interleave(streams: Sequence[Iterable[dict]]) -> Iterator[dict]:
    """Round-robin over the sources, so a token-limited build still holds every source."""
    iters = [iter(s) for s in streams]
    while iters:
        alive = []
        for it in iters:
            item = next(it, None)
            if item is not None:
                yield item
                alive.append(it)
        iters = alive


@dataclass
class BuildOptions:
    seed: int = 0
    holdout_fraction: float = 0.01
    limit_tokens: int | None = None
    build_command: str = ""

    def __post_init__(self) -> None:
        if not 0.0 <= self.holdout_fraction < 1.0:
            raise ValueError(f"holdout fraction must be in [0, 1), got {self.holdout_fraction}")
        if self.limit_tokens is not None and self.limit_tokens <= 0:
            raise ValueError(f"limit_tokens must be positive, got {self.limit_tokens}")


def build_corpus(out_dir: Path, streams: Sequence[Iterable[dict]], tok: CorpusTokenizer,
                 decon: Decontaminator, opts: BuildOptions,
                 progress: Callable[[str], None] | None = None, bar: bool = False) -> dict:
    """Tokenise, decontaminate, shuffle, split and write the corpus; returns the manifest. `bar`: a bar
    over the tokens collected (its ETA against `limit_tokens`) when stderr is a terminal, instead of
    the `progress` line every 10000 documents."""
    start = time.perf_counter()
    out = Path(out_dir)
    check_out_dir(out)  # fail before the long part, replace the old corpus only after it
    dtype = token_dtype(tok.vocab_size)
    with Progress(opts.limit_tokens, "spd data", progress or (lambda _: None), unit="tok", unit_scale=True,
                  enabled=bar) as shown:
        docs, meta, sources = collect(streams, tok, decon, opts, dtype, progress, shown)
    perm = np.random.default_rng(opts.seed).permutation(len(docs))
    n_holdout = int(round(len(docs) * opts.holdout_fraction))
    splits = {"holdout": perm[:n_holdout], "train": perm[n_holdout:]}
    manifest = {
        "format": FORMAT,
        "tokenizer": {"fingerprint": tok.fingerprint, "vocab_size": tok.vocab_size,
                      "eos_ids": list(tok.eos_ids), "special_ids": sorted(tok.special_ids),
                      "dtype": dtype.name},
        "sources": [dict(name=name, **info) for name, info in sources.items()],
        "splits": {}, "shards": {}, "generated": [],
        "decontamination": decon.report(),
        "seed": opts.seed, "holdout_fraction": opts.holdout_fraction,
        "limit_tokens": opts.limit_tokens, "build_command": opts.build_command,
    }
    remove_old_corpus(out)
    for split, order in splits.items():
        write_shard(out, split, [docs[i] for i in order], [meta[i] for i in order], dtype)
        manifest["shards"][split] = split
        manifest["splits"][split] = {"documents": int(order.size),
                                     "tokens": int(sum(docs[i].size for i in order))}
    manifest["build_seconds"] = round(time.perf_counter() - start, 1)
    write_manifest(out, manifest)
    return manifest


def collect(streams: Sequence[Iterable[dict]], tok: CorpusTokenizer, decon: Decontaminator,
            opts: BuildOptions, dtype: np.dtype, progress: Callable[[str], None] | None,
            shown: Progress | None = None) -> tuple[list[np.ndarray], list[tuple[int, int, int]], dict[str, dict]]:
    """Documents ([T] ids each), their (source index, kind code, prompt length), per-source stats."""
    docs: list[np.ndarray] = []
    meta: list[tuple[int, int, int]] = []
    sources: dict[str, dict] = {}
    total = 0
    for record in interleave(streams):
        ids, texts = record_ids(record, tok)
        src = sources.setdefault(record["source"], {"licence": record["licence"], "kinds": [],
                                                     "samples": 0, "tokens": 0, "dropped": 0})
        if not decon.keep(record["source"], ids, texts):
            src["dropped"] += 1
            continue
        if ids and max(ids) >= tok.vocab_size:
            raise ValueError(f"token id {max(ids)} >= vocab size {tok.vocab_size}")
        if record["kind"] not in src["kinds"]:
            src["kinds"].append(record["kind"])
        src["samples"] += 1
        src["tokens"] += len(ids)
        docs.append(np.asarray(ids, dtype=dtype))
        meta.append((list(sources).index(record["source"]), KIND_CODE[record["kind"]],
                     len(ids) if record["kind"] == "prompt" else 0))
        total += len(ids)
        if shown is not None:
            shown.update(len(ids), f"{len(docs)} documents")
        if progress and len(docs) % 10000 == 0:
            if shown is not None:
                shown.line(f"{len(docs)} documents, {total} tokens")  # plain mode only: the bar counts them
            else:
                progress(f"{len(docs)} documents, {total} tokens")
        if opts.limit_tokens is not None and total >= opts.limit_tokens:
            break
    if not docs:
        raise ValueError("no documents: every source was empty or fully dropped")
    return docs, meta, sources


def check_out_dir(out: Path) -> None:
    """The output must be new, empty, or an old corpus (which the build replaces)."""
    if out.exists() and not (out / "manifest.json").is_file() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty and holds no corpus; choose another output directory")
    out.mkdir(parents=True, exist_ok=True)


def remove_old_corpus(out: Path) -> None:
    """Delete an old corpus's manifest and shards (stale generated shards too); other files stay."""
    for path in out.iterdir():
        if path.name == "manifest.json" or path.name.endswith((".tokens.npy", ".offsets.npy", ".docs.npy")):
            path.unlink()


def write_shard(out: Path, name: str, docs: list[np.ndarray], meta: list[tuple[int, int, int]],
                dtype: np.dtype) -> None:
    lengths = np.fromiter((d.size for d in docs), dtype=np.int64, count=len(docs))
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)  # [D+1]
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate(docs).astype(dtype) if docs else np.empty(0, dtype=dtype)  # [N]
    np.save(out / f"{name}.tokens.npy", tokens)
    np.save(out / f"{name}.offsets.npy", offsets)
    np.save(out / f"{name}.docs.npy", np.asarray(meta, dtype=np.int32).reshape(len(docs), 3))


def write_manifest(out: Path, manifest: dict) -> None:
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, out / "manifest.json")  # readers never see a half-written manifest


class Corpus:
    """Reader of a built corpus directory (arrays are memory-mapped)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        mf = self.path / "manifest.json"
        if not mf.is_file():
            raise ValueError(f"{self.path} is not a corpus directory (no manifest.json)")
        self.manifest = json.loads(mf.read_text())
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{mf}: unsupported corpus format {self.manifest.get('format')!r}")
        self.dtype = np.dtype(self.manifest["tokenizer"]["dtype"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    def _shard(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        load = lambda part: np.load(self.path / f"{name}.{part}.npy", mmap_mode="r")  # noqa: E731
        return load("tokens"), load("offsets"), load("docs")

    def shard_names(self, split: str = "train") -> list[str]:
        if split not in self.manifest["splits"]:
            raise ValueError(f"unknown split {split!r}; corpus has {sorted(self.manifest['splits'])}")
        generated = [g["shard"] for g in self.manifest["generated"] if g["split"] == split]
        return [self.manifest["shards"][split]] + generated

    def documents(self, split: str = "train", kinds: Iterable[str] | None = None) -> Iterator[np.ndarray]:
        """Every document of a split (base shard, then generated shards): [T] token ids each."""
        wanted = None if kinds is None else {KIND_CODE[k] for k in kinds}
        for name in self.shard_names(split):
            tokens, offsets, meta = self._shard(name)
            for d in range(offsets.size - 1):
                if wanted is None or int(meta[d, 1]) in wanted:
                    yield np.asarray(tokens[offsets[d]:offsets[d + 1]])

    def prompts(self, split: str = "train") -> Iterator[np.ndarray]:
        """Chat-formatted prompts (ending in the generation prompt), for self-distillation."""
        return self.documents(split, kinds=("prompt",))

    def sequences(self, max_len: int, split: str = "train", kinds: Iterable[str] | None = None,
                  seed: int | None = None) -> Iterator[np.ndarray]:
        """Packed training sequences: documents concatenated and cut into [max_len] windows.

        Documents run on across window boundaries; the last partial window is dropped. With a
        `seed`, the document order is reshuffled (e.g. one seed per epoch).
        """
        if max_len <= 0:
            raise ValueError(f"max_len must be positive, got {max_len}")
        docs: Iterable[np.ndarray] = self.documents(split, kinds)
        if seed is not None:
            listed = list(docs)
            docs = (listed[i] for i in np.random.default_rng(seed).permutation(len(listed)))
        buf = np.empty(0, dtype=np.int64)
        for doc in docs:
            buf = np.concatenate([buf, doc.astype(np.int64)])
            while buf.size >= max_len:
                yield buf[:max_len]
                buf = buf[max_len:]

    def token_count(self, split: str = "train") -> int:
        return sum(int(self._shard(n)[1][-1]) for n in self.shard_names(split))

    def add_generated(self, prompt_ids: Sequence[Sequence[int]], answer_ids: Sequence[Sequence[int]],
                      split: str = "train", source: str = "generated",
                      licence: str = "output of the target model") -> str:
        """Write one shard of (prompt + target answer) documents; returns the shard name."""
        if len(prompt_ids) != len(answer_ids) or not prompt_ids:
            raise ValueError(f"need equally many prompts and answers, got {len(prompt_ids)} and {len(answer_ids)}")
        self.shard_names(split)  # validates the split
        sources = self.manifest["sources"]
        names = [s["name"] for s in sources]
        if source not in names:
            sources.append({"name": source, "licence": licence, "kinds": ["generated"],
                            "samples": 0, "tokens": 0, "dropped": 0})
            names.append(source)
        docs = [np.asarray(list(p) + list(a), dtype=np.int64) for p, a in zip(prompt_ids, answer_ids)]
        top = max(int(d.max()) for d in docs if d.size)
        if top >= self.vocab_size:
            raise ValueError(f"generated token id {top} >= vocab size {self.vocab_size}")
        meta = [(names.index(source), KIND_CODE["generated"], len(p)) for p in prompt_ids]
        name = f"generated-{len(self.manifest['generated']):03d}"
        write_shard(self.path, name, [d.astype(self.dtype) for d in docs], meta, self.dtype)
        tokens = int(sum(d.size for d in docs))
        entry = sources[names.index(source)]
        entry["samples"] += len(docs)
        entry["tokens"] += tokens
        self.manifest["generated"].append({"shard": name, "split": split, "documents": len(docs),
                                           "tokens": tokens, "source": source})
        write_manifest(self.path, self.manifest)
        return name
