"""Training-data sources: each yields well-formed records, from fake wheels and from the real packages."""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from spd_engine.train import sources
from spd_engine.train.sources import (
    CHITCHAT_WHEEL,
    EVALS_WHEEL,
    chitchat_records,
    chunk_source,
    evals_prompt,
    evals_records,
    fetch_wheel,
    reasoning_gym_records,
    reasoning_gym_tasks,
    stdlib_records,
)

KINDS = {"prompt", "text", "conversation"}


def check_record(rec: dict, source: str) -> None:
    assert rec["source"] == source
    assert rec["licence"]
    assert rec["kind"] in KINDS
    if rec["kind"] == "conversation":
        assert "text" not in rec
        assert len(rec["messages"]) >= 2
        for i, m in enumerate(rec["messages"]):
            assert m["role"] == ("user" if i % 2 == 0 else "assistant")
            assert isinstance(m["content"], str) and m["content"].strip()
    else:
        assert "messages" not in rec
        assert isinstance(rec["text"], str) and rec["text"].strip()


def real_wheel(spec: tuple[str, str]) -> Path:
    try:
        return fetch_wheel(*spec)
    except ValueError as err:
        pytest.skip(f"package {spec[0]}=={spec[1]} cannot be downloaded here: {err}")


# ---------------------------------------------------------------- evals
def make_evals_wheel(tmp_path: Path, files: dict[str, list]) -> Path:
    path = tmp_path / "evals-0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, rows in files.items():
            body = "".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows)
            zf.writestr(f"evals/registry/data/{name}", body)
    return path


def chat(*pairs: tuple[str, str]) -> dict:
    return {"input": [{"role": r, "content": c} for r, c in pairs], "ideal": "secret answer"}


def test_evals_prompt_takes_last_user_message() -> None:
    assert evals_prompt(chat(("system", "be brief"), ("user", "q1"), ("assistant", "a1"), ("user", " q2 "))) == "q2"
    assert evals_prompt({"input": "plain"}) == "plain"
    assert evals_prompt({"input": [{"role": "user", "content": [{"type": "image"}]}]}) is None
    assert evals_prompt({"sample": 1}) is None


def test_evals_records_cap_dedupe_and_skip_bad_lines(tmp_path: Path) -> None:
    wheel = make_evals_wheel(tmp_path, {
        "big/a.jsonl": [chat(("user", f"question {i}")) for i in range(10)] + ["{broken\n"],
        "big/b.jsonl": [chat(("user", "question 99"))],
        "small/s.jsonl": [chat(("user", "same")), chat(("user", "same")), "{broken\n",
                          chat(("system", "only a system prompt")), chat(("user", "other"))],
    })
    recs = list(evals_records(max_per_eval=4, wheel=wheel))
    for r in recs:
        check_record(r, "evals")
        assert "secret" not in r["text"]  # prompts only, never the ideal answers
    assert [r["text"] for r in recs if r["subset"] == "big"] == [f"question {i}" for i in range(4)]
    assert [r["text"] for r in recs if r["subset"] == "small"] == ["same", "other"]


def test_evals_lfs_pointer_raises(tmp_path: Path) -> None:
    wheel = make_evals_wheel(tmp_path, {"x/samples.jsonl": [
        "version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 12\n"]})
    with pytest.raises(ValueError, match="git-lfs pointer"):
        list(evals_records(wheel=wheel))


def test_real_evals_wheel_ships_data() -> None:
    recs = list(evals_records(max_per_eval=3, wheel=real_wheel(EVALS_WHEEL)))
    for r in recs:
        check_record(r, "evals")
        assert r["kind"] == "prompt"
    subsets = {r["subset"] for r in recs}
    assert len(subsets) > 300  # hundreds of evals ship real jsonl, not lfs pointers
    assert len(recs) <= 3 * len(subsets)


# ---------------------------------------------------------------- chitchat
def test_chitchat_from_fake_wheel(tmp_path: Path) -> None:
    data = {
        "b": {"messages": [[{"text": "hi"}, {"text": "how are you?"}], [{"text": "fine"}], [{"text": "good"}]]},
        "a": {"messages": [[{"text": "anyone home?"}]]},  # never answered: not a conversation
    }
    wheel = tmp_path / "chitchat_dataset-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("chitchat_dataset/dataset.json", json.dumps(data))
    recs = list(chitchat_records(wheel=wheel))
    assert len(recs) == 1
    check_record(recs[0], "chitchat")
    assert recs[0]["messages"] == [{"role": "user", "content": "hi\nhow are you?"},
                                   {"role": "assistant", "content": "fine"},
                                   {"role": "user", "content": "good"}]


def test_real_chitchat_wheel() -> None:
    recs = list(chitchat_records(wheel=real_wheel(CHITCHAT_WHEEL)))
    assert len(recs) > 3000
    for r in recs[:200]:
        check_record(r, "chitchat")


# ---------------------------------------------------------------- reasoning-gym
def test_reasoning_gym_records() -> None:
    pytest.importorskip("reasoning_gym", reason="reasoning-gym (the data extra) is not installed")
    tasks = reasoning_gym_tasks()
    assert "gsm_symbolic" not in tasks
    assert {"basic_arithmetic", "simple_equations", "bf", "codeio"} <= set(tasks)
    recs = list(reasoning_gym_records(per_task=3, tasks=["basic_arithmetic", "bf"]))
    assert len(recs) == 6
    for r in recs:
        check_record(r, "reasoning_gym")
    again = list(reasoning_gym_records(per_task=3, tasks=["basic_arithmetic", "bf"]))
    assert again == recs  # seeded: the corpus is reproducible
    with pytest.raises(ValueError, match="gsm_symbolic"):
        list(reasoning_gym_records(per_task=1, tasks=["gsm_symbolic"]))


# ---------------------------------------------------------------- stdlib
def test_chunk_source_cuts_at_top_level_and_loses_nothing() -> None:
    text = "".join(f"def f{i}():\n    return {i}\n\n" for i in range(50))
    chunks = chunk_source(text, max_chars=100)
    assert "".join(chunks) == text
    assert len(chunks) > 5
    for c in chunks:
        assert c.startswith("def ")  # never cut inside an indented block


def test_stdlib_records(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("x = 1\n")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "third.py").write_text("y = 2\n")
    (tmp_path / "latin.py").write_bytes(b"s = '\xe9'\n")  # not UTF-8: skipped
    recs = list(stdlib_records(root=tmp_path))
    assert [(r["subset"], r["text"]) for r in recs] == [("pkg/mod.py", "x = 1\n")]
    real = list(stdlib_records(max_files=5))
    assert real
    for r in real:
        check_record(r, "stdlib")


def test_cache_root_honours_env(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPD_CACHE", str(tmp_path))
    assert sources.cache_root() == tmp_path
    monkeypatch.delenv("SPD_CACHE")
    assert sources.cache_root() == Path.home() / ".cache" / "spd-engine"


# ---------------------------------------------------------------- the user's own corpora
def test_user_records_from_jsonl_text_files_and_directories(tmp_path: Path) -> None:
    from spd_engine.train.user_sources import chunk_paragraphs, user_records

    f = tmp_path / "c.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "p1"}, {"turns": ["t1", "t2"]}, {"text": "x"},
        {"messages": [{"role": "user", "content": "only a question"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]) + "\n\n")
    recs = list(user_records(f, licence="CC-BY-4.0"))
    assert [r["kind"] for r in recs] == ["prompt", "prompt", "text", "prompt", "conversation"]
    assert [r.get("text") for r in recs[:4]] == ["p1", "t1", "x", "only a question"]
    for r in recs:
        check_record(r, "user:c.jsonl")
        assert r["licence"] == "CC-BY-4.0" and r["subset"] == "c.jsonl"
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "b.txt").write_text("para one\n\npara two")
    (d / "a.md").write_text("alpha")
    (d / "skip.bin").write_bytes(b"\x00")
    recs = list(user_records(d, max_chars=5))
    assert [(r["subset"], r["text"]) for r in recs] == [("a.md", "alpha"), ("sub/b.txt", "para one"),
                                                         ("sub/b.txt", "para two")]
    text = "a" * 10 + "\n\n" + "b" * 10 + "\n\n" + "c" * 3
    assert chunk_paragraphs(text, 15) == ["a" * 10, "b" * 10 + "\n\n" + "c" * 3]
    assert "".join(chunk_paragraphs(text, 100)) == text


@pytest.mark.parametrize("line, message", [
    ('{"nothing": 1}', "c.jsonl:1: expected an object with 'prompt'"),
    ('not json', "c.jsonl:1: not JSON"),
    ('{"messages": [{"role": "user"}]}', "'messages' must be a list"),
])
def test_user_records_name_the_bad_line(tmp_path: Path, line: str, message: str) -> None:
    from spd_engine.train.user_sources import user_records

    (tmp_path / "c.jsonl").write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        list(user_records(tmp_path / "c.jsonl"))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(ValueError, match="must be one of"):
        list(user_records(tmp_path / "x.csv"))
