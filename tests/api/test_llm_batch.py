"""The Python API with max_batch: several prompts in the pipeline at once give each prompt's greedy
tokens; a closed LLM refuses work and another can start (one per process at a time)."""
from __future__ import annotations

import pytest
from helpers import random_prompts, reference

from spd_engine import LLM, SamplingParams
from spd_engine.engine.runtime.run_config import PRESETS

pytestmark = pytest.mark.multiproc


def test_several_requests_at_once_equal_greedy_then_close():
    prompts = random_prompts(PRESETS["tiny-llama"], [3, 7, 5], seed=8)
    llm = LLM("random:tiny-llama", stages=2, threads=1, prefill_chunk=16, max_batch=2)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=14, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == [reference(llm.config, p, 14) for p in prompts]
    finally:
        llm.close()
    llm.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        llm.generate([4, 5])
    with LLM("random:tiny-llama", stages=2, threads=1, suffix_run=1) as again:  # the process group was left
        assert len(again.generate([4, 5], SamplingParams(max_tokens=3))[0].outputs[0].token_ids) == 3


def test_a_script_without_a_main_guard_runs(tmp_path):
    """Spawned ranks do not run the user's script again (it would build another LLM in every rank)."""
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text("from spd_engine import LLM, SamplingParams\n"
                      "llm = LLM('random:tiny-llama', stages=2, threads=1)\n"
                      "print('reply', llm.generate([4, 5], SamplingParams(max_tokens=3))[0].outputs[0].token_ids)\n"
                      "llm.close()\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("reply") == 1, proc.stdout


@pytest.mark.parametrize("mode", ["ar", "pp"])
def test_baseline_modes_equal_greedy(mode):
    prompt = random_prompts(PRESETS["tiny-llama"], [4], seed=10)[0]
    stages = 1 if mode == "ar" else 2
    with LLM("random:tiny-llama", mode=mode, stages=stages, threads=1, prefill_chunk=16) as llm:
        out = llm.generate(prompt, SamplingParams(max_tokens=9, ignore_eos=True))[0].outputs[0]
        assert out.token_ids == reference(llm.config, prompt, 9)
        with pytest.raises(ValueError, match="capacity|exceeds"):
            llm.generate(prompt, SamplingParams(max_tokens=10 ** 6))
