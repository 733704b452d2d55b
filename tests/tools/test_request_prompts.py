"""Prompt sources shared by spd generate and spd bench (tools/prompt_args.py): --eval-prompts K takes the
first K prompts of each shipped evaluation set, the dev prompts of the speed reports."""
from __future__ import annotations

import argparse
import json

import pytest

from spd_engine.tools.prompt_args import add_request_arguments, load_prompts
from spd_engine.train.evaluate import default_data_dir

pytestmark = pytest.mark.pure


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_request_arguments(p)
    return p.parse_args(list(argv))


def test_eval_prompts_are_the_first_k_of_each_set_in_order():
    got = load_prompts(parse("--eval-prompts", "2", "--prompt", "mine"))
    want = []
    for name in ("mt_bench", "humaneval", "gsm8k"):
        lines = (default_data_dir() / f"{name}.jsonl").read_text().splitlines()[:2]
        want += [json.loads(line)["turns"][0] for line in lines]
    assert got == ["mine", *want] and len(set(want)) == 6


def test_eval_prompts_refuses_a_bad_count():
    with pytest.raises(ValueError, match="--eval-prompts must be >= 1"):
        load_prompts(parse("--eval-prompts", "0"))
