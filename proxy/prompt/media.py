"""The media a chat request carries, as llama-server reads its content parts.

llama-server takes images, audio and video only with a projector (``--mmproj``), and
then only the kinds its ``/props`` ``modalities`` name. A chat content part's type says
its kind (server-common.cpp, oaicompat_content_load_media): ``image_url`` is vision,
``input_audio`` audio, ``input_video`` and ``video_url`` video. Anthropic image blocks
and Responses ``input_image`` items arrive here converted to ``image_url`` parts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

VISION, AUDIO, VIDEO = "vision", "audio", "video"
PART_KINDS: Mapping[str, str] = {
    "image_url": VISION, "input_audio": AUDIO, "input_video": VIDEO, "video_url": VIDEO}


def media_kinds(body: Mapping[str, Any]) -> frozenset[str]:
    """The media kinds a chat body's messages hold (none: text only, or not a chat)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return frozenset()
    kinds: set[str] = set()
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            kind = PART_KINDS.get(part.get("type")) if isinstance(part, dict) else None
            if kind is not None:
                kinds.add(kind)
    return frozenset(kinds)
