"""The base of every request body the API takes (POST and PUT).

A field the model does not declare is refused (422 naming it) rather than dropped: a misspelled
``dry-run`` or filter ``stauts`` must not turn a dry run into a real bulk cancel, or a filter into none.
A number is finite: ``"NaN"`` or ``1e400`` is "Input should be a finite number", not a bound it misses.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["Body"]


class Body(BaseModel):
    """A request body: unknown fields are an error (``additionalProperties: false`` in the schema), and
    so are a NaN and an infinity in a number."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
