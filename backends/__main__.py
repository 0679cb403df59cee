"""`python -m backends prepare [--config PATH] [--gpu cpu|cuda|vulkan] [--native]
[--all-demos] [--json]`: obtain llama-server and the demo models. Idempotent; seconds
when all are cached. Progress goes to stderr, the result (paths, version) to stdout.

--gpu (default: $KVROUTE_GPU, else cpu) picks the variant built when no llama-server is
configured or on PATH; --native (or $KVROUTE_NATIVE=1) builds it for this CPU only
instead of any. Each is cached on its own (backends/gpu.py).

The plain demo model is always built (tests and the loadtest use it); `demo-swa`,
`demo-hybrid`, `demo-coder`, the demo projector (`mmproj: demo`) and the demo LoRA
adapters (`lora: [demo, demo1]`) only when the config's backends use them, or with
--all-demos."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from backends.binary import (
    BinaryError,
    cache_dir,
    ensure_llama_server,
    gpu_variant,
    llama_cpp_python_version,
)
from backends.demo_audio import ensure_demo_audio
from backends.demo_audio import ensure_if_used as ensure_audio_if_used
from backends.demo_audio import for_model as audio_for_model
from backends.demo_lora import demo_lora_paths
from backends.demo_lora import ensure_if_used as ensure_loras_if_used
from backends.demo_mmproj import ensure_demo_mmproj, ensure_if_used, for_model
from backends.demo_model import DEMO, DEMO_KINDS, DemoModelParams, demo_kinds_for, ensure_demo_model
from backends.gpu import GPUS, NATIVE_ENV
from backends.libllama import ensure_libllama


def prepare(config_path: Path | None, all_demos: bool = False,
            gpu: str | None = None) -> dict[str, Any]:
    """Build/find everything the config needs; returns what doctor/scripts want to know."""
    configured_binary: str | None = None
    mmprojs: list[Path | None] = []  # the managed backends' projectors
    loras: list[Path] = []  # and their LoRA adapters
    params = DemoModelParams()
    kinds = list(DEMO_KINDS) if all_demos else [DEMO]
    if config_path is not None:
        # imported here: proxy.config.load imports this package, not the other way round
        from proxy.config.load import load_config

        cfg = load_config(config_path, check_port=False, allow_missing_demo=True)
        configured_binary, params = cfg.llama_server, cfg.demo_model
        used = demo_kinds_for(params, (b.model for b in cfg.managed() if b.is_demo))
        kinds += [k for k in used if k not in kinds]
        mmprojs = [b.mmproj for b in cfg.managed()]
        loras = [p for b in cfg.managed() for p in b.lora]
    t0 = time.monotonic()
    gpu = gpu_variant(gpu)
    binary = ensure_llama_server(configured_binary, gpu=gpu)
    if gpu != "cpu" and binary.source in ("config", "path"):
        print(f"note: using the llama-server from {binary.source} ({binary.path}); a {gpu} "
              "build is made only when none is configured or on PATH", file=sys.stderr)
    libllama = ensure_libllama()  # the tokenizer's: the cpu build's unless pip compiled one
    model = ensure_demo_model(params)
    others = {k: str(ensure_demo_model(params, kind=k)) for k in kinds if k != DEMO}
    if all_demos:
        loras += (demo_lora_paths(params, DEMO_KINDS[DEMO].arch) or {}).values()
    mmproj = (ensure_demo_mmproj(for_model(params)) if all_demos
              else ensure_if_used(params, mmprojs))
    audio = (ensure_demo_audio(audio_for_model(params)) if all_demos
             else ensure_audio_if_used(params, mmprojs))
    return {
        "llama_server": {"path": str(binary.path), "version": binary.version,
                         "source": binary.source},
        "gpu": gpu,  # the variant built or looked for in the cache
        "demo_model": {"path": str(model), "kv_bytes_per_token": params.kv_bytes_per_token,
                       "params": params.tag()},
        "other_demo_models": others,
        "demo_mmproj": None if mmproj is None else str(mmproj),
        "demo_audio_mmproj": None if audio is None else str(audio),
        "demo_loras": [str(p) for p in ensure_loras_if_used(params, loras)],
        "llama_cpp_python": llama_cpp_python_version(),
        "libllama": str(libllama),
        "cache_dir": str(cache_dir()),
        "seconds": round(time.monotonic() - t0, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backends")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="obtain llama-server and the demo model")
    p.add_argument("--config", type=Path, default=None,
                   help="config file (default: ./config.yaml if present)")
    p.add_argument("--all-demos", action="store_true",
                   help="also build the other demo models, used or not")
    p.add_argument("--gpu", choices=GPUS, default=None,
                   help="build llama-server for this GPU backend (default: $KVROUTE_GPU, "
                        "else cpu); used only when none is configured or on PATH")
    p.add_argument("--native", action="store_true",
                   help="build for this CPU only (-march=native, as $KVROUTE_NATIVE=1); "
                        "default: portable, every CPU variant, the best loaded at start")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    if args.native:
        os.environ[NATIVE_ENV] = "1"

    config_path = args.config
    if config_path is None and Path("config.yaml").is_file():
        config_path = Path("config.yaml")
    try:
        result = prepare(config_path, args.all_demos, args.gpu)
    except (BinaryError, ValueError) as e:  # ConfigError is a ValueError
        print(f"prepare failed: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"llama-server: {result['llama_server']['path']} "
              f"({result['llama_server']['version'] or 'version unknown'}, "
              f"{result['llama_server']['source']})")
        print(f"demo model:   {result['demo_model']['path']}")
        for kind, path in result["other_demo_models"].items():
            print(f"{kind + ':':<13} {path}")
        print(f"ready in {result['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
