"""LLM.chat()'s conversations as prompts: each rendered with the tokenizer's chat template (or
the one given), then tokenized without adding special tokens (the rendered text has its own)."""

from transformers import PreTrainedTokenizerBase


def render_conversations(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict] | list[list[dict]],
    chat_template: str | None,
    add_generation_prompt: bool,
    chat_template_kwargs: dict | None,
) -> list[dict]:
    """One conversation or a list -> a TokensPrompt dict each, its text kept."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError(
            "messages must be a conversation (a list of {'role', 'content'} "
            "dicts) or a list of conversations"
        )
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise TypeError(
            f"chat_template_kwargs must be a dict of template variables (e.g. "
            f"{{'enable_thinking': False}}), got {type(chat_template_kwargs).__name__}"
        )
    conversations = [messages] if isinstance(messages[0], dict) else messages
    prompts = []
    for conversation in conversations:
        text = tokenizer.apply_chat_template(
            conversation,
            chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **(chat_template_kwargs or {}),
        )
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        prompts.append({"prompt": text, "prompt_token_ids": token_ids})
    return prompts
