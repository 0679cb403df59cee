"""`lora:` of a managed backend: the demo adapters or files, passed as one `--lora`,
counted in a saved slot's identity; and the demo adapters' files."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from managed_config import error_of, load

from backends.config import ManagedBackendConfig
from backends.demo_lora import (
    DemoLoraParams,
    demo_lora_path,
    ensure_if_used,
    for_model,
    write_lora,
)
from backends.demo_model import DemoModelParams, read_gguf_metadata
from backends.process import ServerSpec
from proxy.disk.identity import model_identity


def test_demo_names_resolve_to_the_adapters_of_the_model(tmp_path: Path,
                                                        demo_model: Path) -> None:
    params = DemoModelParams()
    a, b = (demo_lora_path(for_model(params, seed)) for seed in (0, 1))
    got = load(tmp_path, {"model": "demo", "lora": ["demo1", "demo"]},
               allow_missing_demo=True).lora
    assert got == (b, a)  # in the order given: that order is their ids
    assert load(tmp_path, {"model": "demo", "lora": "demo"},
                allow_missing_demo=True).lora == (a,)
    assert load(tmp_path, {"model": "demo"}).lora == ()
    swa = load(tmp_path, {"model": "demo-swa", "lora": ["demo"]}, allow_missing_demo=True)
    assert swa.lora == (demo_lora_path(for_model(params, 0, "gemma3")),)
    assert "gemma3" in swa.lora[0].name and "llama" in a.name and "-s1." in b.name
    alora = load(tmp_path, {"model": "demo", "lora": ["demo", "demo-alora"]},
                 allow_missing_demo=True).lora
    assert alora == (a, demo_lora_path(for_model(params, 2)))
    assert alora[1].name.endswith("-s2-i43643.1779.25.gguf")  # (its invocation named)


def test_files_or_an_error_naming_the_fix(tmp_path: Path, demo_model: Path) -> None:
    one = tmp_path / "one.gguf"
    one.write_bytes(b"GGUF")
    assert load(tmp_path, {"model": "demo", "lora": ["one.gguf"]}).lora == (one,)
    msg = error_of(tmp_path, {"model": "demo", "lora": ["nope.gguf"]})
    assert f"backends[0].lora: file not found: {tmp_path / 'nope.gguf'}" in msg
    msg = error_of(tmp_path, {"model": "demo-hybrid", "lora": ["demo"]},
                   allow_missing_demo=True)
    assert "backends[0].lora: `demo` is a demo adapter" in msg
    msg = error_of(tmp_path, {"model": "demo-coder", "lora": ["demo-alora"]},
                   allow_missing_demo=True)
    assert "`demo-alora` is a demo adapter and fits only demo and demo-swa" in msg
    assert load(tmp_path, {"model": "demo-coder", "lora": ["demo"]},
                allow_missing_demo=True).lora  # (a plain one fits it)
    assert load(tmp_path, {"model": "demo", "lora": []}).lora == ()
    for bad in ([3], ["one.gguf", "one.gguf"], {"a": 1}):
        msg = error_of(tmp_path, {"model": "demo", "lora": bad})
        assert "backends[0].lora: expected an adapter path" in msg, bad
    comma = tmp_path / "a,b.gguf"
    comma.write_bytes(b"GGUF")
    assert "has a comma" in error_of(tmp_path, {"model": "demo", "lora": [str(comma)]})
    msg = error_of(tmp_path, {"url": "http://127.0.0.1:9", "lora": ["demo"]})
    assert "backends[0].lora: unknown key" in msg


def test_passed_as_one_comma_separated_lora(tmp_path: Path) -> None:
    """llama-server deprecates a repeated --lora ("only last value will be used", it
    warns, though this build still loads each): one flag names them all."""
    spec = ServerSpec(binary=Path("llama-server"), model=Path("m.gguf"), port=1)
    assert "--lora" not in spec.argv()
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    argv = dataclasses.replace(spec, lora=(a, b), extra_args=("-ngl", "0")).argv()
    assert argv.count("--lora") == 1
    assert argv[argv.index("--lora"):][:4] == ["--lora", f"{a},{b}", "-ngl", "0"]


def test_adapters_are_part_of_a_saved_slots_identity(tmp_path: Path,
                                                     demo_model: Path) -> None:
    """The KV was made under the adapters (their order is their ids): a file saved
    under one set is not restored under another. Without any the identity is what it
    was before `lora`."""
    plain = ManagedBackendConfig(name="a", model=demo_model)
    p1, p2 = tmp_path / "p1.gguf", tmp_path / "p2.gguf"
    p1.write_bytes(b"one")
    p2.write_bytes(b"two!")
    sets: list[tuple[Path, ...]] = [(), (p1,), (p2,), (p1, p2), (p2, p1)]
    ids = {model_identity(dataclasses.replace(plain, lora=s)) for s in sets}
    assert len(ids) == len(sets) and None not in ids
    assert model_identity(dataclasses.replace(plain, lora=(tmp_path / "gone",))) is None
    # an adapter is not a projector: the same file in either place is another identity
    assert (model_identity(dataclasses.replace(plain, lora=(p1,)))
            != model_identity(dataclasses.replace(plain, mmproj=p1)))


def test_the_file_is_what_llama_cpp_reads(tmp_path: Path) -> None:
    """general.type adapter, adapter.type lora, the alpha, and an A/B pair per tensor
    (src/llama-adapter.cpp refuses a file without them)."""
    path = tmp_path / "a.gguf"
    write_lora(path, DemoLoraParams(n_layer=2))
    meta = read_gguf_metadata(path)
    assert meta["general.architecture"] == "llama" and meta["general.type"] == "adapter"
    assert meta["adapter.type"] == "lora" and meta["adapter.lora.alpha"] == 8.0
    assert "adapter.alora.invocation_tokens" not in meta
    write_lora(path, DemoLoraParams(n_layer=2, invocation=(43643, 1779, 25)))
    meta = read_gguf_metadata(path, arrays=True)
    assert meta["adapter.alora.invocation_tokens"] == [43643, 1779, 25]
    with pytest.raises(ValueError, match="arch must be one of"):
        DemoLoraParams(arch="lfm2")


def test_prepare_builds_them_only_when_used(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTE_CACHE", str(tmp_path))
    params = DemoModelParams()
    assert ensure_if_used(params, [tmp_path / "other.gguf"]) == []
    assert not (tmp_path / "models").exists()
    wanted = demo_lora_path(for_model(params, 1))
    assert ensure_if_used(params, [wanted]) == [wanted] and wanted.is_file()
    assert not demo_lora_path(for_model(params, 0)).exists()
    first = wanted.read_bytes()
    wanted.unlink()
    assert ensure_if_used(params, [wanted]) == [wanted] and wanted.read_bytes() == first
