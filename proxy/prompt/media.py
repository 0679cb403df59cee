"""The media a chat request carries, and the positions llama-server gives them.

llama-server takes images, audio and video only with a projector (``--mmproj``), and
then only the kinds its ``/props`` ``modalities`` name. A chat content part's type says
its kind (server-common.cpp, oaicompat_content_load_media): ``image_url`` is vision,
``input_audio`` audio, ``input_video`` and ``video_url`` video. Anthropic image blocks
and Responses ``input_image`` items arrive here converted to ``image_url`` parts.

The server replaces each media part with a marker in the rendered prompt, cuts the
prompt there (tools/mtmd/mtmd.cpp, mtmd_tokenizer: each text part tokenized on its own)
and puts the media's chunk in its place: a run of positions keyed by a hash of the
file's bytes. Two prompts share a chunk whole or not at all (server_tokens'
common prefix compares chunk ids). The proxy renders with a marker of its own and
stands a chunk in the ids as ``chunk_ids``: a first id from the bytes' digest, then
filler ids, as many as the chunk's positions. Ids are negative: no token has them, so a
chunk matches only the same bytes, whole. The count depends on the projector and the
image's size: known here for images under llava's fixed-size ``mlp`` projectors (read
from the mmproj GGUF), learned per image size from the servers' reports under any
other (`MediaCounts`). An audio clip's count depends on its decoded samples (whisper's
30 s windows: tests/backends/test_demo_audio.py); it is learned per clip, by its bytes.
The file's bytes, not the part's type, say which it is (mtmd-helper.cpp). The ids stop
at the chunk (``expand``) of media whose count is not known yet, and of video and media
the server fetches itself (URLs): the prediction then never counts what it cannot know.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import secrets
import warnings
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import PIL.Image

from backends.demo_model import read_gguf_metadata

VISION, AUDIO, VIDEO = "vision", "audio", "video"
PART_KINDS: Mapping[str, str] = {
    "image_url": VISION, "input_audio": AUDIO, "input_video": VIDEO, "video_url": VIDEO}
# random, as the server's own: no client text can hold it
MARKER = f"<__kvroute_media_{secrets.token_hex(8)}__>"
SENTINEL = -1  # where a marker was, in the ids the tokenizer gives
SERVER_MARKER_HEAD = "<__media_"  # how llama-server's own random marker starts
_FILL = -2  # every position of a chunk after its first
_FIRST = 3  # a chunk's first id: -(_FIRST + digest mod _SPAN)
_SPAN = (1 << 31) - _FIRST - 1
# projector types of a fixed-size image and no marker tokens (tools/mtmd/mtmd.cpp):
# (image_size / patch_size)^2 positions per image
_FIXED = frozenset({"mlp", "mlp_norm"})
# ids a prompt expands to at most: past any slot's context (the request is refused once
# routed), so that many small images cannot make a huge array of one small body
MAX_IDS = 1 << 22
# base64_decode (server-common.cpp) reads the longest run of these, stopping at "="
_BASE64_RUN = re.compile(r"[A-Za-z0-9+/]*")


# Pillow reads only a file's header here, never its pixels: a huge size is no bomb to us
warnings.filterwarnings("ignore", category=PIL.Image.DecompressionBombWarning)


class Image(NamedTuple):
    """An image as the cache model keys it: ``digest`` its chunk (a hash of the file's
    bytes, as the server keys it), ``shape`` the key of its count of positions. On the
    models kvroute learns counts for, a projector computes that count from the
    decoded width and height alone (resized, tiled or sliced by them; the server's
    --image-min-tokens and --image-max-tokens bound it, alike on a pool's servers), so
    images of one size share it: ``shape`` is the size, or the digest when kvroute
    cannot be sure of the size stb_image decodes (see `_size`). (DeepSeek-V4 pads its
    images by the position they start at: nothing is learned for it.) An audio clip is
    kept alike, ``shape`` its digest: its count depends on its decoded samples."""

    digest: bytes
    shape: bytes
    audio: bool = False  # an audio clip: counted by its bytes, never by an image's count


def image_of(data: bytes) -> Image:
    """The `Image` of a file's bytes (an image's, or an audio clip's: `_is_audio`)."""
    digest = hashlib.blake2b(data, digest_size=16).digest()
    if _is_audio(data):
        return Image(digest, digest, audio=True)
    size = _size(data)
    return Image(digest, digest if size is None else b"%dx%d" % size)


def _size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG or 8-bit JPEG's header (Pillow reads no more of it).
    Pillow sizes some other files otherwise than stb_image does (a GIF frame past its
    screen), or stb_image refuses them (RLE bitmaps) and the server decodes them as
    video: None, and such an image is counted by its bytes. (A rarer one that slips
    through, a lossless JPEG, is caught by `MediaCounts.forget`.)"""
    try:
        with PIL.Image.open(io.BytesIO(data), formats=("PNG", "JPEG")) as im:
            if im.format == "JPEG" and im.mode not in ("L", "RGB", "CMYK"):
                return None
            return im.size
    except Exception:  # (its readers raise OSError, ValueError, SyntaxError...): by its bytes
        return None


# learns an image size's positions from a server's count of a body's prompt (``markers``:
# the backends' own): the prompt's ids with it in place, or None (PromptBuilder.learn_media)
LearnMedia = Callable[[Mapping[str, Any], int, Iterable[str]], "array | None"]


def media_kinds(body: Mapping[str, Any]) -> frozenset[str]:
    """The media kinds a chat body's messages, or a completion body's prompts, hold
    (none: text only)."""
    if "prompt" in body:
        return frozenset(AUDIO if _is_audio(data) else VISION
                         for sub in _subprompts(body["prompt"])
                         for data in map(_file, _listed(sub)) if data is not None)
    return frozenset(PART_KINDS[t] for t, _ in _parts(body))


def _subprompts(prompt: object) -> list[Mapping[str, Any]]:
    """A completion prompt's subprompts of the object form (``prompt_string``)."""
    items = prompt if isinstance(prompt, list) else [prompt]
    return [p for p in items if isinstance(p, Mapping)]


def _listed(sub: Mapping[str, Any]) -> list[object]:
    raw = sub.get("multimodal_data")
    return raw if isinstance(raw, list) else []


def _file(x: object) -> bytes | None:
    """A ``multimodal_data`` file as the server decodes it (base64_decode: raw base64;
    a data URI or a URL decodes to bytes no image or audio loader takes)."""
    return decoded(x) if isinstance(x, str) and not x.startswith("data:") else None


def _is_audio(data: bytes) -> bool:
    """mtmd-helper.cpp is_audio_file: WAV, MP3 or FLAC by its first bytes."""
    if len(data) < 12:
        return False
    return (data[:4] == b"RIFF" and data[8:12] == b"WAVE") or data[:3] == b"ID3" \
        or (data[0] == 0xFF and data[1] & 0xE0 == 0xE0) or data[:4] == b"fLaC"


def completion_media(sub: Mapping[str, Any]) -> tuple[Image | None, ...]:
    """The `Image` of each file of a completion subprompt's ``multimodal_data``, in
    order, as ``media_of`` gives a chat's (None: not decodable)."""
    return tuple(None if data is None else image_of(data) for data in map(_file, _listed(sub)))


def ends_with_media(prompt: object, markers: Iterable[str]) -> bool:
    """Does a completion subprompt with media end with one (a marker last)? The server
    aborts on such a prompt (GGML_ASSERT in its batch: nothing after the media)."""
    ends = tuple(m for m in markers if m)
    return bool(ends) and any(
        isinstance(s := p.get("prompt_string"), str) and s.endswith(ends)
        for p in _subprompts(prompt) if "multimodal_data" in p)


def prompt_for(prompt: object, markers: Iterable[str], marker: str) -> object:
    """A completion ``prompt`` for a backend whose media marker is ``marker``: each
    subprompt with media holds it where it held any of ``markers``."""
    def one(p: object) -> object:
        if isinstance(p, Mapping) and "multimodal_data" in p \
                and isinstance(s := p.get("prompt_string"), str):
            return {**p, "prompt_string": with_marker(s, markers, marker)}
        return p
    return [one(p) for p in prompt] if isinstance(prompt, list) else one(prompt)


def with_marker(text: str, markers: Iterable[str], marker: str) -> str:
    """``text`` with each of ``markers`` (the backends' own, which a client reads from
    `/props`) made ``marker``."""
    for m in markers:
        if m and m != marker:
            text = text.replace(m, marker)
    return text


def media_of(body: Mapping[str, Any]) -> tuple[Image | None, ...]:
    """The `Image` of each image or audio part, in the order the server reads the media
    (None: video, whose positions are not modelled here, or bytes the server fetches
    itself or cannot decode)."""
    return tuple(_image(t, part) if PART_KINDS[t] != VIDEO else None
                 for t, part in _parts(body))


def _parts(body: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    messages = body.get("messages")
    out: list[tuple[str, Mapping[str, Any]]] = []
    for msg in messages if isinstance(messages, list) else ():
        content = msg.get("content") if isinstance(msg, dict) else None
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind in PART_KINDS:
                out.append((kind, part))
    return out


def _image(kind: str, part: Mapping[str, Any]) -> Image | None:
    inner = part.get(kind)
    inner = inner if isinstance(inner, Mapping) else {}
    url = inner.get("url") if kind == "image_url" else inner.get("data", inner.get("url"))
    data = decoded(url) if isinstance(url, str) else None
    return None if data is None else image_of(data)


def decoded(url: str) -> bytes | None:
    """The bytes of a media URL as the server reads them (handle_media): a base64 data
    URI, or raw base64. None for what it fetches (http, file) or refuses."""
    if url.startswith(("http", "file://")):
        return None
    if url.startswith("data:"):
        head, _, b64 = url.partition(",")
        if "," in b64 or not head.endswith("base64") or not head.startswith(
                ("data:image/", "data:video/", "data:audio/")):
            return None
        url = b64
    run = _BASE64_RUN.match(url)
    b64 = run.group() if run else ""
    b64 = b64[:len(b64) - len(b64) % 4] if len(b64) % 4 == 1 else b64
    try:
        data = base64.b64decode(b64 + "=" * (-len(b64) % 4), validate=True)
    except (binascii.Error, ValueError):
        return None
    return data or None


def cut_short(body: Mapping[str, Any], ids: Sequence[int]) -> bool:
    """Do ``body``'s prompt ids stop before its last media (a count not known)? Read
    without decoding: the media a chat's messages, or a completion's first prompt, hold,
    against the chunks in ``ids``."""
    if "prompt" in body:
        prompt = body["prompt"]
        first = prompt[0] if isinstance(prompt, list) and prompt else prompt
        held = len(_listed(first)) if isinstance(first, Mapping) else 0
    else:
        held = len(_parts(body))
    return held > 0 and sum(1 for i in ids if i < _FILL) < held


def media_positions(ids: Sequence[int]) -> int:
    """The positions of ``ids`` that media chunks take."""
    return sum(1 for i in ids if i < 0)


def chunk_ids(digest: bytes, n: int) -> array:
    """The ids that stand for a media chunk of ``n`` positions keyed by ``digest``."""
    first = -(_FIRST + int.from_bytes(digest[:8], "little") % _SPAN)
    out = array("i", [_FILL]) * n
    out[0] = first
    return out


@dataclass(frozen=True)
class MediaModel:
    """What a pool's projector makes of an image: its positions (fixed here)."""

    projector: str
    positions: int

    @classmethod
    def read(cls, mmproj: Path) -> MediaModel | None:
        """The model of the projector in ``mmproj`` (None: one whose count is not known
        here, or not a readable GGUF)."""
        try:
            meta = read_gguf_metadata(mmproj)
        except (OSError, ValueError):
            return None
        kind = meta.get("clip.projector_type")
        size, patch = meta.get("clip.vision.image_size"), meta.get("clip.vision.patch_size")
        if kind not in _FIXED or "clip.vision.image_grid_pinpoints" in meta \
                or not isinstance(size, int) or not isinstance(patch, int) or patch <= 0:
            return None
        return cls(str(kind), (size // patch) ** 2)


class MediaCounts:
    """The positions a pool's servers give each image: its projector's fixed count where
    kvroute reads it (`MediaModel`), else learned per image size (`Image.shape`) from
    what a server reports for a prompt that holds it: the prompt's positions less its
    text and the images already known, when the images of one size are not. Whatever a
    projector puts around an image (its begin and end tokens) counts with it. Nothing
    is learned where the pool does not model media (``learns`` False; see
    proxy/server/pools.py)."""

    def __init__(self, model: MediaModel | None = None, learns: bool = False,
                 limit: int = 4096) -> None:
        self.model, self.learns, self.limit = model, learns and model is None, limit
        self._learned: OrderedDict[bytes, int] = OrderedDict()  # shape -> positions

    def chunk(self, image: Image) -> array | None:
        """The ids of ``image`` (None: its count is not known)."""
        if self.model is not None:
            n = None if image.audio else self.model.positions
        else:
            n = self._learned.get(image.shape)
        if n is None:
            return None
        if self.model is None:
            self._learned.move_to_end(image.shape)
        return chunk_ids(image.digest, n)

    def learn(self, ids: array, media: tuple[Image | None, ...], reported: int) -> bool:
        """A server gave ``reported`` positions to the prompt of ``ids`` (SENTINELs where
        ``media`` go): learn the count of the one image size (or audio clip) of it not
        known. False when there is none, or more than one, or media not decoded here."""
        if not self.learns or ids.count(SENTINEL) != len(media):
            return False
        shapes = [m.shape for m in media if m is not None]
        if len(shapes) != len(media):
            return False
        unknown = {s for s in shapes if s not in self._learned}
        if len(unknown) != 1:
            return False
        (new,) = unknown
        rest = reported - (len(ids) - len(media)) - sum(
            self._learned[s] for s in shapes if s != new)
        times = shapes.count(new)
        if rest <= 0 or rest % times:
            return False
        self._learned[new] = rest // times
        while len(self._learned) > self.limit:
            self._learned.popitem(last=False)
        return True

    def forget(self, media: tuple[Image | None, ...]) -> None:
        """A server counted a prompt of ``media`` otherwise than the counts learned for
        them: forget those (a size whose count is not the same for every image)."""
        for m in media:
            if m is not None:
                self._learned.pop(m.shape, None)


def expand(ids: array, media: tuple[Image | None, ...],
           chunk: Callable[[Image], array | None] | None) -> array:
    """``ids`` with its SENTINELs replaced by ``chunk`` of each media's `Image`; cut at
    the first media without one or a chunk, past the media there are, or at MAX_IDS."""
    out, at = array("i"), 0
    for image in media:
        try:
            i = ids.index(SENTINEL, at)
        except ValueError:
            break
        out.extend(ids[at:i])
        got = None if image is None or chunk is None or len(out) > MAX_IDS \
            else chunk(image)
        if got is None:
            return out
        out.extend(got)
        at = i + 1
    try:
        end = ids.index(SENTINEL, at)
    except ValueError:
        end = len(ids)
    out.extend(ids[at:end])
    return out
