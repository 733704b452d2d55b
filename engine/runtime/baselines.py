"""Baselines in the same engine: plain pipeline-parallel autoregressive decoding (`pp`) and
autoregressive decoding on one rank (`ar`, which is `pp` with one stage).

Same stage worker, same kernels and shapes as SPD; the last stage holds the final norm + head
and replies with the argmax token id; rank 0 runs stage 0 inline and waits for that reply
before the next token enters, so one token goes through all stages at a time.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from spd_engine.engine.comm.transport import Transport
from spd_engine.engine.model.greedy import check_request, prefill_chunks
from spd_engine.engine.protocol.logits_processing import refuse_processing
from spd_engine.engine.protocol.messages import Header, Kind, sampling_payload
from spd_engine.engine.protocol.metrics import GenerationResult
from spd_engine.engine.protocol.sampling import SamplingParams
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.run_config import RankOptions
from spd_engine.engine.runtime.stage_worker import StageWorker, receive_stats


class PipelineDriver:
    def __init__(self, topo: Topology, stage0: StageWorker, transport: Transport, opts: RankOptions) -> None:
        assert topo.colocate and stage0.stage == 0
        self.topo, self.stage0, self.t = topo, stage0, transport
        self.capacity, self.chunk, self.timeout = opts.capacity, opts.prefill_chunk, opts.timeout_s
        self.last = topo.stage_rank(topo.n - 1)
        self.vocab = stage0.model.cfg.vocab_size

    def _send(self, hdr: Header, payloads: Sequence[torch.Tensor] = ()) -> None:
        for rank in self.topo.stage_ranks(0):  # every TP rank of stage 0 takes the input
            self.t.send(rank, hdr, payloads)
        self.stage0.step()  # stage 0 (its TP rank 0) runs inline on this rank

    def _token(self, hdr: Header) -> None:
        """A decode token: without TP, stage 0 takes it in-process (no loopback message)."""
        if self.topo.tp > 1:
            return self._send(hdr)
        self.stage0.step_local(hdr)

    def _reply(self, tick: int) -> int:
        hdr = self.t.recv_header(self.last, self.timeout, tick)
        assert not self.stage0.wire.to_driver(self.topo.n - 1, hdr), "a head stage replies with a header only"
        return hdr.reply

    @torch.no_grad()
    def generate(self, prompt: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int] = (),
                 draft_policy=None, on_token: Callable[[int], None] | None = None,
                 sampling: SamplingParams = SamplingParams()) -> GenerationResult:
        check_request(prompt, max_new_tokens, self.capacity, self.vocab)
        refuse_processing(sampling, "the pp / ar baselines")
        if sampling.seed >= 1 << 63:
            raise ValueError("the pp/ar baselines take seeds below 2**63")
        res = GenerationResult(tokens=[], n=self.topo.n)
        cfg = sampling_payload(sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed)
        self._send(Header(Kind.CONFIG), [cfg])
        t0 = time.perf_counter()
        ids = torch.tensor(prompt, dtype=torch.long)
        chunks = prefill_chunks(len(prompt), self.chunk)
        for start, count in chunks:
            self._send(Header(Kind.PREFILL, start, 0, length=count), [ids[start:start + count]])
        token = [self._reply(0) for _ in chunks][-1]
        res.prefill_s = time.perf_counter() - t0
        eos = set(eos_ids)
        t1 = time.perf_counter()
        pos = len(prompt)
        while True:
            res.tokens.append(token)
            go_on = on_token(token) if on_token is not None else None  # False: stop after this token
            if token in eos or len(res.tokens) >= max_new_tokens or go_on is False:
                break
            res.ticks += 1
            self._token(Header(Kind.TOKEN, pos, 0, token))
            token = self._reply(res.ticks)
            pos += 1
        res.decode_s = time.perf_counter() - t1
        res.stages = self._finish()
        if any(st["trace"] for st in res.stages):  # stages traced (RunConfig.runtime.trace): no driver events here
            res.trace = {"driver": [], "stages": [st.pop("trace") for st in res.stages]}
        return res

    def _finish(self) -> list[dict[str, float]]:
        self._send(Header(Kind.END))
        return [receive_stats(self.t, self.topo.stage_rank(s), self.timeout) for s in range(self.topo.n)]

    def shutdown(self) -> None:
        self._send(Header(Kind.SHUTDOWN))
        self.t.flush()
