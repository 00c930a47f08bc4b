"""List the runtime patches: ``python -m megatron_edit.patches --list``."""

from __future__ import annotations

import argparse

from .api import _Session, build_full_registry, megatron_core_version


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_edit.patches")
    parser.add_argument("--list", action="store_true", help="list the patches and their versions")
    args = parser.parse_args(argv)
    registry = _Session.registry or build_full_registry(lambda: None)
    version = megatron_core_version()
    print(f"megatron-core {version} installed")
    for pid, target, versions, applied, description in registry.table():
        ok = "supported" if registry.patches[[p.id for p in registry.patches].index(pid)].versions.contains(version) else "UNSUPPORTED"
        print(f"{pid:32s} {versions:16s} {ok:11s} applied={applied:3s} {target}\n    {description}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
