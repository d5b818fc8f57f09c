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
    """The key of a full block: SHA-256 of the parent's key and the block's token ids (8 bytes each)."""
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
    def __init__(self, num_blocks: int, block_size: int = 16):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs at least one block of at least one token ({num_blocks=})")
        self.num_blocks, self.block_size = num_blocks, block_size
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

    def cached_prefix(self, tokens: Sequence[int], limit: int | None = None) -> tuple[list[int], list[bytes]]:
        """The blocks of the longest prefix of `tokens` made of full cached blocks (at most `limit`
        blocks), each now referenced once more, and their keys. Counts the lookup in `stats`: every full
        block of `tokens` (up to `limit`) queried, the returned ones hit."""
        full = len(tokens) // self.block_size
        wanted = full if limit is None else min(full, limit)
        blocks, keys, parent = [], [], ROOT
        for i in range(wanted):
            parent = block_key(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            block = self.block_of.get(parent)
            if block is None:
                break
            if self.refs[block] == 0:
                del self.evictable[block]
            self.refs[block] += 1
            blocks.append(block)
            keys.append(parent)
        self.stats.queries += wanted * self.block_size
        self.stats.hits += len(blocks) * self.block_size
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
        least the prompt's last token is left to compute (its logits give the first new token)."""
        assert not self.blocks, "a prefix is reused only by a new table"
        self.blocks, self.keys = self.pool.cached_prefix(prompt, (len(prompt) - 1) // self.pool.block_size)
        return self.capacity

    def ensure(self, positions: int) -> None:
        """Enough blocks for positions [0, positions); raises OutOfBlocks, taking none, when the pool is
        short."""
        missing = -(-positions // self.pool.block_size) - len(self.blocks)
        if missing > 0:
            self.blocks += self.pool.allocate(missing)

    def cache_prompt(self, prompt: Sequence[int]) -> None:
        """Offers the prompt's full blocks to the prefix cache, once their keys and values are written."""
        full = min(len(prompt) // self.pool.block_size, len(self.blocks))
        self.keys = self._chain(prompt, full)
        for block, key in zip(self.blocks, self.keys, strict=False):
            self.pool.cache(block, key)

    def release(self) -> None:
        """Gives every block back (a finished, cancelled or preempted request)."""
        self.pool.release(self.blocks)
        self.blocks, self.keys = [], []

    def _chain(self, prompt: Sequence[int], count: int) -> list[bytes]:
        """The keys of the first `count` full blocks of `prompt`."""
        keys, parent, size = [], ROOT, self.pool.block_size
        for i in range(count):
            parent = block_key(parent, prompt[i * size : (i + 1) * size])
            keys.append(parent)
        return keys
