"""Options of a comparison: a kvroute policy with routing settings of its own
(``prefix[key=value,...]``), so two settings of one policy are compared in one run, live
or simulated; and the machine kept busy for a run (``--contend``)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from loadtest.__main__ import main
from loadtest.fleet import Cluster, busy_loops, policy_variant, split_policies
from loadtest.launch import write_config


@pytest.mark.parametrize("text, policies", [
    ("prefix", ["prefix"]),
    ("prefix,round_robin", ["prefix", "round_robin"]),
    ("prefix, prefix[wait_starve_s=0,wait_ageing=1] ,smg:cache_aware",
     ["prefix", "prefix[wait_starve_s=0,wait_ageing=1]", "smg:cache_aware"]),
    ("prefix,,", ["prefix"]),
])
def test_policies_split_outside_brackets(text: str, policies: list[str]) -> None:
    assert split_policies(text) == policies


@pytest.mark.parametrize("spec, want", [
    ("prefix", ("prefix", {})),
    ("prefix[wait_starve_s=0]", ("prefix", {"wait_starve_s": 0})),
    ("prefix[wait_ageing=1.5, wait_starve_s=10]",
     ("prefix", {"wait_ageing": 1.5, "wait_starve_s": 10})),
])
def test_a_variant_is_its_policy_and_settings(spec: str, want: tuple[str, Any]) -> None:
    assert policy_variant(spec) == want


@pytest.mark.parametrize("spec, says", [
    ("prefix[wait_starve_s=0", "expected name[key=value"),
    ("prefix[wait_starve_s]", "is not key=value"),
    ("prefix[no_such_knob=1]", "no_such_knob"),
])
def test_a_wrong_variant_says_why(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match=says.replace("[", r"\[")):
        policy_variant(spec)


def test_a_variants_settings_go_into_the_config_it_runs(tmp_path: Path) -> None:
    path = write_config(tmp_path / "v.yaml", Cluster(), 2, "prefix[wait_starve_s=0]")
    cfg = yaml.safe_load(path.read_text())
    assert cfg["proxy"]["policy"] == "prefix"
    assert cfg["routing"] == {"wait_starve_s": 0}
    plain = yaml.safe_load(write_config(tmp_path / "p.yaml", Cluster(), 2, "prefix")
                           .read_text())
    assert "routing" not in plain


def test_the_simulator_compares_a_variant_beside_its_policy(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--limit", "300", "--backends", "2", "--slots", "1",
                 "--policies", "prefix,prefix[wait_starve_s=0]"]) == 0
    head = capsys.readouterr().out.splitlines()[1].split()
    assert head == ["metric", "prefix", "prefix[wait_starve_s=0]"]
    assert main(["simulate", "--policies", "prefix[nope=1]"]) == 2
    assert "nope" in capsys.readouterr().err


def _spinning() -> list[int]:
    """This process's children spinning a busy loop (from /proc)."""
    me, out = str(os.getpid()), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmd = (stat.parent / "cmdline").read_bytes()
            if fields[1] == me and b"while True: pass" in cmd and fields[0] in "RSD":
                out.append(int(stat.parent.name))
    return out


def test_busy_loops_spin_for_the_block_and_stop() -> None:
    with busy_loops(2):
        assert len(_spinning()) == 2
    assert _spinning() == []


@pytest.mark.parametrize(("spec", "backends", "devices"), [
    ("", 2, ()),
    ("0,1", 2, (0, 1)),
    ("Vulkan0,Vulkan1", 2, ("Vulkan0", "Vulkan1")),
    ("0", 2, "1 device(s) for 2 backends"),
])
def test_devices_are_one_per_backend_with_every_layer_there(
        tmp_path: Path, spec: str, backends: int, devices: tuple[object, ...] | str) -> None:
    from loadtest.runner import _devices

    if isinstance(devices, str):
        with pytest.raises(SystemExit, match=devices.replace("(", r"\(").replace(")", r"\)")):
            _devices(spec, backends)
        return
    got = _devices(spec, backends)
    assert got == devices
    cfg = yaml.safe_load(write_config(tmp_path / "d.yaml", Cluster(devices=got), backends,
                                      "prefix").read_text())
    for i, b in enumerate(cfg["backends"]):
        assert b.get("devices") == ([devices[i]] if devices else None)
        assert b.get("extra_args") == (["-ngl", "all"] if devices else None)
