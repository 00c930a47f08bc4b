"""Old import path of the three functions a Megatron-LM fork calls (``patches/`` before 0.2):
kept so that forks which applied those patch files keep working. New forks import
:mod:`megatron_edit.training`."""

from .training import add_local_sgd_args, native_training_log, validate_local_sgd_args

__all__ = ["add_local_sgd_args", "native_training_log", "validate_local_sgd_args"]
