"""The dispatcher's exceptions; each is translated into a `CaseFailure` before it leaves a stage."""

from __future__ import annotations

from evalbus_contracts.results import FailureClass, FailureStage


class DispatcherError(Exception):
    """Root of the dispatcher's exceptions."""


class BackendError(DispatcherError):
    """A backend could not provide or operate a sandbox; carries the failure it stands for."""

    def __init__(
        self,
        message: str,
        *,
        code: str,
        failure_class: FailureClass = "infra",
        stage: FailureStage = "dispatch",
        retryable: bool = True,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.failure_class: FailureClass = failure_class
        self.stage: FailureStage = stage
        self.retryable = retryable
