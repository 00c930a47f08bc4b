"""Tests for megatron_edit.cpu.fsdp: Megatron-FSDP (megatron-core's own) on CPU over gloo.

Plain Megatron-FSDP in HSDP (2 instances x 2 shards, outer ``no_shard``, 4 gloo ranks, a real
tiny GPTModel) trains like megatron DDP + the distributed optimizer; the shims are declared for
the releases EDiT on Megatron-FSDP is checked on (0.16.1-0.19.x) only and revert exactly.
"""

import pytest
import torch

from compare import max_difference
from dist import run_ranks
from edit_runs import default_spec, megatron_runs
from megatron_edit.mcore import compat
from megatron_edit.mcore.releases import FSDP_SUPPORTED

WORLD = 4
ON_FSDP_RELEASE = pytest.mark.skipif(
    not FSDP_SUPPORTED.contains(compat.megatron_core_version()),
    reason=f"the CPU adapter's Megatron-FSDP shims are declared for megatron-core {FSDP_SUPPORTED} only",
)


@ON_FSDP_RELEASE
@pytest.mark.timeout(300)
def test_megatron_fsdp_hsdp_trains_on_cpu_like_ddp_with_the_distributed_optimizer():
    """Same model, data and Adam: HSDP's losses and parameters after 4 steps equal those of
    DDP + distributed optimizer with 2 instances (fp32: to 1e-6), and both HSDP instances hold
    the same model (the outer gradient all-reduce keeps them in step)."""
    specs = [default_spec(steps=4), default_spec(steps=4, fsdp=True)]
    results = run_ranks(megatron_runs, WORLD, specs, timeout=280)
    for r in results:
        ddp, fsdp = r["runs"]
        assert fsdp["losses"] == pytest.approx(ddp["losses"], abs=1e-6)
        assert max_difference(fsdp["params"], ddp["params"]) <= 1e-6
    first, other = results[0]["runs"][1]["params"], results[2]["runs"][1]["params"]
    assert all(torch.equal(first[k], other[k]) for k in first), "HSDP instances differ"
    # it trained: the parameters moved
    assert results[0]["runs"][1]["losses"][0] != results[0]["runs"][1]["losses"][-1]


def test_fsdp_shims_declared_for_the_checked_release_only():
    """The three shims are patches of the adapter's registry, for the checked releases only
    (0.16.1-0.19.x; another release does not get them, and EDiT refuses Megatron-FSDP there)."""
    from megatron_edit.cpu.fsdp import declare_fsdp
    from megatron_edit.mcore.wrap_registry import PatchRegistry

    registry = PatchRegistry()
    declare_fsdp(registry)
    ids = {p.id for p in registry.patches}
    assert ids == {"cpu-fsdp-device-string", "cpu-fsdp-device-mesh", "cpu-fsdp-adapter-device"}
    for checked in ("0.16.1", "0.17.1", "0.18.2", "0.19.2"):
        assert {p.id for p in registry.applicable(checked)} == ids
    for other in ("0.15.3", "0.16.0", "0.20.0"):
        assert registry.applicable(other) == []


def test_fsdp_built_without_a_device_is_built_on_the_cpu_without_div_fusion():
    """S3: Megatron-LM's get_model builds FullyShardedDataParallel without a device (it would
    take "cuda:cpu" under the adapter) and with gradient_reduce_div_fusion on (gloo has no
    PREMUL_SUM): the CPU device is given and the fusion turned off; a given device is kept."""
    import types

    import torch

    from megatron_edit.cpu.fsdp import _cpu_device_and_no_div_fusion

    seen = []

    def original(self, config, ddp_config, module, fsdp_unit_modules=None, disable_bucketing=False,
                 device=None, pg_collection=None):
        seen.append((device, ddp_config.gradient_reduce_div_fusion))

    init = _cpu_device_and_no_div_fusion(original)
    init(None, None, types.SimpleNamespace(gradient_reduce_div_fusion=True), None)
    init(None, None, types.SimpleNamespace(gradient_reduce_div_fusion=False), None, device=torch.device("meta"))
    assert seen == [(torch.device("cpu"), False), (torch.device("meta"), False)]


@ON_FSDP_RELEASE
def test_fsdp_shims_apply_and_revert_in_process():
    """Applied, the adapter's module sees the CPU mesh stand-in and MegatronFSDP's constructor is
    wrapped; reverted, both originals are back (the same objects)."""
    import megatron.core.distributed.fsdp.mcore_fsdp_adapter as adapter_module
    from megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp import MegatronFSDP

    from megatron_edit.cpu.fsdp import CpuDeviceMesh, declare_fsdp
    from megatron_edit.mcore.wrap_registry import PatchRegistry

    mesh, init = adapter_module.DeviceMesh, MegatronFSDP.__init__
    registry = PatchRegistry()
    declare_fsdp(registry)
    registry.apply("0.16.1")
    try:
        assert adapter_module.DeviceMesh is CpuDeviceMesh
        assert MegatronFSDP.__init__.__wrapped__ is init
    finally:
        registry.revert()
    assert adapter_module.DeviceMesh is mesh and MegatronFSDP.__init__ is init
