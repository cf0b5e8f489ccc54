"""Staged speculative decoding (Spector & Re 2023): a tree of draft candidates, verified in one oracle pass,
with an optional second stage (draft2) that speculates for the draft.

Each oracle step:
1. The draft grows a tree under the last committed token. Every node the draft has run ("expanded") offers
   `tree_branching` children: its top tokens when greedy, tokens drawn from its distribution without
   replacement when sampling. Nodes are scored by cumulative draft log-probability (EAGLE-2). Each
   draft forward expands the best-scoring unexpanded candidates that could still make the final tree,
   batched with the tree mask; with a draft2, each expanded node also carries a draft2 chain below it in the
   same forward, and every chain token that turns out to be one of the draft's own children is expanded for
   free (the draft checked draft2's guesses, so deep levels cost no extra draft forward).
2. The best `tree_budget` candidates (ancestor-closed; whole sibling groups when sampling) go to the oracle
   in one forward.
3. Walking down from the root, the oracle accepts a child or supplies its own token: greedy follows its
   argmax; sampling tests the children in draw order with Sequoia's rule (accept x with probability
   min(1, p(x)/q(x)); on rejection p <- norm(max(0, p - q)) and x leaves q), so the output is exactly a
   sample of p.
4. Both caches keep the accepted path's entries (gathered) and drop the rest.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from spec_cli.decoding import Models, Output, pending, sampling
from spec_cli.events import ACCEPTED, BONUS, CORRECTED, REJECTED, Event, Token, Verified
from spec_cli.profiles import Decoding
from spec_cli.sampling import Sampler, sample, verify_candidates

ROOT = -1


@dataclass
class Node:
    token: int
    parent: int  # index of the parent node, ROOT for the last committed token
    depth: int
    score: float  # cumulative draft log-probability
    stage: str = "draft"
    slot: int | None = None  # the draft cache slot, once the draft has run this node
    children: list[int] = field(default_factory=list)


@dataclass
class Tree:
    sampled: bool = False  # children drawn from q without replacement (else: the draft's top tokens)
    nodes: list[Node] = field(default_factory=list)
    root_children: list[int] = field(default_factory=list)
    index: dict[tuple[int, int], int] = field(default_factory=dict)  # (parent, token) -> node
    q: dict[int, torch.Tensor] = field(default_factory=dict)  # node -> the draft distribution its children came from

    def add(self, token: int, parent: int, score: float) -> int:
        depth = 1 if parent == ROOT else self.nodes[parent].depth + 1
        self.nodes.append(Node(token, parent, depth, score))
        i = len(self.nodes) - 1
        (self.root_children if parent == ROOT else self.nodes[parent].children).append(i)
        self.index[(parent, token)] = i
        return i

    def children(self, node: int) -> list[int]:
        return self.root_children if node == ROOT else self.nodes[node].children

    def path(self, node: int) -> list[int]:
        out = []
        while node != ROOT:
            out.append(node)
            node = self.nodes[node].parent
        return out[::-1]

    def best(self, budget: int) -> list[int]:
        """The `budget` best nodes by score, ancestor-closed (a child never outscores its parent), in creation
        order so that parents come before children.

        Sampled children must be verified as the whole group that was drawn (a subset picked by the drawn
        values would bias Sequoia's rule), so then whole sibling groups are taken, best parent first."""
        if not self.sampled:
            order = sorted(range(len(self.nodes)), key=lambda i: (-self.nodes[i].score, self.nodes[i].depth, i))
            return sorted(order[:budget])
        parents = sorted({ROOT} | {n.parent for n in self.nodes},
                         key=lambda i: (0.0, 0) if i == ROOT else (-self.nodes[i].score, self.nodes[i].depth))
        chosen: set[int] = set()
        for parent in parents:
            group = self.children(parent)
            if (parent == ROOT or parent in chosen) and len(chosen) + len(group) <= budget:
                chosen.update(group)
        return sorted(chosen)


def _expand(tree: Tree, node: int, logprobs: torch.Tensor, branching: int, max_depth: int,
            generator: torch.Generator | None = None) -> None:
    """Offer children after `node`: the draft's top `branching` tokens, or (sampling) that many drawn from
    the draft's distribution without replacement, in draw order."""
    depth = 0 if node == ROOT else tree.nodes[node].depth
    if depth >= max_depth:
        return
    base = 0.0 if node == ROOT else tree.nodes[node].score
    if tree.sampled:
        probs = logprobs.exp()
        count = min(branching, int((probs > 0).sum()))
        tokens = torch.multinomial(probs, count, replacement=False, generator=generator).tolist()
        tree.q[node] = probs
        for token in tokens:
            tree.add(token, node, base + float(logprobs[token]))
        return
    values, tokens = torch.topk(logprobs, branching)
    for value, token in zip(values.tolist(), tokens.tolist()):
        if value > -math.inf and (node, token) not in tree.index:
            tree.add(token, node, base + value)


def grow_tree(models: Models, out: Output, settings: Decoding, sampler: Sampler, budget: int, max_depth: int,
              generator: torch.Generator | None = None):
    """The draft's tree for this step, and a Verified event counting its forwards and draft2's guesses."""
    draft, draft2 = models.draft, models.draft2
    tail = pending(draft, out.sequence)
    logits = draft.forward(tail, commit=len(tail), last=1)[-1]
    forwards, proposed2, accepted2 = 1, 0, 0
    tree = Tree(sampled=not sampler.greedy)
    _expand(tree, ROOT, _logprobs(logits, sampler), settings.tree_branching, max_depth, generator)
    while forwards < max_depth:  # like EAGLE-2, about one draft forward per level; draft2 chains reach deeper
        chosen = tree.best(budget)
        todo = [i for i in chosen if tree.nodes[i].slot is None and tree.nodes[i].depth < max_depth]
        todo = todo[: settings.tree_width]
        if not todo or draft.room() < len(todo):
            break
        tokens, parents, owners, chains = [], [], [], []
        start = draft.length
        for i in todo:
            node = tree.nodes[i]
            parent_slot = ROOT if node.parent == ROOT else tree.nodes[node.parent].slot
            tokens.append(node.token)
            parents.append(parent_slot)
            owners.append(i)
            node.slot = start + len(tokens) - 1
        if draft2 is not None:
            for i in todo:
                context = out.sequence + [tree.nodes[j].token for j in tree.path(i)]
                room = min(settings.draft2_tokens, max_depth - tree.nodes[i].depth - 1,
                           draft.room() - len(tokens))
                chain = draft2.propose(context, room) if room > 0 else []
                parent_slot = tree.nodes[i].slot
                for token in chain:
                    tokens.append(token)
                    parents.append(parent_slot)
                    parent_slot = start + len(tokens) - 1
                chains.append((i, chain, len(tokens) - len(chain)))
        rows = _logprobs(draft.forward(tokens, parents=parents), sampler)
        forwards += 1
        for row, i in enumerate(owners):
            _expand(tree, i, rows[row], settings.tree_branching, max_depth, generator)
        for i, chain, first in chains:  # draft2's guesses that the draft itself offers become expanded nodes
            proposed2 += len(chain)
            node = i
            for offset, token in enumerate(chain):
                child = tree.index.get((node, token))
                if child is None:
                    break
                accepted2 += 1
                tree.nodes[child].stage = "draft2"
                if tree.nodes[child].slot is None:
                    tree.nodes[child].slot = start + first + offset
                    _expand(tree, child, rows[first + offset], settings.tree_branching, max_depth, generator)
                node = child
    return tree, Verified("draft", forwards, proposed2, accepted2)


def _logprobs(logits: torch.Tensor, sampler: Sampler) -> torch.Tensor:
    if sampler.greedy:
        return torch.log_softmax(logits, -1)
    return torch.log(sampler.probs(logits))


def staged(models: Models, out: Output, settings: Decoding) -> Iterator[Event]:
    oracle, draft = models.oracle, models.draft
    sampler, generator = sampling(settings, models.oracle.device)
    while not out.reason:
        tail = pending(oracle, out.sequence)
        if len(tail) > oracle.room():
            return
        budget = min(settings.tree_budget, oracle.room() - len(tail),
                     draft.room() - len(pending(draft, out.sequence)))
        max_depth = min(settings.tree_depth, out.remaining - 1)
        if budget > 0 and max_depth > 0:
            tree, drafting = grow_tree(models, out, settings, sampler, budget, max_depth, generator)
            yield drafting
            chosen = tree.best(budget)
        else:
            tree, chosen = Tree(), []
        position = {node: k for k, node in enumerate(chosen)}
        start = oracle.length + len(tail)
        parents = [ROOT if tree.nodes[i].parent == ROOT else start + position[tree.nodes[i].parent] for i in chosen]
        logits = oracle.forward(tail + [tree.nodes[i].token for i in chosen], commit=len(tail),
                                parents=parents, last=len(chosen) + 1)
        path, rejected, final = _walk(tree, chosen, logits, sampler, generator)
        yield Verified("oracle", 1, len(chosen), len(path))

        oracle.keep([start + position[i] for i in path])
        draft_path = []
        for i in path:
            if tree.nodes[i].slot is None:
                break
            draft_path.append(tree.nodes[i].slot)
        draft.keep(draft_path)
        events = [Token(tree.nodes[i].token, ACCEPTED, tree.nodes[i].stage) for i in path]
        events += [Token(tree.nodes[i].token, REJECTED, tree.nodes[i].stage) for i in rejected]
        events.append(Token(final, CORRECTED if rejected else BONUS, "oracle"))
        yield from out.emit(events)


def _walk(tree: Tree, chosen: list[int], logits: torch.Tensor, sampler: Sampler, generator):
    """Follow the oracle down the tree: (accepted path, rejected candidates at the end, the oracle's token)."""
    row = {node: k + 1 for k, node in enumerate(chosen)}
    row[ROOT] = 0
    in_tree = set(chosen)
    targets = logits.argmax(-1).tolist() if sampler.greedy else None
    path, node = [], ROOT
    while True:
        children = [c for c in tree.children(node) if c in in_tree]
        if sampler.greedy:
            target = targets[row[node]]
            match = next((c for c in children if tree.nodes[c].token == target), None)
            if match is None:
                return path, children, target
        else:
            p = sampler.probs(logits[row[node]])
            index, residual = verify_candidates(p, [tree.nodes[c].token for c in children],
                                                "without_replacement", generator, tree.q.get(node))
            if index is None:
                return path, children, sample(residual, generator)
            match = children[index]
        path.append(match)
        node = match
