"""One typed, validated config object per service; command-line flags are mapped onto it."""

from __future__ import annotations

import argparse
import typing
from typing import Literal, Sequence, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

C = TypeVar("C", bound="ServiceConfig")


class ServiceConfig(BaseModel):
    """Base: every field becomes a `--flag` (underscores as dashes), its description the help."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="Address to listen on (0.0.0.0 for all interfaces).")
    port: int = Field(0, ge=0, le=65535, description="Port to listen on (0 picks a free one).")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level.")
    metrics_port: int | None = Field(
        None, ge=0, le=65535,
        description="Port of the Prometheus endpoint (http://host:port/metrics); unset = off, 0 = a free port (logged).",
    )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def from_args(cls: type[C], argv: Sequence[str] | None = None, prog: str | None = None) -> C:
        parser = argparse.ArgumentParser(prog=prog, description=cls.__doc__)
        for name, field in cls.model_fields.items():
            flag = "--" + name.replace("_", "-")
            help_text = f"{field.description or ''} (default: {field.default!r})"
            if field.annotation is bool:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            else:
                choices = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is Literal else None
                parser.add_argument(flag, default=None, choices=choices, help=help_text)
        args = vars(parser.parse_args(argv))
        try:
            return cls(**{k: v for k, v in args.items() if v is not None})
        except ValidationError as exc:
            parser.error(_explain(exc))
            raise  # unreachable: parser.error exits


def _explain(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        flag = "--" + "-".join(str(p) for p in err["loc"]).replace("_", "-")
        lines.append(f"{flag}: {err['msg']} (got {err.get('input')!r})")
    return "; ".join(lines)
