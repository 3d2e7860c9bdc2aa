"""The one exception type a user can cause; the CLI turns it into one sentence and exit code 2."""


class UserError(Exception):
    """Bad input from a user: unknown model, malformed YAML, impossible job, nothing feasible."""
