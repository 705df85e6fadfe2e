"""The command-line conventions every console script follows (`epp`, `modelserver` and the workshop's): flags are
written in full (no abbreviations: `--pool` is not `--pool-file`), each flag's help ends with its default, `--version`
prints the installed package's version, a flag that means something only beside another one refuses to be given
alone, and a mistake is one line naming the fix instead of the usage block."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Callable, Sequence

DISTRIBUTION = "llm-routing-reference"


def package_version() -> str:
    """The installed distribution's version (pyproject.toml's), or a note that this checkout is not installed."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed: run `pip install -e .`)"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written; every flag's help followed by its default, unless the help already says it or
    there is none to say (no value, a switch that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or "default" in text
            or default is None
            or default is False
            or default == argparse.SUPPRESS
            or (isinstance(default, list | tuple) and not default)
        ):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, list | tuple) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


class Parser(argparse.ArgumentParser):
    """argparse with the conventions above. Subcommands' parsers (`add_subparsers().add_parser`) are Parsers too."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self._needs: list[tuple[str, str, Callable[[argparse.Namespace], bool]]] = []

    def needs(self, flag: str, requirement: str, met: Callable[[argparse.Namespace], bool]) -> None:
        """`flag`, when written on the command line, needs `requirement` (the error's words), which `met` checks on
        the parsed arguments: `p.needs("--once", "--demo", lambda a: a.demo)`."""
        if flag not in self._option_string_actions:
            raise ValueError(f"needs: no flag {flag}")
        self._needs.append((flag, requirement, met))

    def parse_known_args(self, args: Sequence[str] | None = None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        parsed, extras = super().parse_known_args(args, namespace)
        written = self.written(args)
        for flag, requirement, met in self._needs:
            if self._option_string_actions[flag] in written and not met(parsed):
                self.error(f"{flag} needs {requirement}")
        return parsed, extras

    def written(self, args: Sequence[str]) -> set[argparse.Action]:
        """This parser's flags that `args` writes (`--flag value` or `--flag=value`)."""
        written = set()
        for token in args:
            if token == "--":
                break
            action = self._option_string_actions.get(token.split("=", 1)[0])
            if action is not None:
                written.add(action)
        return written

    def error(self, message: str):
        """One line naming the mistake and where the flags are explained, not the usage block."""
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def command_parser(prog: str, description: str | None) -> Parser:
    """The parser of a console script, with `--version`."""
    parser = Parser(prog=prog, description=description)
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {package_version()}", help="print the version and exit"
    )
    return parser


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value
