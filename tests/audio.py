"""Small WAV clips for the audio tests, written with the standard library.

A clip's samples come from a seed (a sine whose pitch depends on it, with noise), so two
seeds give two clips; ``extra`` appends a chunk after the samples, so the same samples can
be had as other bytes (llama-server keys a clip by a hash of the bytes it was sent,
tools/mtmd/mtmd-helper.cpp).
"""

from __future__ import annotations

import array
import base64
import io
import math
import random
import struct
import wave

from backends.demo_audio import SAMPLE_RATE


def samples(seconds: float, rate: int = SAMPLE_RATE) -> int:
    return round(seconds * rate)


def wav(seed: int, seconds: float, extra: bytes = b"", rate: int = SAMPLE_RATE) -> bytes:
    """A 16-bit mono WAV: a sine whose pitch depends on ``seed``, with noise. ``extra``
    is appended as a LIST chunk after the samples: other bytes, the same samples."""
    rng = random.Random(seed)
    step = 2 * math.pi * (110 + 37 * seed % 2000) / rate
    pcm = array.array("h", (int(8000 * math.sin(i * step)) + rng.randint(-800, 800)
                            for i in range(samples(seconds, rate))))
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    data = out.getvalue()
    if extra:
        extra += b"\0" * (len(extra) % 2)  # RIFF chunks are word-aligned
        data += b"LIST" + struct.pack("<I", len(extra)) + extra
        data = data[:4] + struct.pack("<I", len(data) - 8) + data[8:]
    return data


def audio_part(clip: bytes) -> dict[str, object]:
    """An OpenAI chat ``input_audio`` content part holding ``clip``."""
    return {"type": "input_audio",
            "input_audio": {"data": base64.b64encode(clip).decode(), "format": "wav"}}
