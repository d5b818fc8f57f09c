"""KV blocks: a pool of fixed-size blocks of token positions, reference-counted, with a prefix cache.

A request's keys and values (the target's layers and the draft's alike) live in the blocks its
`BlockTable` lists: position p sits in block table[p // B] at row p % B (B = 16: position 37 is row 5
of the table's third block). Blocks are taken as a request grows and given back when it ends.

Prefix cache (as vLLM and SGLang do it): a block full of prompt tokens is keyed by a SHA-256 of its
parent block's key and its own token ids, so a key names the whole prefix up to the block's end, and a
new request reuses every leading block whose key is cached. A cached block nobody references stays
cached until the pool needs the room: the least recently released goes first. A block is cached only
once its contents are final (a prompt's full blocks, after their prefill); draft tokens and rejected
positions never are.

With an EAGLE-3 draft a block's key also covers the token after it (`key_lookahead` = 1): the draft's
row at position p reads the token at p + 1, so the draft keys and values of a block's last row depend
on the next block's first token. Keyed so, a reused block holds exactly what a cold prefill of the new
prompt would write, target and draft alike, and nothing is recomputed. Example, blocks of 16: a 40-token
prompt caches block 0 under (tokens 0..15, token 16) and block 1 under (tokens 16..31, token 32); a
prompt sharing its first 32 tokens but not the 33rd reuses block 0 only.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

ROOT = b""  # the parent key of a prompt's first block


class OutOfBlocks(RuntimeError):
    """The pool cannot give the blocks asked for (the scheduler preempts a request and retries)."""


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full block: SHA-256 of the parent's key and the block's token ids (8 bytes each, and
    the key_lookahead tokens after the block)."""
    digest = hashlib.sha256(parent)
    digest.update(b"".join(t.to_bytes(8, "little", signed=True) for t in tokens))
    return digest.digest()


@dataclass
class PrefixStats:
    """Prompt tokens looked up in the prefix cache, those found, and cached blocks evicted."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = 16, key_lookahead: int = 0):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs at least one block of at least one token ({num_blocks=})")
        self.num_blocks, self.block_size, self.key_lookahead = num_blocks, block_size, key_lookahead
        self.refs = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))  # holding nothing worth keeping
        self.key_of: dict[int, bytes] = {}  # cached block -> key
        self.block_of: dict[bytes, int] = {}  # key -> cached block
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self.stats = PrefixStats()

    @property
    def available(self) -> int:
        """Blocks `allocate` can hand out now: free ones, then cached ones nobody references."""
        return len(self.free) + len(self.evictable)

    def allocate(self, n: int) -> list[int]:
        """n blocks, each referenced once; raises OutOfBlocks (taking none) when fewer are available."""
        if n > self.available:
            raise OutOfBlocks(f"{n} KV blocks wanted, {self.available} available of {self.num_blocks}")
        blocks = []
        for _ in range(n):
            if self.free:
                block = self.free.popleft()
            else:  # evict the least recently released cached block
                block, _ = self.evictable.popitem(last=False)
                del self.block_of[self.key_of.pop(block)]
                self.stats.evictions += 1
            self.refs[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: Sequence[int]) -> None:
        """Drops one reference to each block; an unreferenced block is free, or evictable if cached."""
        for block in blocks:
            if self.refs[block] < 1:
                raise AssertionError(f"KV block {block} released more often than taken")
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.key_of:
                    self.evictable[block] = None  # the most recently released: evicted last
                else:
                    self.free.append(block)

    def keys(self, tokens: Sequence[int], count: int) -> list[bytes]:
        """The keys of the first `count` full blocks of `tokens` (each with key_lookahead tokens after it)."""
        keys, parent, size = [], ROOT, self.block_size
        for i in range(count):
            parent = block_key(parent, tokens[i * size : (i + 1) * size + self.key_lookahead])
            keys.append(parent)
        return keys

    def keyable(self, tokens: Sequence[int]) -> int:
        """Full blocks of `tokens` that have a key: 40 tokens, blocks of 16, key_lookahead 1 -> 2; 32 -> 1."""
        return max(0, (len(tokens) - self.key_lookahead) // self.block_size)

    def cached_prefix(self, tokens: Sequence[int], limit: int) -> tuple[list[int], list[bytes]]:
        """The blocks of the longest prefix of `tokens` made of cached blocks (at most `limit` blocks),
        each now referenced once more, and their keys."""
        blocks, keys = [], []
        for key in self.keys(tokens, min(limit, self.keyable(tokens))):
            block = self.block_of.get(key)
            if block is None:
                break
            if self.refs[block] == 0:
                del self.evictable[block]
            self.refs[block] += 1
            blocks.append(block)
            keys.append(key)
        return blocks, keys

    def cache(self, block: int, key: bytes) -> bool:
        """Caches a referenced block whose contents are final under `key`. False (not cached) when another
        block already holds that key: two requests computed the same prefix at once, and the first
        one's block serves later requests."""
        if self.refs[block] < 1:
            raise AssertionError(f"KV block {block} is cached while nobody holds it")
        if key in self.block_of or block in self.key_of:
            return False
        self.key_of[block], self.block_of[key] = key, block
        return True


@dataclass
class BlockTable:
    """One request's blocks, in position order, and the keys of its leading full prompt blocks."""

    pool: BlockPool
    blocks: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)  # keys[i]: block i's key, for cached or cacheable blocks

    @property
    def capacity(self) -> int:
        """Token positions the table's blocks hold."""
        return len(self.blocks) * self.pool.block_size

    def reuse_prefix(self, prompt: Sequence[int]) -> int:
        """Takes the cached blocks of prompt's longest cached prefix; returns the tokens they hold. At
        least the prompt's last token is left to compute (its logits give the first new token). The
        lookup is counted in the pool's stats by `count_lookup`, once the request is admitted."""
        assert not self.blocks, "a prefix is reused only by a new table"
        self.blocks, self.keys = self.pool.cached_prefix(prompt, (len(prompt) - 1) // self.pool.block_size)
        return self.capacity

    def count_lookup(self, prompt: Sequence[int]) -> None:
        """Counts reuse_prefix's lookup: the tokens of the blocks it could have reused, those it did."""
        size = self.pool.block_size
        looked_up = min((len(prompt) - 1) // size, self.pool.keyable(prompt))
        self.pool.stats.queries += looked_up * size
        self.pool.stats.hits += len(self.keys) * size

    def ensure(self, positions: int) -> None:
        """Enough blocks for positions [0, positions); raises OutOfBlocks, taking none, when the pool is
        short."""
        missing = -(-positions // self.pool.block_size) - len(self.blocks)
        if missing > 0:
            self.blocks += self.pool.allocate(missing)

    def cache_prompt(self, tokens: Sequence[int], computed: int | None = None) -> None:
        """Offers the full blocks of positions [0, computed) to the prefix cache once their keys and values
        are written; `tokens` (the prompt, and the first new token when known) name them. computed
        defaults to len(tokens)."""
        computed = len(tokens) if computed is None else computed
        full = min(computed // self.pool.block_size, self.pool.keyable(tokens), len(self.blocks))
        self.keys = self.pool.keys(tokens, full)
        for block, key in zip(self.blocks, self.keys, strict=False):
            self.pool.cache(block, key)

    def release(self) -> None:
        """Gives every block back (a finished, cancelled or preempted request)."""
        self.pool.release(self.blocks)
        self.blocks, self.keys = [], []
