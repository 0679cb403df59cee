"""llama-cpp-python's bindings, imported with their library found.

`make` installs llama-cpp-python without compiling libllama: the llama-server build's
libllama, the same llama.cpp version, serves the tokenizer too (backends/binary.py,
libllama_dir). The bindings read where it is from $LLAMA_CPP_LIB_PATH when they are
imported, so every import of them goes through this module.
"""

from __future__ import annotations

import importlib
import os

from backends.binary import LIB_ENV, libllama_dir, package_libllama

if package_libllama() is None and (found := libllama_dir()) is not None:
    os.environ.setdefault(LIB_ENV, str(found))

# imported once the library's place is set
llama_cpp = importlib.import_module("llama_cpp")
