"""Legacy alias module: ``megatron_edit.training_patches`` is the old import path of the three
functions a Megatron-LM fork calls, now in :mod:`megatron_edit.training`
(:func:`~megatron_edit.training.add_local_sgd_args`,
:func:`~megatron_edit.training.native_training_log`,
:func:`~megatron_edit.training.validate_local_sgd_args`). The git patch files of the ``patches/``
folder before 0.2 imported them from here; kept so that forks built from those files keep
working. New forks import :mod:`megatron_edit.training`. It declares no patches (the training
wraps are :mod:`megatron_edit.training.patches`)."""

from .training import add_local_sgd_args, native_training_log, validate_local_sgd_args

__all__ = ["add_local_sgd_args", "native_training_log", "validate_local_sgd_args"]
