"""What backends/client.py reads of a server's answers: `GET /lora-adapters` (the
answer's shape is the pinned server's server_task_result_get_lora::to_json)."""

from __future__ import annotations

import pytest

from backends.client import Adapters, adapter_list

PLAIN = {"id": 0, "path": "a.gguf", "scale": 1.0, "task_name": "", "prompt_prefix": ""}
ALORA = {"id": 1, "path": "b.gguf", "scale": 0.5, "task_name": "", "prompt_prefix": "",
         "alora_invocation_string": " certainty check:",
         "alora_invocation_tokens": [43643, 1779, 25]}


@pytest.mark.parametrize("raw, want", [
    ([], Adapters()),
    ([PLAIN], Adapters((1.0,), ((),))),
    ([ALORA, PLAIN], Adapters((1.0, 0.5), ((), (43643, 1779, 25)))),  # (by id)
    ([{"id": 0, "scale": 1}], Adapters((1.0,), ((),))),
    ({"id": 0}, None),
    ([PLAIN, PLAIN], None),  # (an id twice: one missing)
    ([{**PLAIN, "id": 1}], None),  # (an id out of range)
    ([{**PLAIN, "scale": "1"}], None),
    ([{**PLAIN, "id": True}], None),
    ([{**ALORA, "id": 0, "alora_invocation_tokens": "x"}], None),
    ([{**ALORA, "id": 0, "alora_invocation_tokens": [1.5]}], None),
    ([{**ALORA, "id": 0, "alora_invocation_tokens": [-2]}], None),  # (no token's id)
    ([{**ALORA, "id": 0, "alora_invocation_tokens": [2**31]}], None),
])
def test_adapters_are_read_by_id(raw: object, want: Adapters | None) -> None:
    assert adapter_list(raw) == want
