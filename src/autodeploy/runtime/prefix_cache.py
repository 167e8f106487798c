"""Prefix caching: KV-cache pages shared by requests whose prompts start with the same tokens.

A page that holds a full page of prompt tokens is *published* under its key: the whole token prefix that
it ends (``tuple(prompt[: (i + 1) * page_size])`` for the i-th page). Exact tuples, not hashes, so two
prefixes never collide; the k/v of a page depend only on the tokens up to its end, so a page published
by one request is valid for any other request whose prompt starts with that prefix.

Pages are reference-counted: :meth:`PrefixCachingPool.acquire` shares published pages with a new request,
:meth:`~PrefixCachingPool.free` drops one reference. A published page whose last reference is gone stays
in the cache, *evictable*: it still counts as free, and :meth:`~PrefixCachingPool.allocate` takes pages
that were never published first, then evicts the least recently used evictable ones.

Only full prompt pages before the prompt's last token are shared (:meth:`~PrefixCachingPool.match`), so
every request computes at least its last prompt token itself (the logits it samples from) and no request
ever writes into a shared page.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence


class PrefixCachingPool:
    """A page pool (``allocate`` / ``free`` / ``num_free``, as :class:`~autodeploy.runtime.sequence_info.
    PagePool`) whose full prompt pages are shared between requests by their token prefix."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))  # never published (or evicted): pop() low pages first
        self._refs: dict[int, int] = {}  # page -> requests holding it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # published, unreferenced; LRU first
        self._by_key: dict[tuple[int, ...], int] = {}
        self._key_of: dict[int, tuple[int, ...]] = {}
        self.hit_tokens = 0  # prompt tokens served from the cache, for stats

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_pages(self) -> int:
        return len(self._by_key)

    # -- sharing ----------------------------------------------------------------------------------
    def match(self, prompt: Sequence[int]) -> list[int]:
        """The published pages of ``prompt``'s longest cached prefix (full pages, leaving its last token)."""
        pages: list[int] = []
        for end in range(self.page_size, len(prompt), self.page_size):
            page = self._by_key.get(tuple(prompt[:end]))
            if page is None:
                break
            pages.append(page)
        return pages

    def num_unreferenced(self, pages: Iterable[int]) -> int:
        """How many of ``pages`` are evictable (counted in ``num_free`` until :meth:`acquire` takes them)."""
        return sum(1 for p in pages if p in self._evictable)

    def acquire(self, pages: Iterable[int]) -> None:
        """Take one more reference to each of ``pages`` (published pages from :meth:`match`)."""
        for p in pages:
            self._evictable.pop(p, None)
            self._refs[p] = self._refs.get(p, 0) + 1
            self.hit_tokens += self.page_size

    def publish(self, page: int, prefix: Sequence[int]) -> None:
        """Make ``page`` (full, holding the last ``page_size`` tokens of ``prefix``) shareable. A prefix
        already published by another page keeps that page (two requests computed it at once)."""
        key = tuple(prefix)
        if key in self._by_key or page in self._key_of:
            return
        self._by_key[key] = page
        self._key_of[page] = key

    # -- the pool interface -----------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"out of KV-cache pages: {n} requested, {self.num_free} free of {self.num_pages}")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:  # evict the least recently used published page
                page, _ = self._evictable.popitem(last=False)
                del self._by_key[self._key_of.pop(page)]
            self._refs[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference to each of ``pages`` (a request's pages, in order). Taken in reverse, so that
        the tail of a prefix is evicted before its head (a head without its tail is still a hit)."""
        for p in reversed(list(pages)):
            if p not in self._refs:
                raise ValueError(f"page {p} is not allocated")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                del self._refs[p]
                if p in self._key_of:
                    self._evictable[p] = None  # most recently used last
                else:
                    self._free.append(p)
