"""The package's one patch engine: a registry of declared, reversible runtime patches.

Each :class:`Patch` is a declared object: an id, a dotted target, the megatron-core versions it
applies to, the signature it expects of the original, and a factory that wraps the original
(or, for a ``replace`` patch, gives the object that takes its place: a stand-in class, a
constant, a function that does not call the original; :meth:`Patch.replacing`). The
registry applies the patches for the installed version idempotently (a patch written for other
releases is not applied: a release-specific fix, or one of several variants of a patch), keeps
every original reachable (``wrapper.__wrapped__`` and :meth:`PatchRegistry.original`), reverts
them exactly, and fails loudly when the installed Megatron changed the target's signature
instead of silently doing nothing. Whether megatron_edit supports a release at all is decided
before the registry is used (:mod:`megatron_edit.mcore.compat`).

Nothing here knows about EDiT. Its users: :mod:`megatron_edit.mcore.core_wraps` (the megatron-core
wraps), :mod:`megatron_edit.mcore.checkpoint.checkpoint_wraps` (the checkpoint wraps),
:mod:`megatron_edit.training.training_wraps` (Megatron-LM's training wraps), and the CPU adapters
(:mod:`megatron_edit.cpu.adapter`, :mod:`megatron_edit.cpu.training_adapter`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

logger = logging.getLogger(__name__)


class PatchError(RuntimeError):
    """A patch cannot be applied to the installed Megatron."""


def version_tuple(version: str) -> Tuple[int, ...]:
    parts = []
    for p in version.split("."):
        digits = "".join(ch for ch in p if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(p):  # e.g. "1rc0": stop after the numeric prefix
            break
    return tuple(parts)


@dataclass(frozen=True)
class VersionRange:
    """Inclusive lower bound, exclusive upper bound, on megatron-core's version."""

    minimum: str
    below: str

    def contains(self, version: str) -> bool:
        v = version_tuple(version)
        return version_tuple(self.minimum) <= v < version_tuple(self.below)

    def __str__(self) -> str:
        return f">={self.minimum},<{self.below}"


WRAP = "wrap"
REPLACE = "replace"
DEFINE = "define"


@dataclass
class Patch:
    """One wrap (or replacement) of one attribute of Megatron (or of torch, for the CPU
    adapter)."""

    id: str
    """Stable name, shown by ``python -m megatron_edit.wraps --list`` (the listing CLI)."""
    target: str
    """Dotted path ``module:Owner.attr`` or ``module:attr``."""
    wrap: Callable[[Callable], Callable]
    """Given the original, returns the replacement (which must call the original)."""
    versions: VersionRange
    """megatron-core versions the wrap applies to (written and tested against); on others it is
    not applied."""
    params: Tuple[str, ...]
    """Parameter names the original must have, in order; a mismatch refuses the patch."""
    description: str
    kind: str = WRAP
    """``"wrap"``: ``wrap(original)`` calls the original; the registry checks ``params``, marks
    it (``__wrapped__``) and keeps a static or class method one. ``"replace"``: ``wrap(original)``
    is the new object, set as it is (only the target's existence is checked); still recorded
    and reverted like a wrap. ``"define"``: ``wrap(None)`` is set on a target that must not
    exist (a name the module uses without defining it); revert deletes it."""

    def __post_init__(self):
        if self.kind not in (WRAP, REPLACE, DEFINE):
            raise ValueError(f"patch {self.id}: kind must be {WRAP!r}, {REPLACE!r} or {DEFINE!r}, got {self.kind!r}")

    @classmethod
    def replacing(cls, id: str, target: str, value: object, versions: "VersionRange",
                  description: str) -> "Patch":
        """A ``replace`` patch: ``target`` becomes ``value`` while applied."""
        return cls(id, target, lambda original: value, versions, (), description, REPLACE)

    @classmethod
    def defining(cls, id: str, target: str, value: object, versions: "VersionRange",
                 description: str) -> "Patch":
        """A ``define`` patch: sets ``target``, a name its module uses but lacks, to ``value``
        (the target must not exist); reverting deletes it again."""
        return cls(id, target, lambda original: value, versions, (), description, DEFINE)

    def resolve(self) -> Tuple[object, str]:
        module_name, _, path = self.target.partition(":")
        *owners, attr = path.split(".")
        try:
            owner = importlib.import_module(module_name)
            for name in owners:
                owner = getattr(owner, name)
        except (ImportError, AttributeError) as e:
            raise PatchError(f"patch {self.id}: cannot find {self.target} ({e})") from e
        return owner, attr


@dataclass
class _Applied:
    owner: object
    attr: str
    raw_original: object  # as stored in owner.__dict__ (keeps staticmethod/classmethod)
    inherited: bool  # the original came from a base class: revert deletes instead of setting


@dataclass
class PatchRegistry:
    patches: List[Patch] = field(default_factory=list)
    _applied: Dict[str, _Applied] = field(default_factory=dict)

    def add(self, patch: Patch) -> Patch:
        if any(p.id == patch.id for p in self.patches):
            raise ValueError(f"duplicate patch id {patch.id}")
        self.patches.append(patch)
        return patch

    def is_applied(self, patch_id: Optional[str] = None) -> bool:
        if patch_id is None:
            return bool(self._applied)
        return patch_id in self._applied

    def applicable(self, version: str) -> List[Patch]:
        """The patches that apply to ``version``, in declaration order."""
        return [p for p in self.patches if p.versions.contains(version)]

    def check(self, version: str) -> None:
        """Raise PatchError unless every patch that applies to ``version`` finds its target with
        the parameters it expects."""
        for patch in self.applicable(version):
            owner, attr = patch.resolve()
            if patch.kind == DEFINE:
                if hasattr(owner, attr):
                    raise PatchError(f"patch {patch.id}: {patch.target} already exists in {version}")
                continue
            if not hasattr(owner, attr):
                raise PatchError(f"patch {patch.id}: {patch.target} does not exist in {version}")
            if patch.kind == REPLACE or not patch.params:
                continue  # nothing expected of its signature (a builtin may have none to read)
            fn = inspect.getattr_static(owner, attr)
            fn = fn.__func__ if isinstance(fn, (classmethod, staticmethod)) else fn
            fn = inspect.unwrap(fn)
            got = tuple(inspect.signature(fn).parameters)
            if got[: len(patch.params)] != patch.params:
                raise PatchError(
                    f"patch {patch.id}: {patch.target} has parameters {got}, expected "
                    f"{patch.params}; this Megatron changed the function, refusing to patch it"
                )

    def apply(self, version: str) -> List[str]:
        """Apply every patch for ``version`` not yet applied; returns the ids applied now."""
        self.check(version)
        done = []
        for patch in self.applicable(version):
            if patch.id in self._applied:
                continue
            owner, attr = patch.resolve()
            if patch.kind == DEFINE:
                setattr(owner, attr, patch.wrap(None))
                self._applied[patch.id] = _Applied(owner, attr, None, inherited=True)  # revert deletes
                done.append(patch.id)
                continue
            raw = inspect.getattr_static(owner, attr)
            inherited = attr not in vars(owner)
            if patch.kind == REPLACE:
                setattr(owner, attr, patch.wrap(raw))
                self._applied[patch.id] = _Applied(owner, attr, raw, inherited)
                done.append(patch.id)
                continue
            kind = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
            original = raw.__func__ if kind else raw
            wrapper = patch.wrap(original)
            if not isinstance(wrapper, type):  # a class (a subclass of the original) names itself
                functools.update_wrapper(wrapper, original)
            wrapper.__wrapped__ = original
            wrapper._megatron_edit_patch = patch.id
            setattr(owner, attr, kind(wrapper) if kind else wrapper)
            self._applied[patch.id] = _Applied(owner, attr, raw, inherited)
            done.append(patch.id)
        return done

    def revert(self) -> List[str]:
        """Restore every original, newest first; returns the ids reverted."""
        done = []
        for patch in reversed(self.patches):
            applied = self._applied.pop(patch.id, None)
            if applied is None:
                continue
            if applied.inherited:
                delattr(applied.owner, applied.attr)
            else:
                setattr(applied.owner, applied.attr, applied.raw_original)
            done.append(patch.id)
        return done

    def original(self, patch_id: str) -> Callable:
        """The unpatched function behind an applied patch."""
        applied = self._applied[patch_id]
        raw = applied.raw_original
        return raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw

    def table(self) -> List[Tuple[str, str, str, str, str]]:
        """(id, target, versions, applied, description) per patch."""
        return [
            (p.id, p.target, str(p.versions), "yes" if p.id in self._applied else "no", p.description)
            for p in self.patches
        ]
