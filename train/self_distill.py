"""Self-distillation data: the target's own greedy answers to training prompts, in batches.

At inference the PDM drafts continuations of the target's own output, so training on the
target's answers (rather than human text) matches the distribution it will see.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from spd_engine.engine.model.greedy import greedy_generate_batch
from spd_engine.engine.model.model import StageModel
from spd_engine.train.corpus import Corpus


def pick_prompts(corpus: Corpus, count: int, max_prompt: int, seed: int = 0, skip: int = 0) -> list[list[int]]:
    """Up to `count` training prompts no longer than max_prompt tokens, in a seeded random order.

    `skip` passes over the first prompts of that order (those already answered), so a run that
    adds answers in several calls never answers the same prompt twice.
    """
    prompts = [p.tolist() for p in corpus.prompts() if 0 < p.size <= max_prompt]
    order = np.random.default_rng(seed).permutation(len(prompts))
    return [prompts[i] for i in order[skip:skip + count]]


@torch.no_grad()
def generate_answers(target: StageModel, prompts: Sequence[Sequence[int]], max_new: int, eos: Sequence[int],
                     batch: int = 16, log: Callable[[str], None] = print) -> list[list[int]]:
    """Greedy answers, batching prompts of similar length together."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: list[list[int]] = [[] for _ in prompts]
    t0 = time.time()
    done_tokens = 0
    for start in range(0, len(order), batch):
        idx = order[start:start + batch]
        outs = greedy_generate_batch(target, [prompts[i] for i in idx], max_new, eos)
        for i, out in zip(idx, outs):
            answers[i] = out
            done_tokens += len(out)
        log(f"self-distill: {min(start + batch, len(order))}/{len(order)} prompts, "
            f"{done_tokens} tokens, {done_tokens / max(1e-9, time.time() - t0):.0f} tok/s")
    return answers


def self_distill(corpus: Corpus, target: StageModel, count: int, max_new: int, eos: Sequence[int],
                 max_prompt: int = 256, batch: int = 16, seed: int = 0, skip: int = 0, log=print) -> str:
    prompts = pick_prompts(corpus, count, max_prompt, seed, skip)
    if not prompts:
        raise ValueError(f"corpus {corpus.path} has no prompts of at most {max_prompt} tokens")
    answers = generate_answers(target, prompts, max_new, eos, batch, log)
    return corpus.add_generated(prompts, answers, source="self-distilled",
                                licence="greedy output of the target model on the prompts above")
