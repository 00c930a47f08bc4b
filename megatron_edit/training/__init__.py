"""Megatron-LM's training code (``megatron.training``, repository only) with EDiT.

* :mod:`.flags`: the EDiT flags on Megatron's parser;
* :mod:`.validation`: the flags checked with Megatron-LM's options at start-up;
* :mod:`.metrics`: each sync's figures on the console line and in TensorBoard / W&B;
* :mod:`.worker_local`: Megatron-LM's per-step collectives kept inside each worker;
* :mod:`.training_wraps`: the runtime patches that wire these in (or a fork calls them itself).

A Megatron-LM fork (``patches/``) calls the three functions exported here.
"""

from .flags import add_local_sgd_args
from .training_wraps import native_training_log
from .validation import validate_local_sgd_args

__all__ = ["add_local_sgd_args", "native_training_log", "validate_local_sgd_args"]
