"""The one error type for bad audit data: unreadable runs, tampered files, invalid certificates."""


class AuditError(ValueError):
    """A run, stream or certificate that cannot be used; the message names the file and the problem."""
