"""Entry point: `python -m evalbus_dispatcher` (or `evalbus-dispatcher`)."""

import asyncio
import os
import sys

from evalbus_dispatcher.backends import orphans
from evalbus_dispatcher.service import DispatcherSettings, build_dispatcher
from evalbus_runtime import Service, load_settings, run_service


def main() -> None:
    """Run the dispatcher until SIGTERM."""
    settings = load_settings(DispatcherSettings, "dispatcher")
    # The daemons harnesses fork become this process's children, killed with their sandboxes
    # (`orphans`). Process-wide, so only here: a dispatcher built inside another program (a
    # test) leaves that program's orphans alone.
    orphans.become_subreaper()

    def build(service: Service) -> None:
        service.on_start(_wait_for_children_without_threads)
        build_dispatcher(service, settings)

    run_service(settings, build)


async def _wait_for_children_without_threads(_: Service) -> None:
    """Python 3.11 waits for each subprocess in a thread of its own (`ThreadedChildWatcher`): a
    thread per harness process, each taking the interpreter lock from the event loop when its
    process exits. A pidfd watcher waits on the event loop instead (3.12 does so by default where
    Linux has `pidfd_open`). Process-wide, so only here, like the subreaper."""
    if sys.version_info >= (3, 12) or not hasattr(os, "pidfd_open"):
        return
    try:
        os.close(os.pidfd_open(os.getpid()))  # a kernel without pidfds (before 5.3) keeps the default
    except OSError:
        return
    watcher = asyncio.PidfdChildWatcher()
    watcher.attach_loop(asyncio.get_running_loop())
    asyncio.set_child_watcher(watcher)


if __name__ == "__main__":
    main()
