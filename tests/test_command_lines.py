"""Every console script follows the command-line conventions (protocol/cli.py): each flag has a description and its
default, abbreviations are refused, `--version` prints the package's version, and a flag that needs another one
refuses to be given alone, in one line."""

import argparse
import importlib
import importlib.metadata

import pytest

from protocol.cli import DISTRIBUTION, Parser, command_parser, package_version

SCRIPTS = {
    ep.name: ep for ep in importlib.metadata.distribution(DISTRIBUTION).entry_points if ep.group == "console_scripts"
}


def test_every_console_script_is_walked():
    assert set(SCRIPTS) == {"epp", "modelserver", "epp-local", "msp-conformance", "gateway-conformance", "epp-bench"}


def parsers(parser: argparse.ArgumentParser):
    """`parser` and its subcommands' parsers."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from parsers(sub)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_flag_has_a_description_and_its_default(script):
    module = importlib.import_module(SCRIPTS[script].module)
    for parser in parsers(module.build_parser()):
        assert isinstance(parser, Parser) and parser.allow_abbrev is False, parser.prog
        formatter = parser.formatter_class(parser.prog)
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._VersionAction | argparse._SubParsersAction):
                continue
            text = formatter._get_help_string(action)
            assert action.help and action.help.strip(), f"{parser.prog} {action.option_strings}: no description"
            default = action.default
            if default not in (None, False, [], ()) and action.option_strings:
                assert "default" in text, f"{parser.prog} {action.option_strings}: its default {default!r} unsaid"


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_version(script, capsys):
    main = SCRIPTS[script].load()
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.strip() == f"{script} {importlib.metadata.version(DISTRIBUTION)}"


@pytest.mark.parametrize(
    ("script", "argv", "error"),
    [
        ("epp", ["--pool", "p.yaml"], "unrecognized arguments: --pool"),  # abbreviations are not taken
        ("epp-local", ["--model-server", "3"], "unrecognized arguments: --model-server"),
        ("modelserver", ["--max-lora", "2"], "unrecognized arguments: --max-lora"),
        ("epp", ["--pool-file", "p.yaml", "--kubeconfig", "k"], "--kubeconfig needs --pool-name"),
        ("epp", ["--pool-file", "p", "--kv-events-port", "0", "--kv-events-replay-port-offset", "1"], "KV events on"),
        ("epp", ["--pool-file", "p", "--config-file", "a", "--config-text", "b"], "not allowed with"),
        ("epp-local", ["--once"], "--once needs --demo"),
        ("epp-local", ["--requests", "3"], "--requests needs --demo"),
        ("epp-local", ["--observed-responses-percent", "50"], "needs --response-body-mode FULL_DUPLEX_STREAMED"),
        ("epp-local", ["--model-servers", "0"], "'0' is not a whole number of at least 1"),
        ("epp-local", ["--model-server-url", "http://h:1", "--backend", "sim"], "--backend needs epp-local's own"),
        ("epp-local", ["--model-server-url", "http://h:1", "--pool-file", "p"], "not allowed with"),
        ("modelserver", ["--max-loras", "2"], "--max-loras needs --enable-lora or --lora-modules"),
        ("modelserver", ["--dtype", "float16"], "--dtype needs --backend torch"),
        ("modelserver", ["--backend", "torch", "--sim-decode-base", "0.1"], "--sim-decode-base needs --backend sim"),
        ("modelserver", ["--replicas", "0"], "'0' is not a whole number of at least 1"),
        ("msp-conformance", ["--url", "http://h:1", "--kv-hash-seed", "0"], "--kv-hash-seed needs --kv-events"),
        ("msp-conformance", ["--url", "http://h:1", "--organization", "o"], "--organization needs --report"),
        ("msp-conformance", ["--url", "u", "--kv-events-endpoint", "a", "--kv-events-bind", "b"], "not allowed with"),
        ("gateway-conformance", ["--project", "p"], "--project needs --report"),
        ("epp-bench", ["compare", "--rates", "8", "--concurrency", "4"], "--rates needs no --concurrency"),
    ],
)
def test_mistakes_are_one_line_naming_the_fix(script, argv, error, capsys):
    main = SCRIPTS[script].load()
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and error in lines[0] and f"see {script}" in lines[0], lines


def test_help_says_defaults_it_can_and_only_those():
    p = command_parser("tool", "what it does")
    p.add_argument("--port", type=int, default=8000, help="where")
    p.add_argument("--name", help="who")
    p.add_argument("--quiet", action="store_true", help="less")
    p.add_argument("--ratio", type=float, default=0.0, help="how much (default: none)")
    p.add_argument("--speeds", nargs="+", default=[1.0, 0.5], help="each")
    text = p.format_help()
    assert "where (default: 8000)" in text and "each (default: 1.0 0.5)" in text
    assert "who\n" in text and "less\n" in text and "(default: none)" in text and "(default: 0.0)" not in text


def test_a_needed_flag_is_checked_only_when_written():
    p = command_parser("tool", None)
    p.add_argument("--mode", default="a", help="m")
    p.add_argument("--level", type=int, default=3, help="l")
    p.needs("--level", "--mode b", lambda a: a.mode == "b")
    assert p.parse_args([]).level == 3  # its default alone is not a mistake
    assert p.parse_args(["--mode", "b", "--level=4"]).level == 4
    with pytest.raises(SystemExit):
        p.parse_args(["--level=4"])
    with pytest.raises(ValueError):
        p.needs("--lvl", "x", lambda a: True)


def test_package_version_is_the_installed_one():
    assert package_version() == importlib.metadata.version(DISTRIBUTION)
