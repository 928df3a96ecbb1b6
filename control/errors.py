"""Error types whose message is fit to show a user as one line (the CLI prints it, no traceback)."""


class DuetError(Exception):
    """Base of all user-facing errors."""


class ConfigError(DuetError):
    """A model or cluster config is missing a field or holds a bad value."""


class WeightLoadError(DuetError):
    """A checkpoint file is missing, corrupt, or a tensor is missing or mis-shaped."""


class InvalidRequestError(DuetError):
    """A request cannot be served as given (empty prompt, too long, bad sampling parameters)."""


class OutOfPagesError(DuetError):
    """The KV pool has too few free pages; the caller waits or refuses the request."""
