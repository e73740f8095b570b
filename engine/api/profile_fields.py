"""Reading a profile's JSON by field: each read checks the field's type, and every refusal is a ProfileError
naming the file and the field by its dotted path (engine/api/profile.py and its sections use it)."""

from __future__ import annotations

import copy
from typing import Any, NoReturn

from engine.core.errors import ProfileError


class JsonFields:
    """One JSON object of a profile: each read checks the field's type, and every refusal is a
    ProfileError naming the file (``where``) and the field by its dotted path."""

    def __init__(self, value: Any, path: str, where: str) -> None:
        if not isinstance(value, dict):
            raise ProfileError(f"{where}: field {path}={value!r:.80} is invalid: allowed a JSON object")
        self.d, self.path, self.where = value, path, where

    def name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def refuse(self, key: str, value: Any, allowed: str) -> NoReturn:
        raise ProfileError(f"{self.where}: field {self.name(key)}={value!r:.80} is invalid: allowed {allowed}")

    def raw(self, key: str) -> Any:
        if key not in self.d:
            raise ProfileError(f"{self.where}: field {self.name(key)} is missing")
        return self.d[key]

    def absent(self, key: str) -> bool:
        """The field is missing or null (an optional field then reads as None)."""
        return self.d.get(key) is None

    def integer(self, key: str) -> int:
        v = self.raw(key)
        if not isinstance(v, int) or isinstance(v, bool):
            self.refuse(key, v, "an int")
        return v

    def number(self, key: str) -> float:
        v = self.raw(key)
        if not is_number(v):
            self.refuse(key, v, "a number")
        return float(v)

    def string(self, key: str) -> str:
        v = self.raw(key)
        if not isinstance(v, str):
            self.refuse(key, v, "a string")
        return v

    def flag(self, key: str) -> bool:
        v = self.raw(key)
        if not isinstance(v, bool):
            self.refuse(key, v, "true or false")
        return v

    def array(self, key: str) -> list[Any]:
        v = self.raw(key)
        if not isinstance(v, list):
            self.refuse(key, v, "a JSON array")
        return v

    def mapping(self, key: str) -> dict[str, Any]:
        """A free-form JSON object, copied."""
        v = self.raw(key)
        if not isinstance(v, dict):
            self.refuse(key, v, "a JSON object")
        return copy.deepcopy(v)

    def obj(self, key: str) -> JsonFields:
        """A nested object, read field by field."""
        return JsonFields(self.raw(key), self.name(key), self.where)

    def opt_integer(self, key: str) -> int | None:
        return None if self.absent(key) else self.integer(key)

    def opt_number(self, key: str) -> float | None:
        return None if self.absent(key) else self.number(key)

    def opt_string(self, key: str) -> str | None:
        return None if self.absent(key) else self.string(key)

    def opt_flag(self, key: str) -> bool | None:
        return None if self.absent(key) else self.flag(key)

    def opt_mapping(self, key: str) -> dict[str, Any] | None:
        return None if self.absent(key) else self.mapping(key)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
