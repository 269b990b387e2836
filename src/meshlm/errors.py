"""The two errors a user sees as one line: a bad setting (exit 2) and a failure they can act on
(exit 1). At the bottom of the import graph, so any layer can raise them."""

import sys


class ConfigError(ValueError):
    """A bad configuration value; the message is one line that names the key."""


class RunError(RuntimeError):
    """A runtime failure the user can act on (e.g. no usable checkpoint): one line, exit 1."""


def usage_error(message: str) -> int:
    """Print a bad-usage line the way every command does; returns exit code 2."""
    print(f"meshlm: error: {message}", file=sys.stderr)
    return 2
