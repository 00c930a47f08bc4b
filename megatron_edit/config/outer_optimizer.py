"""The outer optimizer's class and keyword arguments, checked without building an optimizer:
the numbers every optimizer shares, without importing torch (:func:`check_outer_numbers`, also
the flags' check before any rank starts), and each keyword against the class's constructor
(:func:`_check_outer_kwargs`). Part of :mod:`megatron_edit.config`, which re-exports it.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Dict, Type, Union

from dataclasses import dataclass

from ..flags import documented, flag
from .values import ConfigError, _got, _is_bool, _is_int, _is_number, _is_tensor, _name, _require


# The paper's outer optimizer (Nesterov SGD), the default of OuterOptimizerConfig.
DEFAULT_OUTER_KWARGS: Dict[str, Any] = {"lr": 0.7, "momentum": 0.9, "nesterov": True}

# With the sparse exchange (``LocalSGDConfig.exchange_topk_density``) the default outer SGD is
# SparseLoCo's: lr 1 without momentum (its error feedback carries what momentum would). On the
# convergence benchmark (H = 8, top-k 3% int2, 2 seeds) Nesterov 0.7 / 0.9 ended 11-16% higher
# (docs/benchmarks/convergence.md).
TOPK_OUTER_KWARGS: Dict[str, Any] = {"lr": 1.0, "momentum": 0.0, "nesterov": False}

# Short names accepted by --outer-optimizer.
OUTER_OPTIMIZERS: Dict[str, str] = {
    "sgd": "torch.optim.SGD",
    "adam": "torch.optim.Adam",
    "adamw": "torch.optim.AdamW",
}


def resolve_optimizer_class(spec: Union[str, type]) -> Type["torch.optim.Optimizer"]:  # noqa: F821
    """``"sgd"`` / ``"torch.optim.SGD"`` / a class -> the optimizer class (ConfigError if not)."""
    import torch

    if isinstance(spec, str):
        path = OUTER_OPTIMIZERS.get(spec.lower(), spec)
        module_name, _, cls_name = path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), cls_name) if module_name else None
        except (ImportError, AttributeError):
            cls = None
        if cls is None:
            raise ConfigError(
                f"{_name('outer_optim_class')}: cannot import {spec!r}; use one of "
                f"{sorted(OUTER_OPTIMIZERS)} or a dotted path such as 'torch.optim.SGD'."
            )
    else:
        cls = spec
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(
            f"{_name('outer_optim_class')}: {spec!r} is not a torch.optim.Optimizer subclass."
        )
    return cls


def check_outer_numbers(kwargs: Dict[str, Any], name: str = "the outer optimizer") -> None:
    """The outer optimizer's numbers, whatever its class and without importing torch: ``lr``
    given, finite and > 0; ``momentum`` and each of ``betas`` (a pair) in [0, 1) (torch accepts
    momentum 1.5, and fails on ``betas=(0.9,)`` only at its first step, with an IndexError);
    ``eps``, ``weight_decay`` and ``dampening`` finite and >= 0; ``nesterov`` only with
    momentum and no dampening."""
    def fail(msg: str) -> None:
        raise ConfigError(f"{_name('outer_optim_kwargs')}: {msg}")

    if "lr" not in kwargs:
        fail(f"give lr ({name}'s own default would be used without a word).")
    lr = kwargs["lr"]
    if not (_is_tensor(lr) or (_is_number(lr) and lr > 0)):
        fail(f"lr must be a finite number > 0 ({_got(lr)}).")
    momentum = kwargs.get("momentum")
    if momentum is not None and not _is_tensor(momentum):
        if not _is_number(momentum):
            fail(f"momentum must be a finite number ({_got(momentum)}).")
        if not 0 <= momentum < 1:
            fail(f"momentum must be in [0, 1) (got {momentum!r}): at 1 or above the outer "
                 "updates never decay and the run diverges.")
    if "betas" in kwargs:
        betas = kwargs["betas"]
        if not (isinstance(betas, (list, tuple)) and len(betas) == 2
                and all(_is_number(b) and 0 <= b < 1 for b in betas)):
            fail(f"betas must be a pair of numbers in [0, 1) for {name}, e.g. [0.9, 0.95] "
                 f"({_got(betas)}).")
    for key in ("eps", "weight_decay", "dampening"):
        value = kwargs.get(key)
        if value is not None and not _is_tensor(value) and not (_is_number(value) and value >= 0):
            fail(f"{key} must be a finite number >= 0 ({_got(value)}).")
    if kwargs.get("nesterov") is True and (not momentum or kwargs.get("dampening")):
        fail("nesterov: Nesterov momentum needs momentum > 0 and no dampening (torch's SGD "
             "refuses it otherwise): "
             "set momentum, or nesterov False.")


def _check_outer_kwargs(cls: type, kwargs: Dict[str, Any]) -> None:
    """Each keyword against ``cls``'s constructor: known (unless it takes ``**kwargs``), and of
    the kind its default has (a bool for a bool, a finite number for a number); then the
    numbers every optimizer shares (:func:`check_outer_numbers`)."""
    def fail(msg: str) -> None:
        raise ConfigError(f"{_name('outer_optim_kwargs')}: {msg}")

    check_outer_numbers({k: v for k, v in kwargs.items() if k == "lr"}, cls.__name__)
    params = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    options = [n for n, p in params.items() if n not in ("self", "params")
               and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    for key, value in kwargs.items():
        if key in ("self", "params") or (key not in params and not takes_any):
            fail(f"{cls.__name__} has no option {key!r} (its options: {', '.join(options)}).")
        default = params[key].default if key in params else inspect.Parameter.empty
        if isinstance(default, bool) and not _is_bool(value):
            fail(f"{key} must be True or False for {cls.__name__} ({_got(value)}).")
        if _is_int(default) or isinstance(default, float):
            if not _is_number(value) and not _is_tensor(value):
                fail(f"{key} must be a finite number for {cls.__name__} ({_got(value)}).")
        if isinstance(value, (list, tuple)) and not all(_is_number(v) for v in value):
            fail(f"{key} must hold finite numbers ({_got(value)}).")
    check_outer_numbers(kwargs, cls.__name__)


@documented
@dataclass
class OuterOptimizerConfig:
    """The outer optimizer: steps the anchor with the averaged pseudo-gradient as its gradient."""

    outer_optim_class: Union[str, type] = flag("--outer-optimizer", "torch.optim.SGD", by_hand=True)
    """Any torch optimizer class, as a class, a dotted path, or one of ``sgd``, ``adam``,
    ``adamw``. SGD with lr 1 and no momentum is plain parameter averaging."""

    outer_optim_kwargs: Dict[str, Any] = flag(
        "--outer-optimizer-lr / --outer-optimizer-momentum / --outer-optimizer-kwargs", by_hand=True,
        default_factory=lambda: dict(DEFAULT_OUTER_KWARGS))
    """Keyword arguments of the outer optimizer's constructor (default: the paper's Nesterov
    SGD, lr 0.7, momentum 0.9; with the sparse exchange, where no outer optimizer is given,
    :func:`default_outer_config`: SGD lr 1 without momentum)."""

    def __post_init__(self) -> None:
        cls = resolve_optimizer_class(self.outer_optim_class)
        kwargs = self.outer_optim_kwargs
        _require(
            isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs),
            "outer_optim_kwargs",
            f"must be a dict of keyword arguments (got {type(kwargs).__name__}).",
        )
        _check_outer_kwargs(cls, kwargs)  # no optimizer is built to check them

    @property
    def optimizer_class(self) -> type:
        return resolve_optimizer_class(self.outer_optim_class)


def default_outer_config(local) -> OuterOptimizerConfig:
    """The outer optimizer where none is given (``local``: the ``LocalSGDConfig`` or None): the
    paper's Nesterov SGD, or with the sparse exchange SparseLoCo's SGD lr 1 without momentum
    (:data:`TOPK_OUTER_KWARGS`)."""
    if local is not None and local.exchange_topk_density is not None:
        return OuterOptimizerConfig(outer_optim_kwargs=dict(TOPK_OUTER_KWARGS))
    return OuterOptimizerConfig()
