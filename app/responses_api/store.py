"""Stored responses, in memory: retrieved by id, continued by `previous_response_id`, and (run in
the background) cancelled. Bounded in count and bytes; the least recently used go first. A
restart forgets them all."""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from app.responses_api.translate import Conversation, ResponseState


@dataclass
class StoredResponse:
    state: ResponseState
    conversation: Conversation  # its turns and its answer, for a later turn to continue
    input_items: list[dict[str, Any]]  # what it was given, as `.../input_items` lists it
    task: asyncio.Task[None] | None = None  # a background response's run, while it runs

    def size(self) -> int:
        """Bytes it takes, about: its JSON."""
        parts = [self.state.as_dict(), self.conversation, self.input_items]
        return len(json.dumps(parts, ensure_ascii=False))


class ResponseStore:
    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count, self.max_bytes = max_count, max_bytes
        self._entries: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self._bytes = 0

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        return entry[0]

    def put(self, stored: StoredResponse) -> None:
        """Keep (or update) `stored`; the least recently used give way to the bounds (one larger
        than all the memory is not kept)."""
        self.remove(stored.state.id)
        size = stored.size()
        if self.max_count == 0 or size > self.max_bytes:
            return
        self._entries[stored.state.id] = (stored, size)
        self._bytes += size
        while len(self._entries) > self.max_count or self._bytes > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self._bytes -= dropped

    def remove(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return None
        self._bytes -= entry[1]
        return entry[0]

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._entries
