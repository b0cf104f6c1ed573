"""The base of every JSON object of the protocol (``protocol``, and the error objects of ``errors``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class JsonObject(BaseModel):
    """A JSON object of the protocol: its fields' types are kept to the letter (no ``"3"`` for 3,
    no ``true`` for 1), and a field it does not declare is refused rather than ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)
