"""One name -> class table per kind of variant (attention backends, platforms, verify
strategies, decoders): variants register, callers look them up by the name a flag gives."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind  # what a name selects, for error messages ("attention backend")
        self._table: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        """Class decorator: makes the class available under `name` (names are unique)."""

        def wrap(cls: type[T]) -> type[T]:
            if self._table.get(name, cls) is not cls:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._table[name] = cls
            return cls

        return wrap

    def get(self, name: str) -> type[T]:
        """The class registered as `name`; ValueError naming the known ones otherwise."""
        if name not in self._table:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}")
        return self._table[name]

    def names(self) -> list[str]:
        return sorted(self._table)

    def __contains__(self, name: object) -> bool:
        return name in self._table

    def __getitem__(self, name: str) -> type[T]:
        return self.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
