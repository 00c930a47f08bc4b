"""Patching megatron-core and undoing it, in one process: megatron_edit.api / .mcore.wrap_registry."""

import inspect
import subprocess
import sys
import types

import pytest

import megatron_edit.api as api
from megatron_edit.mcore import compat
from megatron_edit.mcore.session import SESSION
from megatron_edit import (
    ConfigError,
    LocalSGDConfig,
    OuterOptimizerConfig,
    PatchError,
    UnsupportedMegatronVersion,
    is_patched,
    patch_megatron_for_local_sgd,
    unpatch_megatron_for_local_sgd,
)
from megatron_edit.api import build_full_registry
from megatron_edit.mcore.compat import SUPPORTED
from megatron_edit.mcore.core_wraps import build_registry
from megatron_edit.wraps import main as list_patches
from megatron_edit.mcore.wrap_registry import Patch, PatchRegistry, VersionRange, version_tuple as _vt

INSTALLED = compat.megatron_core_version()
ALL_PATCHES = build_full_registry(lambda: None).patches
PATCHES = [p for p in ALL_PATCHES if p.versions.contains(INSTALLED)]  # those for this release
EXPECTED_IDS = [p.id for p in PATCHES]

# Targets the brief names explicitly: a missing one means the registry lost a patch.
MUST_PATCH = {
    "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.start_grad_sync",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.__init__",
    "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel.__init__",
}


def _installed():
    """target -> the raw object stored on its owner right now."""
    out = {}
    for patch in PATCHES:
        owner, attr = patch.resolve()
        out[patch.target] = inspect.getattr_static(owner, attr)
    return out


@pytest.fixture
def originals():
    """Unpatched state before the test; everything is unpatched again after it."""
    unpatch_megatron_for_local_sgd()
    before = _installed()
    assert not any(hasattr(fn, "_megatron_edit_patch") for fn in before.values())
    try:
        yield before
    finally:
        unpatch_megatron_for_local_sgd()
    assert _installed() == before


def test_registry_declares_the_patches():
    targets = {p.target for p in PATCHES}
    assert MUST_PATCH <= targets
    assert len(EXPECTED_IDS) == len(set(EXPECTED_IDS)) == len(targets)
    assert len({p.id for p in ALL_PATCHES}) == len(ALL_PATCHES)
    # every patch is for releases megatron_edit supports
    from megatron_edit.mcore import compat

    for p in ALL_PATCHES:
        assert compat.SUPPORTED.contains(p.versions.minimum), p.id
        assert _vt(p.versions.below) <= _vt(compat.SUPPORTED.below), p.id


def test_core_patch_signatures_come_from_compat():
    """One table of Megatron signatures per release: megatron_edit.mcore.compat.SIGNATURES."""
    from megatron_edit.mcore import compat

    from megatron_edit.mcore.expert_bias import GROUP_FROM_PARALLEL_STATE

    for patch in build_registry(lambda: None).patches:
        fsdp = patch.id.startswith("fsdp-")  # Megatron-FSDP's: checked on fewer releases
        if not fsdp or compat.FSDP_SUPPORTED.contains(INSTALLED):
            assert patch.params == compat.params(patch.target, INSTALLED), patch.id
        # the expert bias's group getter: only where Megatron reads that group from parallel_state
        expected = GROUP_FROM_PARALLEL_STATE if patch.id == "moe-expert-bias-group" else compat.SUPPORTED
        assert patch.versions == (compat.FSDP_SUPPORTED if fsdp else expected), patch.id


def test_patch_applies_every_patch(originals):
    assert not is_patched()
    applied = patch_megatron_for_local_sgd(LocalSGDConfig())
    assert applied == EXPECTED_IDS
    assert is_patched()
    for patch in PATCHES:
        installed = _installed()[patch.target]
        original = originals[patch.target]
        assert installed is not original, patch.id
        assert installed._megatron_edit_patch == patch.id
        assert installed.__wrapped__ is original, patch.id
        # (not inspect.unwrap: some Megatron originals are themselves decorated with wraps)
        assert installed.__name__ == original.__name__
        assert SESSION.registry.original(patch.id) is original


def test_patching_twice_is_idempotent(originals):
    patch_megatron_for_local_sgd(LocalSGDConfig(local_sgd_sync_interval=2))
    first = _installed()
    again = patch_megatron_for_local_sgd(LocalSGDConfig(local_sgd_sync_interval=5))
    assert again == EXPECTED_IDS
    second = _installed()
    for target, fn in second.items():
        assert fn is first[target], target
        # one wrap layer: the wrapper wraps Megatron's function, not another wrapper
        assert fn.__wrapped__ is originals[target], target
        assert not hasattr(fn.__wrapped__, "_megatron_edit_patch")
    # the second call replaced the configs the patches read
    assert SESSION.runtime.configs[0].local_sgd_sync_interval == 5


def test_the_default_outer_optimizer_follows_the_exchange(originals):
    """No outer optimizer given: the paper's Nesterov SGD, or with the sparse exchange SGD lr 1
    without momentum (the convergence benchmark's choice); one given is kept as it is."""
    patch_megatron_for_local_sgd(LocalSGDConfig())
    assert SESSION.runtime.configs.outer.outer_optim_kwargs == {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    topk = LocalSGDConfig(exchange_topk_density=0.03, exchange_dtype="int2")
    patch_megatron_for_local_sgd(topk)
    assert SESSION.runtime.configs.outer.outer_optim_kwargs == {"lr": 1.0, "momentum": 0.0, "nesterov": False}
    patch_megatron_for_local_sgd(topk, OuterOptimizerConfig())
    assert SESSION.runtime.configs.outer.outer_optim_kwargs == {"lr": 0.7, "momentum": 0.9, "nesterov": True}


def test_unpatch_restores_the_exact_originals(originals):
    patch_megatron_for_local_sgd(LocalSGDConfig())
    reverted = unpatch_megatron_for_local_sgd()
    assert sorted(reverted) == sorted(EXPECTED_IDS)
    after = _installed()
    for target, original in originals.items():
        assert after[target] is original, target
        owner, attr = next(p for p in PATCHES if p.target == target).resolve()
        assert attr in vars(owner)  # defined on the owner itself, as before
    assert not is_patched()
    assert SESSION.runtime is None
    assert unpatch_megatron_for_local_sgd() == []  # nothing left to revert


def test_patch_unpatch_patch_again(originals):
    patch_megatron_for_local_sgd(LocalSGDConfig())
    unpatch_megatron_for_local_sgd()
    assert patch_megatron_for_local_sgd(LocalSGDConfig()) == EXPECTED_IDS
    for target, fn in _installed().items():
        assert fn.__wrapped__ is originals[target]


def test_outer_config_without_local_config_is_refused(originals):
    with pytest.raises(ValueError, match="local_sgd_config"):
        patch_megatron_for_local_sgd(outer_optim_config=OuterOptimizerConfig())
    assert _installed() == originals


@pytest.mark.parametrize(
    "args, kwargs, fragment",
    [
        (("abc",), {}, "local_sgd_config must be a LocalSGDConfig or None, got str"),
        (({"local_sgd_sync_interval": 4},), {}, "LocalSGDConfig(**d)"),
        ((OuterOptimizerConfig(), LocalSGDConfig()), {}, "wrong order"),
        ((LocalSGDConfig(),), {"gta_config": OuterOptimizerConfig()}, "gta_config must be a GTAConfig"),
        ((LocalSGDConfig(),), {"outer_optim_config": {"lr": 1.0}}, "outer_optim_config must be"),
    ],
    ids=["string", "dict", "swapped", "outer-as-gta", "dict-outer"],
)
def test_arguments_of_the_wrong_class_are_refused_before_patching(originals, args, kwargs, fragment):
    # Before: accepted, then failed inside Megatron (swapped configs at step 1).
    with pytest.raises(TypeError) as info:
        patch_megatron_for_local_sgd(*args, **kwargs)
    assert fragment in str(info.value)
    assert _installed() == originals and not is_patched()


def test_a_config_changed_after_construction_is_validated_again(originals):
    cfg = LocalSGDConfig()
    cfg.use_async = "no"  # dataclass fields can be assigned; the check runs again at patch time
    with pytest.raises(ConfigError, match="use_async.*True or False"):
        patch_megatron_for_local_sgd(cfg)
    assert _installed() == originals


@pytest.mark.parametrize("version", ["0.9.0", "0.11.0", "0.20.0", "0.21.1", "1.0.0"])
def test_unsupported_version_is_refused(originals, monkeypatch, version):
    monkeypatch.setattr(api, "megatron_core_version", lambda: version)
    with pytest.raises(UnsupportedMegatronVersion) as info:
        patch_megatron_for_local_sgd(LocalSGDConfig())
    message = str(info.value)
    assert f"megatron-core {version} is installed" in message
    assert "supports megatron-core >=0.12.0,<0.20.0" in message
    assert "0.19.2" in message  # the newest tested release, to install instead
    newer = _vt(version) >= (0, 20)
    assert ("newer than the newest release megatron_edit was checked against" in message) == newer
    assert isinstance(info.value, PatchError)
    assert _installed() == originals
    assert not is_patched() and SESSION.runtime is None


def test_supported_range():
    assert str(SUPPORTED) == ">=0.12.0,<0.20.0"
    for version in ("0.12.0", "0.12.3", "0.13.1", "0.14.0", "0.15.3", "0.16.0", "0.16.1",
                    "0.16.1rc0", "0.17.0", "0.17.1", "0.18.0", "0.18.2", "0.19.0", "0.19.2"):
        assert SUPPORTED.contains(version), version
    for version in ("0.11.0", "0.11.9", "0.20.0", "0.20.0rc1", "0.9.0", "1.16.0"):
        assert not SUPPORTED.contains(version), version


# --- the registry on its own -----------------------------------------------------------------

_START_GRAD_SYNC = next(p for p in PATCHES if p.id == "bucket-start-grad-sync")
_START_PARAM_SYNC = next(p for p in PATCHES if p.id == "bucket-start-param-sync")  # same on all releases
_DDP_INIT = next(p for p in PATCHES if p.id == "ddp-init")


def _passthrough(original):
    def wrapper(*args, **kwargs):
        return original(*args, **kwargs)

    return wrapper


def _copy(patch, **changes):
    fields = dict(id=patch.id, target=patch.target, wrap=_passthrough, versions=patch.versions,
                  params=patch.params, description=patch.description)
    fields.update(changes)
    return Patch(**fields)


def test_signature_mismatch_refuses_and_patches_nothing(originals):
    registry = PatchRegistry()
    registry.add(_copy(_DDP_INIT))  # fine on its own, listed first
    registry.add(_copy(_START_GRAD_SYNC, params=("self", "force_all_reduce", "bogus")))
    with pytest.raises(PatchError) as info:
        registry.apply(INSTALLED)
    message = str(info.value)
    assert "bucket-start-grad-sync" in message and "bogus" in message
    assert "refusing" in message
    assert not registry.is_applied()
    assert _installed() == originals


def test_renamed_parameter_refuses():
    registry = PatchRegistry([_copy(_START_PARAM_SYNC, params=("self", "force"))])
    with pytest.raises(PatchError, match="force_sync"):
        registry.check(INSTALLED)


def test_patch_for_other_releases_is_not_applied(originals):
    """A patch declared for other releases (a release-specific fix, or another release's variant
    of a patch) is left out, and its signature is not checked; the rest applies."""
    registry = PatchRegistry()
    registry.add(_copy(_DDP_INIT))
    registry.add(_copy(_START_GRAD_SYNC, versions=VersionRange("0.11.0", "0.12.0"), params=("bogus",)))
    assert [p.id for p in registry.applicable(INSTALLED)] == [_DDP_INIT.id]
    assert registry.apply(INSTALLED) == [_DDP_INIT.id]
    assert registry.is_applied(_DDP_INIT.id) and not registry.is_applied(_START_GRAD_SYNC.id)
    assert _installed()[_START_GRAD_SYNC.target] is originals[_START_GRAD_SYNC.target]
    assert registry.revert() == [_DDP_INIT.id]
    assert _installed() == originals


def test_missing_attribute_refuses():
    target = _START_GRAD_SYNC.target.replace("start_grad_sync", "start_grad_sync_renamed")
    registry = PatchRegistry([_copy(_START_GRAD_SYNC, target=target)])
    with pytest.raises(PatchError, match="does not exist"):
        registry.check(INSTALLED)


@pytest.mark.parametrize(
    "old, new",
    [("_ParamAndGradBucketGroup", "_RenamedBucketGroup"),
     ("megatron.core.distributed.param_and_grad_buffer", "megatron.core.distributed.moved_away")],
)
def test_missing_owner_class_or_module_refuses_with_patch_error(old, new):
    target = _START_GRAD_SYNC.target.replace(old, new)
    registry = PatchRegistry([_copy(_START_GRAD_SYNC, target=target)])
    with pytest.raises(PatchError) as info:
        registry.check(INSTALLED)
    assert "bucket-start-grad-sync" in str(info.value) and new in str(info.value)


def test_duplicate_id_refused():
    registry = PatchRegistry([])
    registry.add(_copy(_DDP_INIT))
    with pytest.raises(ValueError, match="duplicate patch id ddp-init"):
        registry.add(_copy(_DDP_INIT))


@pytest.fixture
def fake_module(monkeypatch):
    """An importable module whose class has a plain, a static and a class method."""
    module = types.ModuleType("megatron_edit_fake_target")

    class Base:
        def inherited(self, x):
            return ("base", x)

    class Owner(Base):
        def method(self, x):
            return ("method", x)

        @staticmethod
        def static(x):
            return ("static", x)

        @classmethod
        def klass(cls, x):
            return ("klass", cls.__name__, x)

    module.Base, module.Owner = Base, Owner
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def _tagging(original):
    def wrapper(*args, **kwargs):
        return ("patched", original(*args, **kwargs))

    return wrapper


def _fake_registry(module, attrs, params):
    registry = PatchRegistry()
    for attr, ps in zip(attrs, params):
        registry.add(Patch(attr, f"{module.__name__}:Owner.{attr}", _tagging,
                           VersionRange("0.16.0", "0.17.0"), ps, "test"))
    return registry


def test_static_and_class_methods_keep_their_kind(fake_module):
    Owner = fake_module.Owner
    raw = {a: Owner.__dict__[a] for a in ("method", "static", "klass")}
    registry = _fake_registry(fake_module, ["method", "static", "klass"],
                              [("self", "x"), ("x",), ("cls", "x")])
    assert registry.apply("0.16.1") == ["method", "static", "klass"]
    assert Owner().method(1) == ("patched", ("method", 1))
    assert Owner.static(2) == ("patched", ("static", 2))
    assert Owner.klass(3) == ("patched", ("klass", "Owner", 3))
    assert isinstance(Owner.__dict__["static"], staticmethod)
    assert isinstance(Owner.__dict__["klass"], classmethod)
    assert registry.original("static") is raw["static"].__func__
    assert registry.apply("0.16.1") == []  # idempotent
    assert registry.revert() == ["klass", "static", "method"]  # newest first
    for attr, obj in raw.items():
        assert Owner.__dict__[attr] is obj
    assert Owner.static(2) == ("static", 2)


def test_revert_of_an_inherited_method_leaves_no_copy(fake_module):
    Owner = fake_module.Owner
    registry = _fake_registry(fake_module, ["inherited"], [("self", "x")])
    registry.apply("0.16.1")
    assert Owner().inherited(1) == ("patched", ("base", 1))
    registry.revert()
    assert "inherited" not in vars(Owner)
    assert Owner().inherited(1) == ("base", 1)


def test_replace_patches_set_the_object_as_is_and_revert_exactly(fake_module):
    """The ``replace`` kind (the CPU adapter's stand-ins): the value itself, no signature check,
    no wrapper marks; recorded and reverted like a wrap (an inherited original is deleted)."""
    Owner = fake_module.Owner
    raw = Owner.__dict__["static"]
    stand_in, constant = (lambda: "stand-in"), (1, 2)
    registry = PatchRegistry()
    versions = VersionRange("0.16.0", "0.17.0")
    registry.add(Patch.replacing("static", f"{fake_module.__name__}:Owner.static", stand_in, versions, "t"))
    registry.add(Patch.replacing("inherited", f"{fake_module.__name__}:Owner.inherited", constant,
                                 versions, "t"))
    assert registry.apply("0.16.1") == ["static", "inherited"]
    assert Owner.__dict__["static"] is stand_in and not hasattr(stand_in, "_megatron_edit_patch")
    assert Owner.inherited is constant
    assert registry.apply("0.16.1") == []  # idempotent
    assert registry.revert() == ["inherited", "static"]
    assert Owner.__dict__["static"] is raw and "inherited" not in vars(Owner)
    with pytest.raises(ValueError, match="kind"):
        Patch("x", "m:a", _tagging, versions, (), "t", kind="swap")


# --- python -m megatron_edit.wraps --list ----------------------------------------------------


def test_list_names_every_patch(originals, capsys):
    assert list_patches(["--list"]) == 0
    out = capsys.readouterr().out
    assert f"megatron-core {INSTALLED} installed" in out
    for patch in PATCHES:
        line = next(ln for ln in out.splitlines() if ln.startswith(patch.id + " "))
        assert "applied=no" in line and patch.target in line and " applies " in line
    for patch in ALL_PATCHES:
        if patch not in PATCHES:
            line = next(ln for ln in out.splitlines() if ln.startswith(patch.id + " "))
            assert " n/a " in line and "applied=no" in line
    patch_megatron_for_local_sgd(LocalSGDConfig())
    list_patches(["--list"])
    out = capsys.readouterr().out
    assert out.count("applied=yes") == len(PATCHES)


def test_list_as_a_module():
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "megatron_edit.wraps", "--list"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    for pid in EXPECTED_IDS:
        assert pid in proc.stdout


# --- megatron-core's load fixes alone (plain Megatron) ---------------------------------------


def test_load_fixes_alone_patch_and_revert_and_give_way_to_the_full_registry(originals):
    """patch_megatron_load_fixes(): the fixes of megatron-core's own load defects for plain
    Megatron (one wrap per target, reverted exactly); patch_megatron_for_local_sgd() replaces them
    (its checkpoint patches compose the same fixes), and while it is active the call does nothing."""
    from megatron_edit import patch_megatron_load_fixes, unpatch_megatron_load_fixes
    from megatron_edit.mcore.checkpoint import FSDP_EMPTY_SHARD_BUG, FSDP_LOAD_FIXES, LOAD_FIXES, TORCH_ADAM_LOAD_BUGS

    from megatron_edit.mcore.checkpoint.load_fixes import METADATA_FIX

    if not TORCH_ADAM_LOAD_BUGS.contains(INSTALLED):  # the metadata fix only (every release)
        assert patch_megatron_load_fixes() == [METADATA_FIX[0]]
        assert unpatch_megatron_load_fixes() == [METADATA_FIX[0]]
        return
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    fixes = list(LOAD_FIXES) + (list(FSDP_LOAD_FIXES) if FSDP_EMPTY_SHARD_BUG.contains(INSTALLED) else [])
    methods = [method for _, method, *_ in fixes]
    before = {m: inspect.getattr_static(DistributedOptimizer, m) for m in methods}
    assert patch_megatron_load_fixes() == [patch_id for patch_id, *_ in fixes] + [METADATA_FIX[0]]
    for m in methods:
        assert inspect.getattr_static(DistributedOptimizer, m).__wrapped__ is before[m]
    assert patch_megatron_for_local_sgd(LocalSGDConfig()) == EXPECTED_IDS  # the fixes give way
    for m in methods:
        assert inspect.getattr_static(DistributedOptimizer, m).__wrapped__ is before[m], m  # one layer
    assert set(patch_megatron_load_fixes()) <= set(EXPECTED_IDS)
    unpatch_megatron_for_local_sgd()
    assert unpatch_megatron_load_fixes() == []
    assert {m: inspect.getattr_static(DistributedOptimizer, m) for m in methods} == before
