"""A chat reply on screen: streamed like `spec generate`, holding back what may not stay in the reply."""

from __future__ import annotations

from spec_cli.view import TokenView


class ReplyView(TokenView):
    """A TokenView for one reply: leading and trailing whitespace are held back, and so is anything that
    may be the start of the stop marker (the next "User:" turn), so what is shown is what is kept."""

    def __init__(self, tokenizer, prompt: list[int], stop: str | None, stream=None, color: bool | None = None,
                 trace: bool = False):
        super().__init__(tokenizer, prompt, stream=stream, color=color, trace=trace, stops=[stop] if stop else (),
                         strip=True)
        self.screen.start()

    @property
    def reply(self) -> str:
        """The reply as the conversation keeps it: up to the stop marker, stripped."""
        return self.completion.strip()
