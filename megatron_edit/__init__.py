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
:mod:`.api`, :mod:`.launch` and :mod:`.patches`.
"""

from .api import (
    UnsupportedMegatronVersion,
    get_local_sgd,
    is_patched,
    megatron_core_version,
    patch_megatron_for_local_sgd,
    patch_megatron_load_fixes,
    unpatch_megatron_for_local_sgd,
    unpatch_megatron_load_fixes,
)
from .arguments import configs_from_args, local_sgd_args_provider
from .config import ConfigError, GTAConfig, LocalSGDConfig, NotSupportedYet, OuterOptimizerConfig
from .exchange.report import SyncReport
from .mcore.compat import SUPPORTED as SUPPORTED_MEGATRON_CORE
from .mcore.controller import LocalSGD
from .mcore.patching import PatchError

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
    "unpatch_megatron_for_local_sgd",
    "unpatch_megatron_load_fixes",
]
