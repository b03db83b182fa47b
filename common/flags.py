"""Command-line flags from frozen config dataclasses: one flag per field, its default and its help
text where the field is declared (`setting`), so a setting is described once."""

from __future__ import annotations

import argparse
from dataclasses import field, fields
from typing import Any


def setting(default: Any, help: str) -> Any:
    """A config field with its help text (shown by --help, with the default)."""
    return field(default=default, metadata={"help": help})


def add_config_flags(parser: argparse.ArgumentParser, config_cls, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of `config_cls` (--page-size for page_size); fields in `skip`, and fields
    without help (nested configs), get none."""
    for f in fields(config_cls):
        if f.name in skip or "help" not in f.metadata:
            continue
        flag, text = "--" + f.name.replace("_", "-"), f.metadata["help"]
        if isinstance(f.default, bool):
            parser.add_argument(flag, action="store_true", help=text)
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default, help=f"{text} (default: {f.default!r})")


def from_flags(config_cls, args: argparse.Namespace, **given):
    """The config the flags (and `given`, for fields without a flag) describe; ValueError names a bad value."""
    values = {
        f.name: getattr(args, f.name) for f in fields(config_cls) if f.name not in given and hasattr(args, f.name)
    }
    return config_cls(**values, **given)
