class SpecError(Exception):
    """An error the user can act on: the CLI prints its message as one line, without a traceback."""


class OutOfMemory(SpecError):
    """The device ran out of memory: a server answers 503 with the message and keeps serving."""


class PromptTooLong(SpecError):
    """The prompt leaves no room for a new token in the context window: a server answers 400."""


def check_room(prompt_tokens: int, context: int, model: str = "oracle") -> None:
    """PromptTooLong unless a prompt of `prompt_tokens` leaves room for a new token in the `model`'s `context`."""
    if prompt_tokens >= context:
        raise PromptTooLong(f"the prompt is {prompt_tokens} tokens, but the {model}'s context window is {context} "
                            "tokens (it must leave room for at least one new token)")
