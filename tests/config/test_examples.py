"""The example configs in docs/examples load, and say what kvroute computes of them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from backends.binary import llama_cpp_source
from backends.config import ManagedBackendConfig
from backends.memory import server_memory
from proxy.config.load import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
GiB = 1 << 30


@pytest.fixture
def multi_gpu(tmp_path: Path) -> tuple[ManagedBackendConfig, ...]:
    """docs/examples/multi-gpu.yaml, its model replaced by a GGUF of the same attention
    shape (Llama 3 8B's: 32 layers, 8 KV heads of 128) that the vendored tree ships."""
    data = yaml.safe_load((EXAMPLES / "multi-gpu.yaml").read_text())
    llama3 = llama_cpp_source() / "vendor" / "llama.cpp" / "models" / "ggml-vocab-llama-bpe.gguf"
    for backend in data["backends"]:
        assert backend["model"].endswith("Llama-3.1-8B-Instruct-Q4_K_M.gguf")
        backend["model"] = str(llama3)
    path = tmp_path / "multi-gpu.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path, check_port=False).managed()


def test_multi_gpu_has_one_backend_per_gpu(multi_gpu: tuple[ManagedBackendConfig, ...]) -> None:
    assert [b.devices for b in multi_gpu] == [(0,), (1,)]
    for b in multi_gpu:
        args = " ".join(b.extra_args)
        assert "-ngl 99" in args and "-fa on" in args


def test_multi_gpu_slots_fit_the_arithmetic_in_its_comments(
        multi_gpu: tuple[ManagedBackendConfig, ...]) -> None:
    for b in multi_gpu:
        kv = server_memory(b.model, b.extra_args, b.ctx_per_slot, b.slots).kv_bytes_per_token
        assert kv == 69_632  # q8_0 K and V, as the comment works out
        assert b.slots * b.ctx_per_slot * kv / GiB == pytest.approx(17.0)
        assert b.slots * b.ctx_per_slot * kv <= 17.9 * GiB  # the GPU's room for KV
