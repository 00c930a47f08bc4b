"""Run megatron-core (the releases of ``_TESTED_MEGATRON``: 0.12 - 0.19) on CPU over gloo, for the CPU demo and the multi-rank tests.

Why this exists: megatron-core assumes CUDA everywhere (buffers allocated on
``torch.cuda.current_device()``, ``device='cuda'`` literals, CUDA type-name checks, the CUDA RNG
tracker, side streams). The real ``GPTModel`` + ``DistributedDataParallel`` +
``get_megatron_optimizer`` + ``get_forward_backward_func`` stack is otherwise device-agnostic, so a
handful of reversible in-process replacements lets it run on CPU processes over gloo. That is what
lets EDiT's numerics be tested against the real Megatron code path on a machine without a GPU.

It must never be active on a GPU run: :func:`activate` refuses when ``torch.cuda.is_available()``.

Usage (per rank, before building anything megatron)::

    from megatron_edit.cpu import adapter as cpu_adapter

    torch.set_num_threads(1)   # several ranks share a few cores
    cpu_adapter.activate()
    torch.distributed.init_process_group("gloo")

Release-specific: megatron-core 0.12.x calls its FP8 shard-quantization helper from
``DistributedOptimizer._copy_main_params_to_model_params`` on every step, and without
transformer-engine that helper raises even when there is no FP8 parameter; the adapter gives
it 0.13's behaviour (nothing to do for an empty list, still an error otherwise). MoE without
transformer-engine (0.16.x's router GEMM name, the alltoall dispatcher's split sizes): see
:mod:`megatron_edit.cpu.moe`. Megatron-FSDP (0.16.1): see :mod:`megatron_edit.cpu.fsdp`.
Megatron's checkpoint writers (``--async-save``'s spawned one; every save's results queue, whose
Manager is forked here rather than spawned): see :mod:`megatron_edit.cpu.async_writer`.

Every replacement is a declared :class:`~megatron_edit.mcore.wrap_registry.Patch` (``replace`` patches
for stand-ins, wraps for functions that still call the original) applied by the package's one
patch engine, :class:`~megatron_edit.mcore.wrap_registry.PatchRegistry`, kept in the process's session
object (:data:`megatron_edit.mcore.session.SESSION`); :func:`deactivate` reverts it, putting the
originals back exactly, so tests can activate and deactivate in one process.

Known limits: dropout on CPU draws from the CPU default generator, not from the RNG tracker's
states (the tracker keeps and forks its states faithfully, but CPU ops never read them), so
tensor-parallel dropout is not rank-distinct; ``Tensor.to('cuda')`` is not redirected (megatron's
training path uses ``.cuda()`` or ``current_device()``); the 16-bit ``main_param = None``
bookkeeping in ``DistributedOptimizer.__init__`` (used only by QK-clip) still sees CPU type names.
"""

import contextlib
import functools
import logging
import warnings

import torch

from ..mcore.wrap_registry import Patch, PatchError, PatchRegistry, VersionRange
from ..mcore.session import SESSION
from . import collective_guard
from .async_writer import declare_writers
from .fsdp import declare_fsdp
from .gloo_threads import declare_gloo_threads
from .moe import declare_moe

__all__ = ["activate", "deactivate", "is_active"]

# Minor releases the adapter was checked against (megatron_edit.mcore.compat.TESTED lists the patch
# releases); another one gets a warning, not a refusal.
_TESTED_MEGATRON = ("0.12.", "0.13.", "0.14.", "0.15.", "0.16.", "0.17.", "0.18.", "0.19.")
_CPU = torch.device("cpu")
_ANY_RELEASE = VersionRange("0", "1000")  # the adapter's own check is _TESTED_MEGATRON's warning
_MISSING = object()

# Stand-in for the CUDA default generator: a separate CPU generator, so seeding "CUDA" (as
# model_parallel_cuda_manual_seed does) never disturbs the CPU generator the model init uses.
_cuda_rng = None


def is_active() -> bool:
    """Whether the adapter's replacements are currently installed."""
    return SESSION.cpu_registry is not None and SESSION.cpu_registry.is_applied()


class _ExpectedRngNotice(logging.Filter):
    """Drops megatron-core's "CPU RNG state changed within GPU RNG context" warning, and only
    it. On CPU, parameter initialisation (and dropout) inside the RNG tracker's ``fork()`` draw
    from the CPU generator by construction (see "Known limits" above), so megatron-core logs
    it at every fork: dozens of lines a run that say nothing about the run."""

    MESSAGE = "CPU RNG state changed within GPU RNG context"

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != self.MESSAGE


_RNG_LOGGER = "megatron.core.tensor_parallel.random"
_rng_notice_filter = _ExpectedRngNotice()


def deactivate() -> None:
    """Restore every replaced attribute, newest first. A no-op when not active."""
    global _cuda_rng
    logging.getLogger(_RNG_LOGGER).removeFilter(_rng_notice_filter)
    if SESSION.cpu_registry is not None:
        # newest first; an inherited original (e.g. Tensor.cuda from TensorBase) is deleted
        SESSION.cpu_registry.revert()
        SESSION.cpu_registry = None
    collective_guard.reset()
    _cuda_rng = None


# --- (2) device literals ------------------------------------------------------------------------


def _as_cpu(device):
    """Map any CUDA device spec ('cuda', 'cuda:1', torch.device('cuda'), an ordinal) to CPU."""
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _cpu_factory(fn):
    """Wrap a torch factory so a CUDA ``device=`` keyword allocates on CPU instead."""

    @functools.wraps(fn)
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _as_cpu(kwargs["device"])
        return fn(*args, **kwargs)

    return factory


# Factories megatron-core calls with device='cuda' (keyword-only in torch, so kwargs suffice).
_FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace",
    "rand", "randn", "randint", "zeros_like", "ones_like", "empty_like", "full_like",
)


def _tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    """``Tensor.cuda()`` on CPU: the tensor already lives on the only device there is."""
    return self


# --- (3) CUDA type names --------------------------------------------------------------------------


def _cuda_named_type(original):
    """A ``Tensor.type`` that names CPU tensors like CUDA ones ('torch.cuda.FloatTensor')."""

    def type_(self, *args, **kwargs):
        if args or kwargs:  # a conversion, not a query: leave it alone
            return original(self, *args, **kwargs)
        name = original(self)
        if self.device.type == "cpu" and not name.startswith("torch.cuda."):
            name = "torch.cuda." + name[len("torch."):]
        return name

    return type_


@contextlib.contextmanager
def _cuda_type_names():
    """Only inside this block does ``Tensor.type()`` report CUDA names; restored exactly after."""
    raw = vars(torch.Tensor).get("type", _MISSING)
    torch.Tensor.type = _cuda_named_type(torch.Tensor.type)
    try:
        yield
    finally:
        if raw is _MISSING:
            del torch.Tensor.type
        else:
            torch.Tensor.type = raw


def _with_cuda_type_names(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _cuda_type_names():
            return fn(*args, **kwargs)

    return wrapper


# --- (4) RNG ----------------------------------------------------------------------------------------
# Each replacement is a distinct function object: torch._dynamo keys its trace rules by object
# identity and fails on one object reachable under names with different rules.


def _get_rng_state(device="cuda"):
    return _cuda_rng.get_state()


def _set_rng_state(new_state, device="cuda"):
    _cuda_rng.set_state(new_state)


def _manual_seed(seed):
    _cuda_rng.manual_seed(int(seed))


def _manual_seed_all(seed):
    _cuda_rng.manual_seed(int(seed))


def _megatron_set_cuda_rng_state(new_state, device=-1, graph_safe=False):
    _cuda_rng.set_state(new_state)


# --- (5) streams and events ---------------------------------------------------------------------


class _InertEvent:
    """CUDA event stand-in: CPU work is already ordered, so there is nothing to wait for."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end_event):
        return 0.0


class _InertStream:
    """CUDA stream stand-in (megatron only needs one with num_distributed_optimizer_instances > 1)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _InertEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


_STREAM = _InertStream()


def _inert():
    """A new do-nothing function (a distinct object per replaced name, see the RNG note)."""

    def inert(*args, **kwargs):
        return None

    return inert


# --- (6) megatron-core 0.12.x without transformer-engine -------------------------------------------


def _release(version: str) -> tuple:
    return tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in version.split(".")[:2])


def _quantize_no_fp8_params(original):
    """0.12.x's no-transformer-engine ``_quantize_param_shard_impl`` raises unconditionally;
    0.13 returns when there are no FP8 params. Same here; anything else still raises."""

    @functools.wraps(original)
    def quantize(model_params, *args, **kwargs):
        if len(model_params) == 0:
            return None
        return original(model_params, *args, **kwargs)

    return quantize


# --- activation -----------------------------------------------------------------------------------


def _declare(registry: PatchRegistry, version: str) -> PatchRegistry:
    """Every replacement, in application order, as patches of the package's one engine
    (:mod:`megatron_edit.mcore.wrap_registry`): ``replace`` patches for stand-ins, wraps for the
    functions that still call the original."""
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer

    def replace(target, value, description):
        registry.add(Patch.replacing(f"cpu-{target}", target, value, _ANY_RELEASE, description))

    def wrap(target, wrapper, description, versions=_ANY_RELEASE):
        registry.add(Patch(f"cpu-{target}", target, wrapper, versions, (), description))

    cuda, cuda_random = "torch.cuda:", "torch.cuda.random:"
    # (1) ~80 allocations use device=torch.cuda.current_device(): make that the CPU device.
    replace(cuda + "current_device", lambda: _CPU, "CPU: the current device is the CPU")
    # Megatron-LM's initialize skips model-parallel setup with 0 devices; set_device is moot.
    replace(cuda + "device_count", lambda: 1, "CPU: one (CPU) device")
    replace(cuda + "set_device", _inert(), "CPU: nothing to select")
    # (2) device='cuda' literals (grad scaler, found_inf, clip_grads, total_num_tokens, rerun).
    for name in _FACTORIES:
        wrap(f"torch:{name}", _cpu_factory, "CPU: device='cuda' allocates on CPU")
    # (2) .cuda() calls (and Module.cuda(), which goes through Tensor.cuda).
    replace("torch:Tensor.cuda", _tensor_cuda, "CPU: .cuda() keeps the tensor where it is")
    # (3) the distributed optimizer only accepts params whose type() is a torch.cuda.* name.
    DO, build = distrib_optimizer.DistributedOptimizer, "_build_model_and_main_param_groups"
    if not isinstance(vars(DO).get(build), classmethod):
        raise AttributeError(f"megatron_edit.cpu.adapter: DistributedOptimizer.{build} is not a classmethod")
    wrap(f"megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.{build}",
         _with_cuda_type_names, "CPU: CUDA type names while grouping the parameters")
    # (3) so does the non-distributed 16-bit optimizer, in its __init__.
    wrap("megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__",
         _with_cuda_type_names, "CPU: CUDA type names while building the optimizer")
    # (3) clip_grads asserts grad.type() == 'torch.cuda.FloatTensor'; patched where looked up.
    for module in ("megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads"):
        wrap(f"{module}:clip_grad_by_total_norm_fp32", _with_cuda_type_names,
             "CPU: CUDA type names while clipping")
    # (4) the RNG tracker saves/restores "CUDA" states: back them with a CPU generator.
    for module in (cuda, cuda_random):
        replace(module + "get_rng_state", _get_rng_state, "CPU: the stand-in CUDA generator")
        replace(module + "set_rng_state", _set_rng_state, "CPU: the stand-in CUDA generator")
        # CPU build would queue it forever
        replace(module + "manual_seed", _manual_seed, "CPU: the stand-in CUDA generator")
        # torch.manual_seed calls it
        replace(module + "manual_seed_all", _manual_seed_all, "CPU: the stand-in CUDA generator")
    replace(cuda + "default_generators", (_cuda_rng,), "CPU: the stand-in CUDA generator")
    # (4) megatron's own setter goes through torch.cuda._lazy_call, which never runs on CPU.
    replace("megatron.core.tensor_parallel.random:_set_cuda_rng_state", _megatron_set_cuda_rng_state,
            "CPU: the stand-in CUDA generator")
    # (5) side streams/events for num_distributed_optimizer_instances > 1: inert stand-ins.
    replace(cuda + "Stream", _InertStream, "CPU: an inert stream")
    replace(cuda + "Event", _InertEvent, "CPU: an inert event")
    replace(cuda + "stream", lambda stream=None: contextlib.nullcontext(), "CPU: an inert stream")
    replace(cuda + "current_stream", lambda device=None: _STREAM, "CPU: an inert stream")
    replace(cuda + "default_stream", lambda device=None: _STREAM, "CPU: an inert stream")
    replace(cuda + "synchronize", _inert(), "CPU: nothing to wait for")
    replace(cuda + "empty_cache", _inert(), "CPU: no cache")
    # (6) 0.12.x: the FP8 helper the distributed optimizer calls every step.
    if (0, 12) <= _release(version) < (0, 13):
        import megatron.core.fp8_utils as fp8_utils

        if not fp8_utils.HAVE_TE:
            wrap("megatron.core.fp8_utils:_quantize_param_shard_impl", _quantize_no_fp8_params,
                 "0.12.x without transformer-engine: nothing to quantize without FP8 params")
    # (6) Megatron's checkpoint writers: --async-save's persistent one (a spawned process, without
    # the adapter) and every torch_dist save's results queue (see megatron_edit.cpu.async_writer).
    declare_writers(registry, _ANY_RELEASE)
    # (7) MoE without transformer-engine: the router's GEMM name, the alltoall dispatcher's splits.
    declare_moe(registry, _ANY_RELEASE)
    # (8) Megatron-FSDP: two CUDA literals (megatron-core 0.16.1 only; see megatron_edit.cpu.fsdp).
    declare_fsdp(registry)
    # (9) one worker thread per gloo process group: torch's race on a group's status (issue 62).
    declare_gloo_threads(registry, _ANY_RELEASE)
    # (10) debug (MEGATRON_EDIT_COLLECTIVE_GUARD=1): no buffer of a collective in flight freed or written.
    if collective_guard.enabled():
        collective_guard.declare_guard(registry, _ANY_RELEASE)
    return registry


def activate() -> None:
    """Install the CPU replacements (idempotent). Refuses when CUDA is available."""
    global _cuda_rng
    if torch.cuda.is_available():
        raise RuntimeError("megatron_edit.cpu.adapter must never be active when CUDA is available")
    if is_active():
        return

    import megatron.core

    version = megatron.core.__version__
    if not version.startswith(_TESTED_MEGATRON):
        warnings.warn(
            f"megatron_edit.cpu.adapter was checked with megatron-core "
            f"{', '.join(v + 'x' for v in _TESTED_MEGATRON)}; found {version}"
        )
    _cuda_rng = torch.Generator()
    try:
        SESSION.cpu_registry = _declare(PatchRegistry(), version)
        # (4) the CPU generator moves inside fork() on CPU: expected, not worth a log line.
        logging.getLogger(_RNG_LOGGER).addFilter(_rng_notice_filter)
        try:
            SESSION.cpu_registry.apply(version)
        except PatchError as e:
            raise AttributeError(
                f"megatron_edit.cpu.adapter: {e}; megatron-core or torch changed, update the adapter"
            ) from e
    except BaseException:
        deactivate()
        raise
