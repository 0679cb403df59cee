"""A llama-server asked directly, not through kvroute: the backend tests' view of what
the server itself does (its API key in every request, a 200 asserted)."""

from __future__ import annotations

from typing import Any

import aiohttp


class DirectServer:
    def __init__(self, session: aiohttp.ClientSession, url: str, key: str) -> None:
        self.session, self.url = session, url
        self.headers = {"Authorization": f"Bearer {key}"}

    async def post(self, path: str, body: Any) -> Any:
        async with self.session.post(self.url + path, json=body, headers=self.headers) as r:
            assert r.status == 200, await r.text()
            return await r.json()

    async def get(self, path: str) -> Any:
        async with self.session.get(self.url + path, headers=self.headers) as r:
            assert r.status == 200, await r.text()
            return await r.json()

    async def chat(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The answer to messages; its usage and timings say what was reused."""
        body = {"messages": messages, "max_tokens": 4, "temperature": 0}
        out: dict[str, Any] = await self.post("/v1/chat/completions", body)
        return out

    async def n_tokens(self, text: str) -> int:
        tokens = await self.post("/tokenize", {"content": text, "parse_special": True})
        return len(tokens["tokens"])

    async def text_around(self, messages: list[dict[str, Any]]) -> list[int]:
        """The text tokens between the media of the rendered prompt (each text piece is
        tokenized on its own: a media chunk is a boundary BPE does not merge across)."""
        marker = (await self.get("/props"))["media_marker"]
        prompt = (await self.post("/apply-template", {"messages": messages}))["prompt"]
        return [await self.n_tokens(piece) for piece in prompt.split(marker)]
