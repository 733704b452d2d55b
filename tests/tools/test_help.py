"""`spd --help` matches the registered commands: every subcommand has a one-line help, every argument of
every subcommand (convert's actions and `spd measure`'s experiments included) has help text, every default
a user gets without asking is shown, and the one-line helps that list choices name every registered choice."""
from __future__ import annotations

import argparse
import importlib

import pytest

from spd_engine.engine.runtime.run_config import MODES
from spd_engine.tools import cli
from spd_engine.tools.bench import CONFIGS
from spd_engine.tools.cli import SUBCOMMANDS
from spd_engine.tools.measure import EXPERIMENTS

pytestmark = pytest.mark.pure  # logic only: builds parsers, runs nothing

SKIP = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def _walk(name: str, parser: argparse.ArgumentParser):
    """(name, parser) for a parser and every nested action parser under it."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _walk(f"{name} {sub_name}", sub)


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every subcommand's parser, built as cli.main builds it, and its nested actions' parsers."""
    out: dict[str, argparse.ArgumentParser] = {}
    for name, (module, help_text) in SUBCOMMANDS.items():
        parser = cli.sub_parser(f"spd {name}", help_text)
        importlib.import_module(module).add_arguments(parser)
        out.update(_walk(name, parser))
    return out


PARSERS = _parsers()


def _one_lines() -> dict[str, str]:
    """Subcommand (and nested action) -> the one-line help `spd --help` (or `spd X --help`) prints for it."""
    out = {name: text for name, (_, text) in SUBCOMMANDS.items()}
    for name, parser in PARSERS.items():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                out.update({f"{name} {c.dest}": c.help for c in action._choices_actions})
    return out


ONE_LINES = _one_lines()


def test_the_top_level_help_lists_every_subcommand():
    text = cli.build_parser().format_help()
    for name, (_, help_text) in SUBCOMMANDS.items():
        assert name in text and help_text.split()[0] in text, name


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_one_line_help(name: str):
    assert name in ONE_LINES, f"spd {name} has no one-line help"
    text = ONE_LINES[name]
    assert text and text.strip() and "\n" not in text, f"spd {name}: {text!r}"


def _check_arguments(name: str, parser: argparse.ArgumentParser) -> None:
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, SKIP):
            continue
        label = action.option_strings[0] if action.option_strings else action.dest
        assert action.help and action.help.strip(), f"spd {name} {label} has no help text"
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            shown = formatter._get_help_string(action) % {**vars(action), "prog": parser.prog}
            assert "default" in shown, f"spd {name} {label}: its default {action.default!r} is not shown"
    assert "(default: None)" not in parser.format_help()


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_every_argument_has_help_and_shows_its_default(name: str):
    _check_arguments(name, PARSERS[name])


class _Parsed(Exception):
    """Raised in place of parsing, carrying the parser an experiment built."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def _experiment_parser(name: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser `spd measure NAME` builds: its main() is stopped where it first parses."""
    def stop(self, *args, **kwargs):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", stop)
    module = EXPERIMENTS[name][0]
    main = importlib.import_module(module if "." in module else f"spd_engine.tools.experiments.{module}").main
    with pytest.raises(_Parsed) as parsed:
        main(["--help"])
    return parsed.value.parser


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_every_experiment_argument_has_help_and_shows_its_default(name: str, monkeypatch):
    assert EXPERIMENTS[name][1].strip() and "\n" not in EXPERIMENTS[name][1], name
    _check_arguments(f"measure {name}", _experiment_parser(name, monkeypatch))


def test_generate_names_every_mode():
    """`spd generate --mode` choices come from RunConfig's modes; the one-line help names each of them."""
    text = ONE_LINES["generate"].lower()
    assert all(mode in text for mode in MODES), (text, MODES)


def test_bench_names_every_system():
    """Every `spd bench --configs` family (ar, pp, tp, spd, eagle, hf) is named in the one-line help."""
    text = ONE_LINES["bench"].replace(",", " ").replace("(", " ").split()
    assert all(config.split("-")[0] in text for config in CONFIGS), (text, CONFIGS)


def test_convert_names_every_action():
    actions = [name.split()[1] for name in PARSERS if name.startswith("convert ")]
    assert actions and all(action in ONE_LINES["convert"] for action in actions), (ONE_LINES["convert"], actions)
