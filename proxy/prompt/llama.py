"""llama-cpp-python's bindings, imported with their library found.

`make` installs llama-cpp-python without compiling libllama: the llama-server build's
libllama, the same llama.cpp version, serves the tokenizer too (backends/libllama.py,
libllama_dir). The bindings read where it is from $LLAMA_CPP_LIB_PATH when they are
imported, so every import of them goes through this module; the variable is set for that
import only, not for the servers and tools this process starts.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

from backends.libllama import LIB_ENV, libllama_dir, package_libllama


def _import() -> ModuleType:
    """llama_cpp, with $LLAMA_CPP_LIB_PATH set while it loads where it is not set and
    llama-cpp-python has no libllama of its own."""
    set_here = LIB_ENV not in os.environ and package_libllama() is None
    if set_here and (found := libllama_dir()) is not None:
        os.environ[LIB_ENV] = str(found)
    try:
        return importlib.import_module("llama_cpp")
    finally:
        if set_here:
            os.environ.pop(LIB_ENV, None)


llama_cpp = _import()
