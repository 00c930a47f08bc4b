"""``python -m megatron_edit.wraps --list``, the listing CLI: every patch of the registry
(:func:`megatron_edit.api.build_full_registry`: the megatron-core wraps, the checkpoint wraps,
Megatron-LM's training wraps), the releases each applies to, whether it applies to the installed
megatron-core and whether it is applied in this process.

Not the ``patches/`` folder of git patch files for a Megatron-LM fork, nor the modules that
declare the wraps (:mod:`megatron_edit.mcore.core_wraps`, :mod:`megatron_edit.mcore.checkpoint.checkpoint_wraps`,
:mod:`megatron_edit.training.training_wraps`); the engine that applies them is
:mod:`megatron_edit.mcore.wrap_registry`.
"""

from __future__ import annotations

import argparse

from .api import build_full_registry, unsupported_message
from .mcore import compat
from .mcore.compat import megatron_core_version
from .mcore.session import SESSION


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_edit.wraps")
    parser.add_argument("--list", action="store_true", help="list the registry's patches (megatron-core, checkpoint and Megatron-LM training "
                             "wraps) and the megatron-core releases each applies to")
    parser.parse_args(argv)
    version = megatron_core_version()
    print(f"megatron-core {version} installed")
    if not compat.is_supported(version):
        print(f"{unsupported_message(version)} Nothing would be patched.")
        return 1
    registry = SESSION.registry or build_full_registry(lambda: None)
    for pid, target, versions, applied, description in registry.table():
        ok = "applies" if registry.patches[[p.id for p in registry.patches].index(pid)].versions.contains(version) else "n/a"
        print(f"{pid:32s} {versions:16s} {ok:11s} applied={applied:3s} {target}\n    {description}")
        for release_range, names in compat.SIGNATURES.get(target, ()):
            here = "*" if release_range.contains(version) else " "
            print(f"  {here} {str(release_range):16s} ({', '.join(names)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
