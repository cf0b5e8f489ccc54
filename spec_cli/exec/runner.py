"""A causal LM over a static KV cache that knows about trees.

The cache holds a committed prefix (slots 0..committed-1, position = slot) followed by scratch slots:
speculative tokens whose KV entries were written by a forward but not yet accepted. Each scratch slot has a
parent slot; a new token attends to the committed prefix and to its own ancestors only, at position
parent + 1. `keep(path)` makes an accepted path of scratch slots committed (its entries gathered to the end
of the prefix, on the device, at the start of the next forward) and drops every other scratch entry:
rejection is just overwriting slots.

A forward's rows go to the device in one upload at most (`batch.packed`), none for a chain whose tokens are
already there (`batch.chain`); the masks are built on the device from them. With `compile`, each token
bucket's step is one `torch.compile(fullgraph=True, dynamic=False)` graph; on CUDA each is then captured as a
CUDA graph (`exec.graphs`) and replayed.
"""

from __future__ import annotations

import functools
import math
import mmap
import sys
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

from spec_cli.core import process
from spec_cli.core.errors import OutOfMemory, SpecError, described
from spec_cli.core.families import (
    NO_SKIP,
    Skip,
    check_architecture,
    context_length,
    num_layers,
    sliding_windows,
)
from spec_cli.core.hardware import synchronize
from spec_cli.exec import backends, packing
from spec_cli.exec import placement as offload
from spec_cli.exec.batch import BITS, WORDS, Batch, allowed, chain, packed
from spec_cli.exec.graphs import Graphs
from spec_cli.exec.prefixes import SMALLEST, Prefixes, shared
from spec_cli.exec.quant import Quantized
from spec_cli.exec.shapes import Shapes

WARM_EXACT = 16  # exact shapes warmed: the sizes of most speculative forwards (each dearer the first time)
WARM_SLOW = 0.025  # seconds: past the first, a warming forward this slow (a big model) stops the warm-up there:
# it costs far more than the kernel builds it saves (a small cost a product, once a size)
CHUNK = 512  # a long prompt runs in pieces of this many tokens: its mask is never (prompt x capacity)


def _chain(parents: list[int], committed: int) -> bool:
    """Is every scratch slot of these `parents` (after `committed` slots) the child of the one before?"""
    return all(p == (committed + j - 1 if j else -1) for j, p in enumerate(parents))


def _float_packed(product) -> bool:
    """Whether a lean loop's product is a float weight packed for oneDNN (not a quantized one's integers)."""
    packed = getattr(product, "packed", None)
    return isinstance(packed, torch.Tensor) and packed.is_floating_point()


def out_of_memory(device, what: str) -> OutOfMemory:
    return OutOfMemory(f"out of {device} memory {what}: try a shorter prompt or --max-new-tokens, a smaller "
                     f"--dtype (bfloat16, float16) or a smaller model")


class Forward(NamedTuple):
    """What a forward returns: float32 logits of the rows asked for, those rows' positions, and the `carry`
    data sent with its upload (all on the device; `carried` None without carry); `raw`, the logits where
    `logits` holds other scores (coupled sampling's)."""

    logits: torch.Tensor
    positions: torch.Tensor
    carried: torch.Tensor | None = None
    raw: torch.Tensor | None = None


def trees_exact(device: torch.device, dtype: torch.dtype, quantized: bool, own_attention: bool) -> bool:
    """Whether a tree's rows get the bits one-token steps give them (else staged verifies chains, whose rows sit
    where one-token steps put them). A tree row's ancestors sit between its cousins, not where they will be
    once kept: an attention that sums a row's keys by slot, in blocks with the masked ones among them, groups
    its sums otherwise than a one-token step does. Torch's does, on a CPU below float32 (tests/test_invariance.py)
    and on CUDA (measured on an H200 in bfloat16: rows 4 to 15 of pyfam's trees took other bits, a chain's rows
    never; tests/test_one_shape.py); in float32 on a CPU too, but there the products round a row by the rows
    beside it anyway (identity to float32's rounding, not bitwise), and trees branch. Spec's own attention
    (native/glue.cpp, eager, on a CPU) sums a row's attended keys alone, in slot order: its trees are exact.
    Quantized projections compute in bfloat16 whatever the model's dtype, so in float32 too a regrouped sum
    would flip a rounding there that grows through the layers: such a model attends with spec's own too
    (`backends.own_attention`)."""
    if own_attention:
        return True
    return device.type == "cpu" and dtype == torch.float32 and not quantized


LAZY_BYTES = 1 << 20  # caches this large and up come zeroed as they are first touched (on a CPU)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros for a cache. On a CPU, a large one lies in an anonymous mapping, whose pages the OS zeroes as
    they are first touched: a cache of thousands of slots costs (in time and resident memory) only the slots a
    sequence uses, where torch.zeros writes them all (a server slot's first request waited ~70 ms for the Qwen
    pair's 4,096-slot caches, and 16 new slots at once ~1 s). The same zeros either way."""
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if device.type != "cpu" or nbytes < LAZY_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    private = getattr(mmap, "MAP_PRIVATE", None)  # (the process's own memory, not shared; Windows has no flags)
    mapping = mmap.mmap(-1, nbytes) if private is None else mmap.mmap(-1, nbytes, flags=private)
    return torch.frombuffer(mapping, dtype=dtype, count=count).view(shape)  # (it keeps the mapping)


class Runner:
    def __init__(self, model: torch.nn.Module, vocab_size: int | None = None, capacity: int | None = None,
                 skip: Skip = NO_SKIP, shapes: Shapes | None = None, lean: bool = True,
                 compile: bool | str = False, pack: bool | None = None, graphs: Graphs | bool | None = None,
                 prefixes: Prefixes | None = None, words: torch.Tensor | None = None, lockstep=None):
        config = model.config
        check_architecture(config, f"this {config.model_type} model", untested=True)
        self.model = model
        self.prefixes = prefixes  # earlier sequences' entries, kept for prompts that share a prefix with one
        self.context = context_length(config)
        self.capacity = min(capacity or self.context, self.context)
        self.vocab_size = vocab_size or config.vocab_size
        self.device, self.dtype = offload.execution_device(model), next(model.parameters()).dtype  # (offloaded: meta)
        # whether the device queues forwards while the host goes on (a GPU): a plain step's next forward is then
        # queued before the host reads its token, and the host's work between steps costs the device nothing
        self.queues = self.device.type == "cuda"
        self.layers = num_layers(config)
        self.windows = sliding_windows(config, self.layers)
        self.windowed = any(self.windows)  # (slot positions are kept only for the windows' masks)
        kind = backends.lean_kind(model) if lean and not offload.spans_devices(model) else None
        # (a compiled step traces torch's operations)
        glue = backends.native_glue(self.device, self.dtype) if kind and not compile else None
        quantized = any(isinstance(m, Quantized) for m in model.modules())
        if kind:
            own = glue or (backends.own_attention(self.device, self.dtype, quantized) if not compile else None)
        else:  # (the model's own forward, attending with spec's: `_run_model`)
            own = backends.model_attention(model, self.device, self.dtype, quantized) if not compile else None
        if getattr(kind, "needs_own_attention", False) and own is None:  # (gpt-oss's sinks: spec's attention only)
            kind = glue = None
        blocks = {"blocks": backends.native_blocks(self.device, self.dtype)} if kind is backends.GPT2 and not compile \
            else {}
        def build():
            lean = kind(model, pack=packing.chooser(self.device, self.dtype, pack), glue=glue, **blocks)
            lean.attention = own
            if words is not None:
                head = backends.part_of_head(model.lm_head, words, config.vocab_size,
                                             pack=packing.chooser(self.device, self.dtype, pack))
                if head is not None:
                    lean.head, lean.words = head, words
            return lean

        if not kind:
            self.lean = None
        elif lockstep is not None and not compile:  # runners of one model in lockstep share its packed weights
            self.lean = lockstep.lean(model, words, build)
        else:
            self.lean = build()
        self.words = getattr(self.lean, "words", None)  # a draft's part of the vocabulary (`backends.part_of_head`)
        self.packed = self.lean is not None and packing.packs(self.lean)  # (a CPU: a few tokens cost about one)
        floats = [_float_packed(f) for f in packing.products(self.lean)] if self.lean is not None else []
        self.onednn = any(floats)  # products whose kernels oneDNN builds per row count
        # a lean loop whose layers' products are all quantized builds no oneDNN kernel per shape but the head's
        # (which costs little): exact token counts, not buckets (its integer kernels cost by blocks of 4 rows)
        integer = self.lean is not None and quantized and not any(floats[1:])  # (the layers'; the head's is first)
        self.shapes = shapes or Shapes.for_device(self.device, self.dtype, compiled=bool(compile),
                                                  per_shape=not integer, aligned=own is None)
        if compile and not self.shapes.static:
            raise ValueError("a compiled step needs static shapes: token buckets and the whole capacity attended")
        self.reserve = max(self.shapes.tokens, default=0)  # slots past the capacity where padding rows write
        self.exact_trees = trees_exact(self.device, self.dtype, quantized, own is not None)
        self.driver = None if self.lean else backends.driver(model)
        self._attends = backends.ATTENDS_ALONE if self.driver is not None and own is not None else None
        if self.driver is not None and not compile and self.dtype == torch.bfloat16:  # (a row's bits its own)
            backends.pack_projections(model, self.driver, packing.chooser(self.device, self.dtype, pack))
        self._cache_keyword = None if self.lean else backends.cache_keyword(model)
        self.skip = self.check_skip(skip)  # a self-draft: the model's own sublayers, some left out
        slots = self.capacity + self.reserve
        self.keys: list[torch.Tensor | None] = [None] * self.layers  # per layer [1, kv heads, slots, head dim]
        self.values: list[torch.Tensor | None] = [None] * self.layers
        try:
            self.slot_positions = torch.zeros(slots, dtype=torch.long, device=self.device)
            self._cols = torch.arange(max(slots, BITS), device=self.device)
            self._stacked = None  # the lean loop's caches, all layers in one tensor each: a kept path moves at once
            if self.lean:
                shape = (self.layers, 1, self.lean.kv_heads, slots, self.lean.head_dim)
                self._stacked = (zeroed(shape, self.dtype, self.device), zeroed(shape, self.dtype, self.device))
                self.keys, self.values = list(self._stacked[0]), list(self._stacked[1])
        except torch.cuda.OutOfMemoryError:
            self.keys = self.values = []
            raise out_of_memory(self.device, f"for the {config.model_type} model's {self.capacity}-token cache") \
                from None
        self.compile = False
        self.lockstep = None  # (set below, once the runner is whole)
        # whether a forward keeps what the head read of the rows it returns (`hidden`: [rows, width]), for guesses
        # made from the oracle's own state (`spec_cli.draft2.heads`); an eager lean loop's own forwards only
        self.keeps_hidden = False
        self.hidden: torch.Tensor | None = None
        self._reading = False  # whether the forward under way reads a prompt (`exec.lockstep` budgets those)
        self.reset()
        if compile and self.driver is not None:  # one eager forward first: the model's own layers allocate
            self.forward([0], commit=1)         # their caches and the wrappers learn their outputs, so no
            self.reset()                        # graph sees either change
        self.compile = compile
        self._steps: dict = {}  # skip set -> compiled step
        if graphs is None:
            graphs = bool(compile) and self.device.type == "cuda"
        self.graphs = Graphs() if graphs is True else (graphs or None)  # compiled steps captured and replayed
        self.compiled_keys: set = set()  # (skip set, rows) of the compiled steps run
        # (`exec.lockstep`) forwards run together with other runners' of the same model: their sequences'
        # rows share each product; only an eager lean loop at exact shapes (one shape pads every forward)
        self.lockstep = lockstep if self.together(lockstep) else None

    def company(self) -> int:
        """How many sequences' forwards this runner's share (1: it runs alone)."""
        return max(1, self.lockstep.taking) if self.lockstep is not None else 1

    def row_seconds(self) -> float | None:
        """In lockstep: what one more row adds to a shared forward of this model, as measured (None: not yet)."""
        return self.lockstep.row_seconds(self.lean) if self.lockstep is not None else None

    def together(self, lockstep) -> bool:
        """Whether this runner can run its forwards in `lockstep` with others."""
        return lockstep is not None and self.lean is not None and not self.compile and not self.shapes.fixed

    def warm_up(self, largest: int = 64, skip: Skip | None = None) -> int:
        """Run each padded token count up to `largest` once (with `skip`, as a self-draft would), so that
        kernels built per shape (cuDNN plans, oneDNN primitives, compiled graphs) exist before anything is
        timed; leaves the cache empty. Returns the forwards run. Exact shapes with float products packed for
        oneDNN are warmed too, each size up to `WARM_EXACT` with every row's logits: oneDNN builds a product's
        kernel per row count (the head's as well) and torch's attention per query count (spec's integer
        kernels build nothing per shape); while those forwards are cheap (`WARM_SLOW`)."""
        sizes, last = [n for n in self.shapes.tokens if n <= min(largest, self.capacity)], 1
        exact = not self.shapes.tokens and self.onednn
        if exact:
            sizes, last = list(range(1, min(largest, WARM_EXACT, self.capacity) + 1)), None
        for k, n in enumerate(sizes):
            started = time.perf_counter()
            self.forward([0] * n, commit=n, last=last, skip=skip)
            self.reset()
            if exact and k > 0 and time.perf_counter() - started > WARM_SLOW:
                return k + 1
        return len(sizes)

    def check_skip(self, skip: Skip) -> Skip:
        skip.check(self.layers)
        config = self.model.config
        if skip and config.model_type == "opt" and not getattr(config, "do_layer_norm_before", True):
            raise SpecError("this OPT model normalises after each residual, so a skipped sublayer would not be "
                            "the identity: it cannot draft for itself")
        if self.driver and any(self.driver.mlp[i] is None for i in skip.mlp):
            raise SpecError(f"cannot find the MLP of every layer of this {config.model_type} model to skip")
        return skip

    def reset(self) -> None:
        self.base = 0  # the sequence's tokens before the cache's first slot (`window`: a draft read from there on)
        self.committed = 0
        self.tokens: list[int] = []  # the committed tokens, slot by slot
        self.scratch: list[int | None] = []  # the token in each scratch slot (None: known on the device only)
        self.parents: list[int] = []  # parent slot of each scratch slot (-1: the last committed token)
        self.depths: list[int] = []  # depth below the committed prefix of each scratch slot (1 = child of it)
        self.ancestry: list[int] = []  # each scratch slot's ancestors and itself, as bits over the scratch
        self._gather: tuple[list[int], int] | None = None  # a kept path still to move: (source slots, first slot)

    @torch.inference_mode()  # (a kept path may move: the caches are inference tensors)
    def reuse(self, sequence: list[int]) -> int:
        """Keep the committed prefix `sequence` starts with (all but its last token at most); drop the rest.

        The prefix cache of a conversation: a new turn only runs the tokens the cache does not hold. With
        `prefixes` (`exec.prefixes`), what is dropped is kept there first, and a longer prefix kept there is
        copied in. Returns how many slots were kept.
        """
        self._flush()
        if self.base >= len(sequence):
            self.reset()
        sequence = sequence[self.base:]
        limit = len(sequence) - 1
        n = shared(self.tokens, sequence[:limit])
        store = self.prefixes
        if store is not None and self._stacked is not None:
            self._keep_known(beyond=n)
            most, kept = store.best(sequence, limit)
            if kept is not None and most > n:
                for cache, stored in zip(self._stacked, (kept.keys, kept.values)):
                    cache[:, :, :, :most] = stored[:, :, :, :most]
                if self.windowed:
                    self.slot_positions[:most] = torch.arange(most, device=self.device)
                self.tokens = list(sequence[:most])
                n = most
                store.hits += 1
            else:
                store.misses += 1
        self.committed = n
        del self.tokens[n:]
        self._drop_scratch()
        return n

    @torch.inference_mode()
    def rewind(self, n: int) -> None:
        """Keep the first `n` committed slots at most; drop the rest and all scratch (a draft of another vocabulary
        whose tokens of the text changed before its end: `decoding.foreign`)."""
        self._flush()
        self.committed = min(n, self.committed)
        del self.tokens[self.committed:]
        self._drop_scratch()

    @torch.inference_mode()
    def remember(self) -> None:
        """Keep the committed sequence in the prefix cache now, not only when a next sequence drops it: a
        server's slots each hold one, and the next request sharing its prefix may go to another slot."""
        if self.prefixes is None or self._stacked is None:
            return
        self._flush()
        self._keep_known(beyond=0)

    def _keep_known(self, beyond: int) -> None:
        """Put the committed tokens the host knows in the prefix cache, where they are `SMALLEST` past `beyond`."""
        known = self.tokens.index(None) if None in self.tokens else len(self.tokens)
        if known - beyond >= SMALLEST:
            self.prefixes.put(self.tokens[:known], *(c[:, :, :, :known] for c in self._stacked))

    @torch.inference_mode()
    def window(self, sequence: list[int], most: int) -> None:
        """Read at most `most` more tokens of `sequence` (after `reuse`): where more are unread, start again from
        its last `most`, the cache's first slot its first position (a draft: its guesses need the recent text,
        and a long prompt read whole costs it more than its guesses save); where it keeps none of it, from there
        whatever an earlier sequence's window was."""
        if len(sequence) - self.base - self.committed > most or (self.base and not self.committed):
            self._flush()
            self.reset()
            self.base = max(0, len(sequence) - most)

    def name(self, sequence: list[int]) -> None:
        """Learn the committed tokens that only the device knew, from the sequence they are a prefix of."""
        sequence = sequence[self.base:]
        for i in range(min(len(self.tokens), len(sequence))):
            if self.tokens[i] is None:
                self.tokens[i] = sequence[i]

    @property
    def length(self) -> int:
        return self.committed + len(self.parents)

    def room(self) -> int:
        """How many more slots the cache (and the model's positions) can take."""
        return self.capacity - self.length

    def position(self, slot: int) -> int:
        if slot < self.committed:
            return slot
        return self.committed - 1 + self.depths[slot - self.committed]

    def synchronize(self) -> None:
        synchronize(self.device)

    @torch.inference_mode()
    def forward(
        self, tokens: list[int] | torch.Tensor, commit: int = 0, parents: list[int] | None = None,
        last: int | None = None, skip: Skip | None = None, carry: list[int] | None = None,
    ) -> Forward:
        """Run `tokens` through the model: float32 logits for each token (or the `last` few), their positions.

        `tokens`: ids on the host, or a 1-D tensor of them on the device (they never leave it). The first
        `commit` tokens extend the committed prefix (the cache must hold no scratch then); the rest become
        scratch slots. `parents[i]` is the slot that scratch token i follows (-1 for the last committed
        token); by default each follows the slot before it. `skip` overrides the runner's own skipped
        sublayers for this forward (a self-draft sharing the oracle's cache; a skipped attention sublayer
        writes no cache entry, so such tokens must stay scratch and be overwritten by a full forward).
        `carry`: other host data the caller needs on the device, sent in this forward's upload and returned
        as `carried`.
        """
        n = len(tokens)
        if n == 0:
            raise ValueError("forward of no tokens")
        if n > self.room():
            raise SpecError("the model's context window is full")
        if commit and self.parents:
            raise ValueError("commit with scratch pending")
        fixed = self.shapes.fixed
        piece = self.reserve if self.compile or fixed else CHUNK  # compiled: the largest bucket, no new graph
        if self.lockstep is not None:  # a long prompt between the others' steps, not in one long stall
            piece = self.lockstep.piece
        if n > piece and (n == commit or fixed):  # a long prompt: in pieces, never a (prompt x capacity) mask
            return self._pieces(tokens, piece, commit, parents, last, skip, carry)
        start, committed = self.length, self.committed + commit
        device_ids = tokens if isinstance(tokens, torch.Tensor) else None
        host = [None] * n if device_ids is not None else list(tokens)
        layout = self._layout(start, n, committed, parents)
        self._reading = commit == n > 1  # a prompt (or its piece): all of it committed at once
        try:
            result = self._run(device_ids, host, start, layout, n if last is None else last,
                               self.skip if skip is None else skip, carry or [])
        except torch.cuda.OutOfMemoryError:
            self.reset()
            raise out_of_memory(self.device, f"running the {self.model.config.model_type} model with a "
                                             f"{self.capacity}-token cache") from None
        except BaseException:  # interrupted mid-write (Ctrl-C): the cache can no longer be trusted
            self.reset()
            raise
        self.committed = committed
        self.tokens.extend(host[:commit])
        if layout is None:
            first = len(self.parents)
            for j in range(first, first + n - commit):
                self.parents.append(committed + j - 1 if j else -1)
                self.depths.append(j + 1)
                self.ancestry.append((1 << (j + 1)) - 1)
        else:
            for parent, depth, bits in layout:
                self.parents.append(parent)
                self.depths.append(depth)
                self.ancestry.append(bits)
        self.scratch.extend(host[commit:])
        return result

    def _pieces(self, tokens, piece: int, commit: int, parents: list[int] | None, last: int | None,
                skip: Skip | None, carry: list[int] | None) -> Forward:
        """Forwards of `piece` tokens at most, in order (the last one takes the carry): a long prompt, or with
        one shape (`Shapes.fixed`) any forward longer than it, a tree's rows too (a row's parents are slots,
        so a later piece's rows see an earlier piece's as they would in one forward)."""
        n = len(tokens)
        wanted, parts = n - (n if last is None else last), []
        for first in range(0, n, piece):
            end = min(n, first + piece)
            kept = end - max(first, wanted)
            scratch = slice(max(first, commit) - commit, max(end, commit) - commit)
            part = self.forward(tokens[first:end], commit=max(0, min(commit, end) - first),
                                parents=None if parents is None else list(parents[scratch]),
                                skip=skip, last=min(end - first, max(1, kept)), carry=carry if end == n else None)
            if kept > 0:
                parts.append(Forward(part.logits[-kept:], part.positions[-kept:], part.carried))
        return Forward(torch.cat([p.logits for p in parts]), torch.cat([p.positions for p in parts]),
                       parts[-1].carried)

    def _layout(self, start: int, n: int, committed: int, parents: list[int] | None):
        """(parent, depth, ancestry) of each new scratch slot, checked before anything changes; None when the
        scratch stays one chain from the prefix (each token sees every slot before it), `parents` given or not: a
        chain takes the cheaper path, with no layout to upload and no ancestry to unpack."""
        if parents is None and self._is_chain():
            return None
        known = list(zip(self.parents, self.depths, self.ancestry))
        commit = committed - self.committed  # rows being committed come first
        layout = []
        for i in range(n - commit):
            slot = start + commit + i
            parent = parents[i] if parents is not None else slot - 1
            if parent < committed:
                if parent not in (-1, committed - 1):
                    raise ValueError("a speculative token must follow the last committed one")
                parent = -1
            elif parent >= slot:
                raise ValueError("a speculative token must follow a slot before it")
            j = slot - committed
            if j >= BITS * WORDS:
                raise SpecError(f"a tree of more than {BITS * WORDS} speculative tokens")
            above = known[parent - committed] if parent >= 0 else (-1, 0, 0)
            known.append((parent, above[1] + 1, above[2] | (1 << j)))
            layout.append(known[-1])
        if _chain([p for p, _, _ in known], committed):
            return None
        return layout

    def _is_chain(self) -> bool:
        """Is every scratch slot the child of the one before (no side branches)?"""
        return _chain(self.parents, self.committed)

    def _run(self, device_ids, host, start, layout, last, skip, carry) -> Forward:
        n = len(host)
        pad = self.shapes.pad(n) - n
        end = start + n
        gather, self._gather = self._gather, None
        moved = gather[0] if gather else []
        carried = None
        if layout is None and not moved and not carry and (device_ids is not None or not self.compile):
            ids = device_ids if device_ids is not None else torch.tensor(host, dtype=torch.long, device=self.device)
            batch = chain(ids, start, pad, self.capacity, eager=not self.compile)
        else:
            # (eager) the scratch rows' ancestry starts past the rows being committed
            scratch = None if self.compile else self.committed + n - len(layout or ())
            batch, extra = packed(self._rows(host, start, pad, layout), device_ids, moved + carry, self.device,
                                  scratch)
            if not self.compile and not pad:  # (`_rows`: each row writes start + its index)
                batch.writes = start
            if moved:
                self._move(extra[: len(moved)], gather[1])
            if carry:
                carried = extra[len(moved):]
        span = self.shapes.attended(end, self.capacity)
        plain = (not self.compile and n == 1 and pad == 0 and span == end and not self.windowed
                 and layout is None)
        heads = None if self.shapes.fixed else last  # (one shape: the head takes every row)
        self.hidden = None
        if self.compile:
            logits = self._compiled(skip)(batch)
        elif self.lockstep is not None:  # with other sequences' rows, in one forward
            logits = self.lockstep.run(self, batch, skip, span, plain, heads, reading=self._reading)
        else:
            logits = self._step(batch, skip, span, plain, heads)
        logits = logits[-last:].float()
        if self.hidden is not None:
            self.hidden = self.hidden[-last:]
        if logits.shape[-1] < self.vocab_size:
            logits = F.pad(logits, (0, self.vocab_size - logits.shape[-1]), value=float("-inf"))
        elif logits.shape[-1] > self.vocab_size:
            logits = logits[:, : self.vocab_size]
        positions = batch.positions[-last:]
        return Forward(logits, positions + self.base if self.base else positions, carried)

    def _rows(self, host, start, pad, layout):
        """(id, position, slot, limit, ancestry) per row, padding first, as the host knows them (an id the
        device holds is 0 here, replaced there)."""
        rows = [(0, 0, self.capacity + j, 1, 0) for j in range(pad)]
        commit = len(host) - (len(layout) if layout is not None else 0)
        for i in range(commit if layout is not None else len(host)):  # each sees everything before it
            rows.append((host[i] or 0, start + i, start + i, start + i + 1, 0))
        if layout is not None:
            prefix = self.committed + commit  # scratch rows see the prefix and their ancestors
            for i, (parent, depth, bits) in enumerate(layout):
                rows.append((host[commit + i] or 0, prefix - 1 + depth, start + commit + i, prefix, bits))
        return rows

    def _move(self, sources: torch.Tensor, first: int) -> None:
        """Gather a kept path's entries to slots first.. (before this forward writes anything)."""
        end = first + sources.shape[0]
        if self._stacked is not None:
            for cache in self._stacked:
                cache[:, :, :, first:end] = cache[:, :, :, sources]
        else:
            for keys, values in zip(self.keys, self.values):
                if keys is not None:
                    moved = sources.to(keys.device)  # (a no-op unless the layer is on another GPU)
                    keys[:, :, first:end] = keys[:, :, moved]
                    values[:, :, first:end] = values[:, :, moved]
        if self.windowed:
            self.slot_positions[first:end] = self.slot_positions[sources]

    def _flush(self) -> None:
        """Move a kept path's entries now (one upload), where no forward comes to carry them."""
        if self._gather is not None:
            sources, first = self._gather
            self._gather = None
            try:
                self._move(torch.tensor(sources, device=self.device), first)
            except torch.cuda.OutOfMemoryError:
                self.reset()
                raise out_of_memory(self.device, f"keeping the {self.model.config.model_type} model's accepted "
                                                 f"tokens") from None

    def _store(self, where: slice | torch.Tensor, span: int, layer: int, keys: torch.Tensor, values: torch.Tensor):
        """Write a layer's new entries to slots `where`; return its keys and values up to `span`."""
        if self.keys[layer] is None:
            slots = self.capacity + self.reserve
            try:
                self.keys[layer] = zeroed((*keys.shape[:2], slots, keys.shape[-1]), keys.dtype, keys.device)
                self.values[layer] = zeroed((*values.shape[:2], slots, values.shape[-1]), values.dtype, values.device)
            except torch.cuda.OutOfMemoryError:
                raise out_of_memory(self.device, f"for the {self.model.config.model_type} model's "
                                                 f"{self.capacity}-token cache") from None
        cache = self.keys[layer]
        if cache.shape[:2] != keys.shape[:2] or cache.shape[-1] != keys.shape[-1]:
            raise SpecError(f"layer {layer} of this {self.model.config.model_type} model changed the shape of its "
                            f"keys ({tuple(cache.shape)} cached, {tuple(keys.shape)} now)")
        if isinstance(where, slice):
            cache[:, :, where] = keys
            self.values[layer][:, :, where] = values
        else:
            where = where.to(cache.device)  # (a no-op unless the layer is on another GPU)
            cache.index_copy_(2, where, keys)
            self.values[layer].index_copy_(2, where, values)
        return cache[:, :, :span], self.values[layer][:, :, :span]

    def _step(self, batch: Batch, skip: Skip, span: int, plain: bool = False, last: int | None = None) -> torch.Tensor:
        """Logits of every row of `batch`, attending `span` slots (eagerly, of the `last` rows only: the head is
        a large share of a small model's forward): the whole forward, the function a compiled step traces."""
        where, masks = self.prepare(batch, span, plain)
        store = functools.partial(self._store, where, span)
        ids, positions = batch.ids[None], batch.positions[None]
        if self.lean:
            x = backends.lean_forward(self.lean, store, ids, positions, masks, self.windows, skip,
                                      cache=(self.keys, self.values, where, span, self._stacked))
            x = x if last is None else x[:, -last:]
            if not self.keeps_hidden:
                return self.lean.logits(x)[0]
            self.hidden = self.lean.normed(x)[0]
            return self.lean.head(self.hidden[None])[0]
        return self._run_model(ids, positions, masks, skip, last, store, span)

    def part(self, batch: Batch, span: int, plain: bool, last: int | None) -> backends.Part:
        """This sequence's rows as a grouped forward takes them (`exec.lockstep`)."""
        where, masks = self.prepare(batch, span, plain)
        cache = (self.keys, self.values, where, span) if self._stacked is not None else None
        return backends.Part(batch.ids[None], batch.positions[None], functools.partial(self._store, where, span),
                             masks, last, cache)

    def prepare(self, batch: Batch, span: int, plain: bool = False):
        """What a forward of `batch` needs of this sequence: where its rows' entries go (a slice of slots, or
        the slots) and the masks by attention window (additive for the lean loop)."""
        first = batch.first if batch.first is not None else batch.writes
        if first is not None:  # eager, consecutive slots: written by slicing
            slots = slice(first, first + len(batch))
            if self.windowed:
                self.slot_positions[slots] = batch.positions
        else:
            slots = batch.slots
            if self.windowed:
                self.slot_positions.index_copy_(0, batch.slots, batch.positions)
        if plain:
            masks = {None: None}
        else:
            masks = {w: m[None, None] for w, m in allowed(batch, span, self.slot_positions, self.windows,
                                                            self._cols).items()}
        if self.lean and self.device.type in ("cpu", "cuda"):  # (made once a forward, not by each layer's SDPA)
            masks = {w: backends.additive(m, self.dtype) for w, m in masks.items()}
        return slots, masks

    def _run_model(self, ids, positions, masks, skip, last, store, span):
        driver = self.driver
        if self._attends:  # (spec's attention: attended where 0, not where -inf)
            additive = {w: backends.additive(m, self.dtype) for w, m in masks.items()}
        else:
            low = torch.finfo(self.dtype).min  # the model's own attention may be eager: additive masks
            additive = {w: None if m is None else torch.zeros(m.shape, dtype=self.dtype, device=self.device)
                        .masked_fill(~m, low) for w, m in masks.items()}
        driver.masks, driver.skip, driver.active = additive, skip, True
        config = self.model.config
        implementation = config._attn_implementation
        if self._attends:
            config._attn_implementation = self._attends
        top = additive[None]
        if top is None:
            top = torch.zeros(1, 1, ids.shape[1], span, dtype=self.dtype, device=self.device)
        try:
            kwargs = dict(input_ids=ids, position_ids=positions, attention_mask=top, use_cache=True)
            kwargs[self._cache_keyword] = backends.CacheView(store, 0 if self.compile else self.length)
            if last is not None and driver.keeps_logits:
                kwargs["logits_to_keep"] = last
            logits = self.model(**kwargs).logits[0]
        finally:
            driver.active = False
            config._attn_implementation = implementation
        unmasked = [i for i in range(self.layers) if i not in driver.masked and i not in skip.attention]
        if unmasked:
            raise SpecError(f"layer {unmasked[0]} of this {self.model.config.model_type} model takes no "
                            f"attention_mask keyword, so spec cannot give it a tree mask")
        return logits

    def _compiled(self, skip: Skip):
        """This skip set's step, compiled with `torch.compile(fullgraph=True, dynamic=False)`: one graph per
        token bucket (on CUDA, then captured as a CUDA graph). A failure to compile is one line, and
        the runner goes on eagerly with the same static shapes."""
        step = self._steps.get(skip)
        if step is None:
            process.compiling()
            backend = self.compile if isinstance(self.compile, str) or callable(self.compile) else "inductor"
            if backend == "cudagraphs" and self.graphs is not None:  # graphs without inductor's kernels:
                backend = "eager"  # traced (no host reads left in the step), then captured

            def run(ids, positions, slots, limits, ancestry):  # static shapes: the whole capacity attended
                return self._step(Batch(ids, positions, slots, limits, ancestry), skip, self.capacity)

            step = self._steps[skip] = torch.compile(run, fullgraph=True, dynamic=False, backend=backend)

        def call(batch: Batch) -> torch.Tensor:
            self.compiled_keys.add((skip, len(batch)))
            inputs = (batch.ids, batch.positions, batch.slots, batch.limits, batch.ancestry)
            try:
                if self.graphs is not None:
                    return self.graphs.step((skip, len(batch)), step, inputs)
                return step(*inputs)
            except Exception as e:  # noqa: BLE001 - any compiler failure: say so once, run eagerly
                if isinstance(e, (SpecError, torch.cuda.OutOfMemoryError, KeyboardInterrupt)):
                    raise
                print(f"spec: compiling the {self.model.config.model_type} model's step failed "
                      f"({described(e)}); running it eagerly",
                      file=sys.stderr)
                self.compile = False
                return self._step(batch, skip, self.capacity)

        return call

    @torch.inference_mode()
    def keep(self, path: list[int]) -> None:
        """Commit the scratch slots in `path` (a chain starting below the prefix), drop all other scratch."""
        path = list(path)
        for k, slot in enumerate(path):
            j = slot - self.committed
            if not 0 <= j < len(self.parents) or self.parents[j] != (path[k - 1] if k else -1):
                raise ValueError(f"keep: slot {slot} does not continue the path from the prefix")
        if path and path != list(range(self.committed, self.committed + len(path))):
            self._flush()  # an earlier kept path moves first
            self._gather = (path, self.committed)
        self.tokens.extend(self.scratch[s - self.committed] for s in path)
        self.committed += len(path)
        self._drop_scratch()

    def _drop_scratch(self) -> None:
        self.scratch, self.parents, self.depths, self.ancestry = [], [], [], []
