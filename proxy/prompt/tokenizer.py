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
compare the two). `tokenize_ids` returns the same ids as an `array('i')`: fragments are
cached as native int32 bytes, so a 30k-token prompt is assembled with memcpys and handed
to the router (whose radix tree keys are int32 bytes) without ever becoming 30k Python
ints -- building and converting such a list costs ~1 ms each way. A self-check at load
time falls back to uncached tokenization if a vocabulary ever breaks the independence
assumption.
"""

from __future__ import annotations

import ctypes
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from proxy.prompt.llama import llama_cpp
from proxy.prompt.media import MARKER, SENTINEL, Image
from proxy.prompt.prefixes import Prefix, PrefixMemory
from proxy.prompt.specials import SpecialSplitter, load_specials


@dataclass
class Plan:
    """One text on its way through `plan` -> `fetch` -> `finish` (see `tokenize_ids`)."""

    text: str
    add_special: bool
    start: int = 0                    # chars of `text` covered by `base`
    base: Prefix | None = None        # the remembered prompt `text` shares a head with
    shared: int = 0                   # how many of `base`'s cuts (ends) that head spans
    pieces: list[str] | None = None   # split of text[start:]; None: no fast path
    known: dict[str, bytes] = field(default_factory=dict)           # cached fragments
    missing: dict[str, bytes | None] = field(default_factory=dict)  # filled by `fetch`
    missing_bytes: int = 0            # chars `fetch` will tokenize
    result: array | None = None       # `fetch`'s ids when there is no fast path
    media: bool = False               # holds media markers (cut there: see `fetch`)
    images: tuple[Image | None, ...] = ()  # what each marker stands for (media_of)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    entries: int = 0
    tokens: int = 0  # token ids held by the cache (4 bytes each, as int32 bytes)


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
        # The special-token partition (proxy/prompt/specials.py); `_split_res` is None
        # unless its regex fast path applies.
        self._splitter = SpecialSplitter(load_specials(self._vocab, self.n_vocab))
        self._specials = self._splitter.specials
        self._ids = self._splitter.ids
        self._split_res = self._splitter.split_res
        self._cache: OrderedDict[str, bytes] = OrderedDict()  # fragment -> int32 ids
        # The proxy may tokenize on the event loop and on a worker thread at once: cache
        # bookkeeping is locked (llama_tokenize itself runs outside the lock).
        self._lock = threading.Lock()
        # Recent prompts and their ids, to resume from (proxy/prompt/prefixes.py).
        self._prefixes = PrefixMemory(max_prefixes)
        self._max_cached_tokens = max_cached_tokens
        self.stats = CacheStats()
        self.cache_enabled = self._self_check()

    # -- vocabulary ---------------------------------------------------------------------

    def piece(self, token_id: int) -> str:
        """common_token_to_piece(vocab, id, special=true): how templates see bos/eos."""
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_token_to_piece(self._vocab, token_id, buf, len(buf), 0, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token_id, buf, len(buf), 0, True)
        return buf.raw[:n].decode("utf-8", errors="replace")

    def fim_ids(self) -> tuple[int, int, int, int, int]:
        """The FIM tokens (prefix, suffix, middle, repo, file separator), -1 where the
        vocabulary has none: what llama-server builds an `/infill` prompt with."""
        v = self._vocab
        return (llama_cpp.llama_vocab_fim_pre(v), llama_cpp.llama_vocab_fim_suf(v),
                llama_cpp.llama_vocab_fim_mid(v), llama_cpp.llama_vocab_fim_rep(v),
                llama_cpp.llama_vocab_fim_sep(v))

    # -- tokenization -------------------------------------------------------------------

    def _llama_tokenize(self, data: bytes, add_special: bool, parse_special: bool) -> bytes:
        """The ids as native int32 bytes (the cache's and the router's format)."""
        n_max = len(data) + 8  # a token covers >= 1 byte; + room for BOS/EOS
        buf = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special,
                                     parse_special)
        if n < 0:  # cannot happen with the bound above, but never return a truncation
            buf = (llama_cpp.llama_token * -n)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, -n, add_special,
                                         parse_special)
        return ctypes.string_at(buf, n * 4)

    def tokenize_uncached(self, text: str, add_special: bool = True,
                          parse_special: bool = True) -> list[int]:
        """One `llama_tokenize` call over the whole text (the reference behaviour)."""
        out = array("i")
        out.frombytes(self._llama_tokenize(text.encode("utf-8"), add_special, parse_special))
        return out.tolist()

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """`llama_tokenize(text, add_special, parse_special=True)`, fragment-cached."""
        return self.tokenize_ids(text, add_special).tolist()

    def tokenize_ids(self, text: str, add_special: bool = True) -> array:
        """`tokenize()` as an `array('i')` (no per-id Python objects: see module doc)."""
        plan = self.plan(text, add_special)
        self.fetch(plan)
        return self.finish(plan)

    # `tokenize_ids` in three steps, so that a caller can run only the slow middle one
    # (llama_tokenize of the text never seen, which releases the GIL) on another thread:
    # `plan` and `finish` touch the caches and must stay on one thread; `fetch` only goes
    # through the fragment cache's lock (the paths without a fast path).

    def plan(self, text: str, add_special: bool = True) -> Plan:
        """Split `text` and look its fragments up; `Plan.missing_bytes` is left to do."""
        plan = Plan(text, add_special, media=MARKER in text)
        if not self.cache_enabled or self._split_res is None or plan.media:
            plan.missing_bytes = len(text)  # the whole text is tokenized in `fetch`
            return plan
        hit = self._prefixes.find(text)
        if hit is not None:
            plan.base, plan.shared = hit
            plan.start = plan.base.ends[plan.shared - 1]
        pieces = self._splitter.split(text[plan.start:] if plan.start else text)
        plan.pieces = pieces
        known, missing = plan.known, plan.missing
        cache, stats = self._cache, self.stats
        with self._lock:
            for piece in pieces[::2]:
                if not piece or piece in known:
                    continue
                ids = cache.get(piece)
                if ids is None:
                    if piece not in missing:
                        missing[piece] = None
                        plan.missing_bytes += len(piece)
                    continue
                cache.move_to_end(piece)
                known[piece] = ids
            stats.hits += len(known)
            stats.misses += len(missing)
        return plan

    def fetch(self, plan: Plan) -> None:
        """Tokenize what `plan` found in no cache (thread-safe: the fragment cache only
        under its lock)."""
        if plan.media:
            plan.result = self._around_media(plan.text)
            return
        if plan.pieces is None:
            plan.result = self._body_exact(plan.text) if self.cache_enabled else \
                self._raw_ids(plan.text, plan.add_special)
            return
        tok = self._llama_tokenize
        for frag in plan.missing:
            plan.missing[frag] = tok(frag.encode("utf-8"), False, False)

    def finish(self, plan: Plan) -> array:
        """The ids of `plan.text`; caches what `fetch` tokenized and the prompt's prefix."""
        if plan.pieces is None:
            out = plan.result if plan.result is not None else array("i")
            if not self.cache_enabled and not plan.media:
                return out  # llama_tokenize added BOS/EOS itself
        else:
            out = self._assemble(plan)
        if plan.add_special and self.add_bos:
            out.insert(0, self.bos_id)
        if plan.add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    def head(self, plan: Plan) -> tuple[array, int]:
        """The ids of `plan.text` up to its first fragment no cache holds (BOS included),
        and where in the text that fragment starts: what can be routed on before `fetch`.
        Read-only (no cache is touched). Only for a plan with a fast path."""
        assert plan.pieces is not None
        hit, k = plan.base, plan.shared
        out = array("i") if hit is None else hit.tokens[:hit.counts[k - 1]]
        known, ids, pos = plan.known, self._ids, plan.start
        for i, piece in enumerate(plan.pieces):
            if i & 1:
                out.append(ids[piece])
            elif piece:
                got = known.get(piece)
                if got is None:
                    break
                out.frombytes(got)
            pos += len(piece)
        if plan.add_special and self.add_bos:
            out.insert(0, self.bos_id)
        return out, pos

    def _around_media(self, text: str) -> array:
        """The ids of the text between media markers, each part tokenized on its own (as
        mtmd_tokenizer does), a SENTINEL where each marker was (proxy/prompt/media.py)."""
        out = array("i")
        for i, part in enumerate(text.split(MARKER)):
            if i:
                out.append(SENTINEL)
            out.extend(self._body_exact(part) if self.cache_enabled
                       else self._raw_ids(part, False))
        return out

    def _raw_ids(self, text: str, add_special: bool) -> array:
        out = array("i")
        out.frombytes(self._llama_tokenize(text.encode("utf-8"), add_special, True))
        return out

    def _assemble(self, plan: Plan) -> array:
        """Fast path: resume from a remembered prompt that the text extends (the previous
        turn of the conversation), then append the ids of the rest, piece by piece."""
        hit, k = plan.base, plan.shared
        if hit is None:
            out, ends, counts = array("i"), [], []
        else:
            out, ends, counts = hit.tokens[:hit.counts[k - 1]], hit.ends[:k], hit.counts[:k]
        known, missing, ids, pos = plan.known, plan.missing, self._ids, plan.start
        self._store(missing)
        for i, piece in enumerate(plan.pieces or ()):
            if not piece:
                continue
            pos += len(piece)
            if i & 1:
                out.append(ids[piece])
                ends.append(pos)
                counts.append(len(out))
            else:
                got = known.get(piece)
                out.frombytes(got if got is not None else missing[piece] or b"")
        if ends:
            self._prefixes.remember(Prefix(plan.text[:ends[-1]], ends, counts, out))
        return array("i", out)  # a copy (a memcpy): the caller may insert BOS

    def _body_exact(self, text: str) -> array:
        out = array("i")
        for frag in self.partition(text):
            if isinstance(frag, int):
                out.append(frag)
            else:
                out.frombytes(self._fragment(frag))
        return out

    def _fragment(self, frag: str) -> bytes:
        with self._lock:
            ids = self._cache.get(frag)
            if ids is not None:
                self._cache.move_to_end(frag)
                self.stats.hits += 1
                return ids
            self.stats.misses += 1
        ids = self._llama_tokenize(frag.encode("utf-8"), False, False)
        self._store({frag: ids})
        return ids

    def _store(self, fetched: dict[str, bytes | None]) -> None:
        """Add freshly tokenized fragments to the LRU, evicting the oldest past the cap."""
        if not fetched:
            return
        cache, stats, cap = self._cache, self.stats, self._max_cached_tokens
        with self._lock:
            for frag, ids in fetched.items():
                # a huge one-off must not flush everything else
                if ids is None or len(ids) // 4 > cap // 4 or frag in cache:
                    continue
                cache[frag] = ids
                stats.tokens += len(ids) // 4
            while stats.tokens > cap:
                _, old = cache.popitem(last=False)
                stats.tokens -= len(old) // 4
            stats.entries = len(cache)

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()
            self._prefixes.clear()
            self.stats = CacheStats()

    # -- special-token partition (tokenizer_st_partition, proxy/prompt/specials.py) ------

    def partition(self, text: str) -> list[int | str]:
        """Split `text` into special-token ids and raw-text fragments, as llama.cpp does."""
        return self._splitter.partition(text)

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
