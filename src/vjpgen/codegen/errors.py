"""The generator's one error type: a one-line message naming file:line, the entry and what to do."""


class GenerateError(Exception):
    """Bad generator input; the CLI prints the message and exits with status 2."""
