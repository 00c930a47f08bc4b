"""megatron_edit.mcore.compat against the installed megatron-core: its signature table, config-field and
process-group adapters (4 CPU ranks over gloo), and the gradient statistics EDiT keeps inside a
worker (megatron-core 0.12.x reduces them over every rank)."""

import dataclasses
import importlib
import importlib.util
import inspect
import types

import pytest

from dist import run_ranks
from megatron_edit.mcore import compat, releases

INSTALLED = compat.megatron_core_version()


def _resolve(target):
    module, _, path = target.partition(":")
    owner = importlib.import_module(module)
    for name in path.split("."):
        owner = inspect.getattr_static(owner, name) if isinstance(owner, type) else getattr(owner, name)
    fn = owner.__func__ if isinstance(owner, (classmethod, staticmethod)) else owner
    return inspect.unwrap(fn)


# --- versions and signatures --------------------------------------------------------------------


def test_installed_release_is_supported_and_the_range_is_the_partial_distopt_releases():
    assert compat.is_supported(INSTALLED)
    assert str(compat.SUPPORTED) == ">=0.12.0,<0.20.0"
    assert all(compat.SUPPORTED.contains(v) for v in compat.TESTED)
    assert compat.TESTED[-1] == "0.19.2"
    for version in ("0.17.0", "0.18.2", "0.19.2"):
        assert compat.is_supported(version), version
    for version in ("0.11.0", "0.9.0", "0.20.0", "0.20.0rc0", "1.0.0"):
        assert not compat.is_supported(version), version
    assert compat.TRAINING_SUPPORTED.minimum == "0.16.0"
    assert compat.TRAINING_SUPPORTED.below == compat.SUPPORTED.below


RELEASES = ("0.12.0", "0.12.3", "0.13.0", "0.13.1", "0.14.0", "0.15.0", "0.15.3", "0.16.0",
            "0.16.1", "0.17.0", "0.17.1", "0.18.0", "0.18.2", "0.19.0", "0.19.2")


def _training_importable() -> bool:
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError):
        return False


@pytest.mark.parametrize("target", sorted(compat.SIGNATURES) + sorted(compat.TRAINING_SIGNATURES))
def test_signature_table_matches_the_installed_release_exactly(target):
    """Every function megatron_edit wraps or calls by keyword has, in this release, exactly the
    parameters the table lists for it (the patches refuse a mismatch at start-up); where the
    table says a function is gone, it is gone."""
    if target in compat.TRAINING_SIGNATURES and not (
        _training_importable() and compat.TRAINING_SUPPORTED.contains(INSTALLED)
    ):
        pytest.skip("Megatron-LM's megatron.training is not importable here (megatron-core < 0.17 "
                    "ships none; a checkout on the path provides it: tests/training)")
    if compat.release_range(target).contains(INSTALLED):
        assert tuple(inspect.signature(_resolve(target)).parameters) == compat.params(target)
    elif ".distributed.fsdp." in target and compat.SUPPORTED.contains(INSTALLED):
        # Megatron-FSDP's internals are checked on FSDP_SUPPORTED only: on the other supported
        # releases they exist unchecked, and EDiT on Megatron-FSDP is refused there.
        assert not compat.FSDP_SUPPORTED.contains(INSTALLED)
    else:
        with pytest.raises((ImportError, AttributeError)):
            _resolve(target)


def test_signature_ranges_cover_the_supported_releases_without_overlap():
    for table, checked in ((compat.SIGNATURES, RELEASES),
                           (compat.TRAINING_SIGNATURES, RELEASES[7:])):
        for target, ranges in table.items():
            existing = compat.release_range(target)
            for version in checked:
                matching = [names for versions, names in ranges if versions.contains(version)]
                assert len(matching) == (1 if existing.contains(version) else 0), (target, version)
            with pytest.raises(LookupError, match="0.11.0"):
                compat.params(target, "0.11.0")
            with pytest.raises(LookupError, match="0.20.0"):
                compat.params(target, "0.20.0")
    for target in compat.SIGNATURES:  # Megatron-FSDP's internals: checked on fewer releases
        expected = compat.FSDP_SUPPORTED if ".distributed.fsdp." in target else compat.SUPPORTED
        assert compat.release_range(target) == expected, target


def test_known_differences_are_in_the_table():
    ddp, bucket = releases._DDP + ".__init__", releases._BUCKET_GROUP + ".start_grad_sync"
    assert compat.params(ddp, "0.12.3")[-1] == "disable_bucketing"
    assert compat.params(ddp, "0.14.0")[-2:] == ("grad_comm_pgs", "model_comm_pgs")
    assert compat.params(ddp, "0.15.3")[-1] == compat.params(ddp, "0.17.1")[-1] == "pg_collection"
    assert compat.params(ddp, "0.18.2")[-1] == compat.params(ddp, "0.19.2")[-1] == "full_param_layout"
    assert compat.params(bucket, "0.15.3") == ("self",)
    assert compat.params(bucket, "0.16.0") == compat.params(bucket, "0.19.2") == ("self", "force_all_reduce")
    load = "megatron.core.dist_checkpointing:load"
    assert "common_strategy" in compat.params(load, "0.18.2")
    assert "common_strategy" not in compat.params(load, "0.19.2")
    dp = "megatron.core.parallel_state:get_data_parallel_group"
    assert "independent_all_gather" in compat.params(dp, "0.17.1")
    assert "independent_all_gather" not in compat.params(dp, "0.18.2")
    assert compat.params(dp, "0.19.2")[1] == "with_gtp_remat"
    init = "megatron.training.initialize:initialize_megatron"
    assert compat.params(init, "0.17.1")[3] == compat.params(init, "0.18.2")[0] == "allow_no_cuda"
    assert compat.release_range("megatron.training.initialize:parse_args").below == "0.18.0"
    assert compat.packed_sequence_stats_all_reduced("0.18.0")
    assert not compat.packed_sequence_stats_all_reduced("0.17.1")


def test_call_kwargs_keeps_only_what_the_release_accepts():
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    kwargs = compat.call_kwargs(_ParamAndGradBucketGroup.start_grad_sync, force_all_reduce=False)
    assert kwargs == ({"force_all_reduce": False} if compat.version_at_least("0.16.0") else {})


# --- config fields --------------------------------------------------------------------------------


def _fields(cls):
    return {f.name for f in dataclasses.fields(cls)}


def test_fsdp_under_either_name():
    from megatron.core.distributed import DistributedDataParallelConfig as DDPConfig

    assert not compat.uses_megatron_fsdp(DDPConfig())
    assert compat.uses_megatron_fsdp(DDPConfig(use_custom_fsdp=True))
    if "use_megatron_fsdp" in _fields(DDPConfig):  # 0.14+
        assert compat.uses_megatron_fsdp(DDPConfig(use_megatron_fsdp=True))
    assert ("use_megatron_fsdp" in _fields(DDPConfig)) == compat.version_at_least("0.14.0")


def test_cuda_graphs_under_every_spelling():
    from megatron.core.transformer import TransformerConfig

    def model(**kwargs):
        return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, **kwargs)

    assert not compat.uses_cuda_graphs(model())
    assert compat.uses_cuda_graphs(model(enable_cuda_graph=True))
    assert compat.uses_cuda_graphs(model(external_cuda_graph=True))
    has_impl = "cuda_graph_impl" in _fields(TransformerConfig)
    assert has_impl == compat.version_at_least("0.15.0")
    if has_impl:
        assert compat.uses_cuda_graphs(model(cuda_graph_impl="local"))


def test_tokenizer_base_is_what_this_release_has():
    base = compat.tokenizer_base()
    try:
        from megatron.core.tokenizers import MegatronTokenizerBase
    except ImportError:
        assert not compat.version_at_least("0.15.0")
        assert base is compat._TokenizerBase
    else:
        assert base is MegatronTokenizerBase


def test_grad_stats_flag_matches_the_installed_distributed_optimizer():
    """0.13+ reads the group get_megatron_optimizer sets; 0.12.x always answers None (all ranks)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    fake = types.SimpleNamespace(grad_stats_parallel_group="instance group")
    got = DistributedOptimizer.get_grad_stats_parallel_group(fake)
    assert (got == "instance group") == compat.grad_stats_reduced_per_instance()
    assert compat.grad_stats_reduced_per_instance() == compat.version_at_least("0.13.0")


# --- process groups on 4 ranks --------------------------------------------------------------------


def _groups(rank, world_size, tp):
    import gpt_utils
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    gpt_utils.init_parallel_state(tensor_model_parallel_size=tp, num_distributed_optimizer_instances=2)
    ddp = gpt_utils.wrap_ddp(
        gpt_utils.build_tiny_gpt(), use_distributed_optimizer=True, overlap_grad_reduce=True,
        overlap_param_gather=True, num_distributed_optimizer_instances=2, bucket_size=3000,
    )
    bucket_group = ddp.bucket_groups[0]
    inter = compat.inter_instance_group(bucket_group)
    built = compat.instance_group(inter, build=True)
    again = compat.instance_group(inter, build=True)  # cached: no second set of groups
    native = compat.instance_group(inter)
    ranks = dist.get_process_group_ranks
    out = dict(
        dp=ranks(compat.data_parallel_group(ddp)),
        tp=ranks(compat.tensor_parallel_group(ddp)),
        tp_ps=ranks(ps.get_tensor_model_parallel_group()),
        inter=ranks(inter),
        shard=ranks(bucket_group.intra_distributed_optimizer_instance_group),
        built=ranks(built),
        cached=again is built,
        native=ranks(native),
        single=compat.instance_group(None),
    )
    if compat.version_at_least("0.13.0"):
        out["megatron"] = ranks(ps.get_intra_distributed_optimizer_instance_group())
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_process_groups_on_four_ranks(tp):
    """2 instances of 4 / tp data-parallel ranks each: the groups compat hands out are
    Megatron's, and the instance group built for 0.12.x is the one 0.13+ provides."""
    results = run_ranks(_groups, 4, tp, timeout=100)
    dp = 4 // tp
    for rank, r in enumerate(results):
        assert len(r["dp"]) == dp and rank in r["dp"]
        assert r["tp"] == r["tp_ps"] and len(r["tp"]) == tp
        assert len(r["inter"]) == 2 and rank in r["inter"]
        assert len(r["shard"]) == dp // 2 and set(r["shard"]) | set(r["inter"]) <= set(r["dp"])
        # The instance: this rank's shard group and its tensor-parallel peers, 4 / 2 ranks.
        assert len(r["built"]) == 2 and set(r["shard"]) | set(r["tp"]) == set(r["built"])
        assert r["cached"] and r["single"] is None
        assert r["native"] == (r["megatron"] if "megatron" in r else r["built"])
        if "megatron" in r:
            assert r["built"] == r["megatron"]
    # Every rank is in exactly one instance, and both instances have the same size.
    instances = {tuple(r["built"]) for r in results}
    assert len(instances) == 2 and sorted(sum(instances, ())) == [0, 1, 2, 3]


# --- gradient statistics with EDiT --------------------------------------------------------------


def _edit_with_clipping(rank, world_size, warmup_steps):
    """reference_runs' distributed-optimizer run (2 instances, clip_grad 1.0), with EDiT on."""
    import megatron_edit as me
    import reference_runs as base
    import torch.distributed as dist
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    me.patch_megatron_for_local_sgd(
        me.LocalSGDConfig(local_sgd_sync_interval=100, local_sgd_warmup_steps=warmup_steps)
    )
    groups = []
    original = DistributedOptimizer.get_grad_stats_parallel_group

    def record(self):  # wraps EDiT's patch: which group does the step reduce the norm over?
        group = original(self)
        groups.append(None if group is None else tuple(dist.get_process_group_ranks(group)))
        return group

    DistributedOptimizer.get_grad_stats_parallel_group = record
    try:
        result = base.train_megatron(rank, world_size, True, 2)
    finally:
        DistributedOptimizer.get_grad_stats_parallel_group = original
        me.unpatch_megatron_for_local_sgd()
    result["grad_stats_groups"] = sorted(set(groups), key=str)
    return result


@pytest.mark.timeout(240)
def test_edit_reduces_gradient_norm_inside_the_worker():
    """With clipping: synchronous (warmup) steps under EDiT equal plain PyTorch, so the norm is
    the true one (megatron-core 0.12.x alone reduces it over all ranks, sqrt(2) too large), and
    every norm is reduced inside the worker, never across workers."""
    import reference_runs as base

    (reference,) = run_ranks(base.train_reference, 1, timeout=150)
    results = run_ranks(_edit_with_clipping, 4, base.NUM_STEPS, timeout=200)
    for rank, result in enumerate(results):
        worker = (0, 1) if rank < 2 else (2, 3)
        assert result["grad_stats_groups"] == [worker]
        for name, param in result["params"].items():
            diff = (param - reference["params"][name]).abs().max().item()
            assert diff <= base.TOLERANCE, f"rank {rank} {name}: max |diff| {diff:.2e}"
