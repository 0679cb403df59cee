"""A fake llama-server: a real aiohttp server on a real loopback port, for faults that must
happen at a precise moment (a backend that accepts and never answers, a sick /health)
and for seeing exactly what reaches a backend (headers, paths, bodies).

    fake = FakeBackend()
    url = await fake.start()
    fake.mode = "hang"          # ok | hang (nothing answers) | stall (only completions hang)
                                # | sick (/health 503) | linger (streams stay open after
                                # their last event until `release`) | drop-reused (the
                                # first request on a reused connection is cut, once: a
                                # keep-alive connection closed by the server as it came)
                                # | error-event (streams end with an error event)
                                # | wedged (/health answers; completions and /slots hang:
                                # a stuck main loop) | wedged-mid (the same once a
                                # stream's first event is out)
    fake.release.set()          # let hung requests finish
    await fake.stop()

Run as a program it stands in for the llama-server binary itself (a test's `llama_server`,
through a script that execs `python fake_backend.py "$@"`): it takes llama-server's flags
and, while the file $KVROUTE_FAKE_SEGV_FILE exists, dies by a real SIGSEGV
$KVROUTE_FAKE_SEGV_AFTER_S (0.5) seconds after it starts answering: a crash on demand.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import sys
from pathlib import Path
from typing import Any

from aiohttp import web

ANSWER: dict[str, Any] = {
    "choices": [{"finish_reason": "stop", "index": 0,
                 "message": {"role": "assistant", "content": "ok"}}],
    "created": 0, "model": "kvroute-demo", "object": "chat.completion", "id": "fake",
    "usage": {"completion_tokens": 1, "prompt_tokens": 10, "total_tokens": 11},
    "timings": {"cache_n": 0, "prompt_n": 10, "prompt_ms": 1.0, "predicted_n": 1,
                "predicted_ms": 1.0},
}
_TIMINGS = ANSWER["timings"]
STREAMS: dict[str, tuple[dict[str, Any] | bytes, ...]] = {
    "chat": ({"choices": [{"index": 0, "delta": {"content": "ok"}}]},
             {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
              "timings": _TIMINGS}),
    "/v1/completions": ({"choices": [{"index": 0, "text": "ok"}], "object": "text_completion"},
                        {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}],
                         "object": "text_completion", "timings": _TIMINGS}),
    "/completion": ({"content": "ok", "tokens": [1], "stop": False},
                    {"content": "", "tokens": [], "stop": True, "stop_type": "eos",
                     "timings": _TIMINGS}),
}


class FakeBackend:
    def __init__(self, *, model: str = "kvroute-demo", n_ctx: int = 8192, slots: int = 2,
                 api_key: str | None = None) -> None:
        self.model, self.n_ctx, self.slots, self.api_key = model, n_ctx, slots, api_key
        self.mode = "ok"
        self.streams = dict(STREAMS)  # what streams send, per path ("chat": the default)
        self.done_events = 1  # [DONE] events that end an OpenAI stream (0: none)
        self.answer: bytes | None = None  # the non-streamed answer's body (None: ANSWER)
        self.answer_status, self.answer_type = 200, "application/json"  # ... and its head
        self.busy_slots = 0  # slots /slots says are processing
        self.slot_tokens = 0  # the prompt tokens /slots says each slot holds
        self.release = asyncio.Event()
        self.requests: list[tuple[str, dict[str, str], bytes]] = []  # completions only
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._served: set[int] = set()  # connections that answered a request

    @property
    def hits(self) -> int:
        return len(self.requests)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/health", self._health)
        app.router.add_get("/props", self._props)
        app.router.add_get("/slots", self._slots)
        for path in ("/v1/chat/completions", "/v1/completions", "/completion", "/tokenize"):
            app.router.add_post(path, self._complete)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, _: web.Request) -> web.Response:
        if self.mode == "hang":
            await self.release.wait()
        if self.mode == "sick":
            return web.json_response({"error": "loading"}, status=503)
        return web.json_response({"status": "ok"})

    async def _props(self, _: web.Request) -> web.Response:
        if self.mode == "hang":
            await self.release.wait()
        return web.json_response({
            "total_slots": self.slots, "default_generation_settings": {"n_ctx": self.n_ctx},
            "model_alias": self.model, "model_path": "fake.gguf", "build_info": "fake",
            "chat_template": ""})

    async def _slots(self, _: web.Request) -> web.Response:
        if self.mode in ("hang", "wedged", "wedged-mid"):
            await self.release.wait()
        return web.json_response([{"id": i, "n_ctx": self.n_ctx,
                                   "is_processing": i < self.busy_slots,
                                   "n_prompt_tokens": self.slot_tokens}
                                  for i in range(self.slots)])

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.requests.append((request.path, dict(request.headers), raw))
        if self.mode == "drop-reused":
            conn = id(request.transport)
            if conn in self._served:
                self.mode = "ok"
                assert request.transport is not None
                request.transport.close()  # the client sees the connection drop
                raise web.HTTPInternalServerError()  # not sent: the socket is gone
            self._served.add(conn)
        if self.mode in ("hang", "stall", "wedged"):
            await self.release.wait()
        try:
            body = json.loads(raw)
        except ValueError:
            body = {}
        if isinstance(body, dict) and body.get("stream") is True:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            # each endpoint's own stream format (the proxy assembles non-streamed answers
            # from them); llama-native streams end with stop:true, not [DONE]
            chunks = self.streams.get(request.path, self.streams["chat"])
            for i, chunk in enumerate(chunks):
                if self.mode == "error-event" and i == len(chunks) - 1:
                    chunk = {"error": {"code": 500, "message": "boom", "type": "server_error"}}
                # bytes: an event's raw data, as a broken backend may send it
                data = chunk if isinstance(chunk, bytes) else json.dumps(chunk).encode()
                await resp.write(b"data: " + data + b"\n\n")
                if self.mode == "wedged-mid":
                    await self.release.wait()
            if request.path != "/completion":
                await resp.write(b"data: [DONE]\n\n" * self.done_events)
            if self.mode == "linger":
                await self.release.wait()
            return resp
        if self.answer is not None:
            return web.Response(body=self.answer, status=self.answer_status,
                                content_type=self.answer_type)
        return web.json_response(ANSWER)


async def _serve_as_llama_server(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("-np", type=int, default=1)
    p.add_argument("-c", type=int, default=8192)
    p.add_argument("-a", default="kvroute-demo")
    args, _ = p.parse_known_args(argv)
    fake = FakeBackend(model=args.a, n_ctx=args.c // args.np, slots=args.np,
                       api_key=os.environ.get("LLAMA_API_KEY"))
    url = await fake.start(args.host, args.port)
    print(f"main: server is listening on {url}", flush=True)
    marker = os.environ.get("KVROUTE_FAKE_SEGV_FILE")
    await asyncio.sleep(float(os.environ.get("KVROUTE_FAKE_SEGV_AFTER_S", "0.5")))
    while marker is None or not Path(marker).exists():
        await asyncio.sleep(0.1)
    print("srv  update_slots: decoding", flush=True)
    print(f"fake_backend: SIGSEGV on demand ({marker} exists)", flush=True)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # (no core file left behind)
    signal.signal(signal.SIGSEGV, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGSEGV)


if __name__ == "__main__":
    if "--version" in sys.argv:
        print("version: 0 (fake_backend)", file=sys.stderr)
        sys.exit(0)
    asyncio.run(_serve_as_llama_server(sys.argv[1:]))
