"""llama.cpp's special-token partition (`tokenizer_st_partition`), for FragmentTokenizer.

`llama_tokenize(..., parse_special=true)` first cuts the text at every occurrence of a
special token (control, user-defined and unknown tokens, longest first, honouring
LSTRIP/RSTRIP), then tokenizes each raw-text fragment on its own (see proxy/prompt/tokenizer.py).
`SpecialSplitter` reproduces those cuts from the vocabulary alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from proxy.prompt.llama import llama_cpp

_SPECIAL_ATTRS = (llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
                  | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN)
_C_SPACE = " \t\n\v\f\r"  # C isspace() in the "C" locale, as the partition uses


@dataclass(frozen=True)
class Special:
    id: int
    text: str
    lstrip: bool  # LLAMA_TOKEN_ATTR_LSTRIP: eat whitespace to the left of a match
    rstrip: bool  # LLAMA_TOKEN_ATTR_RSTRIP: eat whitespace to the right of a match


def load_specials(vocab: object, n_vocab: int) -> list[Special]:
    """The vocabulary's special tokens, in the order llama.cpp tries them."""
    out = []
    get_attr, get_text = llama_cpp.llama_vocab_get_attr, llama_cpp.llama_vocab_get_text
    for tid in range(n_vocab):
        attr = get_attr(vocab, tid)
        if not attr & _SPECIAL_ATTRS:
            continue
        raw = get_text(vocab, tid)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # cannot occur inside valid UTF-8 prompt text
        if text:
            out.append(Special(tid, text, bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP),
                               bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP)))
    # llama.cpp sorts by text length, longest first (ties: id order here).
    out.sort(key=lambda s: -len(s.text))
    return out


class SpecialSplitter:
    """Cuts text at special tokens exactly as `tokenizer_st_partition` does."""

    def __init__(self, specials: list[Special]) -> None:
        self.specials = specials
        self._rank = {s.id: i for i, s in enumerate(specials)}
        # One alternation, longest first: at each position it reports the longest special
        # token starting there. Tokens hidden inside a reported one are added through
        # `_contained` so the candidate set is complete (see `_candidates`).
        self._special_re = re.compile("|".join(re.escape(s.text) for s in specials)) \
            if specials else None
        self._contained: dict[str, list[Special]] = {}
        # Fast path: when no two special texts can overlap or contain one another and none
        # strips whitespace, the order llama.cpp carves them out in cannot matter: every
        # occurrence of every special is a cut, found by regex splits in any order. One
        # regex per first character: a pattern that starts with a literal is scanned with
        # a fast substring search, an alternation of several first characters char by
        # char (measured: 1.6 ms vs 0.1 ms per pattern over a 200 KB prompt).
        self.ids = {s.text: s.id for s in specials}
        self.split_res: list[re.Pattern[str]] | None = None
        if self._special_re is not None and self._independent_specials():
            groups: dict[str, list[str]] = {}
            for sp in specials:  # longest first within each group, as before
                groups.setdefault(sp.text[0], []).append(re.escape(sp.text[1:]))
            self.split_res = [re.compile(f"({re.escape(c)}(?:{'|'.join(rest)}))")
                              for c, rest in groups.items()]

    def _independent_specials(self) -> bool:
        """No special text overlaps or contains another, and none strips whitespace."""
        if any(s.lstrip or s.rstrip for s in self.specials):
            return False
        assert self._special_re is not None
        texts = {s.text for s in self.specials}
        prefixes = {t[:i] for t in texts for i in range(1, len(t))}
        for t in texts:
            for i in range(1, len(t)):
                if t[:i] in texts or t[i:] in prefixes or self._special_re.match(t, i):
                    return False  # contains a special, or its tail can start another
        return True

    def split(self, text: str) -> list[str]:
        """Raw text (even indices) alternating with special tokens (odd), as re.split with
        one group returns them (fast path only)."""
        assert self.split_res is not None
        pieces: list[str] | None = None
        for rx in self.split_res:
            if len(self.split_res) > 1 and rx.search(text) is None:
                continue
            if pieces is None:
                pieces = rx.split(text)
                continue
            out: list[str] = []
            for i, p in enumerate(pieces):  # split the raw pieces further: an odd number
                out.extend(rx.split(p) if not i & 1 and p else (p,))  # keeps the parity
            pieces = out
        return [text] if pieces is None else pieces

    def _candidates(self, text: str) -> list[Special]:
        """Every special token that occurs in `text`, longest first."""
        if self._special_re is None:
            return []
        found = {m.group() for m in self._special_re.finditer(text)}
        if not found:
            return []
        cands: dict[str, Special] = {}
        for t in found:
            contained = self._contained.get(t)
            if contained is None:  # specials that are substrings of t (t included)
                contained = [s for s in self.specials if s.text in t]
                self._contained[t] = contained
            for s in contained:
                cands[s.text] = s
        return sorted(cands.values(), key=lambda s: self._rank[s.id])

    def partition(self, text: str) -> list[int | str]:
        """Split `text` into special-token ids and raw-text fragments, as llama.cpp does."""
        if self.split_res is not None:
            ids = self.ids
            return [ids[p] if i & 1 else p for i, p in enumerate(self.split(text)) if p]
        frags: list[int | str] = [text] if text else []
        for sp in self._candidates(text):
            tok = sp.text
            nxt: list[int | str] = []
            for frag in frags:
                if isinstance(frag, int) or tok not in frag:
                    nxt.append(frag)
                    continue
                start = 0
                while True:
                    pos = frag.find(tok, start)
                    if pos < 0:
                        if start < len(frag):
                            nxt.append(frag[start:])
                        break
                    left = frag[start:pos]
                    if sp.lstrip:
                        left = left.rstrip(_C_SPACE)
                    if left:
                        nxt.append(left)
                    nxt.append(sp.id)
                    start = pos + len(tok)
                    if sp.rstrip:
                        while start < len(frag) and frag[start] in _C_SPACE:
                            start += 1
            frags = nxt
        return frags
