"""The names of a base model's tokenizer files, as the server publishes them.

A worker copies these files of each model it serves to the artifact store; the API lists and
serves them at `/api/v1/models/{model}/tokenizer`; the client fetches the ones it reads. Other
files in a model's folder (weights, configs) are never published.
"""

TOKENIZER_FILE = "tokenizer.json"
"""The fast tokenizer itself: every served model publishes it."""

CONFIG_FILE = "tokenizer_config.json"
"""Special tokens and, usually, the chat template."""

TEMPLATE_FILE = "chat_template.jinja"
"""The chat template, where a model keeps it outside `CONFIG_FILE`."""

TOKENIZER_FILES = frozenset(
    {
        TOKENIZER_FILE,
        CONFIG_FILE,
        TEMPLATE_FILE,
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "merges.txt",
        "tokenizer.model",
        "chat_template.json",
    }
)
"""Every file name a worker publishes from a model's tokenizer folder."""
