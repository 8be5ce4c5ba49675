"""The benchmark and device-check scripts (README.md, Benchmarks: which does what)."""
from __future__ import annotations

import argparse
import sys

HELP = {"help_option_names": ["-h", "--help"]}  # click's context settings: -h as megakernel's commands take it


def run_click(command) -> None:
    """Run a click command as a script's entry: a usage error (an unknown option, a bad value) is one `error:` line
    and exit 2, as `megakernel`'s commands give it (click's own is a usage block)."""
    import click
    try:
        rv = command(standalone_mode=False)
    except click.UsageError as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("error: aborted", err=True)
        sys.exit(1)
    sys.exit(rv if isinstance(rv, int) else 0)


class ScriptParser(argparse.ArgumentParser):
    """argparse for the scripts that take no click: a usage error is one `error:` line and exit 2, as `megakernel`'s
    commands give it (argparse's own is a usage block)."""

    def error(self, message):
        sys.stderr.write(f"error: {message}\n")
        sys.exit(2)
