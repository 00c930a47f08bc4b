"""How the main job's processes start and end (``scripts/train_gpt_edit.py``).

Started with python, :func:`launch` checks the flags (no torch yet), then starts the ranks on
this machine through torch's own launcher (what torchrun runs), or, for a torchft run,
:func:`supervise` runs torchft's Lighthouse and one job per worker. A rank that fails ends the
job with one line naming it and its exit code.

A rank ends through :func:`end_rank` (``os._exit`` with its exit code after the main job's
one-line reports), and Ctrl-C through :data:`USER_STOP` (one line on rank 0, exit code 130).
Like the flags, this module imports neither torch nor Megatron at module level.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from main_job_flags import PROG, apply_outer_defaults, check_args, check_launch, in_main_job_terms, supervises
from megatron_edit import arguments
from megatron_edit.arguments import PEER_WAIT_S, Rank0ArgumentParser, wait_for_the_launcher
from megatron_edit.config import ConfigError

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), PROG)
"""The main job's script: what each rank, and each torchft worker's job, runs."""


def supervise(argv, workers: int) -> int:
    """A torchft run on this machine: torchft's Lighthouse and one job per worker, each this
    script with the same flags and its --local-sgd-replica-id (megatron_edit.supervise: a job
    that dies is relaunched fresh; the first sync waits for every worker)."""
    from megatron_edit import supervise as supervisor

    command = [sys.executable, SCRIPT, *argv, "--local-sgd-replica-id", supervisor.PLACEHOLDER]
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Lighthouse and Managers: no INFO line per quorum
    options = supervisor._parser().parse_args(["--workers", str(workers)])  # its defaults
    options.command = command
    return supervisor.supervise(options, prog=PROG)


def launch(parser: Rank0ArgumentParser, argv=None) -> int:
    """Check the flags (no torch yet), then start the ranks on this machine through torch's
    launcher, each running this script with the same flags; the exit code of the job."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    apply_outer_defaults(args)
    check_args(args, parser)
    world = check_launch(args, parser)
    if supervises(args):
        return supervise(argv, args.workers)
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does; each rank uses one thread
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          monitor_interval=0.1)
    for name in list(logging.root.manager.loggerDict):  # its report is the one line below
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        elastic_launch(config, sys.executable)(SCRIPT, *argv)
    except (KeyboardInterrupt, SignalException) as e:
        # Ctrl-C: the ranks got it too; rank 0 printed "stopped by the user at step N" (UserStop)
        signum = getattr(e, "sigval", signal.SIGINT)
        return 128 + int(signum)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        if code == 2:  # a flag refused by the ranks (rank 0 printed the line): nothing to add
            return 2
        how = f"was killed by signal {-code}" if code < 0 else f"ended with exit code {code}"
        print(f"{parser.prog}: rank {rank} {how} (its output is above); the other ranks were "
              "stopped.", file=sys.stderr, flush=True)
        return code if code > 0 else 1
    return 0


class UserStop:
    """Ctrl-C on a rank: rank 0 prints one line, ``stopped by the user at step N``, and every
    rank ends with exit code 130 at once (``os._exit`` from the signal handler: no
    KeyboardInterrupt unwinding through Megatron and gloo, which printed a traceback per rank
    and the peers' closed connections, about 180 lines). The launcher returns 130 quietly."""

    def __init__(self):
        self.step = 0
        """The step in progress (0: before the first)."""

    def install(self) -> None:
        signal.signal(signal.SIGINT, self.stop)

    def line(self) -> str:
        where = f"at step {self.step}" if self.step else "before the first step"
        return f"{PROG}: stopped by the user {where}"

    def stop(self, signum=None, frame=None) -> None:
        if os.environ.get("RANK", "0") == "0":
            print(self.line(), file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)


USER_STOP = UserStop()


def end_rank(error: BaseException) -> None:
    """Ends a main-job rank that stops on an error: :func:`megatron_edit.arguments.end_rank`
    (``os._exit`` with the rank's exit code, without the interpreter's teardown of the live gloo
    groups), after the main job's own one-line reports: a refusal found when EDiT is attached
    (exit code 2, printed by rank 0 in the main job's flag names) and a sync timeout (exit code
    1, printed by the rank that reports it; the others wait for the launcher to stop them)."""
    from megatron_edit.exchange.arrival import SyncTimeout

    if isinstance(error, KeyboardInterrupt):  # raised, not signalled (UserStop handles Ctrl-C)
        USER_STOP.stop()
    if isinstance(error, ConfigError):  # found when EDiT is attached (the model is built), on every rank
        line = f"{PROG}: error: {in_main_job_terms(str(error))}"
        if os.environ.get("RANK", "0") != "0":
            wait_for_the_launcher(PEER_WAIT_S, 2)  # rank 0 prints; the launcher stops this rank
        print(line, file=sys.stderr)
        error = SystemExit(2)
    elif isinstance(error, SyncTimeout):
        # Every waiting rank raises it with the same line: the reporter prints it at once; the
        # others wait for the launcher to stop them (end_with_error's order) and print it only
        # if still running then.
        if not error.reporter:
            wait_for_the_launcher(PEER_WAIT_S, 1)
        print(error, file=sys.stderr)
        error = SystemExit(1)
    arguments.end_rank(error)
