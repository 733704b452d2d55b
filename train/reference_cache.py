"""A disk cache of greedy reference outputs, so that evaluating many heads on one target decodes once.

The T=0 fast path (train/fast_eval.py) spends most of its time in the greedy reference decode,
which does not depend on the head. An entry is keyed by everything that decides that output:
the target's weights (the checkpoint's index.json, which lists every shard's sha256, or the
random preset and seed), its dtype, the prompt ids, max_new_tokens, the EOS ids and the prefill
chunk. Entries are JSON files written atomically; an unreadable entry is recomputed.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from spd_engine.engine.runtime.run_config import RunConfig, random_preset


def weights_identity(ecfg: RunConfig) -> str:
    """What names the target's weights: a random preset + seed, or the checkpoint index bytes."""
    if random_preset(ecfg.model.source) is not None:
        return f"{ecfg.model.source}|seed={ecfg.runtime.seed}|{ecfg.model.cfg.fingerprint()}"
    index = Path(ecfg.model.source) / "index.json"
    return hashlib.sha256(index.read_bytes()).hexdigest()


class ReferenceCache:
    def __init__(self, path: str | Path, ecfg: RunConfig) -> None:
        self.dir = Path(path)
        if self.dir.exists() and not self.dir.is_dir():
            raise ValueError(f"--reference-cache {self.dir} exists and is not a directory")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.model = f"{weights_identity(ecfg)}|{ecfg.model.dtype}|{ecfg.parallel.device}"
        if ecfg.resolved_weight_layout != "row":  # another BLAS kernel rounds otherwise (engine/model/linear.py)
            self.model += f"|layout={ecfg.resolved_weight_layout}"
        self.hits = 0

    def key(self, prompt: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int], chunk: int) -> str:
        blob = json.dumps([self.model, list(prompt), max_new_tokens, sorted(eos_ids), chunk])
        return hashlib.sha256(blob.encode()).hexdigest()

    def get_or_compute(self, prompt: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int], chunk: int,
                       compute: Callable[[], list[int]]) -> list[int]:
        path = self.dir / f"{self.key(prompt, max_new_tokens, eos_ids, chunk)}.json"
        try:
            tokens = json.loads(path.read_text())["tokens"]
            self.hits += 1
            return tokens
        except (OSError, ValueError, KeyError):
            pass  # missing or unreadable: decode again
        tokens = compute()
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"tokens": tokens}))
        tmp.replace(path)
        return tokens
