"""The tokens a stage that holds the head computes from its step's output: T=0 verification's
argmax on a verifying last stage (docs/design.md 3.6; at T > 0 the driver verifies against its
q), and the next token of the pp / ar baselines' head stage (argmax, or a keyed draw).

On a TP stage every TP rank takes part: a vocab-parallel head picks the token across its ranks.
"""
from __future__ import annotations

import time

import torch

from spd_engine.engine.model.graphs import VerifyStep
from spd_engine.engine.model.model import StageModel
from spd_engine.engine.protocol.messages import META_FIELDS, Header
from spd_engine.engine.protocol.metrics import StageStats
from spd_engine.engine.protocol.sampling import SamplingParams, keyed_generator, sample, target_probs
from spd_engine.engine.runtime.run_config import StepMode

_REPLY = META_FIELDS.index("reply")


class StageHead:
    """A stage's head tokens; `sampling` is the request's (a CONFIG message sets it)."""

    def __init__(self, model: StageModel, verifies: bool, step_mode: StepMode) -> None:
        """verifies: a last stage that verifies at T=0; step_mode: how its one-token steps run."""
        self.model, self.verifies = model, verifies
        self.choose = getattr(model, "choose_token", None)  # a vocab-parallel head: the token across TP ranks
        self.sampling = SamplingParams()
        # a verifying SPD stage runs the head as its own step, only at T=0 (the pp head stage's is inside)
        self.verify_step = VerifyStep(model, graphs=step_mode == StepMode.GRAPH) \
            if step_mode != StepMode.EAGER and verifies else None

    def reply(self, hdr: Header, out: torch.Tensor, greedy: torch.Tensor | None) -> int:
        """The token a TOKEN or PREFILL report's header carries for the step's output out [1, T, H]
        (greedy: a static step's argmax [1]); -1: none (every SPD stage: a verifying last stage
        answers the decode rows of BATCH messages, reply_rows, and nothing for a prefill chunk)."""
        if self.verifies or not self.model.has_head:
            return -1
        if greedy is not None and self.sampling.greedy:
            return int(greedy)  # host sync: the id goes in the header; the step ran the head
        # eager steps, prefill, and sampling (which needs the logits, not the argmax)
        return self.next_token(out[0, -1], hdr.position + hdr.num_tokens)

    def reply_rows(self, meta: torch.Tensor, out: torch.Tensor, stats: StageStats) -> None:
        """A BATCH step's T=0 argmax of each row whose reply field asks for one (-1; -2: a sampled
        request's row) into its table meta [R, META_LEN], from out [1, R, H]."""
        asked = meta[:, _REPLY] == -1  # [R]
        if not bool(asked.any()):
            return
        tv = time.perf_counter()
        if len(meta) == 1 and self.verify_step is not None:  # a request alone: the static head step
            meta[0, _REPLY] = int(self.verify_step.run(out[0, -1]))  # host sync: the id goes in the table
        elif bool(asked.all()):
            meta[:, _REPLY] = self.argmax_rows(out[0])
        else:
            rows = asked.nonzero()[:, 0]  # [r]
            meta[rows, _REPLY] = self.argmax_rows(out[0, rows.to(out.device)])
        stats.verify_s += time.perf_counter() - tv

    def argmax_rows(self, out: torch.Tensor) -> torch.Tensor:
        """The target's argmax of each row of a BATCH step's or a suffix run's exit out [R, H]: ids [R]
        (int64, host).
        A vocab-parallel head (a TP stage) picks them across its ranks, every TP rank taking part;
        a screened head (kernels/screened_argmax.py) settles each row exactly from one int8 product
        for all rows, as a one-row step's verification does (the full fp32 head over R rows cost a
        batch's last stage most of its step on a CPU)."""
        if self.choose is None and self.model.screen is not None:
            return torch.tensor(self.model.greedy_tokens(out), dtype=torch.int64)  # host: the ids go in the table
        logits = self.model.logits_rows(out)  # [R, V], or this TP rank's [R, V/T]
        if self.choose is not None:
            return self.model.argmax_rows(logits)
        return logits.argmax(-1).cpu()  # host sync: the ids go in the table

    def next_token(self, h: torch.Tensor, pos: int) -> int:
        """The head stage's token for position `pos` from the hidden state h [H] (argmax, or a keyed draw from p)."""
        if self.choose is not None:  # logits: this TP rank's vocabulary shard
            return self.choose(self.model.logits(h), self.sampling, pos)
        if self.sampling.greedy:
            return self.model.greedy_token(h)  # host sync inside: the id goes in the header
        probs = target_probs(self.model.logits(h), self.sampling)
        return sample(probs, keyed_generator(self.sampling.seed, pos, "target"))
