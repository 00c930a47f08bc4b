"""One worker thread for each of torch's gloo process groups on the CPU: the way around a data race
in torch's ``ProcessGroupGloo`` that crashed CPU runs about once in 10,000 steps (issue 62).

**The defect** (torch's, pytorch/pytorch ``torch/csrc/distributed/c10d/ProcessGroupGloo.cpp``,
``ProcessGroupGloo::runLoop``; seen in the machine code of torch 2.13.0's and 2.15.0's
``libtorch_cpu.so``):
a gloo process group runs its collectives on worker threads, two by default. When one is done,
its thread records it in the group's status with the group's lock released::

    AsyncWork::execute(work);
    pgStatus_->lastCompletedWorkName = opTypeToString(work->opType_);   // no lock held

When two collectives of one group finish together, two threads assign one ``std::string``. A
name longer than 15 characters lives on the heap (``ALLGATHER_COALESCED``, ``ALLREDUCE_COALESCED``:
a 32-byte chunk). Both threads then free the old name's buffer (a double free), or one writes
into it after the other freed it. glibc aborts (``free(): invalid pointer``), or a later
``malloc`` on that thread crashes on the damaged free list (SIGSEGV in ``tcache_get``). Those are
the two cores of docs/status.md.

Megatron on the CPU meets it because its overlapped parameter all-gather is a coalesced
all-gather (``_coalescing_manager`` -> ``allgather_into_tensor_coalesced``) launched while the
group's other thread still runs the previous bucket's collective. ``scripts/dev/repro_gloo_crash.py``
shows it without Megatron or this package: two ranks and two coalesced all-gathers in flight
crash within seconds under glibc's malloc check.

It is not a buffer of a collective: no number of a model or of an exchange is touched. NCCL on a
GPU does not run this code. On a GPU run, Megatron's gloo groups and the torchft backend's gloo
group (``torchft.ProcessGroupGloo``, built by torchft itself) keep torch's defaults. Megatron's
gloo groups have one collective at a time. The torchft group's collectives (all-reduce,
all-to-all, all-gather) have names of at most 15 characters, which never reach the heap.

**The way around it**, while :mod:`megatron_edit.cpu.adapter` is active: every process group that
``torch.distributed`` builds with the gloo backend (``init_process_group``, ``new_group``: Megatron's
groups and the package's) gets one worker thread (``ProcessGroupGloo.Options._threads = 1``). One
thread records every status, so the race cannot happen. The group's collectives then run one
after another in launch order. gloo already pairs a collective across ranks by that order (its
tag), so this cannot deadlock a correct program. What it costs: two collectives of one group no
longer overlap each other on the CPU. Each still overlaps the computation, and the groups overlap
one another. Measured: the same time for DDP tests, about 13% more for Megatron-FSDP and MoE
tests, and the same for the whole CI lane (``scripts/bench/results/native_crash.md``, round 8).

Like torch's own constructor, the group uses the interfaces named in ``GLOO_SOCKET_IFNAME``, or
the default device otherwise. A group built from explicit options keeps them, with one thread.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed.distributed_c10d as c10d

TARGET = "torch.distributed.distributed_c10d:ProcessGroupGloo"
"""The name ``torch.distributed`` builds its gloo backends through (``_new_process_group_helper``)."""

THREADS = 1
"""Worker threads of each gloo process group while the adapter is active."""

_DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)  # torch's own default for this constructor


class OneThreadGloo:
    """Stands in for ``ProcessGroupGloo`` in ``torch.distributed.distributed_c10d``: building it
    builds torch's ``ProcessGroupGloo`` with one worker thread; ``isinstance`` and every attribute
    (``_Options``, ``create_device`` ...) are the original's."""

    def __init__(self, original):
        self.original = original

    def __call__(self, store, rank, size, options=None, timeout=None, **settings):
        if options is None or isinstance(options, datetime.timedelta):
            options = self.default_options(timeout or options or _DEFAULT_TIMEOUT)
        for name, value in settings.items():  # torch 2.15's enable_reconfigure: an option of the same name
            if not hasattr(options, name):
                raise TypeError(f"megatron_edit.cpu.gloo_threads: torch's ProcessGroupGloo was built with "
                                f"{name}=, which its options do not have; update megatron_edit.cpu.gloo_threads")
            setattr(options, name, value)
        options._threads = THREADS
        return self.original(store, rank, size, options)

    def default_options(self, timeout: datetime.timedelta):
        """Torch's default options for a timeout (its ``ProcessGroupGloo(store, rank, size,
        timeout)``): the devices of ``GLOO_SOCKET_IFNAME`` (comma-separated), else the default one."""
        options = self.original._Options()
        names = os.environ.get("GLOO_SOCKET_IFNAME", "")
        if len(names) > 1:
            options._devices = [self.original.create_device(interface=name) for name in names.split(",")]
        else:
            options._devices = [self.original.create_default_device()]
        options._timeout = timeout
        return options

    def __instancecheck__(self, instance) -> bool:
        return isinstance(instance, self.original)

    def __getattr__(self, name):
        return getattr(self.original, name)


def threads_of(group=None) -> int:
    """Worker threads of ``group``'s gloo backend (default: the default group)."""
    group = group if group is not None else c10d._get_default_group()
    return group._get_backend(torch.device("cpu")).options._threads


def declare_gloo_threads(registry, versions) -> None:
    """Add the one-thread patch to the CPU adapter's ``registry`` (``versions``: every release)."""
    from ..mcore.wrap_registry import REPLACE, Patch

    registry.add(Patch("cpu-gloo-one-thread", TARGET, lambda original: OneThreadGloo(original), versions, (),
                       "CPU: one worker thread per gloo process group (torch's status race, issue 62)", REPLACE))
