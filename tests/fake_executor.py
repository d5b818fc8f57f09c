"""A fake executor for the scheduler: it runs step plans as a toy model on a toy paged KV cache, in Python,
and checks every plan against what a device would need.

The toy model: the token after position p is a hash of every token at positions 0 .. p, the one at p being
the forward's input and the others read from the KV cache through the slot's block table. So a plan that
gives a slot the wrong blocks, a prefix-cache hit holding other tokens, or a step that reads positions
nobody wrote, changes the tokens, and a test comparing them with `continuation` sees it. Drafts are the
toy model's own tokens, accepted n_acc at a time (a hash of the position picks 0..K), so speculation is
lossless here as it must be on the device; rejected drafts and prefill padding write garbage where the
real runner writes stale entries, which the plan must never let anyone read.
"""

from __future__ import annotations

from redline.kernels.paged_kv import BLOCK
from redline.runner.plan import ChunkResult, DecodeResult, Shapes, StepPlan, StepResult

GARBAGE = -1
SCRATCH = -1


def next_token(tokens: list[int], vocab: int) -> int:
    """The toy model: the token after `tokens` (ids 2 .. vocab - 1, so never the tokenizer's eos 0 or 1)."""
    h = 0
    for i, t in enumerate(tokens):
        h = (h * 1_000_003 + (i + 1) * (t + 7)) % 2_147_483_647
    return 2 + h % (vocab - 2)


def continuation(prompt: list[int], n: int, vocab: int) -> list[int]:
    """What greedy decoding of the toy model gives after `prompt`: n tokens."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens, vocab))
    return tokens[len(prompt) :]


class FakeExecutor:
    recovers = True

    def __init__(self, shapes: Shapes, num_blocks: int, vocab: int):
        self.shapes, self.num_blocks, self.vocab = shapes, num_blocks, vocab
        per_slot = shapes.cache_len // BLOCK + 1
        self.table = [[SCRATCH] * per_slot for _ in range(shapes.slots)]
        self.kv = {b: [GARBAGE] * BLOCK for b in range(num_blocks)}  # block -> token per row
        self.active = [False] * shapes.slots
        self.pending = [0] * shapes.slots  # the last emitted token, at pos
        self.pos = [0] * shapes.slots
        self.plans: list[StepPlan] = []

    def lost(self) -> str | None:
        return None

    # ---- the toy cache ----

    def _block(self, slot: int, position: int) -> int:
        return self.table[slot][position // BLOCK]

    def _write(self, slot: int, position: int, token: int) -> None:
        if position >= self.shapes.cache_len:
            return
        block = self._block(slot, position)
        if block != SCRATCH:
            self.kv[block][position % BLOCK] = token

    def _read(self, slot: int, upto: int) -> list[int]:
        """Positions 0 .. upto - 1 of the slot, as its blocks hold them."""
        out = []
        for p in range(upto):
            block = self._block(slot, p)
            assert block != SCRATCH, f"slot {slot} reads position {p}, which it holds no block for"
            out.append(self.kv[block][p % BLOCK])
        return out

    def _holds(self, slot: int, positions: int) -> None:
        blocks = -(-min(positions, self.shapes.cache_len) // BLOCK)
        missing = [i for i in range(blocks) if self.table[slot][i] == SCRATCH]
        assert not missing, f"slot {slot} lacks blocks {missing} for positions [0, {positions})"

    # ---- a plan ----

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        for slot in plan.released:
            self.active[slot] = False
            self.table[slot] = [SCRATCH] * len(self.table[slot])
        for update in plan.tables:
            for i, block in enumerate(update.blocks):
                assert 0 <= block < self.num_blocks, f"block {block} is not in the pool"
                self.table[update.slot][update.start + i] = block
        result = StepResult()
        if plan.prefill is not None:
            result.prefill = [self._prefill_chunk(chunk) for chunk in plan.prefill.chunks]
            length = self.shapes.prefill_len(max(len(c.tokens) for c in plan.prefill.chunks))
            for chunk in plan.prefill.chunks:  # padding rows write past each chunk, as the device does
                for p in range(chunk.end, min(chunk.start + length, self.shapes.cache_len)):
                    self._write(chunk.slot, p, GARBAGE)
        if plan.decode is not None:
            k = self.shapes.k if plan.decode.k is None else plan.decode.k  # the drafts this step verifies
            result.decode = self._decode(plan.decode.rows, plan.decode.kv_len, k)
        return result

    def _prefill_chunk(self, chunk) -> ChunkResult:
        self._holds(chunk.slot, chunk.end)
        for i, token in enumerate(chunk.tokens):
            self._write(chunk.slot, chunk.start + i, token)
        if not chunk.final:
            return ChunkResult(None)
        assert chunk.slot not in [s for s, a in enumerate(self.active) if a], "a decoding slot prefills"
        first = next_token(self._read(chunk.slot, chunk.end), self.vocab)
        self.pending[chunk.slot], self.pos[chunk.slot] = first, chunk.end
        self.active[chunk.slot] = chunk.decodes
        return ChunkResult(first)

    def _decode(self, rows: int, kv_len: int, k: int) -> DecodeResult:
        tokens, accepted = [], []
        for slot in range(rows):
            if not self.active[slot]:
                tokens.append([0] * (k + 1))
                accepted.append(0)
                continue
            pos = self.pos[slot]
            self._holds(slot, pos + self.shapes.lookahead)  # the draft chain writes up to pos + 2K
            assert kv_len >= min(pos + 2 * k + 1, self.shapes.cache_len), f"kv_len {kv_len} < slot {slot}'s"
            n_acc = (pos * 2_654_435_761) % (k + 1)
            emitted, token = [], self.pending[slot]
            for j in range(n_acc + 1):
                self._write(slot, pos + j, token)
                token = next_token(self._read(slot, pos + j + 1), self.vocab)
                emitted.append(token)
            for j in range(n_acc + 1, k + 1):  # rejected drafts' entries: stale, rewritten before read
                self._write(slot, pos + j, GARBAGE)
            tokens.append(emitted + [0] * (k - n_acc))
            accepted.append(n_acc)
            self.pending[slot], self.pos[slot] = emitted[-1], pos + n_acc + 1
        for slot in range(rows, self.shapes.slots):
            assert not self.active[slot], f"slot {slot} decodes but lies past the step's {rows} rows"
        return DecodeResult(tokens, accepted, {}, k)
