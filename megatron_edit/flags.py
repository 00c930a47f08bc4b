"""Command-line flags declared on the config dataclasses' fields, and the field documentation.

A field of :class:`~megatron_edit.config.LocalSGDConfig` or :class:`~megatron_edit.config.GTAConfig`
is declared with :func:`flag`, which puts a :class:`Flag` in the field's metadata::

    local_sgd_sync_interval: int = flag("--local-sgd-sync-interval", 1, first=True,
                                        help="H: optimizer steps between outer syncs after warmup.")

From that one declaration come the field -> flag map ``megatron_edit.config.FLAG_NAMES`` (which
every validation message uses, :func:`flag_names`), the argparse declaration
(:func:`add_flags`, used by :func:`megatron_edit.arguments.local_sgd_args_provider`), the args ->
config mapping (:func:`config_kwargs`, used by :func:`megatron_edit.arguments.configs_from_args`),
and through those the flag table of the generated configuration reference
(``scripts/dev/gen_docs.py``). What argparse needs is derived from the field's annotation and
default where it can be: a ``bool`` defaulting to False is a switch (``store_true``), one
defaulting to True an on/off pair (``--[no-]...``), as is an ``Optional[bool]`` (None when neither is given); ``int`` / ``float`` parse as such,
``Optional[float]`` as a number or ``none``; a flag with ``choices`` takes them as strings;
anything else needs ``type=``.

The outer optimizer's flags map onto one dict field (``outer_optim_kwargs``), so
:mod:`megatron_edit.arguments` declares and maps them by hand; their fields carry
``flag(..., by_hand=True)``, which only names them.

Neither torch nor Megatron is imported (layer 0, like the configs and the flags' module).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import typing
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

METADATA_KEY = "flag"


def _none_or_float(text: str) -> Optional[float]:
    """argparse type of an optional number: ``none`` (any case) is None."""
    if text.lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or None, got {text!r}") from None


def with_default(text: str) -> str:
    """Help text that shows the flag's default (in Megatron's parser too, whose formatter
    does not add it)."""
    return text + " (default: %(default)s)"


@dataclass(frozen=True)
class Flag:
    """A field's command-line flag: what argparse needs beyond the field's type and default."""

    name: str
    """The flag as typed, e.g. ``--local-sgd-sync-interval`` (its dest: ``local_sgd_sync_interval``)."""
    help: Optional[str] = None
    """The ``--help`` text; ``(default: ...)`` is appended unless ``show_default`` is False."""
    type: Optional[Callable[[str], Any]] = None
    """Parse function; None: from the field's annotation (``int``, ``float``, ``str``;
    ``Optional[float]``: a number or ``none``)."""
    choices: Optional[Sequence[str]] = None
    negatable: bool = False
    """``--[no-]name`` (BooleanOptionalAction) for a bool field defaulting to False too."""
    show_default: bool = True
    """False where the help states the default in its own words (a switch never shows it)."""
    first: bool = False
    """Listed before the class's other flags in ``--help`` (the settings every run chooses);
    the others follow in field order."""
    by_hand: bool = False
    """Declared and mapped by :mod:`megatron_edit.arguments` itself (the outer optimizer's
    flags, which map onto one dict field): only the name is used here."""

    @property
    def dest(self) -> str:
        """The attribute argparse stores the value in."""
        return self.name.lstrip("-").replace("-", "_")

    def argparse_kwargs(self, annotation: Any, default: Any) -> Dict[str, Any]:
        """``add_argument`` keywords for a field of that annotation and default."""
        if annotation == Optional[bool]:  # --[no-]name, and None when neither is given
            kwargs: Dict[str, Any] = dict(action=argparse.BooleanOptionalAction, default=default)
        elif annotation is bool:
            if not (self.negatable or default):
                return dict(action="store_true", help=self.help)
            kwargs = dict(action=argparse.BooleanOptionalAction, default=default)
        else:
            kwargs = dict(default=default)
            if self.type is not None:
                kwargs["type"] = self.type
            elif self.choices is None:
                if annotation == Optional[float]:
                    kwargs["type"] = _none_or_float
                elif annotation in (int, float, str):
                    kwargs["type"] = annotation
                else:
                    raise TypeError(f"{self.name}: a field annotated {annotation!r} needs flag(type=...)")
            if self.choices is not None:
                kwargs["choices"] = self.choices
        kwargs["help"] = with_default(self.help) if self.show_default else self.help
        return kwargs


def flag(name: str, default: Any = dataclasses.MISSING, *, help: Optional[str] = None,
         type: Optional[Callable[[str], Any]] = None, choices: Optional[Sequence[str]] = None,
         negatable: bool = False, show_default: bool = True, first: bool = False,
         by_hand: bool = False, default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field (``default`` or ``default_factory``) whose flag is ``name``; see
    :class:`Flag` for the keywords. A flag that is generated must have its ``help``."""
    if help is None and not by_hand:
        raise TypeError(f"flag({name!r}): give help= (or by_hand=True)")
    meta = {METADATA_KEY: Flag(name, help, type, choices, negatable, show_default, first, by_hand)}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


def flag_of(f: dataclasses.Field) -> Optional[Flag]:
    """The :class:`Flag` of a dataclass field, or None."""
    return f.metadata.get(METADATA_KEY)


def flag_names(*classes: type) -> Dict[str, str]:
    """{field: its flag} over ``classes``, in field order."""
    return {f.name: flag_of(f).name for cls in classes for f in dataclasses.fields(cls) if flag_of(f)}


def generated_flags(cls: type) -> Iterator[Tuple[dataclasses.Field, Flag]]:
    """(field, flag) of every field of ``cls`` whose flag is generated (not ``by_hand``), in
    ``--help`` order: the ``first`` ones, then the others, each in field order."""
    pairs = [(f, flag_of(f)) for f in dataclasses.fields(cls)]
    pairs = [(f, fl) for f, fl in pairs if fl is not None and not fl.by_hand]
    return iter(sorted(pairs, key=lambda pair: not pair[1].first))


def add_flags(group: Any, cls: type) -> None:
    """``group.add_argument`` for every generated flag of ``cls`` (a parser or argument group)."""
    hints = typing.get_type_hints(cls)
    for f, fl in generated_flags(cls):
        group.add_argument(fl.name, **fl.argparse_kwargs(hints[f.name], f.default))


def config_kwargs(cls: type, args: argparse.Namespace) -> Dict[str, Any]:
    """{field: the parsed value of its flag} for every generated flag of ``cls``."""
    return {f.name: getattr(args, fl.dest) for f, fl in generated_flags(cls)}


# --------------------------------------------------------------------------------------------
# Field documentation
# --------------------------------------------------------------------------------------------

def field_docs(cls) -> Dict[str, str]:
    """{field: its docstring} of a config dataclass, read from the class's source (the string
    after each field), for ``help()``, IDEs and the documentation's configuration reference."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def documented(cls):
    """The class docstring gains every field: name, flag, default and its documentation (the
    strings under the fields are invisible to ``help()`` otherwise)."""
    docs = field_docs(cls)
    lines = [inspect.cleandoc(cls.__doc__ or cls.__name__), "", "Fields:", ""]
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = "required"
        fl = flag_of(f)
        lines.append(f"{f.name} = {default}" + (f"  ({fl.name})" if fl else ""))
        lines.extend("    " + line for line in docs.get(f.name, "(undocumented)").splitlines())
        lines.append("")
    cls.__doc__ = "\n".join(lines).rstrip() + "\n"
    return cls
