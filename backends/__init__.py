"""llama-server backends: obtain the binary and the demo model, run and supervise servers.

    binary.py      find or build llama-server; the cache
    libllama.py    where the tokenizer's libllama is ($LLAMA_CPP_LIB_PATH, pip's, a cached build's)
    gpu.py         its build variants (cpu, cuda, vulkan; portable or native): cmake flags
    cpu.py         the CPU features that pick ggml's kernels
    vendor_patch.py  kvroute's fixes to the vendored llama.cpp (patches/), applied once
    version.py     which llama.cpp a server and the tokenizer come from
    demo_model.py  synthesise the demo GGUF (demo_swa.py, demo_hybrid.py: the other
                   demo architectures; demo_gguf.py: what their writers share)
    memory.py      a model's memory kind and KV bytes per token, from its GGUF and flags
    config.py      what the supervisor is told of each backend and the fleet (FleetSpec)
    process.py     one llama-server process: spawn, wait_ready, stop
    supervisor.py  all configured backends, as one pool: start, stop, states, subscribers
    standing.py    where one backend stands (state, error, info), and who hears of it
    managed.py     a managed llama-server's lifecycle: start, watch, restart; its
                   processes, one per start (a new port and key), and how one died
    health.py      whether a managed server is up: ready (/health, /props), alive
    crash_loop.py  its deaths: when they make a crash loop, what died and the likely fix;
                   when it restarts (backoff)
    external.py    external servers probed, and backends an agent runs, as it reports them
    info.py        a ready backend as the proxy needs it
    agent.py       `kvroute agent`: one host's servers, served to routers elsewhere
    remote.py      a router's side of an agent: its backends as it reports them
    client.py      typed calls to one server (/health, /props, /slots, ...)
"""

from backends.binary import (
    LlamaServerBinary,
    cache_dir,
    ensure_llama_server,
    find_llama_server,
    llama_cpp_python_version,
)
from backends.demo_model import (
    DemoModelParams,
    demo_model_path,
    ensure_demo_model,
)
from backends.memory import gguf_kv_bytes_per_token

__all__ = [
    "DemoModelParams",
    "LlamaServerBinary",
    "cache_dir",
    "demo_model_path",
    "ensure_demo_model",
    "ensure_llama_server",
    "find_llama_server",
    "gguf_kv_bytes_per_token",
    "llama_cpp_python_version",
]
