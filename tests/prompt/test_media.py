"""Media in the prompt ids: decoded as the server decodes them, stood for by chunk ids
that match the same bytes only, whole; markers joined as the server joins them."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from array import array
from pathlib import Path
from typing import Any

import PIL.Image
import pytest
from hypothesis import given
from hypothesis import strategies as st
from images import png

from backends.demo_mmproj import ensure_demo_mmproj
from proxy.prompt.chat_request import MEDIA_MARKER, _join_parts
from proxy.prompt.media import (
    MARKER,
    SENTINEL,
    Image,
    MediaCounts,
    MediaModel,
    chunk_ids,
    completion_media,
    cut_short,
    decoded,
    ends_with_media,
    expand,
    image_of,
    media_kinds,
    media_of,
    prompt_for,
)

PNG = b"\x89PNG\r\n\x1a\nfake"
B64 = base64.b64encode(PNG).decode()
WAV = b"RIFF\x00\x00\x00\x00WAVEfmt "
W64 = base64.b64encode(WAV).decode()


@pytest.mark.parametrize(("url", "data"), [
    (f"data:image/png;base64,{B64}", PNG),
    (f"data:audio/wav;base64,{B64}", PNG),
    (B64, PNG),  # raw base64, as the server takes it
    ("http://example.com/a.png", None),  # the server fetches it: bytes not known here
    ("https://example.com/a.png", None),
    ("file://a.png", None),
    (f"data:text/plain;base64,{B64}", None),  # the server refuses these
    (f"data:image/png,{B64}", None),
    (f"data:image/png;base64,{B64},x", None),
    ("", None),
    # base64_decode: the longest run of the alphabet, up to "=" or any other character
    (B64 + "\n" + B64, PNG),
    (base64.b64encode(b"ab").decode().rstrip("="), b"ab"),  # padding not needed
    ("QUJD" + "Q", b"ABC"),  # a lone last character gives no byte
])
def test_decoded_as_the_server_reads_a_url(url: str, data: bytes | None) -> None:
    assert decoded(url) == data


def test_media_of_keys_by_bytes_in_the_servers_order() -> None:
    def img(b64: str) -> dict[str, object]:
        return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}}
    other = base64.b64encode(PNG + b"!").decode()
    body = {"messages": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, img(B64), img(other)]},
        {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": B64}},
                                     {"type": "image_url", "image_url": {"url": "http://x"}}]}]}
    a, b, c, d = media_of(body)
    assert a != b and a is not None and b is not None
    assert c == a and d is None  # (its bytes make an image, whatever the part); a URL: not read
    (clip,) = media_of({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": W64, "format": "wav"}}]}]})
    assert clip == image_of(WAV) and clip is not None and clip.audio and clip.shape == clip.digest
    again = {"messages": [{"role": "user", "content": [img(B64)]}]}
    assert media_of(again) == (a,)
    assert media_kinds(body) == {"vision", "audio"}


def test_chunks_match_the_same_bytes_whole_and_others_not_at_all() -> None:
    one, two = chunk_ids(b"a" * 16, 64), chunk_ids(b"b" * 16, 64)
    assert len(one) == 64 and one == chunk_ids(b"a" * 16, 64)
    assert one[0] != two[0] and one[1:] == two[1:]  # differ at once, so never in part
    assert all(i < 0 and i != SENTINEL for i in one)  # no token has them


def _reference(ids: list[int], media: list[Image | None], n: int) -> list[int]:
    out: list[int] = []
    k = 0
    for i in ids:
        if i != SENTINEL:
            out.append(i)
            continue
        if k >= len(media) or media[k] is None:
            return out
        out += list(chunk_ids(media[k].digest, n))  # type: ignore[union-attr]
        k += 1
    return out


_IMAGES = st.builds(Image, st.binary(min_size=16, max_size=16), st.just(b"1x1"))


@given(st.lists(st.one_of(st.integers(0, 50), st.just(SENTINEL)), max_size=30),
       st.lists(st.one_of(st.none(), _IMAGES), max_size=5),
       st.integers(1, 5))
def test_expand_is_the_reference(ids: list[int], media: list[Image | None], n: int) -> None:
    got = expand(array("i", ids), tuple(media), lambda m: chunk_ids(m.digest, n))
    assert got.tolist() == _reference(ids, media, n)


def test_without_a_known_count_the_ids_stop_at_the_first_media() -> None:
    ids = array("i", [1, 2, SENTINEL, 3])
    assert expand(ids, (Image(b"x" * 16, b"1x1"),), None).tolist() == [1, 2]


def test_the_demo_projector_is_read_and_others_are_not(tmp_path: Path) -> None:
    model = MediaModel.read(ensure_demo_mmproj())
    assert model is not None and (model.projector, model.positions) == ("mlp", 64)
    assert MediaModel.read(tmp_path / "missing.gguf") is None
    (tmp_path / "x.gguf").write_bytes(b"not a gguf")
    assert MediaModel.read(tmp_path / "x.gguf") is None


def _t(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


M = {"type": MEDIA_MARKER, "text": MARKER}


@pytest.mark.parametrize(("parts", "joined"), [  # common/chat.cpp, concat_content_parts
    ([_t("a"), _t("b")], "a\nb"),
    ([_t("a"), M, _t("b")], f"a{MARKER}b"),  # never a newline next to a marker
    ([M, M, _t("b"), _t("c")], f"{MARKER}{MARKER}b\nc"),
    ([_t(""), _t("a"), M], f"a{MARKER}"),
], ids=["text", "around", "leading", "empty-first"])  # (the marker is random per process)
def test_parts_join_as_the_server_joins_them(parts: list[dict[str, str]], joined: str
                                              ) -> None:
    assert _join_parts(parts) == joined


@pytest.mark.parametrize(("prompt", "kinds", "digests"), [
    ("text", set(), ()),
    ({"prompt_string": "x"}, set(), ()),
    ({"prompt_string": "x", "multimodal_data": [B64]}, {"vision"}, (True,)),
    ({"prompt_string": "x", "multimodal_data": [W64, B64]}, {"audio", "vision"},
     (True, True)),
    # a data URI or a URL decodes to bytes no loader takes: no kind, no digest
    ({"prompt_string": "x", "multimodal_data": [f"data:image/png;base64,{B64}", 3]}, set(),
     (False, False)),
    (["a", {"prompt_string": "x", "multimodal_data": [B64]}], {"vision"}, None),
])
def test_a_completions_media(prompt: object, kinds: set[str],
                             digests: tuple[bool, ...] | None) -> None:
    assert media_kinds({"prompt": prompt}) == kinds
    if digests is not None and isinstance(prompt, dict):
        assert tuple(d is not None for d in completion_media(prompt)) == digests


@pytest.mark.parametrize(("text", "ends"), [
    ("look <m1>", True), ("look <m2>", True), ("look <m1> now", False),
    ("look <m1>\n", False), ("<m3>", False),
])
def test_a_prompt_ending_with_media_is_found(text: str, ends: bool) -> None:
    sub = {"prompt_string": text, "multimodal_data": [B64]}
    assert ends_with_media(sub, {"<m1>", "<m2>", ""}) is ends
    assert ends_with_media(["x", sub], {"<m1>", "<m2>"}) is ends
    assert not ends_with_media({"prompt_string": text}, {"<m1>", "<m2>"})  # (no media)
    assert not ends_with_media(sub, set())


def test_each_backend_gets_its_own_marker() -> None:
    sub = {"prompt_string": "a <m1> b <m2> c", "multimodal_data": [B64, B64]}
    got = prompt_for(["t", sub], {"<m1>", "<m2>", ""}, "<m2>")
    assert got == ["t", {"prompt_string": "a <m2> b <m2> c", "multimodal_data": [B64, B64]}]
    assert prompt_for({"prompt_string": "a <m1>"}, {"<m1>"}, "<m2>") == {
        "prompt_string": "a <m1>"}  # (no media: as it is)


# images of their own sizes; D4 the size of D1, other bytes
D1, D2, D3 = (Image(k * 16, k) for k in (b"1", b"2", b"3"))
D4 = Image(b"4" * 16, b"1")
S = SENTINEL


@pytest.mark.parametrize(("ids", "media", "reported", "learned"), [
    ([5, 6, S, 7], (D1,), 3 + 64, {D1: 64, D4: 64}),  # and every image of its size
    ([5, S, 6, S], (D1, D1), 2 + 2 * 10, {D1: 10}),  # the same image twice
    ([5, S, 6, S], (D1, D4), 2 + 2 * 10, {D1: 10, D4: 10}),  # two of one size
    ([5, S, 6, S], (D2, D1), 2 + 30 + 10, {D1: 10}),  # D2 known (30): D1 is the rest
    ([5, S, S], (D1, D3), 100, {}),  # two unknown sizes: not learned
    ([5, S], (None,), 50, {}),  # not an image
    ([5, S], (D1,), 1, {}),  # nothing left for it
    ([5, S, 6, S], (D1, D1), 2 + 21, {}),  # not a whole count each
    ([5, S, 6], (D1, D3), 90, {}),  # markers and media disagree
])
def test_counts_are_learned_from_one_unknown_size(ids: list[int], media: tuple[Image | None, ...],
                                                  reported: int,
                                                  learned: dict[Image, int]) -> None:
    counts = MediaCounts(learns=True)
    assert counts.learn(array("i", [5, S]), (D2,), 1 + 30)  # D2: 30 positions
    got = counts.learn(array("i", ids), media, reported)
    assert got is bool(learned)
    for m, n in learned.items():
        assert counts.chunk(m) == chunk_ids(m.digest, n)
    if not learned:
        assert counts.chunk(D1) is None


def test_a_projectors_count_is_never_learned_over() -> None:
    counts = MediaCounts(MediaModel("mlp", 64), learns=True)
    assert not counts.learns and not counts.learn(array("i", [5, S]), (D1,), 100)
    assert counts.chunk(D1) == chunk_ids(D1.digest, 64)
    assert not MediaCounts().learn(array("i", [5, S]), (D1,), 100)  # (not learning)


def test_an_image_is_keyed_by_its_bytes_and_counted_by_its_size() -> None:
    a, b, c = image_of(png(1, 64, 48)), image_of(png(2, 64, 48)), image_of(png(1, 48, 64))
    assert a.shape == b.shape == b"64x48" and c.shape == b"48x64"
    assert len({a.digest, b.digest, c.digest}) == 3
    assert image_of(png(1, 64, 48, level=1)).digest != a.digest  # other bytes, same pixels
    junk = image_of(b"\x89PNG\r\n\x1a\nfake")  # a header no reader takes: its bytes
    assert junk.shape == junk.digest


def _png_header(width: int, height: int) -> bytes:
    """A PNG of no pixel data (8-bit RGB): its header says a size, nothing holds it."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


# (proxy/prompt/media.py ignores it from its import on; pytest undoes filters set while
# it collects)
@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
@pytest.mark.parametrize(("width", "height", "shape"), [
    (640, 480, b"640x480"),
    # past Pillow's bomb limit (2 x MAX_IMAGE_PIXELS: it raises): counted by its bytes
    (60000, 60000, None),
    # between the limit and twice it (Pillow warns; the warning is ignored): its size
    (10000, 10000, b"10000x10000"),
])
def test_a_size_is_read_from_the_header_alone(width: int, height: int,
                                              shape: bytes | None) -> None:
    """Only the header is read: a huge size claimed is neither decoded nor allocated."""
    got = image_of(_png_header(width, height))
    assert got.shape == (got.digest if shape is None else shape)


@pytest.mark.parametrize(("body", "ids", "short"), [
    ({"messages": [{"role": "user", "content": "hi"}]}, [1, 2], False),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, [1, 2], True),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, [1, -9, -2, -2, 4], False),
    ({"prompt": {"prompt_string": "a", "multimodal_data": [B64, B64]}}, [1, -9, -2], True),
    ({"prompt": [{"prompt_string": "a", "multimodal_data": [B64]}, "b"]}, [1, -5], False),
    ({"prompt": "text"}, [1], False),
])
def test_ids_cut_short_of_their_media(body: dict[str, Any], ids: list[int],
                                      short: bool) -> None:
    assert cut_short(body, ids) is short


def _encoded(fmt: str, size: tuple[int, int], **save: Any) -> bytes:
    out = io.BytesIO()
    PIL.Image.new("RGB", size, (200, 30, 60)).save(out, fmt, **save)
    return out.getvalue()


@pytest.mark.parametrize(("fmt", "save", "sized"), [
    ("JPEG", {}, True),
    ("JPEG", {"progressive": True}, True),
    ("PNG", {}, True),
    ("GIF", {}, False),  # Pillow may size a GIF otherwise than stb_image: by its bytes
    ("BMP", {}, False),
    ("WEBP", {}, False),  # stb_image does not read it
])
def test_only_a_size_stb_image_reads_alike_keys_a_count(fmt: str, save: dict[str, Any],
                                                        sized: bool) -> None:
    got = image_of(_encoded(fmt, (33, 21), **save))
    assert got.shape == (b"33x21" if sized else got.digest)


def test_a_count_a_server_disagrees_with_is_forgotten() -> None:
    counts = MediaCounts(learns=True)
    assert counts.learn(array("i", [5, S]), (D1,), 1 + 30)
    counts.forget((None, D4))  # (D4: D1's size)
    assert counts.chunk(D1) is None and counts.chunk(D4) is None
    counts.forget((D2,))  # (not learned: nothing to forget)
