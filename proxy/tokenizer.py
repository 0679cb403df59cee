"""Exact llama.cpp tokenization with a cache of fragments between special tokens.

`llama_tokenize(..., parse_special=true)` first partitions the text at every occurrence
of a special token (`tokenizer_st_partition` in src/llama-vocab.cpp: control,
user-defined and unknown tokens, longest first, honouring LSTRIP/RSTRIP), then runs the
BPE/SPM tokenizer on each raw-text fragment on its own. So the token ids of a fragment
never depend on its neighbours, and a conversation's history -- whose fragments are the
same strings turn after turn -- can be served from a cache. Only the new text (usually
the last message) is tokenized.

`FragmentTokenizer.tokenize(text)` returns exactly `llama_tokenize(text, add_special=True,
parse_special=True)`; `tokenize_uncached` is the same call without the cache (tests
compare the two). A self-check at load time falls back to uncached tokenization if a
vocabulary ever breaks the independence assumption.
"""

from __future__ import annotations

import ctypes
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import llama_cpp

_SPECIAL_ATTRS = (llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
                  | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN)
_C_SPACE = " \t\n\v\f\r"  # C isspace() in the "C" locale, as the partition uses


@dataclass(frozen=True)
class _Special:
    id: int
    text: str
    lstrip: bool  # LLAMA_TOKEN_ATTR_LSTRIP: eat whitespace to the left of a match
    rstrip: bool  # LLAMA_TOKEN_ATTR_RSTRIP: eat whitespace to the right of a match


@dataclass(frozen=True)
class _Prefix:
    core: str            # a prompt up to (and including) its last special token
    ends: list[int]      # offsets in `core` just after each special token
    counts: list[int]    # number of ids of core[:ends[i]]
    tokens: list[int]    # ids of the whole prompt (first counts[-1] are core's)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    entries: int = 0
    tokens: int = 0  # token ids held by the cache (its memory is ~40 bytes per id)


class FragmentTokenizer:
    """llama-cpp-python vocabulary + special-token partition + bounded LRU of fragments."""

    def __init__(self, gguf_path: Path | str, *, max_cached_tokens: int = 2_000_000,
                 max_prefixes: int = 32) -> None:
        self.llama = llama_cpp.Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)
        self._vocab = self.llama._model.vocab
        self.metadata: dict[str, str] = dict(self.llama.metadata)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
        self.add_eos = bool(llama_cpp.llama_vocab_get_add_eos(self._vocab))
        self.bos_id = llama_cpp.llama_vocab_bos(self._vocab)
        self.eos_id = llama_cpp.llama_vocab_eos(self._vocab)
        self._specials = self._load_specials()
        self._rank = {s.id: i for i, s in enumerate(self._specials)}
        # One alternation, longest first: at each position it reports the longest special
        # token starting there. Tokens hidden inside a reported one are added through
        # `_contained` so the candidate set is complete (see `_candidates`).
        self._special_re = re.compile("|".join(re.escape(s.text) for s in self._specials)) \
            if self._specials else None
        self._contained: dict[str, list[_Special]] = {}
        # Fast path: when no two special texts can overlap or contain one another and none
        # strips whitespace, the order llama.cpp carves them out in cannot matter, and one
        # regex split (leftmost match, longest first) gives the very same partition.
        self._ids = {s.text: s.id for s in self._specials}
        self._split_re = re.compile("(" + self._special_re.pattern + ")") \
            if self._special_re is not None and self._independent_specials() else None
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        # The proxy may tokenize on the event loop and on a worker thread at once: cache
        # bookkeeping is locked (llama_tokenize itself runs outside the lock).
        self._lock = threading.Lock()
        # Recent prompts, cut after their last special token: a conversation's next turn
        # starts with its previous prompt, and a cut at a special token is a fragment
        # boundary, so those ids are reused without even splitting that text again.
        self._prefixes: OrderedDict[int, _Prefix] = OrderedDict()
        self._max_prefixes = max_prefixes
        self._max_cached_tokens = max_cached_tokens
        self.stats = CacheStats()
        self.cache_enabled = self._self_check()

    # -- vocabulary ---------------------------------------------------------------------

    def _load_specials(self) -> list[_Special]:
        out = []
        get_attr, get_text, vocab = (llama_cpp.llama_vocab_get_attr,
                                     llama_cpp.llama_vocab_get_text, self._vocab)
        for tid in range(self.n_vocab):
            attr = get_attr(vocab, tid)
            if not attr & _SPECIAL_ATTRS:
                continue
            raw = get_text(vocab, tid)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                continue  # cannot occur inside valid UTF-8 prompt text
            if text:
                out.append(_Special(tid, text, bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP),
                                    bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP)))
        # llama.cpp sorts by text length, longest first (ties: id order here).
        out.sort(key=lambda s: -len(s.text))
        return out

    def _independent_specials(self) -> bool:
        """No special text overlaps or contains another, and none strips whitespace."""
        if any(s.lstrip or s.rstrip for s in self._specials):
            return False
        assert self._special_re is not None
        texts = {s.text for s in self._specials}
        prefixes = {t[:i] for t in texts for i in range(1, len(t))}
        for t in texts:
            for i in range(1, len(t)):
                if t[:i] in texts or t[i:] in prefixes or self._special_re.match(t, i):
                    return False  # contains a special, or its tail can start another
        return True

    def piece(self, token_id: int) -> str:
        """common_token_to_piece(vocab, id, special=true): how templates see bos/eos."""
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_token_to_piece(self._vocab, token_id, buf, len(buf), 0, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token_id, buf, len(buf), 0, True)
        return buf.raw[:n].decode("utf-8", errors="replace")

    # -- tokenization -------------------------------------------------------------------

    def _llama_tokenize(self, data: bytes, add_special: bool, parse_special: bool) -> list[int]:
        n_max = len(data) + 8  # a token covers >= 1 byte; + room for BOS/EOS
        buf = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special,
                                     parse_special)
        if n < 0:  # cannot happen with the bound above, but never return a truncation
            buf = (llama_cpp.llama_token * -n)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, -n, add_special,
                                         parse_special)
        return buf[:n]

    def tokenize_uncached(self, text: str, add_special: bool = True,
                          parse_special: bool = True) -> list[int]:
        """One `llama_tokenize` call over the whole text (the reference behaviour)."""
        return self._llama_tokenize(text.encode("utf-8"), add_special, parse_special)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """`llama_tokenize(text, add_special, parse_special=True)`, fragment-cached."""
        if not self.cache_enabled:
            return self.tokenize_uncached(text, add_special, True)
        out = self._body(text) if self._split_re is not None else self._body_exact(text)
        if add_special and self.add_bos:
            out.insert(0, self.bos_id)
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    def _body_exact(self, text: str) -> list[int]:
        out: list[int] = []
        for frag in self.partition(text):
            if isinstance(frag, int):
                out.append(frag)
            else:
                out.extend(self._fragment(frag))
        return out

    def _body(self, text: str) -> list[int]:
        """Fast path: resume from a remembered prompt that `text` extends (the previous turn
        of the conversation), then split and look up only the rest."""
        hit = self._find_prefix(text)
        if hit is None:
            start, out, ends, counts = 0, [], [], []
        else:
            start, out = len(hit.core), hit.tokens[:hit.counts[-1]]
            ends, counts = list(hit.ends), list(hit.counts)
        ids, pos = self._ids, start
        # re.split with one group alternates raw text (even) and a special token (odd).
        for i, piece in enumerate(self._split_re.split(text[start:] if start else text)):  # type: ignore[union-attr]
            if not piece:
                continue
            pos += len(piece)
            if i & 1:
                out.append(ids[piece])
                ends.append(pos)
                counts.append(len(out))
            else:
                out.extend(self._fragment(piece))
        if ends:
            self._remember(_Prefix(text[:ends[-1]], ends, counts, out))
        return list(out)

    def _find_prefix(self, text: str) -> _Prefix | None:
        best = None
        with self._lock:
            for p in self._prefixes.values():
                if (best is None or len(p.core) > len(best.core)) and text.startswith(p.core):
                    best = p
            if best is not None:
                # The prompt being built extends `best` and will supersede it: dropping it
                # keeps the list to about one entry per live conversation.
                del self._prefixes[id(best)]
        return best

    def _remember(self, p: _Prefix) -> None:
        with self._lock:
            self._prefixes[id(p)] = p  # keyed by identity: hashing a 100 KB text costs
            while len(self._prefixes) > self._max_prefixes:
                self._prefixes.popitem(last=False)

    def _fragment(self, frag: str) -> tuple[int, ...]:
        cache, stats = self._cache, self.stats
        with self._lock:
            ids = cache.get(frag)
            if ids is not None:
                cache.move_to_end(frag)
                stats.hits += 1
                return ids
            stats.misses += 1
        ids = tuple(self._llama_tokenize(frag.encode("utf-8"), False, False))
        if len(ids) <= self._max_cached_tokens // 4:  # a huge one-off must not flush all
            with self._lock:
                if frag not in cache:
                    cache[frag] = ids
                    stats.tokens += len(ids)
                while stats.tokens > self._max_cached_tokens:
                    _, old = cache.popitem(last=False)
                    stats.tokens -= len(old)
                stats.entries = len(cache)
        return ids

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()
            self._prefixes.clear()
            self.stats = CacheStats()

    # -- special-token partition (tokenizer_st_partition) ------------------------------

    def _candidates(self, text: str) -> list[_Special]:
        """Every special token that occurs in `text`, longest first."""
        if self._special_re is None:
            return []
        found = {m.group() for m in self._special_re.finditer(text)}
        if not found:
            return []
        cands: dict[str, _Special] = {}
        for t in found:
            contained = self._contained.get(t)
            if contained is None:  # specials that are substrings of t (t included)
                contained = [s for s in self._specials if s.text in t]
                self._contained[t] = contained
            for s in contained:
                cands[s.text] = s
        return sorted(cands.values(), key=lambda s: self._rank[s.id])

    def partition(self, text: str) -> list[int | str]:
        """Split `text` into special-token ids and raw-text fragments, as llama.cpp does."""
        if self._split_re is not None:
            ids = self._ids
            # re.split with one group alternates raw text (even) and a special (odd).
            return [ids[p] if i & 1 else p
                    for i, p in enumerate(self._split_re.split(text)) if p]
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

    def _self_check(self) -> bool:
        probe = "".join(f"{s.text} a b\n\n  x{s.text}{s.text}y " for s in self._specials[:64])
        probe = "Hello world  \n" + probe + " naïve 日本語 🙂 end"
        cached = self.tokenize_uncached(probe) == self._tokenize_fragments_only(probe)
        self.clear_cache()
        return cached

    def _tokenize_fragments_only(self, text: str) -> list[int]:
        self.cache_enabled = True
        try:
            return self.tokenize(text)
        finally:
            self.cache_enabled = False
