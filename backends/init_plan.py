"""`kvroute init`: a config for this machine's devices and one model, and why.

Pure: what the machine has (`Machine`: GPUs, host RAM and cores, from backends/detect.py)
and what the model needs (`ModelFacts`: its weights' bytes, KV bytes per token, trained
context) go in; the backends to run and the reasoning come out (`plan`), then a
commented config.yaml (`render`).

- One backend per GPU when the weights fit one with room for the KV cache; else one per
  group of 2, 4 or 8 GPUs (the model split over them: `devices`). Without a GPU, one
  backend on the CPU.
- A device gives its memory less a margin (`MARGIN`: compute buffers, the driver's own)
  to the weights, then to the KV cache: slots of up to `TARGET_CTX` tokens each (a
  coding agent's first prompt is ~30k tokens), as many as fit, at most `MAX_SLOTS`.
- The host-RAM prompt cache (`cache_ram_mib`) takes `RAM_SHARE` of the host's RAM, split
  over the backends; the CPU backend's KV comes from the host's RAM too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from backends.devices import DeviceRef

MiB = 1 << 20
MARGIN = 0.10  # of a device's memory, kept free (and at least MARGIN_MIB)
MARGIN_MIB = 1024
TARGET_CTX = 65536  # tokens per slot when memory allows (at most the trained context)
MIN_CTX = 32768  # below this, fewer slots (Claude Code's first prompt: ~30k tokens)
MAX_SLOTS = 8
CPU_MAX_SLOTS = 4  # a CPU prefills slowly: more conversations than this would queue
RAM_SHARE = 0.40  # of the host's RAM, for the prompt caches (and a CPU backend's KV)
GROUPS = (1, 2, 4, 8)


@dataclass(frozen=True)
class GPU:
    ref: DeviceRef  # what `devices:` names it by: a CUDA index, or a --list-devices name
    name: str  # its model, as its driver says
    total_mib: int


@dataclass(frozen=True)
class Machine:
    gpus: tuple[GPU, ...]
    ram_mib: int
    cpus: int
    found_by: str  # "nvidia-smi", "llama-server --list-devices" or "no GPU found"


@dataclass(frozen=True)
class ModelFacts:
    path: Path
    weights_bytes: int
    kv_bytes_per_token: int
    ctx_train: int | None


@dataclass(frozen=True)
class Backend:
    name: str
    devices: tuple[DeviceRef, ...]
    slots: int
    ctx_per_slot: int
    threads: int
    cache_ram_mib: int


@dataclass(frozen=True)
class Plan:
    backends: tuple[Backend, ...]
    why: tuple[str, ...]  # the reasoning, one line each


class DoesNotFit(ValueError):
    """The model's weights do not fit the machine: the message says by how much."""


def _usable(total_mib: int) -> int:
    return total_mib - max(int(total_mib * MARGIN), MARGIN_MIB)


def _slots(kv_bytes: int, m: ModelFacts, most: int = MAX_SLOTS) -> tuple[int, int]:
    """(slots, tokens per slot) that ``kv_bytes`` of KV cache holds: slots of
    ``TARGET_CTX`` tokens (at most the trained context) while that many fit, else of
    ``MIN_CTX``, else one slot of what there is."""
    tokens = kv_bytes // m.kv_bytes_per_token
    target = min(TARGET_CTX, m.ctx_train or TARGET_CTX)
    per = target if tokens >= target else min(MIN_CTX, target)
    slots = max(1, min(most, tokens // per))
    ctx = tokens // slots
    if m.ctx_train:
        ctx = min(ctx, m.ctx_train)
    return slots, ctx // 256 * 256


def plan(m: ModelFacts, machine: Machine) -> Plan:
    """The backends for ``m`` on ``machine``; DoesNotFit when no grouping holds it."""
    why = [f"model {m.path.name}: {m.weights_bytes / MiB / 1024:.1f} GiB of weights, "
           f"{m.kv_bytes_per_token / 1024:g} KiB of KV cache a token (f16), trained "
           f"context {m.ctx_train or 'unknown'}",
           f"devices ({machine.found_by}): " + (", ".join(
               f"{g.ref} {g.name} {g.total_mib} MiB" for g in machine.gpus) or "none"),
           f"host: {machine.ram_mib} MiB of RAM, {machine.cpus} cores"]
    if not machine.gpus:
        return _cpu_plan(m, machine, why)
    gpus = machine.gpus
    weights_mib = m.weights_bytes / MiB
    per = min(_usable(g.total_mib) for g in gpus)
    need = MIN_CTX * m.kv_bytes_per_token / MiB  # one slot of MIN_CTX at least
    group = next((k for k in GROUPS if k <= len(gpus) and weights_mib / k + need <= per),
                 None)
    if group is None:
        raise DoesNotFit(
            f"{m.path.name}: {weights_mib / 1024:.1f} GiB of weights and one {MIN_CTX}-token "
            f"slot need more than the {len(gpus)} GPU(s) give ({per} MiB each after a "
            f"{MARGIN:.0%} margin) (fix: a smaller quantization, or more GPUs)")
    n = len(gpus) // group
    kv_mib = group * per - weights_mib
    slots, ctx = _slots(int(kv_mib * MiB), m)
    ram = int(machine.ram_mib * RAM_SHARE / n)
    threads = max(1, min(4, machine.cpus // n))
    why += [f"{'one backend per GPU' if group == 1 else f'one backend per {group} GPUs'}: "
            f"{weights_mib / group:.0f} MiB of weights a GPU, {per} MiB usable "
            f"({MARGIN:.0%} or {MARGIN_MIB} MiB kept free)",
            f"KV cache: {kv_mib:.0f} MiB a backend = {int(kv_mib * MiB) // m.kv_bytes_per_token}"
            f" tokens: {slots} slot(s) of {ctx}",
            f"host-RAM prompt cache: {RAM_SHARE:.0%} of RAM over {n} backend(s): {ram} MiB "
            f"each; {threads} thread(s) each to feed the GPU"]
    backends = tuple(
        Backend(f"gpu{i}" if group == 1 else f"gpus{i * group}-{i * group + group - 1}",
                tuple(g.ref for g in gpus[i * group:(i + 1) * group]),
                slots, ctx, threads, ram)
        for i in range(n))
    if len(gpus) % group:
        why.append(f"{len(gpus) % group} GPU(s) left over: not a whole group")
    return Plan(backends, tuple(why))


def _cpu_plan(m: ModelFacts, machine: Machine, why: list[str]) -> Plan:
    budget_mib = machine.ram_mib * RAM_SHARE
    weights_mib = m.weights_bytes / MiB
    kv_mib = budget_mib / 2 - weights_mib
    if kv_mib * MiB < MIN_CTX * m.kv_bytes_per_token:
        raise DoesNotFit(f"{m.path.name}: {weights_mib / 1024:.1f} GiB of weights and one "
                         f"{MIN_CTX}-token slot need more than {budget_mib / 2:.0f} MiB "
                         "of this host's RAM (fix: a smaller model or quantization)")
    slots, ctx = _slots(int(kv_mib * MiB), m, CPU_MAX_SLOTS)
    ram = int(budget_mib / 2)
    why += [f"no GPU: one backend on the CPU, {machine.cpus} thread(s)",
            f"KV cache: {kv_mib:.0f} MiB of RAM = {int(kv_mib * MiB) // m.kv_bytes_per_token} "
            f"tokens: {slots} slot(s) of {ctx}; host-RAM prompt cache {ram} MiB"]
    return Plan((Backend("cpu", (), slots, ctx, machine.cpus, ram),), tuple(why))


def render(p: Plan, m: ModelFacts, alias: str | None = None) -> str:
    """config.yaml for ``p`` (``kvroute serve --config`` runs it as it is)."""
    lines = ["# Written by `kvroute init`. The reasoning:",
             *(f"#   {w}" for w in p.why),
             "# Every key: docs/configuration.md.",
             "proxy:", "  host: 127.0.0.1", "  port: 8080", "  policy: prefix", "",
             "backends:"]
    for b in p.backends:
        lines += [f"  - name: {b.name}",
                  f"    model: {m.path}",
                  *([f"    alias: {alias}"] if alias else []),
                  f"    slots: {b.slots}",
                  f"    ctx_per_slot: {b.ctx_per_slot}",
                  f"    threads: {b.threads}",
                  f"    cache_ram_mib: {b.cache_ram_mib}"]
        if b.devices:
            lines += [f"    devices: [{', '.join(map(str, b.devices))}]",
                      '    extra_args: ["-ngl", "all"]   # every layer on its device(s)']
    return "\n".join(lines) + "\n"
