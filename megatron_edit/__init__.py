"""megatron_edit: EDiT and A-EDiT local SGD for Megatron-LM, as runtime patches.

EDiT (arXiv 2412.07210): data-parallel workers train locally and exchange pseudo-gradients
every H steps, layer by layer during the forward pass, on the shards of Megatron's distributed
optimizer. Typical use with megatron-core alone::

    from megatron_edit import LocalSGDConfig, patch_megatron_for_local_sgd
    patch_megatron_for_local_sgd(local_sgd_config=LocalSGDConfig(local_sgd_sync_interval=8))
    # ... build DistributedDataParallel and get_megatron_optimizer as usual ...

With Megatron-LM's ``pretrain``: call ``patch_megatron_for_local_sgd()`` without configs and
add the flags with ``local_sgd_args_provider``.

The layers, each importing only those before it: :mod:`.config` and :mod:`.arguments`
(configuration); :mod:`.algorithm` (pure math); :mod:`.exchange` (the collectives of a sync,
over groups passed in); :mod:`.mcore` (the attachment to megatron-core); :mod:`.cpu` (running on
CPU, demo data); :mod:`.training` (Megatron-LM's training code); and the entry points
:mod:`.api`, :mod:`.launch` and :mod:`.wraps`.
"""

# The public names, each from the module that defines it, imported on first use (PEP 562): a
# program that only parses the flags (``megatron_edit.arguments``, ``megatron_edit.config``)
# does not import torch or megatron-core, so the main job can check its flags in well under a
# second before it starts any rank.
_PUBLIC = {
    "UnsupportedMegatronVersion": "api",
    "get_local_sgd": "api",
    "is_patched": "api",
    "megatron_core_version": "api",
    "patch_megatron_for_local_sgd": "api",
    "patch_megatron_load_fixes": "api",
    "set_train_iters": "api",
    "unpatch_megatron_for_local_sgd": "api",
    "unpatch_megatron_load_fixes": "api",
    "configs_from_args": "arguments",
    "local_sgd_args_provider": "arguments",
    "ConfigError": "config",
    "GTAConfig": "config",
    "LocalSGDConfig": "config",
    "NotSupportedYet": "config",
    "OuterOptimizerConfig": "config",
    "SyncReport": "exchange.report",
    "SUPPORTED_MEGATRON_CORE": "mcore.compat",
    "LocalSGD": "mcore.controller",
    "PatchError": "mcore.wrap_registry",
}
_RENAMED = {"SUPPORTED_MEGATRON_CORE": "SUPPORTED"}


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'megatron_edit' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), _RENAMED.get(name, name))
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))


__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "GTAConfig",
    "LocalSGD",
    "LocalSGDConfig",
    "NotSupportedYet",
    "OuterOptimizerConfig",
    "PatchError",
    "SUPPORTED_MEGATRON_CORE",
    "SyncReport",
    "UnsupportedMegatronVersion",
    "configs_from_args",
    "get_local_sgd",
    "is_patched",
    "local_sgd_args_provider",
    "megatron_core_version",
    "patch_megatron_for_local_sgd",
    "patch_megatron_load_fixes",
    "set_train_iters",
    "unpatch_megatron_for_local_sgd",
    "unpatch_megatron_load_fixes",
]
