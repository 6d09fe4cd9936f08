"""quantree's own error and warning types, so callers can catch exactly what we raise."""


class QuantreeError(Exception):
    """A problem with the model, its annotation or the call order.

    Messages name the node and the op involved and say what to do about it.
    """


class QuantreeWarning(UserWarning):
    """Something was left in float or approximated; the model still runs."""
