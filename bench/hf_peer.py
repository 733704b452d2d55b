"""The external peer of `spd bench`: transformers' own `generate` on the same prompts, machine and
thread count, plain greedy (`hf`), with prompt-lookup decoding (`hf-lookup`,
`prompt_lookup_num_tokens`: drafts copied from the prompt's n-grams, verified in one target pass),
and with assisted generation (`hf-assisted`: classic draft-model speculative decoding, a smaller
model of the same tokenizer drafting, `--assistant MODEL`), so a user sees our tok/s beside a
library they know.

The runtime mirrors the engine's (`generate(prompt, max_new, eos, ...) -> GenerationResult`), so
`bench/speed.py` times it the same way: token times come from a generate streamer (a lookup pass
that commits several tokens stamps them all at once), `ticks` counts target forward passes after
the prefill, so `eal` is the tokens committed per target pass. HF computes with its own kernels,
so its greedy tokens may leave ours at a near-tie: equality is reported, never assumed.
"""
from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from spd_engine.engine.protocol.metrics import GenerationResult

DEFAULT_LOOKUP_TOKENS = 10  # the value transformers' prompt-lookup documentation suggests


@dataclass(frozen=True)
class HFPeer:
    hf_dir: Path
    dtype: torch.dtype
    threads: int
    lookup_tokens: int | None = None  # None: plain greedy generate
    assistant_dir: Path | None = None  # assisted generation with this draft model (HF directory)

    def __post_init__(self) -> None:
        if self.lookup_tokens is not None and self.assistant_dir is not None:
            raise ValueError("a transformers peer drafts by prompt lookup or by an assistant model, not both")
        if self.lookup_tokens is not None and self.lookup_tokens < 1:
            raise ValueError(f"--lookup-tokens must be >= 1, got {self.lookup_tokens}")

    @contextlib.contextmanager
    def open(self) -> Iterator["HFRuntime"]:
        try:
            from transformers import AutoModelForCausalLM
            from transformers.utils import logging as hf_logging
        except ImportError as err:
            raise ValueError("the hf and hf-lookup rows need transformers (pip install transformers)") from err
        hf_logging.disable_progress_bar()
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            model = AutoModelForCausalLM.from_pretrained(self.hf_dir, dtype=self.dtype, local_files_only=True)
            assistant = None if self.assistant_dir is None else AutoModelForCausalLM.from_pretrained(
                self.assistant_dir, dtype=self.dtype, local_files_only=True).eval()
            yield HFRuntime(model.eval(), self.lookup_tokens, assistant)
        finally:
            torch.set_num_threads(before)


class _Clock:
    """A generate streamer: the first put is the prompt, every later one the tokens just committed."""

    def __init__(self, on_token: Callable[[int], object] | None) -> None:
        self.on_token, self.times, self.prompt_seen = on_token, [], False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        now = time.perf_counter()
        for tok in value.reshape(-1).tolist():
            self.times.append(now)
            if self.on_token is not None:
                self.on_token(tok)

    def end(self) -> None:
        pass


class HFRuntime:
    def __init__(self, model, lookup_tokens: int | None, assistant=None) -> None:
        self.model, self.lookup_tokens, self.assistant, self.passes = model, lookup_tokens, assistant, 0
        forward = model.forward

        def counted(*a, **kw):
            self.passes += 1
            return forward(*a, **kw)

        model.forward = counted  # target passes: the prefill, then one per decode step or lookup round

    def _config(self, max_new: int, eos: Sequence[int]):
        gc = copy.deepcopy(self.model.generation_config)
        gc.do_sample, gc.temperature, gc.top_p, gc.top_k = False, None, None, None  # greedy, as the ar row
        gc.max_new_tokens, gc.min_new_tokens = max_new, None
        gc.eos_token_id = list(eos)  # []: run to max_new (--ignore-eos); None would fall back to the model's EOS
        gc.pad_token_id = gc.pad_token_id if gc.pad_token_id is not None else 0
        gc.prompt_lookup_num_tokens = self.lookup_tokens
        return gc

    @torch.no_grad()
    def generate(self, prompt: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int] = (),
                 draft_policy=None, on_token: Callable[[int], object] | None = None) -> GenerationResult:
        assert draft_policy is None, "synthetic acceptance applies to the engine's spd rows only"
        ids = torch.tensor([list(prompt)], dtype=torch.long)  # [1, P]
        clock, self.passes = _Clock(on_token), 0
        t0 = time.perf_counter()
        extra = {} if self.assistant is None else {"assistant_model": self.assistant}
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=self._config(
            max_new_tokens, eos_ids), streamer=clock, **extra)
        res = GenerationResult(tokens=out[0, len(prompt):].tolist(), n=1, ticks=max(0, self.passes - 1))
        assert len(clock.times) == len(res.tokens), "the streamer saw every committed token"
        if clock.times:
            res.prefill_s, res.decode_s = clock.times[0] - t0, clock.times[-1] - clock.times[0]
        return res
