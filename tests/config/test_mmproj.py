"""`mmproj:` of a managed backend: the demo projector or a file, passed as `--mmproj`,
shown by the status and counted in a saved slot's identity."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from managed_config import error_of, load

from backends.config import ManagedBackendConfig
from backends.demo_audio import demo_audio_path
from backends.demo_audio import for_model as audio_for_model
from backends.demo_mmproj import DemoMmprojParams, demo_mmproj_path, ensure_if_used, for_model
from backends.demo_model import DemoModelParams
from backends.process import ServerSpec
from proxy.config.fields import ConfigError
from proxy.config.load import load_config
from proxy.disk.identity import model_identity


def test_demo_resolves_to_the_projector_of_the_demo_sizes(tmp_path: Path,
                                                          demo_model: Path) -> None:
    want = demo_mmproj_path(for_model(DemoModelParams()))
    b = load(tmp_path, {"model": "demo", "mmproj": "demo"}, allow_missing_demo=True)
    assert b.mmproj == want and "T512" in want.name
    assert load(tmp_path, {"model": "demo"}).mmproj is None
    audio = load(tmp_path, {"model": "demo", "mmproj": "demo-audio"}, allow_missing_demo=True)
    assert audio.mmproj == demo_audio_path(audio_for_model(DemoModelParams()))
    assert "ultravox" in audio.mmproj.name and "T512" in audio.mmproj.name


def test_a_missing_demo_projector_says_how_to_build_it(tmp_path: Path,
                                                      demo_model: Path) -> None:
    # a seed nobody built: the model (allowed missing) and its projector both
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"backends": [{"name": "a", "model": "demo",
                                                  "mmproj": "demo"}],
                                    "demo_model": {"n_embd": 256, "seed": 777}}))
    with pytest.raises(ConfigError) as exc:
        load_config(path, check_port=False)
    assert "backends[0].model: file not found" in str(exc.value)
    cfg = load_config(path, check_port=False, allow_missing_demo=True)
    assert cfg.managed()[0].mmproj == demo_mmproj_path(DemoMmprojParams(n_embd_text=256))


def test_a_file_or_an_error_naming_the_fix(tmp_path: Path, demo_model: Path) -> None:
    proj = tmp_path / "proj.gguf"
    proj.write_bytes(b"GGUF")
    assert load(tmp_path, {"model": "demo", "mmproj": "proj.gguf"}).mmproj == proj
    msg = error_of(tmp_path, {"model": "demo", "mmproj": "nope.gguf"})
    assert f"backends[0].mmproj: file not found: {tmp_path / 'nope.gguf'}" in msg
    # the demo projector fits the demo models' width only
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    msg = error_of(tmp_path, {"model": str(model), "mmproj": "demo"})
    assert "backends[0].mmproj: `demo` is one of the demo models' projectors" in msg
    assert "expected a non-empty string" in error_of(tmp_path, {"model": "demo", "mmproj": 3})
    # an external server's projector is its own business: it reports it in /props
    msg = error_of(tmp_path, {"url": "http://127.0.0.1:9", "mmproj": "demo"})
    assert "backends[0].mmproj: unknown key" in msg


def test_passed_as_mmproj(tmp_path: Path) -> None:
    spec = ServerSpec(binary=Path("llama-server"), model=Path("m.gguf"), port=1)
    assert "--mmproj" not in spec.argv()
    argv = dataclasses.replace(spec, mmproj=tmp_path / "p.gguf",
                               extra_args=("-ngl", "0")).argv()
    assert argv[argv.index("--mmproj"):][:4] == ["--mmproj", str(tmp_path / "p.gguf"),
                                                 "-ngl", "0"]


def test_the_projector_is_part_of_a_saved_slots_identity(tmp_path: Path,
                                                         demo_model: Path) -> None:
    """The KV of an image was made by the projector: a file saved under one is not
    restored under another. Without one the identity is what it was before `mmproj`."""
    plain = ManagedBackendConfig(name="a", model=demo_model)
    p1, p2 = tmp_path / "p1.gguf", tmp_path / "p2.gguf"
    p1.write_bytes(b"one")
    p2.write_bytes(b"two!")
    ids = {model_identity(dataclasses.replace(plain, mmproj=p)) for p in (None, p1, p2)}
    assert len(ids) == 3 and None not in ids
    assert model_identity(dataclasses.replace(plain, mmproj=tmp_path / "gone")) is None


def test_prepare_builds_it_only_when_used(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTE_CACHE", str(tmp_path))
    params = DemoModelParams()
    assert ensure_if_used(params, [None, tmp_path / "other.gguf"]) is None
    assert not (tmp_path / "models").exists()
    path = ensure_if_used(params, [demo_mmproj_path(for_model(params))])
    assert path is not None and path.is_file()
    first = path.read_bytes()
    path.unlink()
    assert ensure_if_used(params, [path]) == path and path.read_bytes() == first  # seeded
