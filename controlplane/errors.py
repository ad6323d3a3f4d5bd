"""One error type per failure a caller can handle; the CLI maps them to exit codes."""

from __future__ import annotations


class FleetError(Exception):
    """Base of the control plane's own errors."""

    exit_code = 3


class ConfigError(FleetError):
    """The fleet file is missing, not YAML, or not a valid fleet description."""

    exit_code = 3

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: invalid fleet configuration ({len(problems)} problem(s)):\n{lines}")


class DataError(FleetError):
    """A data file (trace, performance profile, fixture) is missing, truncated, damaged or malformed.

    The message names the file (and the line, where there is one) and what is wrong with it.
    """

    exit_code = 3

    def __init__(self, path: object, message: str, line: int | None = None) -> None:
        self.path = str(path)
        self.line = line
        super().__init__(f"{path}:{line}: {message}" if line is not None else f"{path}: {message}")


class StoreUnavailable(FleetError):
    """The store cannot be reached or opened."""

    exit_code = 4


class StoreConflict(FleetError):
    """A write the database refused as inconsistent (e.g. a second open finding for one key)."""

    exit_code = 4


class ActionConflict(StoreConflict):
    """An action was no longer in the state a transition expected: someone else moved it first."""

    def __init__(self, action_id: int, expected: str, current: str) -> None:
        self.action_id = action_id
        self.current = current
        super().__init__(f"action {action_id} is {current}, not {expected}")


class ActionNotFound(FleetError):
    """No action has the given id."""

    exit_code = 3

    def __init__(self, action_id: int) -> None:
        self.action_id = action_id
        super().__init__(f"no action {action_id}")


class ActuationError(FleetError):
    """The actuator could not carry out an action."""

    exit_code = 5


class GateError(FleetError):
    """A canary gate cannot judge: its source keeps failing (or, as GateInputError, it was asked wrongly)."""

    exit_code = 3


class GateInputError(GateError):
    """A canary gate was asked wrongly: a bad selector, a metric its source cannot read, an unknown report format."""
