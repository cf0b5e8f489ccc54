"""What several test modules use: `spec` run in this process and its one-line errors, and tiny models with
exact output distributions to hold the decoding methods to."""

import contextlib
import copy
import io
import itertools
import os
import random
import sys
import time
from collections import Counter
from types import SimpleNamespace
from unittest import mock

import torch

from spec_cli.cli import main
from spec_cli.core.events import Token
from spec_cli.core.settings import Decoding
from spec_cli.decoding.methods import decode

# --- the command line ------------------------------------------------------------------------------------

ENV = {"NO_COLOR": "1", "HF_HUB_OFFLINE": "1"}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def spec(*args, stdin=None, env=None, tty=False):
    """Run `spec` in this process (fast): exit code, stdout and stderr as a subprocess would give them.
    stdin is a pipe holding `stdin`, or (`tty`) a terminal nobody types into."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with mock.patch.dict(os.environ, {**ENV, **(env or {})}), mock.patch.object(sys, "argv", ["spec", *args]), \
            mock.patch.object(sys, "stdin", Terminal() if tty else io.StringIO(stdin or "")), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def assert_clean_error(result, pattern):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert pattern in lines[0], lines[0]


# --- decoding on tiny models -----------------------------------------------------------------------------

def run(models, prompt, **settings):
    """The output tokens and every event of decoding `prompt` with these settings."""
    events = list(decode(models, prompt, Decoding(**settings)))
    return [e.token for e in events if isinstance(e, Token) and e.output], events


def prompts(n, seed=0, vocab=300):
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(1, 20))] for _ in range(n)]


VOCAB = 5


def tiny_vocab_model(seed, layers, std=0.5):
    """A GPT-2 over VOCAB tokens, peaked enough (at the default std) that its distributions differ from a sibling's."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=layers, n_head=2)
    m = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
    return m


def noisy_copy(model, noise, seed):
    torch.manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * noise * (p.std() if p.numel() > 1 else 0))
    return draft


def exact_distribution(model, prompt, length, sampler):
    """P(first `length` tokens) under the oracle alone, by enumeration."""
    out = {}
    for seq in itertools.product(range(VOCAB), repeat=length):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(seq)])).logits[0, len(prompt) - 1 : -1].float()
        probs = sampler.probs(logits)
        out[seq] = float(torch.prod(probs[torch.arange(length), torch.tensor(seq)]))
    return out


def sampled(models, prompt, length, trials, **settings):
    """Completions of seeds 0..trials-1, by the speculative-sampling rules unless `sampling` says otherwise."""
    settings.setdefault("sampling", "rejection")
    counts = Counter()
    for seed in range(trials):
        tokens, _ = run(models, prompt, max_new_tokens=length, seed=seed, **settings)
        counts[tuple(tokens)] += 1
    return counts


def teacher_forced(models, oracle, sampler, tokens: int, **settings):
    """Completions of up to 500 tokens from two-token prompts, seed by seed, on one thread, until `tokens` are
    drawn; each token with the oracle's distribution given the text before it (one teacher-forced forward).
    Returns the tokens, those distributions, and each completion's events."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        drawn, ps, events, seed = [], [], [], 0
        while sum(len(t) for t in drawn) < tokens:
            prompt = [seed % 5, (seed // 5) % 5]
            got, completion = run(models, prompt, max_new_tokens=500, seed=seed, **settings)
            with torch.no_grad():
                logits = oracle(torch.tensor([prompt + got])).logits[0, len(prompt) - 1 : -1].double()
            drawn.append(torch.tensor(got))
            ps.append(sampler.probs(logits))
            events.append(completion)
            seed += 1
    finally:
        torch.set_num_threads(threads)
    return torch.cat(drawn), torch.cat(ps), events


def long_context_pair():
    """A GPT-2 oracle over 5 tokens, far from peaked, with 512 positions, and a noisy copy as its draft."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(11)
    oracle = GPT2LMHeadModel(GPT2Config(vocab_size=5, n_positions=512, n_embd=32, n_layer=2, n_head=2)).eval()
    with torch.no_grad():
        for p in oracle.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    return oracle, noisy_copy(oracle, 1.0, 5)


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def settled(count, want, seconds: float = 2.0) -> int:
    """`count()` once it equals `want` (threads exit a moment after they are told to), or its last value."""
    end = time.monotonic() + seconds
    while (now := count()) != want and time.monotonic() < end:
        time.sleep(0.01)
    return now
