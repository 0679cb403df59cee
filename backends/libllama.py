"""Where the proxy's tokenizer finds libllama.

`make` installs llama-cpp-python without compiling libllama: the llama-server build's
libllama (backends/binary.py), the same llama.cpp version, serves the tokenizer too. This
module says where that library is, and builds the cpu variant when there is none.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from backends.binary import (
    Progress,
    _print,
    build_llama_server,
    cache_dir,
    cache_lock,
    cached_llama_server,
)
from backends.gpu import binary_path, portable, requested_gpu

# llama-cpp-python's own override of where its libllama is
LIB_ENV = "LLAMA_CPP_LIB_PATH"


def package_libllama() -> Path | None:
    """llama-cpp-python's own libllama, if its install compiled one (`make` installs it
    without: one build of llama.cpp then serves the server and the tokenizer)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    lib = Path(spec.origin).parent / "lib" / "libllama.so"
    return lib if lib.is_file() else None


def libllama_dir() -> Path | None:
    """Where the tokenizer's libllama is: $LLAMA_CPP_LIB_PATH, else llama-cpp-python's own,
    else the cached cpu build's (the same llama.cpp: the cache is per version)."""
    if os.environ.get(LIB_ENV):
        return Path(os.environ[LIB_ENV])
    if (own := package_libllama()) is not None:
        return own.parent
    # the builds asked for first; every variant's libllama tokenizes alike
    for gpu in dict.fromkeys((requested_gpu(), "cpu")):
        for native in (not portable(), portable()):
            lib = binary_path(cache_dir(), gpu, native).with_name("libllama.so")
            if lib.is_file():
                return lib.parent
    return None


def ensure_libllama(progress: Progress = _print) -> Path:
    """The tokenizer's libllama directory, building the cpu variant if there is none."""
    found = libllama_dir()
    if found is not None:
        return found
    with cache_lock():
        if cached_llama_server("cpu") is None:
            build_llama_server(progress, gpu="cpu")
    return binary_path(cache_dir(), "cpu").parent
