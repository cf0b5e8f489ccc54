"""Guesses from the oracle's own state, for a model alone: small heads fitted on what the oracle read.

After each step the oracle's head has read a state h (the last layer's output, normed) at the row that chose the
pending token x. Head 1 takes (h, x) and guesses the token after x; a head 2 (fitted only when asked: `DEPTH`)
takes (h, x, its guess) and guesses the one after that (Hydra's sequential heads, Ankner et al. 2024; EAGLE's
inputs without its layer, Li et al. 2024):
    z = h + down(silu(up([h; norm(e(x)); ...]))),   scored by the oracle's own head rows for the `words` it guesses.
They are fitted once per oracle (`spec tune`) on the oracle's own reads of a corpus (Python's standard library
unless told otherwise), its argmax at each position as the target (self-distillation: the corpus need not be text
the oracle writes), and kept in the cache. Their guesses are deterministic, verified like the lookup's, so they
change no output: only how many tokens a forward verifies (benchmarks/reports: the 1.5B coder alone).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from spec_cli.core.paths import cache_dir
from spec_cli.core.settings import ModelRef
from spec_cli.draft2.trigrams import model_key
from spec_cli.exec import backends, packing

WORDS = 2048  # the targets' most frequent words a head guesses among (its scores: that many of the head's rows)
INNER = 512  # a head's inner width
TOKENS = int(os.environ.get("SPEC_HEADS_TOKENS", 81_920))  # the corpus's tokens the oracle reads to fit them
PIECE = 512  # ... in pieces of this many
EPOCHS = 4
BATCH = 512
TOP = 4  # head 1's likeliest tokens offered
DEPTH = 1  # heads fitted: head 2 (one token further, under head 1's first guess) verified as many tokens a forward
# without it as with it, and cost ~0.6 ms a step more (the 1.5B coder on a Xeon, 16 code prompts: 1.62x its
# baseline with head 1 alone against 1.54x, benchmarks/reports)
BELOW = 1  # where a file holds head 2: its guesses under that many of head 1's (its two likeliest under each)
VERSION = 1


def folder() -> Path:
    return cache_dir() / "heads"


def path_for(ref: ModelRef) -> Path:
    """Where the heads fitted on the oracle `ref` are kept."""
    return folder() / f"{model_key(ref, f'heads-v{VERSION}')}.pt"


class Head(torch.nn.Module):
    """One head: the state h and the `depth` tokens after it (embedded) -> a state the oracle's head rows
    score, for the token after those."""

    def __init__(self, depth: int, width: int, inner: int = INNER):
        super().__init__()
        self.norms = torch.nn.ModuleList(torch.nn.RMSNorm(width) for _ in range(depth))
        self.up = torch.nn.Linear(width * (1 + depth), inner)
        self.down = torch.nn.Linear(inner, width)
        torch.nn.init.zeros_(self.down.weight)  # (it starts as the oracle's own head on h)
        torch.nn.init.zeros_(self.down.bias)
        self.products = None  # (up, down) as packed products, once fitted (`Heads`)

    def forward(self, h: torch.Tensor, embedded: list[torch.Tensor]) -> torch.Tensor:
        parts = [h] + [norm(e) for norm, e in zip(self.norms, embedded)]
        up, down = self.products or (self.up, self.down)
        return h + down(F.silu(up(torch.cat(parts, -1))))


@dataclass
class Guess:
    token: int
    p: float  # head 1's probability of it (among its words)
    below: list[tuple[int, float]]  # head 2's guesses after it, with their probabilities


def fits(model: torch.nn.Module) -> bool:
    """Whether heads run on `model`: spec's own layer loop runs it (keeping what its head reads) and its head can be
    cut to their words."""
    return backends.lean_kind(model) is not None and head_rows(model, torch.arange(2)) is not None


def head_rows(model: torch.nn.Module, words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(W [width, words], b [words]) in float32: the oracle's own head for `words`, at its own values (a quantized
    head's rows, read back through its product), so that the heads' scores are the oracle's on their state; None
    where the head cannot be cut (`backends.rows_of_head`)."""
    product = backends.rows_of_head(model.get_output_embeddings(), words)
    if product is None:
        return None
    width = model.get_output_embeddings().in_features
    weight = next(model.parameters())
    dtype, device = weight.dtype, weight.device
    with torch.inference_mode():
        bias = product(torch.zeros(1, width, dtype=dtype, device=device)).float()[0]
        rows = product(torch.eye(width, dtype=dtype, device=device)).float() - bias
    return rows.cpu(), bias.cpu()


class Heads:
    """Fitted heads bound to their oracle: its embedding, and its head's rows for the heads' words as the product
    its own forward runs (a quantized head's kernel: ~30 us for 2,048 words of the 1.5B's, against ~300 in
    bfloat16)."""

    def __init__(self, saved: dict, model: torch.nn.Module):
        weight = next(model.parameters())
        self.dtype, device = weight.dtype, weight.device
        self.words = saved["words"].to(torch.long).to(device)
        pack = packing.chooser(device, self.dtype, None)
        self.score = backends.rows_of_head(model.get_output_embeddings(), self.words, pack)
        if self.score is None:
            raise ValueError("the oracle's head cannot be cut to the heads' words")
        width = model.get_output_embeddings().in_features
        self.heads = []
        for depth, state in enumerate(saved["heads"], 1):
            head = Head(depth, width, saved["inner"])
            head.load_state_dict(state)
            head = head.to(device=device, dtype=self.dtype).eval()
            head.products = (backends.projection(head.up, pack=pack), backends.projection(head.down, pack=pack))
            self.heads.append(head)
        self.embed = model.get_input_embeddings()
        self.key = ""  # which fit they are (`bound`)

    def first(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Head 1's scores over its words from states `h` and the embedded tokens `x` they chose [rows, words]."""
        return self.score(self.heads[0](h, [x]))

    @torch.inference_mode()
    def guesses(self, hidden: torch.Tensor, token: int, top: int = TOP, below: int = BELOW) -> list[Guess]:
        """Head 1's `top` likeliest tokens after `token` (the oracle read `hidden` when it chose it), and under
        the first `below` of them head 2's two likeliest: one read from the device."""
        h = hidden.to(self.dtype)[None]
        x = self.embed(torch.tensor([token], device=h.device)).to(self.dtype)
        p1, w1 = torch.softmax(self.first(h, x).float(), -1)[0].topk(top)
        under = min(below, top, len(self.heads) - 1)
        parts = [self.words[w1].float(), p1]
        if under > 0:
            firsts = self.embed(self.words[w1[:under]]).to(self.dtype)
            z = self.heads[1](h.expand(under, -1), [x.expand(under, -1), firsts])
            p2, w2 = torch.softmax(self.score(z).float(), -1).topk(2, -1)
            parts += [self.words[w2].flatten().float(), p2.flatten()]
        read = torch.cat(parts).tolist()  # (word ids are exact in float32)
        firsts, probs, seconds, second_probs = read[:top], read[top:2 * top], read[2 * top:2 * top + 2 * under], \
            read[2 * top + 2 * under:]
        return [Guess(int(t), p, [(int(seconds[2 * k + j]), second_probs[2 * k + j]) for j in range(2)]
                      if k < under else []) for k, (t, p) in enumerate(zip(firsts, probs))]


def load(ref: ModelRef, model: torch.nn.Module) -> Heads | None:
    """The heads fitted on the oracle `ref` (`model`, loaded), if there are any and they fit it."""
    path = path_for(ref)
    if not path.is_file():
        return None
    try:
        return bound(torch.load(path, weights_only=True), model, path)
    except Exception:  # (a file of another build, or an oracle whose head cannot be cut: no heads)
        return None


def bound(saved: dict, model: torch.nn.Module, path: Path) -> Heads:
    """Heads as `fit` saved them (to `path`), bound to `model`."""
    heads = Heads(saved, model)
    heads.key = f"{path.stem}-{int(saved.get('made', 0))}"  # (a refit is new heads to the controllers)
    return heads


# --- fitting -----------------------------------------------------------------------------------------------

@dataclass
class Reads:
    """The oracle's reads of a corpus: each piece's tokens, the state its head read at each, and its argmax."""

    hidden: torch.Tensor  # [pieces, PIECE, width]
    tokens: torch.Tensor  # [pieces, PIECE]
    targets: torch.Tensor  # [pieces, PIECE]: the argmax at each position (the token after it, as the oracle says)
    interrupted: bool = False  # Ctrl-C stopped the reading

    def split(self, tokens: int) -> tuple["Reads", "Reads | None"]:
        """(the rest, the last pieces holding `tokens`): a held-out part, where there are pieces enough."""
        held = -(-tokens // self.tokens.shape[1])
        if held >= self.tokens.shape[0]:
            return self, None
        cut = self.tokens.shape[0] - held
        return (Reads(self.hidden[:cut], self.tokens[:cut], self.targets[:cut]),
                Reads(self.hidden[cut:], self.tokens[cut:], self.targets[cut:]))


def read(runner, texts: Iterable[str], tokenizer, tokens: int = TOKENS,
         progress: Callable[[int, int], None] | None = None) -> Reads:
    """The oracle (`runner`, an eager lean loop) reading `texts` (joined by its end token) in pieces of PIECE
    (or its capacity), `tokens` in all; Ctrl-C keeps the pieces read (none read: it stops)."""
    end = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    size = min(PIECE, runner.capacity)
    hidden, ids, targets, pending = [], [], [], []
    interrupted = False
    texts = iter(texts)
    runner.keeps_hidden = True
    try:
        while len(ids) * size < tokens:
            while len(pending) < size:
                text = next(texts, None)
                if text is None:
                    break
                pending += tokenizer(text, add_special_tokens=False)["input_ids"] + [end]
            if len(pending) < size:
                break
            piece, pending = pending[:size], pending[size:]
            runner.reset()
            logits = runner.forward(piece, commit=size, last=size).logits
            targets.append(logits.argmax(-1).cpu())
            hidden.append(runner.hidden.to(torch.bfloat16).cpu())
            ids.append(torch.tensor(piece))
            if progress is not None:
                progress(min(len(ids) * size, tokens), tokens)
    except KeyboardInterrupt:
        if not ids:
            raise
        interrupted = True
    finally:
        runner.keeps_hidden = False
        runner.reset()
    if not ids:
        raise ValueError(f"the corpus holds fewer than {size} tokens")
    return Reads(torch.stack(hidden), torch.stack(ids), torch.stack(targets), interrupted)


def corpus_texts(files: list[Path], seed: int = 0) -> Iterable[str]:
    """The files' text in a fixed shuffled order (a corpus read in part is then a sample of all of it)."""
    order = list(files)
    random.Random(seed).shuffle(order)
    for path in order:
        yield path.read_text(errors="replace")


def fit(reads: Reads, model: torch.nn.Module, words: int = WORDS, inner: int = INNER, depth: int = DEPTH,
        epochs: int = EPOCHS, seed: int = 0, progress: Callable[[int, int], None] | None = None) -> dict:
    """Heads 1..`depth` fitted on `reads` (of `model`): what `Heads` loads. Head k learns the target at position
    i + k from the state at i and the k tokens after i; the oracle's head rows score them, frozen."""
    with torch.inference_mode(False), torch.enable_grad():  # (a process that decodes has gradients off)
        return _fit(reads, model, words, inner, depth, epochs, seed, progress)


def _fit(reads, model, words, inner, depth, epochs, seed, progress) -> dict:
    torch.manual_seed(seed)
    pieces, length = reads.tokens.shape
    counts = torch.bincount(reads.targets.flatten())
    chosen = torch.argsort(counts, descending=True)[: min(words, int((counts > 0).sum()))]
    slot = torch.full((max(len(counts), int(reads.tokens.max()) + 1),), -1, dtype=torch.long)
    slot[chosen] = torch.arange(len(chosen))
    rows = head_rows(model, chosen)
    if rows is None:
        raise ValueError("the oracle's head cannot be cut to a part of its words")
    weight, bias = (t.clone() for t in rows)  # (made in inference mode: clones autograd may save; fitted on the CPU)
    embed = model.get_input_embeddings()
    width = reads.hidden.shape[-1]
    with torch.inference_mode():
        device = next(model.parameters()).device
        embedded = embed(reads.tokens.flatten().to(device)).float().cpu().view(pieces, length, width)
    embedded, hidden = embedded.clone(), reads.hidden.float().clone()
    fitted = []
    steps_all = depth * epochs * max(1, pieces * length // BATCH)
    done = 0
    for k in range(1, depth + 1):
        h = hidden[:, : length - k].reshape(-1, width)
        xs = [embedded[:, 1 + j: length - k + 1 + j].reshape(-1, width) for j in range(k)]
        ys = slot[reads.targets[:, k:].reshape(-1)]
        keep = ys >= 0
        h, xs, ys = h[keep], [x[keep] for x in xs], ys[keep]
        head = Head(k, width, inner)
        optimiser = torch.optim.AdamW(head.parameters(), lr=1e-3, weight_decay=0.0)
        steps = max(1, len(ys) // BATCH)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, 1e-3, total_steps=max(1, epochs * steps),
                                                       pct_start=0.05)
        for _ in range(epochs):
            order = torch.randperm(len(ys))
            for s in range(steps):
                batch = order[s * BATCH: (s + 1) * BATCH]
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    z = head(h[batch], [x[batch] for x in xs])
                    loss = F.cross_entropy((z @ weight + bias).float(), ys[batch])
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
                schedule.step()
                done += 1
                if progress is not None and done % 16 == 0:
                    progress(min(done, steps_all), steps_all)
        fitted.append({name: value.detach().clone() for name, value in head.state_dict().items()})
    return {"version": VERSION, "words": chosen, "inner": inner, "heads": fitted, "tokens": pieces * length,
            "made": time.time()}


@torch.inference_mode()
def agreement(heads: Heads, reads: Reads) -> float:
    """How often head 1's first guess is the oracle's own next token on `reads` (a held-out check of a fit)."""
    width = reads.hidden.shape[-1]
    device = heads.words.device
    h = reads.hidden[:, :-1].reshape(-1, width).to(device, heads.dtype)
    x = heads.embed(reads.tokens[:, 1:].reshape(-1).to(device)).to(heads.dtype)
    guessed = heads.words[heads.first(h, x).argmax(-1)]
    return (guessed.cpu() == reads.targets[:, 1:].reshape(-1)).float().mean().item()
