"""The EDiT flags on Megatron-LM's parser, whatever ``extra_args_provider`` a script passes.

``pretrain_gpt.py`` passes its own provider, so the flags (defined in one place,
:mod:`megatron_edit.arguments`) are added by wrapping it.
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional

from ..arguments import local_sgd_args_provider


def add_local_sgd_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the EDiT flags unless the parser has them already (idempotent); returns the parser."""
    if "--use-local-sgd" not in parser._option_string_actions:
        local_sgd_args_provider(parser)
    return parser


def with_local_sgd_args(extra_args_provider: Optional[Callable]) -> Callable:
    """An ``extra_args_provider`` that runs the script's own one, then adds the EDiT flags."""

    def provider(parser):
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        return add_local_sgd_args(parser)

    return provider
