"""evalbus dispatcher: fans batches out into cases and executes each on a backend, releasing the
sandbox at its last use.

The stage logic here is independent of NATS; the service wiring feeds it requests and publishes
what it returns.
"""

from evalbus_dispatcher.backends.base import Backend, Capacity, HarnessRun, OnOutput, OutputStream, SandboxHandle
from evalbus_dispatcher.backends.local import LocalBackend, LocalSandbox
from evalbus_dispatcher.cancellation import cancelled_execution
from evalbus_dispatcher.collect import TracePuller, trace_ref_for
from evalbus_dispatcher.errors import BackendError, DispatcherError
from evalbus_dispatcher.execute import execute_case, merge_marks, run_id_of
from evalbus_dispatcher.fanout import fan_out, plan_of, unique_cases
from evalbus_dispatcher.harness_output import HarnessOutput, parse_stdout
from evalbus_dispatcher.live import LiveSink, LiveTee
from evalbus_dispatcher.retry import next_attempt, should_retry

__all__ = [
    "Backend",
    "BackendError",
    "Capacity",
    "DispatcherError",
    "HarnessOutput",
    "HarnessRun",
    "LiveSink",
    "LiveTee",
    "LocalBackend",
    "LocalSandbox",
    "OnOutput",
    "OutputStream",
    "SandboxHandle",
    "TracePuller",
    "cancelled_execution",
    "execute_case",
    "fan_out",
    "merge_marks",
    "next_attempt",
    "parse_stdout",
    "plan_of",
    "run_id_of",
    "should_retry",
    "trace_ref_for",
    "unique_cases",
]
