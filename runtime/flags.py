"""Flags declared once: a configuration dataclass's fields carry their command-line option.

A field made with `flag(default, "--option", help, panel)` is both a config value and a flag;
the metadata names the option (vLLM's spelling), its help text and help panel. A command
names the flag dataclasses it takes with a `FlagGroup` (which fields, its own defaults, or
comma lists for sweeps); `group_specs` resolves that into one `FlagSpec` per option and
`build_group` turns parsed option values back into the dataclass; `expand_groups` does both
for a whole command, and tells a command that asks (`Typed`) which flags its command line
gave, one typed at its default value included. Nothing here reads argv: the CLI hands the
specs to its parser library (through the `option` it passes), the values back and which
options were given.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any


def flag(default: Any, option: str, help: str | None = None, panel: str | None = None,
         **extra: Any) -> Any:
    """A dataclass field that is also a command-line flag. `option` is e.g. "--block-size" or
    "--enable-x/--no-enable-x" for a boolean pair; `extra` passes on short="-tp" (or
    alias="--sim-model": a second spelling),
    envvar="NAME", min=1 / max=9 (the parser refuses a smaller / larger value) or
    bounds=(1, 4096) (the dataclass refuses a value outside them, `check_bounds`)."""
    return field(default=default, metadata={"flag": option, "help": help, "panel": panel,
                                            **extra})


def check_bounds(config: Any) -> None:
    """ValueError naming the option and the value for the first flag field of dataclass
    `config` outside its `bounds=(lo, hi)` (inclusive; None, an unset flag, passes). Called
    from `__post_init__`, so a limit declared on the field holds for the CLI and for code
    that builds the dataclass alike."""
    for f in dataclasses.fields(config):
        if "bounds" not in f.metadata:
            continue
        lo, hi = f.metadata["bounds"]
        value = getattr(config, f.name)
        option = str(f.metadata["flag"]).split("/")[0]
        if value is not None and value < lo:
            raise ValueError(f"{option} must be >= {lo}, got {value}")
        if value is not None and value > hi:
            raise ValueError(f"{option} must be at most {hi}, got {value}")


@dataclass(frozen=True)
class Typed:
    """Which flags a command line gave (typed, or set by their environment variable), for
    each flag dataclass built from it: a flag typed at its default value is given too
    (`rt simulate --pd-threshold 16` without P/D is refused, as 17 is). `expand_groups`
    makes it for a command that takes a parameter annotated `Typed`."""

    built: tuple[tuple[Any, frozenset[str]], ...] = ()  # (dataclass instance, fields given)

    def fields(self, config: Any) -> frozenset[str] | None:
        """The fields given of `config`, this very instance; None when it was not built from
        the command line (e.g. a copy with a field replaced)."""
        return next((fields for built, fields in self.built if built is config), None)


def given_options(config: Any, names: Sequence[str] | None = None,
                  typed: Typed | None = None) -> list[str]:
    """The flags of dataclass `config` (`names` only, when given) that were given, each as
    typed: "--gpu 'a100-80gb'", "-tp"'s long name and its value, "--no-x" for a False
    boolean pair, a repeated flag with its first value; in field order. Given: on the
    command line, where `typed` knows `config` (whatever the value); else set to other than
    its default."""
    fields = typed.fields(config) if typed is not None else None
    given = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if "flag" not in f.metadata or (names is not None and f.name not in names) \
                or (f.name not in fields if fields is not None else value == f.default):
            continue
        on, _, off = str(f.metadata["flag"]).partition("/")
        if isinstance(value, bool):
            given.append(on if value else off)
        else:
            shown = value[0] if isinstance(value, list | tuple) and value else value
            given.append(f"{on} {shown!r}" if isinstance(shown, str) and shown is value
                         else f"{on} {shown}")
    return given


@dataclass(frozen=True)
class FlagGroup:
    """How a command offers a flag dataclass: `only` these fields (default: every field with
    flag metadata) minus `exclude`, with the command's own `defaults` and help `panel`; with
    `lists`, each as a comma list, and the command gets {field: [values]} for those given.
    `inline`: the options are listed among the command's own, where the parameter stands
    (the command's own options come first, then the shared groups')."""

    only: tuple[str, ...] | None = None
    exclude: tuple[str, ...] = ()
    defaults: Mapping[str, Any] = field(default_factory=dict)
    lists: bool = False
    panel: str | None = None
    inline: bool = False


@dataclass(frozen=True, slots=True)
class FlagSpec:
    """One option of a group: the dataclass field it fills and how the option reads."""

    field: str
    name: str  # the option's parameter name: "--max-num-seqs" -> "max_num_seqs"
    decls: tuple[str, ...]  # ("--tensor-parallel-size", "-tp")
    hint: Any  # the value's type as the parser sees it (str | None for lists)
    scalar: type  # one element's type: int for `int | None`
    default: Any
    help: str | None
    panel: str | None
    envvar: str | None
    minimum: int | float | None = None  # the smallest value the parser accepts
    maximum: int | float | None = None  # the largest


def group_specs(cls: type, group: FlagGroup) -> list[FlagSpec]:
    """The options `group` offers of dataclass `cls`, in field order."""
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "flag" not in meta or f.name in group.exclude or (
                group.only is not None and f.name not in group.only):
            continue
        hint = hints[f.name]
        scalar = next((t for t in typing.get_args(hint) or (hint,) if t is not type(None)),
                      str)
        default = group.defaults.get(f.name, None if group.lists else f.default)
        specs.append(FlagSpec(
            f.name, str(meta["flag"]).split("/")[0].lstrip("-").replace("-", "_"),
            (meta["flag"], *(meta[k] for k in ("short", "alias") if k in meta)),
            str | None if group.lists else hint, scalar, default, meta.get("help"),
            group.panel or meta.get("panel"), meta.get("envvar"), meta.get("min"),
            meta.get("max")))
    return specs


@dataclass(frozen=True, slots=True)
class GroupParam:
    """A command parameter that takes a flag dataclass: its name, the class, how the command
    offers it, and every option that fills it (a shared one included)."""

    name: str
    cls: type
    group: FlagGroup
    specs: list[FlagSpec]


def command_layout(params: Sequence[tuple[str, tuple[type, FlagGroup] | None]]
                   ) -> tuple[list[str | FlagSpec], list[GroupParam]]:
    """A command's options in listing order, from its parameters (name, and (flag class,
    group) or None for a plain parameter): the plain parameters' and `inline` groups'
    options in parameter order, then the other groups'; an option two groups share (e.g.
    --seed) is listed once, where it first appears. Returns that order (a plain parameter
    by its name) and the group parameters."""
    seen = {name for name, flags in params if flags is None}
    groups: list[GroupParam] = []

    def expand(name: str, flags: tuple[type, FlagGroup]) -> list[str | FlagSpec]:
        specs = group_specs(*flags)
        fresh: list[str | FlagSpec] = [s for s in specs if s.name not in seen]
        seen.update(s.name for s in specs)
        groups.append(GroupParam(name, *flags, specs))
        return fresh

    first = [(n, f) for n, f in params if f is None or f[1].inline]
    order = [x for n, f in first for x in ([n] if f is None else expand(n, f))]
    order += [x for n, f in params if f is not None and not f[1].inline for x in expand(n, f)]
    return order, groups


def build_group(cls: type, group: FlagGroup, specs: list[FlagSpec],
                values: Mapping[str, Any]) -> Any:
    """The dataclass (or, for lists, {field: [values]}) from the parsed option values keyed
    by `FlagSpec.name`. ValueError (from the dataclass's checks, or naming the option of a
    bad list) on bad input."""
    if not group.lists:
        return cls(**{s.field: values[s.name] for s in specs})
    return {s.field: comma_list(s.decls[0], values[s.name], s.scalar)
            for s in specs if values[s.name] is not None}


def listed(group: object) -> dict[str, list[Any]]:
    """A `lists=True` group's value as a command receives it: `build_group`'s
    {field: [values]} for the options given, not the dataclass the parameter's annotation
    names (that names only whose fields become options). TypeError if it is not one."""
    if not isinstance(group, dict):
        raise TypeError(f"a comma-list flag group is a dict, got {type(group).__name__}")
    return group


def comma_list(option: str, text: str, kind: type) -> list[Any]:
    """"1,2,4" -> [1, 2, 4] as `kind`; ValueError naming `option` and the text, or the
    first value given twice ("1,1,2", "1,1.0": a sweep ran that point twice)."""
    items = [v.strip() for v in text.split(",") if v.strip()]
    try:
        values = [kind(v) for v in items]
    except ValueError:
        raise ValueError(f"{option}: not a comma-separated list of {kind.__name__} values: "
                         f"{text!r}") from None
    if not values:
        raise ValueError(f"{option}: empty list")
    for i, value in enumerate(values):
        if value in values[:i]:
            raise ValueError(f"{option}: {items[i]!r} given twice (each value is run once)")
    return values


def expand_groups(command: Callable[..., None], option: Callable[[FlagSpec], Any],
                  guard: Callable[[], AbstractContextManager[None]],
                  given: Callable[[str], bool] | None = None) -> Callable[..., None]:
    """`command` with each parameter annotated `Annotated[FlagClass, FlagGroup(...)]` turned
    into one keyword parameter per option (`command_layout`'s order; the annotation is
    `option(spec)`, e.g. the parser library's option type); called with those options, it
    builds the dataclasses (`build_group`, inside `guard()`, which turns a ValueError into
    the parser's error) and calls `command` with them and its plain parameters. A parameter
    annotated `Typed` is no option: it gets the options `given(parameter name)` says the
    command line gave, per dataclass built (without `given`: none known, `Typed()`)."""
    hints = typing.get_type_hints(command, include_extras=True)
    signature = {p.name: p for p in inspect.signature(command).parameters.values()
                 if hints[p.name] is not Typed}
    typed_as = next((name for name, hint in hints.items() if hint is Typed), None)
    order, groups = command_layout([(name, _group_of(hints[name])) for name in signature])
    own = set(signature) - {g.name for g in groups}
    keyword = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter(x.name, keyword, default=x.default, annotation=option(x))
              if isinstance(x, FlagSpec)
              else signature[x].replace(annotation=hints[x], kind=keyword) for x in order]

    @functools.wraps(command)
    def expanded(**values: Any) -> None:
        with guard():
            built = {g.name: build_group(g.cls, g.group, g.specs, values) for g in groups}
        if typed_as is not None:
            values[typed_as] = Typed() if given is None else Typed(tuple(
                (built[g.name], frozenset(s.field for s in g.specs if given(s.name)))
                for g in groups if not g.group.lists))
        command(**{k: v for k, v in values.items() if k in own or k == typed_as}, **built)

    # read by inspect.signature (typer builds the options from it); not declared on functions
    expanded.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    expanded.__annotations__ = {p.name: p.annotation for p in params}
    return expanded


def _group_of(hint: Any) -> tuple[type, FlagGroup] | None:
    """(flag class, group) of a parameter annotated `Annotated[FlagClass, FlagGroup(...)]`."""
    group = next((m for m in getattr(hint, "__metadata__", ()) if isinstance(m, FlagGroup)),
                 None)
    return (typing.get_args(hint)[0], group) if group is not None else None
