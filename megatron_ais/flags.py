"""Flags declared once, on the config dataclass fields they fill (megatron's `ArgumentGroupFactory` idea).

    @dataclasses.dataclass(frozen=True)
    class BridgeConfig(FlagConfig):
        bucket_size_mb: float = flag(512.0, "Bytes per bucket ...", name="--bridge-bucket-size-mb")

`BridgeConfig.add_flags(group)` registers `--bridge-bucket-size-mb` with that default and help;
`BridgeConfig.from_args(args)` builds the config from the parsed namespace. A field's default is its flag's default:
there is no second place to write it. Fields without `flag` are not flags (the caller passes them to `from_args`).
Only the entry points and `from_args` see the namespace; everything below takes configs.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

from megatron_ais.errors import ArgumentValidationError

_FLAG = "megatron_ais_flag"


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """How one field appears on the command line: its option string(s) and argparse's other keywords.
    `switches` maps each of several mutually exclusive option strings to the value it stores."""

    help: str
    name: str | None = None
    switches: tuple[tuple[str, Any, str], ...] = ()  # (option, value, help)
    options: tuple[tuple[str, Any], ...] = ()
    bounds: "FlagBounds | None" = None


@dataclasses.dataclass(frozen=True)
class FlagBounds:
    """The range a flag's value must lie in (None: unbounded on that side; `strict`: the bound itself is out), and
    what the edge means, said with the error."""

    low: float | None = None
    high: float | None = None
    low_strict: bool = False
    high_strict: bool = False
    note: str | None = None

    def holds(self, value) -> bool:
        if self.low is not None and not (value > self.low if self.low_strict else value >= self.low):
            return False
        return self.high is None or (value < self.high if self.high_strict else value <= self.high)

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_strict else '['}{self.low}, {self.high}{')' if self.high_strict else ']'}"
        if self.low is not None:
            return f"> {self.low}" if self.low_strict else f"at least {self.low}"
        return f"< {self.high}" if self.high_strict else f"at most {self.high}"


def flag(default: Any, help: str, *, name: str | None = None, switches: dict[str, tuple[Any, str]] | None = None,
         at_least: float | None = None, above: float | None = None, at_most: float | None = None,
         below: float | None = None, bound_note: str | None = None, **argparse_options) -> Any:
    """A dataclass field that is also a flag: `--<field-name>` unless `name` says otherwise; `switches` gives
    several store-const flags instead (e.g. --bf16 / --fp32). Types follow the default unless `type` is given;
    a False default is a store-true switch; `choices` may be a function that returns them (a registry's names).
    `at_least` / `above` / `at_most` / `below` bound the value (None is always allowed): a config outside them is
    refused with one line naming the flag, the value and the range (`bound_note`: what the edge means)."""
    bounds = None
    if (at_least, above, at_most, below) != (None,) * 4:
        bounds = FlagBounds(above if above is not None else at_least, below if below is not None else at_most,
                            above is not None, below is not None, bound_note)
    spec = FlagSpec(help, name, tuple((k, v, h) for k, (v, h) in (switches or {}).items()),
                    tuple(argparse_options.items()), bounds)
    return dataclasses.field(default=default, metadata={_FLAG: spec})


def _flag_fields(cls) -> list[tuple[dataclasses.Field, FlagSpec]]:
    return [(f, f.metadata[_FLAG]) for f in dataclasses.fields(cls) if _FLAG in f.metadata]


def option_name(field: dataclasses.Field, spec: FlagSpec) -> str:
    """The field's option string, e.g. --bridge-bucket-size-mb."""
    return spec.name or "--" + field.name.replace("_", "-")


def dest(field: dataclasses.Field, spec: FlagSpec) -> str:
    """Where argparse stores the field's value in the namespace."""
    return field.name if spec.switches else option_name(field, spec).removeprefix("--").replace("-", "_")


def _argparse_options(field: dataclasses.Field, spec: FlagSpec) -> dict[str, Any]:
    options = dict(spec.options)
    if callable(options.get("choices")):  # a registry filled after this config's module is imported
        options["choices"] = options["choices"]()
    default = field.default
    if "action" not in options and "type" not in options:
        if default is False:
            options["action"] = "store_true"
        elif isinstance(default, tuple):
            options["type"] = type(default[0])
        elif default is not None:
            options["type"] = type(default)
    if isinstance(default, tuple):
        options.setdefault("nargs", len(default) or "*")
    return {"default": default, "help": spec.help, "dest": dest(field, spec), **options}


class FlagConfig:
    """Mixin of frozen config dataclasses whose fields are declared with `flag`. A subclass's own `__post_init__`
    calls this one's first (the flags' bounds are checked before any rule that combines them). No float flag takes
    NaN or infinity (argparse's float() reads both)."""

    def __post_init__(self):
        for field, spec in _flag_fields(type(self)):
            value = getattr(self, field.name)
            if any(isinstance(v, float) and not math.isfinite(v) for v in (value if isinstance(value, tuple)
                                                                           else (value,))):
                raise ArgumentValidationError(f"{option_name(field, spec)} {value} must be a finite number")
            if spec.bounds is None or value is None:
                continue
            if not spec.bounds.holds(value):  # NaN holds no bound
                note = f" ({spec.bounds.note})" if spec.bounds.note else ""
                raise ArgumentValidationError(f"{option_name(field, spec)} {value} must be "
                                              f"{spec.bounds.describe()}{note}")

    @classmethod
    def add_flags(cls, group) -> None:
        """Register this config's flags in an argparse group."""
        for field, spec in _flag_fields(cls):
            if spec.switches:
                exclusive = group.add_mutually_exclusive_group()
                for option, value, help_text in spec.switches:
                    exclusive.add_argument(option, dest=field.name, action="store_const", const=value,
                                           help=help_text)
                group.set_defaults(**{field.name: field.default})
            else:
                group.add_argument(option_name(field, spec), **_argparse_options(field, spec))

    @classmethod
    def flag_values(cls, args: argparse.Namespace) -> dict[str, Any]:
        """The values of this config's flags in a parsed namespace, by field name."""
        values = {}
        for field, spec in _flag_fields(cls):
            value = getattr(args, dest(field, spec))
            values[field.name] = tuple(value) if isinstance(value, list) else value
        return values

    @classmethod
    def from_args(cls, args: argparse.Namespace, **fields):
        """Build the config from parsed flags; `fields` fills (or overrides) the fields that are not flags."""
        return cls(**{**cls.flag_values(args), **fields})


def add_flag_group(parser: argparse.ArgumentParser, title: str, *configs) -> None:
    """Register the flags of `configs` under one --help heading."""
    group = parser.add_argument_group(title)
    for config in configs:
        config.add_flags(group)


def _plain(value) -> bool:
    return value is None or isinstance(value, (int, float, str, bool))


def plain_flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """Every plain value of a parsed namespace (unset flags as None; a list flag's values as a list): what a
    checkpoint records of its run."""
    return {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in vars(args).items()
            if _plain(v) or (isinstance(v, (list, tuple)) and all(_plain(x) for x in v))}


class FlagParser(argparse.ArgumentParser):
    """argparse whose errors a person reads: 'prog: error: the reason' and where to look, not the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\nsee: {self.prog} --help\n")
