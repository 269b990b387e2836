"""The two errors a user sees as one line: a bad setting (exit 2) and a failure they can act on
(exit 1). At the bottom of the import graph, so any layer can raise them."""

import argparse
import contextlib
import sys
from pathlib import Path


class ConfigError(ValueError):
    """A bad configuration value; the message is one line that names the key."""


class RunError(RuntimeError):
    """A runtime failure the user can act on (e.g. no usable checkpoint): one line, exit 1."""


@contextlib.contextmanager
def naming(path: str | Path):
    """An OSError inside names `path`: a full disk fails in write() or flush(), whose error names
    no file ("[Errno 28] No space left on device"), so the user could not tell which disk."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


def unwritable(path: str | None, flag: str) -> str | None:
    """Why the output file `path` cannot be written, naming `flag` (its directory does not exist,
    or is a file), or None: checked before the work whose result it would hold."""
    if path is None:
        return None
    parent = Path(path).expanduser().absolute().parent
    return None if parent.is_dir() else f"{flag}: {parent} is not a directory"


def unusable_directory(path: str | Path, flag: str) -> str | None:
    """Why `path` cannot be a directory to write into, naming `flag`: it, or the nearest part of
    its path that exists, is not a directory; None if it is one or can be made."""
    full = Path(path).expanduser().absolute()
    found = next(p for p in (full, *full.parents) if p.exists())
    if found.is_dir():
        return None
    return f"{flag}: {path} exists and is not a directory" if found == full else \
        f"{flag}: {path} cannot be made: {found} is not a directory"


def usage_error(message: str) -> int:
    """Print a bad-usage line the way every command does; returns exit code 2."""
    print(f"meshlm: error: {message}", file=sys.stderr)
    return 2


class OneLineErrorParser(argparse.ArgumentParser):
    """The argument parser of every command: a usage error is `PROG: error: MESSAGE (see PROG
    --help)` on one line, exit 2, not argparse's usage block first (that is what --help is for).
    Subcommand parsers (`add_subparsers().add_parser`) are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
