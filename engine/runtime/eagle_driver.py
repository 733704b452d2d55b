"""The serial speculative decoding baseline (`--mode eagle`, docs/design.md 3.10) on one rank.

Prefill runs the whole target over the prompt and keeps the fused low/mid/high features of every
position. Each round then drafts a chain of k tokens with the EAGLE head (engine/model/eagle_head.py):
one head forward over the rows whose target features arrived since the last round, then k - 1
single-row steps on the head's own hidden output. ONE target forward of k + 1 tokens (the last
committed token and the k drafts) over the KV cache verifies the chain with the rule SPD uses
(engine/protocol/verify.py, per draft in order): the longest accepted prefix is committed, then the
target's own token at the first rejection (the correction) or after the last draft (the bonus).
KV caches roll back implicitly (engine/model/kv_cache.py): the next round writes from the first slot
that holds a rejected draft. At T>0 every draw is keyed by (seed, position, purpose) as in SPD.

Invariants at the start of a round, with c committed tokens (prompt included): the target's
KV cache holds positions 0..c-2 (the last committed token has not been run); the head's cache
holds the rows of positions < `rows_done`, each made from true target features; `pending` holds
the fused features of positions rows_done..c-2, whose rows the next round computes.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from spd_engine.engine.model.eagle_head import EagleHead, load_eagle, random_eagle
from spd_engine.engine.model.greedy import check_request, prefill_chunks
from spd_engine.engine.model.model import StageModel
from spd_engine.engine.model.pdm import draft_probs_full, greedy_draft
from spd_engine.engine.protocol.logits_processing import refuse_processing
from spd_engine.engine.protocol.metrics import GenerationResult
from spd_engine.engine.protocol.sampling import SamplingParams, keyed_generator, sample, target_probs
from spd_engine.engine.protocol.verify import verify_sampled
from spd_engine.engine.runtime.build import build_stage_model
from spd_engine.engine.runtime.run_config import RunConfig

# (position, greedy draft id at T=0 / draft distribution q [V] at T>0) -> the draft id / q to use
DraftPolicy = Callable[[int, object], object]


@dataclass
class _Request:
    res: GenerationResult
    max_new: int
    eos: frozenset[int]
    sampling: SamplingParams
    policy: DraftPolicy | None
    on_token: Callable[[int], object] | None
    context: list[int]  # prompt + committed tokens
    q_store: dict[int, torch.Tensor] = field(default_factory=dict)  # T>0: position -> q of its draft
    timers: dict[str, float] = field(default_factory=lambda: {"draft": 0.0, "target": 0.0, "verify": 0.0})


class EagleDriver:
    """`generate` has the Driver's signature; one rank runs the target and the head."""

    def __init__(self, target: StageModel, head: EagleHead, k: int, capacity: int, prefill_chunk: int) -> None:
        if k < 1:
            raise ValueError(f"--eagle-k must be >= 1, got {k}")
        assert target.has_embedding and target.has_head and len(target.layer_range) == target.cfg.num_layers
        self.target, self.head, self.k = target, head, k
        self.capacity, self.chunk = capacity, prefill_chunk
        self.device = next(target.parameters()).device
        # allocated once: a request only reads slots it wrote itself (the slot rule, 3.4)
        self.tcache, self.dcache = target.new_cache(1, capacity), head.new_cache(capacity)
        self.req: _Request | None = None

    # ---- generation ----
    @torch.no_grad()
    def generate(self, prompt: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int] = (),
                 draft_policy: DraftPolicy | None = None, on_token: Callable[[int], object] | None = None,
                 sampling: SamplingParams = SamplingParams()) -> GenerationResult:
        check_request(prompt, max_new_tokens, self.capacity, self.target.cfg.vocab_size)
        refuse_processing(sampling, "--mode eagle")
        res = GenerationResult(tokens=[], n=1)
        self.req = req = _Request(res, max_new_tokens, frozenset(eos_ids), sampling, draft_policy, on_token,
                                  list(prompt))
        try:
            t0 = time.perf_counter()
            tcache, dcache = self.tcache, self.dcache
            logits, pending = self._prefill(prompt, tcache)
            first = self._sample_target(logits, len(prompt))
            res.prefill_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            if self._commit(first):
                self._decode(tcache, dcache, pending)
            res.decode_s = time.perf_counter() - t1
            res.ticks = res.target_passes
            res.driver = dict(req.timers)
        finally:
            self.req = None
        return res

    def _prefill(self, prompt: Sequence[int], tcache) -> tuple[torch.Tensor, torch.Tensor]:
        """The target over the prompt in chunks: (logits [V] of the last position, fused features [P, H])."""
        ids = torch.tensor(prompt, dtype=torch.long, device=self.device)
        feats, h = [], None
        for start, count in prefill_chunks(len(prompt), self.chunk):
            h, caps = self.target.forward_layers(self.target.embed(ids[None, start:start + count]), tcache, start,
                                                 capture=self.head.feature_layers)
            feats.append(self.head.fused(caps)[0])  # [count, H]
        return self.target.logits(h[0, -1]), torch.cat(feats)

    def _commit(self, token: int) -> bool:
        """Commit a token; False when the request ends here (EOS, max tokens, or on_token said stop)."""
        req = self.req
        req.res.tokens.append(token)
        req.context.append(token)
        go_on = req.on_token(token) if req.on_token is not None else None
        return token not in req.eos and len(req.res.tokens) < req.max_new and go_on is not False

    def _decode(self, tcache, dcache, pending: torch.Tensor) -> None:
        req, rows_done = self.req, 0
        while True:
            c = len(req.context)
            k = min(self.k, req.max_new - len(req.res.tokens) - 1)  # never draft past the last token
            td = time.perf_counter()
            drafts: list[int] = []
            if k > 0:
                drafts = self._draft_chain(dcache, pending, rows_done, c, k)
                rows_done, pending = c - 1, pending[:0]
            tt = time.perf_counter()
            req.timers["draft"] += tt - td
            ids = torch.tensor([[req.context[-1], *drafts]], device=self.device)  # [1, k+1]
            h, caps = self.target.forward_layers(self.target.embed(ids), tcache, c - 1,
                                                 capture=self.head.feature_layers)
            logits = self.target.logits(h[0])  # [k+1, V]
            req.res.target_passes += 1
            tv = time.perf_counter()
            req.timers["target"] += tv - tt
            going, used = self._verify_chain(logits, drafts, c)
            req.timers["verify"] += time.perf_counter() - tv
            if not going:
                return
            pending = torch.cat([pending, self.head.fused(caps)[0, :used]])  # positions c-1 .. c-2+used

    def _draft_chain(self, dcache, pending: torch.Tensor, rows_done: int, c: int, k: int) -> list[int]:
        """k drafts for positions c..c+k-1: the rows rows_done..c-2 from true features, then the
        head's own hidden output fed back as the feature of the next row."""
        self.req.q_store.clear()  # every draft of the last chain was verified or dropped
        ctx = torch.tensor(self.req.context[rows_done + 1:c], device=self.device)  # x_{rows_done+1} .. x_{c-1}
        assert pending.shape[0] == ctx.numel() == c - 1 - rows_done, (pending.shape, ctx.numel(), c, rows_done)
        rows = self.head.rows(self.target.embed(ctx[None]), pending[None])  # [1, c-1-rows_done, H]
        h = self.head.forward_rows(rows, dcache, rows_done)[0, -1]  # [H]
        drafts = []
        for i in range(k):
            drafts.append(self._draft(h, c + i))
            if i + 1 < k:
                tok = torch.tensor([[drafts[-1]]], device=self.device)
                row = self.head.rows(self.target.embed(tok), h[None, None])  # [1, 1, H]
                h = self.head.forward_rows(row, dcache, c - 1 + i)[0, -1]
        return drafts

    def _verify_chain(self, logits: torch.Tensor, drafts: list[int], c: int) -> tuple[bool, int]:
        """Commit the accepted prefix of the chain and the target's token after it; (request goes on,
        tokens of this pass whose target features are now valid)."""
        res, greedy = self.req.res, self.req.sampling.greedy
        targets = logits.argmax(-1).tolist() if greedy else None  # host sync: one per pass at T=0
        for i, d in enumerate(drafts):
            res.verified += 1
            accepted, token = self._verify(logits[i], c + i, d, targets[i] if greedy else None)
            res.accepted += int(accepted)
            if not self._commit(token):
                return False, i + 1
            if not accepted:
                res.rejections += 1  # followed by at least one more committed token: the request goes on
                return True, i + 1
        token = targets[len(drafts)] if greedy else self._sample_target(logits[len(drafts)], c + len(drafts))
        return self._commit(token), len(drafts) + 1

    # ---- drafting and verification (T = 0: argmax; T > 0: speculative sampling, docs/design.md 3.6) ----
    def _sample_target(self, logits: torch.Tensor, pos: int) -> int:
        """A plain draw from the target distribution p for the token at `pos` (first and bonus tokens)."""
        sp = self.req.sampling
        if sp.greedy:
            return int(logits.argmax())  # host sync: the id is needed to continue
        return sample(target_probs(logits, sp), keyed_generator(sp.seed, pos, "target"))

    def _draft(self, h: torch.Tensor, pos: int) -> int:
        """The draft for `pos` from the head's hidden state [H]."""
        req, sp = self.req, self.req.sampling
        if sp.greedy:
            token = greedy_draft(self.head, h)  # host sync: the next draft step embeds it
            return req.policy(pos, token) if req.policy is not None else token
        q = draft_probs_full(self.head, target_probs(self.head.draft_logits(h), sp))  # [V]
        if req.policy is not None:
            q = req.policy(pos, q)
        req.q_store[pos] = q  # a re-draft of pos in a later round replaces it
        return sample(q, keyed_generator(sp.seed, pos, "draft"))

    def _verify(self, logits: torch.Tensor, pos: int, proposed: int, target: int | None) -> tuple[bool, int]:
        """(accepted, committed token) for the draft at `pos` from the target logits [V] (target:
        their argmax at T=0)."""
        sp = self.req.sampling
        if sp.greedy:
            return target == proposed, target
        q = self.req.q_store.pop(pos)
        return verify_sampled(target_probs(logits, sp), q, proposed, keyed_generator(sp.seed, pos, "accept"),
                              keyed_generator(sp.seed, pos, "residual"))

    def shutdown(self) -> None:
        """Nothing to release: one rank, no peers."""


def build_eagle_driver(ecfg: RunConfig, head: EagleHead | None = None) -> EagleDriver:
    """The eagle runtime of a RunConfig: the whole target and its head (trained, or untrained:
    `eagle_head="random"`, seeded by the run's seed) on this rank."""
    target = build_stage_model(ecfg, range(ecfg.model.cfg.num_layers), embedding=True, head=True)
    if head is None:
        head = random_eagle(ecfg.model.cfg, seed=ecfg.runtime.seed + 1) if ecfg.drafting.eagle_head == "random" else \
            load_eagle(ecfg.drafting.eagle_head, ecfg.model.cfg)
    head = head.to(device=ecfg.parallel.device, dtype=ecfg.model.torch_dtype).eval()
    return EagleDriver(target, head, ecfg.drafting.eagle_k, ecfg.runtime.capacity, ecfg.runtime.prefill_chunk)
