"""Secret masking: URL passwords and the values of secret-looking environment variables never reach the run
directory, the loggers or the checkpoints."""

from __future__ import annotations

import os
import re

# A password in a URL (postgresql://user:PASSWORD@host/db) and values of secret-looking environment variables.
_URL_PASSWORD = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]+):(?P<password>[^@\s/]+)@")
_SECRET_ENV = re.compile(r"(API_KEY|TOKEN|PASSWORD|SECRET|ACCESS_KEY)$", re.IGNORECASE)


def redact_values(value):
    """`value` (a string, or dicts, lists and tuples of them) with `redact_secrets` applied to every string."""
    if isinstance(value, str):
        return redact_secrets(value)
    if isinstance(value, dict):
        return {k: redact_values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_values(v) for v in value)
    return value


def redact_secrets(text: str) -> str:
    """`text` with URL passwords and the values of secret environment variables (WANDB_API_KEY...) masked."""
    text = _URL_PASSWORD.sub(lambda m: f"{m['scheme']}:***@", text)
    for name, value in os.environ.items():
        if _SECRET_ENV.search(name) and len(value) >= 6:
            text = text.replace(value, f"<{name}>")
    return text
