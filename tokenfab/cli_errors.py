"""CLIError: a user mistake on the command line, printed by `tokenfab` (cli.py) as one line, exit code 2.

A leaf, so every part's sub-commands raise it without importing the command dispatcher above them.
"""


class CLIError(Exception):
    """A user mistake: printed as one line, exit code 2."""
