"""Logits processing (engine/protocol/logits_processing.py) against vLLM's rules written out token by
token in plain Python: repetition over prompt and output (logit > 0 divided, else multiplied), then
frequency and presence over the output, EOS masked below min_tokens; pending tokens count as output;
neutral values change nothing; bad values are refused naming the field."""
from __future__ import annotations

import math

import pytest
import torch

from spd_engine.engine.protocol.logits_processing import TokenHistory, apply_penalties, refuse_processing
from spd_engine.engine.protocol.sampling import SamplingParams

V = 12


def by_hand(logits: list[float], prompt: list[int], output: list[int], sp: SamplingParams, eos: list[int]
            ) -> list[float]:
    """vLLM's processing of one position, one token at a time."""
    out = []
    for t, x in enumerate(logits):
        count = output.count(t)
        if t in prompt or count:
            x = x / sp.repetition_penalty if x > 0 else x * sp.repetition_penalty
        x = x - sp.frequency_penalty * count
        x = x - sp.presence_penalty * (count > 0)
        if len(output) < sp.min_tokens and t in eos:
            x = -math.inf
        out.append(x)
    return out


CASES = [SamplingParams(repetition_penalty=1.7), SamplingParams(repetition_penalty=0.6),
         SamplingParams(frequency_penalty=0.9), SamplingParams(presence_penalty=-1.5),
         SamplingParams(min_tokens=3), SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5,
                                                       presence_penalty=0.25, min_tokens=2, temperature=0.8)]


@pytest.mark.parametrize("sp", CASES)
def test_processing_equals_vllm_rules_written_out(sp):
    gen = torch.Generator().manual_seed(0)
    prompt, eos = [1, 4, 4, 9], [2, 11]
    hist = TokenHistory(sp, prompt, eos)
    output: list[int] = []
    for step, tok in enumerate([4, 7, 7, 2, 7, 0]):
        logits = torch.randn(V, generator=gen) * 3
        got = hist.process(logits, len(prompt) + step)
        want = torch.tensor(by_hand(logits.tolist(), prompt, output, sp, eos))
        assert torch.allclose(got, want, atol=1e-6), (step, got, want)
        assert got is not logits
        hist.extend([tok])
        output.append(tok)


def test_pending_tokens_count_as_output():
    sp = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5, min_tokens=4)
    prompt, eos = [3, 5], [6]
    logits = torch.linspace(-2, 3, V)
    committed = TokenHistory(sp, prompt, eos)
    committed.extend([8, 8, 1])
    pending = TokenHistory(sp, prompt, eos)
    pending.extend([8])
    pending.process(logits, 3)  # counts made on first use, then kept by extend
    assert torch.equal(pending.process(logits, 5, pending=(8, 1)), committed.process(logits, 5))
    assert float(committed.process(logits, 5)[6]) == -math.inf  # 3 output tokens < min_tokens 4
    committed.extend([2])
    assert math.isfinite(float(committed.process(logits, 6)[6]))
    with pytest.raises(AssertionError, match="position 7"):
        committed.process(logits, 7)  # a position whose output before it the history does not hold


def test_neutral_values_change_nothing_and_say_so():
    sp = SamplingParams(temperature=0.7, top_k=5, seed=3)
    assert not sp.processes
    logits = torch.randn(V)
    out = apply_penalties(logits, torch.ones(V, dtype=torch.bool), torch.ones(V), sp)
    assert torch.equal(out, logits)
    assert all(SamplingParams(**kw).processes for kw in (dict(repetition_penalty=1.01), dict(min_tokens=1),
                                                         dict(presence_penalty=-0.1), dict(frequency_penalty=2)))
    refuse_processing(sp, "x")
    with pytest.raises(ValueError, match="--mode spd"):
        refuse_processing(SamplingParams(min_tokens=1), "--mode eagle")


@pytest.mark.parametrize("kw,field", [(dict(repetition_penalty=0), "repetition_penalty"),
                                      (dict(repetition_penalty=-1.0), "repetition_penalty"),
                                      (dict(repetition_penalty=math.inf), "repetition_penalty"),
                                      (dict(presence_penalty=2.5), "presence_penalty"),
                                      (dict(frequency_penalty=-2.01), "frequency_penalty"),
                                      (dict(frequency_penalty=True), "frequency_penalty"),
                                      (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=1.0), "min_tokens")])
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"sampling: {field}"):
        SamplingParams(**kw)


def test_generation_config_overrides_take_the_new_fields():
    sp = SamplingParams.from_generation_config({"do_sample": True, "temperature": 0.6}, repetition_penalty=1.2,
                                               min_tokens=None)
    assert (sp.temperature, sp.repetition_penalty, sp.min_tokens) == (0.6, 1.2, 0)
